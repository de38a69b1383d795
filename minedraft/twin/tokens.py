"""Simulated token ids for the twin: what the drafter proposes and what the target commits, consistent with each
other, so that the engine's own code decides what matches (lookahead's branches are taken by comparing token ids).

The drafter's ranked candidates at a position are a deterministic function of the request, the position and the
token before it (a hash): the simulated drafter answers a job from them (its draft is the chain of its top
choices, its candidates the top few at each drafted position and the one after), and the simulated target commits
from them. The target's token at a position is the drafter's top choice with the acceptance model's conditional
rate there (the accepted drafts, and the bonus after a full acceptance); otherwise, as after a rejection, it is the
drafter's rank-r candidate with the measured P(rank = r | rank >= 2) (`rank_given_rejection`, from
benchmarks/lookahead_coverage.py on the local pair), and past the ranks given a fresh id no candidate list holds.
So a branch drafted for (accepted length a, bonus among the top F) hits exactly as often as the pair's acceptance
and the drafter's coverage of the target's token say, whatever branches the engine chooses to draft.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from minedraft.engine.control.cost_model import LOCAL_PAIR_RANK_GIVEN_REJECTION

_MASK = (1 << 64) - 1
# Candidate ids lie in [1, 2^31); fresh ids (tokens the drafter ranks past every candidate) above it.
_CANDIDATE_SPACE = (1 << 31) - 1
_FRESH_BASE = 1 << 31
# A candidate's key: request, position, previous token and rank spread by odd multipliers before one mix.
_STREAM_MUL, _POSITION_MUL = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F
_PREVIOUS_MUL, _RANK_MUL = 0x165667B19E3779F9, 0x27D4EB2F165667C5


def _mix(value: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an integer (deterministic across runs)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def stream_of(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


@dataclass
class TokenModel:
    """The drafter's candidates and the target's tokens of every simulated request (see the module's doc)."""

    rank_given_rejection: tuple[float, ...] = LOCAL_PAIR_RANK_GIVEN_REJECTION
    seed: int = 0
    rng: random.Random = field(init=False, repr=False)
    _fresh: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if any(q < 0 for q in self.rank_given_rejection) or sum(self.rank_given_rejection) > 1 + 1e-9:
            raise ValueError(f"rank_given_rejection: probabilities summing to at most 1, got "
                             f"{self.rank_given_rejection}")
        self.rng = random.Random(self.seed)

    def candidate(self, stream: int, position: int, previous: int, rank: int) -> int:
        """The drafter's rank-`rank` choice (1: its top) at `position` after token `previous`."""
        # One mix of the four, spread by odd multipliers first (a hash per drafted token: the twin's hot path).
        key = stream * _STREAM_MUL + position * _POSITION_MUL + previous * _PREVIOUS_MUL + rank * _RANK_MUL
        return 1 + _mix(key & _MASK) % _CANDIDATE_SPACE

    def candidates(self, stream: int, position: int, previous: int, count: int) -> list[int]:
        return [self.candidate(stream, position, previous, rank) for rank in range(1, count + 1)]

    def draft(self, stream: int, position: int, previous: int, length: int) -> list[int]:
        """A greedy draft of `length` tokens from `position` on: each the drafter's top choice after the one before."""
        out: list[int] = []
        for i in range(length):
            previous = self.candidate(stream, position + i, previous, 1)
            out.append(previous)
        return out

    def draft_with_candidates(self, stream: int, position: int, previous: int, length: int,
                              count: int) -> tuple[list[int], list[list[int]]]:
        """The draft and the top `count` candidates at each drafted position and at the one after it."""
        # `candidate` unrolled (the twin's hottest loop under lookahead: six ranks at each of k + 1 positions of
        # every branch): the same keys and mix, the request's and each position's terms added once.
        drafted: list[int] = []
        ranked: list[list[int]] = []
        base = stream * _STREAM_MUL
        rank_terms = [rank * _RANK_MUL for rank in range(1, max(count, 1) + 1)]
        for i in range(length + 1):
            here = base + (position + i) * _POSITION_MUL + previous * _PREVIOUS_MUL
            row = []
            for term in rank_terms:
                value = ((here + term) & _MASK) + 0x9E3779B97F4A7C15 & _MASK
                value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
                value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
                row.append(1 + (value ^ (value >> 31)) % _CANDIDATE_SPACE)
            top = row[0]
            ranked.append(row if count >= 1 else [])
            if i < length:
                drafted.append(top)
                previous = top
        return drafted, ranked

    def _other_rank(self) -> int | None:
        """A rank >= 2 drawn from `rank_given_rejection`; None past the ranks given (a fresh token)."""
        draw = self.rng.random()
        for rank, share in enumerate(self.rank_given_rejection, start=2):
            draw -= share
            if draw < 0:
                return rank
        return None

    def target_token(self, stream: int, position: int, previous: int, top_choice_rate: float) -> int:
        """The target's token at a position the drafter's top choice is accepted at with `top_choice_rate`."""
        if self.rng.random() < top_choice_rate:
            return self.candidate(stream, position, previous, 1)
        return self.rejected_token(stream, position, previous)

    def rejected_token(self, stream: int, position: int, previous: int) -> int:
        """The target's token where it is not the drafter's top choice (a rejected draft's bonus)."""
        rank = self._other_rank()
        if rank is None:
            self._fresh += 1
            return _FRESH_BASE + self._fresh
        return self.candidate(stream, position, previous, rank)

    def valid_prefix(self, stream: int, position: int, previous: int, proposal: Sequence[int]) -> int:
        """How many of the proposal's first tokens are the drafter's top choices in the request's real context: a
        draft made from another context (a lookahead backup: a branch whose bonus token was not the real one)
        leaves it, and from there the target, whose token is the top choice or another candidate, rejects it."""
        for index, token in enumerate(proposal):
            if token != self.candidate(stream, position + index, previous, 1):
                return index
            previous = token
        return len(proposal)

    def judge(self, stream: int, position: int, previous: int, proposal: Sequence[int], drawn: int,
              top_choice_rate: float) -> list[int]:
        """The tokens a verification commits, where the acceptance model drew `drawn` accepted drafts for a
        well-formed proposal: as drawn up to the proposal's valid prefix (`valid_prefix`); past it the proposal's
        token is not the target's, so the draw decides only the target's own token there (its top choice where the
        draw went on, another rank where it stopped), which is then the bonus."""
        valid = self.valid_prefix(stream, position, previous, proposal)
        if drawn <= valid:
            return self.commit(stream, position, previous, proposal, drawn, top_choice_rate)
        committed = list(proposal[:valid])
        after = committed[-1] if committed else previous
        committed.append(self.candidate(stream, position + valid, after, 1))
        return committed

    def commit(self, stream: int, position: int, previous: int, proposal: Sequence[int], accepted: int,
               top_choice_rate: float) -> list[int]:
        """The tokens a verification commits: the first `accepted` proposed tokens and the bonus after them (the
        proposal's tokens are the drafter's top choices, as `draft` makes them). `top_choice_rate`: the bonus's
        chance to be the drafter's top choice after a full acceptance (the acceptance model's conditional rate at
        the next position); after a rejection it is another rank."""
        committed = list(proposal[:accepted])
        after = committed[-1] if committed else previous
        bonus_position = position + accepted
        if accepted < len(proposal):
            committed.append(self.rejected_token(stream, bonus_position, after))
        else:
            committed.append(self.target_token(stream, bonus_position, after, top_choice_rate))
        return committed
