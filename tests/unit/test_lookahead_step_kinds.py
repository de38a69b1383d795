"""Which kind of step a lookahead step teaches the cost model: one without drafts verifies beside its branch job on
the target's own cores, not widened like ar's."""

from __future__ import annotations

from dataclasses import replace

from minedraft.engine.control.cost_model import BESIDE, CostModel
from tests.unit.test_lookahead_pricing import lookahead_record


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
