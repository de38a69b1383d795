"""Messages between the verifier (our scheduler) and the drafter process.

Only token ids (and, for extra drafts, the drafted tokens' log-probabilities) cross: kilobytes per step.
"""

from __future__ import annotations

import msgspec


class DraftItem(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    # The committed context: prompt and verified output tokens, nothing speculative.
    token_ids: list[int]
    num_draft_tokens: int


class DraftJob(msgspec.Struct, frozen=True, array_like=True, tag="job"):
    job_id: int
    items: list[DraftItem]
    want_logprobs: bool = False


class CancelRequests(msgspec.Struct, frozen=True, array_like=True, tag="cancel"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag="shutdown"):
    pass


class DraftResult(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    # Length of the context the draft was made from: the provenance check on the verifier side.
    context_num_tokens: int
    token_ids: list[int]
    logprobs: list[float] | None = None


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


class Ready(msgspec.Struct, frozen=True, array_like=True, tag="ready"):
    pid: int
    model: str
    startup_seconds: float


class DrafterError(msgspec.Struct, frozen=True, array_like=True, tag="error"):
    job_id: int
    message: str


ToDrafter = DraftJob | CancelRequests | Shutdown
FromDrafter = DraftReply | Ready | DrafterError

_encoder = msgspec.msgpack.Encoder()
_to_drafter = msgspec.msgpack.Decoder(ToDrafter)  # type: ignore[var-annotated]
_from_drafter = msgspec.msgpack.Decoder(FromDrafter)  # type: ignore[var-annotated]


def encode(message: ToDrafter | FromDrafter) -> bytes:
    return _encoder.encode(message)


def decode_to_drafter(data: bytes) -> ToDrafter:
    return _to_drafter.decode(data)  # type: ignore[no-any-return]


def decode_from_drafter(data: bytes) -> FromDrafter:
    return _from_drafter.decode(data)  # type: ignore[no-any-return]
