"""The OpenAI <-> minedraft.v1 translations (pure): request fields, parameter names in errors, SSE event sequences."""

from __future__ import annotations

import json
import sys

import grpc
import pytest

from minedraft.api import pb
from minedraft.openai_api.protocol import (
    MAX_CHOICES,
    MAX_GENERATIONS,
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
    MAX_STOP_TOKEN_IDS,
    SSE_DONE,
    ApiError,
    Kind,
    ResponseState,
    choice_events,
    choice_states,
    decode_body,
    error_from_status,
    full_response,
    json_depth,
    merged_full_response,
    merged_usage,
    parse_request,
    stream_events,
)


def parse(kind: Kind = Kind.COMPLETION, **body):
    base = {"model": "m", "prompt": "hi"} if kind is Kind.COMPLETION else {
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return parse_request({**base, **body}, kind)


def param_of(kind: Kind = Kind.COMPLETION, **body) -> str | None:
    with pytest.raises(ApiError) as info:
        parse(kind, **body)
    assert info.value.status == 400
    return info.value.param


def test_completion_fields_become_the_engine_request():
    parsed = parse(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["\n", "x"], top_k=-1, ignore_eos=True,
                   stop_token_ids=[5], user="u", presence_penalty=0, logprobs=None, echo=False, n=1)
    request = parsed.request
    assert request.prompt == "hi" and request.request_id.startswith("cmpl-")
    params = request.sampling_params
    assert (params.max_tokens, params.seed, list(params.stop), params.top_k) == (7, 3, ["\n", "x"], 0)
    assert params.temperature == pytest.approx(0.5) and params.top_p == pytest.approx(0.9)
    assert params.ignore_eos and list(params.stop_token_ids) == [5]
    assert not parsed.stream and not parsed.include_usage


def test_defaults_follow_openai():
    # Completions default to 16 tokens (OpenAI's default); chat to the rest of the context (left unset).
    assert parse().request.sampling_params.max_tokens == 16
    assert not parse(Kind.CHAT).request.sampling_params.HasField("max_tokens")
    assert not parse().request.sampling_params.HasField("temperature")


def test_prompt_forms():
    assert list(parse(prompt=[1, 2, 3]).request.prompt_token_ids) == [1, 2, 3]
    assert parse(prompt=["one"]).request.prompt == "one"
    assert list(parse(prompt=[[4, 5]]).request.prompt_token_ids) == [4, 5]
    assert param_of(prompt=[1, True]) == "prompt"
    assert param_of(prompt=["a", [1, True]]) == "prompt"
    assert param_of(prompt=["a", 5]) == "prompt"
    assert param_of(prompt=None) == "prompt"


def test_chat_messages_and_max_completion_tokens():
    parsed = parse(Kind.CHAT, messages=[{"role": "system", "content": "s"},
                                        {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}],
                   max_completion_tokens=9, stream=True, stream_options={"include_usage": True})
    assert [(m.role, m.content) for m in parsed.request.messages] == [("system", "s"), ("user", "ab")]
    assert parsed.request.request_id.startswith("chatcmpl-")
    assert parsed.request.sampling_params.max_tokens == 9 and parsed.include_usage
    assert parsed.params["sampling_params.max_tokens"] == "max_completion_tokens"


@pytest.mark.parametrize(("kind", "body", "param"), [
    (Kind.COMPLETION, {"n": MAX_CHOICES + 1}, "n"),
    (Kind.COMPLETION, {"n": 0}, "n"),
    (Kind.COMPLETION, {"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"),
    (Kind.COMPLETION, {"prompt": ["a"] * 8, "n": MAX_GENERATIONS // 8 + 1}, "n"),
    (Kind.COMPLETION, {"seed": 2**63 - 2, "n": 3}, "seed"),
    (Kind.COMPLETION, {"echo": True, "prompt": [1, 2]}, "echo"),
    (Kind.COMPLETION, {"echo": True, "prompt": ["a", [1, 2]]}, "echo"),
    (Kind.CHAT, {"echo": True}, "echo"),
    (Kind.COMPLETION, {"logprobs": 21}, "logprobs"),
    (Kind.COMPLETION, {"logprobs": True}, "logprobs"),
    (Kind.CHAT, {"logprobs": 1}, "logprobs"),
    (Kind.CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (Kind.COMPLETION, {"echo": True, "logprobs": 1}, "echo"),  # prompt log-probabilities: not computed
    (Kind.COMPLETION, {"best_of": 2}, "best_of"),
    (Kind.COMPLETION, {"frequency_penalty": "1"}, "frequency_penalty"),
    (Kind.COMPLETION, {"logit_bias": {"5": 1}}, "logit_bias"),
    (Kind.COMPLETION, {"suffix": "x"}, "suffix"),
    (Kind.CHAT, {"tools": [{"type": "function"}]}, "tools"),
    (Kind.CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (Kind.CHAT, {"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools"),
    (Kind.CHAT, {"tool_choice": "required"}, "tool_choice"),
    (Kind.CHAT, {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    (Kind.COMPLETION, {"presence_penalty": True}, "presence_penalty"),
    (Kind.COMPLETION, {"max_tokens": 1.5}, "max_tokens"),
    (Kind.COMPLETION, {"max_tokens": True}, "max_tokens"),
    (Kind.COMPLETION, {"max_tokens": 2**40}, "max_tokens"),
    (Kind.COMPLETION, {"seed": 2**70}, "seed"),
    (Kind.COMPLETION, {"temperature": "hot"}, "temperature"),
    (Kind.COMPLETION, {"stop": ["a"] * 5}, "stop"),
    (Kind.COMPLETION, {"stop": [""]}, "stop"),
    (Kind.COMPLETION, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (Kind.COMPLETION, {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    (Kind.COMPLETION, {"prompt": [1] * (MAX_PROMPT_TOKEN_IDS + 1)}, "prompt"),
    (Kind.CHAT, {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages"),
    (Kind.COMPLETION, {"stream": 1}, "stream"),
    (Kind.COMPLETION, {"stream_options": {"include_usage": True}}, "stream_options"),
    (Kind.COMPLETION, {"stream": True, "stream_options": {"bogus": 1}}, "stream_options"),
    # vLLM's own extensions that change the output: a client moving from vLLM is told, not silently ignored.
    (Kind.COMPLETION, {"min_tokens": 5}, "min_tokens"),
    (Kind.CHAT, {"repetition_penalty": 1.2}, "repetition_penalty"),
    (Kind.COMPLETION, {"min_p": 0.1}, "min_p"),
    (Kind.COMPLETION, {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    (Kind.CHAT, {"skip_special_tokens": False}, "skip_special_tokens"),
    (Kind.COMPLETION, {"bad_words": ["x"]}, "bad_words"),
    (Kind.COMPLETION, {"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    (Kind.COMPLETION, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (Kind.COMPLETION, {"use_beam_search": True}, "use_beam_search"),
    (Kind.CHAT, {"add_generation_prompt": False}, "add_generation_prompt"),
    (Kind.CHAT, {"continue_final_message": True}, "continue_final_message"),
    (Kind.CHAT, {"chat_template": "{{ messages }}"}, "chat_template"),
    # vLLM's legacy structured output and its special-token switch: refused unless they ask for nothing.
    (Kind.COMPLETION, {"guided_json": {"type": "object"}}, "guided_json"),
    (Kind.CHAT, {"guided_choice": ["a", "b"]}, "guided_choice"),
    (Kind.COMPLETION, {"guided_regex": "[a-z]+"}, "guided_regex"),
    (Kind.COMPLETION, {"add_special_tokens": False}, "add_special_tokens"),
    (Kind.CHAT, {"add_special_tokens": True}, "add_special_tokens"),
    (Kind.CHAT, {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    (Kind.COMPLETION, {"model": ""}, "model"),
    (Kind.CHAT, {"messages": "hi"}, "messages"),
    (Kind.CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (Kind.CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (Kind.CHAT, {"max_tokens": 3, "max_completion_tokens": 3}, "max_completion_tokens"),
])
def test_unsupported_or_malformed_fields_name_the_param(kind, body, param):
    assert param_of(kind, **body) == param


def test_neutral_values_of_unsupported_fields_are_accepted():
    parse(presence_penalty=0.0, frequency_penalty=0, logit_bias={}, best_of=1, echo=False, suffix=None)
    parse(Kind.CHAT, tools=[], tool_choice=None, logprobs=False, metadata={"a": "b"}, store=False)
    parse(Kind.CHAT, tool_choice="none", response_format={"type": "text"}, top_logprobs=0)
    parse(min_tokens=0, repetition_penalty=1, min_p=0, skip_special_tokens=True, bad_words=[], use_beam_search=False,
          include_stop_str_in_output=False, length_penalty=1.0, prompt_logprobs=None)
    parse(Kind.CHAT, add_generation_prompt=True, continue_final_message=False, chat_template_kwargs={},
          chat_template=None, add_special_tokens=False, guided_json=None)
    parse(add_special_tokens=True, guided_choice=None, guided_regex=None)
    # vLLM's fields that change neither the output nor its shape stay unknown (ignored, logged); so do vLLM's chat-only
    # fields on completions (vLLM does not know them there either).
    assert parse(priority=1, cache_salt="s", add_generation_prompt=False).ignored_fields == (
        "priority", "cache_salt", "add_generation_prompt")
    parse(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False})


def test_integers_written_as_floats_are_integers():
    # As vLLM's validation (pydantic) takes them: 2.0 is 2; 1.5 stays a 400 naming the field.
    parsed = parse(n=2.0, max_tokens=3.0, seed=7.0, logprobs=1.0)
    floats = parsed.request.sampling_params
    assert parsed.n == 2 and (floats.max_tokens, floats.seed, floats.logprobs) == (3, 7, 1)
    assert param_of(n=1.5) == "n" and param_of(max_tokens=float("inf")) == "max_tokens"


def test_unknown_fields_are_ignored_and_reported():
    # As vLLM's server: unknown fields do not fail the request; the front end logs their names.
    parsed = parse(bogus=1, messages=[])
    assert parsed.ignored_fields == ("bogus", "messages")
    assert parsed.request.prompt == "hi"


def test_deeply_nested_json_is_a_400_whatever_the_recursion_limit():
    # The bound is the decoder's own, not the interpreter's recursion limit (process-global state that torch's
    # compiler raises to 2,000 in the same process): with the limit far above any depth, the body is still refused.
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(100000)
    try:
        for depth in (MAX_JSON_DEPTH + 1, 1000):
            with pytest.raises(ApiError) as info:
                decode_body(b'{"a": ' + b"[" * depth + b"]" * depth + b"}")
            assert info.value.status == 400 and "nested" in info.value.message
    finally:
        sys.setrecursionlimit(previous)
    # At the limit it decodes; brackets inside strings (escaped quotes and backslashes too) are text, not nesting.
    nested = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)
    assert decode_body(b'{"a": ' + nested + b"}")["a"]
    text = '[{' * 100 + '\\" \\\\'
    assert decode_body(json.dumps({"s": text, "t": [[1]]}).encode())["s"] == text


def test_json_depth_counts_nesting_outside_strings():
    assert json_depth(b'{"a": [1, {"b": [2]}]}') == 4
    # A string ending in an escaped backslash: its closing quote closes it, and the nesting after it counts.
    deep = b'{"s": "' + b"[" * 200 + b'\\\\", "t": ' + b"[" * 70 + b"]" * 70 + b"}"
    assert json_depth(deep) == 71
    # An escaped quote does not close the string: the brackets after it are still text.
    assert json_depth(b'"' + b"[" * 200 + b'\\"' + b"[" * 70 + b'"') == 0


def test_body_must_be_a_json_object():
    for raw in (b"{", b"[1]", b"NaN"):
        with pytest.raises(ApiError) as info:
            decode_body(raw)
        assert info.value.status == 400 and info.value.param is None


def test_engine_errors_map_to_openai_statuses_and_params():
    params = parse(Kind.CHAT, max_completion_tokens=0).params
    error = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.max_tokens: must be positive",
                              "sampling_params.max_tokens", params)
    assert (error.status, error.param, error.message) == (400, "max_completion_tokens",
                                                           "max_completion_tokens: must be positive")
    assert error.body()["error"]["type"] == "invalid_request_error"
    chat_prompt = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "prompt: too long", "prompt", params)
    assert chat_prompt.param == "messages"
    completion = parse().params
    assert error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", "prompt_token_ids", completion).param == "prompt"
    assert error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", "sampling_params.top_p", completion).param == \
        "top_p"
    assert error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", "request_id", completion).param is None
    statuses = {grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
                grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNKNOWN: 500}
    for code, status in statuses.items():
        error = error_from_status(code, "m", "prompt", completion)
        assert error.status == status and error.param is None


def responses(texts: list[str]) -> list[pb.GenerateResponse]:
    out = [pb.GenerateResponse(request_id="r", token_ids=[i], text=t) for i, t in enumerate(texts)]
    last = out[-1]
    last.finish_reason = "length"
    last.usage.prompt_tokens = 4
    last.usage.completion_tokens = len(texts)
    last.speculation.num_draft_tokens = 6
    last.speculation.num_accepted_tokens = 2
    return out


def events_of(parsed, texts) -> list[dict | str]:
    state = ResponseState(parsed)
    raw = b"".join(b"".join(stream_events(state, r)) for r in responses(texts))
    assert raw.endswith(SSE_DONE)
    out: list[dict | str] = []
    for event in raw.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: ")
        data = event[len(b"data: "):]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def test_chat_stream_sequence_with_usage():
    events = events_of(parse(Kind.CHAT, stream=True, stream_options={"include_usage": True}), ["a", "b"])
    assert [e if e == "[DONE]" else e["choices"] for e in events] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}],
        [],
        "[DONE]",
    ]
    chunks = [e for e in events if e != "[DONE]"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["usage"] for c in chunks[:-1]] == [None] * 4
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert chunks[-2]["speculation"] == chunks[-1]["speculation"] == {"num_draft_tokens": 6,
                                                                      "num_accepted_tokens": 2}


def test_completion_stream_without_usage_has_no_usage_key():
    events = events_of(parse(stream=True), ["x", ""])
    chunks = [e for e in events if e != "[DONE]"]
    assert [c["choices"][0]["text"] for c in chunks] == ["x", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


def test_full_response():
    state = ResponseState(parse(Kind.CHAT))
    for response in responses(["a", "b"]):
        state.absorb(response)
    body = full_response(state, "ab")
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                       "content": "ab"}
    assert body["usage"]["total_tokens"] == 6 and body["speculation"]["num_accepted_tokens"] == 2


def test_return_token_ids_extension():
    parsed = parse(stream=True, return_token_ids=True)
    events = [e for e in events_of(parsed, ["x", "", "y"]) if e != "[DONE]"]
    # The token with no text of its own still carries its id.
    assert [c["choices"][0].get("token_ids") for c in events] == [[0], [1], [2], None]
    state = ResponseState(parse(return_token_ids=True))
    state.token_ids.extend([4, 5])
    assert full_response(state, "ab")["choices"][0]["token_ids"] == [4, 5]
    assert "token_ids" not in full_response(ResponseState(parse()), "ab")["choices"][0]


def test_seeds_are_promised_as_reproducible_within_one_deployment():
    # The promise the engine keeps (tests/component/test_engine.py, test_http_server.py check it): identical seeded
    # requests give identical outputs under speculation; the API reference and the proto say so, and say its limit.
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    docs = (root / "docs" / "api.md").read_text()
    proto = (root / "proto" / "minedraft" / "v1" / "generation.proto").read_text()
    assert "**reproducible under speculation**" in docs
    assert "The guarantee holds for one\ndeployment" in docs
    assert "identical seeded requests give identical outputs in psd, sd, auto and ar" in proto
    assert "not reproducible" not in docs + proto


# -- fan-out (n > 1, a batch of prompts) and echo ---------------------------------------------------------------------

def test_n_and_a_batch_fan_out_in_openai_choice_order_with_vllm_seeds():
    parsed = parse(prompt=["a", [7, 8]], n=3, seed=10, max_tokens=5)
    subs = parsed.requests
    assert len(subs) == 6 and parsed.n == 3
    # Choice index = prompt_index * n + i (as OpenAI and vLLM number them).
    assert [s.prompt for s in subs[:3]] == ["a"] * 3 and all(not s.prompt_token_ids for s in subs[:3])
    assert all(list(s.prompt_token_ids) == [7, 8] and not s.prompt for s in subs[3:])
    # vLLM's parallel sampling: choice i of every prompt gets seed + i.
    assert [s.sampling_params.seed for s in subs] == [10, 11, 12, 10, 11, 12]
    assert all(s.sampling_params.max_tokens == 5 for s in subs)
    # Unique engine request ids under the response's own id.
    assert [s.request_id for s in subs] == [f"{parsed.request.request_id}-{i}" for i in range(6)]
    # Without a seed the choices stay unseeded; a single choice is not fanned out.
    assert not any(s.sampling_params.HasField("seed") for s in parse(n=2).requests)
    assert parse().fanned == () and parse(prompt=["one"]).fanned == ()
    chat = parse(Kind.CHAT, n=2)
    assert [len(s.messages) for s in chat.requests] == [1, 1]


def test_merged_full_response_orders_choices_and_sums_usage():
    parsed = parse(prompt=["p", "q"], n=2)
    states = choice_states(parsed)
    assert [s.index for s in states] == [0, 1, 2, 3] and len({s.created for s in states}) == 1
    for state in reversed(states):  # finished in any order
        for response in responses(["t", str(state.index)]):
            state.absorb(response)
            state.texts.append(response.text)
    body = merged_full_response(states)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t3")]
    # As vLLM counts: each prompt's tokens once, every choice's completion tokens.
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}
    assert body["speculation"] == {"num_draft_tokens": 24, "num_accepted_tokens": 8}
    assert merged_usage(states[:1]) == states[0].usage()


def test_fanned_out_chunks_carry_their_choice_index():
    parsed = parse(Kind.CHAT, n=2, stream=True)
    states = choice_states(parsed)
    first = json.loads(b"".join(choice_events(states[1], responses(["x"])[0]))[len(b"data: "):].split(b"\n\n")[0])
    assert first["choices"][0]["index"] == 1 and first["choices"][0]["delta"]["role"] == "assistant"
    # A choice's own events never carry [DONE] or usage: the merge sends them once.
    assert SSE_DONE not in b"".join(choice_events(states[0], responses(["y"])[-1]))


def test_echo_puts_the_prompt_before_the_completion_streamed_and_not():
    parsed = parse(prompt="Hello", echo=True, stream=True)
    texts = [e["choices"][0]["text"] for e in events_of_states(choice_states(parsed)[0], ["", " world", "!"])]
    assert texts == ["Hello", " world", "!", ""]  # vLLM: the prompt with the first response
    state = choice_states(parse(prompt="Hello", echo=True))[0]
    assert full_response(state, " world")["choices"][0]["text"] == "Hello world"
    batch = choice_states(parse(prompt=["A", "B"], n=2, echo=True))
    assert [s.echo_text for s in batch] == ["A", "A", "B", "B"]
    assert full_response(choice_states(parse(prompt="Hello"))[0], "x")["choices"][0]["text"] == "x"


def test_echo_with_max_tokens_0_answers_the_prompt_alone_streamed_and_not():
    # As vLLM's server (and OpenAI's legacy API): the engine generates one token, the answer leaves it out.
    parsed = parse(prompt="Hello", echo=True, max_tokens=0, return_token_ids=True, n=2)
    assert all(r.sampling_params.max_tokens == 1 for r in parsed.requests)
    states = choice_states(parsed)
    for state in states:
        for response in responses([" world"]):
            state.collect(response)
    body = merged_full_response(states)
    assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in body["choices"]] == [("Hello", [], "length")] * 2
    streamed = parse(prompt="Hello", echo=True, max_tokens=0, stream=True, return_token_ids=True)
    chunks = events_of_states(choice_states(streamed)[0], [" world"])
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", ""]
    assert all(c["choices"][0].get("token_ids", []) == [] for c in chunks)
    # Without echo, max_tokens 0 is left to the engine to refuse (as vLLM's server refuses it).
    assert parse(max_tokens=0).request.sampling_params.max_tokens == 0


def events_of_states(state, texts) -> list[dict]:
    raw = b"".join(b"".join(stream_events(state, r)) for r in responses(texts))
    return [json.loads(e[len(b"data: "):]) for e in raw.split(b"\n\n")[:-1] if e != SSE_DONE.strip()]



# -- penalties and log-probabilities ---------------------------------------------------------------------------------

def test_penalties_and_logprobs_become_sampling_fields():
    sampling = parse(presence_penalty=0.5, frequency_penalty=-1, logprobs=3).request.sampling_params
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.logprobs) == (0.5, -1.0, 3)
    assert not parse().request.sampling_params.HasField("logprobs") and not parse().logprobs
    chat = parse(Kind.CHAT, logprobs=True, top_logprobs=2)
    assert chat.logprobs and chat.request.sampling_params.logprobs == 2
    assert parse(Kind.CHAT, logprobs=True).request.sampling_params.logprobs == 0
    assert not parse(Kind.CHAT, logprobs=False, top_logprobs=0).logprobs
    # An engine error about the field names the client's parameter.
    assert error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", "sampling_params.logprobs",
                             chat.params).param == "top_logprobs"
    assert error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", "sampling_params.presence_penalty",
                             chat.params).param == "presence_penalty"


def logprob_responses() -> list[pb.GenerateResponse]:
    first = pb.GenerateResponse(token_ids=[1, 2], text="ab", logprobs=[
        pb.TokenLogprob(logprob=-0.5, token="a", top_logprobs=[pb.TopLogprob(token_id=1, token="a", logprob=-0.5),
                                                                pb.TopLogprob(token_id=3, token="c", logprob=-1.5)]),
        pb.TokenLogprob(logprob=float("-inf"), token="b", top_logprobs=[
            pb.TopLogprob(token_id=4, token="é", logprob=-0.25)])])
    last = pb.GenerateResponse(token_ids=[5], text="dd", finish_reason="length",
                               logprobs=[pb.TokenLogprob(logprob=-1.0, token="dd")])
    return [first, last]


def test_completion_logprobs_streamed_and_not():
    state = choice_states(parse(logprobs=2))[0]
    for response in logprob_responses():
        state.collect(response)
    logprobs = full_response(state, "abdd")["choices"][0]["logprobs"]
    assert logprobs == {"text_offset": [0, 1, 2], "token_logprobs": [-0.5, -9999.0, -1.0], "tokens": ["a", "b", "dd"],
                        "top_logprobs": [{"a": -0.5, "c": -1.5}, {"b": -9999.0, "é": -0.25}, {"dd": -1.0}]}
    streamed = choice_states(parse(logprobs=2, stream=True))[0]
    chunks = [json.loads(e[len(b"data: "):]) for r in logprob_responses() for e in stream_events(streamed, r)
              if e != SSE_DONE]
    per_chunk = [c["choices"][0]["logprobs"] for c in chunks]
    assert per_chunk[0]["tokens"] == ["a", "b"] and per_chunk[1]["text_offset"] == [2]  # offsets run on
    assert per_chunk[-1] is None  # the final chunk (finish reason only)


def test_chat_logprobs_streamed_and_not():
    state = choice_states(parse(Kind.CHAT, logprobs=True, top_logprobs=1))[0]
    for response in logprob_responses():
        state.collect(response)
    content = full_response(state, "abdd")["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "c", "logprob": -1.5, "bytes": [99]}]}
    assert content[1]["top_logprobs"][0]["bytes"] == [195, 169] and content[1]["logprob"] == -9999.0
    streamed = choice_states(parse(Kind.CHAT, logprobs=True, stream=True))[0]
    events = [json.loads(e[len(b"data: "):]) for r in logprob_responses() for e in stream_events(streamed, r)
              if e != SSE_DONE]
    assert [len(e["choices"][0]["logprobs"]["content"]) for e in events[1:3]] == [2, 1]
    # Without logprobs asked for: null, as before.
    plain = choice_states(parse(Kind.CHAT))[0]
    plain.collect(logprob_responses()[1])
    assert full_response(plain, "dd")["choices"][0]["logprobs"] is None
