"""One drafter shared by many engine replicas: `minedraft drafter` (the drafter as a network service).

The drafter's job protocol is the local drafter's (protocol.py: token-id deltas in, drafts out), carried over TCP
in authenticated sessions (wire.py). What the service adds to the local drafter's message loop
(process.DrafterServer, reused as it is for the deltas, the backend and poison isolation):

- sessions: each engine's request ids are namespaced by its session, so two engines' "req-1" never meet;
- batching across engines: jobs of different sessions that are queued together are drafted in one batched forward
  (one backend call; the torch backend batches slots, the vLLM one batches requests);
- fair order: a batch takes at most one job per session, sessions in round-robin order, so one busy engine cannot
  starve another's jobs; a job that waited longer than its engine's deadline is answered "busy" (the engine has gone
  ahead without it anyway);
- backpressure: past a bound on queued jobs (per session and in all) a job is answered "busy" at once, and the
  engine verifies that sub-batch without drafts (counted in its metrics);
- liveness: a session silent for `session_timeout_seconds` (no heartbeat, no job) is dropped with its requests'
  tokens and KV and its queued jobs;
- faults: a batch that fails is re-run job by job, so a poison request from one engine costs only that engine's job
  (the drafter names the request, the engine quarantines it) and no other engine's drafts.
- optional work yields: a lookahead engine's job carries, per request, its likeliest branch and further branches it
  adds only because a drafter of its own would have the time for them. In a batch shared with another engine's job,
  or while other jobs wait, only each request's first item is drafted (`protocol.required_items`): the extra
  branches would lengthen the forward everyone's job is in. Time spent on extra branches alone is counted apart
  (`optional_drafting_seconds`), so the pool's autoscaler does not add replicas for work that only fills spare time.

ServiceCore is the service without the socket (tests drive it directly); `serve` is the thin ZMQ loop around it;
the `minedraft drafter` command (minedraft/server/drafter_cli.py) adds the Prometheus endpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minedraft.engine.drafter import protocol, wire
from minedraft.engine.drafter.process import POISON_TOKEN_ENV, STEP_SLEEP_ENV, DrafterServer

log = logging.getLogger("minedraft.drafter_service")

Send = Callable[[bytes, Any], None]


@dataclass(frozen=True)
class ServiceSettings:
    # Jobs waiting to be drafted, all sessions together, and per session (an engine has at most two in flight).
    max_queued_jobs: int = 64
    max_queued_jobs_per_session: int = 4
    # Requests drafted in one forward at most (the backend's slots bound it too).
    max_batch_requests: int = 256
    # A session that sent nothing (jobs, heartbeats) this long is gone: its requests and jobs are dropped.
    session_timeout_seconds: float = 10.0
    # An unfinished handshake is forgotten after this long.
    handshake_timeout_seconds: float = 10.0
    max_pending_handshakes: int = 1024


@dataclass
class _QueuedJob:
    session_id: str
    job_id: int  # the engine's own id
    job: protocol.DraftJob  # taken in: namespaced request ids, whole contexts
    need_context: list[str]  # the engine's request ids
    arrived_at: float


@dataclass
class _Session:
    session_id: str
    peer: bytes
    engine_name: str
    deadline_seconds: float
    last_heard_at: float
    queue: deque[_QueuedJob] = field(default_factory=deque)

    @property
    def prefix(self) -> str:
        return f"{self.session_id}/"


@dataclass
class _Handshake:
    hello: wire.Hello
    server_nonce: bytes
    started_at: float


@dataclass
class Batch:
    parts: list[_QueuedJob]
    job: protocol.DraftJob
    # The share of the batch's drafted tokens that are lookahead's extra branches (0 when they were dropped).
    optional_share: float = 0.0


@dataclass
class ServiceCounters:
    """Monotonic totals since the service started (the pool's metrics read them)."""

    jobs_done: int = 0
    batches: int = 0
    shared_batches: int = 0
    busy_replies: int = 0
    sessions_expired: int = 0
    failed_batches: int = 0
    # Requests drafted, summed over batches (mean batch size = batch_requests / batches).
    batch_requests: int = 0
    # Seconds spent drafting batches (utilisation = its rate).
    drafting_seconds: float = 0.0
    # Of drafting_seconds, the share spent on lookahead's extra branches (apportioned by drafted tokens): drafted
    # only in batches nobody else's work waited for, so spare time, not capacity anyone needs.
    optional_drafting_seconds: float = 0.0
    # Extra branches not drafted because their batch was shared or other jobs waited.
    optional_items_dropped: int = 0
    # Per engine (by the name it gave): jobs answered, and seconds from a job's arrival to its answer.
    engine_jobs: dict[str, int] = field(default_factory=dict)
    engine_job_seconds: dict[str, float] = field(default_factory=dict)


class ServiceCore:
    """Sessions, fair batching, backpressure and liveness over one DrafterServer; single-threaded, no I/O."""

    def __init__(self, server: DrafterServer, token: bytes | wire.LiveTokens, model: str, send: Send,
                 settings: ServiceSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        self._token = token
        self.model = model
        self._send = send
        self.settings = settings or ServiceSettings()
        self._clock = clock
        self.sessions: dict[str, _Session] = {}
        self._by_peer: dict[bytes, str] = {}
        self._handshakes: dict[bytes, _Handshake] = {}
        self._session_ids = itertools.count(1)
        self._job_ids = itertools.count(1)
        self._order: deque[str] = deque()  # round-robin order of sessions
        self.counters = ServiceCounters()
        # The batch being drafted (progress reports go to its sessions).
        self._current: Batch | None = None
        server._send = self._fan_out_progress  # DrafterServer.on_step reports progress through it
        self._run_id = f"{os.getpid():x}{int(time.time()) & 0xFFFF:04x}"

    # -- messages ----------------------------------------------------------------------------------------------

    def on_message(self, peer: bytes, message: Any) -> None:
        now = self._clock()
        if isinstance(message, wire.Hello):
            self._hello(peer, message, now)
            return
        if isinstance(message, wire.Auth):
            self._auth(peer, message, now)
            return
        session_id = self._by_peer.get(peer)
        if session_id is None:
            self._send(peer, wire.Rejected("unknown session: open one with a hello (the service restarted or dropped "
                                           "this session after a silence)"))
            return
        session = self.sessions[session_id]
        session.last_heard_at = now
        if isinstance(message, protocol.DraftJob):
            self._job(session, message, now)
        elif isinstance(message, protocol.CancelJobs):
            doomed = set(message.job_ids)
            session.queue = deque(q for q in session.queue if q.job_id not in doomed)
        elif isinstance(message, protocol.CancelRequests):
            gone = [session.prefix + rid for rid in message.request_ids]
            self.server.handle(protocol.CancelRequests(gone))
            gone_set = set(gone)
            for queued in session.queue:
                queued.job.items[:] = [i for i in queued.job.items if i.request_id not in gone_set]
        elif isinstance(message, wire.Heartbeat):
            self._send(peer, wire.HeartbeatAck(self.queued_jobs))
        elif isinstance(message, wire.StatusRequest):
            self._send(peer, self.status())
        elif isinstance(message, wire.Goodbye | protocol.Shutdown):
            # An engine's Shutdown ends its session, never the service other engines share.
            self._drop_session(session_id, "said goodbye")

    def _hello(self, peer: bytes, hello: wire.Hello, now: float) -> None:
        if hello.version != wire.WIRE_VERSION:
            self._send(peer, wire.Rejected(f"wire version {hello.version} not supported (service speaks "
                                           f"{wire.WIRE_VERSION})"))
            return
        if len(hello.client_nonce) != wire.NONCE_BYTES:
            self._send(peer, wire.Rejected("malformed hello"))
            return
        self._expire_handshakes(now)
        if len(self._handshakes) >= self.settings.max_pending_handshakes:
            self._send(peer, wire.Rejected("too many handshakes in progress"))
            return
        old = self._by_peer.get(peer)
        if old is not None:
            self._drop_session(old, "opened a new session")
        nonce = wire.new_nonce()
        self._handshakes[peer] = _Handshake(hello, nonce, now)
        self._send(peer, wire.Challenge(nonce))

    def _auth(self, peer: bytes, auth: wire.Auth, now: float) -> None:
        handshake = self._handshakes.pop(peer, None)
        if handshake is None:
            self._send(peer, wire.Rejected("authentication without a hello"))
            return
        hello = handshake.hello
        # Any token of the (re-read) file: a rotation adds the new one before it removes the old.
        token = next((candidate for candidate in wire.accepted_tokens(self._token)
                      if wire.verify(wire.client_mac(candidate, hello.client_nonce, handshake.server_nonce),
                                     auth.mac)), None)
        if token is None:
            log.warning("engine %r failed authentication; refused", hello.engine_name[:64])
            self._send(peer, wire.Rejected("authentication failed: the engine's drafter token does not match"))
            return
        session_id = f"{self._run_id}-{next(self._session_ids)}"
        self.sessions[session_id] = _Session(session_id, peer, hello.engine_name[:128],
                                             max(0.01, float(hello.deadline_seconds)), now)
        self._by_peer[peer] = session_id
        self._order.append(session_id)
        proof = wire.server_proof(token, hello.client_nonce, handshake.server_nonce)
        self._send(peer, wire.Welcome(session_id, proof, self.model, int(self.server.vocab_size),
                                      int(getattr(self.server.drafter, "max_context_tokens", 0) or 0)))
        log.info("session %s opened for engine %r (%d sessions)", session_id, hello.engine_name[:64],
                 len(self.sessions))

    def _job(self, session: _Session, job: protocol.DraftJob, now: float) -> None:
        prefix = session.prefix
        global_id = next(self._job_ids)
        namespaced = protocol.DraftJob(global_id, [
            protocol.DraftItem(prefix + i.request_id, i.token_ids, i.num_draft_tokens, i.base_num_tokens, i.tail,
                               i.branch)
            for i in job.items
        ], job.want_logprobs, job.top_f)
        # Always take in the tokens, even when the job is refused below: the next job then stays a small delta.
        self.server.handle(namespaced)
        taken = self.server.queued.pop()
        need = [rid[len(prefix):] for rid in self.server._need_context.pop(global_id, [])]
        queued = _QueuedJob(session.session_id, job.job_id, taken, need, now)
        if (len(session.queue) >= self.settings.max_queued_jobs_per_session
                or self.queued_jobs >= self.settings.max_queued_jobs):
            self._busy(session, queued, "queue full")
            return
        session.queue.append(queued)

    def _busy(self, session: _Session, queued: _QueuedJob, reason: str) -> None:
        self.counters.busy_replies += 1
        self._send(session.peer, protocol.DrafterBusy(queued.job_id, reason))

    # -- liveness ----------------------------------------------------------------------------------------------

    def expire(self) -> None:
        """Drop silent sessions and answer busy for jobs queued past their engine's deadline."""
        now = self._clock()
        for session in list(self.sessions.values()):
            if now - session.last_heard_at > self.settings.session_timeout_seconds:
                self.counters.sessions_expired += 1
                self._drop_session(session.session_id, f"silent for {now - session.last_heard_at:.1f}s")
                continue
            while session.queue and now - session.queue[0].arrived_at > session.deadline_seconds:
                self._busy(session, session.queue.popleft(), "waited past the engine's deadline")
        self._expire_handshakes(now)

    def _expire_handshakes(self, now: float) -> None:
        for peer, handshake in list(self._handshakes.items()):
            if now - handshake.started_at > self.settings.handshake_timeout_seconds:
                del self._handshakes[peer]

    def _drop_session(self, session_id: str, why: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        self._by_peer.pop(session.peer, None)
        with contextlib.suppress(ValueError):
            self._order.remove(session_id)
        held = [rid for rid in self.server.contexts if rid.startswith(session.prefix)]
        if held:
            self.server.handle(protocol.CancelRequests(held))
        log.info("session %s (engine %r) dropped: %s; %d requests and %d queued jobs freed", session_id,
                 session.engine_name[:64], why, len(held), len(session.queue))

    # -- drafting ----------------------------------------------------------------------------------------------

    @property
    def queued_jobs(self) -> int:
        return sum(len(s.queue) for s in self.sessions.values())

    def next_batch(self) -> Batch | None:
        """At most one job per session, sessions in round-robin order, up to max_batch_requests requests. Sessions
        served go to the back of the order; one left out (the batch was full) keeps its place at the front."""
        parts: list[_QueuedJob] = []
        served: list[str] = []
        num_requests = 0
        for session_id in self._order:
            session = self.sessions[session_id]
            if not session.queue:
                continue
            # (Packed by required items: shared, a batch drafts no more.)
            size = len(protocol.required_items(session.queue[0].job.items))
            if parts and num_requests + size > self.settings.max_batch_requests:
                break
            parts.append(session.queue.popleft())
            served.append(session_id)
            num_requests += size
        if served:
            taken = set(served)
            self._order = deque([s for s in self._order if s not in taken] + served)
        if not parts:
            return None
        everything = [item for part in parts for item in part.job.items]
        contended = len(parts) > 1 or self.queued_jobs > 0
        required = [item for part in parts for item in protocol.required_items(part.job.items)]
        items = required if contended else everything
        self.counters.optional_items_dropped += len(everything) - len(items)
        optional_share = 0.0
        if not contended and len(items) > len(required):
            optional_share = 1.0 - protocol.drafted_tokens(required) / protocol.drafted_tokens(items)
        # (Candidates for the largest top_f any part asked for; each part gets back as many as it asked for.)
        merged = protocol.DraftJob(next(self._job_ids), items, any(p.job.want_logprobs for p in parts),
                                   max(p.job.top_f for p in parts))
        return Batch(parts, merged, optional_share)

    def run_batch(self, batch: Batch, idle_seconds: float, poll_messages: Callable[[], None]) -> None:
        self._current = batch
        started = self._clock()
        try:
            reply = self.server.run_job(batch.job, idle_seconds, poll_messages)
            if isinstance(reply, protocol.DrafterError) and len(batch.parts) > 1:
                # One engine's poison must not cost the others their drafts: draft each engine's job alone (the
                # failing one is narrowed to its request there).
                self.counters.failed_batches += 1
                for part in batch.parts:
                    self._current = Batch([part], part.job)
                    self._answer(part, self.server.run_job(part.job, idle_seconds, poll_messages))
            else:
                for part in batch.parts:
                    self._answer(part, reply)
        finally:
            self._current = None
        seconds = self._clock() - started
        self.counters.drafting_seconds += seconds
        self.counters.optional_drafting_seconds += seconds * batch.optional_share
        self.counters.batch_requests += len(batch.job.items)
        self.counters.batches += 1
        self.counters.shared_batches += len({p.session_id for p in batch.parts}) > 1
        self.counters.jobs_done += len(batch.parts)

    def _answer(self, part: _QueuedJob, reply: Any) -> None:
        session = self.sessions.get(part.session_id)
        if session is None:
            return  # the engine left while its job was drafted
        c = self.counters
        c.engine_jobs[session.engine_name] = c.engine_jobs.get(session.engine_name, 0) + 1
        c.engine_job_seconds[session.engine_name] = (c.engine_job_seconds.get(session.engine_name, 0.0)
                                                     + self._clock() - part.arrived_at)
        prefix = session.prefix
        if isinstance(reply, protocol.DrafterError):
            mine = [rid[len(prefix):] for rid in reply.request_ids if rid.startswith(prefix)]
            self._send(session.peer, protocol.DrafterError(part.job_id, reply.message, mine))
            return
        top_f = part.job.top_f
        results = [
            protocol.DraftResult(r.request_id[len(prefix):], r.context_num_tokens, r.token_ids, r.logprobs, r.branch,
                                 r.tail, [c[:top_f] for c in r.candidates] if top_f else [])
            for r in reply.results if r.request_id.startswith(prefix)
        ]
        self._send(session.peer, protocol.DraftReply(part.job_id, results, reply.draft_seconds, reply.idle_seconds,
                                                     reply.first_token_seconds, part.need_context))

    def _fan_out_progress(self, message: Any) -> None:
        batch = self._current
        if batch is None or not isinstance(message, protocol.Progress):
            return
        for part in batch.parts:
            session = self.sessions.get(part.session_id)
            if session is not None:
                self._send(session.peer, protocol.Progress(part.job_id, message.num_steps))

    def status(self) -> wire.ServiceStatus:
        c = self.counters
        return wire.ServiceStatus(len(self.sessions), len(self.server.contexts), self.queued_jobs, c.jobs_done,
                                  c.batches, c.shared_batches, c.busy_replies, c.sessions_expired)


# -- the process ---------------------------------------------------------------------------------------------------


def serve(settings: dict[str, Any], host: str, port: int, token: bytes | wire.LiveTokens, service: ServiceSettings,
          ready: Callable[[int], None] | None = None, on_core: Callable[[ServiceCore], None] | None = None) -> int:
    """The service's loop (never returns while it runs). `on_core` receives the ServiceCore once it exists (the
    metrics exporter reads its counters)."""
    from minedraft.engine.drafter.backends import make_drafter
    from minedraft.engine.drafter.process import _configure_device

    _configure_device(settings)
    started = time.perf_counter()
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    # Never block the loop on one slow engine: its messages are dropped instead (it times the service out).
    socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
    drafter = make_drafter(settings)
    # Bound once the model is loaded: an open port means ready (a TCP readiness probe asks exactly that), and engines
    # that connect earlier retry with back-off meanwhile.
    bound_port = socket.bind_to_random_port(f"tcp://{host}") if port == 0 else port
    if port:
        socket.bind(f"tcp://{host}:{port}")
    poison = os.environ.get(POISON_TOKEN_ENV)
    server = DrafterServer(drafter, drafter.vocab_size, None,
                           step_sleep_seconds=float(os.environ.get(STEP_SLEEP_ENV) or 0.0),
                           poison_token=int(poison) if poison else None)

    def send(peer: bytes, message: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):
            socket.send_multipart([peer, wire.encode(message)], zmq.NOBLOCK)

    core = ServiceCore(server, token, str(settings["model"]), send, service)
    if on_core is not None:
        on_core(core)
    deferred: list[tuple[bytes, Any]] = []

    def receive_one(block_ms: int, during_job: bool) -> bool:
        if not socket.poll(block_ms):
            return False
        frames = socket.recv_multipart()
        if len(frames) != 2:
            return True
        try:
            message = wire.decode_to_service(frames[1])
        except Exception:  # garbage from a peer must never stop the service
            send(frames[0], wire.Rejected("malformed message"))
            return True
        if during_job and isinstance(message, protocol.DraftJob | protocol.CancelRequests | protocol.CancelJobs):
            # Mid-job, a job's tokens would extend the contexts being drafted in place: keep them for after.
            deferred.append((frames[0], message))
        else:
            core.on_message(frames[0], message)
        return True

    def poll_during_job() -> None:
        while receive_one(0, during_job=True):
            pass

    def on_progress_tick(message: Any) -> None:
        core._fan_out_progress(message)
        poll_during_job()  # heartbeats are answered while a long job runs

    server._send = on_progress_tick
    log.info("drafter service on tcp://%s:%d ready in %.1fs (%s backend)", host, bound_port,
             time.perf_counter() - started, settings.get("backend"))
    print(f"minedraft drafter: serving on {host}:{bound_port}", file=sys.stderr, flush=True)
    if ready is not None:
        ready(bound_port)
    idle_since = time.perf_counter()
    last_report = time.monotonic()
    while True:
        for peer, message in deferred:
            core.on_message(peer, message)
        deferred.clear()
        block_ms = 0 if core.queued_jobs else 200
        while receive_one(block_ms, during_job=False):
            block_ms = 0
        core.expire()
        batch = core.next_batch()
        if batch is not None:
            core.run_batch(batch, time.perf_counter() - idle_since, poll_during_job)
            idle_since = time.perf_counter()
        if time.monotonic() - last_report > 60:
            last_report = time.monotonic()
            log.info("status: %s", core.status())
