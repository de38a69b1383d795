"""One benchmark engine in a process of its own, so each gets its own cores; driven over a pipe by the runner."""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import asdict
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from minedraft.bench.workload import Workload, result_to_dict, run_workload
from minedraft.engine.settings import EngineSettings, Mode


def worker_main(settings: EngineSettings, conn: Connection) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s bench-worker %(levelname)s %(message)s")
    asyncio.run(_serve(settings, conn))


async def _serve(settings: EngineSettings, conn: Connection) -> None:
    from minedraft.engine.async_engine import AsyncEngine

    engine = await AsyncEngine.create(settings)
    conn.send(("ready", engine.engine.startup_seconds))
    try:
        while True:
            command: tuple[Any, ...] = await asyncio.to_thread(conn.recv)
            if command[0] == "stop":
                break
            _, mode_name, workload = command
            assert isinstance(workload, Workload)
            mode = Mode(mode_name)
            if engine.engine.psd_scheduler is not None:
                await engine.call(partial(_set_mode, mode=mode))
            before = engine.engine.totals()
            results, makespan = await run_workload(engine, workload)
            # Counts pooled over the whole run (the step-record ring buffer may hold only its tail).
            totals = engine.engine.totals() - before
            conn.send(("result", [result_to_dict(r) for r in results], makespan, asdict(totals)))
    finally:
        await engine.shutdown()
        conn.close()


def _set_mode(engine: Any, mode: Mode) -> None:
    engine.set_mode(mode)
