"""Messages between the verifier (our scheduler) and the drafter process.

Only token ids (and, for extra drafts, the drafted tokens' log-probabilities) cross: kilobytes per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import msgspec


class DraftItem(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    # Committed tokens (prompt and verified output, nothing speculative) from position base_num_tokens on: the
    # drafter keeps each request's earlier tokens between jobs, so a job carries only what was committed since.
    token_ids: list[int]
    num_draft_tokens: int
    # 0: token_ids is the whole context. Otherwise the drafter must already hold at least this many tokens of the
    # request (it answers `need_context` if it does not: after a restart or an eviction).
    base_num_tokens: int = 0
    # Lookahead: speculative tokens after the committed context (an outcome the verification may have: accepted
    # drafts and a bonus token) that this branch drafts from. Never committed: the drafter's holdings of the request
    # stay the committed tokens, and several branches of one request share them.
    tail: list[int] = []
    # Lookahead: which branch of its request this item is (echoed in the result).
    branch: int = 0


class _OfRequest(Protocol):
    @property
    def request_id(self) -> str: ...


_Item = TypeVar("_Item", bound=_OfRequest)


def required_items(items: Sequence[_Item]) -> list[_Item]:
    """Each request's first item in a job: its only one (sd, psd, a root, a catch-up chunk), or lookahead's likeliest
    branch (an engine lists a request's branches likeliest first). The rest are extra branches: each raises the hit
    rate a little and costs a row of every forward (a shared drafter drops them when other jobs wait). Results come
    back in their items' order, so the same picks a reply's results for those items."""
    seen: set[str] = set()
    kept: list[_Item] = []
    for item in items:
        if item.request_id not in seen:
            seen.add(item.request_id)
            kept.append(item)
    return kept


def drafted_tokens(items: list[DraftItem]) -> int:
    """The tokens a job's forwards take per item (its tail and its drafts; at least one): what apportions a batch's
    time among its items."""
    return sum(max(1, len(item.tail) + item.num_draft_tokens) for item in items)


class DraftJob(msgspec.Struct, frozen=True, array_like=True, tag="job"):
    job_id: int
    items: list[DraftItem]
    want_logprobs: bool = False
    # Lookahead: with each draft, the drafter's top-`top_f` token ids at every drafted position and the one after
    # (0: none).
    top_f: int = 0


class CancelRequests(msgspec.Struct, frozen=True, array_like=True, tag="cancel"):
    """These requests finished or were aborted: drop their work and forget their tokens and KV."""

    request_ids: list[str]


class CancelJobs(msgspec.Struct, frozen=True, array_like=True, tag="cancel_jobs"):
    """The verifier went ahead without these jobs' drafts: skip their drafting, keep every request's tokens and KV
    (the requests are alive and will be drafted again next step)."""

    job_ids: list[int]


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag="shutdown"):
    pass


class DraftResult(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    # Length of the context the draft was made from: the provenance check on the verifier side.
    context_num_tokens: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    # Lookahead: the item's branch and tail, echoed; context_num_tokens then counts the tail too (the context the
    # draft follows).
    branch: int = 0
    tail: list[int] = []
    # Lookahead (DraftJob.top_f > 0): the top-F token ids, best first, at positions 1..len(token_ids)+1 after the
    # context (the last: candidates for the bonus token after a full acceptance).
    candidates: list[list[int]] = []


class DraftReply(msgspec.Struct, frozen=True, array_like=True, tag="reply"):
    job_id: int
    results: list[DraftResult]
    draft_seconds: float
    # Time the drafter sat with nothing to do before this job arrived.
    idle_seconds: float
    # Of draft_seconds, the part up to the first drafted token: feeding the tokens committed since the last job
    # (a whole prompt for a new request) and proposing position 1. Each further position costs one small forward,
    # so a draft of length k costs first + (k - 1) * next, not k times a forward. 0 when not measured.
    first_token_seconds: float = 0.0
    # Requests of the job whose earlier tokens the drafter does not hold (restarted, evicted): not drafted; the
    # verifier sends their whole context next time.
    need_context: list[str] = []


class Ready(msgspec.Struct, frozen=True, array_like=True, tag="ready"):
    pid: int
    model: str
    startup_seconds: float
    # The longest context (committed tokens plus drafts) the drafter can hold; 0: no limit it knows of. The verifier
    # sends it no request at or past this length: such a request decodes in every step, without drafts.
    max_context_tokens: int = 0


class StartupStage(msgspec.Struct, frozen=True, array_like=True, tag="startup"):
    """The drafter's start-up reached a stage (before Ready): "imported" (its backend's modules: vLLM's import alone
    takes tens of seconds), "downloading" (the weights' download grew; repeated while it does), "weights" (loaded),
    "compiled" (vLLM's CUDA graphs captured or its engine initialised). The verifier judges a start-up by the time
    since its last stage, not since the spawn: a drafter still downloading or compiling is not a hung one."""

    pid: int
    stage: str
    seconds: float  # since the process started
    detail: str = ""


STARTUP_STAGES = ("imported", "downloading", "weights", "compiled")


class DrafterError(msgspec.Struct, frozen=True, array_like=True, tag="error"):
    job_id: int
    message: str
    # Requests that fail even when drafted alone (the drafter retries a failed job's requests one by one): the
    # verifier stops drafting them, and the drafter stays up for the rest. Empty when it could not tell.
    request_ids: list[str] = []
    # The drafter itself is broken (a probe job with a known-good one-token context failed too: a sticky device
    # error, not a poison request): the verifier restarts it, with back-off, and blames no request.
    drafter_broken: bool = False


class Progress(msgspec.Struct, frozen=True, array_like=True, tag="progress"):
    """The drafter is working on a job and has just finished another step of it (a forward pass). Sent at most
    every PROGRESS_INTERVAL_SECONDS while a job runs: the verifier tells a slow drafter (steps keep finishing) from a
    hung one (no step finishes) by these, not by how long a reply takes."""

    job_id: int
    # Steps of this job finished so far.
    num_steps: int


class DrafterBusy(msgspec.Struct, frozen=True, array_like=True, tag="busy"):
    """A shared drafter service did not draft this job: its queue was full, or the job waited longer than the
    engine's deadline (backpressure). The verifier verifies that sub-batch without drafts at once and counts it; the
    service still took in the job's tokens, so the next job stays a small delta."""

    job_id: int
    reason: str


# How often at most a working drafter reports progress; the verifier's hang threshold must be well above it.
PROGRESS_INTERVAL_SECONDS = 0.25

ToDrafter = DraftJob | CancelRequests | CancelJobs | Shutdown
FromDrafter = DraftReply | Ready | DrafterError | Progress | DrafterBusy | StartupStage

_encoder = msgspec.msgpack.Encoder()
_to_drafter = msgspec.msgpack.Decoder(ToDrafter)  # type: ignore[var-annotated]
_from_drafter = msgspec.msgpack.Decoder(FromDrafter)  # type: ignore[var-annotated]


def encode(message: ToDrafter | FromDrafter) -> bytes:
    return _encoder.encode(message)


def decode_to_drafter(data: bytes) -> ToDrafter:
    return _to_drafter.decode(data)  # type: ignore[no-any-return]


def decode_from_drafter(data: bytes) -> FromDrafter:
    return _from_drafter.decode(data)  # type: ignore[no-any-return]
