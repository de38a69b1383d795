"""The shared drafter service without sockets (ServiceCore over DrafterServer and a recording backend): the
handshake, sessions and their namespaces, batching across engines, round-robin fairness, backpressure, deadlines,
silent engines, and a poison request from one engine."""

from __future__ import annotations

import time
from typing import Any

import pytest

from minedraft.engine.drafter import protocol, wire
from minedraft.engine.drafter.process import DrafterServer
from minedraft.engine.drafter.service import ServiceCore, ServiceSettings
from minedraft.engine.settings import DrafterSettings, EngineSettings, SettingsError

TOKEN = b"a-token-of-enough-bytes"


class RecordingBackend:
    """Drafts token len(context) for each request; records each batch's request ids."""

    def __init__(self) -> None:
        self.cancelled: set[str] = set()
        self.batches: list[list[str]] = []

    def context_changed(self, request_id: str, num_tokens_kept: int) -> None:
        pass

    def draft(self, job: Any, poll_messages: Any, on_step: Any = lambda: None) -> Any:
        self.batches.append([i.request_id for i in job.items])
        on_step()
        results = [protocol.DraftResult(i.request_id, len(i.token_ids), [len(i.token_ids)] * i.num_draft_tokens)
                   for i in job.items]
        return results, 0.01, 0.005


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, settings: ServiceSettings | None = None, poison: int | None = None) -> None:
        self.backend = RecordingBackend()
        self.clock = Clock()
        self.sent: list[tuple[bytes, Any]] = []
        server = DrafterServer(self.backend, vocab_size=1000, clock=self.clock, poison_token=poison)
        self.core = ServiceCore(server, TOKEN, "draft", lambda peer, m: self.sent.append((peer, m)), settings,
                                clock=self.clock)

    def take(self, peer: bytes) -> list[Any]:
        mine = [m for p, m in self.sent if p == peer]
        self.sent = [(p, m) for p, m in self.sent if p != peer]
        return mine

    def connect(self, peer: bytes, token: bytes = TOKEN, deadline_seconds: float = 5.0) -> Any:
        nonce = wire.new_nonce()
        self.core.on_message(peer, wire.Hello(wire.WIRE_VERSION, peer.decode(), nonce, deadline_seconds))
        (challenge,) = self.take(peer)
        assert isinstance(challenge, wire.Challenge)
        self.core.on_message(peer, wire.Auth(wire.client_mac(token, nonce, challenge.server_nonce)))
        (answer,) = self.take(peer)
        if isinstance(answer, wire.Welcome):
            assert wire.verify(wire.server_proof(TOKEN, nonce, challenge.server_nonce), answer.proof)
        return answer

    def job(self, peer: bytes, job_id: int, *items: tuple[Any, ...]) -> None:
        self.core.on_message(peer, protocol.DraftJob(job_id, [protocol.DraftItem(*i) for i in items]))

    def run(self) -> None:
        while (batch := self.core.next_batch()) is not None:
            self.core.run_batch(batch, 0.0, lambda: None)


def test_an_engine_with_the_wrong_token_gets_no_session_and_its_jobs_are_refused():
    h = Harness()
    answer = h.connect(b"intruder", token=b"not-the-token-at-all")
    assert isinstance(answer, wire.Rejected) and "authentication failed" in answer.reason
    h.job(b"intruder", 1, ("r", [1, 2], 2))
    (refusal,) = h.take(b"intruder")
    assert isinstance(refusal, wire.Rejected)
    assert not h.core.sessions and not h.core.server.contexts and not h.backend.batches


def test_the_token_never_crosses_the_wire():
    h = Harness()
    h.connect(b"a")
    # Every message either side sent: the handshake's nonces and MACs, never the token.
    nonce = wire.new_nonce()
    frames = [wire.encode(wire.Hello(wire.WIRE_VERSION, "a", nonce, 5.0)),
              wire.encode(wire.Auth(wire.client_mac(TOKEN, nonce, nonce)))]
    frames += [wire.encode(m) for _, m in h.sent]
    assert all(TOKEN not in f for f in frames)


def test_the_welcome_carries_the_drafters_length_limit():
    """A request at or past the service drafter's length must decode every step without drafts (as with a local
    drafter), so the engine must learn that limit from the service."""
    h = Harness()
    h.backend.max_context_tokens = 777  # type: ignore[attr-defined]
    welcome = h.connect(b"a")
    assert isinstance(welcome, wire.Welcome) and welcome.max_context_tokens == 777


def test_two_engines_requests_live_apart_and_are_drafted_in_one_forward():
    h = Harness()
    assert isinstance(h.connect(b"a"), wire.Welcome)
    assert isinstance(h.connect(b"b"), wire.Welcome)
    # The same request id from both engines, different contexts.
    h.job(b"a", 1, ("req-1", [1, 2, 3], 2))
    h.job(b"b", 1, ("req-1", [7], 2))
    h.run()
    assert len(h.backend.batches) == 1 and len(h.backend.batches[0]) == 2  # one forward for both engines
    (ra,) = [m for m in h.take(b"a") if isinstance(m, protocol.DraftReply)]
    (rb,) = [m for m in h.take(b"b") if isinstance(m, protocol.DraftReply)]
    assert [(r.request_id, r.context_num_tokens) for r in ra.results] == [("req-1", 3)]
    assert [(r.request_id, r.context_num_tokens) for r in rb.results] == [("req-1", 1)]
    # Deltas stay per engine: a's next job builds on a's tokens only.
    h.job(b"a", 2, ("req-1", [4], 2, 3))
    h.run()
    (ra,) = [m for m in h.take(b"a") if isinstance(m, protocol.DraftReply)]
    assert ra.results[0].context_num_tokens == 4 and not ra.need_context
    assert h.core.status().shared_batches == 1


def test_round_robin_one_busy_engine_cannot_starve_another():
    h = Harness(ServiceSettings(max_batch_requests=2, max_queued_jobs_per_session=8))
    h.connect(b"busy")
    h.connect(b"quiet")
    for job_id in range(1, 5):
        h.job(b"busy", job_id, (f"b{job_id}a", [1], 1), (f"b{job_id}b", [1], 1))
    h.job(b"quiet", 1, ("q", [1], 1))
    h.run()
    # The quiet engine's job is in the second batch at the latest, not after all of the busy one's.
    position = next(n for n, batch in enumerate(h.backend.batches) if any("/q" in rid for rid in batch))
    assert position <= 1


def test_past_the_queue_bound_jobs_are_answered_busy_and_their_tokens_still_taken_in():
    h = Harness(ServiceSettings(max_queued_jobs_per_session=1))
    h.connect(b"a")
    h.job(b"a", 1, ("r1", [1, 2], 1))
    h.job(b"a", 2, ("r2", [5, 6], 1))
    (busy,) = h.take(b"a")
    assert isinstance(busy, protocol.DrafterBusy) and busy.job_id == 2
    h.run()
    # r2's tokens were kept: its next job is a delta, not a need_context.
    h.job(b"a", 3, ("r2", [7], 1, 2))
    h.run()
    replies = [m for m in h.take(b"a") if isinstance(m, protocol.DraftReply)]
    assert replies[-1].job_id == 3 and replies[-1].results[0].context_num_tokens == 3
    assert not replies[-1].need_context
    assert h.core.status().busy_replies == 1


def test_a_job_queued_past_its_engines_deadline_is_answered_busy():
    h = Harness()
    h.connect(b"a", deadline_seconds=0.5)
    h.job(b"a", 1, ("r", [1], 1))
    h.clock.now += 1.0
    h.core.on_message(b"a", wire.Heartbeat())
    h.core.expire()
    assert any(isinstance(m, protocol.DrafterBusy) and m.job_id == 1 for m in h.take(b"a"))
    assert h.core.next_batch() is None


def test_a_silent_engine_has_its_session_requests_and_jobs_dropped_and_the_other_keeps_its_own():
    h = Harness(ServiceSettings(session_timeout_seconds=3.0))
    h.connect(b"gone")
    h.connect(b"alive")
    h.job(b"gone", 1, ("r", [1, 2], 1))
    h.job(b"alive", 1, ("r", [3, 4], 1))
    h.run()
    h.job(b"gone", 2, ("r", [5], 1, 2))  # queued, never drafted: its engine goes silent
    h.clock.now += 2.0
    h.core.on_message(b"alive", wire.Heartbeat())
    h.clock.now += 2.0
    h.core.expire()
    assert len(h.core.sessions) == 1
    assert len(h.core.server.contexts) == 1 and next(iter(h.core.server.contexts)).endswith("/r")
    assert h.core.queued_jobs == 0
    # The dropped engine is told to open a new session; the other drafts on from its delta.
    h.take(b"gone")
    h.take(b"alive")
    h.job(b"gone", 3, ("r", [6], 1, 3))
    assert isinstance(h.take(b"gone")[0], wire.Rejected)
    h.job(b"alive", 2, ("r", [5], 1, 2))
    h.run()
    (reply,) = [m for m in h.take(b"alive") if isinstance(m, protocol.DraftReply)]
    assert reply.results[0].context_num_tokens == 3


def test_a_poison_request_from_one_engine_costs_nobody_else_their_drafts():
    poison = 666
    h = Harness(poison=poison)
    h.connect(b"a")
    h.connect(b"b")
    h.job(b"a", 1, ("bad", [1, poison], 2), ("good", [1, 2], 2))
    h.job(b"b", 1, ("x", [3, 4], 2))
    h.run()
    (error,) = [m for m in h.take(b"a") if isinstance(m, protocol.DrafterError)]
    assert error.job_id == 1 and error.request_ids == ["bad"]  # only that request, named in a's own ids
    (reply,) = [m for m in h.take(b"b") if isinstance(m, protocol.DraftReply)]
    assert [r.request_id for r in reply.results] == ["x"]


def test_progress_reaches_every_engine_in_the_batch_under_its_own_job_id():
    h = Harness()
    h.connect(b"a")
    h.connect(b"b")
    h.job(b"a", 7, ("r", [1], 1))
    h.job(b"b", 9, ("r", [1], 1))
    h.run()
    assert any(isinstance(m, protocol.Progress) and m.job_id == 7 for m in h.take(b"a"))
    assert any(isinstance(m, protocol.Progress) and m.job_id == 9 for m in h.take(b"b"))


def test_an_engine_shutdown_ends_its_session_not_the_service():
    h = Harness()
    h.connect(b"a")
    h.connect(b"b")
    h.core.on_message(b"a", protocol.Shutdown())
    assert len(h.core.sessions) == 1


def test_the_remote_drafter_settings_name_their_fields():
    drafter = DrafterSettings(model="d", address="drafter:50061")
    with pytest.raises(SettingsError) as missing:
        EngineSettings(model="t", drafter=drafter)
    assert missing.value.field_name == "drafter.token_file"
    with pytest.raises(SettingsError) as bad:
        EngineSettings(model="t", drafter=DrafterSettings(model="d", address="drafter", token_file="/t"))
    assert bad.value.field_name == "drafter.address"
    with pytest.raises(SettingsError) as window:
        EngineSettings(model="t", drafter=DrafterSettings(model="d", window=-1))
    assert window.value.field_name == "drafter.window"
    with pytest.raises(SettingsError) as vllm_window:
        EngineSettings(model="t", drafter=DrafterSettings(model="d", backend="vllm", window=256))
    assert vllm_window.value.field_name == "drafter.window"


def test_a_short_or_missing_token_file_is_refused_without_showing_the_token(tmp_path):
    short = tmp_path / "short"
    short.write_text("secret")
    with pytest.raises(SettingsError) as exc:
        wire.read_token(str(short))
    assert "secret" not in str(exc.value) and exc.value.field_name == "drafter.token_file"
    with pytest.raises(SettingsError):
        wire.read_token(str(tmp_path / "missing"))


def test_a_busy_answer_releases_the_sub_batchs_ticket_at_once():
    """The engine's link routes DrafterBusy to the job's sub-batch (the scheduler then verifies it without drafts and
    counts it) instead of leaving the ticket to time out."""
    from minedraft.engine.drafter.link import DrafterLink

    from .test_drafter_link import FakeClient

    client = FakeClient()
    link = DrafterLink(client, hang_seconds=30.0, max_failed_jobs=3)  # type: ignore[arg-type]
    assert link.send(0, [protocol.DraftItem("r", [1, 2], 3)], False)
    client.inbox.append(protocol.DrafterBusy(client.sent_jobs[-1], "queue full"))
    from minedraft.engine.psd.events import DrafterBusy

    seen = link.poll(0.0)
    assert 0 not in link.jobs
    assert len(seen) == 1 and isinstance(seen[0], DrafterBusy) and seen[0].job is not None and seen[0].job.group == 0


def _fake_service(token: bytes, answer_proof: bool = True) -> tuple[Any, int, Any]:
    """A ROUTER socket on loopback answering one handshake (a correct proof, or one made with another token)."""
    import threading

    import zmq

    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        if not router.poll(10_000):
            return
        peer, data = router.recv_multipart()
        hello = wire.decode_to_service(data)
        assert isinstance(hello, wire.Hello)
        nonce = wire.new_nonce()
        router.send_multipart([peer, wire.encode(wire.Challenge(nonce))])
        if not router.poll(10_000):
            return
        peer, data = router.recv_multipart()
        proof_token = token if answer_proof else b"an-impostor-without-the-token"
        proof = wire.server_proof(proof_token, hello.client_nonce, nonce)
        router.send_multipart([peer, wire.encode(wire.Welcome("s-1", proof, "draft", 1000, 2048))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return router, port, thread


@pytest.mark.parametrize("honest", [True, False], ids=["service-holds-the-token", "impostor"])
def test_the_engine_checks_the_services_proof_before_sending_it_anything(honest: bool):
    from minedraft.engine.drafter.client import DrafterState
    from minedraft.engine.drafter.remote import RemoteDrafterClient

    router, port, thread = _fake_service(TOKEN, answer_proof=honest)
    client = RemoteDrafterClient(f"127.0.0.1:{port}", TOKEN, connect_timeout_seconds=10.0)
    try:
        client.start()
        if honest:
            up = client.wait_ready(10)
        else:
            # Until the client has judged the proof (not a fixed wait: it retries an impostor forever), never up.
            give_up_at = time.monotonic() + 60.0  # a safety net against hanging, not a measured bound
            while "failed authentication" not in (client.last_error or ""):
                assert not client.wait_ready(0.1), "the engine took an impostor for the service"
                assert time.monotonic() < give_up_at, client.last_error
            up = client.wait_ready(0.5)
        thread.join(10)
        assert up is honest
        if honest:
            assert client.session_id == "s-1" and client.state is DrafterState.UP
            # The service's length limit reaches the scheduler as a local drafter's Ready does.
            assert client.max_context_tokens == 2048
        else:
            # (It keeps retrying with back-off: a proper service may come up at that address.)
            assert client.state is not DrafterState.UP and "failed authentication" in (client.last_error or "")
            # Nothing goes to an impostor: no job is taken while down.
            assert client.submit([protocol.DraftItem("r", [1], 1)], False) is None
    finally:
        client.shutdown()
        router.close(linger=0)


def test_serve_takes_a_drafter_service_address_token_file_and_window(tmp_path):
    from minedraft.cli import build_parser, settings_from_args
    from minedraft.engine.core import Engine, drafter_process_settings
    from minedraft.engine.drafter.remote import RemoteDrafterClient

    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    args = build_parser().parse_args(["serve", "--model", "t", "--draft", "d", "--drafter-address", "pool:50061",
                                      "--drafter-token-file", str(token_file), "--drafter-window", "256"])
    settings = settings_from_args(args)
    assert (settings.drafter.address, settings.drafter.token_file, settings.drafter.window) == (
        "pool:50061", str(token_file), 256)
    # The local drafter process gets the window too (torch backend).
    assert drafter_process_settings(settings)["drafter_window"] == 256
    # The engine drafts through a session with the service instead of starting a process (nothing is listening
    # there: the client is only created and says hello).
    client = Engine._start_drafter(object(), settings)  # type: ignore[arg-type]
    try:
        assert isinstance(client, RemoteDrafterClient) and client.address == "pool:50061"
    finally:
        client.shutdown()
    # Without the address, the local drafter stays the default.
    local = settings_from_args(build_parser().parse_args(["serve", "--model", "t", "--draft", "d"]))
    assert local.drafter.address is None and local.drafter.window == 0


def test_an_engine_back_from_idle_does_not_take_its_own_silence_for_a_dead_service():
    from minedraft.engine.drafter.client import DrafterState
    from minedraft.engine.drafter.remote import RemoteDrafterClient

    router, port, thread = _fake_service(TOKEN)
    clock = Clock()
    client = RemoteDrafterClient(f"127.0.0.1:{port}", TOKEN, connect_timeout_seconds=1e9,
                                 service_timeout_seconds=5.0, clock=clock)
    try:
        client.start()
        assert client.wait_ready(10)
        thread.join(10)
        clock.now += 60.0  # no step for a minute: nothing called check_alive, no heartbeat went out
        assert client.check_alive() and client.state is DrafterState.UP
        # Now the engine steps (checking in every half second, heartbeating) and the service stays silent: down.
        alive = []
        for _ in range(12):
            clock.now += 0.5
            alive.append(client.check_alive())
        assert alive[0] and not alive[-1] and "silent" in (client.last_error or "")
    finally:
        client.shutdown()
        router.close(linger=0)


class _ThreadService:
    """ServiceCore over a real ROUTER socket on loopback, in a thread, with the recording backend (no model)."""

    def __init__(self) -> None:
        import threading

        import zmq

        self.router = zmq.Context.instance().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        server = DrafterServer(RecordingBackend(), vocab_size=1000)
        self.core = ServiceCore(server, TOKEN, "draft",
                                lambda peer, m: self.router.send_multipart([peer, wire.encode(m)]))
        self.drop_sessions = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            if self.router.poll(20):
                peer, data = self.router.recv_multipart()
                self.core.on_message(peer, wire.decode_to_service(data))
            if self.drop_sessions.is_set():
                for session_id in list(self.core.sessions):
                    self.core._drop_session(session_id, "test")
                self.drop_sessions.clear()
            batch = self.core.next_batch()
            if batch is not None:
                self.core.run_batch(batch, 0.0, lambda: None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.router.close(linger=0)


def test_a_session_the_service_dropped_is_reopened_at_once_and_drafting_goes_on():
    import time

    from minedraft.engine.drafter.remote import RemoteDrafterClient

    service = _ThreadService()
    client = RemoteDrafterClient(f"127.0.0.1:{service.port}", TOKEN)
    try:
        client.start()
        assert client.wait_ready(10)
        first = client.session_id
        service.drop_sessions.set()  # an idle spell past the service's session timeout
        while service.drop_sessions.is_set():
            time.sleep(0.01)
        assert client.submit([protocol.DraftItem("r", [1, 2], 2)], False) is not None
        deadline = time.monotonic() + 10
        while client.session_id == first and time.monotonic() < deadline:
            client.receive(0.05)
            client.check_alive()
        assert client.wait_ready(10) and client.session_id != first
        assert client.last_error is None  # reopened as a matter of course, not a failure
        assert client.num_starts == 2
        # The new session drafts (whole contexts, as after any new session).
        ticket = client.submit([protocol.DraftItem("r", [1, 2, 3], 2)], False)
        assert ticket is not None
        replies: list[Any] = []
        while not replies and time.monotonic() < deadline:
            replies = [m for m in client.receive(0.05) if isinstance(m, protocol.DraftReply)]
        assert replies and replies[0].job_id == ticket.job_id and replies[0].results[0].context_num_tokens == 3
    finally:
        client.shutdown()
        service.close()


def test_a_rotated_token_file_is_read_again_and_both_tokens_work_between_the_two_steps(tmp_path):
    """Two-step rotation with no restart: (1) the new token is added as a second line: the pool accepts both, engines
    still present the old (first) one; (2) the old line is removed: engines present the new one from their next
    session, and the old one is refused."""
    import os

    old, new = b"old-token-of-enough-bytes", b"new-token-of-enough-bytes"
    path = tmp_path / "token"
    path.write_bytes(old + b"\n")
    tokens = wire.LiveTokens(str(path))
    h = Harness()
    h.core._token = tokens  # the pool's live file
    nonce = wire.new_nonce()

    def connect(peer: bytes, token: bytes) -> Any:
        h.core.on_message(peer, wire.Hello(wire.WIRE_VERSION, peer.decode(), nonce, 5.0))
        (challenge,) = h.take(peer)
        h.core.on_message(peer, wire.Auth(wire.client_mac(token, nonce, challenge.server_nonce)))
        (answer,) = h.take(peer)
        if isinstance(answer, wire.Welcome):  # the pool proves the token the engine used
            assert wire.verify(wire.server_proof(token, nonce, challenge.server_nonce), answer.proof)
        return answer

    assert isinstance(connect(b"a", old), wire.Welcome)
    assert isinstance(connect(b"b", new), wire.Rejected)
    path.write_bytes(old + b"\n" + new + b"\n")
    os.utime(path, ns=(1, 1))  # a new stamp even within the file system's time resolution
    assert tokens.presented() == old
    assert isinstance(connect(b"c", old), wire.Welcome) and isinstance(connect(b"d", new), wire.Welcome)
    path.write_bytes(new + b"\n")
    os.utime(path, ns=(2, 2))
    assert tokens.presented() == new
    assert isinstance(connect(b"e", old), wire.Rejected) and isinstance(connect(b"f", new), wire.Welcome)
    # A file broken mid-rotation keeps the last good tokens; errors never show a token.
    path.write_bytes(b"short\n")
    os.utime(path, ns=(3, 3))
    assert tokens.accepted() == (new,)
    with pytest.raises(SettingsError) as exc:
        wire.read_tokens(str(path))
    assert "short" not in str(exc.value).replace(str(tmp_path), "")


def test_the_engine_presents_the_files_first_token_at_each_new_session(tmp_path):
    import os

    from minedraft.engine.drafter.remote import RemoteDrafterClient

    path = tmp_path / "token"
    path.write_bytes(b"old-token-of-enough-bytes\n")
    client = RemoteDrafterClient("127.0.0.1:1", wire.LiveTokens(str(path)))
    client.start()
    assert client._token == b"old-token-of-enough-bytes"
    path.write_bytes(b"new-token-of-enough-bytes\n")
    os.utime(path, ns=(5, 5))
    client.start()
    assert client._token == b"new-token-of-enough-bytes"
    client._close_socket()


class BranchBackend(RecordingBackend):
    """Echoes each item's branch and tail; candidates: top_f ids per drafted position and the one after."""

    def __init__(self, clock: Clock | None = None) -> None:
        super().__init__()
        self.jobs: list[Any] = []
        self.clock = clock  # advanced 10 ms per job: the service's drafting seconds

    def draft(self, job: Any, poll_messages: Any, on_step: Any = lambda: None) -> Any:
        self.jobs.append(job)
        if self.clock is not None:
            self.clock.now += 0.01
        results = [protocol.DraftResult(i.request_id, len(i.token_ids) + len(i.tail), [9] * i.num_draft_tokens, None,
                                        i.branch, list(i.tail),
                                        [list(range(job.top_f)) for _ in range(i.num_draft_tokens + 1)]
                                        if job.top_f else [])
                   for i in job.items]
        return results, 0.01, 0.005


def branch_harness() -> Harness:
    h = Harness()
    h.backend = BranchBackend(h.clock)
    h.core.server.drafter = h.backend
    assert isinstance(h.connect(b"a"), wire.Welcome)
    assert isinstance(h.connect(b"b"), wire.Welcome)
    return h


def branch_job(job_id: int, committed: list[int], base: int = 0) -> protocol.DraftJob:
    """Lookahead's job for request r: its likeliest branch (tail 4 5, carrying the committed delta), then another."""
    return protocol.DraftJob(job_id, [protocol.DraftItem("r", committed, 2, base, [4, 5], 0),
                                      protocol.DraftItem("r", [], 2, base + len(committed), [6], 1)], top_f=3)


def test_lookahead_branches_cross_the_service_with_their_tails_and_candidates():
    h = branch_harness()
    h.core.on_message(b"a", branch_job(1, [1, 2, 3]))
    h.run()
    (job,) = h.backend.jobs
    assert job.top_f == 3
    assert [(i.tail, i.branch, list(i.token_ids)) for i in job.items] == [([4, 5], 0, [1, 2, 3]), ([6], 1, [1, 2, 3])]
    (ra,) = [m for m in h.take(b"a") if isinstance(m, protocol.DraftReply)]
    assert [(r.request_id, r.branch, r.tail, r.context_num_tokens) for r in ra.results] == [("r", 0, [4, 5], 5),
                                                                                            ("r", 1, [6], 4)]
    assert all(len(r.candidates) == 3 and all(len(c) == 3 for c in r.candidates) for r in ra.results)
    # Alone, the extra branch ran: its share of the batch's drafted tokens (tail + drafts: 3 of 7) is counted apart.
    counters = h.core.counters
    assert counters.drafting_seconds == pytest.approx(0.01)
    assert counters.optional_drafting_seconds == pytest.approx(0.01 * 3 / 7)
    assert counters.optional_items_dropped == 0
    # The service holds committed tokens only: the tails never entered the stored context.
    assert list(h.core.server.contexts.values()) == [[1, 2, 3]]


def test_a_shared_batch_drafts_each_requests_likeliest_branch_only():
    h = branch_harness()
    h.core.on_message(b"a", branch_job(1, [1, 2, 3]))
    h.job(b"b", 1, ("r", [7, 8], 2))
    h.run()
    (job,) = h.backend.jobs
    assert job.top_f == 3, "merged: the largest top_f asked for"
    assert [(i.branch, i.tail) for i in job.items] == [(0, [4, 5]), (0, [])], "a's extra branch dropped"
    (ra,) = [m for m in h.take(b"a") if isinstance(m, protocol.DraftReply)]
    assert [(r.branch, r.tail) for r in ra.results] == [(0, [4, 5])]
    (rb,) = [m for m in h.take(b"b") if isinstance(m, protocol.DraftReply)]
    assert rb.results[0].candidates == [] and rb.results[0].tail == [], "b asked for no candidates"
    counters = h.core.counters
    assert (counters.optional_items_dropped, counters.optional_drafting_seconds) == (1, 0.0)
    assert counters.drafting_seconds == pytest.approx(0.01)
    # Dropped, not forgotten: the delta its items carried was taken in (a's next job builds on it).
    assert sorted(h.core.server.contexts.values()) == [[1, 2, 3], [7, 8]]


def test_a_job_with_work_queued_behind_it_drafts_its_likeliest_branches_only():
    h = branch_harness()
    h.core.on_message(b"a", branch_job(1, [1, 2, 3]))
    h.core.on_message(b"a", branch_job(2, [7], base=3))  # (a's next job, queued behind the first)
    first = h.core.next_batch()
    assert first is not None and [i.branch for i in first.job.items] == [0]
    h.core.run_batch(first, 0.0, lambda: None)
    second = h.core.next_batch()
    assert second is not None and [i.branch for i in second.job.items] == [0, 1], "nothing waits: all of it"
