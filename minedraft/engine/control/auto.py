"""`auto` mode: pick ar / sd / psd / lookahead, k (and lookahead's fan-out F) from the cost model, with hysteresis and
cheap probes.

Pure policy over plain data: `AutoController.on_step(record, num_running)` is fed every step record and returns a
`Decision` when the engine should switch (the scheduler applies it at the step boundary) or None.

- Every `decision_interval_steps` steps it ranks every allowed (mode, k) (lookahead: (mode, k, F) for each F of
  `fanout_candidates`) by predicted output tokens per second at the current number of running requests.
- A switch needs the best to beat the current choice's prediction by `switch_margin` (`measured_switch_margin` when
  both are priced from costs measured at this load) and the current choice to have
  run `min_dwell_steps`: steady load does not flap.
- A mode not run for `stale_after_steps` (or never) is predicted from stale or extrapolated costs (acceptance is
  not measured while running ar; half-batch verification not while running sd): a short probe (`probe_steps`) of
  it refreshes them, then the policy decides again against the setting that ran before the probe. So is a mode
  whose costs at the current load were never measured (the load moved far from where it ran, by more than
  `extrapolation_slack`): extrapolated costs can be off by a large factor either way, and without the probe a
  mode judged from them might never be tried where it would win. Such exploration measures a mode once per load
  region, whatever k: the other k's are priced from what that probe measured.
- A close call is measured too: a setting predicted a little below the current one (`close_call_margin`), or
  above it short of the switch margin, from costs at sizes beyond any measured (a longer draft verifies more
  tokens per step than any step so far) gets one probe per load region. Extrapolating from two nearby sizes lets
  noise set the slope, and a real gain (a memory-bound target verifies 8 tokens barely slower than 4) would
  otherwise never be seen; the probe costs little because the setting is predicted nearly as good as what runs.
- Drafting seconds of the first steps after steps without drafts are left out of the cost curves: they include
  the drafter's catch-up on every token committed meanwhile, a cost of the switch, not of the mode.
- A load shift (the running requests of `load_shift_steps` steps in a row beyond `load_shift_factor` of the load of
  the last decision) is decided on at once, on the new load alone, dwell and interval aside; while one may be under
  way no regular decision is priced from a window that mixes the two loads. A burst that arrives (or ends) is met
  within a few steps rather than after a decision interval priced at a blend of both loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minedraft.engine.control.cost_model import LOOKAHEAD, CostModel, Prediction
from minedraft.engine.control.stats import StepRecord

AUTO_CHOICES = ("ar", "sd", "psd", LOOKAHEAD)
# (mode, k, fan-out): ar's k and every mode's fan-out but lookahead's are 0.
Setting = tuple[str, int, int]


def setting_of(prediction: Prediction) -> Setting:
    return prediction.mode, prediction.k, prediction.fanout


@dataclass(frozen=True)
class AutoSettings:
    # Every mode the engine runs: lookahead included since its branch job is priced at the items it drafts (a hit's
    # F branches, a miss's root); in the twin auto then holds >= 0.97 of the best fixed mode at 1-256 requests on the
    # H200 curves and on curve files it was not tuned on (benchmarks/results/gpu-twin/lookahead.md).
    allowed_modes: tuple[str, ...] = AUTO_CHOICES
    k_candidates: tuple[int, ...] = (1, 2, 3, 4, 5)
    # Lookahead's branches per request to choose among (where lookahead is allowed). Empty: price lookahead at the
    # fan-out the engine runs it with (its core sets the fan-out from measured drafter and verify times, up to
    # --lookahead-fanout; the cost model reads it off lookahead's step records).
    fanout_candidates: tuple[int, ...] = ()
    # A step is 10-50 ms: decisions every ~0.1-0.4 s, a choice held at least ~0.3-1 s, probes of ~0.1-0.6 s.
    # Switching costs almost nothing (sub-batch membership, draft length), so these follow the load closely;
    # the switch margin and the smoothed cost curves, not long dwells, keep steady load from flapping.
    decision_interval_steps: int = 8
    min_dwell_steps: int = 24
    switch_margin: float = 0.08
    # The margin when both the best and the current setting are priced from costs measured at this load (neither
    # extrapolated beyond `close_call_slack`): such predictions are close to what runs, and holding a setting 8%
    # slower than one measured here cost auto 5% at 256 requests on the H200 curves (sd k=1 against psd k=3).
    measured_switch_margin: float = 0.03
    # Predictions move between decisions as fresh costs come in: on the H200 twin by 0.1-1.4% on average for one
    # setting at one load; on a 2-core CPU by ~20% (lookahead k=1 at one request, in auto's logged decisions:
    # 141-244 tok/s over ~2,300 steps), where a 3% margin followed the noise (12 of 28 decisions in a run were
    # switches, 10 of them for predicted gains of 3-22%). The margin is at least this many times each compared
    # setting's average relative move (over decisions at an unchanged load, weighted `prediction_spread_weight` to
    # the newest); 0: off.
    noise_margin_factor: float = 1.5
    prediction_spread_weight: float = 0.2
    stale_after_steps: int = 1000
    # A stale mode (run before) predicted below this fraction of the current setting is not probed while a drafting
    # mode runs (acceptance is measured then; in ar it is not, and a drafting mode's price may be far off): costs
    # drift, they do not halve, and at one or two requests a probe of ar (0.4x lookahead there) cost auto 2-3% by
    # itself. None: every stale mode is probed.
    stale_probe_floor: float | None = 0.5
    probe_steps: int = 12
    # Step records older than this many steps are not used to describe the load (running requests).
    load_window_steps: int = 16
    # A mode whose predicted costs at the current load lie beyond this factor of any size it was measured at is
    # probed (once per such load region).
    extrapolation_slack: float = 1.5
    # After steps without drafting, this many drafted steps (psd: one per sub-batch) carry the drafter's catch-up
    # on the tokens committed meanwhile; their drafting seconds are not the mode's steady cost (CostModel.observe).
    resume_steps: int = 2
    # A setting predicted within this fraction below the current one (or above it, short of the switch margin)
    # from costs at sizes beyond `close_call_slack` times any measured is probed once per load region (None: never).
    close_call_margin: float | None = 0.15
    close_call_slack: float = 1.1
    # A load shift: when the running requests of the last `load_shift_steps` steps all lie beyond this factor of
    # the load the last decision was made at (and at least `load_shift_min_requests` away from it), the controller
    # decides at once on the new load, without waiting out the dwell or the decision interval (those keep a steady
    # load from flapping; a burst arriving or ending is not steady). None: no such reaction.
    load_shift_factor: float | None = 2.0
    load_shift_steps: int = 4
    load_shift_min_requests: int = 4
    # Whether steps run in fixed modes (before auto was turned on, or while it was off) teach auto's cost model too.
    # In service any measurement helps; a benchmark turns it off so that auto knows only what it paid to measure.
    learn_from_fixed_modes: bool = True

    def __post_init__(self) -> None:
        if not self.allowed_modes or not set(self.allowed_modes) <= set(AUTO_CHOICES):
            raise ValueError(f"allowed_modes: expected a non-empty subset of {', '.join(AUTO_CHOICES)}, got "
                             f"{self.allowed_modes}")
        if self.fanout_candidates and min(self.fanout_candidates) < 1:
            raise ValueError(f"fanout_candidates: expected positive fan-outs, got {self.fanout_candidates}")
        if not self.k_candidates or min(self.k_candidates) < 1:
            raise ValueError(f"k_candidates: expected positive draft lengths, got {self.k_candidates}")
        if self.stale_probe_floor is not None and not 0 <= self.stale_probe_floor <= 1:
            raise ValueError(f"stale_probe_floor: must be in [0, 1] or None, got {self.stale_probe_floor}")
        if self.decision_interval_steps < 1 or self.min_dwell_steps < 0 or self.probe_steps < 1:
            raise ValueError("decision_interval_steps and probe_steps must be positive, min_dwell_steps >= 0")
        if self.resume_steps < 0:
            raise ValueError(f"resume_steps: must be >= 0, got {self.resume_steps}")
        if self.switch_margin < 0 or self.measured_switch_margin < 0:
            raise ValueError(f"switch_margin and measured_switch_margin: must be >= 0, got {self.switch_margin} and "
                             f"{self.measured_switch_margin}")
        if self.noise_margin_factor < 0 or not 0 < self.prediction_spread_weight <= 1:
            raise ValueError(f"noise_margin_factor: must be >= 0, got {self.noise_margin_factor}; "
                             f"prediction_spread_weight: must be in (0, 1], got {self.prediction_spread_weight}")
        if self.close_call_margin is not None and not 0 <= self.close_call_margin < 1:
            raise ValueError(f"close_call_margin: must be in [0, 1) or None, got {self.close_call_margin}")
        if self.close_call_slack < 1:
            raise ValueError(f"close_call_slack: must be >= 1, got {self.close_call_slack}")
        if self.load_shift_factor is not None and self.load_shift_factor <= 1:
            raise ValueError(f"load_shift_factor: must be > 1 or None, got {self.load_shift_factor}")
        if self.load_shift_steps < 1 or self.load_shift_min_requests < 0:
            raise ValueError("load_shift_steps must be >= 1 and load_shift_min_requests >= 0")


@dataclass(frozen=True)
class Decision:
    """One of auto's switches: the chosen mode (psd, sd, ar or lookahead), k and lookahead's fan-out it sets for the
    coming steps."""

    step: int
    mode: str
    k: int
    previous_mode: str
    previous_k: int
    reason: str
    # "switch" (the policy chose it), "probe" (a short visit to refresh a stale mode's costs) or "return" (back
    # from a probe).
    kind: str
    num_running: float
    # Predicted output tokens per second of the chosen and the previous setting (0 when unknown).
    predicted_tokens_per_second: float
    previous_predicted_tokens_per_second: float
    # Measured output tokens per second over the interval before the decision.
    measured_tokens_per_second: float
    predictions: tuple[Prediction, ...] = ()
    # Lookahead's branches per request (0 for the other modes).
    fanout: int = 0
    previous_fanout: int = 0


@dataclass
class AutoController:
    settings: AutoSettings
    mode: str
    k: int
    cost_model: CostModel = field(default_factory=CostModel)
    decisions: list[Decision] = field(default_factory=list)
    max_decisions_kept: int = 256
    # Lookahead's fan-out while lookahead is chosen (the last one otherwise).
    fanout: int = 0
    _steps_in_choice: int = 0
    _steps_since_decision: int = 0
    _probe_remaining: int = 0
    _probe_return: Setting | None = None
    _window_running: list[int] = field(default_factory=list)
    _window_tokens: int = 0
    _window_seconds: float = 0.0
    # Steps this controller has seen (its own clock: fixed modes may run between its spells).
    _steps_seen: int = 0
    # Its clock at the last decode step run in each mode (as run: a down drafter shows as ar).
    _last_run: dict[str, int] = field(default_factory=dict)
    # Decode steps run without drafts since drafting last ran, and drafted steps left whose drafts still catch up.
    _undrafted_steps: int = 0
    _resume_left: int = 0
    # Decode steps run in each mode (as run) at each number of running requests.
    _steps_at_load: dict[str, dict[int, int]] = field(default_factory=dict)
    # (mode, k, fan-out, running requests) of the close calls probed: each is measured once per load region.
    _close_calls: list[tuple[str, int, int, int]] = field(default_factory=list)
    # Running requests (window average) at the last decision that saw any: a load shift is measured from it.
    _decided_running: float = 0.0
    # Per (mode, k): the load and output tokens/s of its last prediction, and the average relative move of its
    # predictions between decisions at an unchanged load.
    _last_predicted: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)
    _prediction_spread: dict[tuple[str, int], float] = field(default_factory=dict)
    _spread_before: dict[tuple[str, int], float] = field(default_factory=dict)

    def _resuming(self, record: StepRecord) -> bool:
        if record.num_decode_requests == 0:
            return False
        if record.num_requests_with_drafts == 0:
            self._undrafted_steps += 1
            self._resume_left = 0
            return False
        if self._undrafted_steps:
            self._undrafted_steps = 0
            self._resume_left = self.settings.resume_steps
        if self._resume_left:
            self._resume_left -= 1
            return True
        return False

    def on_step(self, record: StepRecord, num_running: int) -> Decision | None:
        self.cost_model.observe(record, resuming=self._resuming(record))
        self._steps_seen += 1
        if record.num_decode_requests > 0:
            self._last_run[record.mode] = self._steps_seen
            loads = self._steps_at_load.setdefault(record.mode, {})
            loads[num_running] = loads.get(num_running, 0) + 1
        self._steps_in_choice += 1
        self._steps_since_decision += 1
        self._window_running = ([*self._window_running, num_running])[-self.settings.load_window_steps:]
        self._window_tokens += record.num_output_tokens
        self._window_seconds += record.step_seconds

        if self._probe_remaining > 0:
            self._probe_remaining -= 1
            if self._probe_remaining > 0:
                return None
            # Probe over: decide afresh with what it measured, against the setting that ran before it.
            assert self._probe_return is not None
            fallback, self._probe_return = self._probe_return, None
            return self.decide(record.step, after_probe=fallback)

        shifted = self._steps_beyond_decided_load()
        if shifted >= self.settings.load_shift_steps:
            # Decide on the new load alone: the window's older steps describe the load that has gone.
            self._window_running = self._window_running[-self.settings.load_shift_steps:]
            self._steps_in_choice = max(self._steps_in_choice, self.settings.min_dwell_steps)
            return self.decide(record.step)
        if shifted or self._steps_since_decision < self.settings.decision_interval_steps:
            # (A shift under way is decided on once it holds, not priced now from a window mixing both loads.)
            return None
        return self.decide(record.step)

    def _steps_beyond_decided_load(self) -> int:
        """How many of the latest steps in a row ran at a load beyond the load shift's band around the load of the
        last decision (0 without load shifts)."""
        factor = self.settings.load_shift_factor
        decided = self._decided_running
        if factor is None or decided <= 0:
            return 0
        count = 0
        for n in reversed(self._window_running[-self.settings.load_shift_steps:]):
            if decided / factor <= n <= decided * factor or abs(n - decided) < self.settings.load_shift_min_requests:
                break
            count += 1
        return count

    @property
    def setting(self) -> Setting:
        return self.mode, 0 if self.mode == "ar" else self.k, self.fanout if self.mode == LOOKAHEAD else 0

    def _fanouts(self) -> tuple[int, ...]:
        if LOOKAHEAD not in self.settings.allowed_modes:
            return (1,)
        return self.settings.fanout_candidates or (self.cost_model.lookahead_fanout,)

    def _priced(self, setting: Setting) -> Setting:
        """`setting` as predictions name it. Without fan-out candidates lookahead is priced at the fan-out its core
        ran last (the core moves it with measured times, whatever auto chose): the lookahead that runs is that one,
        not one missing from the predictions (which switched away from lookahead with no margin at all: eager
        drafting, 8 requests, to sd k=1, 4% slower)."""
        mode, k, _ = setting
        if mode == LOOKAHEAD and not self.settings.fanout_candidates:
            return mode, k, self._fanouts()[0]
        return setting

    def decide(self, step: int, after_probe: Setting | None = None) -> Decision | None:
        self._steps_since_decision = 0
        running = sum(self._window_running) / len(self._window_running) if self._window_running else 0.0
        measured = self._window_tokens / self._window_seconds if self._window_seconds > 0 else 0.0
        self._window_tokens, self._window_seconds = 0, 0.0
        if running <= 0 and after_probe is None:
            return None
        if running > 0:
            self._decided_running = running
        num_running = max(1, round(running))
        predictions = self.cost_model.predict_all(num_running, self.settings.allowed_modes,
                                                  self.settings.k_candidates, self._fanouts())
        self._track_spread(predictions, num_running)
        incumbent = self._priced(after_probe or self.setting)
        incumbent_key = incumbent
        current = next((p for p in predictions if setting_of(p) == incumbent_key), None)
        best = max(predictions, key=lambda p: p.output_tokens_per_second) if predictions else None
        current_rate = current.output_tokens_per_second if current is not None else 0.0

        if after_probe is None and self._steps_in_choice < self.settings.min_dwell_steps:
            return None
        margin = self.settings.switch_margin
        if best is not None and current is not None and not any(
                self.cost_model.extrapolated(p.mode, p.k, num_running, self.settings.close_call_slack, p.fanout)
                for p in (best, current)):
            margin = min(margin, self.settings.measured_switch_margin)
        if best is not None and current is not None:
            margin = max(margin, self.settings.noise_margin_factor * max(self._spread(best), self._spread(current)))
        if best is not None and setting_of(best) != incumbent_key and (
            current is None or best.output_tokens_per_second >= current_rate * (1 + margin)
        ):
            if setting_of(best) != self._priced(self.setting) and self.cost_model.extrapolated(
                    best.mode, best.k, num_running, self.settings.extrapolation_slack, best.fanout):
                # Predicted best only from costs never measured at this load: measure it briefly before
                # committing to it for a whole dwell (after a probe, the setting to fall back to stays the same).
                reason = (f"probe: {best.mode} k={best.k} predicted best ({best.output_tokens_per_second:.1f} vs "
                          f"{current_rate:.1f} tok/s) but not measured near {num_running} running requests")
                return self._probe(step, setting_of(best), measured, reason, return_to=incumbent)
            reason = (f"predicted {best.output_tokens_per_second:.1f} tok/s for {_label(setting_of(best))} vs "
                      f"{current_rate:.1f} for {_label(incumbent_key)} at {running:.1f} running requests")
            return self._switch(step, setting_of(best), reason, (best, current, tuple(predictions)), measured,
                                "switch")
        if after_probe is not None:
            if self._priced(self.setting) == incumbent:
                return None
            return self._switch(step, incumbent, "probe finished: keeping the previous setting",
                                (current, current, tuple(predictions)) if current else None, measured, "return")

        # Explore cheaply: a mode not run for a while (or ever) is predicted from stale costs.
        rates = {p.mode: p.output_tokens_per_second for p in self._best_per_mode(predictions)}
        floor = self.settings.stale_probe_floor
        stale = [m for m in self.settings.allowed_modes if m != self.mode
                 and self._steps_seen - self._last_run.get(m, -1_000_000_000) > self.settings.stale_after_steps
                 and (m not in self._last_run or floor is None or m not in rates or self.mode == "ar"
                      or rates[m] >= floor * current_rate)]
        if stale:
            # Never run first, then the one predicted best (a prediction it has to be refreshed for), then oldest.
            probe_mode = min(stale, key=lambda m: (m in self._last_run, -rates.get(m, 0.0),
                                                   self._last_run.get(m, -1_000_000_000)))
            return self._probe(step, self._best_setting(num_running, probe_mode), measured,
                               f"probe: {probe_mode} not measured in {self.settings.stale_after_steps} steps")
        # ... and one whose costs at this load were never measured (a load far from any it ran at, or the other
        # core placement standing in) is extrapolated: measured once there, it is not probed there again.
        # A mode that ran near this load with another k is not explored again for this one: its verification and
        # drafting were measured here, and the draft length is priced from them and the per-position acceptance.
        others = [p for p in predictions if setting_of(p) != incumbent_key]
        unmeasured = [p for p in self._best_per_mode(others)
                      if self.cost_model.extrapolated(p.mode, p.k, num_running, self.settings.extrapolation_slack,
                                                      p.fanout)
                      and not self._ran_near(p.mode, num_running)]
        if unmeasured:
            probe = max(unmeasured, key=lambda p: p.output_tokens_per_second)
            return self._probe(step, setting_of(probe), measured,
                               f"probe: {_label(setting_of(probe))} not measured near {num_running} running requests")
        # ... and a close call: a setting predicted nearly as good as the current one, priced from sizes
        # beyond those measured (a longer draft verifies more tokens than any step so far). Two nearby points
        # extrapolate a slope that noise dominates, enough to hide a real gain of 20% or more; measuring it once
        # here costs little, since it is predicted nearly as good as what runs.
        if self.settings.close_call_margin is not None:
            close = [p for p in others
                     if p.output_tokens_per_second >= current_rate * (1 - self.settings.close_call_margin)
                     and self.cost_model.extrapolated(p.mode, p.k, num_running, self.settings.close_call_slack,
                                                      p.fanout)
                     and not self._close_call_measured(setting_of(p), num_running)]
            if close:
                probe = max(close, key=lambda p: p.output_tokens_per_second)
                self._close_calls.append((*setting_of(probe), num_running))
                return self._probe(step, setting_of(probe), measured,
                                   f"probe: {_label(setting_of(probe))} predicted within "
                                   f"{self.settings.close_call_margin:.0%} ({probe.output_tokens_per_second:.1f} vs "
                                   f"{current_rate:.1f} tok/s) from costs beyond those measured")
        return None

    def _near(self, load: float, num_running: int) -> bool:
        """Whether `load` lies in the load region of `num_running` (within the extrapolation slack)."""
        slack = self.settings.extrapolation_slack
        return num_running / slack <= load <= num_running * slack

    def _close_call_measured(self, setting: Setting, num_running: int) -> bool:
        return any((m, kk, f) == setting and self._near(load, num_running) for m, kk, f, load in self._close_calls)

    def _track_spread(self, predictions: list[Prediction], num_running: int) -> None:
        # A decision weighs the spread measured before it: a setting whose prediction has just moved (freshly
        # measured by a probe, or better now) is not held back by that very move.
        self._spread_before = dict(self._prediction_spread)
        weight = self.settings.prediction_spread_weight
        for prediction in predictions:
            key = (prediction.mode, prediction.k)
            rate = prediction.output_tokens_per_second
            last = self._last_predicted.get(key)
            if last is not None and last[0] == num_running and last[1] > 0:
                move = abs(rate - last[1]) / last[1]
                spread = self._prediction_spread.get(key)
                self._prediction_spread[key] = move if spread is None else (1 - weight) * spread + weight * move
            self._last_predicted[key] = (num_running, rate)

    def _spread(self, prediction: Prediction) -> float:
        return self._spread_before.get((prediction.mode, prediction.k), 0.0)

    def resume(self) -> tuple[str, int]:
        """Turned back on after fixed modes ran: the (mode, k) to carry on with, everything learned kept.

        What belonged to the last spell is dropped: a probe under way ends on the setting it would have returned to,
        the measuring window and the dwell start afresh, and the first drafted steps count as resuming (the drafter
        may catch up on tokens committed while it was off)."""
        if self._probe_return is not None:
            self.mode, k, fanout = self._probe_return
            self.k = k or self.k
            self.fanout = fanout or self.fanout
        self._probe_remaining, self._probe_return = 0, None
        self._window_running, self._window_tokens, self._window_seconds = [], 0, 0.0
        self._steps_since_decision = self._steps_in_choice = 0
        self._undrafted_steps, self._resume_left = 1, 0
        return self.mode, self.k

    def _ran_near(self, mode: str, num_running: int) -> bool:
        """Whether `mode` ran (with any k) for at least half a probe at loads within the extrapolation slack."""
        steps = sum(count for load, count in self._steps_at_load.get(mode, {}).items() if self._near(load, num_running))
        return steps >= max(1, self.settings.probe_steps // 2)

    def _probe(self, step: int, setting: Setting, measured: float, reason: str,
               return_to: Setting | None = None) -> Decision:
        self._probe_remaining = self.settings.probe_steps
        self._probe_return = return_to or self.setting
        return self._switch(step, setting, reason, None, measured, "probe")

    @staticmethod
    def _best_per_mode(predictions: list[Prediction]) -> list[Prediction]:
        best: dict[str, Prediction] = {}
        for prediction in predictions:
            if prediction.mode not in best or prediction.output_tokens_per_second > best[
                    prediction.mode].output_tokens_per_second:
                best[prediction.mode] = prediction
        return list(best.values())

    def _best_setting(self, num_running: int, mode: str) -> Setting:
        predictions = self.cost_model.predict_all(num_running, (mode,), self.settings.k_candidates, self._fanouts())
        if predictions:
            return setting_of(max(predictions, key=lambda p: p.output_tokens_per_second))
        k = self.k if self.k in self.settings.k_candidates else self.settings.k_candidates[0]
        return mode, 0 if mode == "ar" else k, max(self._fanouts()) if mode == LOOKAHEAD else 0

    def _switch(
        self,
        step: int,
        setting: Setting,
        reason: str,
        ranked: tuple[Prediction | None, Prediction | None, tuple[Prediction, ...]] | None,
        measured: float | None,
        kind: str,
    ) -> Decision:
        mode, k, fanout = setting
        k = max(1, k) if mode != "ar" else self.k  # ar keeps the last k for the next drafting mode
        # (the other modes keep lookahead's last fan-out for its next turn)
        fanout = max(1, fanout) if mode == LOOKAHEAD else self.fanout
        running = sum(self._window_running) / len(self._window_running) if self._window_running else 0.0
        decision = Decision(
            step=step,
            mode=mode,
            k=k if mode != "ar" else 0,
            previous_mode=self.mode,
            previous_k=0 if self.mode == "ar" else self.k,
            reason=reason,
            kind=kind,
            num_running=running,
            predicted_tokens_per_second=ranked[0].output_tokens_per_second if ranked and ranked[0] else 0.0,
            previous_predicted_tokens_per_second=ranked[1].output_tokens_per_second if ranked and ranked[1] else 0.0,
            measured_tokens_per_second=measured or 0.0,
            predictions=ranked[2] if ranked else (),
            fanout=fanout if mode == LOOKAHEAD else 0,
            previous_fanout=self.fanout if self.mode == LOOKAHEAD else 0,
        )
        self.mode, self.k, self.fanout = mode, k, fanout
        self._steps_in_choice = 0
        self.decisions.append(decision)
        del self.decisions[: -self.max_decisions_kept]
        return decision


def _label(setting: Setting) -> str:
    mode, k, fanout = setting
    return mode if mode == "ar" else f"{mode} k={k}" + (f" F={fanout}" if mode == LOOKAHEAD else "")
