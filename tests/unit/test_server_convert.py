"""Proto <-> engine conversions and the request checks done before the engine is touched (pure)."""

import math

import pytest

from minedraft.api import pb
from minedraft.engine.requests import OutputDelta, RequestError, SamplingSettings, TokenLogprob
from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode
from minedraft.server.convert import ModelLimits, model_info, prepare_request, response_from_delta

LIMITS = ModelLimits(vocab_size=100, max_model_len=32)


def tokenize(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def field_of(request: pb.GenerateRequest) -> str:
    with pytest.raises(RequestError) as info:
        prepare_request(request, LIMITS, tokenize)
    return info.value.field_name


def test_text_prompt_with_defaults():
    prepared = prepare_request(pb.GenerateRequest(prompt="abc", request_id="r1"), LIMITS, tokenize)
    assert prepared.prompt_token_ids == [97, 98, 99 % 100]
    assert prepared.request_id == "r1"
    s = prepared.sampling
    # Unset max_tokens: the rest of the context; greedy; no top-p/top-k truncation.
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (29, 0.0, 1.0, 0, None)


def test_token_prompt_and_every_sampling_field_carried():
    params = pb.SamplingParams(max_tokens=5, temperature=0.5, top_p=0.25, top_k=7, seed=3, stop=["\n"],
                               stop_token_ids=[9], ignore_eos=True)
    prepared = prepare_request(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=params), LIMITS,
                               tokenize)
    assert prepared.prompt_token_ids == [1, 2, 3] and prepared.request_id is None
    s = prepared.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (5, 0.5, 0.25, 7, 3)
    assert s.stop == ("\n",) and s.stop_token_ids == (9,) and s.ignore_eos
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs) == (0.0, 0.0, None)
    params = pb.SamplingParams(presence_penalty=-1.5, frequency_penalty=2, logprobs=0)
    s = prepare_request(pb.GenerateRequest(prompt="a", sampling_params=params), LIMITS, tokenize).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs) == (-1.5, 2.0, 0)


@pytest.mark.parametrize(("request_", "field"), [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(prompt="ab", prompt_token_ids=[1]), "prompt"),
    (pb.GenerateRequest(prompt_token_ids=[1, 100]), "prompt_token_ids"),
    (pb.GenerateRequest(prompt_token_ids=[1] * 32), "prompt_token_ids"),
    (pb.GenerateRequest(prompt="x" * 32), "prompt"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(max_tokens=0)), "sampling_params.max_tokens"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(max_tokens=-3)), "sampling_params.max_tokens"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(max_tokens=32)), "sampling_params.max_tokens"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(temperature=-0.1)),
     "sampling_params.temperature"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(temperature=math.nan)),
     "sampling_params.temperature"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(temperature=2.5)),
     "sampling_params.temperature"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(temperature=math.inf)),
     "sampling_params.temperature"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(top_p=0.0)), "sampling_params.top_p"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(top_p=1.5)), "sampling_params.top_p"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(top_k=-1)), "sampling_params.top_k"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(seed=-1)), "sampling_params.seed"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(stop_token_ids=[100])),
     "sampling_params.stop_token_ids"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(stop=[""])), "sampling_params.stop"),
    (pb.GenerateRequest(prompt="a", request_id="x" * 300), "request_id"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(presence_penalty=2.5)),
     "sampling_params.presence_penalty"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(frequency_penalty=math.nan)),
     "sampling_params.frequency_penalty"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(logprobs=21)), "sampling_params.logprobs"),
    (pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(logprobs=-1)), "sampling_params.logprobs"),
])
def test_each_invalid_field_is_named(request_, field):
    assert field_of(request_) == field


@pytest.mark.parametrize(("name", "values"), [
    ("temperature", [-1.0, 0.0, 1.0, 2.0, 2.5, 100.0, math.inf, math.nan]),
    ("top_p", [-0.5, 0.0, 1e-6, 1.0, 1.5, math.nan]),
    ("top_k", [-2, -1, 0, 1, 99, 100, 10**6]),
    ("presence_penalty", [-3.0, -2.0, 0.0, 2.0, 2.5, math.nan]),
    ("frequency_penalty", [-3.0, -2.0, 0.0, 2.0, 2.5, math.inf]),
    ("logprobs", [-2, -1, 0, 20, 21]),
    ("seed", [-1, 0, 2**63 - 1]),
    ("max_tokens", [-1, 0, 1, 31]),
])
def test_every_value_accepted_here_is_accepted_by_vllm(name, values):
    # vLLM's own SamplingParams checks run at request creation, in the engine: a value they refuse that passed here
    # was an unhandled ValueError there, a 500 the SDKs retry (temperature 2.5 was one). Each value is refused here
    # (naming the field) or accepted by vLLM too.
    from minedraft.engine.core import vllm_sampling_params

    for value in values:
        request = pb.GenerateRequest(prompt="a", sampling_params=pb.SamplingParams(**{name: value}))
        try:
            sampling = prepare_request(request, LIMITS, tokenize).sampling
        except RequestError as error:
            assert error.field_name == f"sampling_params.{name}"
            continue
        vllm_sampling_params(sampling, sampling.max_tokens)


def test_a_value_vllm_refuses_at_request_creation_is_a_request_error_naming_it():
    # Defence in depth behind the checks above: should vLLM refuse a value they let through (a check added in a later
    # vLLM), the engine answers INVALID_ARGUMENT naming the field, not an unhandled error (a 500).
    from minedraft.engine.core import vllm_sampling_params

    with pytest.raises(RequestError) as info:
        vllm_sampling_params(SamplingSettings(max_tokens=1, temperature=3.0), 1)  # not validated: straight to vLLM
    assert info.value.field_name == "sampling_params.temperature" and "temperature" in str(info.value)


def test_max_tokens_fitting_exactly_is_accepted():
    # 3 prompt tokens + 29 generated = the whole 32-token context.
    request = pb.GenerateRequest(prompt="abc", sampling_params=pb.SamplingParams(max_tokens=29))
    assert prepare_request(request, LIMITS, tokenize).sampling.max_tokens == 29


def test_tokenizer_yielding_nothing_is_an_empty_prompt():
    with pytest.raises(RequestError) as info:
        prepare_request(pb.GenerateRequest(prompt=" "), LIMITS, lambda text: [])
    assert info.value.field_name == "prompt"


def test_response_from_deltas():
    middle = response_from_delta(OutputDelta("r", [1, 2], "ab"))
    assert list(middle.token_ids) == [1, 2] and middle.text == "ab" and middle.finish_reason == ""
    assert not middle.HasField("usage") and not middle.HasField("speculation")
    final = response_from_delta(OutputDelta("r", [3], "c", finish_reason="length", num_prompt_tokens=4,
                                            num_output_tokens=3, num_draft_tokens=6, num_accepted_tokens=2))
    assert final.finish_reason == "length" and final.request_id == "r"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (4, 3)
    assert (final.speculation.num_draft_tokens, final.speculation.num_accepted_tokens) == (6, 2)


def test_model_info_reports_speculation_only_when_drafting():
    settings = EngineSettings(model="t", drafter=DrafterSettings(model="d"), mode=Mode.PSD, num_speculative_tokens=4,
                              max_model_len=512)
    info = model_info(settings, 2048)
    assert (info.model, info.draft_model, info.mode, info.num_speculative_tokens) == ("t", "d", "psd", 4)
    assert (info.max_model_len, info.vocab_size) == (512, 2048)
    ar = model_info(settings.with_changes(mode=Mode.AR), 2048)
    assert (ar.draft_model, ar.num_speculative_tokens, ar.mode) == ("", 0, "ar")


def test_model_info_does_not_show_where_the_draft_lies_on_the_machine(tmp_path):
    draft = tmp_path / "models" / "pair-v1" / "draft"
    draft.mkdir(parents=True)
    for path, shown in ((str(draft), "pair-v1/draft"), ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B")):
        settings = EngineSettings(model="t", drafter=DrafterSettings(model=path), mode=Mode.PSD)
        assert model_info(settings, 2048).draft_model == shown


# -- bounds on per-request work (checked before tokenizing or touching the engine) ---------------------------------


def test_prompt_bytes_are_bounded_before_tokenizing():
    from minedraft.server.convert import max_token_bytes

    limits = ModelLimits(vocab_size=100, max_model_len=32, max_token_bytes=4)
    calls: list[int] = []

    def counting_tokenize(text: str) -> list[int]:
        calls.append(len(text))
        return tokenize(text)

    with pytest.raises(RequestError) as info:
        prepare_request(pb.GenerateRequest(prompt="x" * (32 * 4 + 1)), limits, counting_tokenize)
    assert info.value.field_name == "prompt" and "129 bytes" in str(info.value)
    assert calls == [], "an over-long prompt is refused without being tokenized"
    # Multi-byte characters are counted in bytes, not characters.
    with pytest.raises(RequestError):
        prepare_request(pb.GenerateRequest(prompt="é" * 65), limits, counting_tokenize)
    assert calls == []
    assert max_token_bytes(["a", "Ġhello", "é"]) == 7  # "Ġ" is 2 bytes in UTF-8: an over-estimate, never under


def test_prompt_token_ids_count_checked_before_their_values():
    with pytest.raises(RequestError) as info:
        prepare_request(pb.GenerateRequest(prompt_token_ids=[10**6] * 40), LIMITS, tokenize)
    assert info.value.field_name == "prompt_token_ids" and "40 tokens" in str(info.value)


@pytest.mark.parametrize(("params", "field", "words"), [
    (pb.SamplingParams(stop=["s"] * 17), "sampling_params.stop", "17 stop strings"),
    (pb.SamplingParams(stop=["ok", "x" * 257]), "sampling_params.stop", "stop string 1 is 257 characters"),
    (pb.SamplingParams(stop_token_ids=[1] * 65), "sampling_params.stop_token_ids", "65 token ids"),
])
def test_list_fields_are_bounded(params, field, words):
    with pytest.raises(RequestError) as info:
        prepare_request(pb.GenerateRequest(prompt="abc", sampling_params=params), LIMITS, tokenize)
    assert info.value.field_name == field and words in str(info.value)
    # At the bound: accepted.
    ok = pb.SamplingParams(stop=["x" * 256] * 16, stop_token_ids=[1] * 64, max_tokens=2)
    assert prepare_request(pb.GenerateRequest(prompt="abc", sampling_params=ok), LIMITS, tokenize).sampling.stop


def test_chat_message_count_is_bounded_before_its_bytes_are_summed():
    request = pb.GenerateRequest()
    for _ in range(LIMITS.max_model_len):
        request.messages.add(role="u", content="")
    with pytest.raises(RequestError) as info:
        prepare_request(request, LIMITS, tokenize)
    assert info.value.field_name == "messages" and "32 messages" in str(info.value)


def test_response_carries_logprobs_with_each_tokens_text():
    delta = OutputDelta("r", [5, 6], "xy", logprobs=(TokenLogprob(-0.5, ((5, -0.5), (7, -1.0))),
                                                      TokenLogprob(-2.0, ((8, -0.1),))))
    response = response_from_delta(delta, lambda token_id: f"<{token_id}>")
    assert [(e.logprob, e.token) for e in response.logprobs] == [(-0.5, "<5>"), (-2.0, "<6>")]
    assert [[(t.token_id, t.token, t.logprob) for t in e.top_logprobs] for e in response.logprobs] == [
        [(5, "<5>", -0.5), (7, "<7>", -1.0)], [(8, "<8>", pytest.approx(-0.1))]]
    assert not response_from_delta(OutputDelta("r", [1], "a")).logprobs


def test_engine_logprobs_from_vllms_keep_the_top_by_rank():
    from minedraft.engine.core import token_logprobs

    class Logprob:
        def __init__(self, logprob: float, rank: int) -> None:
            self.logprob, self.rank = logprob, rank

    # vLLM's position dicts: the chosen token (any rank) plus the top k; the chosen one outside the top k is not
    # among the top.
    positions = [{9: Logprob(-3.0, 4), 1: Logprob(-0.1, 1), 2: Logprob(-0.7, 2)}, {1: Logprob(-0.2, 1)}]
    out = token_logprobs([9, 1], positions, 2)
    assert out == (TokenLogprob(-3.0, ((1, -0.1), (2, -0.7))), TokenLogprob(-0.2, ((1, -0.2),)))
    assert token_logprobs([1], positions[1:], 0) == (TokenLogprob(-0.2, ()),)
