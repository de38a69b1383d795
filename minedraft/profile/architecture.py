"""A decoder's shape (what the cost of its forward pass depends on), from a named preset or a Hugging Face config.json.

Nothing is downloaded: the paper's Qwen3 models are presets with their published configuration numbers, and the
repository's local pair is read from its own config files (they ship with the package).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Decoders implemented by minedraft.profile.model: Llama, and Qwen3 (Llama plus RMSNorm on each head's q and k).
ARCHITECTURES = ("llama", "qwen3")

BYTES_PER_DTYPE = {"bfloat16": 2, "float16": 2, "float32": 4}

_PAIR_DIR = Path(__file__).resolve().parent.parent / "models" / "data" / "pair-v1"


class ArchitectureError(ValueError):
    """A model spec or config that cannot be profiled; the message names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Architecture:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    model_type: str = "llama"  # "qwen3": RMSNorm over each head's queries and keys
    tied_embeddings: bool = False
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "inter", "vocab"):
            if int(getattr(self, name)) <= 0:
                raise ArchitectureError(name, f"must be a positive integer, got {getattr(self, name)!r}")
        if self.heads % self.kv_heads:
            raise ArchitectureError("kv_heads", f"{self.kv_heads} does not divide the {self.heads} query heads")
        if self.model_type not in ARCHITECTURES:
            raise ArchitectureError("model_type", f"the profiler implements {', '.join(ARCHITECTURES)}, "
                                                  f"not {self.model_type!r}")

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    def params(self) -> int:
        """Parameters the profiler's decoder allocates (the model's own count: embeddings, LM head unless tied,
        per layer fused QKV, output projection, gated MLP, two norms (+ q/k norms), and the final norm)."""
        attention = (self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
                     + self.heads * self.head_dim * self.hidden)
        per_layer = attention + 3 * self.hidden * self.inter + 2 * self.hidden + (2 * self.head_dim if self.qk_norm
                                                                                   else 0)
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * per_layer + self.hidden

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_PER_DTYPE[dtype]

    def curve_config(self) -> dict[str, int]:
        """The `config` object of a cost-curve file."""
        return {"hidden": self.hidden, "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "inter": self.inter, "vocab": self.vocab}

    def to_json(self) -> dict[str, Any]:
        return {**self.curve_config(), "model_type": self.model_type, "tied_embeddings": self.tied_embeddings,
                "rms_norm_eps": self.rms_norm_eps}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Architecture:
        return cls(**data)


def from_hf_config(config: dict[str, Any], source: str = "config") -> Architecture:
    """The shape of a Llama- or Qwen3-style decoder from its Hugging Face config.json contents."""
    c = config.get("text_config") or config
    model_type = str(c.get("model_type") or config.get("model_type") or "")
    if model_type not in ARCHITECTURES:
        raise ArchitectureError(f"{source}.model_type", f"the profiler implements {', '.join(ARCHITECTURES)}, "
                                                        f"not {model_type!r}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(c.get(key), int):
            raise ArchitectureError(f"{source}.{key}", f"missing or not an integer: {c.get(key)!r}")
    heads = int(c["num_attention_heads"])
    return Architecture(
        hidden=int(c["hidden_size"]),
        layers=int(c["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        inter=int(c["intermediate_size"]),
        vocab=int(c["vocab_size"]),
        model_type=model_type,
        tied_embeddings=bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
    )


def load_hf_config(path: str | Path) -> Architecture:
    """A config.json file, or a model directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ArchitectureError("config", f"no such file: {p}") from None
    except json.JSONDecodeError as exc:
        raise ArchitectureError("config", f"{p} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ArchitectureError("config", f"{p} does not hold a JSON object")
    return from_hf_config(data, source=str(p))


# The published configurations (Hugging Face Qwen/Qwen3-32B, Qwen/Qwen3-1.7B, Qwen/Qwen3-0.6B config.json).
PRESETS: dict[str, Architecture] = {
    "qwen3-32b": Architecture(hidden=5120, layers=64, heads=64, kv_heads=8, head_dim=128, inter=25600,
                              vocab=151936, model_type="qwen3", tied_embeddings=False),
    "qwen3-1.7b": Architecture(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, inter=6144,
                               vocab=151936, model_type="qwen3", tied_embeddings=True),
    "qwen3-0.6b": Architecture(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, inter=3072,
                               vocab=151936, model_type="qwen3", tied_embeddings=True),
}

# The repository's local pair: read from its own config files, so a rebuilt pair is profiled as it is.
FILE_PRESETS: dict[str, Path] = {
    "pair-v1-target": _PAIR_DIR / "target" / "config.json",
    "pair-v1-draft": _PAIR_DIR / "draft" / "config.json",
}


def preset_names() -> list[str]:
    return [*PRESETS, *FILE_PRESETS]


def resolve(spec: str, field: str = "model") -> tuple[str, Architecture]:
    """`NAME` (a preset), `PATH` (config.json or its directory; named after the directory) or `NAME=PATH`."""
    name, _, path = spec.partition("=") if "=" in spec else ("", "", spec)
    if not path:
        raise ArchitectureError(field, f"empty model spec {spec!r}")
    if path in PRESETS:
        return name or path, PRESETS[path]
    if path in FILE_PRESETS:
        return name or path, load_hf_config(FILE_PRESETS[path])
    p = Path(path)
    if not p.exists():
        raise ArchitectureError(field, f"{path!r} is neither a preset ({', '.join(preset_names())}) nor a config "
                                       "file or model directory")
    try:
        arch = load_hf_config(p)
    except ArchitectureError as exc:
        raise ArchitectureError(field, str(exc)) from None
    directory = p if p.is_dir() else p.parent
    return name or directory.name, arch
