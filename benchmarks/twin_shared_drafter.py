"""N replicas sharing one drafter GPU, against a drafter GPU per replica (the paper's TP + 1) and vLLM's colocated SD
on the target's GPUs, through the twin on the H200 cost curves (Qwen3-32B target, k=3, acceptance 0.8 per position).

Writes benchmarks/results/gpu-twin/shared-drafter.{json,md,png}. Usage (from the repository root):
    python benchmarks/twin_shared_drafter.py      # a few minutes on a contended 2-core machine; pure Python

Layouts: the paper's (TP=4 target, Qwen3-1.7B drafter), the same pair at TP=2 and TP=1 (verification slower than
the drafter's loop), and TP=4 with the curves' cheaper drafter (Qwen3-0.6B). Per layout, context (prompt 1024 or
4096 tokens, the curves' context levels), load (requests per replica) and drafter window (none, or 512 + 4 sinks),
tokens/s per GPU of: ar on TP GPUs, vLLM's colocated sd on TP (drafting on the target's GPUs, in sequence with
verification), psd TP + 1 (a drafter GPU per replica), and psd with N = 2, 4, 8 replicas sharing one drafter GPU
(N x TP + 1 GPUs). The window is MineDraft's; vLLM's drafter has none.

Every drafter pays its jobs' catch-up, the shared one included: newcomers' prompts at the drafter's prefill price
(the curves hold no prefill; a per-token price is read off their forward passes, see `token_price_ms`), bounded by
the window when there is one (the windowed drafter takes in only the sinks and the last W positions). The target's
own prefill is left out, as in the twin's other GPU figures (it costs every mode alike and dilutes every speculative
gain); `--target-prefill` prices it too (the same way), for a look at that regime:
    python benchmarks/twin_shared_drafter.py --target-prefill --out /tmp/shared-prefill
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import CostCurves, ModelCurves, load_curves  # noqa: E402
from minedraft.twin.run import Workload, run_concurrency  # noqa: E402
from minedraft.twin.shared_drafter import run_shared  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
COMMAND = "python benchmarks/twin_shared_drafter.py"
ACCEPTANCE = 0.8
K = 3
CONTEXTS = (1024, 4096)
CONCURRENCIES = (4, 16, 64, 128)
REPLICAS = (2, 4, 8)
WINDOWS = (0, 512)
GOAL = 1.2
TARGET = "qwen3-32b"
# The 0.6B drafter's curves hold no forward passes to price its prefill from: the 1.7B's price scaled by their nominal
# sizes (an estimate, said in the results).
NOMINAL_PARAMS = {"qwen3-1.7b": 1.7e9, "qwen3-0.6b": 0.6e9}
PRICED_DRAFTER = "qwen3-1.7b"


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    drafter: str


LAYOUTS = (
    Layout("paper: TP=4, 1.7B drafter", 4, "qwen3-1.7b"),
    Layout("TP=2, 1.7B drafter", 2, "qwen3-1.7b"),
    Layout("TP=1, 1.7B drafter", 1, "qwen3-1.7b"),
    Layout("TP=4, 0.6B drafter", 4, "qwen3-0.6b"),
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def token_price_ms(model: ModelCurves) -> float:
    """One more token's milliseconds in a large forward on one GPU: the slope of the curves' forward at 128 requests
    and context 1024 from 1 to 6 new tokens each (640 tokens more; compute-bound, as a prefill chunk is)."""
    batch = 128
    more = model.forward_ms(batch, 1024, 6).ms - model.forward_ms(batch, 1024, 1).ms
    return more / (batch * 5)


def prices(curves: CostCurves) -> dict[str, float]:
    """Per-token prefill prices (ms): the target's on one GPU, and each drafter's on its own GPU."""
    target = token_price_ms(curves.model(TARGET, "target"))
    priced = token_price_ms(curves.model(PRICED_DRAFTER, "drafter"))
    return {"target": target, **{name: priced * params / NOMINAL_PARAMS[PRICED_DRAFTER]
                                 for name, params in NOMINAL_PARAMS.items()}}


def hardware(layout: Layout, price: dict[str, float], target_prefill: bool, **extra: Any) -> Hardware:
    # The target's prefill splits over its TP group (compute-bound); the drafter's runs on its one GPU.
    return Hardware(tensor_parallel_size=layout.tp,
                    prefill_ms_per_token=price["target"] / layout.tp if target_prefill else 0.0,
                    drafter_prefill_ms_per_token=price[layout.drafter], **extra)


def measure(curves: CostCurves, price: dict[str, float], target_prefill: bool) -> list[dict[str, Any]]:
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    rows: list[dict[str, Any]] = []
    for layout in LAYOUTS:
        for context in CONTEXTS:
            workload = Workload(prompt_tokens=context)
            for window in WINDOWS:
                costs = StepCosts.from_curves(curves, TARGET, layout.drafter,
                                              hardware(layout, price, target_prefill,
                                                       drafter_window_tokens=window))
                slow_colocated = StepCosts.from_curves(curves, TARGET, layout.drafter, hardware(
                    layout, price, target_prefill, colocated_draft_scales_with_tp=False))
                for concurrency in CONCURRENCIES:
                    rows.append(_row(layout, costs, slow_colocated, acceptance, context, window, concurrency,
                                     workload))
    return rows


def _row(layout: Layout, costs: StepCosts, slow_colocated: StepCosts, acceptance: AcceptanceModel, context: int,
         window: int, concurrency: int, workload: Workload) -> dict[str, Any]:
    ar = run_concurrency(costs, acceptance, "ar", 0, concurrency, workload)
    vllm = run_concurrency(costs, acceptance, "vllm-sd", K, concurrency, workload)
    vllm_slow = (vllm if layout.tp == 1 else
                 run_concurrency(slow_colocated, acceptance, "vllm-sd", K, concurrency, workload))
    own = run_concurrency(costs, acceptance, "psd", K, concurrency, workload)
    row: dict[str, Any] = {
        "layout": layout.name, "tp": layout.tp, "drafter": layout.drafter,
        "context": context, "window": window or None, "concurrency_per_replica": concurrency,
        "ar": round(ar.tokens_per_s_per_gpu, 1), "vllm_sd": round(vllm.tokens_per_s_per_gpu, 1),
        "vllm_sd_drafter_1gpu_time": round(vllm_slow.tokens_per_s_per_gpu, 1),
        "psd_own_drafter": round(own.tokens_per_s_per_gpu, 1),
        "psd_own_drafter_deadline_misses": own.deadline_misses,
        # PSD pays: psd on its own drafter GPU beats plain decoding on the same target, per replica.
        "psd_pays": own.tokens_per_s > ar.tokens_per_s,
        "shared": {},
    }
    for n in REPLICAS:
        shared = run_shared(costs, acceptance, K, n, concurrency, workload)
        per_gpu = shared.result.tokens_per_s_per_gpu
        row["shared"][str(n)] = {
            "gpus": shared.result.gpus, "tokens_per_s_per_gpu": round(per_gpu, 1),
            "over_vllm_sd": round(per_gpu / vllm.tokens_per_s_per_gpu, 3),
            "over_psd_own_drafter": round(per_gpu / own.tokens_per_s_per_gpu, 3),
            "drafter_utilisation": round(shared.drafter_utilisation, 3),
            "requests_per_draft_loop": round(shared.mean_round_batch, 1),
            "jobs_per_draft_loop": round(shared.jobs_per_round, 2),
            "deadline_misses": shared.result.deadline_misses,
        }
    best = max(row["shared"].values(), key=lambda s: s["tokens_per_s_per_gpu"])
    row["best_shared_over_vllm_sd"] = best["over_vllm_sd"]
    row["best_shared_over_vllm_sd_drafter_1gpu_time"] = round(
        best["tokens_per_s_per_gpu"] / vllm_slow.tokens_per_s_per_gpu, 3)
    row["best_shared_replicas"] = next(n for n, s in row["shared"].items() if s is best)
    log(f"{layout.name}, context {context} window {window or '-'} load {concurrency}: ar {row['ar']}, vllm-sd "
        f"{row['vllm_sd']}, own drafter {row['psd_own_drafter']}, shared best {best['tokens_per_s_per_gpu']} "
        f"({best['over_vllm_sd']}x vllm-sd) tok/s/GPU")
    return row


def markdown(report: dict[str, Any]) -> str:
    rows, price = report["rows"], report["assumptions"]["prefill_ms_per_token"]
    lines = [
        "# N replicas sharing one drafter GPU (twin, H200 curves)", "",
        f"Command: `{COMMAND}`. Qwen3-32B target, k={K}, acceptance {ACCEPTANCE} per position, outputs 256 tokens "
        "(+-50%). Tokens/s per GPU; `shared N` = N replicas and one drafter GPU (N x TP + 1 GPUs); `own` = psd with "
        "a drafter GPU per replica (TP + 1); best/vllm-sd = the best shared N over vLLM's colocated SD on the "
        "target's TP GPUs. Colocated SD twice at TP > 1: its drafter's loop divided by TP plus all-reduces (the "
        "twin's default) and, in brackets, at its one-GPU time (a small drafter's loop is largely launch-bound, "
        "which TP hardly shortens); the truth lies between. Window 512: the drafter's KV reads capped at 516 "
        "positions (below the curves' lowest context level: extrapolated), and each request's catch-up at most 516 "
        "tokens. psd pays: psd with its own drafter beats ar in tokens/s per replica. Drafter util: busy share of "
        "the shared drafter GPU at N=2.", "",
        f"Prefill priced per token (read off the curves' forward passes: one more token in a 128-request forward): "
        f"drafter 1.7B {price['qwen3-1.7b']:.4f} ms on its GPU, 0.6B {price['qwen3-0.6b']:.4f} ms (the 1.7B's "
        "scaled by nominal size: its curves hold no forward passes); every drafter pays its jobs' catch-up "
        "(newcomers' prompts), the shared one included. "
        + (f"The target's prefill too: {price['target']:.4f} ms per prompt token on one GPU, divided by TP."
           if report["assumptions"]["target_prefill"] else
           "The target's own prefill is not modelled (it costs every mode alike)."),
    ]
    for layout in LAYOUTS:
        sel = [r for r in rows if r["layout"] == layout.name]
        tp = layout.tp
        lines += [
            "", f"## {layout.name}", "",
            f"| context | window | load/replica | ar {tp} | vllm-sd {tp} | psd own ({tp}+1) | shared 2 | shared 4 | "
            "shared 8 | best/vllm-sd | psd pays | drafter util (N=2) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sel:
            s = r["shared"]
            slow = tp > 1
            vllm = f"{r['vllm_sd']} ({r['vllm_sd_drafter_1gpu_time']})" if slow else f"{r['vllm_sd']}"
            ratio = (f"{r['best_shared_over_vllm_sd']} ({r['best_shared_over_vllm_sd_drafter_1gpu_time']})" if slow
                     else f"{r['best_shared_over_vllm_sd']}")
            lines.append(f"| {r['context']} | {r['window'] or '-'} | {r['concurrency_per_replica']} | {r['ar']} | "
                         f"{vllm} | {r['psd_own_drafter']} | {s['2']['tokens_per_s_per_gpu']} | "
                         f"{s['4']['tokens_per_s_per_gpu']} | {s['8']['tokens_per_s_per_gpu']} | "
                         f"{ratio} | {'yes' if r['psd_pays'] else 'no'} | {s['2']['drafter_utilisation']} |")
        pays = [r for r in sel if r["psd_pays"]]
        for key, what in (("best_shared_over_vllm_sd", "its drafter sped up by TP"),
                          ("best_shared_over_vllm_sd_drafter_1gpu_time", "its drafter at one-GPU time")):
            if tp == 1 and key.endswith("1gpu_time"):
                continue
            met = [r for r in sel if r[key] >= GOAL]
            lines += ["", f"Goal >= {GOAL}x colocated SD ({what}) per GPU: met in {len(met)} of {len(sel)} cells; "
                      f"where PSD pays ({len(pays)} cells) in {sum(1 for r in pays if r[key] >= GOAL)}."]
    if report["extrapolated"]:
        lines += ["", "Curves extrapolated in: " + ", ".join(report["extrapolated"]) + "."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(c, w) for c in CONTEXTS for w in WINDOWS]
    fig, axes = plt.subplots(len(LAYOUTS), len(panels), figsize=(18, 4 * len(LAYOUTS)), squeeze=False)
    for line, layout in zip(axes, LAYOUTS, strict=True):
        tp = layout.tp
        for ax, (context, window) in zip(line, panels, strict=True):
            sel = [r for r in rows if r["layout"] == layout.name and r["context"] == context
                   and (r["window"] or 0) == window]
            x = [r["concurrency_per_replica"] for r in sel]
            ax.plot(x, [r["ar"] for r in sel], "k:", label=f"ar ({tp})")
            ax.plot(x, [r["vllm_sd"] for r in sel], "r-o", label=f"vLLM colocated sd ({tp})")
            if tp > 1:
                ax.plot(x, [r["vllm_sd_drafter_1gpu_time"] for r in sel], "r--o", mfc="none",
                        label=f"vLLM colocated sd ({tp}), drafter at 1-GPU time")
            ax.plot(x, [r["psd_own_drafter"] for r in sel], "b-s", label=f"psd {tp}+1")
            for n, style in zip(REPLICAS, ("g--^", "g-.v", "g:d"), strict=True):
                ax.plot(x, [r["shared"][str(n)]["tokens_per_s_per_gpu"] for r in sel], style,
                        label=f"psd, {n} share 1")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{layout.name}\ncontext {context}, window {window or 'none'}", fontsize=9)
            ax.set_xlabel("requests per replica")
        line[0].set_ylabel("output tokens/s per GPU")
        line[0].legend(fontsize=6)
    fig.suptitle("Qwen3-32B on H200 curves, twin: a shared drafter GPU against a drafter per replica and colocated SD")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    # A parser, so that --help (or a stray argument) explains instead of running and overwriting the results.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-prefill", action="store_true",
                        help="price the target's prefill too (not in the committed set)")
    parser.add_argument("--out", type=Path, default=OUT, help="result folder (default: the committed set's)")
    args = parser.parse_args(argv)
    curves = load_curves(CURVES)
    price = prices(curves)
    rows = measure(curves, price, args.target_prefill)
    flags: set[str] = set()
    for layout in LAYOUTS:
        for window in WINDOWS:
            costs = StepCosts.from_curves(curves, TARGET, layout.drafter,
                                          hardware(layout, price, args.target_prefill,
                                                   drafter_window_tokens=window))
            for context in CONTEXTS:
                for n in REPLICAS:
                    flags |= costs.extrapolations(max(CONCURRENCIES) * n / 2, context + 256, (K,))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": COMMAND, "curves": "benchmarks/curves/h200-qwen3-32b.json",
              "assumptions": {"layouts": [{"name": lay.name, "tp": lay.tp, "drafter": lay.drafter} for lay in LAYOUTS],
                              "k": K, "acceptance_per_position": ACCEPTANCE,
                              "output_tokens_mean": Workload().output_tokens,
                              "prefill_ms_per_token": {key: round(value, 5) for key, value in price.items()},
                              "target_prefill": args.target_prefill,
                              "prefill": ("target: its price / TP per prompt token in the step taking it in; "
                                          if args.target_prefill else "target: not modelled; ")
                              + "drafters: their own price per catch-up token beyond the loop's first k + 1, "
                                "bounded by the window",
                              "window_sink_tokens": 4, "psd_pays": "psd TP+1 tokens/s per replica > ar's"},
              "extrapolated": sorted(flags), "rows": rows}
    (out / "shared-drafter.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "shared-drafter.md").write_text(markdown(report))
    plot(rows, out / "shared-drafter.png")
    log(f"wrote {out / 'shared-drafter.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
