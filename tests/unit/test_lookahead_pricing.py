"""Lookahead's pricing in the cost model and auto: the hit share from acceptance and the drafter's ranks, and the
step's arithmetic (the whole batch verified beside an R x F branch job) on hand-built costs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from minedraft.engine.control.auto import AutoController, AutoSettings
from minedraft.engine.control.cost_model import (
    ALONE,
    BESIDE,
    LOOKAHEAD,
    PLAIN,
    CostModel,
    branch_hit_rate,
    outcome_probabilities,
)
from minedraft.engine.control.stats import StepRecord

RANKS = (0.5, 0.25, 0.25)  # P(rank = 2, 3, 4 | rank >= 2): a hand-checkable stand-in for the measured one


def test_outcomes_are_accepted_length_times_bonus_rank() -> None:
    outcomes = outcome_probabilities([0.8, 0.8], 1, RANKS)
    # a = 1, bonus the drafter's top choice: 0.8 * 0.8; a = 0, bonus rank 2: 0.2 * 0.5; a = 1, rank 2: 0.8*0.2*0.5
    assert outcomes[0] == pytest.approx((0.64, 1, 1))
    assert outcomes[1] == pytest.approx((0.1, 0, 2))
    assert outcomes[2] == pytest.approx((0.08, 1, 2))
    assert sum(o[0] for o in outcomes) == pytest.approx(1.0)


def test_hit_share_is_the_steady_drafted_share() -> None:
    # k = 1, F = 1: a drafted request hits with 0.64, a plain one with 0.8 (its root's first token the drafter's
    # top choice): p = 0.8 / (1 - 0.64 + 0.8).
    assert branch_hit_rate([0.8, 0.8], 1, 1, RANKS) == pytest.approx(0.8 / 1.16)
    # F = 2 adds (a=0, rank 2) to the drafted (0.74); a plain one still has its root alone.
    assert branch_hit_rate([0.8, 0.8], 1, 2, RANKS) == pytest.approx(0.8 / (1 - 0.74 + 0.8))
    # More branches never hit less; longer drafts have more outcomes to cover.
    rates = [branch_hit_rate([0.8] * 5, 3, f) for f in (1, 2, 3, 4)]
    assert rates == sorted(rates)
    assert branch_hit_rate([0.8] * 5, 1, 2) > branch_hit_rate([0.8] * 5, 3, 2)


def priced_model(verify_ms: dict[int, float], draft_first_ms: dict[int, float], draft_next_ms: dict[int, float],
                 acceptance: float = 0.8, beside_factor: float = 1.0) -> CostModel:
    """A cost model whose curves hold the given points (requests or tokens -> ms). `beside_factor` > 1: the target
    verifies on the drafter's cores when nothing drafts (widened: sd's steps) and that much slower beside a draft
    (psd's, lookahead's): a CPU whose cores both share."""
    model = CostModel()
    kinds = {PLAIN: 1.0, BESIDE: beside_factor} | ({ALONE: 1.0} if beside_factor != 1.0 else {})
    model.widening_seen = beside_factor != 1.0
    for kind, factor in kinds.items():
        for tokens, ms in verify_ms.items():
            model.verify[kind].observe(tokens, factor * ms / 1000)
    for requests, ms in draft_first_ms.items():
        model.draft_first.observe(requests, ms / 1000)
    for requests, ms in draft_next_ms.items():
        model.draft_next.observe(requests, ms / 1000)
    for _ in range(50):
        model.acceptance.observe((1000,) * 6, tuple(round(1000 * acceptance ** (i + 1)) for i in range(6)))
    model.acceptance.decay = 1.0
    return model


# A memory-bound target (GPU-like): verification flat in tokens up to 1024; a cheap drafter, flat in batch.
GPU: dict[str, Any] = dict(verify_ms={1: 20.0, 1024: 20.5},
                           draft_first_ms={1: 3.0, 1024: 3.2}, draft_next_ms={1: 3.0, 1024: 3.2})
# Two CPU cores shared by target and drafter: verification compute-bound and twice as slow beside a draft; a drafter
# costing a third of the target per token, so branch jobs F times the batch take the cores for long.
CPU: dict[str, Any] = dict(verify_ms={1: 1.0, 1024: 400.0}, draft_first_ms={1: 0.5, 1024: 130.0},
                           draft_next_ms={1: 0.5, 1024: 130.0}, beside_factor=2.0)


def test_lookahead_wins_where_drafting_hides_behind_a_flat_verify() -> None:
    model = priced_model(**GPU)
    sd = model.predict("sd", 3, 16)
    lookahead = model.predict(LOOKAHEAD, 3, 16, fanout=4)
    assert sd is not None and lookahead is not None
    # sd: 16 x 2.952 tokens per 9 + 20 ms. Lookahead: the branch job (64 requests, 9 ms) hides behind the verify
    # (20 ms at 16 x (1 + 3h) tokens); 16 x (h 2.952 + 1 - h) tokens, h derived (0.71 at 0.8 acceptance).
    h = branch_hit_rate(model.acceptance.conditionals(4), 3, 4)
    assert lookahead.hit_rate == pytest.approx(h)
    assert lookahead.cycle_seconds == pytest.approx(0.020 + 0.5e-3 * (16 * (1 + 3 * h) - 1) / 1023, rel=1e-3)
    assert lookahead.tokens_per_cycle == pytest.approx(16 * (h * 2.952 + 1 - h), rel=1e-3)
    assert lookahead.output_tokens_per_second > 1.1 * sd.output_tokens_per_second
    # Auto, fed the same model, chooses lookahead (and a fan-out) at this load.
    controller = AutoController(AutoSettings(allowed_modes=("ar", "sd", "psd", LOOKAHEAD),
                                             fanout_candidates=(1, 2, 3, 4)), "sd", 3, model)
    ranked = model.predict_all(16, controller.settings.allowed_modes, controller.settings.k_candidates,
                               controller.settings.fanout_candidates)
    best = max(ranked, key=lambda p: p.output_tokens_per_second)
    assert best.mode == LOOKAHEAD and best.fanout >= 2


def test_lookahead_loses_where_branch_jobs_cost_as_much_as_verifying() -> None:
    model = priced_model(**CPU)
    sd = model.predict("sd", 3, 16)
    best = max((model.predict(LOOKAHEAD, k, 16, fanout=f) for k in (1, 2, 3) for f in (1, 2, 3, 4)),
               key=lambda p: p.output_tokens_per_second if p else 0.0)
    assert sd is not None and best is not None
    # Verifying beside the branch job costs twice what sd's verification alone does, and a miss's next step has no
    # draft: the overlap does not pay for either.
    assert best.output_tokens_per_second < sd.output_tokens_per_second
    # The same costs without the contention (a drafter device of its own) turn it around.
    own = priced_model(**(CPU | {"beside_factor": 1.0}))
    own_best = max(own.predict(LOOKAHEAD, 3, 16, fanout=f).output_tokens_per_second for f in (1, 2))  # type: ignore[union-attr]
    assert own_best > own.predict("sd", 3, 16).output_tokens_per_second  # type: ignore[union-attr]


def test_measured_hits_replace_the_derived_rate_and_scale_other_fanouts() -> None:
    model = priced_model(**GPU)
    derived_2 = model.lookahead_hit_rate(3, 2)
    derived_4 = model.lookahead_hit_rate(3, 4)
    model.lookahead_hits.decay = 1.0
    model.lookahead_hits.observe(3, 2, hits=4000, requests=10000)  # 0.4, well below the derived rate, at F = 2
    assert model.lookahead_hit_rate(3, 2) == pytest.approx(0.4, abs=0.005)
    # Another fan-out at the same k: the requests measured at F = 2 count, each hit scaled by the derived rates.
    prior = model.lookahead_hits.prior_requests
    assert model.lookahead_hit_rate(3, 4) == pytest.approx((4000 * derived_4 / derived_2 + prior * derived_4)
                                                           / (10000 + prior))


def test_a_short_probes_hit_share_is_shrunk_towards_what_the_running_setting_says() -> None:
    """A 12-step probe at 4 requests sees ~40 requests: its hit share is weighed against the prior (the derived rate
    scaled by the setting that ran long), not taken as is. Taken as is, a low draw (0.53 where 0.63 runs) priced
    k=5 below k=4 for good."""
    model = priced_model(**GPU)
    hits = model.lookahead_hits
    hits.decay = 1.0
    derived_4, derived_5 = model.lookahead_hit_rate(4, 4), model.lookahead_hit_rate(5, 4)
    hits.observe(4, 4, hits=round(1600 * derived_4), requests=1600)  # k=4 ran long, at its derived rate
    hits.observe(5, 4, hits=20, requests=38)  # the probe of k=5: 0.53
    prior = derived_5 * hits.measured(4, 4) / derived_4  # type: ignore[operator]
    assert model.lookahead_hit_rate(5, 4) == pytest.approx((20 + hits.prior_requests * prior)
                                                           / (38 + hits.prior_requests))
    assert 20 / 38 < model.lookahead_hit_rate(5, 4) < prior


def test_the_branch_job_drafts_a_hits_fanout_and_a_misss_root() -> None:
    """A branch job holds F branches for each request that hit and one root for each that missed, k + 1 deep only
    where some request missed. Priced as R x F items always k + 1 deep, a slow drafter's job outlasted the
    verification where it hides behind it (at one request, 85% of jobs are hits alone, k deep)."""
    slow: dict[str, Any] = dict(verify_ms={1: 20.0, 1024: 20.5}, draft_first_ms={1: 15.0, 1024: 16.0},
                                draft_next_ms={1: 15.0, 1024: 16.0})
    model = priced_model(**slow)
    hit = model.lookahead_hit_rate(1, 4)
    one = model.predict(LOOKAHEAD, 1, 1, fanout=4)
    assert one is not None
    verify = model._shaped_verify_seconds(BESIDE, 1, 1 + hit)
    assert verify is not None
    hit_job = model._draft_seconds(4, 1)  # four branches, one token each: hides behind the verification
    miss_job = model._draft_seconds(1, 2)  # the miss's root, two deep: outlasts it
    assert hit_job < verify < miss_job
    assert one.cycle_seconds == pytest.approx(hit * verify + (1 - hit) * miss_job, rel=1e-6)
    # Measured items per request (fewer than F per hit where outcomes are unlikely) price the job at 16 requests.
    model.lookahead_hits.decay = 1.0
    model.lookahead_hits.observe_job_items(3, 4, items=48 * 10, requests=16 * 10)
    assert model.lookahead_hits.items_per_request(3, 4, 0.6) == pytest.approx(3.0)
    assert model.lookahead_hits.items_per_request(2, 4, 0.6) == pytest.approx(0.6 * 4 + 0.4)


def test_misses_verified_with_backups_cost_their_tokens_but_gain_nothing() -> None:
    model = priced_model(**(CPU | {"beside_factor": 1.0}))  # verification linear in tokens
    plain = model.predict(LOOKAHEAD, 3, 16, fanout=2)
    model.lookahead_hits.observe_proposed(3, 1.0, requests=64)  # every miss verified with a backup's k tokens
    backed = model.predict(LOOKAHEAD, 3, 16, fanout=2)
    assert plain is not None and backed is not None
    assert backed.tokens_per_cycle == pytest.approx(plain.tokens_per_cycle)
    assert backed.cycle_seconds == pytest.approx(model._shaped_verify_seconds(BESIDE, 16, 4.0), rel=1e-6)
    assert backed.cycle_seconds > plain.cycle_seconds


def lookahead_record(step: int, hits: int, misses: int, *, backups: int = 0, k: int = 3,
                     fanout: int = 2, prefills: int = 0, job_items: int = 0) -> StepRecord:
    """A lookahead step of hits + misses decoding requests: hits verified with k drafted tokens (2 accepted each),
    `backups` of the misses with a backup branch's k tokens (none accepted)."""
    drafted = hits + backups
    return StepRecord(
        step=step, started_at=0.02 * step, mode=LOOKAHEAD, verified_group=0, group_sizes=(hits + misses, 0),
        num_decode_requests=hits + misses, num_prefill_requests=prefills, num_requests_with_drafts=drafted,
        num_draft_tokens=k * drafted, num_accepted_tokens=2 * hits,
        drafted_per_position=(drafted,) * k, accepted_per_position=(hits, hits, 0),
        num_output_tokens=3 * hits + misses, num_scheduled_tokens=(hits + misses) + k * drafted,
        verify_seconds=0.02, wait_seconds=0.0, draft_seconds=0.005, drafter_idle_seconds=0.0, schedule_seconds=0.0,
        step_seconds=0.02, drafter_up=True, k=k, num_branch_hits=hits, num_branch_misses=misses,
        lookahead_fanout=fanout, draft_job_requests=job_items, draft_job_length=k if job_items else 0)


def test_busy_steps_teach_the_hit_share_and_the_branch_jobs_time() -> None:
    """At high load nearly every step takes in a prompt and holds a miss verified with a backup: such steps still
    count hits over their decoding requests, and their branch job (its items, its seconds) still prices jobs."""
    model = CostModel()
    for step in range(1, 8):
        model.observe(lookahead_record(step, 12, 4, backups=4, prefills=1, job_items=28))
    assert model.lookahead_hits.measured(3, 2) == pytest.approx(0.75)
    assert model.draft_first.covers(28, 1.01) and model.draft_next.covers(28, 1.01)
    assert not model.acceptance.drafted, "backups still teach no acceptance"


def test_hits_are_learned_past_a_switchs_first_steps_and_backups_teach_no_acceptance() -> None:
    model = CostModel()
    # The first two lookahead steps after a switch hold no branches yet: all misses, not the mode's hit rate.
    model.observe(lookahead_record(1, 0, 16))
    model.observe(lookahead_record(2, 0, 16))
    assert model.lookahead_hits.counts == {}
    for step in range(3, 8):
        model.observe(lookahead_record(step, 12, 4, backups=4))
    assert model.lookahead_hits.measured(3, 2) == pytest.approx(0.75)
    assert model.lookahead_fanout == 2
    # Every request verified with k tokens (hits and backups): the verification's share, beyond the hits.
    assert model.lookahead_hits.proposed_share(3, 0.75) == pytest.approx(1.0)
    # Steps with backups (drafts for outcomes that did not happen) leave acceptance unlearned; clean ones teach it.
    assert not model.acceptance.drafted
    model.observe(lookahead_record(8, 16, 0))
    assert model.acceptance.drafted[0] == pytest.approx(16)


def test_a_new_k_is_a_switch_whose_first_steps_teach_no_hit_rate() -> None:
    """After lookahead changes k, the first steps verify branches drafted for the old k's outcomes."""
    model = CostModel()
    for step in range(1, 6):
        model.observe(lookahead_record(step, 12, 4))
    model.observe(lookahead_record(6, 16, 0, k=2))
    model.observe(lookahead_record(7, 16, 0, k=2))
    assert (2, 2) not in model.lookahead_hits.counts
    model.observe(lookahead_record(8, 16, 0, k=2))
    assert model.lookahead_hits.counts[(2, 2)][1] == pytest.approx(16)


def test_auto_prices_the_running_lookahead_at_the_fanout_its_core_runs() -> None:
    """The core moves lookahead's fan-out with measured times, whatever auto chose; auto prices lookahead at the
    fan-out run last. The running setting must be found among those predictions: otherwise it has no price, and any
    other setting wins without a margin (eager drafting, 8 requests: a switch to sd k=1, 4% slower)."""
    model = priced_model(**GPU)
    model.lookahead_fanout = 2  # the core ran F = 2 last
    settings = AutoSettings(allowed_modes=("sd", LOOKAHEAD), k_candidates=(3,), min_dwell_steps=0,
                            close_call_margin=None, stale_after_steps=10**9)
    controller = AutoController(settings, LOOKAHEAD, 3, model, fanout=4)  # auto last chose F = 4
    controller._steps_at_load = {"sd": {16: 12}, LOOKAHEAD: {16: 100}}
    controller._last_run = {"sd": 0, LOOKAHEAD: 0}
    controller._window_running = [16]
    assert controller.decide(step=100) is None


def test_a_stale_mode_predicted_far_below_the_running_one_is_not_probed() -> None:
    """Costs drift; they do not halve. At a few requests ar runs at ~0.4 of lookahead, and probing it every
    `stale_after_steps` cost auto 2-3% by itself; sd, predicted close, is still refreshed."""
    model = priced_model(**GPU)
    model.lookahead_hits.observe(3, 4, hits=70, requests=100)

    def controller(floor: float | None) -> AutoController:
        settings = AutoSettings(allowed_modes=("ar", LOOKAHEAD), k_candidates=(3,), min_dwell_steps=0,
                                close_call_margin=None, stale_after_steps=100, stale_probe_floor=floor)
        made = AutoController(settings, LOOKAHEAD, 3, model, fanout=4)
        made._steps_at_load = {"ar": {2: 100}, LOOKAHEAD: {2: 1000}}
        made._last_run = {"ar": 0, LOOKAHEAD: 1000}
        made._steps_seen = 1000
        made._window_running = [2]
        return made

    ar = model.predict("ar", 0, 2)
    lookahead = model.predict(LOOKAHEAD, 3, 2, fanout=4)
    assert ar is not None and lookahead is not None
    assert ar.output_tokens_per_second < 0.5 * lookahead.output_tokens_per_second
    assert controller(0.5).decide(step=1000) is None
    probe = controller(None).decide(step=1000)
    assert probe is not None and probe.kind == "probe" and probe.mode == "ar"


def test_misses_drafted_afresh_are_priced_at_an_sd_steps_tokens_and_the_wait_for_them() -> None:
    """At one request on a CPU the engine drafts most misses from their real context and waits (a refresh): such a
    miss makes L(k) tokens, not one, and its step lasts the wait longer. Learned per k and load from step records;
    nothing learned (the twin never refreshes) leaves the price as it was."""
    model = priced_model(**(CPU | {"beside_factor": 1.0}))
    before = model.predict(LOOKAHEAD, 3, 1, fanout=4)
    assert before is not None
    hit = before.hit_rate
    # Twelve steps of one request at k=3 that missed (the first two, after the switch, teach nothing): of the ten
    # learned from, eight refreshed, each waiting 4 ms for its draft.
    for step in range(1, 13):
        refreshed = step > 4
        model.observe(replace(lookahead_record(step, 0, 1, k=3, fanout=4), num_refreshed=int(refreshed),
                              refresh_seconds=0.004 if refreshed else 0.0))
    share, wait = model.lookahead_hits.refresh_at(3, 1)
    assert (share, wait) == (pytest.approx(0.8, abs=0.01), pytest.approx(0.0032, abs=1e-4))
    after = model.predict(LOOKAHEAD, 3, 1, fanout=4)
    assert after is not None
    hit = after.hit_rate  # (the misses taught a lower hit share too)
    length = model.acceptance.expected_accepted_length(3)
    assert after.tokens_per_cycle == pytest.approx(hit * length + (1 - hit) * (share * length + 1 - share))
    assert after.tokens_per_cycle > hit * length + 1 - hit
    # Another load saw no refreshes: priced as before; another k at this load takes k=3's share, its wait scaled by
    # its forwards (k + 1).
    assert model.lookahead_hits.refresh_at(3, 4) == (0.0, 0.0)
    assert model.lookahead_hits.refresh_at(2, 1) == (pytest.approx(share), pytest.approx(wait * 3 / 4))
    without = priced_model(**(CPU | {"beside_factor": 1.0}))
    for step in range(1, 13):
        without.observe(lookahead_record(step, 0, 1, k=3, fanout=4))
    plain = without.predict(LOOKAHEAD, 3, 1, fanout=4)
    assert plain is not None and plain.hit_rate == pytest.approx(hit)
    assert plain.tokens_per_cycle == pytest.approx(hit * length + 1 - hit)
    # The step with a miss lasts the refresh's wait longer (every step here has one at a hit share this low).
    assert after.cycle_seconds - plain.cycle_seconds == pytest.approx((1 - hit) * wait, rel=1e-6)
