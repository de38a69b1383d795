"""A cost-realistic model pair with a chosen acceptance rate, built from constructed weights (no training).

Why: the trained local pair is tiny and overhead-bound, the regime where speculation does not pay. GPU serving's
regime needs a target whose decode step is memory-bound (a large float32 model on this CPU) and an acceptance rate
we choose. vLLM's own way to fix acceptance (`rejection_sample_method: synthetic`) asserts on CPU in 0.32, and it
gives up losslessness. Instead the weights themselves fix the acceptance, and verification stays real:

- The target's residual stream carries the last token's embedding almost unchanged: every layer computes at full
  cost (random q/k/v/gate/up weights), but its output projections are scaled to ~0. Its unembedding maps the
  embedding of token x to the logit of succ(x), the next id on a fixed cycle over the ordinary (non-special) ids.
  Greedy decoding therefore counts along the cycle, whatever the prompt.
- The draft is built the same way at a small size, but its unembedding maps x to succ(x) only for x in a random
  set S holding a fraction `acceptance` of the ids; other ids go to wrong successors (a permutation, so no id is
  favoured). A draft is accepted position by position while the tokens it extends lie in S: each position is
  accepted with probability `acceptance`, independently, as in vLLM's synthetic mode, but by the real rejection
  sampler, so outputs stay lossless (greedy output equals the target alone's).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConstructedRecipe:
    acceptance: float = 0.8
    # ~160M parameters, float32: memory-bound decode at low concurrency on this CPU (docs/architecture.md).
    target_hidden_size: int = 1024
    target_num_layers: int = 12
    target_num_heads: int = 16
    target_intermediate_size: int = 2816
    draft_hidden_size: int = 256
    draft_num_layers: int = 2
    draft_num_heads: int = 4
    draft_intermediate_size: int = 688
    # Output projections are scaled by this: layers cost what they cost but barely move the residual stream.
    residual_scale: float = 1e-4
    max_position_embeddings: int = 2048
    seed: int = 20261202

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"acceptance: must be within [0, 1], got {self.acceptance}")


def successor_cycle(vocab_size: int, special_ids: set[int], seed: int) -> dict[int, int]:
    """succ(x) over the ordinary ids, as one cycle in a shuffled order (so succ is not simply x + 1)."""
    ordinary = [i for i in range(vocab_size) if i not in special_ids]
    random.Random(seed).shuffle(ordinary)
    return {x: ordinary[(i + 1) % len(ordinary)] for i, x in enumerate(ordinary)}


def draft_successors(succ: dict[int, int], acceptance: float, seed: int) -> tuple[dict[int, int], set[int]]:
    """The draft's next-token map: succ(x) for x in S (|S| = acceptance * n), a wrong successor otherwise.

    For x outside S the draft names the successor of another id outside S (a cyclic shift among them): still a
    permutation, and never succ(x) when at least two ids are outside S.
    """
    ids = sorted(succ)
    rng = random.Random(seed + 1)
    rng.shuffle(ids)
    num_in = round(acceptance * len(ids))
    in_set = set(ids[:num_in])
    outside = ids[num_in:]
    mapping = {x: succ[x] for x in in_set}
    for i, x in enumerate(outside):
        mapping[x] = succ[outside[(i + 1) % len(outside)]] if len(outside) > 1 else succ[x]
    return mapping, in_set


def _build_model(
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
    next_token: dict[int, int],
    recipe: ConstructedRecipe,
    seed: int,
    special_ids: set[int],
) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=min(special_ids) if special_ids else 0,
        eos_token_id=min(special_ids) if special_ids else 0,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        embedding = torch.randn(vocab_size, hidden)
        model.model.embed_tokens.weight.copy_(embedding)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(recipe.residual_scale)
            layer.mlp.down_proj.weight.mul_(recipe.residual_scale)
        unembed = torch.zeros(vocab_size, hidden)
        # Row y scores how much the final hidden state looks like the embedding of a token whose successor is y.
        for x, y in next_token.items():
            unembed[y] = embedding[x]
        model.lm_head.weight.copy_(unembed)
        model.model.norm.weight.fill_(1.0)
    return model


def build_constructed_pair(
    output_dir: Path, tokenizer_dir: Path, recipe: ConstructedRecipe = ConstructedRecipe()
) -> dict[str, Any]:
    """Write `target/` and `draft/` (Hugging Face Llama, float32, with the tokenizer) and `build.json`."""
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab_size = len(tokenizer)
    special_ids = set(tokenizer.all_special_ids)
    succ = successor_cycle(vocab_size, special_ids, recipe.seed)
    draft_next, in_set = draft_successors(succ, recipe.acceptance, recipe.seed)

    partial = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for role, (hidden, layers, heads, intermediate, mapping, seed) in {
        "target": (recipe.target_hidden_size, recipe.target_num_layers, recipe.target_num_heads,
                   recipe.target_intermediate_size, succ, recipe.seed + 10),
        "draft": (recipe.draft_hidden_size, recipe.draft_num_layers, recipe.draft_num_heads,
                  recipe.draft_intermediate_size, draft_next, recipe.seed + 20),
    }.items():
        log.info("building the %s (%d x %d)", role, layers, hidden)
        model = _build_model(vocab_size, hidden, layers, heads, intermediate, mapping, recipe, seed, special_ids)
        model.save_pretrained(partial / role)
        tokenizer.save_pretrained(partial / role)
        del model
    report = {
        "recipe": asdict(recipe),
        "vocab_size": vocab_size,
        "num_ordinary_ids": len(succ),
        "num_ids_drafted_correctly": len(in_set),
        "build_seconds": round(time.perf_counter() - started, 1),
        "acceptance_source": f"constructed weights (per-position acceptance {recipe.acceptance})",
    }
    (partial / "build.json").write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(output_dir, ignore_errors=True)
    partial.rename(output_dir)
    return report


def constructed_pair_dir(cache_root: Path, acceptance: float) -> Path:
    return cache_root / "models" / f"constructed-a{round(acceptance * 100):02d}"
