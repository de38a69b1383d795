"""What to measure: shape grids (batch x context x draft length) and the list of measurements they make."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from itertools import product
from typing import Any

KINDS = ("forward", "draft_loop", "concurrent", "prefill")


@dataclass(frozen=True)
class ShapeGrid:
    points: tuple[tuple[int, int], ...]  # (batch, context) for forwards and draft loops
    ks: tuple[int, ...]  # draft lengths: verify forwards at k + 1 new tokens, draft loops of k tokens
    concurrent_points: tuple[tuple[int, int], ...] = ()  # (batch, context) for target + drafter on two streams
    concurrent_ks: tuple[int, ...] = ()
    # (prompt tokens, cached context) for one request's prompt chunk (batch 1): what prefill costs.
    prefill_points: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for tokens, context in self.prefill_points:
            if tokens < 1 or context < 0:
                raise ValueError(f"shapes: prefill tokens must be positive and context >= 0, got ({tokens}, "
                                 f"{context})")
        for batch, context in (*self.points, *self.concurrent_points):
            if batch < 1 or context < 1:
                raise ValueError(f"shapes: batch and context must be positive, got ({batch}, {context})")
        if not self.points:
            raise ValueError("shapes: no (batch, context) points")
        if any(k < 1 for k in (*self.ks, *self.concurrent_ks)) or not self.ks:
            raise ValueError(f"shapes: draft lengths must be positive integers, got {self.ks}")

    def new_tokens(self) -> tuple[int, ...]:
        """One-token decode steps and k-token verifications (k + 1 new tokens)."""
        return tuple(sorted({1, *(k + 1 for k in self.ks)}))

    def with_overrides(self, batches: list[int] | None = None, contexts: list[int] | None = None,
                       ks: list[int] | None = None) -> ShapeGrid:
        """Replace the grid's batches and/or contexts by their product, and/or its draft lengths."""
        grid = self
        if batches or contexts:
            bs = batches or sorted({b for b, _ in self.points})
            cs = contexts or sorted({c for _, c in self.points})
            points = tuple(product(bs, cs))
            concurrent = tuple(p for p in points if p in set(self.concurrent_points)) or (
                tuple(product(bs, cs[:1])) if self.concurrent_points else ())
            grid = replace(grid, points=points, concurrent_points=concurrent)
        if ks:
            grid = replace(grid, ks=tuple(ks), concurrent_ks=tuple(ks[:1]) if grid.concurrent_points else ())
        return grid


def _points(batches: tuple[int, ...], context: int) -> tuple[tuple[int, int], ...]:
    return tuple((b, context) for b in batches)


SHAPE_PRESETS: dict[str, ShapeGrid] = {
    # The H200 file's grid: batch 1-128 at context 1024, batch 1, 8, 32 at 4096; k 3 and 5 (1, 4, 6 new tokens).
    "gpu": ShapeGrid(points=_points((1, 2, 4, 8, 16, 32, 64, 128), 1024) + _points((1, 8, 32), 4096),
                     ks=(3, 5), concurrent_points=_points((1, 8, 16, 32, 64), 1024), concurrent_ks=(3,),
                     prefill_points=((128, 0), (512, 0), (1024, 0), (2048, 0), (4096, 0), (1024, 4096))),
    # The local pair on a CPU: the concurrencies `minedraft bench` runs, at a short and a longer context.
    "cpu-small": ShapeGrid(points=_points((1, 2, 4, 8, 16, 32), 128) + _points((1, 2, 4, 8, 16, 32), 512),
                           ks=(3,), concurrent_points=_points((1, 8, 32), 128), concurrent_ks=(3,),
                           prefill_points=((32, 0), (128, 0), (512, 0))),
    # For tests: seconds on a CPU.
    "tiny": ShapeGrid(points=((1, 16), (2, 16)), ks=(2,), concurrent_points=((2, 16),), concurrent_ks=(2,),
                      prefill_points=((8, 0), (16, 0))),
}


@dataclass(frozen=True)
class Measurement:
    kind: str  # forward | draft_loop | concurrent
    model: str  # the model measured (concurrent: the target)
    batch: int
    context: int
    tokens: int  # forward: new tokens per request; draft_loop and concurrent: k; prefill: prompt tokens
    drafter: str = ""  # concurrent: the drafter running beside the target

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {', '.join(KINDS)}")

    def label(self) -> str:
        what = {"forward": f"q={self.tokens}", "draft_loop": f"k={self.tokens}", "prefill": f"tokens={self.tokens}",
                "concurrent": f"k={self.tokens} beside {self.drafter}"}[self.kind]
        return f"{self.kind} {self.model} batch={self.batch} context={self.context} {what}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        return cls(**data)


def plan(grid: ShapeGrid, target: str, drafters: list[str], concurrent: bool) -> list[Measurement]:
    """Every measurement, grouped by model: the target first, then each drafter followed by its pair with the target
    on two streams (in order of importance, for a run whose time budget ends early)."""
    out = [Measurement("forward", target, b, c, q) for (b, c) in grid.points for q in grid.new_tokens()]
    out += [Measurement("prefill", target, 1, c, p) for (p, c) in grid.prefill_points]
    for drafter in drafters:
        out += [Measurement("forward", drafter, b, c, q) for (b, c) in grid.points for q in grid.new_tokens()]
        out += [Measurement("draft_loop", drafter, b, c, k) for (b, c) in grid.points for k in grid.ks]
        out += [Measurement("prefill", drafter, 1, c, p) for (p, c) in grid.prefill_points]
        if concurrent:
            out += [Measurement("concurrent", target, b, c, k, drafter=drafter)
                    for (b, c) in grid.concurrent_points for k in grid.concurrent_ks]
    return out


def cache_tokens(context: int, tokens: int, kind: str) -> int:
    """KV-cache positions per request a measurement needs: context + new tokens, or for a k-token draft loop the
    k + 1 tokens of its first pass and the k - 1 of the one-token passes after it."""
    return context + (tokens if kind in ("forward", "prefill") else 2 * tokens)
