"""Lookahead's refreshes in the cost model: a miss drafted afresh from its real context before the step (the engine
does so where misses are most of the batch: one request) gains an accepted length like a hit, and the step waits
for that draft first. Priced without them, lookahead at one request was credited one token per refreshed miss and
ranked below sd on this CPU, where it runs 1.2-1.4x sd. And lookahead's steps without drafts are not ar's kind of
step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from minedraft.engine.control.cost_model import BESIDE, LOOKAHEAD, CostModel
from tests.unit.test_lookahead_pricing import CPU, lookahead_record, priced_model

WAIT_SECONDS = 0.0015


def refreshing(steps: int = 40) -> list[tuple[int, int, int, float]]:
    """(running, misses, refreshed, refresh seconds) of one-request steps: every other one a miss, refreshed."""
    return [(1, step % 2, step % 2, WAIT_SECONDS * (step % 2)) for step in range(steps)]


def test_a_refreshed_miss_gains_an_accepted_length_and_its_wait_is_priced() -> None:
    model = priced_model(**CPU)
    plain = model.predict(LOOKAHEAD, 3, 1, fanout=2)
    for row in refreshing():
        model.lookahead_refresh.observe(*row)
    refreshed = model.predict(LOOKAHEAD, 3, 1, fanout=2)
    assert plain is not None and refreshed is not None
    accepted_length = model.acceptance.expected_accepted_length(3)
    # Every miss refreshed: each step makes an accepted length, as sd's does (without: misses made one token).
    assert refreshed.tokens_per_cycle == pytest.approx(accepted_length)
    assert plain.tokens_per_cycle < accepted_length - 0.5
    # One wait per step that misses (one request: a miss is a refresh).
    miss = 1.0 - refreshed.hit_rate
    assert refreshed.cycle_seconds == pytest.approx(plain.cycle_seconds + miss * WAIT_SECONDS)
    assert refreshed.output_tokens_per_second > plain.output_tokens_per_second


def test_refreshes_measured_at_one_request_do_not_price_a_far_load() -> None:
    """At 16 requests misses are a small share and the engine verifies them at once: a refresh share measured at one
    request would credit lookahead there with gains it never has."""
    model = priced_model(**CPU)
    plain = model.predict(LOOKAHEAD, 3, 16, fanout=2)
    for row in refreshing():
        model.lookahead_refresh.observe(*row)
    assert model.predict(LOOKAHEAD, 3, 16, fanout=2) == plain


def test_lookahead_steps_teach_the_refreshes() -> None:
    model = priced_model(**CPU)
    for step in range(1, 30):
        hit = step % 2 == 0
        record = lookahead_record(step, int(hit), int(not hit), backups=int(not hit))
        if not hit:
            record = replace(record, num_branch_refreshed=1, refresh_seconds=WAIT_SECONDS)
        model.observe(record)
    assert model.lookahead_refresh.refreshed_share_of_misses(1) == pytest.approx(1.0)
    # One request, half of them missing and refreshed: half a wait per step.
    assert model.lookahead_refresh.wait_seconds_per_step(1, 0.5) == pytest.approx(0.5 * WAIT_SECONDS)
    assert model.lookahead_refresh.wait_seconds_per_step(16, 0.5) == 0.0


def test_lookahead_steps_without_drafts_do_not_price_ar() -> None:
    """A lookahead step without drafts (after a switch, or all misses) verifies beside its branch job on the target's
    own cores; ar's steps are widened onto the drafter's. Learned as ar's, 16-request lookahead steps made ar look
    measured at 16 requests (and slow), so auto never probed it there."""
    model = CostModel()
    # ar measured at one request only (a probe there): at 16 it is extrapolated, which auto answers with a probe.
    for step in range(1, 20):
        model.observe(replace(lookahead_record(step, 0, 1), mode="ar", k=0, num_requests_with_drafts=0,
                              num_draft_tokens=0, drafted_per_position=(), accepted_per_position=(),
                              num_scheduled_tokens=1, widened=True, verify_seconds=0.004))
    assert model.extrapolated("ar", 0, 16)
    for step in range(20, 40):
        model.observe(replace(lookahead_record(step, 0, 16), num_requests_with_drafts=0, num_draft_tokens=0,
                              drafted_per_position=(), accepted_per_position=(), num_scheduled_tokens=16,
                              verify_seconds=0.03))
    assert model.extrapolated("ar", 0, 16)
    assert model.verify[BESIDE].covers(16, 1.1)
