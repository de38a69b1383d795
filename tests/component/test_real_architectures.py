"""A Qwen3-shaped pair (q/k RMSNorm, grouped-query attention; tiny random weights built with transformers) through
the whole engine with the vLLM drafter backend: psd and sd reproduce the target alone (ar on the same engine).

The torch drafter's Qwen3 path is checked token for token against transformers in tests/unit/test_torch_drafter.py.
"""

from __future__ import annotations

import pytest

from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, default_core_split

from .device_checks import assert_greedy_matches
from .driver import Planned, drive
from .patience import wait_for_drafts

pytestmark = pytest.mark.engine

GREEDY = SamplingSettings(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_engine():
    from minedraft.engine.core import Engine
    from minedraft.models.tiny import tiny_pair

    pair = tiny_pair("qwen3")
    target_cores, drafter_cores = default_core_split()
    engine = Engine(EngineSettings(
        model=str(pair / "target"),
        drafter=DrafterSettings(model=str(pair / "draft"), cpu_cores=drafter_cores, kv_cache_gib=1,
                                deadline_seconds=10.0, backend="vllm"),
        mode=Mode.PSD, num_speculative_tokens=3, max_num_seqs=16, max_model_len=256, kv_cache_gib=1,
        target_cpu_cores=target_cores, check_invariants=True))
    assert engine.wait_for_drafter(300), "drafter did not start"
    yield wait_for_drafts(engine)
    engine.shutdown()


def test_a_qwen3_pair_runs_psd_and_sd_losslessly(qwen3_engine):
    engine = qwen3_engine
    assert engine.pair_check["target_model_type"] == engine.pair_check["draft_model_type"] == "qwen3"
    prompts = [engine.encode_prompt(t) for t in ("def main():\n", "import os\n", "class Parser:\n", "x = [")]

    def run(mode: Mode, tag: str) -> list[list[int]]:
        engine.set_mode(mode, None if mode is Mode.AR else 3, 0)
        if mode is not Mode.AR:
            assert engine.wait_for_drafter(300)
        result = drive(engine, [Planned(f"{tag}-{i}", p, GREEDY) for i, p in enumerate(prompts)])
        return [result.completions[f"{tag}-{i}"].token_ids for i in range(len(prompts))]

    reference = run(Mode.AR, "ar")
    for mode in (Mode.PSD, Mode.SD):
        before = engine.totals()
        assert_greedy_matches(run(mode, mode.value), reference, f"qwen3 {mode.value}")
        assert engine.totals().draft_tokens > before.draft_tokens, f"{mode.value}: drafts were verified"
