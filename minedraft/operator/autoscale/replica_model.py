"""A model of one engine replica for the simulator: output tokens/s as a function of load, acceptance and k.

Calibrated from the engine benchmark's JSON (`minedraft bench --json`), with the shape of the engine's own cost
model (`minedraft/engine/control/cost_model.py`). Each ingredient is a cost curve through the benchmark's points
(seconds against a size, made nondecreasing by isotonic regression, joined piecewise-linearly, extrapolated along the
nearest segment), so a cost that is flat at small batches and steep at large ones (memory-bound, then
compute-bound) is kept as measured rather than averaged into one line:

- ar (plain decoding) of c requests: one step of t_ar(c) seconds yields c tokens;
- sd(k): a draft of k drafter forwards, f(c) seconds each, then a verification of c requests with k drafted tokens
  each, W(c, k) = t_ar(c) + k e(c) seconds: a step's cost per request (scheduling, sampling, attention over its
  context: what plain decoding pays) plus e(c) per drafted position; one cycle k f(c) + W(c, k) yields c L(k)
  tokens. (Verification as a function of verified tokens alone would price 16 requests x 2 tokens like 8 x 4,
  which a step's per-request work makes wrong; with a single k measured, linear in k is what can be fitted.)
- psd(k): two half-batch steps of h = c / 2 requests, each verifying one half while the other half drafts:
  max(r(h) W(h, k), k f(h)) twice, where r(h) is the measured ratio of a psd half-step to an sd verification of
  the same requests (verifying beside a draft is dearer where the two share a machine); fewer than 2 requests leave
  one side empty, which is sd.

L(k) = 1 + a + a^2 + ... + a^k is the expected tokens per request per verification with a draft of k tokens, where
`a` is the per-position acceptance: the chance a drafted token is accepted given the ones before it were (the
traces' `acceptance_rate`; constant along the draft). Acceptance falls along a draft, so it is not 1 + k a. The
engines' acceptance-rate metric (accepted / drafted) is (L(k) - 1) / k of that.

A replica in `auto` mode runs whichever of ar, sd(k) and psd(k), k in the allowed range, gives the most tokens/s at
its load and acceptance: that is what the engines' predicted-goodput gauge reports.

`speedup` divides every step's seconds: the benchmark's shape (how ar, sd and psd compare across batch sizes and
k) on a device that many times faster, for when the benchmark ran on CPUs much slower than the replicas the
traces are sized for.

Prompts cost too. Prefill: `prefill_seconds_per_token` of a replica's time per prompt token (compute-bound, so a
replica prefilling is not decoding). KV cache: `kv_capacity_tokens` tokens per replica; a request holds its prompt
and output in it, so a replica decodes at most min(max_batch, kv_capacity_tokens / (prompt + output)) requests
(`slots`): with long prompts the KV cache, not --max-num-seqs, is what limits the batch. Neither is in the engine
benchmark the curves come from: `assumptions` says where the figures came from.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MODES = ("ar", "sd", "psd")
# Modes the engines run that this model has no curves of, and the mode each is priced as. lookahead verifies the whole
# batch each step while the drafter, on its own device, pre-drafts the next round: drafting overlaps verification as
# in psd, so it is priced as psd (its misses, its branches' extra drafting and whole-batch verification are not
# modelled; `calibrate` fits no lookahead points). The twin's table model (TableReplicaModel) prices it as run.
PRICED_AS = {"lookahead": "psd"}
Curve = tuple[tuple[float, float], ...]  # (size, seconds), sizes increasing


# Pure and asked about the same few arguments over and over (the simulator's profile: a third of its time went to
# these two): remembered.
@functools.lru_cache(maxsize=65536)
def accepted_length(acceptance: float, k: int) -> float:
    """Expected tokens per request per verification with k drafts at per-position acceptance `acceptance`."""
    a = min(max(acceptance, 0.0), 1.0)
    return 1.0 + sum(a ** i for i in range(1, k + 1))


def acceptance_rate_metric(acceptance: float, k: int) -> float:
    """The engines' acceptance rate (accepted / drafted tokens) at per-position acceptance `acceptance`."""
    return (accepted_length(acceptance, k) - 1.0) / k if k > 0 else 0.0


@functools.lru_cache(maxsize=65536)
def evaluate(curve: Curve, size: float) -> float:
    """Seconds at `size`: piecewise-linear through the points, extrapolated along the first or last segment (never
    below a quarter of the first point's seconds nor falling past the last)."""
    if not curve:
        return 0.0
    if len(curve) == 1:
        return curve[0][1]
    (x0, y0), (x1, y1) = curve[0], curve[1]
    if size <= x0:
        slope = (y1 - y0) / (x1 - x0)
        return max(0.25 * y0, y0 - slope * (x0 - size))
    for (xa, ya), (xb, yb) in itertools.pairwise(curve):
        if size <= xb:
            return ya + (yb - ya) * (size - xa) / (xb - xa)
    (xa, ya), (xb, yb) = curve[-2], curve[-1]
    return yb + max(0.0, (yb - ya) / (xb - xa)) * (size - xb)


CURVES = ("ar_step", "draft_forward", "sd_extra_per_draft", "psd_ratio")


@dataclass(frozen=True)
class ReplicaModel:
    ar_step: Curve  # t_ar: seconds of one plain decoding step against requests
    draft_forward: Curve  # f: seconds of one drafter forward against requests
    sd_extra_per_draft: Curve  # e: seconds an sd verification adds per drafted position, against requests
    psd_ratio: Curve  # r: a psd half-step's seconds over W of the same requests and k, against requests
    max_batch: int  # requests one replica decodes at once (--max-num-seqs)
    startup_seconds: float  # from scale-up to serving (pod start + model load)
    modes: tuple[str, ...] = MODES
    min_speculative_tokens: int = 1
    max_speculative_tokens: int = 5
    speedup: float = 1.0
    calibrated_from: tuple[str, ...] = ()
    # Tokens of KV cache one replica holds (None: unbounded, the batch is limited by max_batch alone).
    kv_capacity_tokens: float | None = None
    # Seconds of a replica's time per prompt token prefilled (0: prefill not modelled).
    prefill_seconds_per_token: float = 0.0
    # Where the figures not measured by the engine benchmark came from (KV capacity, prefill, start-up), in words.
    assumptions: tuple[str, ...] = ()

    def slots(self, prompt_tokens: float, output_tokens: float) -> float:
        """Requests one replica can decode at once at these lengths: its batch limit, or what its KV cache holds."""
        if self.kv_capacity_tokens is None:
            return float(self.max_batch)
        return max(1.0, min(float(self.max_batch), math.floor(self.kv_capacity_tokens
                                                               / max(prompt_tokens + output_tokens, 1.0))))

    def _draft(self, requests: float, k: int) -> float:
        return k * evaluate(self.draft_forward, requests)

    def _verify(self, requests: float, k: int) -> float:
        return evaluate(self.ar_step, requests) + k * evaluate(self.sd_extra_per_draft, requests)

    def cycle_seconds(self, mode: str, running: float, k: int) -> float:
        """Seconds of one step (ar) or one verification of every request (sd, psd) at this batch."""
        c = max(running, 1.0)
        mode = PRICED_AS.get(mode, mode)
        if mode == "ar":
            seconds = evaluate(self.ar_step, c)
        elif mode == "sd" or (mode == "psd" and c < 2.0):
            seconds = self._draft(c, k) + self._verify(c, k)
        elif mode == "psd":
            half = c / 2
            ratio = evaluate(self.psd_ratio, half) if self.psd_ratio else 1.0
            seconds = 2 * max(ratio * self._verify(half, k), self._draft(half, k))
        else:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        return seconds / self.speedup

    def tokens_per_second(self, mode: str, running: float, acceptance: float, k: int) -> float:
        c = max(running, 1.0)
        length = 1.0 if mode == "ar" else accepted_length(acceptance, k)
        return c * length / self.cycle_seconds(mode, c, k)

    def best(self, running: float, acceptance: float) -> tuple[float, str, int]:
        """(output tokens/s, mode, k) of the best way to decode `running` requests at this acceptance."""
        options: list[tuple[float, str, int]] = []
        for mode in self.modes:
            for k in (0,) if mode == "ar" else range(self.min_speculative_tokens, self.max_speculative_tokens + 1):
                options.append((self.tokens_per_second(mode, running, acceptance, k), mode, k))
        best = max(options, key=lambda o: o[0])
        if running < 1.0:
            return best[0] * running, best[1], best[2]
        return best

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for name in CURVES:
            data[name] = [list(point) for point in data[name]]
        return {**data, "modes": list(self.modes), "calibrated_from": list(self.calibrated_from),
                "assumptions": list(self.assumptions)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaModel:
        curves = {name: tuple((float(x), float(y)) for x, y in data.get(name, ())) for name in CURVES}
        return cls(**{**data, **curves, "modes": tuple(data.get("modes", MODES)),
                      "calibrated_from": tuple(data.get("calibrated_from", ())),
                      "assumptions": tuple(data.get("assumptions", ()))})

    @classmethod
    def load(cls, path: Path) -> ReplicaModel:
        return cls.from_json(json.loads(path.read_text()))


def fit_curve(points: list[tuple[float, float]], nondecreasing: bool = True, digits: int = 7) -> Curve:
    """Points averaged per size; for a cost, made nondecreasing by least squares (pool adjacent violators).

    A cost does not fall as the work grows: where measurement noise says it does, neighbouring points are pooled.
    """
    by_size: dict[float, list[float]] = {}
    for x, y in points:
        by_size.setdefault(float(x), []).append(float(y))
    # Blocks of (sum of sizes, sum of seconds, count) over the sizes in increasing order.
    blocks: list[list[float]] = []
    for x in sorted(by_size):
        ys = by_size[x]
        blocks.append([x * len(ys), sum(ys), float(len(ys))])
        while (nondecreasing and len(blocks) > 1
               and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]):
            last = blocks.pop()
            blocks[-1] = [a + b for a, b in zip(blocks[-1], last, strict=True)]
    return tuple((round(sx / n, digits), round(sy / n, digits)) for sx, sy, n in blocks)


def bench_datasets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A measurement file as the benchmark's shape: one {"config": {"num_speculative_tokens": k}, "runs": [{
    "concurrency": c, "modes": {mode: figures}}]} per k.

    `minedraft bench --json` already has it. `minedraft doctor --json` (and `minedraft autoscale history`) list flat
    runs, {"mode", "k", "concurrency", "tokens_per_second", "mean_accepted_length"[, "draft_seconds_per_step"]}:
    grouped by k, each sd/psd point beside the ar point of the same load. Without draft seconds (doctor does not
    record them) drafting is folded into verification: each measured point is still priced as measured.
    """
    runs = data.get("runs") or []
    if not runs or "modes" in runs[0] or "mode" not in runs[0]:
        return [data]
    ar = {int(r["concurrency"]): r for r in runs if r["mode"] == "ar"}
    ks = sorted({int(r["k"]) for r in runs if r["mode"] != "ar"}) or [1]

    def figures(r: dict[str, Any]) -> dict[str, Any]:
        out = {"output_tokens_per_s": float(r["tokens_per_second"]),
               "mean_accepted_length": float(r.get("mean_accepted_length") or 1.0)}
        if r.get("draft_seconds_per_step"):
            out["draft_seconds_per_step"] = float(r["draft_seconds_per_step"])
        return out

    datasets = []
    for k in ks:
        by_load: dict[int, dict[str, Any]] = {}
        for c, r in ar.items():
            by_load.setdefault(c, {})["ar"] = {**figures(r), "mean_accepted_length": 1.0}
        for r in runs:
            if r["mode"] in ("sd", "psd") and int(r["k"]) == k:
                by_load.setdefault(int(r["concurrency"]), {})[r["mode"]] = figures(r)
        datasets.append({"config": {"num_speculative_tokens": k},
                         "runs": [{"concurrency": c, "modes": modes} for c, modes in sorted(by_load.items())]})
    return datasets


def _cycle(concurrency: int, figures: dict[str, Any]) -> float:
    """Measured seconds per verification of every request: requests x tokens per verification / tokens/s."""
    return concurrency * float(figures.get("mean_accepted_length", 1.0)) / float(figures["output_tokens_per_s"])


def calibrate(bench_files: list[Path], startup_seconds: float, speedup: float = 1.0,
              max_batch: int | None = None, kv_capacity_tokens: float | None = None,
              prefill_seconds_per_token: float = 0.0, assumptions: tuple[str, ...] = ()) -> ReplicaModel:
    """Fit the model's curves to every (concurrency, mode) point of the benchmark files.

    Each point's cycle is its measured seconds per verification of every request (requests x mean accepted length /
    output tokens/s). t_ar: ar's cycle against requests. f: each sd point's draft seconds per step / k against its
    requests, each psd point's against half of them (a half-step drafts the other half). e: an sd point's cycle less
    its draft (k f(c)) and less t_ar(c), per drafted position (never below 0). r: half a psd point's cycle over W of
    half its requests, from the points where that half-step exceeds the other half's draft (else the draft, not the
    verification, set the pace). A mode without points is left out of the model (psd without usable points takes
    r = 1). `max_batch` defaults to the largest concurrency measured; points above it are not fitted (the model is
    only asked about batches up to it).
    """
    ar: list[tuple[float, float]] = []
    draft: list[tuple[float, float]] = []
    sd_points: list[tuple[int, int, float]] = []  # (c, k, cycle seconds)
    psd_points: list[tuple[int, int, float]] = []
    batches: list[int] = []
    ks: list[int] = []
    datasets = [d for path in bench_files for d in bench_datasets(json.loads(path.read_text()))]
    for data in datasets:
        k = int(data["config"]["num_speculative_tokens"])
        ks.append(k)
        for run in data["runs"]:
            if not isinstance(run.get("concurrency"), int):
                continue  # a trace run (varying load): no single batch to attribute its figures to
            c = int(run["concurrency"])
            if max_batch is not None and c > max_batch:
                continue
            batches.append(c)
            modes = run["modes"]
            if "ar" in modes and modes["ar"]["output_tokens_per_s"] > 0:
                ar.append((c, _cycle(c, {**modes["ar"], "mean_accepted_length": 1.0})))
            for mode, points in (("sd", sd_points), ("psd", psd_points)):
                figures = modes.get(mode)
                if not figures or figures["output_tokens_per_s"] <= 0:
                    continue
                points.append((c, k, _cycle(c, figures)))
                if figures.get("draft_seconds_per_step") and (mode == "sd" or c >= 2):
                    draft.append((c if mode == "sd" else c / 2, float(figures["draft_seconds_per_step"]) / k))
    if not ar:
        raise ValueError("calibrate: the benchmarks have no ar points")
    ar_curve = fit_curve(ar)
    draft_curve = fit_curve(draft)
    modes = ["ar"]
    extra: Curve = ()
    ratio: Curve = ()
    if sd_points:
        extra = fit_curve([(c, max(0.0, (cycle - k * evaluate(draft_curve, c) - evaluate(ar_curve, c)) / k))
                           for c, k, cycle in sd_points])
        modes.append("sd")
    if psd_points:
        def verify(requests: float, k: int) -> float:
            return evaluate(ar_curve, requests) + k * evaluate(extra, requests)

        ratio = fit_curve([(c / 2, cycle / 2 / verify(c / 2, k)) for c, k, cycle in psd_points
                           if c >= 2 and cycle / 2 > k * evaluate(draft_curve, c / 2)], nondecreasing=False)
        modes.append("psd")
    return ReplicaModel(ar_step=ar_curve, draft_forward=draft_curve, sd_extra_per_draft=extra, psd_ratio=ratio,
                        max_batch=max_batch or max(batches), startup_seconds=startup_seconds, modes=tuple(modes),
                        min_speculative_tokens=1, max_speculative_tokens=max(5, *ks), speedup=speedup,
                        calibrated_from=tuple(p.name for p in bench_files), kv_capacity_tokens=kv_capacity_tokens,
                        prefill_seconds_per_token=prefill_seconds_per_token, assumptions=assumptions)


def describe(model: ReplicaModel, acceptances: tuple[float, ...] = (0.9, 0.6, 0.1),
             batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> list[str]:
    """One line per (acceptance, batch): the best mode, k and tokens/s, and how that compares with plain decoding."""
    lines = []
    for a in acceptances:
        for c in batches:
            if c > model.max_batch:
                continue
            tps, mode, k = model.best(c, a)
            ar = model.tokens_per_second("ar", c, a, 0)
            label = mode if mode == "ar" else f"{mode} k={k}"
            lines.append(f"acceptance {a:g}, batch {c}: {label} {tps:.0f} tok/s ({tps / ar:.2f}x ar)"
                         if math.isfinite(tps) else f"acceptance {a:g}, batch {c}: -")
    return lines


# -- a replica model from the twin ---------------------------------------------------------------------------------

TABLE_KIND = "twin-table"


def _bracket(values: tuple[float, ...], x: float, log: bool = False) -> tuple[int, int, float]:
    """Indices of the grid values around x and x's weight on the upper one (clamped to the grid's ends)."""
    if x <= values[0]:
        return 0, 0, 0.0
    if x >= values[-1]:
        last = len(values) - 1
        return last, last, 0.0
    for i in range(len(values) - 1):
        lo, hi = values[i], values[i + 1]
        if lo <= x <= hi:
            if log:
                return i, i + 1, (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return i, i + 1, (x - lo) / (hi - lo)
    raise AssertionError("unreachable: x within the grid")


@dataclass(frozen=True)
class TableReplicaModel:
    """One replica as the twin of the engine gives it (`minedraft plan` on a cost-curve file): output tokens/s of the
    engine's auto mode at each load (requests decoding) and acceptance, decoding only (prefill is priced apart, per
    prompt token, as the simulator does), with the mode and k auto ran there; the KV cache's tokens and the prefill
    time per prompt token from the same file; a start-up estimated from the weights' bytes and a disk bandwidth.

    Between the grid's loads tokens/s is interpolated in log(load) (throughput grows about logarithmically while
    decoding is weight-bound), between acceptances linearly; outside the grid the nearest edge holds, and below one
    request a replica gives that share of one request's speed (as ReplicaModel).
    """

    loads: tuple[float, ...]
    acceptances: tuple[float, ...]
    tokens_per_second: tuple[tuple[float, ...], ...]  # [acceptance][load]
    choices: tuple[tuple[tuple[str, int], ...], ...]  # [acceptance][load]: (mode, k) auto ran
    max_batch: int
    startup_seconds: float
    kv_capacity_tokens: float | None = None
    prefill_seconds_per_token: float = 0.0
    assumptions: tuple[str, ...] = ()
    source: str = ""
    prompt_tokens: int = 0  # the request shape the twin ran (context for the decode speeds; KV capacity's shape)
    output_tokens: int = 0

    def __post_init__(self) -> None:
        if len(self.tokens_per_second) != len(self.acceptances) or any(
                len(row) != len(self.loads) for row in self.tokens_per_second):
            raise ValueError("tokens_per_second: one row per acceptance, one value per load")
        if list(self.loads) != sorted(self.loads) or list(self.acceptances) != sorted(self.acceptances):
            raise ValueError("loads and acceptances: increasing")

    def slots(self, prompt_tokens: float, output_tokens: float) -> float:
        if self.kv_capacity_tokens is None:
            return float(self.max_batch)
        return max(1.0, min(float(self.max_batch), math.floor(self.kv_capacity_tokens
                                                               / max(prompt_tokens + output_tokens, 1.0))))

    def best(self, running: float, acceptance: float) -> tuple[float, str, int]:
        """(output tokens/s, mode, k) of the replica in auto mode with `running` requests decoding."""
        c = max(running, 1.0)
        a0, a1, wa = _bracket(self.acceptances, acceptance)
        l0, l1, wl = _bracket(self.loads, c, log=True)

        def at(i: int) -> float:
            """Row i's tokens/s at this load, carried to this acceptance along its mode's accepted length: tokens
            per verification grow as L(a, k) = 1 + a + ... + a^k, convex in a, which a straight line between two
            acceptances would overstate (outside the grid the edge holds)."""
            row = self.tokens_per_second[i]
            tps = row[l0] * (1 - wl) + row[l1] * wl
            mode, k = self.choices[i][l1 if wl >= 0.5 else l0]
            if a0 == a1 or mode == "ar" or k <= 0:
                return tps
            return tps * accepted_length(acceptance, k) / accepted_length(self.acceptances[i], k)

        tps = at(a0) * (1 - wa) + at(a1) * wa
        if c < self.loads[0]:
            tps *= c / self.loads[0]  # fewer requests than the first load: as many shares of its per-request speed
        mode, k = self.choices[a1 if wa >= 0.5 else a0][l1 if wl >= 0.5 else l0]
        if running < 1.0:
            return tps * running, mode, k
        return tps, mode, k

    def capacity_with_prefill(self, running: float, acceptance: float, prompt_tokens: float,
                              output_tokens: float) -> float:
        """Output tokens/s with `running` requests in flight when each also prefills its prompt on the replica:
        decoding at D tok/s while O output tokens per request bring P prompt tokens at p s each leaves
        D / (1 + D P p / O) (the simulator's time-share of prefill and decoding)."""
        decode = self.best(min(running, self.slots(prompt_tokens, output_tokens)), acceptance)[0]
        per_request = prompt_tokens * self.prefill_seconds_per_token / max(output_tokens, 1.0)
        return decode / (1.0 + decode * per_request)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {"kind": TABLE_KIND, **data, "loads": list(self.loads), "acceptances": list(self.acceptances),
                "tokens_per_second": [list(r) for r in self.tokens_per_second],
                "choices": [[list(c) for c in row] for row in self.choices],
                "assumptions": list(self.assumptions)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TableReplicaModel:
        fields = {k: v for k, v in data.items() if k != "kind"}
        return cls(**{**fields, "loads": tuple(float(x) for x in data["loads"]),
                      "acceptances": tuple(float(x) for x in data["acceptances"]),
                      "tokens_per_second": tuple(tuple(float(x) for x in row) for row in data["tokens_per_second"]),
                      "choices": tuple(tuple((str(m), int(k)) for m, k in row) for row in data["choices"]),
                      "assumptions": tuple(data.get("assumptions", ()))})


AnyReplicaModel = ReplicaModel | TableReplicaModel


def load_replica_model(path: Path) -> AnyReplicaModel:
    """A replica model file: the CPU calibration (`calibrate`) or a table from the twin (`simulate --curves`)."""
    data = json.loads(path.read_text())
    if data.get("kind") == TABLE_KIND:
        return TableReplicaModel.from_json(data)
    return ReplicaModel.from_json(data)
