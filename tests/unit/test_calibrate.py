"""Cost curves from the engine's own step records (minedraft.bench.calibrate): pure, no engine started."""

from __future__ import annotations

import pytest

from minedraft.bench.calibrate import curves_from_records, overhead_seconds
from minedraft.engine.control.stats import StepRecord
from minedraft.profile.architecture import resolve
from minedraft.twin.costs import Hardware, StepCosts
from minedraft.twin.curves import parse_curves

TARGET = ("t", resolve("qwen3-0.6b")[1])
DRAFTER = ("d", resolve("qwen3-0.6b")[1])


def step(n: int, at: float, requests: int, q: int, verify: float, mode: str = "ar", wait: float = 0.0,
         job: int = 0, draft: float = 0.0, prefill: int = 0) -> StepRecord:
    return StepRecord(
        step=n, started_at=at, mode=mode, verified_group=None, group_sizes=(requests, 0),
        num_decode_requests=0 if prefill else requests, num_prefill_requests=prefill,
        num_requests_with_drafts=requests if q > 1 else 0, num_draft_tokens=requests * (q - 1),
        num_accepted_tokens=0, drafted_per_position=(), accepted_per_position=(), num_output_tokens=requests,
        num_scheduled_tokens=requests * q, verify_seconds=verify, wait_seconds=wait, draft_seconds=draft,
        drafter_idle_seconds=0.0, schedule_seconds=0.0, step_seconds=verify + wait, drafter_up=True, k=q - 1 or 3,
        draft_job_requests=job, draft_job_length=3 if job else 0)


def ar_run(requests: int, verify: float, count: int, gap: float) -> list[StepRecord]:
    return [step(i, i * gap, requests, 1, verify) for i in range(count)]


def sd_run(requests: int, verify: float, draft: float, count: int, gap: float) -> list[StepRecord]:
    return [step(i, i * gap, requests, 4, verify, "sd", wait=draft, job=requests, draft=draft)
            for i in range(count)]


def test_each_shape_is_the_median_of_its_steps_and_parses_as_a_curve_file() -> None:
    ar = [*ar_run(4, 0.002, 6, 0.0025), step(6, 0.0150, 4, 1, 0.050)]  # one outlier: the median ignores it
    sd = sd_run(4, 0.003, 0.0015, 6, 0.005)
    doc = curves_from_records({"ar": [ar], "sd": [sd]}, TARGET, DRAFTER, context=100, k=3, device="cpu",
                              measured="test")
    forward = {(r["batch"], r["new_tokens"]): r["ms"] for r in doc["models"]["t"]["forward_ms"]}
    assert forward == {(4, 1): pytest.approx(2.0), (4, 4): pytest.approx(3.0)}
    assert doc["models"]["d"]["draft_loop_ms"] == [
        {"batch": 4, "context": 100, "k": 3, "ms": pytest.approx(1.5), "steps": 6}]
    # The twin reads the file and prices exactly those shapes.
    costs = StepCosts.from_curves(parse_curves(doc), "t", "d", Hardware())
    assert costs.verify_ms(4, 100, 4) == pytest.approx(3.0)
    assert costs.draft_ms(4, 100, 3) == pytest.approx(1.5)


def test_host_work_is_the_gap_between_steps_less_verification_and_wait() -> None:
    # ar: 2 ms verifying every 2.5 ms -> 0.5 ms of host work; sd: 3 ms + 1.5 ms waiting every 5 ms -> 0.5 ms.
    ar = ar_run(4, 0.002, 6, 0.0025)
    sd = sd_run(4, 0.003, 0.0015, 6, 0.005)
    assert overhead_seconds([ar]) == pytest.approx([0.0005] * 5)
    doc = curves_from_records({"ar": [ar], "sd": [sd]}, TARGET, DRAFTER, 100, 3, "cpu", "test")
    assert doc["step_overhead_ms"] == {"all": pytest.approx(0.5), "ar": pytest.approx(0.5), "sd": pytest.approx(0.5)}
    # Steps of separate runs, or a second apart (idle between loads), are not one step's host work.
    assert overhead_seconds([ar[:1], ar[1:2]]) == []
    assert overhead_seconds([[ar[0], step(1, 5.0, 4, 1, 0.002)]]) == []


def test_ramp_shapes_too_few_steps_mixed_draft_lengths_and_prefills_are_left_out() -> None:
    ramp = [step(100 + i, 1.0 + i * 0.003, 3, 1, 0.009) for i in range(6)]  # batch 3: a ramp, not the grid
    few = [step(200 + i, 2.0 + i * 0.003, 8, 1, 0.004) for i in range(2)]  # batch 8: too few steps
    mixed = [StepRecord(**{**step(300, 3.0, 4, 4, 0.1).__dict__, "num_scheduled_tokens": 14})]  # 3.5 per request
    prefill = [step(400 + i, 4.0 + i, 2, 1, 0.02, prefill=2) for i in range(5)]  # 2 tokens of prompt each
    doc = curves_from_records({"ar": [ar_run(4, 0.002, 6, 0.0025), ramp, few, mixed, prefill]}, TARGET, DRAFTER,
                              100, 3, "cpu", "test", batches=(1, 2, 4, 8))
    assert [(r["batch"], r["new_tokens"]) for r in doc["models"]["t"]["forward_ms"]] == [(4, 1)]
    assert doc["prefill_ms_per_token"] == pytest.approx(10.0)


def test_of_several_loads_of_a_shape_the_least_contended_one_counts() -> None:
    quiet = ar_run(4, 0.002, 6, 0.0025)
    contended = [step(10 + i, 1.0 + i * 0.01, 4, 1, 0.006) for i in range(6)]  # the same shape, 3x slower
    doc = curves_from_records({"ar": [contended, quiet]}, TARGET, DRAFTER, 100, 3, "cpu", "test")
    assert doc["models"]["t"]["forward_ms"] == [
        {"batch": 4, "context": 100, "new_tokens": 1, "ms": pytest.approx(2.0), "steps": 12}]
    assert doc["step_overhead_ms"]["ar"] == pytest.approx(0.5)


def test_prefill_is_what_a_step_taking_prompts_in_costs_beyond_its_decoding_part() -> None:
    decoding = [*ar_run(4, 0.002, 6, 0.0025), *[step(10 + i, 1.0 + i * 0.01, 8, 1, 0.004) for i in range(6)]]
    # 6 decoding requests (between the rows at 4 and 8: 3 ms) and 10 prompt tokens in 13 ms: 1 ms per token.
    mixed = [StepRecord(**{**step(20 + i, 2.0 + i * 0.02, 6, 1, 0.013).__dict__, "num_prefill_requests": 1,
                           "num_scheduled_tokens": 16}) for i in range(5)]
    doc = curves_from_records({"ar": [decoding, mixed]}, TARGET, DRAFTER, 100, 3, "cpu", "test")
    assert doc["prefill_ms_per_token"] == pytest.approx(1.0)


def test_the_drafters_catch_up_price_is_fitted_from_the_jobs_and_the_twin_charges_it() -> None:
    """sd jobs of 4 and 8 requests whose loops cost 1.5 and 2.5 ms carry 0-12 accepted tokens and, now and then, a
    newcomer's 120-token prompt at 20 us a token: the file gets that price and the loops net of it, and the twin
    charges a job its catch-up tokens at the price (a prompt makes the job later, as in the engine)."""
    from dataclasses import replace

    from minedraft.engine.drafter import protocol
    from minedraft.twin.costs import AcceptanceModel
    from minedraft.twin.replica import ReplicaSettings, TwinReplica

    price_s = 0.00002
    runs = []
    for requests, loop in ((4, 0.0015), (8, 0.0025)):
        run = []
        for i in range(30):
            tokens = (i * 5) % 13 + (120 if i % 6 == 1 else 0)
            base = step(i, i * 0.01, requests, 4, 0.003, "sd", job=requests, draft=loop + tokens * price_s)
            run.append(replace(base, draft_job_catch_up_tokens=tokens))
        runs.append(run)
    doc = curves_from_records({"sd": runs}, TARGET, DRAFTER, 100, 3, "cpu", "test")
    drafter = doc["models"]["d"]
    assert drafter["catch_up_ms_per_token"] == pytest.approx(price_s * 1000, rel=0.01)
    assert {r["batch"]: r["ms"] for r in drafter["draft_loop_ms"]} == {4: pytest.approx(1.5), 8: pytest.approx(2.5)}
    curves = parse_curves(doc)
    assert curves.models["d"].catch_up_ms_per_token == pytest.approx(0.02)

    replica = TwinReplica(StepCosts.from_curves(curves, "t", "d", Hardware()), AcceptanceModel.constant(0.7),
                          ReplicaSettings(mode="sd", k=3))
    # A newcomer's 121-token prompt (120 catch-up tokens) and a request with 3 accepted tokens (3): 123 tokens.
    items = [protocol.DraftItem("new", [0] * 121, 3, 0), protocol.DraftItem("old", [0] * 4, 3, 200)]
    assert replica.link.send(0, items, want_logprobs=False)
    assert replica.drafter.jobs[-1].reply.draft_seconds == pytest.approx(
        (replica.costs.draft_ms(2, (121 + 204) / 2, 3) + 123 * 0.02) / 1000)
    job = replica.link.jobs.get(0)
    assert job is not None and job.catch_up_tokens == 123


def test_catch_up_ms_per_token_is_optional_and_checked_by_name() -> None:
    from minedraft.twin.curves import CurveError

    doc = curves_from_records({"sd": [sd_run(4, 0.003, 0.0015, 6, 0.005)]}, TARGET, DRAFTER, 100, 3, "cpu", "test")
    assert "catch_up_ms_per_token" not in doc["models"]["d"]  # the jobs' tokens never varied: no price
    assert parse_curves(doc).models["d"].catch_up_ms_per_token is None
    for bad, where in ((-1, "models.d.catch_up_ms_per_token"), ("fast", "models.d.catch_up_ms_per_token")):
        doc["models"]["d"]["catch_up_ms_per_token"] = bad
        with pytest.raises(CurveError) as error:
            parse_curves(doc)
        assert error.value.field_name == where
    del doc["models"]["d"]["catch_up_ms_per_token"]
    doc["models"]["t"]["catch_up_ms_per_token"] = 0.01
    with pytest.raises(CurveError, match="only drafters"):
        parse_curves(doc)
