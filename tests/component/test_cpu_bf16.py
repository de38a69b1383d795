"""The bfloat16 path on this CPU (asked for with --dtype bfloat16; "auto" is float32 on every CPU).

In bf16 the verifier's (k+1)-token passes and plain decoding round differently, so greedy output is not bit-identical
to the target alone and the check is the GPU one from device_checks: over the first tokens, nearly every request
agrees exactly (a PSD bug breaks nearly all of them within a few tokens). The reference is the same engine in ar mode,
so both sides run the same bf16 weights and kernels. On CPUs without fast bf16 (AVX2 only) vLLM computes bf16 through
conversions: slower, and checked the same way.
"""

from __future__ import annotations

import pytest

from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import Mode

from .conftest import engine_settings
from .device_checks import assert_greedy_matches, on_gpu
from .driver import Planned, drive
from .patience import drafts_missing, wait_for_drafts

pytestmark = pytest.mark.engine

GREEDY = SamplingSettings(max_tokens=24)


# Session scope, like the shared engines: shutting a vLLM engine down tears down vLLM's process-wide parallel state.
@pytest.fixture(scope="session")
def bf16_engine(pair_dir):
    if on_gpu():
        pytest.skip("the GPU path is bf16 already (device_checks)")
    from minedraft.engine.core import Engine

    engine = Engine(engine_settings(pair_dir, Mode.PSD, dtype="bfloat16", max_num_seqs=16))
    assert engine.wait_for_drafter(300), "drafter did not start"
    yield wait_for_drafts(engine)
    engine.shutdown()


def test_bf16_on_the_cpu_loads_as_asked_and_psd_agrees_with_the_target_alone(bf16_engine, pair_dir):
    import torch

    from minedraft.bench.workload import bench_prompts

    engine = bf16_engine
    assert engine.settings.dtype == "bfloat16" and engine._llm.model_config.dtype == torch.bfloat16
    prompts = [engine.encode_prompt(t) for t in bench_prompts(pair_dir, 10, chars=160)]

    def run(mode: Mode, tag: str) -> list[list[int]]:
        engine.set_mode(mode, None if mode is Mode.AR else 3, 0)
        result = drive(engine, [Planned(f"{tag}-{i}", p, GREEDY) for i, p in enumerate(prompts)])
        return [result.completions[f"{tag}-{i}"].token_ids for i in range(len(prompts))]

    references = run(Mode.AR, "bf16-ar")
    for mode in (Mode.PSD, Mode.SD):
        before = engine.totals()
        outputs = run(mode, f"bf16-{mode.value}")
        after = engine.totals()
        assert after.accepted_tokens > before.accepted_tokens, drafts_missing(engine, before, after)
        assert_greedy_matches(outputs, references, f"{mode.value} in bf16 on this CPU", gpu=True)
