"""The drafter's top-F coverage of the target's next token on the local pair: what lookahead's branches can hit.

Lookahead drafts the next round, while the target verifies this one, for a request's likely outcomes: an accepted
length and a bonus token among the drafter's top-F candidates at the position the bonus lands on. A branch hits when
the target's bonus token is among them. This measures, greedy and teacher-forced (the drafter reads the target's own
greedy continuation of held-out prompts, as it does once the drafts it made were accepted), the rank of the target's
token in the drafter's distribution at every position, and reports:

- acceptance: P(rank 1), what a drafted position is accepted with (greedy);
- after full acceptance (the previous k positions all rank 1, k = 1..4): coverage@F = P(rank <= F) for F = 1..4;
- after a rejection (rank >= 2: the drafter's top-1 was the rejected draft token): coverage@F = P(rank <= F | rank
  >= 2) with the rejected token counted among the F (F = 1 covers nothing), and P(rank <= F + 1 | rank >= 2) with it
  left out (F fresh candidates);
- the rank distribution given a rejection, P(rank = r | rank >= 2) for r = 2..8: what the twin derives a pair's
  coverage from (its acceptance model gives P(rank 1); the shape of the miss's ranks comes from here).

Usage (from the repository root; ~1 minute on one core):
    python benchmarks/lookahead_coverage.py [--prompts 32] [--prompt-tokens 48] [--generate-tokens 64]
Writes benchmarks/results/gpu-twin/lookahead-coverage.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.models.check import load_heldout, load_pair  # noqa: E402
from minedraft.models.spec import committed_pair_dir  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gpu-twin" / "lookahead-coverage.json"
MAX_F = 4
MAX_RANK = 8
COMMAND = "python benchmarks/lookahead_coverage.py"


def ranks_for_text(target: Any, draft: Any, ids: list[int], prompt_tokens: int, generate_tokens: int) -> list[int]:
    """The rank (1 = the drafter's top choice) of the target's greedy token at each generated position."""
    import torch

    prompt = torch.tensor(ids[:prompt_tokens]).unsqueeze(0)
    generated = target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                max_new_tokens=generate_tokens, min_new_tokens=generate_tokens,
                                do_sample=False, pad_token_id=0)
    sequence = generated[0]
    with torch.no_grad():
        draft_logits = draft(input_ids=sequence.unsqueeze(0)).logits[0]
    ranks: list[int] = []
    for position in range(prompt_tokens, sequence.numel()):
        token = int(sequence[position])
        logits = draft_logits[position - 1]
        ranks.append(1 + int((logits > logits[token]).sum()))
    return ranks


def summarise(all_ranks: list[list[int]]) -> dict[str, Any]:
    flat = [r for ranks in all_ranks for r in ranks]
    rejected = [r for r in flat if r >= 2]
    out: dict[str, Any] = {
        "positions": len(flat),
        "acceptance_top1": round(sum(r == 1 for r in flat) / len(flat), 4),
        "after_full_acceptance": {},
        "after_rejection": {
            "positions": len(rejected),
            "coverage_at_f_rejected_counted": {
                str(f): round(sum(r <= f for r in rejected) / len(rejected), 4) for f in range(1, MAX_F + 1)},
            "coverage_at_f_fresh_candidates": {
                str(f): round(sum(r <= f + 1 for r in rejected) / len(rejected), 4) for f in range(1, MAX_F + 1)},
            "rank_given_rejection": {
                str(r): round(sum(x == r for x in rejected) / len(rejected), 4) for r in range(2, MAX_RANK + 1)},
        },
    }
    for k in range(1, 5):
        after = [ranks[i] for ranks in all_ranks for i in range(k, len(ranks)) if all(x == 1 for x in ranks[i - k:i])]
        out["after_full_acceptance"][f"k{k}"] = {
            "positions": len(after),
            "coverage_at_f": {str(f): round(sum(r <= f for r in after) / len(after), 4) for f in range(1, MAX_F + 1)},
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--generate-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    pair_dir = committed_pair_dir()
    target, draft, tokenizer = load_pair(pair_dir)
    all_ranks = []
    with torch.no_grad():
        for text in load_heldout(pair_dir)[: args.prompts]:
            ids = tokenizer(text)["input_ids"]
            if len(ids) < args.prompt_tokens:
                continue
            all_ranks.append(ranks_for_text(target, draft, ids, args.prompt_tokens, args.generate_tokens))
    result = {
        "command": COMMAND + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""),
        "pair": str(pair_dir.relative_to(ROOT)),
        "prompts": len(all_ranks), "prompt_tokens": args.prompt_tokens, "generate_tokens": args.generate_tokens,
        "method": "greedy, teacher-forced on the target's own greedy continuation of held-out prompts; the "
                  "drafter reads the whole context",
        **summarise(all_ranks),
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
