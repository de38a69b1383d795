"""What callers send and get back: sampling settings and output deltas, validated with field-named errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RequestError(ValueError):
    """A request the engine will not run; `field_name` names the offending field (for INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses the engine process's pipe intact (the default would call RequestError(full_text) and fail).
        return rebuild_error, (type(self), self.args, self.__dict__)


def rebuild_error(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """Unpickle an error whose constructor does not take its own `args` (errors that name a field)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class EngineDeadError(RuntimeError):
    """The engine stopped; requests in flight end with this error instead of silently."""


def encode_prompt(tokenizer: Any, prompt: str | list[int], vocab_size: int, max_model_len: int) -> list[int]:
    """A prompt's token ids (text encoded by the target's tokenizer), checked against the vocabulary and context."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("prompt", "text prompts need a tokenizer; send token ids")
        token_ids = list(tokenizer.encode(prompt))
    else:
        token_ids = list(prompt)
    if not token_ids:
        raise RequestError("prompt", "is empty")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise RequestError("prompt_token_ids", f"token ids must be in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise RequestError(
            "prompt",
            f"is {len(token_ids)} tokens; the context holds {max_model_len} including at least one generated token",
        )
    return token_ids


# vLLM's default `max_logprobs`: the most top tokens a request may ask for at each position.
MAX_TOP_LOGPROBS = 20
# The largest temperature: OpenAI's range, and vLLM 0.32 refuses more (a ValueError at request creation).
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: no log-probabilities; 0: the chosen token's; k: also the k most likely tokens at each position.
    logprobs: int | None = None

    def validate(self) -> None:
        if self.max_tokens <= 0:
            raise RequestError("max_tokens", f"must be positive, got {self.max_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails this too
            raise RequestError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise RequestError("seed", f"must be >= 0, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # NaN fails this too
                raise RequestError(name, f"must be in [-2, 2], got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the target and the most likely tokens at its position
    ((token id, log-probability), most likely first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class OutputDelta:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Per-request speculation: filled on the final delta.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # With SamplingSettings.logprobs: one per token of token_ids.
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    """A whole generation, assembled from its deltas."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, delta: OutputDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.num_prompt_tokens = delta.num_prompt_tokens
            self.num_draft_tokens = delta.num_draft_tokens
            self.num_accepted_tokens = delta.num_accepted_tokens
