"""The engine core in a process of its own: `EngineProcess` is AsyncEngine's face over a spawned engine process.

Why: in one process the gRPC and HTTP servers, tokenisation and the engine's step loop share one GIL, so every
server action delays the next step (on a GPU, host time between steps is GPU idle time). vLLM's own async front end
runs its engine core in a separate process for the same reason. Here the serving process keeps the servers and the
tokenizer (prompts are encoded and checked before anything crosses); the engine process runs `Engine` and the same
loop AsyncEngine's thread runs: commands between steps, then a step.

What runs where:
- serving process: gRPC, HTTP, metrics export, prompt encoding and its checks (`encode_prompt`), detokenisation and
  stop strings (detokenize.py: vLLM's own incremental detokenizer per stream; a stop string aborts the request in the
  engine, as vLLM's output processor does), this front end and one reader thread that turns the engine process's
  messages into stream deltas and call results.
- engine process: `Engine` (vLLM's engine core in-process, our scheduler, the drafter's client) with requests added
  with detokenize=False (token ids only), the step loop and one reader thread that queues the commands arriving from
  the pipe (so a long step never leaves the serving process blocked on a full pipe) and notices the serving process's
  end (EOF).

The link is a multiprocessing Pipe (a Unix socket pair) from the "spawn" context: exactly one peer, ordered, with
pickling built in, no address, port or file to manage, and the peer's death seen as EOF on both sides, which is all
the lifecycle needs (a dead engine process ends every stream; a dead serving process makes the engine exit). ZMQ
would add sockets and addresses and still need the EOF watch. Spawn, not fork: the serving process already runs
gRPC's and the metrics server's threads, and a forked child inherits their locks in whatever state they were.

Messages: commands one way (add, abort, call, stop); the other way ONE message per loop turn carrying that turn's
events (every delta of the step, failed admissions, abort notices), call results in messages of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

from minedraft.engine.detokenize import StreamDetokenizer
from minedraft.engine.loop import run_steps
from minedraft.engine.requests import EngineDeadError, OutputDelta, RequestError, SamplingSettings, encode_prompt
from minedraft.engine.settings import EngineSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long the engine process may take to shut down cleanly once its serving process is gone before it exits anyway
# (a step stuck in a kernel would otherwise keep it, and the accelerator, forever).
ORPHAN_GRACE_S = 20.0
# How long shutdown() waits for the engine process to exit before killing it.
SHUTDOWN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EngineFacts:
    """What the servers read off the engine, fixed once it is loaded (sent once, in the ready message)."""

    settings: EngineSettings
    vocab_size: int
    max_model_len: int
    startup_seconds: float


def engine_facts(engine: Any) -> EngineFacts:
    return EngineFacts(engine.settings, int(engine.vocab_size), int(engine.max_model_len),
                       float(getattr(engine, "startup_seconds", 0.0)))


def load_tokenizer(settings: EngineSettings) -> Any:
    """The target's tokenizer, loaded as vLLM loads it for the engine (same name, mode, revision and trust)."""
    from vllm.tokenizers import get_tokenizer

    extra = settings.extra_vllm_args
    return get_tokenizer(extra.get("tokenizer") or settings.model,
                         tokenizer_mode=extra.get("tokenizer_mode", "auto"),
                         trust_remote_code=bool(extra.get("trust_remote_code", False)),
                         revision=extra.get("tokenizer_revision"))


# -- messages ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Failed:
    """A request the engine refused at admission (vLLM's own validation)."""

    request_id: str
    error: BaseException


def _portable(error: BaseException) -> BaseException:
    """The error itself if it survives the pipe (pickles and unpickles), else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


# -- the engine process ------------------------------------------------------------------------------------------


def _read_commands(conn: Connection, commands: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    """Engine process: queue what the serving process sends; at EOF (it exited or died) stop, and exit regardless
    after a grace period."""
    try:
        while True:
            commands.put(conn.recv())
    except (EOFError, OSError):
        pass
    commands.put(("stop", "the serving process is gone"))

    def exit_if_still_here() -> None:
        time.sleep(ORPHAN_GRACE_S)
        log.error("engine process: still running %.0f s after its serving process ended: exiting", ORPHAN_GRACE_S)
        os._exit(1)

    threading.Thread(target=exit_if_still_here, name="minedraft-orphan-exit", daemon=True).start()


def _leave_to_the_serving_process(signum: int, frame: Any) -> None:
    log.info("engine process: %s left to the serving process (it stops this one)", signal.Signals(signum).name)


def engine_process_main(conn: Connection, factory: Callable[[EngineSettings], Any], settings: EngineSettings,
                        wait_for_drafter: bool, log_level: int) -> None:
    """The engine process's entry point: build the engine, say ready (or why not), run the loop."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine process] %(message)s")
    # The serving process owns this one's lifecycle (stop, EOF, SIGKILL past the shutdown timeout): a Ctrl-C or a
    # SIGTERM sent to the whole process group must start its graceful drain, not end the engine under open streams.
    # A handler rather than SIG_IGN: ignored signals stay ignored in processes this one starts (the drafter, vLLM's
    # workers), handled ones go back to their defaults there.
    signal.signal(signal.SIGINT, _leave_to_the_serving_process)
    signal.signal(signal.SIGTERM, _leave_to_the_serving_process)
    commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    # Reading starts before the (long) load so that the serving process's end is noticed during it too.
    threading.Thread(target=_read_commands, args=(conn, commands), name="minedraft-engine-commands",
                     daemon=True).start()
    try:
        engine = factory(settings)
        if wait_for_drafter:
            engine.wait_for_drafter()
    except BaseException as exc:
        log.exception("engine failed to start")
        _send_quietly(conn, ("error", _portable(exc)))
        return
    try:
        conn.send(("ready", engine_facts(engine)))
        _serve(engine, conn, commands)
    finally:
        try:
            engine.shutdown()
        finally:
            conn.close()


def _send_quietly(conn: Connection, message: tuple[Any, ...]) -> None:
    with contextlib.suppress(OSError):  # the serving process is gone: nobody to tell
        conn.send(message)


def _serve(engine: Any, conn: Connection, commands: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    """The step loop (engine/loop.py, as AsyncEngine runs it, over a pipe): every queued command, then one step; one
    message per turn with the deltas of the step and the commands' own (failed adds, aborts)."""
    events: list[OutputDelta | _Failed] = []

    def handle(command: tuple[Any, ...]) -> bool:
        if command[0] == "stop":
            log.info("engine process stopping: %s", command[1])
            return False
        _handle(engine, conn, command, events)
        return True

    def publish(deltas: list[OutputDelta]) -> None:
        events.extend(deltas)
        if events:
            conn.send(("events", list(events)))
            events.clear()

    try:
        run_steps(engine, commands, handle, publish)
    except (EOFError, BrokenPipeError):
        log.warning("engine process: the serving process is gone")
    except BaseException as exc:
        log.exception("engine loop died")
        _send_quietly(conn, ("dead", _portable(exc)))


def _handle(engine: Any, conn: Connection, command: tuple[Any, ...], events: list[OutputDelta | _Failed]) -> None:
    kind = command[0]
    if kind == "add":
        _, request_id, token_ids, sampling, detokenize = command
        try:
            if detokenize:
                engine.add_request(request_id, token_ids, sampling)
            else:  # the front end detokenises and matches stop strings
                engine.add_request(request_id, token_ids, sampling, detokenize=False)
        except Exception as exc:  # vLLM's own validation: fail this request, not the engine
            events.append(_Failed(request_id, exc if isinstance(exc, RequestError) else RequestError("request",
                                                                                                     str(exc))))
    elif kind == "abort":
        _, request_id, notify = command
        engine.abort([request_id])
        if notify:
            # vLLM's synchronous engine emits no output for an aborted request: end the caller's stream ourselves.
            events.append(OutputDelta(request_id, [], "", finish_reason="abort"))
    elif kind == "call":
        _, call_id, fn = command
        try:
            result: tuple[Any, ...] = ("call", call_id, True, fn(engine))
        except Exception as exc:
            result = ("call", call_id, False, _portable(exc))
        try:
            conn.send(result)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # pickling fails before anything is written
            conn.send(("call", call_id, False, TypeError(f"engine.call: the result cannot cross to the serving "
                                                         f"process: {exc}")))
    else:
        raise ValueError(f"unknown engine command {kind!r}")


# -- the serving process's side ----------------------------------------------------------------------------------


class _Stream:
    """One generate() in flight: where its deltas go (its event loop and queue)."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[OutputDelta | BaseException] = asyncio.Queue()


class EngineProcess:
    """AsyncEngine's public interface over an engine in a process of its own (see the module's docstring)."""

    in_process = False

    def __init__(self, process: BaseProcess, conn: Connection, facts: EngineFacts, tokenizer: Any) -> None:
        self.process = process
        self._conn = conn
        self.settings = facts.settings
        self.vocab_size = facts.vocab_size
        self.max_model_len = facts.max_model_len
        self.startup_seconds = facts.startup_seconds
        self.tokenizer = tokenizer
        self._lock = threading.Lock()  # guards _streams, _calls, _closed and the order of commands
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._closed = False
        self._stopping = False
        self._dead: BaseException | None = None
        self._finished = False
        self._reader = threading.Thread(target=self._read, name="minedraft-engine-reader", daemon=True)
        self._reader.start()
        # Commands, pickled, in the order they were made; one sender thread writes them to the pipe. A write blocks
        # while the engine process reads nothing (its reader thread held off the GIL by a step; a prompt of
        # megabytes fills the socket's buffer): on the event loop it would stall every stream of this process.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send, name="minedraft-engine-sender", daemon=True)
        self._sender.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @classmethod
    async def create(cls, settings: EngineSettings, wait_for_drafter: bool = True,
                     factory: Callable[[EngineSettings], Any] | None = None,
                     tokenizer_loader: Callable[[EngineSettings], Any] = load_tokenizer) -> EngineProcess:
        """Start the engine process and wait until its engine is ready; its startup errors are raised here, as the
        in-process Engine(settings) raises them. `factory` (a picklable callable, default Engine) builds the engine
        in the engine process; the tokenizer loads here meanwhile."""
        if factory is None:
            from minedraft.engine.core import Engine

            factory = Engine
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe(duplex=True)
        # Not a daemon: the engine starts processes of its own (the drafter, tensor-parallel workers). It exits with
        # this process anyway: it watches the pipe for EOF.
        process = context.Process(target=engine_process_main, name="minedraft-engine",
                                  args=(child_conn, factory, settings, wait_for_drafter,
                                        logging.getLogger().getEffectiveLevel()))
        process.start()
        child_conn.close()
        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(tokenizer_loader, settings))
        try:
            message = await asyncio.to_thread(_wait_ready, parent_conn, process)
        except BaseException:
            await asyncio.to_thread(_stop_process, process, parent_conn, 10.0)
            tokenizer_task.cancel()
            raise
        try:
            tokenizer = await tokenizer_task
        except BaseException:
            await asyncio.to_thread(_stop_process, process, parent_conn, SHUTDOWN_TIMEOUT_S)
            raise
        return cls(process, parent_conn, message, tokenizer)

    # -- public API (AsyncEngine's) ----------------------------------------------------------------------------

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
        token_ids = encode_prompt(self.tokenizer, prompt, self.vocab_size, self.max_model_len)
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = _Stream(asyncio.get_running_loop())
        # Text is made here, off the engine's GIL, when this front end has the tokenizer (see detokenize.py).
        detokenizer = (StreamDetokenizer(self.tokenizer, request_id, token_ids, sampling)
                       if self.tokenizer is not None else None)
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"engine is not running: {self._dead or 'shut down'}")
            if request_id in self._streams:
                raise RequestError("request_id", f"{request_id!r} is already in flight")
            self._streams[request_id] = stream
            self._send_locked(("add", request_id, token_ids, sampling, detokenizer is None))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if detokenizer is not None:
                    item, stopped_here = detokenizer.apply(item)
                    if stopped_here:  # a stop string: the engine still runs the request
                        self._abort_quietly(request_id)
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
                if not finished and not self._closed:
                    with contextlib.suppress(EngineDeadError):
                        self._send_locked(("abort", request_id, False))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a final delta whose finish reason is "abort"."""
        with self._lock:
            if not self._closed:
                with contextlib.suppress(EngineDeadError):  # gone: its streams end with EngineDeadError anyway
                    self._send_locked(("abort", request_id, True))

    def _abort_quietly(self, request_id: str) -> None:
        """Abort a request in the engine without a final delta (its stream has ended here already)."""
        with self._lock:
            self._streams.pop(request_id, None)
            if not self._closed:
                with contextlib.suppress(EngineDeadError):
                    self._send_locked(("abort", request_id, False))

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run fn(engine) in the engine process between steps. fn must pickle (a module-level function, or a
        functools.partial of one) and so must its result."""
        future: Future[T] = Future()
        # Running from the start: a caller cancelled meanwhile (a task stopped while it waits) cannot cancel this
        # future under the reader thread, which sets its result whenever the engine answers.
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"engine is not running: {self._dead or 'shut down'}")
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            try:
                self._send_locked(("call", call_id, fn))
            except BaseException:
                self._calls.pop(call_id, None)
                raise
        return await asyncio.wrap_future(future)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    async def shutdown(self, shutdown_engine: bool = True) -> None:
        """Stop the engine process (requests in flight end with EngineDeadError): ask, wait, kill if it must.
        The engine always goes with its process: `shutdown_engine` is accepted for AsyncEngine's signature."""
        self._stopping = True
        with self._lock:
            if not self._closed:
                with contextlib.suppress(EngineDeadError):
                    self._send_locked(("stop", "shutdown"))
            self._outbox.put(None)  # the sender ends once what is queued is written
        await asyncio.to_thread(_stop_process, self.process, None, SHUTDOWN_TIMEOUT_S)
        await asyncio.to_thread(self._reader.join, 10.0)
        await asyncio.to_thread(self._sender.join, 10.0)
        self._conn.close()

    # -- internals ---------------------------------------------------------------------------------------------

    def _send_locked(self, message: tuple[Any, ...]) -> None:
        """Queue a command for the engine process (under self._lock: commands leave in the order they are made).
        Pickled here, so a command that cannot cross fails its caller as Connection.send would; written by the
        sender thread, never on the caller's event loop."""
        if self._closed:
            raise EngineDeadError(f"engine is not running: {self._dead or 'shut down'}")
        self._outbox.put(bytes(ForkingPickler.dumps(message)))

    def _send(self) -> None:
        """Sender thread: write each queued command (Connection.send's framing: the reader's recv() takes them)."""
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as exc:  # the engine process is gone, or the pipe closed
                if self._dead is None and not self._stopping:
                    self._dead = EngineDeadError(f"cannot write to the engine process: {exc}")
                self._finish()  # what waits on a command that never arrives ends now
                return

    def _read(self) -> None:
        """Reader thread: deliver each message's deltas (one wake-up per event loop), resolve calls; at EOF the
        engine process is gone: end everything."""
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "events":
                    self._deliver(message[1])
                elif kind == "call":
                    _, call_id, ok, value = message
                    with self._lock:
                        future = self._calls.pop(call_id, None)
                    if future is not None:
                        if ok:
                            future.set_result(value)
                        else:
                            future.set_exception(value)
                elif kind == "dead":
                    self._dead = message[1]
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # an undecodable message: the link cannot be trusted any more
            log.exception("engine process link failed")
            self._dead = exc
        finally:
            self._finish()

    def _deliver(self, events: list[OutputDelta | _Failed]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, OutputDelta | BaseException]]] = {}
        with self._lock:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None:
                    continue
                if isinstance(event, _Failed):
                    del self._streams[event.request_id]
                    by_loop.setdefault(stream.loop, []).append((stream, event.error))
                else:
                    by_loop.setdefault(stream.loop, []).append((stream, event))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody is reading those streams
                loop.call_soon_threadsafe(_put_all, items)

    def _finish(self) -> None:
        with self._lock:  # the reader's EOF, or the sender's failed write: whichever comes first
            if self._finished:
                return
            self._finished = True
        if not self._stopping and self._dead is None:
            self.process.join(5.0)
            self._dead = EngineDeadError(f"engine process exited (exit code {self.process.exitcode})")
        if self._dead is not None and not self._stopping:
            log.error("engine process is not running: %s", self._dead)
        error = EngineDeadError(f"engine stopped: {self._dead or 'shutdown'}")
        with self._lock:
            self._closed = True
            streams = list(self._streams.values())
            self._streams.clear()
            calls = list(self._calls.values())
            self._calls.clear()
            self._outbox.put(None)  # nothing more is sent: the sender thread ends
        for stream in streams:
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        for future in calls:
            future.set_exception(error)


def _put_all(items: list[tuple[_Stream, OutputDelta | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _wait_ready(conn: Connection, process: BaseProcess) -> EngineFacts:
    """Wait for the engine process's first message: ready (its facts) or its startup error, raised here."""
    wait([conn, process.sentinel])
    message: tuple[Any, ...] | None = None
    if conn.poll(0):
        try:
            message = conn.recv()
        except EOFError:
            message = None
    if message is not None and message[0] == "ready":
        facts: EngineFacts = message[1]
        return facts
    process.join(30.0 if message is not None else 5.0)
    if message is not None and message[0] == "error":
        raise message[1]
    raise EngineDeadError(f"engine process exited while starting (exit code {process.exitcode})")


def _stop_process(process: BaseProcess, conn: Connection | None, timeout_s: float) -> None:
    """Join the engine process; past the timeout, kill it. `conn`: closed first (EOF asks the process to stop)."""
    if conn is not None:
        conn.close()
    process.join(timeout_s)
    if process.is_alive():
        log.warning("engine process did not exit within %.0f s: killing it", timeout_s)
        process.kill()
        process.join(10.0)
