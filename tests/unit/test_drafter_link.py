"""The drafter's job loop (DrafterServer) and the verifier's link (DrafterLink) without processes or sockets."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterState, JobTicket
from minedraft.engine.drafter.link import DrafterLink
from minedraft.engine.drafter.process import DrafterServer
from minedraft.engine.psd.events import DrafterRestarted, JobHung


class RecordingBackend:
    """Drafts token len(context) for each request; fails on any context holding a poison token."""

    POISON = 666

    def __init__(self, steps_per_job: int = 1) -> None:
        self.cancelled: set[str] = set()
        self.seen: list[list[tuple[str, list[int]]]] = []
        self.steps_per_job = steps_per_job
        self.changes: list[tuple[str, int]] = []

    def context_changed(self, request_id, num_tokens_kept):
        self.changes.append((request_id, num_tokens_kept))

    def draft(self, job, poll_messages, on_step=lambda: None):
        self.seen.append([(i.request_id, list(i.token_ids)) for i in job.items])
        if any(self.POISON in i.token_ids for i in job.items):
            raise RuntimeError("bad context")
        for _ in range(self.steps_per_job):
            on_step()
        results = [protocol.DraftResult(i.request_id, len(i.token_ids), [len(i.token_ids)] * i.num_draft_tokens)
                   for i in job.items]
        return results, 0.01, 0.005


def job(job_id, *items, want_logprobs=False):
    return protocol.DraftJob(job_id, [protocol.DraftItem(*i) for i in items], want_logprobs)


def test_jobs_carry_deltas_and_the_drafter_rebuilds_whole_contexts():
    backend = RecordingBackend()
    server = DrafterServer(backend, vocab_size=1000)
    server.handle(job(1, ("a", [1, 2, 3], 2), ("b", [9], 2)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert [(r.request_id, r.context_num_tokens) for r in reply.results] == [("a", 3), ("b", 1)]
    # Next job: a's 2 new tokens after its first 3 (the drafter's own drafted tail is not context).
    server.handle(job(2, ("a", [4, 5], 2, 3)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert backend.seen[-1] == [("a", [1, 2, 3, 4, 5])]
    assert reply.results[0].context_num_tokens == 5 and reply.need_context == []


def test_an_unknown_base_is_answered_with_need_context_not_a_wrong_draft():
    server = DrafterServer(RecordingBackend(), vocab_size=1000)
    server.handle(job(1, ("a", [4, 5], 2, 3), ("b", [1], 1)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert reply.need_context == ["a"]
    assert [r.request_id for r in reply.results] == ["b"]


def test_a_cancelled_job_is_skipped_but_its_requests_tokens_are_kept():
    backend = RecordingBackend()
    server = DrafterServer(backend, vocab_size=1000)
    server.handle(job(1, ("a", [1, 2, 3], 2)))
    server.handle(protocol.CancelJobs([1]))
    assert server.queued == [] and backend.seen == []
    assert server.contexts == {"a": [1, 2, 3]}, "a deadline miss must not make the drafter forget a live request"
    assert not backend.cancelled, "the backend was not told to drop the request's KV"
    server.handle(job(2, ("a", [4], 2, 3)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert reply.need_context == [] and reply.results[0].context_num_tokens == 4


def test_finished_requests_are_forgotten_on_the_drafter_side():
    backend = RecordingBackend()
    server = DrafterServer(backend, vocab_size=1000)
    server.handle(job(1, ("a", [1, 2], 2), ("b", [3], 2)))
    server.handle(protocol.CancelRequests(["a"]))
    assert "a" not in server.contexts and "a" in backend.cancelled
    assert [i.request_id for i in server.queued[0].items] == ["b"]


def test_a_request_that_fails_every_job_is_named_and_the_rest_of_the_job_is_unharmed():
    backend = RecordingBackend()
    server = DrafterServer(backend, vocab_size=1000)
    server.handle(job(1, ("good", [1, 2], 2), ("bad", [RecordingBackend.POISON], 2)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert isinstance(reply, protocol.DrafterError) and reply.request_ids == ["bad"]
    assert "bad" not in server.contexts and "good" in server.contexts


def test_token_ids_outside_the_vocabulary_skip_only_that_request():
    server = DrafterServer(RecordingBackend(), vocab_size=10)
    server.handle(job(1, ("a", [1, 2], 2), ("b", [3, 50], 2)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert [r.request_id for r in reply.results] == ["a"]


def test_a_working_drafter_reports_progress_rate_limited_while_a_job_runs():
    clock = Clock()
    sent: list[object] = []

    class SlowSteps(RecordingBackend):
        def draft(self, job, poll_messages, on_step=lambda: None):
            def step():
                clock.now += 0.1  # each step takes 0.1 s
                on_step()
            return super().draft(job, poll_messages, step)

    server = DrafterServer(SlowSteps(steps_per_job=100), vocab_size=1000, send=sent.append, clock=clock)
    server.handle(job(7, ("a", [1, 2], 2)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert isinstance(reply, protocol.DraftReply)
    assert all(isinstance(m, protocol.Progress) and m.job_id == 7 for m in sent)
    steps = [m.num_steps for m in sent]  # type: ignore[attr-defined]
    assert steps[0] == 1 and steps == sorted(steps)
    # 10 s of steps, one report per 0.25 s at most (each 0.3 s here, steps being 0.1 s): not one per step.
    assert 25 <= len(sent) <= 10 / protocol.PROGRESS_INTERVAL_SECONDS + 1


def test_a_poison_token_set_for_fault_injection_fails_only_its_request():
    server = DrafterServer(RecordingBackend(), vocab_size=1000, poison_token=13)
    server.handle(job(1, ("good", [1, 2], 2), ("bad", [5, 13, 6], 2)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert isinstance(reply, protocol.DrafterError) and reply.request_ids == ["bad"]
    server.handle(job(2, ("good", [3], 2, 2)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert isinstance(reply, protocol.DraftReply) and reply.results[0].context_num_tokens == 3


def test_protocol_round_trips_the_new_fields():
    for message in (job(3, ("a", [4], 2, 9)), protocol.CancelJobs([1, 2])):
        assert protocol.decode_to_drafter(protocol.encode(message)) == message
    for message in (protocol.DraftReply(1, [], 0.1, 0.0, 0.0, ["x"]), protocol.DrafterError(1, "boom", ["y"]),
                    protocol.Progress(4, 12)):
        assert protocol.decode_from_drafter(protocol.encode(message)) == message


# -- the verifier's side -------------------------------------------------------------------------------------------


@dataclass
class FakeClient:
    """A DrafterClient stand-in: messages are queued by the test; restarts are counted."""

    state: DrafterState = DrafterState.UP
    num_starts: int = 1
    inbox: list[protocol.FromDrafter] = field(default_factory=list)
    sent_jobs: list[int] = field(default_factory=list)
    cancelled_jobs: list[int] = field(default_factory=list)
    hung_reasons: list[str] = field(default_factory=list)
    next_job: int = 1

    def submit(self, items, want_logprobs):
        ticket = JobTicket(self.next_job, frozenset(i.request_id for i in items), 0.0)
        self.sent_jobs.append(self.next_job)
        self.next_job += 1
        return ticket

    def cancel_jobs(self, job_ids):
        self.cancelled_jobs.extend(job_ids)

    def cancel(self, request_ids):
        pass

    def receive(self, timeout_seconds):
        out, self.inbox = self.inbox, []
        return out

    def check_alive(self):
        return self.state is DrafterState.UP

    def mark_hung(self, reason):
        self.hung_reasons.append(reason)
        self.num_starts += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def item(rid):
    return protocol.DraftItem(rid, [1], 2)


def test_a_silent_drafter_with_work_outstanding_is_restarted_and_a_slow_but_alive_one_is_not():
    clock = Clock()
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3, clock=clock)  # type: ignore[arg-type]
    assert link.send(0, [item("a")], False)
    for _ in range(10):  # slow but alive: replies keep coming, every 2 s, each job late
        clock.now += 2.0
        client.inbox.append(protocol.DraftReply(client.sent_jobs[-1], [], 2.0, 0.0))
        link.poll(0.0)
        assert link.check() and client.hung_reasons == []
        assert link.send(0, [item("a")], False)
    clock.now += 4.0
    assert link.check() and client.hung_reasons == []
    clock.now += 1.5  # 5.5 s without a word while a job is outstanding
    link.check()
    assert len(client.hung_reasons) == 1 and not link.jobs
    assert DrafterRestarted() in link.take_events() and link.take_events() == []


def test_a_drafter_reporting_progress_is_never_restarted_however_long_its_job_takes():
    """One job for an hour (a huge prefill, a drafter sharing its cores): no reply, but a step finishes every 2 s.
    Only when the reports stop is it hung."""
    clock = Clock()
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3, clock=clock)  # type: ignore[arg-type]
    assert link.send(0, [item("a")], False)
    routed: list[object] = []
    for step in range(1, 1800):
        clock.now += 2.0
        client.inbox.append(protocol.Progress(client.sent_jobs[-1], step))
        routed += link.poll(0.0)
        assert link.check(), f"restarted after {step * 2} s of progress"
    assert client.hung_reasons == [] and 0 in link.jobs and routed == []
    assert link.num_progress_reports == 1799
    clock.now += 5.5
    link.check()
    assert len(client.hung_reasons) == 1 and "no progress" in client.hung_reasons[0]


def test_a_stopped_drafter_serving_short_bursts_is_still_taken_for_hung():
    """Bursts of requests shorter than the hang threshold, each ending with its late jobs abandoned (no job outstanding
    between bursts): the silence adds up across them, as long as the drafter says nothing. A stopped drafter used to go
    unnoticed this way until the engine's sends to it backed up."""
    clock = Clock()
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3, clock=clock)  # type: ignore[arg-type]
    for _ in range(2):  # 2 s of outstanding work per burst, then idle between bursts
        assert link.send(0, [item("a")], False)
        clock.now += 2.0
        assert link.check() and client.hung_reasons == []
        link.abandon(0)
        clock.now += 30.0  # idle time between bursts is not silence with work outstanding
        assert link.check() and client.hung_reasons == []
    assert link.send(0, [item("a")], False)
    clock.now += 1.5
    link.check()
    assert len(client.hung_reasons) == 1, "5.5 s of outstanding work without a word over three bursts"


def test_a_drafter_heard_from_between_bursts_starts_its_silence_afresh():
    clock = Clock()
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3, clock=clock)  # type: ignore[arg-type]
    for _ in range(5):
        assert link.send(0, [item("a")], False)
        clock.now += 2.0
        client.inbox.append(protocol.Progress(client.sent_jobs[-1], 1))  # alive: working on it
        link.poll(0.0)
        clock.now += 2.0
        link.abandon(0)
        clock.now += 30.0
        assert link.check()
    assert client.hung_reasons == []


def test_an_idle_drafter_is_never_taken_for_hung():
    clock = Clock()
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3, clock=clock)  # type: ignore[arg-type]
    clock.now += 60
    assert link.check() and client.hung_reasons == []


def test_abandoning_a_late_job_cancels_its_work_and_routes_its_late_reply_nowhere():
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3)  # type: ignore[arg-type]
    link.send(0, [item("a")], False)
    link.send(1, [item("b")], False)
    result = link.wait_for(0, 0.01)
    assert not result.arrived and 0 in link.jobs
    link.abandon(0)
    assert client.cancelled_jobs == [1]
    client.inbox = [protocol.DraftReply(1, [], 0.1, 0.0), protocol.DraftReply(2, [], 0.1, 0.0)]
    routed = [event.job.group if event.job else None for event in link.poll(0.0)]  # type: ignore[union-attr]
    assert routed == [None, 1] and not link.jobs


def test_unattributed_failed_jobs_restart_the_drafter_after_a_run_of_them():
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3)  # type: ignore[arg-type]
    link.job_failed_unattributed()
    link.job_failed_unattributed()
    assert client.hung_reasons == []
    link.job_failed_unattributed()
    assert len(client.hung_reasons) == 1 and link.consecutive_failed_jobs == 0


def test_a_drafter_that_never_starts_is_reported_and_retried_with_backoff(tmp_path):
    """A real drafter process that cannot start (bound to a core that does not exist: it fails before loading
    anything): the client reports why, serves without drafts (not up) and schedules the next start after a back-off
    instead of respawning every step."""
    import time as _time

    from minedraft.engine.drafter.client import DrafterClient

    client = DrafterClient({"model": str(tmp_path / "no-such-model"), "backend": "torch", "max_model_len": 64,
                            "max_num_seqs": 2, "cpu_cores": [4095]}, restart=True)
    try:
        client.start()
        assert client._process is not None
        client._process.wait(timeout=300)
        assert not client.check_alive()
        assert client.state is DrafterState.DOWN
        assert client.last_error is not None and "exited with code" in client.last_error
        assert client.num_restarts == 0 and client._next_start_at > _time.monotonic(), "no respawn before back-off"
        for _ in range(5):
            assert not client.check_alive()
        assert client.num_starts == 1
    finally:
        client.shutdown()


def test_loading_is_said_only_while_a_drafter_process_starts() -> None:
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=30.0, max_failed_jobs=3)  # type: ignore[arg-type]
    assert not link.loading
    client.state = DrafterState.STARTING
    assert link.loading
    client.state = DrafterState.DOWN
    assert not link.loading
    assert not DrafterLink(None, hang_seconds=30.0, max_failed_jobs=3).loading


def test_jobs_sent_to_a_replaced_drafter_do_not_make_its_successor_look_hung():
    # Seen in the merged suite: a job was outstanding when the shared engine went idle; the drafter was then killed
    # and replaced; at the next step the old ticket's age (minutes) was taken for a hang of the new process, which
    # was killed in turn.
    clock = Clock()
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3, clock=clock)  # type: ignore[arg-type]
    assert link.send(0, [item("a")], False)
    clock.now += 300.0
    client.num_starts += 1  # killed and replaced outside the link (a crash, an operator, a test)
    assert link.check()
    assert link.num_hangs == 0 and client.hung_reasons == []
    assert not link.jobs
    assert link.take_events() == [DrafterRestarted()] and link.take_events() == []
    # The new process is judged from its own jobs.
    assert link.send(0, [item("a")], False)
    clock.now += 6.0
    link.check()
    assert link.num_hangs == 1


class BrokenBackend(RecordingBackend):
    """Fails every job, whatever it carries (a sticky device error)."""

    def draft(self, job, poll_messages, on_step=lambda: None):
        self.seen.append([(i.request_id, list(i.token_ids)) for i in job.items])
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_broken_drafter_says_so_instead_of_naming_every_request_as_poison():
    server = DrafterServer(BrokenBackend(), vocab_size=1000)
    server.handle(job(1, ("a", [1, 2], 2), ("b", [3], 2)))
    reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
    assert isinstance(reply, protocol.DrafterError)
    assert reply.drafter_broken and reply.request_ids == [], reply
    assert "probe" in reply.message
    # With a drafter that works, a poison request is still named (the probe passes).
    healthy = DrafterServer(RecordingBackend(), vocab_size=1000)
    healthy.handle(job(2, ("a", [1, 2], 2), ("bad", [RecordingBackend.POISON], 2)))
    reply = healthy.run_job(healthy.queued.pop(0), 0.0, lambda: None)
    assert isinstance(reply, protocol.DrafterError) and not reply.drafter_broken and reply.request_ids == ["bad"]
    assert "minedraft-probe:" not in healthy.contexts


def test_restarts_back_off_until_a_job_succeeds_not_until_the_drafter_is_up(tmp_path):
    """A drafter that comes up and then fails every job must not be restarted at once every time: Ready does not end
    the back-off, a drafted reply does."""
    import zmq

    from minedraft.engine.drafter.client import DrafterClient

    client = DrafterClient({"model": "unused"}, restart=False)
    peer = client._context.socket(zmq.PAIR)
    try:
        client._socket = client._context.socket(zmq.PAIR)
        client._socket.bind(f"ipc://{tmp_path}/d.sock")
        peer.connect(f"ipc://{tmp_path}/d.sock")
        client._consecutive_failures = 3
        peer.send(protocol.encode(protocol.Ready(1, "m", 0.5, max_context_tokens=2048)))
        # receive() keeps waiting its whole timeout after a Ready (nothing for the caller yet): short polls until up.
        give_up_at = time.monotonic() + 60.0  # a safety net against hanging, not a measured bound
        while client.state is not DrafterState.UP:
            assert client.receive(0.05) == [] and time.monotonic() < give_up_at
        assert client.max_context_tokens == 2048
        assert client._consecutive_failures == 3, "coming up is not success"
        peer.send(protocol.encode(protocol.DraftReply(1, [], 0.01, 0.0)))
        assert len(client.receive(5.0)) == 1 and client._consecutive_failures == 0
    finally:
        peer.close(linger=0)
        client.shutdown()


def test_after_a_hang_the_job_the_drafter_was_stuck_on_is_named():
    clock = Clock()
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3, clock=clock)  # type: ignore[arg-type]
    assert link.send(0, [item("a"), item("long")], False)
    assert link.send(1, [item("c")], False)
    assert link.take_events() == []
    clock.now += 6.0
    link.check()
    assert link.take_events()[0] == JobHung(frozenset({"a", "long"}))
    assert not any(isinstance(event, JobHung) for event in link.take_events())


def test_each_reply_is_handed_over_with_the_catch_up_tokens_its_job_really_carried():
    """Per request, the committed tokens a job carries beyond the last one (accepted tokens since the drafter's last
    job, a newcomer's whole prompt; a catch-up chunk's all), counted at submission and given with the reply; a reply
    of an abandoned job counts none."""
    client = FakeClient()
    link = DrafterLink(client, hang_seconds=5.0, max_failed_jobs=3, clock=Clock())  # type: ignore[arg-type]
    steady = protocol.DraftItem("a", [5, 6, 7], 3, 40)  # two accepted tokens and the bonus: 2
    newcomer = protocol.DraftItem("b", list(range(120)), 3, 0)  # a whole prompt: 119
    chunk = protocol.DraftItem("c", list(range(64)), 0, 10)  # a catch-up chunk, nothing drafted: 64
    assert link.send(0, [steady, newcomer, chunk], False)
    assert link.send(1, [protocol.DraftItem("d", [9], 3, 70)], False)
    job = link.jobs.get(0)
    assert job is not None and job.catch_up_tokens == 2 + 119 + 64
    link.abandon(1)
    client.inbox += [protocol.DraftReply(client.sent_jobs[1], [], 0.01, 0.0),
                     protocol.DraftReply(client.sent_jobs[0], [], 0.02, 0.0)]
    seen = [(None, 0) if e.job is None else (e.job.group, e.job.catch_up_tokens) for e in link.poll(0.0)]  # type: ignore[union-attr]
    assert seen == [(None, 0), (0, 185)]
