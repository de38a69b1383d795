"""One drafter service shared by two engine replicas, end to end on loopback with real processes.

The service is a real `minedraft drafter` process (torch backend: it starts in seconds); the two engines are the
suite's shared psd engines (conftest: psd_engine and psd_vllm_drafter_engine), each switched from its own drafter to
a session with the service for this module and switched back afterwards, so the module starts no engine of its own.
Both engines are stepped in turn in this thread, so their jobs reach the service together.

Checked: greedy output of both equals the target alone (ar) and both got drafts, drafted in shared batches; the
service killed, stopped (hung) or restarted mid-stream -> both engines keep serving without drafts, lose nothing,
reconnect and draft again; one engine gone -> its session and requests freed, the other unaffected; a poison request
from one engine -> only that request quarantined, the other engine's drafts untouched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterState
from minedraft.engine.drafter.process import POISON_TOKEN_ENV
from minedraft.engine.drafter.remote import RemoteDrafterClient
from minedraft.engine.requests import Completion, SamplingSettings
from minedraft.engine.settings import Mode, default_core_split

from .conftest import MAX_MODEL_LEN
from .device_checks import assert_greedy_matches
from .driver import reference

pytestmark = pytest.mark.engine

TOKEN = b"drafter-service-test-token-0123456789"
SAMPLING = SamplingSettings(max_tokens=48)
# Fault tests stream long enough for the engines to notice the fault mid-stream (seconds of decoding).
LONG = SamplingSettings(max_tokens=200)
# Liveness. The engines are stepped in turn in one thread on a shared, loaded machine, so one engine's step can keep
# the other's heartbeats back for seconds: the sharing tests give the service long before either side is taken for
# gone (a test about who gets drafts must not depend on timing). The fault tests shorten the engines' service timeout
# for their duration (short_liveness) so a killed or hung service is noticed within a few steps; the service frees a
# silent session after SESSION_TIMEOUT_SECONDS, which the engine-gone test waits out.
CLIENT = {"heartbeat_seconds": 0.3, "service_timeout_seconds": 60.0, "connect_timeout_seconds": 10.0,
          "max_backoff_seconds": 1.0}
FAULT_SERVICE_TIMEOUT_SECONDS = 2.0
SESSION_TIMEOUT_SECONDS = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    pair_dir: Path
    token_file: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, env: dict[str, str] | None = None) -> None:
        """Start `minedraft drafter` (the real command) on the port, without waiting for it."""
        _, drafter_cores = default_core_split()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "minedraft.cli", "drafter", "--model", str(self.pair_dir / "draft"),
             "--port", str(self.port), "--token-file", str(self.token_file), "--max-model-len", str(MAX_MODEL_LEN),
             "--max-num-seqs", "64", "--cores", ",".join(str(c) for c in drafter_cores),
             "--session-timeout-seconds", str(SESSION_TIMEOUT_SECONDS)],
            env={**os.environ, **(env or {})}, start_new_session=True,
        )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def signal(self, number: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, number)

    def status(self) -> Any:
        """The service's own counters, asked over a session of the test's own."""
        client = RemoteDrafterClient(self.address, TOKEN, engine_name="status", **CLIENT)
        client.start()
        try:
            assert client.wait_ready(60), client.last_error
            client.request_status()
            deadline = time.monotonic() + 30
            while client.last_status is None and time.monotonic() < deadline:
                client.receive(0.1)
            assert client.last_status is not None
            return client.last_status
        finally:
            client.shutdown()


@pytest.fixture(scope="module")
def service(pair_dir, tmp_path_factory) -> Iterator[Service]:
    token_file = tmp_path_factory.mktemp("drafter-service") / "token"
    token_file.write_bytes(TOKEN + b"\n")
    token_file.chmod(0o600)
    svc = Service(pair_dir, token_file, _free_port())
    svc.start()
    yield svc
    svc.kill()


@pytest.fixture(scope="module")
def engines(psd_engine, psd_vllm_drafter_engine, service) -> Iterator[list[Any]]:
    """The two shared psd engines, each drafting through its own session with the service."""
    originals = []
    for engine in (psd_engine, psd_vllm_drafter_engine):
        scheduler = engine.psd_scheduler
        # Each shared engine goes back to the k it ran at (the vLLM-drafter one runs at the k it was built for).
        originals.append((scheduler.drafter, scheduler.core.k, scheduler.core.wait_policy.slack))
        engine.set_mode(Mode.PSD, 3, 0)
        remote = RemoteDrafterClient(service.address, TOKEN, deadline_seconds=10.0, **CLIENT)
        remote.start()
        scheduler.attach_drafter(remote)
        scheduler.core.planner.drafter_restarted()
        # The wait is about which requests get drafts, not lateness (the machine is shared): as test_engine.py.
        scheduler.core.wait_policy.slack = 4.0
    yield [psd_engine, psd_vllm_drafter_engine]
    for engine, (original, k, slack) in zip((psd_engine, psd_vllm_drafter_engine), originals, strict=True):
        scheduler = engine.psd_scheduler
        scheduler.drafter.shutdown()
        scheduler.attach_drafter(original)
        scheduler.core.planner.drafter_restarted()
        scheduler.core.wait_policy.slack = slack
        engine.set_mode(Mode.PSD, k, 0)


@pytest.fixture(scope="module")
def prompts(pair_dir, ar_engine) -> list[list[int]]:
    from minedraft.bench.workload import bench_prompts

    return [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 6, chars=160)]


@pytest.fixture(scope="module")
def expected(ar_engine, prompts) -> list[list[int]]:
    return reference(ar_engine, prompts, SAMPLING)


@pytest.fixture(scope="module")
def expected_long(ar_engine, prompts) -> list[list[int]]:
    return reference(ar_engine, prompts, LONG)


@contextlib.contextmanager
def short_liveness(engines: list[Any]) -> Iterator[None]:
    """The engines take a silent service for gone after FAULT_SERVICE_TIMEOUT_SECONDS, for a fault test's duration."""
    clients = [engine.psd_scheduler.drafter for engine in engines]
    for client in clients:
        client.service_timeout_seconds = FAULT_SERVICE_TIMEOUT_SECONDS
    try:
        yield
    finally:
        for client in clients:
            client.service_timeout_seconds = CLIENT["service_timeout_seconds"]


def _wait_up(engines: list[Any]) -> None:
    for engine in engines:
        drafter = engine.psd_scheduler.drafter
        assert drafter.wait_ready(120), drafter.last_error


def drive_together(engines: list[Any], prompts: list[list[int]], on_step: Callable[[int], None] | None = None,
                   sampling: SamplingSettings = SAMPLING, extra: dict[str, Completion] | None = None,
                   max_steps: int = 20000) -> list[list[list[int]]]:
    """The same prompts on every engine, the engines stepped in turn; each engine's outputs in prompt order.
    `extra`: requests the caller added to the first engine, collected here too."""
    completions: list[dict[str, Completion]] = []
    for n, engine in enumerate(engines):
        mine = {}
        for i, prompt in enumerate(prompts):
            request_id = f"e{n}-{i}-{time.monotonic_ns()}"
            engine.add_request(request_id, prompt, sampling)
            mine[request_id] = Completion(request_id)
        completions.append(mine)
    extras = extra if extra is not None else {}
    step = 0
    while any(engine.has_unfinished_requests() for engine in engines):
        if on_step is not None:
            on_step(step)
        for engine, mine in zip(engines, completions, strict=True):
            if engine.has_unfinished_requests():
                for delta in engine.step():
                    (mine if delta.request_id in mine else extras)[delta.request_id].add(delta)
        step += 1
        assert step < max_steps, "engines did not finish"
    return [[c.token_ids for c in mine.values()] for mine in completions]


def _drafted(engines: list[Any], run: Callable[[], Any]) -> tuple[Any, list[int]]:
    before = [engine.totals().draft_tokens for engine in engines]
    result = run()
    return result, [engine.totals().draft_tokens - b for engine, b in zip(engines, before, strict=True)]


def test_two_engines_share_one_service_identical_to_the_target_alone_and_both_get_drafts(engines, service, prompts,
                                                                                          expected):
    _wait_up(engines)
    before = service.status()
    outputs, drafted = _drafted(engines, lambda: drive_together(engines, prompts))
    after = service.status()
    for n, out in enumerate(outputs):
        assert_greedy_matches(out, expected, f"engine {n} via the shared drafter service")
    assert all(drafted), f"an engine got no drafts from the service: {drafted}"
    assert after.jobs_done > before.jobs_done
    assert all(engine.psd_scheduler.drafter.session_id for engine in engines)
    # Whether the two engines' jobs met in one batch here depends on timing (an idle service drafts each job before
    # the other engine's arrives): test_jobs_of_two_sessions_waiting_together_are_drafted_in_one_batch checks it.


def test_lookahead_through_the_shared_service_is_identical_to_the_target_alone_and_hits_branches(
        engines, service, prompts, expected):
    """Branch items (tails, top-F candidates) cross the service's sessions and batches and come back as branches."""
    _wait_up(engines)
    ks = [engine.psd_scheduler.core.k for engine in engines]
    before = [engine.totals() for engine in engines]
    for engine, k in zip(engines, ks, strict=True):
        engine.set_mode(Mode.LOOKAHEAD, k, 0)
    try:
        outputs = drive_together(engines, prompts)
    finally:
        for engine, k in zip(engines, ks, strict=True):
            engine.set_mode(Mode.PSD, k, 0)
    for n, out in enumerate(outputs):
        assert_greedy_matches(out, expected, f"engine {n}: lookahead via the shared drafter service")
    for engine, was in zip(engines, before, strict=True):
        now = engine.totals()
        assert now.branches_drafted > was.branches_drafted and now.branch_hits > was.branch_hits, \
            (now.branches_drafted - was.branches_drafted, now.branch_hits - was.branch_hits)


def test_jobs_of_two_sessions_waiting_together_are_drafted_in_one_batch(service, prompts):
    """The real service drafts the jobs of different sessions that wait together in one forward. They are made to
    wait together by stopping the service while both are sent. (Its ZMQ I/O thread may still hand the loop one job
    before the other after SIGCONT - a window of microseconds - so up to three tries; one shared batch suffices.)"""
    clients = [RemoteDrafterClient(service.address, TOKEN, engine_name=f"batching-{n}", **CLIENT) for n in range(2)]
    for client in clients:
        client.start()
    try:
        for client in clients:
            assert client.wait_ready(60), client.last_error
        before = service.status()
        for attempt in range(3):
            service.signal(signal.SIGSTOP)
            try:
                tickets = [client.submit([protocol.DraftItem(f"shared-{attempt}", prompts[n], 3)], False)
                           for n, client in enumerate(clients)]
                assert all(tickets), [client.last_error for client in clients]
                time.sleep(0.2)  # both sends reach the stopped service's socket buffers (not a correctness wait)
            finally:
                service.signal(signal.SIGCONT)
            for client, ticket in zip(clients, tickets, strict=True):
                assert ticket is not None
                replies: list[Any] = []
                deadline = time.monotonic() + 60
                while not replies and time.monotonic() < deadline:
                    replies = [m for m in client.receive(0.1) if isinstance(m, protocol.DraftReply)]
                assert replies and replies[0].job_id == ticket.job_id and replies[0].results, replies
            if (after := service.status()).shared_batches > before.shared_batches:
                break
        assert after.shared_batches > before.shared_batches, after
    finally:
        for client in clients:
            client.shutdown()


def test_service_killed_then_restarted_mid_stream_loses_nothing_and_drafting_resumes(engines, service, prompts,
                                                                                      expected, expected_long):
    _wait_up(engines)
    restarts = [engine.psd_scheduler.drafter.num_starts for engine in engines]
    noticed: list[bool] = []

    def fault(step: int) -> None:
        if step == 4:
            service.kill()
        # Back on the same port once both engines noticed (and decoded plainly meanwhile).
        if service.process is not None and service.process.poll() is not None and all(
                engine.psd_scheduler.drafter.state is not DrafterState.UP for engine in engines):
            noticed.append(True)
            service.start()

    with short_liveness(engines):
        outputs = drive_together(engines, prompts, on_step=fault, sampling=LONG)
    for n, out in enumerate(outputs):
        assert_greedy_matches(out, expected_long, f"engine {n}, service killed and restarted")
    assert noticed, "the engines finished before noticing the service was gone"
    assert service.process is not None and service.process.poll() is None, "the service was not restarted"
    _wait_up(engines)
    assert all(engine.psd_scheduler.drafter.num_starts > r for engine, r in zip(engines, restarts, strict=True))
    outputs, drafted = _drafted(engines, lambda: drive_together(engines, prompts))
    for n, out in enumerate(outputs):
        assert_greedy_matches(out, expected, f"engine {n} after reconnecting")
    assert all(drafted), f"an engine drafted no more after the service came back: {drafted}"


def test_service_hung_mid_stream_engines_serve_on_and_draft_again_once_it_resumes(engines, service, prompts,
                                                                                   expected, expected_long):
    _wait_up(engines)
    stopped: list[bool] = []

    def fault(step: int) -> None:
        if step == 4:
            service.signal(signal.SIGSTOP)
            stopped.append(True)
        if len(stopped) == 1 and all(engine.psd_scheduler.drafter.state is not DrafterState.UP
                                     for engine in engines):
            service.signal(signal.SIGCONT)
            stopped.append(False)

    try:
        with short_liveness(engines):
            outputs = drive_together(engines, prompts, on_step=fault, sampling=LONG)
    finally:
        service.signal(signal.SIGCONT)
    for n, out in enumerate(outputs):
        assert_greedy_matches(out, expected_long, f"engine {n}, service hung")
    assert stopped == [True, False], "the engines never noticed the hung service"
    _wait_up(engines)
    outputs, drafted = _drafted(engines, lambda: drive_together(engines, prompts))
    for n, out in enumerate(outputs):
        assert_greedy_matches(out, expected, f"engine {n} after the service resumed")
    assert all(drafted), f"an engine drafted no more after the service resumed: {drafted}"


def test_an_engine_that_goes_away_has_its_session_freed_and_the_other_drafts_on(engines, service, prompts,
                                                                                 expected):
    _wait_up(engines)
    gone, staying = engines
    gone_client = gone.psd_scheduler.drafter
    # Leave requests held on the service, then vanish without a goodbye (a killed pod).
    drive_together([gone], prompts[:2])
    gone_client.kill()
    gone_client._closed = True  # and stay away (a killed engine does not reconnect)
    try:
        outputs, drafted = _drafted([staying], lambda: drive_together([staying], prompts))
        assert_greedy_matches(outputs[0], expected, "the engine that stayed")
        assert drafted[0], "the engine that stayed lost its drafts"
        deadline = time.monotonic() + SESSION_TIMEOUT_SECONDS + 60
        scheduler = staying.psd_scheduler
        while (status := service.status()).sessions > 2 and time.monotonic() < deadline:
            # The staying engine is idle meanwhile; its link is looked after as an idle engine's steps would (its
            # heartbeats), so only the engine that went away falls silent.
            for _ in range(5):
                scheduler.core.poll_drafter(0.0)
                scheduler.link.check()
                time.sleep(0.1)
        # Left: the staying engine's session and the status client's own.
        assert status.sessions == 2, status
    finally:
        gone_client._closed = False
        gone_client.start()
        gone.psd_scheduler.core.planner.drafter_restarted()


def test_a_poison_request_from_one_engine_is_quarantined_and_nobody_else_loses_drafts(engines, service, prompts,
                                                                                      expected, ar_engine,
                                                                                      monkeypatch):
    used = {t for p, e in zip(prompts, expected, strict=True) for t in p + e}
    poison = next(t for t in range(3, ar_engine.vocab_size) if t not in used)
    poisoned_prompt = [*prompts[0][:-1], poison]
    poisoned_expected = reference(ar_engine, [poisoned_prompt], SAMPLING)[0]
    service.kill()
    service.start(env={POISON_TOKEN_ENV: str(poison)})
    try:
        for engine in engines:
            engine.psd_scheduler.drafter.mark_hung("test: a new service")
        _wait_up(engines)
        drafted: list[dict[str, int]] = [{}, {}]
        for engine, seen in zip(engines, drafted, strict=True):
            planner = engine.psd_scheduler.core.planner

            def spy(items: Any, is_live: Any, store: Any = planner.store_drafts, seen: dict[str, int] = seen) -> Any:
                items = list(items)
                for request_id, draft in items:
                    seen[request_id] = seen.get(request_id, 0) + len(draft.token_ids)
                return store(iter(items), is_live)

            monkeypatch.setattr(planner, "store_drafts", spy)
        errors = [engine.totals().drafter_errors for engine in engines]
        poisoned_engine = engines[0]
        poisoned_engine.add_request("poison", poisoned_prompt, SAMPLING)
        extra = {"poison": Completion("poison")}
        outputs = drive_together(engines, prompts, extra=extra)
        errors = [engine.totals().drafter_errors - e for engine, e in zip(engines, errors, strict=True)]
    finally:
        service.kill()
        service.start()
        for engine in engines:
            engine.psd_scheduler.drafter.mark_hung("test: the service restarted without fault injection")
    for n, out in enumerate(outputs):
        assert_greedy_matches(out, expected, f"engine {n} beside a poison request")
    assert not any(rid.startswith("poison") for rid in drafted[0]), "the poison request was drafted"
    assert all(drafted), f"an engine lost its drafts to another's poison request: {drafted}"
    assert extra["poison"].token_ids == poisoned_expected
    assert errors == [1, 0], errors
