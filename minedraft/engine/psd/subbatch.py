"""Pure sub-batch bookkeeping for batch-parallel speculative decoding (no vLLM, no I/O).

Two sub-batches (0 and 1) partition the decoding requests. Each engine step verifies one of them while the other
is drafted; the scheduler adapter asks this module who is in which sub-batch, where newcomers go, how to restore
balance, and which draft positions to keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Move:
    request_id: str
    from_group: int
    to_group: int


@dataclass
class SubBatches:
    """Membership of two sub-batches, insertion-ordered so rebalancing moves the newest requests."""

    groups: tuple[dict[str, None], dict[str, None]] = field(default_factory=lambda: ({}, {}))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups[0] or request_id in self.groups[1]

    def group_of(self, request_id: str) -> int | None:
        if request_id in self.groups[0]:
            return 0
        if request_id in self.groups[1]:
            return 1
        return None

    def sizes(self) -> tuple[int, int]:
        return len(self.groups[0]), len(self.groups[1])

    def members(self, group: int) -> list[str]:
        return list(self.groups[group])

    def all_members(self) -> set[str]:
        return set(self.groups[0]) | set(self.groups[1])

    def admit(self, request_id: str, preferred_group: int, balance: bool = True) -> int:
        """Place a newcomer in the smaller sub-batch; on a tie (or with balance off), in `preferred_group`.

        The scheduler prefers the sub-batch that is drafted next, so a newcomer is drafted before it is verified.
        """
        existing = self.group_of(request_id)
        if existing is not None:
            return existing
        size0, size1 = self.sizes()
        smaller = 0 if size0 < size1 else 1
        group = preferred_group if not balance or size0 == size1 else smaller
        self.groups[group][request_id] = None
        return group

    def remove(self, request_id: str) -> int | None:
        group = self.group_of(request_id)
        if group is not None:
            del self.groups[group][request_id]
        return group

    def merge_into(self, group: int) -> None:
        """Put everyone in one sub-batch (sequential SD)."""
        other = 1 - group
        for request_id in list(self.groups[other]):
            del self.groups[other][request_id]
            self.groups[group][request_id] = None

    def rebalance(self) -> list[Move]:
        """Move the newest members of the larger sub-batch until sizes are within one.

        Moves in either direction keep every request's tokens and drafts valid (drafts are keyed by context
        length, not by sub-batch); a moved request at worst decodes once without drafts.
        """
        moves: list[Move] = []
        while True:
            size0, size1 = self.sizes()
            if abs(size0 - size1) <= 1:
                return moves
            larger = 0 if size0 > size1 else 1
            request_id = next(reversed(self.groups[larger]))
            del self.groups[larger][request_id]
            self.groups[1 - larger][request_id] = None
            moves.append(Move(request_id, larger, 1 - larger))

    def check_balanced(self) -> None:
        size0, size1 = self.sizes()
        if abs(size0 - size1) > 1:
            raise AssertionError(f"sub-batches out of balance: {size0} vs {size1}")
        overlap = set(self.groups[0]) & set(self.groups[1])
        if overlap:
            raise AssertionError(f"requests in both sub-batches: {sorted(overlap)}")


def cumulative(logprobs: list[float]) -> list[float]:
    total = 0.0
    out = []
    for value in logprobs:
        total += value
        out.append(total)
    return out


def select_draft_lengths(
    draft_logprobs: dict[str, list[float]], num_speculative_tokens: int, budget: int | None
) -> dict[str, int]:
    """How many draft tokens of each request to verify.

    Without a budget (no extra drafts) every request keeps its first k tokens. With one, the `budget` positions
    of highest cumulative draft log-probability across the whole sub-batch are kept (TETRIS-style), and each
    request's draft is cut after its furthest kept position. Cumulative log-probabilities never increase along a
    draft, so the kept positions of a request always form a prefix.
    """
    if budget is None:
        return {rid: min(num_speculative_tokens, len(lps)) for rid, lps in draft_logprobs.items()}
    ranked = sorted(
        ((value, -position, rid) for rid, lps in draft_logprobs.items()
         for position, value in enumerate(cumulative(lps))),
        reverse=True,
    )
    lengths = dict.fromkeys(draft_logprobs, 0)
    for _, negative_position, rid in ranked[:budget]:
        lengths[rid] = max(lengths[rid], -negative_position + 1)
    return lengths
