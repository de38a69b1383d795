"""Asyncio face of the engine: `generate()` streams deltas, `abort()` cancels; one thread runs the step loop.

vLLM releases the GIL inside its kernels, so a dedicated thread keeps the event loop (gRPC, metrics) responsive
while the engine steps. All engine calls happen on that thread; the event loop only enqueues commands.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from minedraft.engine.core import Engine
from minedraft.engine.loop import run_steps
from minedraft.engine.requests import EngineDeadError, OutputDelta, RequestError, SamplingSettings
from minedraft.engine.settings import EngineSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSettings
    sink: Callable[[OutputDelta | BaseException], None]


@dataclass
class _Abort:
    request_id: str
    # vLLM's synchronous engine emits no output for an aborted request: end the caller's stream ourselves.
    notify: bool = False


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: Future[Any]


class AsyncEngine:
    """The engine driven from a thread of this process (`EngineProcess` is the same interface over a process)."""

    in_process = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.settings = engine.settings
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        # Written by the event loop (generate) and the engine thread (failures, shutdown): guarded.
        self._sinks: dict[str, Callable[[OutputDelta | BaseException], None]] = {}
        self._sinks_lock = threading.Lock()
        # Set (under the lock) when the engine thread exits: no sink registered after it would ever be served.
        self._closed = False
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="minedraft-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def create(cls, settings: EngineSettings, wait_for_drafter: bool = True) -> AsyncEngine:
        engine = await asyncio.to_thread(Engine, settings)
        if wait_for_drafter:
            await asyncio.to_thread(engine.wait_for_drafter)
        return cls(engine)

    # -- what the servers read (fixed once the engine is loaded; the same attributes as EngineProcess's) ---------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def startup_seconds(self) -> float:
        return self.engine.startup_seconds

    # -- public API --------------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingSettings,
        request_id: str | None = None,
    ) -> AsyncIterator[OutputDelta]:
        """Stream a request's output. Closing the iterator (or cancelling its task) aborts the request."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        sampling.validate()
        token_ids = self.engine.encode_prompt(prompt)
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[OutputDelta | BaseException] = asyncio.Queue()

        def sink(item: OutputDelta | BaseException) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, item)

        with self._sinks_lock:
            if self._closed:
                raise EngineDeadError(f"engine is not running: {self._dead or 'shut down'}")
            if request_id in self._sinks:
                raise RequestError("request_id", f"{request_id!r} is already in flight")
            self._sinks[request_id] = sink
        self._commands.put(_Add(request_id, token_ids, sampling, sink))
        finished = False
        try:
            while True:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            with self._sinks_lock:
                self._sinks.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a final delta whose finish reason is "abort"."""
        self._commands.put(_Abort(request_id, notify=True))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread between steps (mode switches, consistent reads)."""
        future: Future[T] = Future()
        with self._sinks_lock:
            if self._closed:
                raise EngineDeadError(f"engine is not running: {self._dead or 'shut down'}")
            self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    async def shutdown(self, shutdown_engine: bool = True) -> None:
        """Stop the step loop (requests in flight end with EngineDeadError) and, by default, the engine."""
        self._stopping = True
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 60)
        if shutdown_engine:
            await asyncio.to_thread(self.engine.shutdown)

    # -- engine thread -----------------------------------------------------------------------------------------

    def _handle(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.sampling)
            except Exception as exc:  # vLLM's own validation: fail this request, not the engine
                with self._sinks_lock:
                    if self._sinks.get(command.request_id) is command.sink:
                        del self._sinks[command.request_id]
                command.sink(exc if isinstance(exc, RequestError) else RequestError("request", str(exc)))
        elif isinstance(command, _Abort):
            self.engine.abort([command.request_id])
            if command.notify:
                with self._sinks_lock:
                    sink = self._sinks.get(command.request_id)
                if sink is not None:
                    sink(OutputDelta(command.request_id, [], "", finish_reason="abort"))
        else:
            if not command.future.set_running_or_notify_cancel():
                return  # its caller was cancelled while it waited: nothing to run, nobody to answer
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as exc:
                command.future.set_exception(exc)

    def _handled(self, command: _Add | _Abort | _Call | None) -> bool:
        if command is not None:  # (None only wakes the loop: shutdown)
            self._handle(command)
        return True

    def _publish(self, deltas: list[OutputDelta]) -> None:
        for delta in deltas:
            with self._sinks_lock:
                sink = self._sinks.get(delta.request_id)
            if sink is not None:
                sink(delta)

    def _run(self) -> None:
        try:
            run_steps(self.engine, self._commands, self._handled, self._publish, idle_wait_seconds=0.1,
                      stopping=lambda: self._stopping)
        except BaseException as exc:
            log.exception("engine loop died")
            self._dead = exc
        finally:
            error = EngineDeadError(f"engine stopped: {self._dead or 'shutdown'}")
            with self._sinks_lock:
                self._closed = True
                sinks = list(self._sinks.values())
                self._sinks.clear()
            for sink in sinks:
                sink(error)
            # Commands that will never run: fail waiting callers rather than leave them hanging.
            while True:
                try:
                    pending = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(pending, _Call):
                    pending.future.set_exception(error)
                elif isinstance(pending, _Add):
                    pending.sink(error)
