"""The engine process's protocol (engine_process.py) against a fake engine in a real spawned process: streaming,
abort, calls, failures at admission and at startup, the engine process killed, the serving process killed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from minedraft.engine.engine_process import EngineProcess
from minedraft.engine.requests import EngineDeadError, OutputDelta, RequestError, SamplingSettings
from minedraft.engine.settings import SettingsError

from . import engine_process_fakes as fakes


async def start(factory=fakes.FakeEngine) -> EngineProcess:
    return await EngineProcess.create(fakes.fake_settings(), factory=factory, tokenizer_loader=lambda settings: None)


async def collect(stream) -> list[OutputDelta]:
    return [delta async for delta in stream]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


async def test_streams_aborts_and_calls_cross_the_process_and_shutdown_ends_it():
    engine = await start()
    try:
        assert engine.pid != os.getpid() and await engine.call(fakes.pid) == engine.pid
        assert (engine.vocab_size, engine.max_model_len, engine.settings.model) == (100, 64, "fake-target")
        # A Ctrl-C or SIGTERM sent to the whole process group is the serving process's to act on (a graceful drain).
        os.kill(engine.pid, signal.SIGINT)
        os.kill(engine.pid, signal.SIGTERM)
        assert await engine.call(fakes.pid) == engine.pid and engine.process.is_alive()
        # Concurrent streams each get their own deltas, in order, ending with the final one.
        first, second = await asyncio.gather(collect(engine.generate([1, 2, 3], SamplingSettings(max_tokens=5))),
                                             collect(engine.generate([4], SamplingSettings(max_tokens=3))))
        assert [d.token_ids for d in first] == [[1], [2], [3], [4], [5]] and first[-1].finish_reason == "length"
        assert [d.token_ids for d in second] == [[1], [2], [3]] and second[-1].finish_reason == "length"
        assert "".join(d.text for d in first) == "t1t2t3t4t5"

        # abort(): the stream ends with reason "abort" and the request is gone from the engine.
        stream = engine.generate([1], SamplingSettings(max_tokens=10_000), request_id="long")
        assert (await anext(stream)).token_ids == [1]
        await engine.abort("long")
        rest = await collect(stream)
        assert rest[-1].finish_reason == "abort"
        assert "long" in await engine.call(fakes.aborted) and await engine.call(fakes.in_flight) == []

        # Closing a stream early (a client gone) aborts its request in the engine.
        stream = engine.generate([1], SamplingSettings(max_tokens=10_000), request_id="closed")
        await anext(stream)
        await stream.aclose()
        assert "closed" in await engine.call(fakes.aborted)

        # Checks before the engine: the prompt in the front end; a refusal at admission comes back as raised there.
        with pytest.raises(RequestError) as invalid:
            await collect(engine.generate([100], SamplingSettings(max_tokens=5)))
        assert invalid.value.field_name == "prompt_token_ids"
        with pytest.raises(RequestError) as refused:
            await collect(engine.generate([1], SamplingSettings(max_tokens=fakes.REFUSED_MAX_TOKENS)))
        assert refused.value.field_name == "max_tokens" and "refused by the fake engine" in str(refused.value)
        # A call that cannot cross (a lambda) fails by itself; the engine carries on.
        with pytest.raises(Exception, match="pickle"):
            await engine.call(lambda e: e.steps)
        assert await engine.call(partial(fakes.steps)) > 0
        # A caller cancelled while its call runs (a metrics poll when the server stops) leaves the engine running.
        waiting = asyncio.ensure_future(engine.call(fakes.slow_pid))
        await asyncio.sleep(0.1)
        waiting.cancel()
        assert await engine.call(fakes.pid) == engine.pid and engine.dead_error is None
        assert engine.num_in_flight == 0 and engine.dead_error is None

        # Shutdown: a stream in flight ends with EngineDeadError; the process exits; nothing more is accepted.
        stream = engine.generate([1], SamplingSettings(max_tokens=10_000))
        await anext(stream)
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await collect(stream)
        assert engine.process.exitcode == 0
        with pytest.raises(EngineDeadError):
            await engine.call(fakes.steps)
    finally:
        if engine.process.is_alive():
            engine.process.kill()


async def test_engine_process_killed_ends_every_stream_with_engine_dead():
    engine = await start()
    try:
        streams = [engine.generate([1], SamplingSettings(max_tokens=10_000)) for _ in range(3)]
        for stream in streams:
            await anext(stream)
        os.kill(engine.pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(EngineDeadError, match="exit code -9"):
                await collect(stream)
        assert isinstance(engine.dead_error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await engine.call(fakes.steps)
        with pytest.raises(EngineDeadError):
            await collect(engine.generate([1], SamplingSettings(max_tokens=5)))
        assert engine.num_in_flight == 0
        await engine.shutdown()
    finally:
        if engine.process.is_alive():
            engine.process.kill()


async def test_a_startup_refusal_is_raised_as_the_in_process_engine_raises_it():
    with pytest.raises(SettingsError) as refused:
        await start(fakes.refusing_engine)
    assert refused.value.field_name == "max_model_len"
    assert str(refused.value) == "max_model_len: the fake engine refuses these settings"


SERVING_PROCESS = """
import asyncio, sys
from minedraft.engine.engine_process import EngineProcess
from tests.unit import engine_process_fakes as fakes

async def main():
    engine = await EngineProcess.create(fakes.fake_settings(), factory=fakes.FakeEngine,
                                        tokenizer_loader=lambda settings: None)
    print(engine.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_the_engine_process_does_not_outlive_its_serving_process():
    root = Path(__file__).resolve().parents[2]
    serving = subprocess.Popen([sys.executable, "-c", SERVING_PROCESS], cwd=root, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
                                   str(root), os.environ.get("PYTHONPATH"))))})
    engine_pid = 0
    try:
        assert serving.stdout is not None
        engine_pid = int(serving.stdout.readline())
        assert not _gone(engine_pid)
        serving.kill()  # no shutdown, no atexit: only the pipe's EOF tells the engine process
        serving.wait()
        waited_s = 0.0
        while not _gone(engine_pid) and waited_s < 60:  # a bound on a hang, not a timing assertion
            time.sleep(0.1)
            waited_s += 0.1
        assert _gone(engine_pid), "the engine process outlived its serving process"
    finally:
        serving.kill()
        if engine_pid and not _gone(engine_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_pid, signal.SIGKILL)


async def test_text_and_stop_strings_are_made_in_the_front_end_as_the_engine_makes_them():
    """With the tokenizer, the front end asks the engine for token ids only and detokenises them itself (vLLM's own
    incremental detokenizer): the text of a stream is its tokens' text; a stop string cuts the text before it and the
    token ids after the one that completed it, ends the stream with "stop" and aborts the request in the engine."""
    from minedraft.engine.engine_process import load_tokenizer

    pair = Path(__file__).resolve().parents[2] / "minedraft" / "models" / "data" / "pair-v1"
    tokenizer = load_tokenizer(fakes.fake_settings().with_changes(model=str(pair / "target")))
    text = "def area(radius):\n    return 3.14159 * radius ** 2  # STOP here, and never this tail\n"
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    engine = await EngineProcess.create(fakes.fake_settings(), factory=fakes.ParrotEngine,
                                        tokenizer_loader=lambda settings: tokenizer)
    try:
        whole = await collect(engine.generate(ids, SamplingSettings(max_tokens=500), request_id="whole"))
        assert "".join(d.text for d in whole) == tokenizer.decode(ids)
        assert [t for d in whole for t in d.token_ids] == ids and whole[-1].finish_reason == "length"

        cut = await collect(engine.generate(ids, SamplingSettings(max_tokens=500, stop=("STOP",)), request_id="cut"))
        streamed = "".join(d.text for d in cut)
        assert streamed == tokenizer.decode(ids).split("STOP")[0]
        assert all("ST" not in d.text for d in cut), "a possible stop string's start is held back until it settles"
        tokens = [t for d in cut for t in d.token_ids]
        assert tokens == ids[:len(tokens)] and "STOP" in tokenizer.decode(tokens)
        assert "STOP" not in tokenizer.decode(tokens[:-1]), "tokens past the one completing the stop string are cut"
        assert cut[-1].finish_reason == "stop" and cut[-1].num_output_tokens == len(tokens)
        assert "cut" in await engine.call(fakes.aborted), "the front end aborts it in the engine"
        assert "whole" not in await engine.call(fakes.aborted)
        assert await engine.call(fakes.detokenize_flags) == {"whole": False, "cut": False}
    finally:
        await engine.shutdown()


class _IdleProcess:
    """The engine process's handle for a front end whose pipe's far end is the test's."""

    pid = None
    exitcode = 0

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def kill(self) -> None:
        pass


async def test_a_blocked_write_to_the_engine_process_never_blocks_the_event_loop_and_commands_keep_their_order():
    """The engine process reads nothing for a while (its reader held off by a step) and a prompt of megabytes
    fills the pipe: the write waits off the event loop, which keeps serving; the commands arrive in order."""
    import multiprocessing
    import threading

    from minedraft.engine.engine_process import EngineFacts

    ours, theirs = multiprocessing.Pipe(duplex=True)
    facts = EngineFacts(fakes.fake_settings(), vocab_size=100, max_model_len=2_000_000, startup_seconds=0.0)
    engine = EngineProcess(_IdleProcess(), ours, facts, tokenizer=None)  # type: ignore[arg-type]
    received: list[tuple] = []

    def engine_process_reads_late() -> None:
        time.sleep(1.5)
        for _ in range(3):
            received.append(theirs.recv())

    reader = threading.Thread(target=engine_process_reads_late, daemon=True)
    reader.start()
    loop = asyncio.get_running_loop()
    gaps: list[float] = []

    async def ticker() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - last)
            last = loop.time()

    ticking = asyncio.create_task(ticker())
    tasks: list[asyncio.Task] = []
    try:
        big = engine.generate([1] * 1_000_000, SamplingSettings(max_tokens=1), request_id="big")  # ~2 MB pickled
        tasks.append(asyncio.create_task(anext(big)))
        await asyncio.sleep(0.05)
        await engine.abort("big")
        tasks.append(asyncio.create_task(engine.call(fakes.pid)))
        await asyncio.to_thread(reader.join, 10)
        assert max(gaps) < 0.5, f"the event loop stalled {max(gaps):.2f} s on a write to the engine process"
        assert [m[0] for m in received] == ["add", "abort", "call"]
        assert received[0][1] == "big" and len(received[0][2]) == 1_000_000
    finally:
        ticking.cancel()
        theirs.close()  # EOF: the front end ends what waits
        for task in tasks:
            with contextlib.suppress(EngineDeadError):
                await task
        await asyncio.to_thread(engine._sender.join, 5)
        assert not engine._sender.is_alive()  # the link ended (EOF): the sender thread went with it
        await engine.shutdown()
