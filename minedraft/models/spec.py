"""What the local model pair is: sizes, seeds and training budgets as plain data.

Kept apart from the training code so the CLI, the checks and the tests can read the recipe without importing torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PAIR_NAME = "pair-v1"


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    # 64 is a head size every CPU and GPU attention backend of vLLM supports.
    head_dim: int = 64


@dataclass(frozen=True)
class PairRecipe:
    """Everything that determines the built pair; changing any field means a new PAIR_NAME."""

    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    target: LlamaShape = field(default_factory=lambda: LlamaShape(4, 256, 768, 4))
    draft: LlamaShape = field(default_factory=lambda: LlamaShape(1, 192, 512, 3))
    seed: int = 1234
    # Every tenth corpus file (by a stable hash of its path) is held out from training.
    heldout_modulus: int = 10
    sequence_length: int = 256
    batch_size: int = 16
    target_steps: int = 500
    target_learning_rate: float = 3e-3
    draft_steps: int = 700
    draft_learning_rate: float = 3e-3
    # Distillation temperature for the KL loss on the target's logits.
    distill_temperature: float = 1.0


RECIPE = PairRecipe()


def committed_pair_dir() -> Path:
    """The pair shipped inside the package (built once by `minedraft models build --output ...`)."""
    return Path(__file__).parent / "data" / PAIR_NAME


def cache_root() -> Path:
    env = os.environ.get("MINEDRAFT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "minedraft"


def is_complete_pair(pair_dir: Path) -> bool:
    return all((pair_dir / role / "config.json").is_file() for role in ("target", "draft")) and (
        pair_dir / "target" / "tokenizer.json"
    ).is_file()


def default_pair_dir() -> Path:
    """Where the local pair is read from: an explicit override, the committed copy, else the cache."""
    env = os.environ.get("MINEDRAFT_PAIR_DIR")
    if env:
        return Path(env)
    committed = committed_pair_dir()
    if is_complete_pair(committed):
        return committed
    return cache_root() / "models" / PAIR_NAME
