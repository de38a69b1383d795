"""Tiny random-weight pairs of real architectures (Qwen3, Llama), built with transformers: no downloads.

They exercise what the trained local pair (a plain Llama) cannot: Qwen3's q/k RMSNorm and its config fields in vLLM
and both drafter backends. Random weights give near-zero acceptance; these pairs are for correctness (greedy
identity with the target alone, the distribution test), not for speed. Both models use the local pair's tokenizer,
so target and draft share a vocabulary as a real pair does.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_VERSION = "v1"
ARCHITECTURES = ("qwen3", "llama")


@dataclass(frozen=True)
class TinyShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


# Wide enough that vLLM's CPU attention (head_dim a multiple of 32) and GQA are exercised; small enough to load in a
# second. Grouped-query attention in the target (2 KV heads for 4 query heads), as in Qwen3-32B.
TARGET_SHAPE = TinyShape(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                         intermediate_size=256)
DRAFT_SHAPE = TinyShape(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128)


def tiny_config(architecture: str, shape: TinyShape, vocab_size: int, max_position_embeddings: int = 2048) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "dtype": "float32",
    }
    if architecture == "qwen3":
        return Qwen3Config(**common)
    if architecture == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"architecture: expected one of {', '.join(ARCHITECTURES)}, got {architecture!r}")


def build_tiny_pair(out: Path, architecture: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """target/ and draft/ under `out`, each a complete Hugging Face model directory. Idempotent."""
    import torch
    from transformers import AutoModelForCausalLM

    vocab_size = int(_read_vocab_size(tokenizer_dir))
    for role, shape in (("target", TARGET_SHAPE), ("draft", DRAFT_SHAPE)):
        directory = out / role
        if (directory / "config.json").is_file() and (directory / "model.safetensors").is_file():
            continue
        torch.manual_seed(seed + (0 if role == "target" else 1))
        model = AutoModelForCausalLM.from_config(tiny_config(architecture, shape, vocab_size))
        with torch.no_grad():  # larger logits than the default init, so greedy choices are not near-ties
            model.get_input_embeddings().weight.mul_(8.0)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, tmp / name)
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
    return out


def _read_vocab_size(tokenizer_dir: Path) -> int:
    import json

    return int(json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"])


def tiny_pair(architecture: str) -> Path:
    """The tiny pair of an architecture, built into the user cache on first use (seconds)."""
    from minedraft.models.spec import cache_root, default_pair_dir

    local = default_pair_dir()
    if not (local / "target" / "tokenizer.json").is_file():
        from minedraft.models.spec import committed_pair_dir

        local = committed_pair_dir()
    return build_tiny_pair(cache_root() / "models" / f"tiny-{architecture}-{TINY_VERSION}", architecture,
                           local / "target")
