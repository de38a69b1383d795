"""Pure conversions between the API's messages and the engine's types, and the request checks done before any engine
state is touched. No I/O, no gRPC calls: tested directly in tests/unit."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minedraft.api import pb
from minedraft.engine.requests import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, OutputDelta, RequestError, SamplingSettings
from minedraft.engine.settings import EngineSettings, Mode

# Request ids are echoed in responses and logged: keep them bounded.
MAX_REQUEST_ID_CHARS = 256
# Per-request work every step pays on the path all requests share (vLLM checks each stop string against the new text
# of every step): bounded. OpenAI's API allows 4 stop strings.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Bytes per token assumed when the tokenizer's vocabulary cannot be read (an upper bound for common vocabularies).
FALLBACK_MAX_TOKEN_BYTES = 64


@dataclass(frozen=True)
class ModelLimits:
    """What a request must fit: the target's vocabulary and context (prompt plus generated tokens).

    `max_token_bytes` is the longest token's text in bytes: a text prompt longer than max_model_len of those cannot
    fit the context whatever it tokenizes to, so it is refused before tokenizing (tokenizing megabytes takes seconds).
    """

    vocab_size: int
    max_model_len: int
    max_token_bytes: int = FALLBACK_MAX_TOKEN_BYTES

    @property
    def max_prompt_bytes(self) -> int:
        return self.max_model_len * self.max_token_bytes


def max_token_bytes(vocabulary: Iterable[str]) -> int:
    """The longest token text in UTF-8 bytes (for byte-level BPE vocabularies an over-estimate: each of their
    characters stands for one byte but may take two in UTF-8)."""
    return max((len(token.encode("utf-8", errors="replace")) for token in vocabulary), default=0) or 1


@dataclass(frozen=True)
class PreparedRequest:
    """A request that passed every check: ready for AsyncEngine.generate."""

    request_id: str | None
    prompt_token_ids: list[int]
    sampling: SamplingSettings


def _check_token_ids(field_name: str, token_ids: list[int], vocab_size: int) -> None:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise RequestError(field_name, f"token id {token_id} at position {index} is outside [0, {vocab_size})")


# Renders a chat (role, content pairs) into prompt token ids with the model's chat template; raises RequestError
# naming `messages` when the model has none.
ChatRenderer = Callable[[list[tuple[str, str]]], list[int]]


def _no_chat_template(messages: list[tuple[str, str]]) -> list[int]:
    raise RequestError("messages", "this model has no chat template: use a text prompt")


def prompt_token_ids(request: pb.GenerateRequest, limits: ModelLimits,
                     tokenize: Callable[[str], list[int]], render_chat: ChatRenderer = _no_chat_template) -> list[int]:
    """The prompt as token ids: exactly one of text, token ids and chat messages, non-empty, in the vocabulary,
    within the context."""
    given = [name for name, present in (("prompt", bool(request.prompt)),
                                        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
                                        ("messages", len(request.messages) > 0)) if present]
    if len(given) > 1:
        raise RequestError(given[0], f"set only one of prompt, prompt_token_ids and messages, not "
                                     f"{' and '.join(given)}")
    if not given:
        raise RequestError("prompt", "is empty: set prompt (text), prompt_token_ids or messages")
    field_name = given[0]
    if field_name == "prompt":
        token_ids = list(tokenize(request.prompt))
    elif field_name == "messages":
        token_ids = list(render_chat([(message.role, message.content) for message in request.messages]))
    else:
        token_ids = list(request.prompt_token_ids)
    if not token_ids:
        raise RequestError(field_name, "tokenizes to no tokens")
    _check_token_ids(field_name, token_ids, limits.vocab_size)
    if len(token_ids) >= limits.max_model_len:
        raise RequestError(field_name, f"is {len(token_ids)} tokens; the context holds {limits.max_model_len} "
                                       "including at least one generated token")
    return token_ids


def sampling_from_proto(params: pb.SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> SamplingSettings:
    """SamplingParams -> SamplingSettings; unset fields take the documented defaults, set ones are range-checked.

    Field names in errors are the request's own paths (`sampling_params.top_p`), so a client can point at them.
    """
    room = limits.max_model_len - num_prompt_tokens
    max_tokens = params.max_tokens if params.HasField("max_tokens") else room
    if max_tokens <= 0:
        raise RequestError("sampling_params.max_tokens", f"must be positive, got {max_tokens}")
    if max_tokens > room:
        # vLLM's OpenAI server rejects this too rather than silently truncating the completion.
        raise RequestError("sampling_params.max_tokens",
                           f"{max_tokens} tokens do not fit: the context holds {limits.max_model_len} tokens and "
                           f"the prompt takes {num_prompt_tokens}")
    temperature = params.temperature if params.HasField("temperature") else 0.0
    if not 0 <= temperature <= MAX_TEMPERATURE:  # NaN fails this too
        raise RequestError("sampling_params.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:  # NaN fails this too
        raise RequestError("sampling_params.top_p", f"must be in (0, 1], got {top_p}")
    top_k = params.top_k if params.HasField("top_k") else 0
    if top_k < 0:
        raise RequestError("sampling_params.top_k", f"must be >= 0 (0 disables it), got {top_k}")
    seed = params.seed if params.HasField("seed") else None
    if seed is not None and seed < 0:
        raise RequestError("sampling_params.seed", f"must be >= 0, got {seed}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name) if params.HasField(name) else 0.0
        if not -2.0 <= value <= 2.0:  # NaN fails this too
            raise RequestError(f"sampling_params.{name}", f"must be in [-2, 2], got {value}")
        penalties[name] = value
    logprobs = params.logprobs if params.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError("sampling_params.logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    check_list_sizes(params)
    _check_token_ids("sampling_params.stop_token_ids", list(params.stop_token_ids), limits.vocab_size)
    if any(not s for s in params.stop):
        raise RequestError("sampling_params.stop", "stop strings must be non-empty")
    sampling = SamplingSettings(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=logprobs,
        **penalties,
    )
    sampling.validate()  # the engine's own rules, in case they are stricter than the above
    return sampling


def check_list_sizes(params: pb.SamplingParams) -> None:
    """Bounds on every list field of SamplingParams (count and element size)."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise RequestError("sampling_params.stop", f"has {len(params.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    for index, stop in enumerate(params.stop):
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise RequestError("sampling_params.stop", f"stop string {index} is {len(stop)} characters; at most "
                                                       f"{MAX_STOP_STRING_CHARS}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError("sampling_params.stop_token_ids",
                           f"has {len(params.stop_token_ids)} token ids; at most {MAX_STOP_TOKEN_IDS}")


def check_before_tokenizing(request: pb.GenerateRequest, limits: ModelLimits) -> None:
    """The checks that cost nothing and bound what tokenizing may cost: run them first, on the event loop."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestError("request_id", f"is longer than {MAX_REQUEST_ID_CHARS} characters")
    # A character is at most 4 bytes in UTF-8: only a prompt that may be over the bound is measured.
    if len(request.prompt) * 4 > limits.max_prompt_bytes:
        num_bytes = len(request.prompt.encode("utf-8", errors="replace"))
        if num_bytes > limits.max_prompt_bytes:
            raise RequestError("prompt", f"is {num_bytes} bytes; a prompt that fits the context of "
                                         f"{limits.max_model_len} tokens is at most {limits.max_prompt_bytes} bytes")
    # A chat is bounded like a text prompt: its contents' bytes (the template adds a few per message). Counted first:
    # every message costs at least one token, and summing the bytes of hundreds of thousands of messages would hold
    # the event loop.
    if len(request.messages) >= limits.max_model_len:
        raise RequestError("messages", f"has {len(request.messages)} messages; a chat that fits the context of "
                                       f"{limits.max_model_len} tokens has fewer")
    if request.messages:
        num_bytes = sum(len(m.content.encode("utf-8", errors="replace")) + len(m.role) for m in request.messages)
        if num_bytes > limits.max_prompt_bytes:
            raise RequestError("messages", f"are {num_bytes} bytes; a chat that fits the context of "
                                           f"{limits.max_model_len} tokens is at most {limits.max_prompt_bytes} bytes")
    if len(request.prompt_token_ids) >= limits.max_model_len:
        raise RequestError("prompt_token_ids", f"is {len(request.prompt_token_ids)} tokens; the context holds "
                                               f"{limits.max_model_len} including at least one generated token")
    check_list_sizes(request.sampling_params)


def prepare_request(request: pb.GenerateRequest, limits: ModelLimits,
                    tokenize: Callable[[str], list[int]],
                    render_chat: ChatRenderer = _no_chat_template) -> PreparedRequest:
    """Every check a Generate request must pass; raises RequestError naming the first bad field."""
    check_before_tokenizing(request, limits)
    token_ids = prompt_token_ids(request, limits, tokenize, render_chat)
    sampling = sampling_from_proto(request.sampling_params, len(token_ids), limits)
    return PreparedRequest(request.request_id or None, token_ids, sampling)


def token_texts(tokenizer: Any) -> Callable[[int], str]:
    """Each token's text by itself (for log-probabilities; cached: the same ids recur)."""
    if tokenizer is None:
        return lambda token_id: ""

    # vLLM's own per-token text (decode, with a SentencePiece token's leading space put back), so the tokens read
    # as vLLM's server reports them.
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    @functools.lru_cache(maxsize=1 << 16)
    def text(token_id: int) -> str:
        return str(convert_ids_list_to_tokens(tokenizer, [token_id])[0])

    return text


def _no_token_text(token_id: int) -> str:
    return ""


def response_from_delta(delta: OutputDelta, token_text: Callable[[int], str] = _no_token_text) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text)
    if delta.logprobs is not None:
        for token_id, entry in zip(delta.token_ids, delta.logprobs, strict=False):
            response.logprobs.add(logprob=entry.logprob, token=token_text(token_id), top_logprobs=[
                pb.TopLogprob(token_id=t, token=token_text(t), logprob=lp) for t, lp in entry.top])
    if delta.finished:
        response.finish_reason = delta.finish_reason or "stop"
        response.usage.prompt_tokens = delta.num_prompt_tokens
        response.usage.completion_tokens = delta.num_output_tokens
        response.speculation.num_draft_tokens = delta.num_draft_tokens
        response.speculation.num_accepted_tokens = delta.num_accepted_tokens
    return response


def public_model_name(model: str) -> str:
    """A model as callers may see it: a hub id as it is, a local directory by its last two path components (its
    place on the machine is the operator's business, not the callers')."""
    path = Path(model)
    if path.is_absolute() or model.startswith((".", "~")) or path.exists():
        return "/".join(path.parts[-2:])
    return model


def model_info(settings: EngineSettings, vocab_size: int) -> pb.GetModelInfoResponse:
    uses_draft = settings.mode is not Mode.AR
    return pb.GetModelInfoResponse(
        model=settings.model,
        draft_model=public_model_name(settings.drafter.model) if uses_draft else "",
        max_model_len=settings.max_model_len,
        vocab_size=vocab_size,
        mode=settings.mode.value,
        num_speculative_tokens=settings.num_speculative_tokens if uses_draft else 0,
        num_extra_draft_tokens=settings.num_extra_draft_tokens if uses_draft else 0,
        max_num_seqs=settings.max_num_seqs,
    )


def chat_renderer(tokenizer: Any) -> ChatRenderer:
    """The target tokenizer's chat template as a ChatRenderer (transformers' apply_chat_template, then the tokenizer
    on the rendered text without special tokens, as vLLM's OpenAI server does: the template places those)."""

    def render(messages: list[tuple[str, str]]) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            _no_chat_template(messages)
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (a role it does not know, an order it forbids)
            raise RequestError("messages", f"the model's chat template rejected them: {exc}") from exc
        return list(tokenizer.encode(text, add_special_tokens=False))

    return render
