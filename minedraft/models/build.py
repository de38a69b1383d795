"""Build the local target/draft pair: a byte-level BPE tokenizer, a small Llama target, and a draft distilled from it.

The draft learns the target's next-token distribution (KL on the target's logits) rather than the corpus: that is
what makes its greedy proposals agree with the target's often enough to be a realistic speculative pair.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from minedraft.models.corpus import read_texts, split_stdlib
from minedraft.models.spec import RECIPE, LlamaShape, PairRecipe

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN
    )
    fast.model_max_length = RECIPE.max_position_embeddings
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def llama_config(shape: LlamaShape, recipe: PairRecipe, eos_token_id: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        dtype="float32",
    )


def _token_stream(tokenizer: Any, texts: list[str]) -> Any:
    import torch

    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _batches(stream: Any, recipe: PairRecipe, steps: int, seed: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    high = stream.numel() - recipe.sequence_length - 1
    for _ in range(steps):
        starts = torch.randint(0, high, (recipe.batch_size,), generator=generator)
        yield torch.stack([stream[s : s + recipe.sequence_length] for s in starts.tolist()])


def _lr_at(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _train(
    model: Any,
    stream: Any,
    recipe: PairRecipe,
    steps: int,
    peak_lr: float,
    seed: int,
    desc: str,
    teacher: Any | None = None,
) -> list[float]:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    losses: list[float] = []
    bar = tqdm(_batches(stream, recipe, steps, seed), total=steps, desc=desc, unit="step")
    for step, batch in enumerate(bar):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps, peak_lr)
        logits = model(input_ids=batch).logits[:, :-1]
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=batch).logits[:, :-1]
            temperature = recipe.distill_temperature
            loss = F.kl_div(
                F.log_softmax(logits / temperature, dim=-1).reshape(-1, logits.shape[-1]),
                F.log_softmax(teacher_logits / temperature, dim=-1).reshape(-1, logits.shape[-1]),
                log_target=True,
                reduction="batchmean",
            ) * (temperature**2)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    model.eval()
    return losses


def build_pair(out_dir: Path, recipe: PairRecipe = RECIPE, threads: int | None = None) -> dict[str, Any]:
    """Build tokenizer, target and distilled draft into out_dir/{target,draft}; returns a build report."""
    import torch
    from transformers import LlamaForCausalLM

    started = time.monotonic()
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    if threads:
        torch.set_num_threads(threads)
    split = split_stdlib(recipe.heldout_modulus)
    texts = read_texts(split.train_files)
    log.info("corpus: %d training files, %d held out", len(texts), len(split.heldout_files))

    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = train_tokenizer(texts, recipe.vocab_size, staging / "target")
    stream = _token_stream(tokenizer, texts)
    log.info("corpus: %d training tokens", stream.numel())

    torch.manual_seed(recipe.seed)
    target = LlamaForCausalLM(llama_config(recipe.target, recipe, tokenizer.eos_token_id))
    target_losses = _train(target, stream, recipe, recipe.target_steps, recipe.target_learning_rate,
                           recipe.seed, "target")
    for param in target.parameters():
        param.requires_grad_(False)

    torch.manual_seed(recipe.seed + 1)
    draft = LlamaForCausalLM(llama_config(recipe.draft, recipe, tokenizer.eos_token_id))
    draft_losses = _train(draft, stream, recipe, recipe.draft_steps, recipe.draft_learning_rate,
                          recipe.seed + 1, "draft (distil)", teacher=target)

    for role, model in (("target", target), ("draft", draft)):
        model.save_pretrained(str(staging / role), safe_serialization=True)
        tokenizer.save_pretrained(str(staging / role))
    from minedraft.models.check import HELDOUT_FILE, make_heldout_sample

    (staging / HELDOUT_FILE).write_text(json.dumps(make_heldout_sample(), indent=1) + "\n")
    report = {
        "recipe": asdict(recipe),
        "train_tokens": int(stream.numel()),
        "target_final_loss": sum(target_losses[-20:]) / 20,
        "draft_final_kl": sum(draft_losses[-20:]) / 20,
        "build_seconds": round(time.monotonic() - started, 1),
        "torch_version": torch.__version__,
    }
    (staging / "build.json").write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return report
