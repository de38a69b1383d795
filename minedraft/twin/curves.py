"""Cost curves in the `minedraft-cost-curves/v1` format: read, validate, interpolate. Pure: no clocks, no devices.

A file holds, per model, measured forward times (`forward_ms`: `batch` requests each adding `new_tokens` tokens after
`context` cached ones) and, for drafters, whole k-token draft loops (`draft_loop_ms`). The grid is sparse (on the
H200 file: batch 1-128 at context 1024, three batches at 4096, k 3 and 5), so every query interpolates:

- in batch, piecewise-linearly between measured batches (cost is flat while weight-bound and grows about linearly
  once compute-bound, so a straight line between neighbouring grid points fits both); beyond the largest measured
  batch the last segment's slope continues (the compute-bound growth), never falling;
- in context, linearly between the two nearest measured contexts. A context level measured at fewer batches (4096
  at 1, 8, 32) adds to the densest level the difference the two levels show at the batches both have, itself
  interpolated or continued in batch: the KV-read cost a longer context adds grows with the batch;
- in new tokens and in k, linearly between the measured values at the same batch and context.

Anything outside the measured ranges is extrapolated linearly from the nearest two points and floored at a share of
the nearest measured value (a cost never drops to nothing); each query says whether it extrapolated
(`Lookup.extrapolated`), and the twin reports which dimensions did.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "minedraft-cost-curves/v1"
ROLES = ("target", "drafter")
# An extrapolated cost never falls below this share of the nearest measured one.
EXTRAPOLATION_FLOOR = 0.5


class CurveError(ValueError):
    """An invalid cost-curve file; `field_name` names the offending field (a JSON path)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


@dataclass(frozen=True)
class Lookup:
    ms: float
    # Dimensions the query reached beyond the measured grid ("batch", "context", "new_tokens", "k").
    extrapolated: frozenset[str] = frozenset()


def interpolate(points: Sequence[tuple[float, float]], x: float,
                proportional_floor: bool = False) -> tuple[float, bool]:
    """Piecewise-linear through sorted (x, y) points; linear beyond the ends (the nearest segment's slope, floored at
    EXTRAPOLATION_FLOOR of the nearest value, or with `proportional_floor` at y_first * x / x_first: a draft of
    fewer tokens costs at least its share of a longer one; growth beyond the top never negative).
    Returns (y, extrapolated)."""
    if not points:
        raise ValueError("no points")
    if len(points) == 1:
        return points[0][1], x != points[0][0]
    (x_first, y_first), (x_last, y_last) = points[0], points[-1]
    if x < x_first:
        (x0, y0), (x1, y1) = points[0], points[1]
        slope = (y1 - y0) / (x1 - x0)
        floor = y_first * x / x_first if proportional_floor and x_first > 0 else EXTRAPOLATION_FLOOR * y_first
        return max(floor, y0 - slope * (x0 - x)), True
    if x > x_last:
        (x0, y0), (x1, y1) = points[-2], points[-1]
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        return y1 + slope * (x - x1), True
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            return (y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)), False
    return y_last, False  # unreachable: the ranges above cover every x


def _sorted_points(pairs: Mapping[int, float] | Mapping[float, float]) -> list[tuple[float, float]]:
    return sorted((float(x), float(y)) for x, y in pairs.items())


@dataclass(frozen=True)
class _Grid:
    """ms by (context, third dimension) -> {batch: ms}; the third dimension is new_tokens or k."""

    name: str  # "new_tokens" or "k"
    cells: dict[tuple[int, int], dict[int, float]]

    def thirds(self) -> list[int]:
        return sorted({third for _, third in self.cells})

    def contexts(self, third: int) -> list[int]:
        return sorted(context for context, t in self.cells if t == third)

    def lookup(self, batch: float, context: float, third: float) -> Lookup:
        thirds = self.thirds()
        values: list[tuple[float, float]] = []
        flags: set[str] = set()
        # Interpolate in the third dimension between the nearest measured values (two are enough).
        for t in _nearest_two(thirds, third):
            ms, sub_flags = self._at_third(batch, context, t)
            values.append((t, ms))
            flags |= sub_flags
        ms, beyond = interpolate(values, third, proportional_floor=True)
        if beyond:
            flags.add(self.name)
        return Lookup(ms, frozenset(flags))

    def _at_third(self, batch: float, context: float, third: int) -> tuple[float, set[str]]:
        contexts = self.contexts(third)
        flags: set[str] = set()
        # The densest level (most batches) is the base; others add their measured difference to it.
        base = max(contexts, key=lambda c: (len(self.cells[(c, third)]), -c))
        base_points = _sorted_points(self.cells[(base, third)])
        base_ms, beyond = interpolate(base_points, batch)
        if beyond:
            flags.add("batch")
        values: list[tuple[float, float]] = []
        for level in _nearest_two(contexts, context):
            if level == base:
                values.append((level, base_ms))
                continue
            level_cells = self.cells[(level, third)]
            base_at = dict(base_points)
            diffs = {b: ms - base_at[float(b)] for b, ms in level_cells.items() if float(b) in base_at}
            if diffs:
                diff, beyond = interpolate(_sorted_points(diffs), batch)
                if beyond:
                    flags.add("batch")
                values.append((level, base_ms + diff))
            else:  # no batch in common: that level alone, in batch
                ms, beyond = interpolate(_sorted_points(level_cells), batch)
                if beyond:
                    flags.add("batch")
                values.append((level, ms))
        ms, beyond = interpolate(values, context)
        if beyond:
            flags.add("context")
        return ms, flags


def _nearest_two(levels: Sequence[int], value: float) -> list[int]:
    """The measured levels bracketing `value` (or the nearest two beyond the range; one if only one exists)."""
    if len(levels) <= 2:
        return list(levels)
    below = [lv for lv in levels if lv <= value]
    above = [lv for lv in levels if lv >= value]
    if below and above:
        return sorted({below[-1], above[0]})
    return list(levels[:2]) if not below else list(levels[-2:])


@dataclass(frozen=True, slots=True)
class PrefillGrid:
    """Measured prefill times: ms by context level -> sorted (tokens, ms); linear in tokens, then in context."""

    cells: Mapping[int, tuple[tuple[float, float], ...]]

    def lookup(self, tokens: float, context: float) -> tuple[float, bool]:
        levels = sorted(self.cells)
        below = [c for c in levels if c <= context]
        above = [c for c in levels if c >= context]
        pair = sorted({below[-1], above[0]}) if below and above else (levels[:2] if not below else levels[-2:])
        values: list[tuple[float, float]] = []
        beyond = False
        for level in pair:
            points = self.cells[level]
            if len(points) == 1:  # one measured prompt length: proportional in tokens (prefill is compute-bound)
                (x, y), = points
                ms, out = y * tokens / x, tokens != x
            else:
                ms, out = interpolate(points, tokens, proportional_floor=True)
            values.append((float(level), ms))
            beyond |= out
        ms, out = interpolate(values, context)
        return ms, beyond or out


def _prefill_grid(rows: Any, where: str) -> PrefillGrid:
    if not isinstance(rows, list) or not rows:
        raise CurveError(where, "expected a non-empty list of measurements")
    cells: dict[int, dict[int, float]] = {}
    for i, row in enumerate(rows):
        at = f"{where}[{i}]"
        if not isinstance(row, dict):
            raise CurveError(at, f"expected an object, got {type(row).__name__}")
        tokens = _require(row, "tokens", at, int)
        context = _require(row, "context", at, int)
        ms = _require(row, "ms", at, (int, float))
        if tokens < 1:
            raise CurveError(f"{at}.tokens", f"must be >= 1, got {tokens}")
        if context < 0:
            raise CurveError(f"{at}.context", f"must be >= 0, got {context}")
        if not ms > 0 or ms != ms or ms == float("inf"):
            raise CurveError(f"{at}.ms", f"must be a positive finite time, got {ms}")
        level = cells.setdefault(context, {})
        if tokens in level:
            raise CurveError(at, f"duplicate measurement for {tokens} tokens at context {context}")
        level[tokens] = float(ms)
    return PrefillGrid({context: tuple(_sorted_points(level)) for context, level in cells.items()})


@dataclass(frozen=True)
class ModelCurves:
    name: str
    role: str
    params: int | None
    config: dict[str, int]
    kv_bytes_per_token: int | None
    forward: _Grid | None
    draft_loop: _Grid | None
    # A drafter's price per catch-up token (optional `catch_up_ms_per_token`): the tokens a draft job makes it take
    # in before drafting, beyond each request's last (accepted tokens since its last job, a newcomer's prompt).
    # None: not measured; the twin then estimates newcomers' prompts from the target's prefill cost.
    catch_up_ms_per_token: float | None = None
    # Optional `prefill_ms`: one request's prompt chunk of `tokens` tokens after `context` cached ones (batch 1).
    # None in older files: minedraft.twin.capacity.prefill_ms then gives a labelled roofline estimate.
    prefill: PrefillGrid | None = None

    @property
    def layers(self) -> int:
        return int(self.config.get("layers", 0))

    def forward_ms(self, batch: float, context: float, new_tokens: float) -> Lookup:
        if self.forward is None:
            raise CurveError(f"models.{self.name}.forward_ms", "no forward times measured for this model")
        return self.forward.lookup(batch, context, new_tokens)

    def draft_loop_ms(self, batch: float, context: float, k: float) -> Lookup:
        if self.draft_loop is None:
            raise CurveError(f"models.{self.name}.draft_loop_ms", "no draft loops measured (is it a drafter?)")
        return self.draft_loop.lookup(batch, context, k)

    @property
    def measured_ks(self) -> list[int]:
        return self.draft_loop.thirds() if self.draft_loop is not None else []

    @property
    def max_measured_batch(self) -> int:
        grid = self.forward or self.draft_loop
        assert grid is not None
        return max(max(cells) for cells in grid.cells.values())


@dataclass(frozen=True)
class CostCurves:
    source: str
    device: str
    dtype: str
    execution: str
    measured: str
    models: dict[str, ModelCurves] = field(default_factory=dict)
    # Optional: one device's memory in bytes as CUDA reports it (KV capacity); None: looked up by `device`.
    device_memory_bytes: int | None = None

    def model(self, name: str, role: str) -> ModelCurves:
        found = self.models.get(name)
        if found is None:
            names = ", ".join(f"{n} ({m.role})" for n, m in self.models.items())
            raise CurveError("target" if role == "target" else "drafter",
                             f"no model {name!r} in {self.source}; it has {names}")
        if found.role != role:
            raise CurveError("target" if role == "target" else "drafter",
                             f"{name!r} is a {found.role} in {self.source}, not a {role}")
        if role == "target" and found.forward is None:
            raise CurveError(f"models.{name}.forward_ms", "a target needs forward times")
        if role == "drafter" and found.draft_loop is None:
            raise CurveError(f"models.{name}.draft_loop_ms", "a drafter needs draft loops")
        return found

    def names(self, role: str) -> list[str]:
        return [n for n, m in self.models.items() if m.role == role]


def pick_model(curves: CostCurves, role: str, name: str | None) -> str:
    """The model of `role` ("target" or "drafter") a command means: `name` when given, else the curves' only one
    (a file with several must be told which)."""
    if name:
        return name
    names = curves.names(role)
    if len(names) != 1:
        raise CurveError(role, f"{curves.source} has {len(names)} {role} models ({', '.join(names)}): name one")
    return names[0]


def load_curves(path: str | Path, drafters_only: bool = False) -> CostCurves:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CurveError("curves", f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CurveError("curves", f"{path} is not JSON: {exc}") from None
    return parse_curves(data, str(path), drafters_only)


def _require(obj: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in obj:
        raise CurveError(f"{where}.{key}" if where else key, "missing")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CurveError(f"{where}.{key}" if where else key, f"expected {expected}, got {type(value).__name__}")
    return value


def _grid(rows: Any, where: str, third: str) -> _Grid:
    if not isinstance(rows, list) or not rows:
        raise CurveError(where, "expected a non-empty list of measurements")
    cells: dict[tuple[int, int], dict[int, float]] = {}
    for i, row in enumerate(rows):
        at = f"{where}[{i}]"
        if not isinstance(row, dict):
            raise CurveError(at, f"expected an object, got {type(row).__name__}")
        batch = _require(row, "batch", at, int)
        context = _require(row, "context", at, int)
        t = _require(row, third, at, int)
        ms = _require(row, "ms", at, (int, float))
        if batch < 1:
            raise CurveError(f"{at}.batch", f"must be >= 1, got {batch}")
        if context < 0:
            raise CurveError(f"{at}.context", f"must be >= 0, got {context}")
        if t < 1:
            raise CurveError(f"{at}.{third}", f"must be >= 1, got {t}")
        if not ms > 0 or ms != ms or ms == float("inf"):
            raise CurveError(f"{at}.ms", f"must be a positive finite time, got {ms}")
        cell = cells.setdefault((context, t), {})
        if batch in cell:
            raise CurveError(at, f"duplicate measurement for batch {batch}, context {context}, {third} {t}")
        cell[batch] = float(ms)
    # Every third-dimension value needs a batch curve at some context, and every context level needs the same
    # third values as the densest level (otherwise interpolation would mix levels measured at different shapes).
    return _Grid(third, cells)


def parse_curves(data: Any, source: str = "<curves>", drafters_only: bool = False) -> CostCurves:
    """`drafters_only`: a file of drafters measured alone on their own device (`minedraft profile --drafter-only`):
    its target entries, which hold no times, are left out."""
    if drafters_only and isinstance(data, dict) and isinstance(data.get("models"), dict):
        data = {**data, "models": {n: m for n, m in data["models"].items()
                                   if not (isinstance(m, dict) and m.get("role") == "target")}}
    if not isinstance(data, dict):
        raise CurveError("curves", f"expected a JSON object, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise CurveError("format", f"expected {FORMAT!r}, got {fmt!r}")
    models_data = _require(data, "models", "", dict)
    if not models_data:
        raise CurveError("models", "no models")
    models: dict[str, ModelCurves] = {}
    for name, model in models_data.items():
        where = f"models.{name}"
        if not isinstance(model, dict):
            raise CurveError(where, f"expected an object, got {type(model).__name__}")
        role = _require(model, "role", where, str)
        if role not in ROLES:
            raise CurveError(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        params = model.get("params")
        if params is not None and (not isinstance(params, int) or params <= 0):
            raise CurveError(f"{where}.params", f"expected a positive integer or null, got {params!r}")
        config = model.get("config", {})
        if not isinstance(config, dict) or not all(isinstance(v, int) for v in config.values()):
            raise CurveError(f"{where}.config", "expected an object of integers (hidden, layers, heads, ...)")
        kv = model.get("kv_bytes_per_token")
        if kv is not None and (not isinstance(kv, int) or kv <= 0):
            raise CurveError(f"{where}.kv_bytes_per_token", f"expected a positive integer, got {kv!r}")
        # A drafter may leave forward_ms empty: its draft loops are what the twin needs of it.
        if role == "target" and "forward_ms" not in model:
            raise CurveError(f"{where}.forward_ms", "missing (a target needs forward times)")
        forward = (_grid(model["forward_ms"], f"{where}.forward_ms", "new_tokens")
                   if model.get("forward_ms") or role == "target" else None)
        loop = _grid(model["draft_loop_ms"], f"{where}.draft_loop_ms", "k") if "draft_loop_ms" in model else None
        if role == "target" and forward is None:
            raise CurveError(f"{where}.forward_ms", "missing (a target needs forward times)")
        if role == "drafter" and loop is None:
            raise CurveError(f"{where}.draft_loop_ms", "missing (a drafter needs draft loops)")
        if loop is not None and role != "drafter":
            raise CurveError(f"{where}.draft_loop_ms", "only drafters have draft loops")
        catch_up = model.get("catch_up_ms_per_token")
        if catch_up is not None and (isinstance(catch_up, bool) or not isinstance(catch_up, int | float)
                                     or not 0 <= catch_up < float("inf")):
            raise CurveError(f"{where}.catch_up_ms_per_token", f"expected a finite number >= 0, got {catch_up!r}")
        if catch_up is not None and role != "drafter":
            raise CurveError(f"{where}.catch_up_ms_per_token", "only drafters take in catch-up tokens")
        prefill = _prefill_grid(model["prefill_ms"], f"{where}.prefill_ms") if model.get("prefill_ms") else None
        models[name] = ModelCurves(name, role, params, dict(config), kv, forward, loop,
                                   None if catch_up is None else float(catch_up), prefill)
    if not drafters_only and not any(m.role == "target" for m in models.values()):
        raise CurveError("models", "no model with role 'target'")
    memory = data.get("device_memory_bytes")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
        raise CurveError("device_memory_bytes", f"expected a positive integer, got {memory!r}")
    return CostCurves(
        source=source,
        device=str(data.get("device", "unknown device")),
        dtype=str(data.get("dtype", "unknown")),
        execution=str(data.get("execution", "unknown")),
        measured=str(data.get("measured", "")),
        models=models,
        device_memory_bytes=memory,
    )
