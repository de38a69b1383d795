"""OpenAI HTTP API <-> minedraft.v1 messages: pure translations, no I/O.

A request body becomes a pb.GenerateRequest (the one request type the engine server validates, whichever front end
it came through); pb.GenerateResponse messages become OpenAI's response objects and Server-Sent Event chunks; a gRPC
status becomes OpenAI's error object and HTTP status. Every known field that would change the output and that
MineDraft cannot honour is rejected with a 400 naming it; a field the endpoint does not know is ignored and reported
(the front end logs it), as vLLM's server does.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import accumulate
from typing import Any

import grpc
import msgspec

from minedraft.api import pb

# Proto field limits (int32 / int64 / uint32): a larger JSON number is a 400, not an exception while converting.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UINT32_MAX = 2**32 - 1
# OpenAI's completions API defaults max_tokens to 16 (chat defaults to the rest of the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI accepts up to 4 stop sequences; more are refused there too.
MAX_STOP_SEQUENCES = 4
# Bounds on the lists a body may carry, checked before any per-item work (the engine checks the model's own limits:
# its context length, its vocabulary): far above any model's context, far below what 8 MiB of JSON holds.
MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 1 << 16
# Fan-out bounds: one HTTP request becomes n generations per prompt, each its own engine request (and, through the
# gateway, its own admission slot). Bounded so that one request cannot take a whole server's batch.
MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # a completions batch: a list of prompts
MAX_GENERATIONS = 64  # n times the number of prompts
# The most top tokens per position a request may ask log-probabilities of (vLLM's default `max_logprobs`).
MAX_TOP_LOGPROBS = 20
# Arrays and objects nested deeper than this in a body are a 400 (OpenAI's bodies nest a handful of levels).
MAX_JSON_DEPTH = 64
# json_depth's tables: strings cut out, every byte but a bracket deleted, then each bracket's step.
_JSON_STRING = re.compile(rb'"[^"]*"')
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = [1 if b in b"[{" else -1 for b in range(256)]
# -inf is not JSON: OpenAI's servers (and vLLM's) send this floor instead.
MIN_LOGPROB = -9999.0

SSE_DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"


class ApiError(Exception):
    """An OpenAI error: HTTP status and the {"error": {message, type, param, code}} body."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or _ERROR_TYPES.get(status, "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_exceeded", 431: "invalid_request_error", 503: "service_unavailable",
                504: "timeout"}


def invalid(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param, code=code)


@dataclass(frozen=True)
class ParsedRequest:
    """An OpenAI request translated: the engine request plus what shapes the HTTP response."""

    kind: Kind
    model: str
    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    # Engine field name -> the OpenAI parameter the client set it with (for 400s the engine raises).
    params: dict[str, str] = field(default_factory=dict)
    # vLLM's extension: each choice (and chunk) also carries the generated `token_ids`.
    return_token_ids: bool = False
    # Fields this endpoint does not know, ignored (the front end logs them).
    ignored_fields: tuple[str, ...] = ()
    # Choices per prompt, and the engine requests of a fanned-out request (n > 1 or a batch of prompts): one per
    # choice, in choice order (index = prompt_index * n + i, as OpenAI and vLLM number them). Empty: `request` alone.
    n: int = 1
    fanned: tuple[pb.GenerateRequest, ...] = ()
    # completions' `echo`: each prompt's text, put before its choices' text.
    echo_texts: tuple[str, ...] = ()
    # The answer carries the generated tokens' log-probabilities.
    logprobs: bool = False
    # completions' echo with max_tokens 0: the prompt alone. The engine generates one token (as vLLM's server has
    # its engine do), which the answer leaves out.
    echo_only: bool = False

    @property
    def requests(self) -> tuple[pb.GenerateRequest, ...]:
        """Every engine request this HTTP request runs."""
        return self.fanned or (self.request,)


# Fields accepted and ignored because they do not change the output (OpenAI's own bookkeeping fields).
_IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
# Fields that change the output and that MineDraft can only honour at their neutral value.
_NEUTRAL: dict[str, Any] = {
    "logit_bias": None, "best_of": 1,
    "suffix": None, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
    "response_format": None, "parallel_tool_calls": None, "modalities": None,
    "audio": None, "prediction": None, "reasoning_effort": None, "web_search_options": None,
}
# vLLM's own extensions (its server honours them) that change the output or its shape, with the values that ask for
# nothing: a client moving from vLLM that sets one otherwise gets a 400 naming it, not a silently different answer.
# vLLM's fields that change neither (priority, cache_salt, request_id, kv_transfer_params, stream_interval, ...) stay
# unknown here: ignored and logged.
_VLLM_NEUTRAL: dict[str, Any] = {
    "use_beam_search": False, "min_p": 0.0, "repetition_penalty": 1.0, "watermarking": False, "length_penalty": 1.0,
    "include_stop_str_in_output": False, "min_tokens": 0, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "allowed_token_ids": None,
    "prompt_logprobs": None, "logprob_token_ids": None, "bad_words": None, "prompt_embeds": None,
    "structured_outputs": None, "return_tokens_as_token_ids": False, "return_token_offsets": False,
    "vllm_xargs": None, "repetition_detection": None, "thinking_token_budget": None,
    # vLLM's legacy structured-output fields (before `structured_outputs`), still read by clients written for it.
    "guided_json": None, "guided_choice": None, "guided_regex": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None,
    # Whether the tokenizer adds its special tokens (BOS) to the prompt: vLLM's completions add them, its chat does
    # not (the template places them), and so does the engine here.
    "add_special_tokens": True,
}
_VLLM_CHAT_NEUTRAL: dict[str, Any] = {
    "add_special_tokens": False,
    "add_generation_prompt": True, "continue_final_message": False, "documents": None, "chat_template": None,
    "chat_template_kwargs": None, "return_prompt_text": False,
}
_NEUTRAL_BY_KIND = {Kind.COMPLETION: {**_NEUTRAL, **_VLLM_NEUTRAL},
                    Kind.CHAT: {**_NEUTRAL, **_VLLM_NEUTRAL, **_VLLM_CHAT_NEUTRAL}}
# Further values of those fields that ask for nothing the engine does not do anyway.
_ALSO_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tool_choice": ("none",), "response_format": ({"type": "text"},),
}
_COMMON = frozenset({"model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
                     "logprobs", "top_k", "ignore_eos", "stop_token_ids", "return_token_ids", "presence_penalty",
                     "frequency_penalty"})
_ALLOWED = {
    Kind.COMPLETION: _COMMON | {"prompt", "echo"},
    Kind.CHAT: _COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
}


def json_depth(raw: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest (0: a scalar), counted in C-level passes, never by
    recursion (whose bound is process-global state: sys.getrecursionlimit(), which torch's compiler raises), and
    without numpy (the gateway's install has none).

    Escaped backslashes, then escaped quotes, are blanked (bytes.replace, left to right: what is left of each
    backslash pair cannot start another escape), so every quote left opens or closes a string; strings are cut out
    (an unterminated last one with all after it) and the brackets left are summed as +1/-1. Invalid JSON gets some
    number; the decoder refuses it."""
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets <= MAX_JSON_DEPTH:
        return brackets  # an upper bound, and within the limit: no need to measure
    text = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    if text.count(b'"') % 2:
        text = text[:text.rfind(b'"')]
    kept = _JSON_STRING.sub(b"", text).translate(None, _NOT_A_BRACKET)
    return max(0, max(accumulate(map(_BRACKET_STEP.__getitem__, kept)), default=0))


def decode_body(raw: bytes) -> dict[str, Any]:
    # The depth first, explicitly: the decoder's own bound is the interpreter's recursion limit, process-global state.
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise invalid(None, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels of arrays and "
                            "objects)")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise invalid(None, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    return body


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # an integer written as 2.0 (vLLM's validation accepts it too)
    # JSON true/false decode to bool, a subclass of int: not a number here.
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise invalid(name, f"must be in [{low}, {high}], got {value}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"must be a number, got {value!r}")
    return float(value)


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"must be true or false, got {value!r}")
    return value


def _check_fields(body: Mapping[str, Any], kind: Kind) -> list[str]:
    """Refuses the fields that would change the output and cannot be honoured; returns the unknown ones."""
    ignored: list[str] = []
    for name, value in body.items():
        if name in _IGNORED:
            continue
        if name == "echo" and kind is Kind.CHAT:
            # vLLM's chat `echo` (repeat the last message) is not OpenAI's and not implemented: never ignored.
            if value not in (None, False):
                raise invalid(name, "is supported by completions only", "unsupported_parameter")
            continue
        neutrals = _NEUTRAL_BY_KIND[kind]
        if name in neutrals:
            neutral = neutrals[name]
            if value in _ALSO_NEUTRAL.get(name, ()):
                continue
            if value is not None and value != neutral and not (neutral is None and value in ({}, [], False)):
                raise invalid(name, f"is not supported by this server (only {neutral!r})", "unsupported_parameter")
            continue
        if name not in _ALLOWED[kind]:
            ignored.append(name)  # as vLLM's server does: ignored (and logged), not refused
    return ignored


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must be non-empty")
    return stops


def _token_ids(value: Any, name: str, max_count: int = MAX_PROMPT_TOKEN_IDS) -> list[int] | None:
    # Bounded before the per-item pass: a body of millions of small items costs its decoding, not a check each.
    if isinstance(value, list) and len(value) > max_count:
        raise invalid(name, f"has {len(value)} token ids; at most {max_count}")
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(not 0 <= t <= UINT32_MAX for t in value):
            raise invalid(name, "token ids must be non-negative")
        return value
    return None


def _prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The prompts of a completions request: one (a string or a list of token ids) or a batch (a list of those)."""
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    # OpenAI's batch forms: a list of strings, or a list of token id lists.
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid("prompt", f"a batch of {len(prompt)} prompts; at most {MAX_PROMPTS} per request")
        prompts: list[str | list[int]] = []
        for index, item in enumerate(prompt):
            if isinstance(item, str):
                prompts.append(item)
                continue
            token_ids = _token_ids(item, "prompt")
            if token_ids is None:
                raise invalid("prompt", f"prompt[{index}] must be a string or a list of token ids")
            prompts.append(token_ids)
        return prompts
    token_ids = _token_ids(prompt, "prompt")
    if token_ids is None:
        raise invalid("prompt", "must be a string, a list of token ids, or a list of those (a batch)")
    return [token_ids]


def _set_prompt(request: pb.GenerateRequest, prompt: str | list[int]) -> None:
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)


def _content(value: Any, index: int) -> str:
    if isinstance(value, str):
        return value
    # OpenAI's content parts: only text parts can be rendered by a text model's template.
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"messages[{index}].content", "only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{index}].content", "must be a string or a list of text parts")


def _messages(body: Mapping[str, Any], request: pb.GenerateRequest) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "is required: a non-empty list of {role, content}")
    if len(messages) > MAX_MESSAGES:
        raise invalid("messages", f"has {len(messages)} messages; at most {MAX_MESSAGES}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{index}]", "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"messages[{index}].role", "must be a non-empty string")
        content = message.get("content")
        request.messages.add(role=role, content="" if content is None else _content(content, index))


def parse_request(body: Mapping[str, Any], kind: Kind) -> ParsedRequest:
    """Translate a completions or chat completions body (already JSON-decoded) into the engine request.

    Raises ApiError(400) naming the OpenAI parameter. Range checks the engine makes itself (temperature, top_p,
    max_tokens against the context, token ids against the vocabulary) are left to it, so both APIs share them.
    """
    ignored = _check_fields(body, kind)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required: one of the ids GET /v1/models lists")
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    stream = _bool(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options", "must be an object with include_usage")
        include_usage = _bool(options, "include_usage")
        if _bool(options, "continuous_usage_stats"):
            # vLLM's extension (usage on every chunk): the engine reports usage with a request's last response only,
            # and the gateway cannot count prompt tokens. Refused rather than silently left out.
            raise invalid("stream_options.continuous_usage_stats", "is not supported by this server (usage comes in "
                          "the last chunk, with include_usage)", "unsupported_parameter")

    request = pb.GenerateRequest(request_id=new_request_id(kind))
    params: dict[str, str] = {}
    prompts: list[str | list[int]] = []
    echo = False
    if kind is Kind.COMPLETION:
        prompts = _prompts(body)
        if len(prompts) * n > MAX_GENERATIONS:
            raise invalid("n", f"n={n} for {len(prompts)} prompts is {len(prompts) * n} generations; at most "
                               f"{MAX_GENERATIONS} per request")
        _set_prompt(request, prompts[0])
        params["prompt_token_ids"] = "prompt"
        echo = _bool(body, "echo")
        if echo and any(not isinstance(p, str) for p in prompts):
            # The front end has no tokenizer (the gateway): the prompt's text is only known when it was sent as text.
            raise invalid("echo", "needs text prompts: a prompt of token ids cannot be echoed by this server",
                          "unsupported_parameter")
    else:
        _messages(body, request)
        params["prompt"] = params["prompt_token_ids"] = "messages"

    sampling = request.sampling_params
    max_tokens_name = "max_tokens"
    max_tokens = _int(body, "max_tokens", -INT32_MAX, INT32_MAX)
    if kind is Kind.CHAT and body.get("max_completion_tokens") is not None:
        if max_tokens is not None:
            raise invalid("max_completion_tokens", "set max_completion_tokens or max_tokens, not both")
        max_tokens_name = "max_completion_tokens"
        max_tokens = _int(body, "max_completion_tokens", -INT32_MAX, INT32_MAX)
    if max_tokens is None and kind is Kind.COMPLETION:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    params["sampling_params.max_tokens"] = max_tokens_name
    if (temperature := _number(body, "temperature")) is not None:
        sampling.temperature = temperature
    if (top_p := _number(body, "top_p")) is not None:
        sampling.top_p = top_p
    if (top_k := _int(body, "top_k", -INT32_MAX, INT32_MAX)) is not None:
        # vLLM's extension: -1 means disabled there, 0 here.
        sampling.top_k = 0 if top_k == -1 else top_k
    if (seed := _int(body, "seed", -INT64_MAX, INT64_MAX)) is not None:
        sampling.seed = seed
    sampling.stop.extend(_stop(body))
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        ids = _token_ids(stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        if ids is None:
            raise invalid("stop_token_ids", "must be a list of token ids")
        sampling.stop_token_ids.extend(ids)
    sampling.ignore_eos = _bool(body, "ignore_eos")
    for name in ("presence_penalty", "frequency_penalty"):
        if (penalty := _number(body, name)) is not None:
            setattr(sampling, name, penalty)  # the range ([-2, 2]) is checked by the engine, for both APIs
    top_logprobs = _logprobs(body, kind)
    if top_logprobs is not None:
        sampling.logprobs = top_logprobs
        params["sampling_params.logprobs"] = "logprobs" if kind is Kind.COMPLETION else "top_logprobs"
        if echo:
            raise invalid("echo", "with logprobs would return the prompt's log-probabilities, which this server does "
                                  "not compute", "unsupported_parameter")
    fanned = fan_out(request, prompts, n) if n > 1 or len(prompts) > 1 else ()
    echo_texts = tuple(p for p in prompts if isinstance(p, str)) if echo else ()
    return ParsedRequest(kind, model, request, stream, include_usage, params, _bool(body, "return_token_ids"),
                         tuple(ignored), n, fanned, echo_texts, top_logprobs is not None, echo_only)


def _logprobs(body: Mapping[str, Any], kind: Kind) -> int | None:
    """How many top tokens per position the request wants log-probabilities of (None: no log-probabilities).
    Completions: `logprobs` is that number; chat: `logprobs: true` and `top_logprobs` (OpenAI's forms)."""
    if kind is Kind.COMPLETION:
        return _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise invalid("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def fan_out(request: pb.GenerateRequest, prompts: list[str | list[int]], n: int) -> tuple[pb.GenerateRequest, ...]:
    """One engine request per choice, choice `prompt_index * n + i` for the i-th choice of each prompt. A chat's
    `prompts` is empty (its messages are in `request`). A seed gives choice i of each prompt seed + i, as vLLM's
    parallel sampling does, so the choices differ and a seeded request stays seeded."""
    seeded = request.sampling_params.HasField("seed")
    if seeded and request.sampling_params.seed + n - 1 > INT64_MAX:
        raise invalid("seed", f"seed + n - 1 must be at most {INT64_MAX} (choice i is sampled with seed + i)")
    requests = []
    for prompt_index, prompt in enumerate(prompts or [None]):
        for i in range(n):
            sub = pb.GenerateRequest()
            sub.CopyFrom(request)
            sub.request_id = f"{request.request_id}-{prompt_index * n + i}"
            if prompt is not None:
                sub.ClearField("prompt")
                sub.ClearField("prompt_token_ids")
                _set_prompt(sub, prompt)
            if seeded:
                sub.sampling_params.seed = request.sampling_params.seed + i
            requests.append(sub)
    return tuple(requests)


def new_request_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind is Kind.CHAT else 'cmpl'}-{uuid.uuid4().hex}"


# -- errors ------------------------------------------------------------------------------------------------------

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    # An engine-side cancel (the client's own never gets an answer): the service failed this request, retryable.
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}


def param_name(engine_field: str | None, params: Mapping[str, str]) -> str | None:
    """The OpenAI parameter behind an engine field name (`sampling_params.top_p` -> `top_p`)."""
    if not engine_field:
        return None
    if engine_field in params:
        return params[engine_field]
    if engine_field == "request_id":
        return None  # made up by this server, never the client's
    return engine_field.removeprefix("sampling_params.")


def error_from_status(code: grpc.StatusCode, message: str, engine_field: str | None = None,
                      params: Mapping[str, str] | None = None) -> ApiError:
    """A gRPC failure (engine or gateway) as the OpenAI error a client of the HTTP API gets."""
    status = _HTTP_STATUS.get(code, 500)
    param = param_name(engine_field, params or {}) if status == 400 else None
    if param is not None and engine_field and message.startswith(f"{engine_field}:"):
        message = f"{param}:{message[len(engine_field) + 1:]}"
    return ApiError(status, message, param, code=code.name.lower())


# -- responses ---------------------------------------------------------------------------------------------------

@dataclass
class ResponseState:
    """What accumulates over one request's engine responses."""

    parsed: ParsedRequest
    created: int = field(default_factory=lambda: int(time.time()))
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    role_sent: bool = False
    # This choice's index (fanned-out requests) and the prompt text still to echo before its first text.
    index: int = 0
    echo_text: str = ""
    # With logprobs: the entries of a non-streamed answer, and where the next token's text starts (completions'
    # text_offset, counted over the streamed chunks).
    logprob_entries: list[pb.TokenLogprob] = field(default_factory=list)
    text_offset: int = 0

    @property
    def id(self) -> str:
        return self.parsed.request.request_id

    def collect(self, response: pb.GenerateResponse) -> None:
        """Accumulate one engine response for a non-streamed answer."""
        self.absorb(response)
        if self.parsed.echo_only:
            return
        self.texts.append(response.text)
        self.token_ids.extend(response.token_ids)
        if self.parsed.logprobs:
            self.logprob_entries.extend(response.logprobs)

    def absorb(self, response: pb.GenerateResponse) -> None:
        if response.finish_reason:
            self.finish_reason = finish_reason(response.finish_reason)
            self.prompt_tokens = response.usage.prompt_tokens
            self.completion_tokens = response.usage.completion_tokens
            self.num_draft_tokens = response.speculation.num_draft_tokens
            self.num_accepted_tokens = response.speculation.num_accepted_tokens

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def speculation(self) -> dict[str, int]:
        # A top-level field OpenAI's SDKs keep as an extra attribute (`response.speculation`) and otherwise ignore.
        return {"num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens}


def finish_reason(engine_reason: str) -> str:
    # The engine's "abort" ends a request nobody waits for any more; OpenAI has no such reason.
    return engine_reason if engine_reason in ("stop", "length") else "stop"


def choice_states(parsed: ParsedRequest) -> list[ResponseState]:
    """One ResponseState per choice of a request (one, unless fanned out), each with its index and echo text."""
    created = int(time.time())
    echo = parsed.echo_texts
    return [ResponseState(parsed, created, index=index, echo_text=echo[index // parsed.n] if echo else "")
            for index in range(len(parsed.requests))]


def _logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # -inf (and NaN) as OpenAI's floor


def choice_logprobs(state: ResponseState, entries: Sequence[pb.TokenLogprob]) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a choice (or of one chunk) for these tokens: completions' legacy object (tokens,
    token_logprobs, top_logprobs as {token: logprob} with the chosen token first, as vLLM's server; text_offset),
    chat's `content` list (token, logprob, bytes, top_logprobs)."""
    if not state.parsed.logprobs:
        return None
    if state.parsed.kind is Kind.CHAT:
        return {"content": [{"token": e.token, "logprob": _logprob(e.logprob), "bytes": list(e.token.encode()),
                             "top_logprobs": [{"token": t.token, "logprob": _logprob(t.logprob),
                                               "bytes": list(t.token.encode())} for t in e.top_logprobs]}
                            for e in entries]}
    offsets, top = [], []
    for entry in entries:
        offsets.append(state.text_offset)
        state.text_offset += len(entry.token)
        tops = {entry.token: _logprob(entry.logprob)}
        for t in entry.top_logprobs:
            tops.setdefault(t.token, _logprob(t.logprob))
        top.append(tops)
    return {"text_offset": offsets, "token_logprobs": [_logprob(e.logprob) for e in entries],
            "tokens": [e.token for e in entries], "top_logprobs": top}


def _full_choice(state: ResponseState, text: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": state.index, "logprobs": choice_logprobs(state, state.logprob_entries),
                              "finish_reason": state.finish_reason}
    if state.parsed.return_token_ids:
        choice["token_ids"] = state.token_ids
    if state.parsed.kind is Kind.CHAT:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = state.echo_text + text
    return choice


def full_response(state: ResponseState, text: str) -> dict[str, Any]:
    parsed = state.parsed
    return {"id": state.id, "object": "chat.completion" if parsed.kind is Kind.CHAT else "text_completion",
            "created": state.created, "model": parsed.model, "choices": [_full_choice(state, text)],
            "usage": state.usage(), "speculation": state.speculation()}


def merged_usage(states: list[ResponseState]) -> dict[str, int]:
    """A fanned-out request's usage, as vLLM's server counts it: every choice's completion tokens, each prompt's
    tokens once (not once per choice)."""
    prompt_tokens = sum(s.prompt_tokens for s in states if s.index % s.parsed.n == 0)
    completion_tokens = sum(s.completion_tokens for s in states)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def merged_speculation(states: list[ResponseState]) -> dict[str, int]:
    return {"num_draft_tokens": sum(s.num_draft_tokens for s in states),
            "num_accepted_tokens": sum(s.num_accepted_tokens for s in states)}


def merged_full_response(states: list[ResponseState]) -> dict[str, Any]:
    """The non-streamed answer of a fanned-out request: every choice in index order, usage summed."""
    first = states[0]
    parsed = first.parsed
    return {"id": first.id, "object": "chat.completion" if parsed.kind is Kind.CHAT else "text_completion",
            "created": first.created, "model": parsed.model,
            "choices": [_full_choice(s, "".join(s.texts)) for s in sorted(states, key=lambda s: s.index)],
            "usage": merged_usage(states), "speculation": merged_speculation(states)}


def _chunk(state: ResponseState, choices: list[dict[str, Any]]) -> dict[str, Any]:
    parsed = state.parsed
    chunk: dict[str, Any] = {"id": state.id,
                             "object": "chat.completion.chunk" if parsed.kind is Kind.CHAT else "text_completion",
                             "created": state.created, "model": parsed.model, "choices": choices}
    if parsed.include_usage:
        chunk["usage"] = None  # OpenAI's chunks carry usage: null until the final usage chunk
    return chunk


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def stream_events(state: ResponseState, response: pb.GenerateResponse) -> list[bytes]:
    """The SSE events one engine response becomes (OpenAI's sequence: a chat's first chunk carries the role; text
    chunks; a final chunk with an empty delta and the finish reason, plus `speculation`; with include_usage a last
    chunk with `choices: []` and the usage)."""
    events = choice_events(state, response)
    if response.finish_reason:
        if state.parsed.include_usage:
            events.append(usage_event(state, state.usage(), state.speculation()))
        events.append(SSE_DONE)
    return events


def usage_event(state: ResponseState, usage: dict[str, int], speculation: dict[str, int]) -> bytes:
    usage_chunk = _chunk(state, [])
    usage_chunk["usage"] = usage
    usage_chunk["speculation"] = speculation
    return sse(usage_chunk)


def choice_events(state: ResponseState, response: pb.GenerateResponse) -> list[bytes]:
    """One choice's chunks for one engine response (no usage chunk, no [DONE]: a fanned-out request sends those
    once, after every choice has finished)."""
    state.absorb(response)
    if state.parsed.echo_only:
        response = _without_output(response)
    chat = state.parsed.kind is Kind.CHAT
    index = state.index
    events: list[bytes] = []
    if chat and not state.role_sent:
        state.role_sent = True
        events.append(sse(_chunk(state, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])))
    text = response.text
    if state.echo_text:
        # completions' echo: the prompt goes out with the choice's first response (as vLLM's server sends it).
        text = state.echo_text + text
        state.echo_text = ""
    # A token whose text is not complete yet (part of a character) has no text of its own; its id (and log-
    # probability) still goes out.
    parsed = state.parsed
    if text or ((parsed.return_token_ids or parsed.logprobs) and response.token_ids):
        logprobs = choice_logprobs(state, response.logprobs) if parsed.logprobs else None
        choice: dict[str, Any] = ({"index": index, "delta": {"content": text}, "logprobs": logprobs,
                                   "finish_reason": None} if chat
                                  else {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None})
        if state.parsed.return_token_ids:
            choice["token_ids"] = list(response.token_ids)
        events.append(sse(_chunk(state, [choice])))
    if response.finish_reason:
        final: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": state.finish_reason}
        if chat:
            final["delta"] = {}
        else:
            final["text"] = ""
        chunk = _chunk(state, [final])
        chunk["speculation"] = state.speculation()
        events.append(sse(chunk))
    return events


def _without_output(response: pb.GenerateResponse) -> pb.GenerateResponse:
    """An engine response with its generated tokens left out (echo with max_tokens 0)."""
    bare = pb.GenerateResponse(request_id=response.request_id, finish_reason=response.finish_reason)
    if response.finish_reason:
        bare.usage.CopyFrom(response.usage)
        bare.speculation.CopyFrom(response.speculation)
    return bare


def models_list(model_ids: list[str], created: int, owned_by: str = "minedraft") -> dict[str, Any]:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": owned_by}
                                       for m in model_ids]}


def encode(payload: dict[str, Any]) -> bytes:
    return _encoder.encode(payload)
