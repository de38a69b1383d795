"""Drafter faults end to end on the shared psd engine (real engine, real torch drafter process):
- a poison request (every job carrying it fails in the drafter: the drafter's test-only fault injection,
  MINEDRAFT_TEST_DRAFTER_POISON_TOKEN) is quarantined after its first failed job and served without drafts; the
  other requests keep their drafts; the drafter is not restarted;
- a drafter that crashes at load on every start: the engine serves without drafts, says so (drafter_up, the step
  records, the client's last error, the log) and retries with back-off instead of respawning every step.
Each test leaves a healthy drafter behind for the next one."""

from __future__ import annotations

import logging

import pytest

from minedraft.engine.drafter.process import POISON_TOKEN_ENV
from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import Mode

from .device_checks import assert_greedy_matches
from .driver import Planned, drive, reference

pytestmark = pytest.mark.engine

SAMPLING = SamplingSettings(max_tokens=32)


@pytest.fixture(scope="module")
def prompts(pair_dir, ar_engine) -> list[list[int]]:
    from minedraft.bench.workload import bench_prompts

    return [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 6, chars=160)]


def _replace_drafter(engine) -> None:
    """Kill the drafter and wait for its replacement (started with the environment and settings as they are now)."""
    drafter = engine.psd_scheduler.drafter
    drafter.kill()
    assert not drafter.check_alive()  # noticed now: wait_for_drafter would otherwise see the old process's "up"
    assert engine.wait_for_drafter(300), drafter.last_error


def test_a_poison_request_is_quarantined_and_the_others_keep_their_drafts(psd, ar_engine, prompts, monkeypatch):
    expected = reference(ar_engine, prompts, SAMPLING)
    used = {t for p, e in zip(prompts, expected, strict=True) for t in p + e}
    poison = next(t for t in range(3, ar_engine.vocab_size) if t not in used)
    poisoned_prompt = [*prompts[0][:-1], poison]
    poisoned_expected = reference(ar_engine, [poisoned_prompt], SAMPLING)[0]

    scheduler = psd.psd_scheduler
    monkeypatch.setenv(POISON_TOKEN_ENV, str(poison))
    try:
        _replace_drafter(psd)
        restarts, hangs = scheduler.drafter.num_restarts, scheduler.link.num_hangs
        before = psd.totals()
        # Which requests the drafter's replies brought drafts for (a spy on the real planner: per-request counts of
        # verified tokens include the padding to k, so they cannot tell).
        drafted: dict[str, int] = {}
        store_drafts = scheduler.core.planner.store_drafts

        def spy(items, is_live):
            items = list(items)
            for request_id, draft in items:
                name = request_id.rpartition("-")[0]  # vLLM's internal id: ours plus "-<random suffix>"
                drafted[name] = drafted.get(name, 0) + len(draft.token_ids)
            return store_drafts(iter(items), is_live)

        monkeypatch.setattr(scheduler.core.planner, "store_drafts", spy)
        plan = [Planned(f"ok-{i}", p, SAMPLING) for i, p in enumerate(prompts)]
        plan.insert(3, Planned("poison", poisoned_prompt, SAMPLING))
        run = drive(psd, plan)
        after = psd.totals()
        restarted = (scheduler.drafter.num_restarts - restarts, scheduler.link.num_hangs - hangs)
    finally:
        monkeypatch.delenv(POISON_TOKEN_ENV)
        _replace_drafter(psd)
    assert_greedy_matches([run.completions[f"ok-{i}"].token_ids for i in range(len(prompts))], expected, "poison")
    assert run.completions["poison"].token_ids == poisoned_expected
    assert "poison" not in drafted, "the poison request was drafted"
    assert all(drafted.get(f"ok-{i}") for i in range(len(prompts))), \
        f"a request beside the poison one went without drafts: {drafted}"
    assert after.drafter_errors - before.drafter_errors == 1, "the culprit was named and quarantined at once"
    assert restarted == (0, 0), "a poison request restarted the drafter"


def test_a_drafter_that_crashes_at_load_leaves_the_engine_serving_without_drafts(psd, ar_engine, prompts, caplog,
                                                                                 tmp_path):
    expected = reference(ar_engine, prompts, SAMPLING)
    scheduler = psd.psd_scheduler
    drafter = scheduler.drafter
    settings = drafter._process_settings
    good_model = settings["model"]
    settings["model"] = str(tmp_path / "no-such-draft-model")  # every start fails while loading the model
    caplog.set_level(logging.ERROR, logger="minedraft.engine.drafter.client")
    try:
        drafter.kill()
        starts_before = drafter.num_starts
        before = psd.totals()
        records = psd.step_records()
        first = records[-1].step if records else 0
        runs = []
        # Serve until two restarts were tried (each fails while loading), then a little more.
        while drafter.num_starts - starts_before < 2 and len(runs) < 200:
            r = len(runs)
            runs.append(drive(psd, [Planned(f"down-{r}-{i}", p, SAMPLING) for i, p in enumerate(prompts)]))
        steps = sum(run.steps for run in runs)
        after = psd.totals()
        records = psd.step_records(first)
        starts = drafter.num_starts - starts_before
        up = scheduler.drafter_up
        last_error = drafter.last_error
    finally:
        settings["model"] = good_model
        assert psd.wait_for_drafter(300), drafter.last_error
    for r, run in enumerate(runs):
        assert_greedy_matches([run.completions[f"down-{r}-{i}"].token_ids for i in range(len(prompts))], expected,
                              "drafter down")
    assert after.draft_tokens == before.draft_tokens, "drafts while no drafter could start"
    assert not up and records and not any(r.drafter_up for r in records)
    assert all(r.mode == Mode.AR.value for r in records), "without a drafter the whole batch decodes each step"
    assert last_error is not None and "exited with code 1" in last_error, last_error  # (a load failure)
    assert any("serving without drafts" in m for m in caplog.messages)
    # Restarts back off: a handful of attempts over the run, not one per step.
    assert 2 <= starts <= 3 and starts * 10 < steps, (starts, steps)
    drive(psd, [Planned("back", prompts[0], SAMPLING)])
    assert psd.totals().draft_tokens > after.draft_tokens, "drafting resumed once the drafter could start"
