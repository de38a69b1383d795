"""Measure the local pair: greedy acceptance on held-out text, target/draft cost ratio, and vLLM loading both."""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minedraft.models.corpus import split_stdlib
from minedraft.models.spec import RECIPE

HELDOUT_FILE = "heldout.json"


def make_heldout_sample(num_snippets: int = 32, snippet_chars: int = 800, seed: int = 7) -> list[str]:
    """Snippets of held-out standard-library files (never seen in training), chosen deterministically."""
    split = split_stdlib(RECIPE.heldout_modulus)
    rng = random.Random(seed)
    files = list(split.heldout_files)
    rng.shuffle(files)
    snippets: list[str] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < snippet_chars * 2:
            continue
        start = rng.randrange(0, len(text) - snippet_chars)
        snippets.append(text[start : start + snippet_chars])
        if len(snippets) == num_snippets:
            break
    return snippets


def load_heldout(pair_dir: Path) -> list[str]:
    return list(json.loads((pair_dir / HELDOUT_FILE).read_text()))


@dataclass(frozen=True)
class AcceptanceReport:
    num_speculative_tokens: int
    num_prompts: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float


def _greedy_continue(model: Any, prefix: Any, num_tokens: int) -> list[int]:
    import torch

    out = model.generate(
        input_ids=prefix.unsqueeze(0),
        attention_mask=torch.ones(1, prefix.numel(), dtype=torch.long),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, prefix.numel():].tolist()]


def greedy_acceptance(
    target: Any, draft: Any, tokenizer: Any, texts: list[str], num_speculative_tokens: int = 4,
    prompt_tokens: int = 48, generate_tokens: int = 48,
) -> AcceptanceReport:
    """Simulate greedy speculative decoding: the draft proposes k tokens, the target's greedy tokens judge them."""
    import torch

    drafted = accepted = steps = 0
    num_prompts = 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            if len(ids) < prompt_tokens:
                continue
            num_prompts += 1
            prompt = torch.tensor(ids[:prompt_tokens])
            reference = _greedy_continue(target, prompt, generate_tokens)
            position = 0
            while position < generate_tokens:
                k = min(num_speculative_tokens, generate_tokens - position)
                context = torch.cat([prompt, torch.tensor(reference[:position], dtype=torch.long)])
                proposal = _greedy_continue(draft, context, k)
                run = 0
                while run < k and proposal[run] == reference[position + run]:
                    run += 1
                drafted += k
                accepted += run
                steps += 1
                position += run + 1
    return AcceptanceReport(
        num_speculative_tokens=num_speculative_tokens,
        num_prompts=num_prompts,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=(accepted + steps) / steps if steps else 0.0,
    )


def forward_seconds(model: Any, batch: int = 8, length: int = 128, repeats: int = 5) -> float:
    import torch

    x = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    timings = []
    with torch.no_grad():
        model(input_ids=x)
        for _ in range(repeats):
            started = time.perf_counter()
            model(input_ids=x)
            timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def load_pair(pair_dir: Path) -> tuple[Any, Any, Any]:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(pair_dir / "target"))
    target = LlamaForCausalLM.from_pretrained(str(pair_dir / "target"), dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(str(pair_dir / "draft"), dtype=torch.float32).eval()
    return target, draft, tokenizer


def check_pair(pair_dir: Path, with_vllm: bool = True) -> dict[str, Any]:
    target, draft, tokenizer = load_pair(pair_dir)
    texts = load_heldout(pair_dir)
    acceptance = greedy_acceptance(target, draft, tokenizer, texts)
    target_seconds = forward_seconds(target)
    draft_seconds = forward_seconds(draft)
    report: dict[str, Any] = {
        "pair_dir": str(pair_dir),
        "acceptance": asdict(acceptance),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "target_forward_seconds": target_seconds,
        "draft_forward_seconds": draft_seconds,
        "cost_ratio": target_seconds / draft_seconds,
    }
    if with_vllm:
        report["vllm"] = {role: vllm_generate(str(pair_dir / role)) for role in ("target", "draft")}
    return report


def vllm_generate(model_dir: str, prompt: str = "def main(", max_tokens: int = 24) -> dict[str, Any]:
    """Load a model with vLLM and generate from it (in this process: vLLM's engine core in-process)."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, max_num_seqs=8, seed=0)
    load_seconds = time.perf_counter() - started
    output = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
    text = output.outputs[0].text
    llm.llm_engine.engine_core.shutdown()
    del llm
    return {"load_seconds": round(load_seconds, 1), "prompt": prompt, "completion": text,
            "num_tokens": len(output.outputs[0].token_ids)}
