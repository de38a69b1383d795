"""minedraft profile's decoder computes what it claims: a GQA decoder whose cost is being measured, not something
cheaper (folded grouped-query attention equals plain GQA; a k + 1-token verify equals k + 1 one-token steps; the
draft loop feeds each argmax to the next pass)."""

import pytest
import torch
import torch.nn.functional as F

from minedraft.profile.architecture import Architecture
from minedraft.profile.model import KVCache, RandomDecoder
from minedraft.profile.timing import TimingSettings, time_eager

QWEN_LIKE = Architecture(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=96, vocab=50,
                         model_type="qwen3", tied_embeddings=False)
LLAMA_LIKE = Architecture(hidden=48, layers=1, heads=3, kv_heads=3, head_dim=16, inter=64, vocab=40,
                          model_type="llama", tied_embeddings=True)


def _decoder(arch: Architecture) -> RandomDecoder:
    # Larger weights than the profiler's, so that argmaxes are well separated and comparisons are not ties.
    decoder = RandomDecoder(arch, torch.float64, "cpu", seed=1)
    for tensor in [decoder.embed, decoder.lm_head, *(t for layer in decoder.layers
                                                     for t in (layer.qkv, layer.o, layer.gate_up, layer.down))]:
        tensor.mul_(20.0)
    return decoder


def _clone(cache: KVCache) -> KVCache:
    return KVCache([k.clone() for k in cache.keys], [v.clone() for v in cache.values])


@pytest.mark.parametrize("arch", [QWEN_LIKE, LLAMA_LIKE])
def test_allocated_parameters_are_the_architectures_count(arch):
    assert RandomDecoder(arch, torch.float32, "cpu").num_parameters() == arch.params()


@pytest.mark.parametrize("arch", [QWEN_LIKE, LLAMA_LIKE])
def test_a_multi_token_pass_equals_one_token_passes(arch):
    decoder = _decoder(arch)
    context, num, batch = 5, 4, 3
    cache = decoder.new_cache(batch, context + num)
    tokens = decoder.new_tokens(batch, num)
    stepwise_cache = _clone(cache)
    together = decoder.hidden_states(tokens, cache, context, decoder.mask(num, context))
    steps = [decoder.hidden_states(tokens[:, i:i + 1], stepwise_cache, context + i, None) for i in range(num)]
    torch.testing.assert_close(together, torch.cat(steps, dim=1))
    torch.testing.assert_close(cache.keys[0], stepwise_cache.keys[0])


@pytest.mark.parametrize("arch", [QWEN_LIKE, LLAMA_LIKE])
def test_a_prefill_fills_the_cache_as_a_forward_does_and_predicts_from_its_last_position(arch):
    decoder = _decoder(arch)
    prompt, batch = 6, 2
    cache = decoder.new_cache(batch, prompt)
    tokens = decoder.new_tokens(batch, prompt)
    forward_cache = _clone(cache)
    nxt = decoder.prefill(tokens, cache, 0, decoder.mask(prompt, 0))
    every = decoder.forward(tokens, forward_cache, 0, decoder.mask(prompt, 0))
    torch.testing.assert_close(nxt, every[:, -1])
    torch.testing.assert_close(cache.keys[-1], forward_cache.keys[-1])


def test_folded_grouped_query_attention_is_plain_gqa():
    torch.manual_seed(0)
    batch, kv_heads, group, num, length, dim = 2, 2, 3, 4, 9, 8
    q = torch.randn(batch, num, kv_heads, group, dim, dtype=torch.float64)
    keys = torch.randn(batch, kv_heads, length, dim, dtype=torch.float64)
    values = torch.randn(batch, kv_heads, length, dim, dtype=torch.float64)
    start = length - num
    decoder = RandomDecoder(Architecture(hidden=8, layers=1, heads=kv_heads * group, kv_heads=kv_heads,
                                         head_dim=dim, inter=8, vocab=8), torch.float64, "cpu")
    folded = q.permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * num, dim)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=decoder.mask(num, start))
    out = out.view(batch, kv_heads, group, num, dim).permute(0, 3, 1, 2, 4)
    # Reference: every query head against its KV head (repeated), causal over the new tokens.
    heads = q.reshape(batch, num, kv_heads * group, dim).transpose(1, 2)
    causal = torch.arange(length).view(1, -1) <= (start + torch.arange(num)).view(-1, 1)
    reference = F.scaled_dot_product_attention(heads, keys.repeat_interleave(group, dim=1),
                                               values.repeat_interleave(group, dim=1), attn_mask=causal)
    torch.testing.assert_close(out.reshape(batch, num, kv_heads * group, dim), reference.transpose(1, 2))


def test_the_draft_loop_feeds_each_argmax_to_the_next_pass():
    decoder = _decoder(QWEN_LIKE)
    context, k, batch = 6, 3, 2
    cache = decoder.new_cache(batch, context + 2 * k)
    tokens = decoder.new_tokens(batch, k + 1)
    by_hand_cache = _clone(cache)
    drafts = decoder.draft_loop(tokens, cache, context, k, decoder.mask(k + 1, context))
    assert drafts.shape == (batch, k)
    fed = tokens
    position = context
    for i in range(k):
        hidden = decoder.hidden_states(fed, by_hand_cache, position, decoder.mask(fed.shape[1], position))
        nxt = F.linear(hidden[:, -1], decoder.lm_head).argmax(-1)
        assert torch.equal(drafts[:, i], nxt)
        position += fed.shape[1]
        fed = nxt.view(batch, 1)


def test_eager_timing_is_a_positive_median():
    decoder = RandomDecoder(LLAMA_LIKE, torch.float32, "cpu")
    cache = decoder.new_cache(2, 20)
    tokens = decoder.new_tokens(2, 4)
    mask = decoder.mask(4, 16)
    ms = time_eager(lambda: decoder.forward(tokens, cache, 16, mask), TimingSettings(repeats=3, replays=2, warmup=1),
                    torch.device("cpu"))
    assert ms > 0
    with pytest.raises(ValueError, match="repeats"):
        TimingSettings(repeats=0)


class _Clock:
    """A GPU simulated at the level time_two_streams works at: each stream has a clock; a replay advances its
    stream's clock by the graph's duration, an event records its stream's clock, a wait moves the stream's clock to
    the event's. Every call is logged, so the test can check that nothing synchronizes between launches."""

    def __init__(self):
        self.log: list[str] = []
        self.current = None


class _Stream:
    def __init__(self, clock: _Clock, name: str):
        self.clock, self.name, self.time = clock, name, 0.0

    def wait_event(self, event):
        self.clock.log.append(f"{self.name} waits")
        self.time = max(self.time, event.time)


class _Event:
    def __init__(self, clock: _Clock):
        self.clock, self.time = clock, None

    def record(self, stream):
        self.time = stream.time

    def elapsed_time(self, other):
        return other.time - self.time


class _Graph:
    def __init__(self, clock: _Clock, name: str, ms: float):
        self.clock, self.name, self.ms = clock, name, ms

    def replay(self):
        stream = self.clock.current
        self.clock.log.append(f"{self.name} on {stream.name}")
        stream.time += self.ms


def test_two_streams_are_ordered_by_events_only_and_timed_from_a_common_start(monkeypatch):
    import contextlib

    from minedraft.profile import timing

    clock = _Clock()
    main = _Stream(clock, "main")
    clock.current = main
    made = iter(["s1", "s2"])

    @contextlib.contextmanager
    def use(stream):
        previous, clock.current = clock.current, stream
        try:
            yield
        finally:
            clock.current = previous

    def synchronize(*args):
        clock.log.append("synchronize")
        for stream in streams:
            main.time = max(main.time, stream.time)

    streams = [main]

    def new_stream():
        stream = _Stream(clock, next(made))
        streams.append(stream)
        return stream

    monkeypatch.setattr(timing.torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(timing.torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(timing.torch.cuda, "Event", lambda enable_timing: _Event(clock))
    monkeypatch.setattr(timing.torch.cuda, "stream", use)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", synchronize)
    settings = TimingSettings(repeats=2, replays=3, warmup=1)
    result = timing.time_two_streams(_Graph(clock, "target", 20.0), _Graph(clock, "drafter", 8.0), settings)
    assert result == {"ms": 20.0, "target_ms": 20.0, "drafter_ms": 8.0, "target_alone_ms": 20.0,
                      "drafter_alone_ms": 8.0}
    # Each run: one synchronize before its first launch and one after its last, none in between.
    runs = "\n".join(clock.log).split("synchronize")
    assert [bool(chunk.strip()) for chunk in runs] == [False, True, False, True, False, True, False, True, False]
    together = runs[-2].split()
    assert together.count("target") == together.count("drafter") == settings.repeats * settings.replays
    # The target replays on one stream, the drafter on the other, each after waiting for the common start.
    assert "target on s1" in runs[-2] and "drafter on s2" in runs[-2]
    first = runs[-2].strip().splitlines()[:4]
    assert first == ["s1 waits", "target on s1", "s2 waits", "drafter on s2"]


def test_eager_blocks_last_at_least_min_block_ms(monkeypatch):
    """Short calls are timed in blocks long enough to average over a shared CPU's time slices (a fake clock: each
    call takes 2 ms)."""
    from minedraft.profile import timing

    now = [0.0]
    calls = []

    def call():
        calls.append(1)
        now[0] += 0.002

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    ms = time_eager(call, TimingSettings(repeats=3, replays=2, warmup=1, min_block_ms=50.0), torch.device("cpu"))
    assert ms == pytest.approx(2.0)
    assert len(calls) == 1 + 1 + 3 * 25  # warmup, calibration, 3 blocks of 50 ms / 2 ms
    calls.clear()
    time_eager(call, TimingSettings(repeats=3, replays=2, warmup=1), torch.device("cpu"))
    assert len(calls) == 1 + 3 * 2
