"""One benchmark engine in a process of its own, so each gets its own cores; driven over a pipe by the runner."""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import asdict
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from minedraft.bench.workload import Trace, Workload, result_to_dict, run_trace, run_workload
from minedraft.engine.control.auto import Decision
from minedraft.engine.settings import EngineSettings, Mode


def worker_main(settings: EngineSettings, conn: Connection) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s bench-worker %(levelname)s %(message)s")
    asyncio.run(_serve(settings, conn))


async def _serve(settings: EngineSettings, conn: Connection) -> None:
    from minedraft.engine import calls
    from minedraft.engine.async_engine import AsyncEngine

    engine = await AsyncEngine.create(settings)
    conn.send(("ready", engine.startup_seconds))
    try:
        while True:
            command: tuple[Any, ...] = await asyncio.to_thread(conn.recv)
            if command[0] == "stop":
                break
            if command[0] == "predict":
                predictions = await engine.call(partial(_predict, concurrencies=command[1], k=command[2]))
                conn.send(("predictions", predictions))
                continue
            _, mode_name, workload = command
            assert isinstance(workload, Workload | Trace)
            mode = Mode(mode_name)
            if await engine.call(calls.switchable):
                # Fixed modes at the configured k (auto may have left another); auto resumes its last choice.
                k = None if mode is Mode.AUTO else settings.num_speculative_tokens
                await engine.call(partial(_set_mode, mode=mode, k=k))
            before = await engine.call(calls.totals)
            records = await engine.call(calls.step_records)
            first_step = records[-1].step if records else 0
            if isinstance(workload, Trace):
                results, makespan = await run_trace(engine, workload)
            else:
                results, makespan = await run_workload(engine, workload)
            # Counts pooled over the whole run (the step-record ring buffer may hold only its tail).
            totals = await engine.call(calls.totals) - before
            tokens_by_mode: dict[str, int] = {}
            for record in await engine.call(partial(calls.step_records, since_step=first_step)):
                key = record.mode if record.mode == "ar" else f"{record.mode} k={record.k}"
                tokens_by_mode[key] = tokens_by_mode.get(key, 0) + record.num_output_tokens
            decisions = [_decision_summary(d) for d in await engine.call(calls.auto_decisions) if d.step > first_step]
            conn.send(("result", [result_to_dict(r) for r in results], makespan, asdict(totals), tokens_by_mode,
                       decisions))
    finally:
        await engine.shutdown()
        conn.close()


def _decision_summary(decision: Decision) -> dict[str, Any]:
    """What auto chose and why, without the full prediction table."""
    return {"step": decision.step, "kind": decision.kind, "from": f"{decision.previous_mode} k={decision.previous_k}",
            "to": f"{decision.mode} k={decision.k}", "num_running": round(decision.num_running, 1),
            "predicted_tokens_per_s": round(decision.predicted_tokens_per_second, 1),
            "previous_predicted_tokens_per_s": round(decision.previous_predicted_tokens_per_second, 1),
            "measured_tokens_per_s": round(decision.measured_tokens_per_second, 1), "reason": decision.reason}


def _set_mode(engine: Any, mode: Mode, k: int | None) -> None:
    engine.set_mode(mode, k)


def _predict(engine: Any, concurrencies: list[int], k: int) -> dict[int, list[dict[str, Any]]]:
    """The cost model's predicted tokens/s per mode at each load (ar, and sd/psd at draft length k)."""
    return {c: [asdict(p) for p in engine.predictions(c, (k,))] for c in concurrencies}
