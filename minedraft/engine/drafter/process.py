"""The drafter process: on its own device, drafting greedily with the backend backends.py picks (vLLM or torch).

Each job carries, per request, only the tokens committed since the previous job (DrafterServer keeps the rest).
The vLLM backend still re-admits each request per job (vLLM's engine cannot append tokens to a live request, so a
request cannot stay resident between jobs); its prefix cache keeps the already-seen context cheap, at a per-job
cost that grows with context (block hashing). The torch backend keeps each request's KV cache between jobs.

Greedy drafting makes each proposal deterministic, which is what lets the verifier's rejection sampler stay
exactly lossless without draft probabilities.

While a job runs the drafter reports progress after each step (protocol.Progress, rate-limited): the verifier restarts
only a drafter that stops making progress, never one that is merely slow.

Run as `python -m minedraft.engine.drafter.process ADDRESS SETTINGS_JSON`; the scheduler starts it.

Test-only environment variables (fault injection for the test suite; never set them in a deployment):
  MINEDRAFT_TEST_DRAFTER_STEP_SLEEP_SECONDS  sleep this long after every step of a job: a slow but working drafter.
  MINEDRAFT_TEST_DRAFTER_POISON_TOKEN        fail every job whose context holds this token id: a poison request.
  MINEDRAFT_TEST_DRAFTER_BROKEN              fail every job and every probe: a broken drafter (a sticky device error).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from minedraft.engine.drafter.backends import make_drafter, no_op

log = logging.getLogger("minedraft.drafter")

STEP_SLEEP_ENV = "MINEDRAFT_TEST_DRAFTER_STEP_SLEEP_SECONDS"
POISON_TOKEN_ENV = "MINEDRAFT_TEST_DRAFTER_POISON_TOKEN"
BROKEN_ENV = "MINEDRAFT_TEST_DRAFTER_BROKEN"
# The request id of the probe job a failed job is followed by (see DrafterServer.run_job); no real id has this form.
PROBE_REQUEST_ID = "minedraft-probe:"


def _configure_device(settings: dict[str, Any]) -> None:
    """Bind this process to its own cores (or GPU) before torch or vLLM start any threads."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(settings.get("kv_cache_gib", 1))))
    cores = settings.get("cpu_cores") or []
    if cores:
        os.sched_setaffinity(0, cores)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
        os.environ["OMP_NUM_THREADS"] = str(len(cores))
    # The device as the pod named it (one entry of the engine's inherited CUDA_VISIBLE_DEVICES, mapped by
    # minedraft.engine.placement.plan_devices); the engine's own narrowed list must not leak in.
    if settings.get("cuda_visible_devices") is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(settings["cuda_visible_devices"])


class DrafterServer:
    """The drafter's message loop without the socket: keeps each request's committed tokens between jobs (jobs carry
    deltas), drops cancelled jobs' work without forgetting their requests, forgets finished requests, and isolates a
    request that makes jobs fail."""

    def __init__(self, drafter: Any, vocab_size: int, send: Callable[[Any], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, step_sleep_seconds: float = 0.0,
                 poison_token: int | None = None, broken: bool = False) -> None:
        self.drafter = drafter
        self.vocab_size = vocab_size
        # Progress reports go out through `send` (none in unit tests that do not look at them).
        self._send = send
        self._clock = clock
        self._step_sleep_seconds = step_sleep_seconds
        self._poison_token = poison_token
        # Test fault injection: every job and every probe fails.
        self._broken = broken
        self._job_id = 0
        self._num_steps = 0
        self._last_report_at = float("-inf")
        self.num_progress_reports = 0
        # Committed tokens per live request, as taken in from jobs (on receipt, so a cancelled job still counts).
        self.contexts: dict[str, list[int]] = {}
        self.queued: list[Any] = []
        self.stop = False
        self._need_context: dict[int, list[str]] = {}

    def handle(self, message: Any) -> None:
        from minedraft.engine.drafter import protocol

        if isinstance(message, protocol.DraftJob):
            self.queued.append(self._take_in(message))
        elif isinstance(message, protocol.CancelJobs):
            doomed = set(message.job_ids)
            self.queued = [job for job in self.queued if job.job_id not in doomed]
        elif isinstance(message, protocol.CancelRequests):
            gone = set(message.request_ids)
            for request_id in gone:
                self._drop(request_id)
            self.drafter.cancelled.update(gone)
            for job in self.queued:
                job.items[:] = [i for i in job.items if i.request_id not in gone]
        else:
            self.stop = True

    def _take_in(self, job: Any) -> Any:
        """Apply the job's deltas to the stored contexts; returns the job with whole contexts (the stored lists
        themselves, not copies: backends only read them)."""
        from minedraft.engine.drafter import protocol

        items: list[protocol.DraftItem] = []
        missing: list[str] = []
        for item in job.items:
            new = item.token_ids
            if new and (max(new) >= self.vocab_size or min(new) < 0):
                # A context the draft model cannot read: that request goes undrafted, the rest of the job proceeds.
                self._drop(item.request_id)
                continue
            held = self.contexts.get(item.request_id)
            if item.base_num_tokens == 0:
                self.drafter.context_changed(item.request_id, 0)
                held = self.contexts[item.request_id] = list(new)
            elif held is None or len(held) < item.base_num_tokens:
                missing.append(item.request_id)
                self._drop(item.request_id)
                continue
            else:
                if len(held) > item.base_num_tokens:
                    self.drafter.context_changed(item.request_id, item.base_num_tokens)
                    del held[item.base_num_tokens:]
                held.extend(new)
            if held:
                # (A lookahead branch's tail rides along apart: the stored context stays committed tokens only.)
                items.append(protocol.DraftItem(item.request_id, held, item.num_draft_tokens, 0, item.tail,
                                                item.branch))
        if missing:
            self._need_context[job.job_id] = missing
        return protocol.DraftJob(job.job_id, items, job.want_logprobs, job.top_f)

    def run_job(self, job: Any, idle_seconds: float, poll_messages: Any) -> Any:
        from minedraft.engine.drafter import protocol

        need_context = self._need_context.pop(job.job_id, [])
        self._job_id, self._num_steps = job.job_id, 0
        try:
            self._check_poison(job)
            results, seconds, first_token_seconds = self.drafter.draft(job, poll_messages, on_step=self.on_step)
            return protocol.DraftReply(job.job_id, results, seconds, idle_seconds, first_token_seconds,
                                       need_context)
        except Exception as exc:  # a bad job must not take the drafter down with it
            log.exception("draft job %d failed", job.job_id)
            error = f"{type(exc).__name__}: {exc}"
            # Before blaming the job's requests: can this drafter draft at all? A sticky device error fails every
            # job, and retrying each request alone would name them all as poison.
            probe_error = self._probe(job.job_id)
            if probe_error is not None:
                log.error("a probe job failed too (%s): the drafter is broken, not the requests", probe_error)
                return protocol.DrafterError(job.job_id, f"{error}; a probe job failed too: {probe_error}", [],
                                             drafter_broken=True)
            return protocol.DrafterError(job.job_id, error, self._culprits(job))

    def _probe(self, job_id: int) -> str | None:
        """Draft one token from a one-token context no request can hold: None if that works, else its error."""
        from minedraft.engine.drafter import protocol

        probe = protocol.DraftJob(job_id, [protocol.DraftItem(PROBE_REQUEST_ID, [0], 1)], False)
        try:
            if self._broken:
                raise RuntimeError("test fault injection: a broken drafter")
            self.drafter.draft(probe, no_op)
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            self.drafter.context_changed(PROBE_REQUEST_ID, 0)
            self.drafter.cancelled.add(PROBE_REQUEST_ID)

    def on_step(self) -> None:
        """A step of the current job finished: report it, at most every PROGRESS_INTERVAL_SECONDS."""
        from minedraft.engine.drafter import protocol

        if self._step_sleep_seconds:
            time.sleep(self._step_sleep_seconds)
        self._num_steps += 1
        now = self._clock()
        if self._send is not None and now - self._last_report_at >= protocol.PROGRESS_INTERVAL_SECONDS:
            self._last_report_at = now
            self.num_progress_reports += 1
            self._send(protocol.Progress(self._job_id, self._num_steps))

    def _check_poison(self, job: Any) -> None:
        if self._broken:
            raise RuntimeError("test fault injection: a broken drafter")
        if self._poison_token is not None and any(self._poison_token in i.token_ids for i in job.items):
            raise RuntimeError(f"test fault injection: a context holds poison token {self._poison_token}")

    def _culprits(self, job: Any) -> list[str]:
        """Retry a failed job's requests one at a time: those that still fail are named (and forgotten here)."""
        from minedraft.engine.drafter import protocol

        if len(job.items) <= 1:
            culprits = [i.request_id for i in job.items]
        else:
            culprits = []
            for item in job.items:
                alone = protocol.DraftJob(job.job_id, [item], job.want_logprobs, job.top_f)
                try:
                    self._check_poison(alone)
                    self.drafter.draft(alone, no_op, on_step=self.on_step)
                except Exception:
                    culprits.append(item.request_id)
        for request_id in culprits:
            self._drop(request_id)
        return culprits

    def _drop(self, request_id: str) -> None:
        self.contexts.pop(request_id, None)
        self.drafter.context_changed(request_id, 0)


# vLLM 0.32's log lines that mark its start-up stages (in this process: the drafter's engine runs in-process).
VLLM_STAGE_MESSAGES = (("Loading weights took", "weights"), ("Model loading took", "weights"),
                       ("Graph capturing finished", "compiled"), ("init engine (profile", "compiled"))
# How often the download watch looks at the Hugging Face cache's size.
DOWNLOAD_POLL_SECONDS = 5.0


def huggingface_cache_dir() -> str:
    """Where huggingface_hub downloads to (HF_HUB_CACHE, HF_HOME/hub, or ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def directory_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


class StartupReporter(logging.Handler):
    """Sends the verifier a StartupStage at each start-up stage: those the process marks itself (`stage`), those
    vLLM's own log lines mark (a handler on the "vllm" logger), and "downloading" whenever the Hugging Face cache
    grew since the last look (a watch thread, for models not on local disk). All sends go through one lock: the
    watch thread and vLLM's logging threads share the socket with the main thread only while starting, and the
    watch is stopped before Ready."""

    def __init__(self, send: Callable[[Any], None], started: float, watch_downloads: bool) -> None:
        super().__init__(level=logging.INFO)
        self._send = send
        self._started = started
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_downloads, name="download-watch", daemon=True) \
            if watch_downloads else None

    def __enter__(self) -> StartupReporter:
        logging.getLogger("vllm").addHandler(self)
        if self._watch is not None:
            self._watch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("vllm").removeHandler(self)
        self._stop.set()
        if self._watch is not None:
            self._watch.join(timeout=DOWNLOAD_POLL_SECONDS + 5)

    def stage(self, name: str, detail: str = "", repeat: bool = False) -> None:
        from minedraft.engine.drafter import protocol

        with self._lock:
            if name in self._done and not repeat:
                return
            self._done.add(name)
            seconds = time.perf_counter() - self._started
            log.info("start-up stage %s after %.1fs %s", name, seconds, detail)
            # A verifier not reading yet only misses a report; the next stage or Ready still comes.
            with contextlib.suppress(Exception):
                self._send(protocol.StartupStage(os.getpid(), name, seconds, detail))

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for marker, stage in VLLM_STAGE_MESSAGES:
            if message.startswith(marker):
                self.stage(stage)

    def _watch_downloads(self) -> None:
        path = huggingface_cache_dir()
        seen = directory_bytes(path)
        while not self._stop.wait(DOWNLOAD_POLL_SECONDS):
            now = directory_bytes(path)
            if now > seen:
                self.stage("downloading", f"{now - seen} bytes in {DOWNLOAD_POLL_SECONDS:.0f}s", repeat=True)
            seen = now


def main(argv: list[str]) -> int:
    address, settings_json = argv[1], argv[2]
    settings = json.loads(settings_json)
    _configure_device(settings)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s drafter %(message)s")
    started = time.perf_counter()
    parent_pid = os.getppid()

    import zmq

    from minedraft.engine.drafter import protocol

    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(address)
    with StartupReporter(lambda message: socket.send(protocol.encode(message), zmq.NOBLOCK), started,
                         watch_downloads=not os.path.isdir(str(settings["model"]))) as startup:
        if settings.get("backend", "vllm") != "torch":
            import vllm  # noqa: F401  (the slowest import: reported as its own stage)
        startup.stage("imported")
        drafter = make_drafter(settings)
        startup.stage("weights" if settings.get("backend", "vllm") == "torch" else "compiled")

    def send_progress(message: Any) -> None:
        # Never block a job on a verifier that is not reading: a dropped report only delays the next one.
        with contextlib.suppress(zmq.Again):
            socket.send(protocol.encode(message), zmq.NOBLOCK)

    poison = os.environ.get(POISON_TOKEN_ENV)
    server = DrafterServer(drafter, drafter.vocab_size, send_progress,
                           step_sleep_seconds=float(os.environ.get(STEP_SLEEP_ENV) or 0.0),
                           poison_token=int(poison) if poison else None, broken=bool(os.environ.get(BROKEN_ENV)))
    socket.send(protocol.encode(protocol.Ready(os.getpid(), settings["model"], time.perf_counter() - started,
                                               int(getattr(drafter, "max_context_tokens", 0)))))
    log.info("drafter ready in %.1fs", time.perf_counter() - started)

    def poll_messages() -> None:
        while socket.poll(0):
            server.handle(protocol.decode_to_drafter(socket.recv()))

    def orphaned() -> bool:
        # An engine killed outright (SIGKILL, OOM) sends no Shutdown: its drafter notices it was re-parented. Checked
        # when idle and after every job, so a drafter with a backlog stops within one job instead of drafting on for
        # nobody.
        if os.getppid() != parent_pid:
            log.warning("parent process exited; drafter stopping")
            return True
        return False

    idle_since = time.perf_counter()
    while not server.stop:
        if not server.queued:
            if socket.poll(1000) == 0:
                if orphaned():
                    break
                continue
            server.handle(protocol.decode_to_drafter(socket.recv()))
            continue
        # Take in everything already sent first: cancels of queued jobs, and newer jobs' tokens.
        poll_messages()
        if not server.queued:
            continue
        job = server.queued.pop(0)
        reply = server.run_job(job, time.perf_counter() - idle_since, poll_messages)
        socket.send(protocol.encode(reply))
        idle_since = time.perf_counter()
        if orphaned():
            break
    socket.close(linger=0)
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
