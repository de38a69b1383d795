"""`--max-num-seqs-from-kv` reads the target GPU's memory through NVML, which numbers devices physically and ignores
CUDA_VISIBLE_DEVICES: visible GPU i is CUDA_VISIBLE_DEVICES' i-th entry (an index or a UUID). Its errors name the
flag. NVML is a recording stand-in here (no GPU); everything else is the real code."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from minedraft.engine import batch_limit
from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, SettingsError

GIB = 1 << 30


class FakeNvml(types.ModuleType):
    """pynvml with GPUs of distinct sizes: physical index i has (i + 1) * 10 GiB and UUID GPU-000i-...."""

    def __init__(self, count: int = 4) -> None:
        super().__init__("pynvml")
        self.count = count
        self.asked: list[Any] = []

    def nvmlInit(self) -> None:  # NVML's names
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.asked.append(index)
        if not 0 <= index < self.count:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-000{handle}-aaaa-bbbb".encode()

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        self.asked.append(uuid)
        for index in range(self.count):
            if self.nvmlDeviceGetUUID(index).decode() == uuid:
                return index
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return types.SimpleNamespace(total=(handle + 1) * 10 * GIB)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


@pytest.mark.parametrize(("visible", "index", "physical_gib"), [
    (None, 1, 20),  # unset: the visible list is every GPU
    ("3,2", 0, 40),  # visible GPU 0 is physical GPU 3
    ("3,2", 1, 30),
    ("GPU-0002-aaaa-bbbb,GPU-0000-aaaa-bbbb", 0, 30),  # a UUID
    ("GPU-0001,GPU-0003", 1, 40),  # a UUID's prefix, as CUDA takes it
])
def test_the_visible_index_is_mapped_to_the_physical_gpu(nvml: FakeNvml, visible: str | None, index: int,
                                                         physical_gib: int) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert batch_limit.gpu_memory_bytes(index, env) == physical_gib * GIB


def test_a_visible_index_beyond_the_list_is_refused_naming_the_flag(nvml: FakeNvml) -> None:
    with pytest.raises(SettingsError) as refused:
        batch_limit.gpu_memory_bytes(2, {"CUDA_VISIBLE_DEVICES": "3,2"})
    assert refused.value.field_name == "--max-num-seqs-from-kv" and "CUDA_VISIBLE_DEVICES=3,2" in str(refused.value)


def config(path: Path, **fields: Any) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"} | fields))
    return str(path)


LLAMA = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 512, "vocab_size": 1000}


def test_resize_reads_the_targets_own_gpu_and_a_bad_config_is_refused_naming_the_flag(
        nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    target = config(tmp_path / "target", **LLAMA)
    settings = EngineSettings(model=target, mode=Mode.PSD, drafter=DrafterSettings(model=target, gpu_index=0),
                              target_gpus=(1,))
    sized = batch_limit.resize(settings, 1024, ceiling=100_000)
    assert nvml.asked == [0]  # visible GPU 1 is physical GPU 0 (10 GiB), never physical GPU 1
    smaller = sized.max_num_seqs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert batch_limit.resize(settings, 1024, ceiling=100_000).max_num_seqs > smaller  # physical GPU 2: 30 GiB

    broken = config(tmp_path / "broken", model_type="not-a-transformers-model")
    with pytest.raises(SettingsError) as refused:
        batch_limit.resize(EngineSettings(model=broken, mode=Mode.PSD, drafter=DrafterSettings(model=target)), 1024)
    assert refused.value.field_name == "--max-num-seqs-from-kv" and "target" in str(refused.value)
    with pytest.raises(SettingsError) as missing:
        batch_limit.resize(EngineSettings(model=target, mode=Mode.PSD,
                                          drafter=DrafterSettings(model=str(tmp_path / "nowhere"))), 1024)
    assert missing.value.field_name == "--max-num-seqs-from-kv" and "drafter" in str(missing.value)


def test_a_non_positive_request_length_is_refused_naming_the_flag() -> None:
    from minedraft.cli import build_parser
    from minedraft.engine_options import settings_from_args

    args = build_parser().parse_args(["serve", "--model", "m", "--mode", "ar", "--max-num-seqs-from-kv", "0"])
    with pytest.raises(SettingsError) as refused:
        settings_from_args(args)
    assert refused.value.field_name == "--max-num-seqs-from-kv"
