"""The cost model on hand-computed cases: accepted length from per-position rates, and the psd/sd crossover."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from minedraft.engine.control.cost_model import AcceptanceProfile, CostCurve, CostModel
from minedraft.engine.control.stats import StepRecord

_clock = itertools.count()


def record(
    step: int,
    started_at: float,
    *,
    mode: str = "sd",
    num_requests: int,
    num_tokens: int,
    verify_seconds: float,
    draft_seconds: float = 0.0,
    drafted: tuple[int, ...] = (),
    accepted: tuple[int, ...] = (),
    wait_seconds: float = 0.0,
    num_output_tokens: int = 0,
) -> StepRecord:
    return StepRecord(
        step=step, started_at=started_at, mode=mode, verified_group=0, group_sizes=(num_requests, 0),
        num_decode_requests=num_requests, num_prefill_requests=0,
        num_requests_with_drafts=num_requests if drafted else 0,
        num_draft_tokens=sum(drafted), num_accepted_tokens=sum(accepted),
        drafted_per_position=drafted, accepted_per_position=accepted,
        num_output_tokens=num_output_tokens or num_requests, num_scheduled_tokens=num_tokens,
        verify_seconds=verify_seconds, wait_seconds=wait_seconds, draft_seconds=draft_seconds,
        drafter_idle_seconds=0.0, schedule_seconds=0.0, step_seconds=verify_seconds + wait_seconds,
        drafter_up=True, k=len(drafted),
    )


def run_steps(model: CostModel, template: StepRecord, count: int, gap_seconds: float) -> None:
    """Feed `count` copies of `template`, `gap_seconds` apart, starting when the model's last step ended."""
    last = model._previous
    step, now = (last.step + 1, last.started_at + last.step_seconds) if last is not None else (1, 0.0)
    for i in range(count):
        model.observe(replace(template, step=step + i, started_at=now + i * gap_seconds))


def test_accepted_length_comes_from_per_position_rates() -> None:
    profile = AcceptanceProfile(decay=1.0)
    for _ in range(10):
        profile.observe((10, 10, 10), (8, 4, 2))
    assert profile.survival(3) == pytest.approx([0.8, 0.4, 0.2])
    assert profile.expected_accepted_length(1) == pytest.approx(1.8)
    assert profile.expected_accepted_length(3) == pytest.approx(2.4)
    # Past the measured positions the last conditional rate (0.2 / 0.4) carries on: 0.1, then 0.05.
    assert profile.expected_accepted_length(5) == pytest.approx(2.55)
    # A single overall rate (14/30) would have said 1 + 3 * 0.467 = 2.4 at k=3 but 3.33 at k=5.


def test_acceptance_forgets_old_steps() -> None:
    profile = AcceptanceProfile(decay=0.9)
    for _ in range(50):
        profile.observe((10,), (9,))
    for _ in range(50):
        profile.observe((10,), (1,))
    assert profile.survival(1)[0] == pytest.approx(0.1, abs=0.01)


def test_cost_curve_interpolates_and_extrapolates_conservatively() -> None:
    curve = CostCurve()
    assert curve.predict(4) is None
    curve.observe(4, 0.010)
    # One point: cost assumed to grow like sqrt(size) above it, and not to fall below it.
    assert curve.predict(16) == pytest.approx(0.020)
    assert curve.predict(2) == pytest.approx(0.010)
    curve.observe(16, 0.022)
    assert curve.predict(10) == pytest.approx(0.016)
    assert curve.predict(28) == pytest.approx(0.034)  # the last segment's slope, 1 ms per unit
    assert curve.predict(1) >= 0.0025  # never below a quarter of the smallest measured cost


def _feed_linear(model: CostModel, a: float, b: float, c: float, d: float, acceptance: float) -> None:
    """V(tokens) = a + b * tokens, a k=1 draft of n requests costs c + d * n, no other per-step cost."""
    now = 0.0
    step = 0
    for n in (2, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        for _ in range(3):
            step += 1
            verify = a + b * 2 * n
            model.observe(record(step, now, num_requests=n, num_tokens=2 * n, verify_seconds=verify,
                                 draft_seconds=c + d * n, drafted=(n,), accepted=(round(n * acceptance),)))
            now += verify


def test_predicted_crossover_of_psd_and_sd_matches_the_hand_computed_one() -> None:
    # With k=1: sd costs c + dR + a + 2bR per step, psd 2(a + bR) while drafting stays shorter than verifying;
    # psd wins once a - c < dR, i.e. past R = (a - c) / d = 16 requests.
    model = CostModel()
    a, b, c, d = 0.010, 0.001, 0.002, 0.0005
    _feed_linear(model, a, b, c, d, acceptance=0.5)

    def rate(mode: str, running: int) -> float:
        prediction = model.predict(mode, 1, running)
        assert prediction is not None
        return prediction.output_tokens_per_second

    assert model.predict("sd", 1, 8).cycle_seconds == pytest.approx(0.032, rel=1e-6)  # type: ignore[union-attr]
    assert model.predict("psd", 1, 8).cycle_seconds == pytest.approx(0.036, rel=1e-6)  # type: ignore[union-attr]
    assert rate("sd", 8) > rate("psd", 8)
    assert rate("sd", 12) > rate("psd", 12)
    assert rate("psd", 20) > rate("sd", 20)
    assert rate("psd", 32) > rate("sd", 32)
    assert rate("psd", 16) == pytest.approx(rate("sd", 16))  # the crossover itself: a tie
    assert rate("sd", 14) > rate("psd", 14) and rate("psd", 18) > rate("sd", 18)
    # Tokens per cycle use the accepted length: 1.5 per request at acceptance 0.5 and k=1.
    assert model.predict("sd", 1, 8).tokens_per_cycle == pytest.approx(12.0)  # type: ignore[union-attr]


def test_ar_needs_no_drafting_estimates_and_speculation_needs_them() -> None:
    model = CostModel()
    now = 0.0
    for step in range(1, 10):
        model.observe(record(step, now, mode="ar", num_requests=4, num_tokens=4, verify_seconds=0.01))
        now += 0.01
    assert model.predict("ar", 0, 4) is not None
    assert model.predict("ar", 0, 4).output_tokens_per_second == pytest.approx(400.0)  # type: ignore[union-attr]
    assert model.predict("sd", 2, 4) is None
    assert model.predict("psd", 2, 4) is None


def test_per_step_overhead_is_measured_from_the_gaps_between_steps() -> None:
    model = CostModel()
    now = 0.0
    for step in range(1, 20):
        model.observe(record(step, now, mode="ar", num_requests=4, num_tokens=4, verify_seconds=0.01))
        now += 0.015  # 5 ms outside verification each step
    assert model.overhead["plain"].predict(4) == pytest.approx(0.005)
    assert model.predict("ar", 0, 4).output_tokens_per_second == pytest.approx(4 / 0.015)  # type: ignore[union-attr]


def test_widened_steps_keep_their_own_verify_costs() -> None:
    # On a CPU machine a step with nothing drafting beside it computes on the drafter's cores too: 8 tokens cost
    # 5 ms there and 10 ms beside a draft (psd). One shared curve would price each at the other's cost.
    model = CostModel()
    run_steps(model, replace(record(0, 0.0, mode="ar", num_requests=8, num_tokens=8, verify_seconds=0.005),
                             widened=True), 10, 0.005)
    # Until a step beside a draft is seen, the widened curve stands in for it.
    assert model._verify_curve(alone=False).predict(8) == pytest.approx(0.005)
    run_steps(model, record(0, 0.0, mode="psd", num_requests=4, num_tokens=8, verify_seconds=0.010,
                            draft_seconds=0.002, drafted=(4,), accepted=(2,)), 10, 0.010)
    assert model._verify_curve(alone=False).predict(8) == pytest.approx(0.010)
    assert model._verify_curve(alone=True).predict(8) == pytest.approx(0.005)
    # ar and sd are priced alone, psd's halves beside a draft.
    assert model.predict("ar", 0, 8).cycle_seconds == pytest.approx(0.005)  # type: ignore[union-attr]
    sd = model.predict("sd", 1, 4)
    psd = model.predict("psd", 1, 8)
    assert sd is not None and psd is not None
    assert sd.cycle_seconds == pytest.approx(0.002 + 0.005, rel=0.01)
    assert psd.cycle_seconds == pytest.approx(2 * 0.010, rel=0.01)
    assert model.predict("ar", 0, 8).cycle_seconds == pytest.approx(0.005, rel=0.05)  # type: ignore[union-attr]


def test_steps_without_drafts_keep_their_own_verify_costs() -> None:
    # 8 requests with one token each (ar) cost more than 2 requests with 4 tokens each (sd k=3): per-request work
    # (sampling, bookkeeping) is not per token. Keyed by tokens alone, ar would be priced at sd's cost.
    model = CostModel()
    run_steps(model, replace(record(0, 0.0, mode="ar", num_requests=8, num_tokens=8, verify_seconds=0.012),
                             widened=True), 10, 0.012)
    run_steps(model, replace(record(0, 0.0, num_requests=2, num_tokens=8, verify_seconds=0.006, draft_seconds=0.003,
                                    wait_seconds=0.003, drafted=(2, 2, 2), accepted=(2, 1, 1)), widened=True),
              10, 0.009)
    ar, sd = model.predict("ar", 0, 8), model.predict("sd", 3, 2)
    assert ar is not None and sd is not None
    assert ar.cycle_seconds == pytest.approx(0.012, rel=0.01)
    assert sd.cycle_seconds == pytest.approx(0.003 + 0.006, rel=0.01)
    # ar at 8 requests and sd at 2 were both measured: neither is an extrapolation; psd (beside a draft) is.
    assert not model.extrapolated("ar", 0, 8)
    assert not model.extrapolated("sd", 3, 2)
    assert model.extrapolated("psd", 3, 4)


def test_without_widening_sd_and_psd_share_the_curve_of_steps_with_drafts() -> None:
    # A GPU machine never lends the drafter's device: sd's verification is the same kind of step as psd's, so
    # having measured one, the other is not an extrapolation to be probed again and again.
    model = CostModel()
    run_steps(model, record(0, 0.0, mode="psd", num_requests=4, num_tokens=16, verify_seconds=0.008,
                            draft_seconds=0.004, drafted=(4, 4, 4), accepted=(3, 2, 1)), 19, 0.008)
    assert not model.widening_seen
    assert not model.extrapolated("sd", 3, 4)
    sd = model.predict("sd", 3, 4)
    assert sd is not None and sd.cycle_seconds == pytest.approx(0.004 + 0.008, rel=0.01)


def test_a_draft_costs_its_catch_up_then_one_forward_per_further_position() -> None:
    # The drafter reports 6 ms up to the first drafted token (catching up on committed tokens) of a 10 ms, k=3 job
    # for 4 requests: each further position costs 2 ms, so k=1 costs 6 ms and k=5 14 ms (k * 10/3 would give
    # 3.3 and 16.7 ms).
    model = CostModel()
    run_steps(model, replace(record(0, 0.0, num_requests=4, num_tokens=16, verify_seconds=0.004, draft_seconds=0.010,
                                    wait_seconds=0.010, drafted=(4, 4, 4), accepted=(3, 2, 1)),
                             widened=True, draft_first_token_seconds=0.006), 19, 0.014)
    assert model._draft_seconds(4, 3) == pytest.approx(0.010)
    assert model._draft_seconds(4, 1) == pytest.approx(0.006)
    assert model._draft_seconds(4, 5) == pytest.approx(0.014)
    # Drafting at k=1 needs only the first-token curve; 2..5 share one further-position curve: all measured.
    assert model._drafting_covers(4, 1, 1.5) and model._drafting_covers(4, 5, 1.5)
    assert not model._drafting_covers(16, 3, 1.5)


def test_a_drafter_that_does_not_split_its_time_is_modelled_as_equal_forwards() -> None:
    model = CostModel()
    run_steps(model, replace(record(0, 0.0, num_requests=4, num_tokens=16, verify_seconds=0.004, draft_seconds=0.009,
                                    wait_seconds=0.009, drafted=(4, 4, 4), accepted=(3, 2, 1)), widened=True),
              19, 0.013)
    assert model._draft_seconds(4, 1) == pytest.approx(0.003)
    assert model._draft_seconds(4, 3) == pytest.approx(0.009)


def test_cost_curve_is_nondecreasing_and_a_young_outlier_is_pooled_not_followed() -> None:
    """Mature buckets at 4 and 8 tokens (5 and 7 ms); two steps at 6 tokens took 12 ms (the end of requests, a
    hiccup). Followed as measured, 6 tokens would cost more than 8; pooled with its heavier neighbour (weights 2
    and 10, the smoothing's memory), both read (2 x 12 + 10 x 7) / 12 ms."""
    curve = CostCurve()
    for _ in range(40):
        curve.observe(4, 0.005)
        curve.observe(8, 0.007)
    curve.observe(6, 0.012)
    curve.observe(6, 0.012)
    pooled = (2 * 0.012 + 10 * 0.007) / 12
    assert curve.points() == [(4, pytest.approx(0.005)), (6, pytest.approx(pooled)), (8, pytest.approx(pooled))]
    assert curve.predict(5) < curve.predict(6) <= curve.predict(7) <= curve.predict(8)  # type: ignore[operator]
    # A nondecreasing curve is left exactly as measured.
    rising = CostCurve()
    for size, seconds in ((2, 0.003), (4, 0.004), (8, 0.009)):
        rising.observe(size, seconds)
    assert rising.points() == [(2, 0.003), (4, 0.004), (8, 0.009)]


# Verification priced by shape (requests x tokens per request), as the H200 curves measure it: at equal tokens a
# step of more requests costs more (each reads its own KV cache). 32 requests x 3 tokens: 27.8 ms; 16 x 6: 23.8 ms.
H200_SHAPES = {(32, 3): 0.0278, (16, 6): 0.0238, (32, 1): 0.0220, (16, 1): 0.0205, (16, 4): 0.0244}


def _shape_record(requests: int, q: int, mode: str = "sd") -> StepRecord:
    drafted = (requests,) * (q - 1)
    return record(0, 0.0, mode=mode, num_requests=requests, num_tokens=requests * q,
                  verify_seconds=H200_SHAPES[(requests, q)], drafted=drafted, accepted=drafted,
                  draft_seconds=0.003 * (q - 1) if q > 1 else 0.0)


def _run_shape(model: CostModel, requests: int, q: int, count: int, mode: str = "sd") -> None:
    template = _shape_record(requests, q, mode)
    run_steps(model, template, count, template.verify_seconds)  # back to back: no overhead beyond verification


def test_equal_tokens_in_other_shapes_keep_their_own_costs() -> None:
    model = CostModel()
    for _ in range(3):
        _run_shape(model, 32, 3, 10)  # sd, k=2, 32 requests
        _run_shape(model, 16, 6, 10, mode="psd")  # psd, k=5, 16 a side
    # A tokens-only curve blends both into one 96-token price (~25.8 ms) and misprices psd's half-batch steps.
    assert model._verify_seconds(16, 5, alone=False) == pytest.approx(0.0238, rel=0.01)
    assert model._verify_seconds(32, 2, alone=False) == pytest.approx(0.0278, rel=0.01)


def test_a_shape_two_tokens_beyond_any_measured_at_this_batch_counts_as_extrapolated() -> None:
    # psd k=3 at 32 requests (16 x 4 a side) and sd k=2 at 32 (32 x 3): psd k=5 (16 x 6 a side) verifies 96 tokens,
    # as many as sd's steps, but its shape never ran at 16 requests: its price is the tokens curve (32-request steps,
    # 27.8 ms) scaled, while 16 x 6 verifies in 23.8 ms. Auto must treat that price as a guess (and measure it when
    # it comes close), not as measured; psd k=4 (16 x 5) lies within a token per request of the measured shape.
    model = CostModel()
    for _ in range(3):
        _run_shape(model, 16, 4, 10, mode="psd")
        _run_shape(model, 32, 3, 10)
    assert not model.widening_seen
    assert not model.extrapolated("psd", 3, 32)
    assert not model.extrapolated("psd", 4, 32)
    assert model.extrapolated("psd", 5, 32)
    assert model._verify_seconds(16, 5, alone=False) > 0.0238 * 1.05  # the guess it is: dearer than the shape runs
    _run_shape(model, 16, 6, 10, mode="psd")
    assert not model.extrapolated("psd", 5, 32)
    assert model._verify_seconds(16, 5, alone=False) == pytest.approx(0.0238, rel=0.01)


def test_a_longer_draft_on_a_flat_target_is_priced_from_the_shapes_either_side_not_feared() -> None:
    # A memory-bound target: ar (1 token each) and k=3 (4 tokens each) measured at 16 requests. k=5 (6 tokens each)
    # was never run: it is priced linearly in tokens per request (24.4 + 2/3 * (24.4 - 20.5) = 27.0 ms), not by the
    # tokens curve's conservative growth beyond its largest size (+41% at 1.5x the tokens).
    model = CostModel()
    _run_shape(model, 16, 1, 20, mode="ar")
    _run_shape(model, 16, 4, 20)
    assert model._verify_seconds(16, 5) == pytest.approx(0.0244 + (0.0244 - 0.0205) * 2 / 3, rel=0.01)


def test_drafting_is_priced_by_the_jobs_own_size_not_the_requests_verified_with_its_drafts() -> None:
    # The first psd step after an sd probe at k=1 verifies 32 requests with drafts of a job that drafted 64 requests
    # one token each (8 ms). Priced by what the step verified, that job would say "32 requests, 8 ms a position".
    model = CostModel()
    steady = replace(record(0, 0.0, mode="psd", num_requests=32, num_tokens=128, verify_seconds=0.009,
                            draft_seconds=0.009, drafted=(32, 32, 32), accepted=(24, 18, 14)),
                     draft_job_requests=32, draft_job_length=3)
    run_steps(model, steady, 10, 0.009)
    after_probe = replace(steady, draft_seconds=0.008, draft_job_requests=64, draft_job_length=1)
    run_steps(model, after_probe, 1, 0.009)
    assert model._draft_seconds(32, 3) == pytest.approx(0.009, rel=0.01)
    assert model._draft_seconds(64, 1) == pytest.approx(0.008, rel=0.01)


# -- catch-up tokens priced per token (issue 26) ---------------------------------------------------------------------

def _job_record(step: int, *, requests: int, k: int, catch_up_tokens: int, loop_seconds: float,
                price_seconds: float, first_share: float = 0.4, split: bool = True) -> StepRecord:
    """A psd step whose verified job of `requests` requests and length k carried `catch_up_tokens`: it took
    loop_seconds (first_share of it up to the first token) plus the tokens at `price_seconds` each."""
    catch_up = catch_up_tokens * price_seconds
    first = first_share * loop_seconds + catch_up
    base = record(step, step * 0.05, mode="psd", num_requests=requests, num_tokens=requests * (k + 1),
                  verify_seconds=0.02, draft_seconds=loop_seconds + catch_up, drafted=(requests,) * k,
                  accepted=tuple(max(0, requests - i * requests // (k + 1)) for i in range(1, k + 1)))
    return replace(base, draft_first_token_seconds=first if split else 0.0, draft_job_requests=requests,
                   draft_job_length=k, draft_job_catch_up_tokens=catch_up_tokens)


@pytest.mark.parametrize("split", [True, False], ids=["first-token-split", "whole-job-only"])
def test_the_catch_up_price_per_token_is_recovered_from_jobs_of_several_sizes(split: bool) -> None:
    """Jobs of 2, 4 and 8 requests (their loops costing anything) carry steady deltas and, now and then, a
    newcomer's prompt; the per-token price comes back, and the loop curves hold the loop alone."""
    price = 0.00004  # 40 us per token
    loops = {2: 0.003, 4: 0.0045, 8: 0.009}
    model = CostModel()
    step = 0
    for i in range(60):
        for requests, loop in loops.items():
            step += 1
            tokens = requests * (i % 3) + (300 if i % 7 == 3 else 0)  # deltas of 0-2 accepted; a prompt now and then
            model.observe(_job_record(step, requests=requests, k=3, catch_up_tokens=tokens, loop_seconds=loop,
                                      price_seconds=price, split=split))
    fitted = model.catch_up.seconds_per_token()
    assert fitted == pytest.approx(price, rel=0.02)
    # The loop alone at 4 requests (0.4 of it to the first token), priced without the average catch-up in it.
    first = model.draft_first.predict(4)
    assert first == pytest.approx(0.4 * 0.0045 if split else 0.0045 / 3, rel=0.1)
    # A predicted job adds the expected catch-up: per request its accepted drafts plus the churn seen lately.
    expected_tokens = 4 * (model.acceptance.expected_accepted_length(3) - 1 + model.churn_tokens_per_request)
    assert model.catch_up_seconds(4, 3) == pytest.approx(price * expected_tokens, rel=0.03)
    assert model.churn_tokens_per_request > 0


def test_the_catch_up_price_stays_unknown_until_the_tokens_vary() -> None:
    model = CostModel()
    for step in range(1, 40):
        model.observe(_job_record(step, requests=4, k=3, catch_up_tokens=8, loop_seconds=0.004,
                                  price_seconds=0.0001))
    assert model.catch_up.seconds_per_token() is None
    # Unknown price: the first-token curve keeps the average catch-up in it, as before (nothing subtracted).
    assert model.draft_first.predict(4) == pytest.approx(0.4 * 0.004 + 8 * 0.0001)
    assert model.catch_up_seconds(4, 3) == 0.0


def test_churn_makes_drafting_dearer_only_once_priced() -> None:
    """Two models see the same loops; one sees newcomers' prompts in its jobs. Its drafting prediction is dearer
    by the churn at the fitted price, where one fed only steady deltas predicts the loop."""
    calm, churned = CostModel(), CostModel()
    for step in range(1, 80):
        steady = 4 * (step % 4)
        calm.observe(_job_record(step, requests=4, k=3, catch_up_tokens=steady, loop_seconds=0.004,
                                 price_seconds=0.0001))
        churned.observe(_job_record(step, requests=4, k=3, catch_up_tokens=steady + (200 if step % 5 == 0 else 0),
                                    loop_seconds=0.004, price_seconds=0.0001))
    assert churned._draft_seconds(4, 3) > calm._draft_seconds(4, 3) + 0.0001 * 4 * 5


# -- steps scheduled ahead (async PSD steps, issue 28) ---------------------------------------------------------------

def test_steps_scheduled_ahead_teach_their_own_host_work_and_price_psd_when_async() -> None:
    """Synchronous psd steps show 3 ms of host work between them; steps scheduled ahead overlap the previous one,
    so their start-to-start gaps are shorter than their own forward. Those must not be read as host work (which
    would make sd, priced from psd's kind of step where the target never widens, look 3 ms a step cheaper), and
    psd is priced from what such steps left unhidden once the engine runs them."""
    sync, mixed = CostModel(), CostModel(async_psd_steps=True)
    template = record(1, 0.0, mode="psd", num_requests=8, num_tokens=32, verify_seconds=0.020, draft_seconds=0.01,
                      drafted=(8, 8, 8), accepted=(6, 4, 2))
    for model in (sync, mixed):
        run_steps(model, template, 40, gap_seconds=0.023)  # 20 ms forward + 3 ms host work, in series
    ahead = replace(template, scheduled_ahead=True, step_seconds=0.0205)  # 0.5 ms of it left unhidden
    last = mixed._previous
    assert last is not None
    for i in range(40):
        # Scheduled while the previous step computed: 8 ms after its start, 20.5 ms apart at their ends.
        mixed.observe(replace(ahead, step=last.step + 1 + i, started_at=last.started_at + 0.008 + i * 0.0205))
    overhead_sync = sync._curve(sync.overhead, "beside").predict(8)
    assert overhead_sync == pytest.approx(0.003, rel=0.01)
    # The synchronous host work is not dragged down by the overlapped steps' gaps ...
    assert mixed._curve(mixed.overhead, "beside").predict(8) == pytest.approx(0.003, rel=0.01)
    # ... and psd, run ahead, is priced from what those steps left unhidden.
    assert mixed.overhead_ahead.predict(8) == pytest.approx(0.0005, rel=0.01)
    assert mixed._verify_seconds(4, 3, alone=False) < sync._verify_seconds(4, 3, alone=False) - 0.002
    # sd (the same kind of step on a machine that never widens) keeps the synchronous host work.
    assert mixed._verify_seconds(8, 3, alone=True) == pytest.approx(sync._verify_seconds(8, 3, alone=True))
