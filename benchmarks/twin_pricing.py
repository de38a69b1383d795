"""Dollars per million output tokens by deployment family, through the twin, with prefill and KV capacity priced:
plain vLLM, vLLM's colocated draft-model SD, and the engine with its drafter off the target's GPU (a drafter device
per replica, or one shared by several replicas), each at its best load within a latency target.

Writes benchmarks/results/gpu-twin/pricing.{json,md}. Usage (from the repository root):
    python benchmarks/twin_pricing.py            # ~10-20 minutes of pure Python on a contended 2-core machine
    python benchmarks/twin_pricing.py --quick    # two families, for a look

Inputs: the H200 curves (Qwen3-32B, Qwen3-0.6B/1.7B, bf16, CUDA graphs), acceptance 0.8 per position, 2.5 ms host
work per step (paid in series by the engine's synchronous steps, hidden by vLLM's and psd-async), prefill priced
per prompt token by the curves' roofline estimate, KV capacity from vLLM's accounting (0.9 of each GPU, 2 GiB runtime
reserve), the example price table. Other devices than the H200 (an H100 target, drafter devices) are roofline
estimates from the H200 measurements. Per family and mode, every load on a ladder up to the mode's KV capacity is run
at k 3 and 5; a load counts if its mean time per output token (requests running / tokens per second per replica,
Little's law: the same yardstick for every deployment, shared drafters included) is within the target; the cheapest
such point is the mode's figure.
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

from minedraft.twin.costs import AcceptanceModel, Hardware  # noqa: E402
from minedraft.twin.curves import load_curves  # noqa: E402
from minedraft.twin.deploy import DeploymentModel, deployment_model  # noqa: E402
from minedraft.twin.pricing import EXAMPLE_PRICES, Layout  # noqa: E402
from minedraft.twin.run import Workload, run_concurrency  # noqa: E402
from minedraft.twin.shared_drafter import run_shared  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
COMMAND = "python benchmarks/twin_pricing.py"
ACCEPTANCE = 0.8
KS = (3, 5)
LADDER = (4, 8, 16, 32, 64, 128, 192, 256)
OUTPUT_TOKENS = 256
HOST_MS = 2.5


@dataclass(frozen=True)
class Family:
    name: str
    target_device: str
    drafter: str
    prompt_tokens: int
    drafter_device: str
    # Replicas sharing one drafter device (1: a drafter device per replica).
    share: int = 1


FAMILIES = (
    Family("H200, 1k prompts, 1.7B drafter on its own H200", "H200", "qwen3-1.7b", 1024, "H200"),
    Family("H200, 1k prompts, 0.6B drafter on an RTX 4090", "H200", "qwen3-0.6b", 1024, "RTX 4090"),
    Family("H200, 4k prompts, 0.6B drafter on an RTX 4090", "H200", "qwen3-0.6b", 4096, "RTX 4090"),
    Family("H200, 4k prompts, 0.6B drafter, one L40S for 4 replicas", "H200", "qwen3-0.6b", 4096, "L40S", 4),
    Family("H100, 1k prompts, 0.6B drafter on an RTX 4090", "H100", "qwen3-0.6b", 1024, "RTX 4090"),
    Family("H100, 2k prompts, 0.6B drafter on an RTX 4090", "H100", "qwen3-0.6b", 2048, "RTX 4090"),
    Family("H100, 2k prompts, 0.6B drafter, one RTX 4090 for 2 replicas", "H100", "qwen3-0.6b", 2048, "RTX 4090", 2),
    Family("H100, 4k prompts, 0.6B drafter on an RTX 4090", "H100", "qwen3-0.6b", 4096, "RTX 4090"),
    Family("H100, 2k prompts, 0.6B drafter, one L40S for 4 replicas", "H100", "qwen3-0.6b", 2048, "L40S", 4),
    Family("H100, 1k prompts, 1.7B drafter, one L40S for 4 replicas", "H100", "qwen3-1.7b", 1024, "L40S", 4),
)
QUICK = (FAMILIES[1], FAMILIES[5])



def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def point(model: DeploymentModel, family: Family, mode: str, k: int, concurrency: int,
          acceptance: AcceptanceModel) -> dict[str, Any]:
    """One mode at one load: tokens/s per replica, mean time per output token, and what it costs."""
    workload = Workload(family.prompt_tokens, OUTPUT_TOKENS)
    engine = mode in ("sd", "psd", "psd-async")
    costs = model.engine_costs if engine else model.costs
    if engine and family.share > 1:
        shared = run_shared(costs, acceptance, k, family.share, concurrency, workload, warmup_steps=30,
                            measure_steps=120, mode="psd" if mode.startswith("psd") else "sd")
        per_replica = shared.result.tokens_per_s / family.share
    else:
        per_replica = run_concurrency(costs, acceptance, mode, k, concurrency, workload, warmup_steps=30,
                                      measure_steps=120, min_measure_tokens=4000).tokens_per_s
    label = mode if mode == "vllm-ar" else f"{mode}-k{k}"
    layout = model.layout(label)
    if engine and family.share > 1:
        layout = Layout(layout.target_device, layout.target_gpus, layout.drafter_device, 1.0 / family.share)
    devices = layout.devices(family.share if engine else 1)
    replicas = family.share if engine else 1
    usd = sum(n * EXAMPLE_PRICES.price(kind) for kind, n in devices.items())
    tokens = per_replica * replicas
    return {"mode": label, "concurrency": concurrency, "tokens_per_s_per_replica": round(per_replica, 1),
            "tpot_ms_mean": round(1000.0 * concurrency / per_replica, 2),
            "tokens_per_s_per_target_gpu": round(per_replica / layout.target_gpus, 1),
            "tokens_per_s_per_gpu": round(tokens / sum(devices.values()), 1),
            "usd_per_hour_per_replica": round(usd / replicas, 3),
            "usd_per_million_tokens": round(usd / (tokens * 3600.0) * 1e6, 4)}


def run_family(family: Family, slos_ms: tuple[float, ...], acceptance: AcceptanceModel) -> dict[str, Any]:
    curves = load_curves(CURVES)
    model = deployment_model(curves, "qwen3-32b", family.drafter, Hardware(step_overhead_ms=HOST_MS),
                             prompt_tokens=family.prompt_tokens, output_tokens=OUTPUT_TOKENS,
                             target_device=family.target_device, drafter_device=family.drafter_device)
    drafter_limit = model.drafter_device_limit()
    caps: dict[str, int] = {}
    points: list[dict[str, Any]] = []
    for mode in ("vllm-ar", "vllm-sd", "sd", "psd", "psd-async"):
        if family.share > 1 and mode == "psd-async":
            continue  # the shared-drafter twin runs synchronous steps only
        cap = model.max_concurrency(mode, max(KS) if mode != "vllm-ar" else 0) or 0
        if mode in ("sd", "psd", "psd-async") and drafter_limit is not None:
            cap = min(cap, drafter_limit // family.share)
        caps[mode] = cap
        loads = sorted({c for c in LADDER if c <= cap} | ({cap} if cap > 0 else set()))
        for k in (0,) if mode == "vllm-ar" else KS:
            for concurrency in loads:
                points.append(point(model, family, mode, k, concurrency, acceptance))
        log(f"{family.name}: {mode} (held {cap}) done")
    best: dict[str, dict[str, Any]] = {}
    for slo in slos_ms:
        by_family: dict[str, Any] = {}
        for mode in ("vllm-ar", "vllm-sd", "sd", "psd", "psd-async"):
            fits = [p for p in points if p["mode"].startswith(mode + "-k") or p["mode"] == mode]
            fits = [p for p in fits if p["mode"].split("-k")[0] == mode and p["tpot_ms_mean"] <= slo]
            by_family[mode] = min(fits, key=lambda p: p["usd_per_million_tokens"]) if fits else None
        engine = [p for m, p in by_family.items() if m in ("sd", "psd", "psd-async") and p]
        engine_best = min(engine, key=lambda p: p["usd_per_million_tokens"]) if engine else None

        def ratio(other: str, engine_best: dict[str, Any] | None = engine_best,
                  by_family: dict[str, Any] = by_family) -> float | None:
            if engine_best is None or by_family[other] is None:
                return None
            return round(by_family[other]["usd_per_million_tokens"] / engine_best["usd_per_million_tokens"], 3)

        best[str(slo)] = {"by_mode": by_family, "engine": engine_best,
                          "engine_vs_vllm_sd_per_dollar": ratio("vllm-sd"),
                          "engine_vs_vllm_ar_per_dollar": ratio("vllm-ar")}
    return {"family": family.name, "target_device": family.target_device, "drafter": family.drafter,
            "drafter_device": family.drafter_device, "replicas_per_drafter": family.share,
            "prompt_tokens": family.prompt_tokens, "max_concurrency": caps,
            "prefill_ms": None if model.prefill is None else round(model.prefill.ms, 1),
            "best_within_tpot_ms": best, "points": points}


def render(result: dict[str, Any]) -> str:
    lines = ["# Cost per token by deployment family (twin, prefill and KV capacity priced)", "",
             f"`{result['command']}`, {result['when']}. {result['inputs']}", ""]
    for slo in result["slos_ms"]:
        lines += [f"## Mean time per output token within {slo:g} ms", "",
                  "| family | held: vllm-sd / engine | vllm-ar $/M | vllm-sd $/M | engine best | engine $/M | "
                  "engine vs vllm-sd per $ | engine vs vllm-ar per $ |", "|---|---|---|---|---|---|---|---|"]
        for fam in result["families"]:
            b = fam["best_within_tpot_ms"][str(slo)]
            caps = fam["max_concurrency"]

            def usd(p: dict[str, Any] | None) -> str:
                return "-" if p is None else f"{p['usd_per_million_tokens']:.3f} ({p['mode']} @{p['concurrency']})"

            engine = b["engine"]
            lines.append(f"| {fam['family']} | {caps['vllm-sd']} / {caps['psd']} | {usd(b['by_mode']['vllm-ar'])} | "
                         f"{usd(b['by_mode']['vllm-sd'])} | {engine['mode'] if engine else '-'} | {usd(engine)} | "
                         f"{b['engine_vs_vllm_sd_per_dollar'] or '-'} | {b['engine_vs_vllm_ar_per_dollar'] or '-'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--families", help="comma-separated indices into FAMILIES (default: all)")
    parser.add_argument("--slo-ms", default="40,60", help="mean time per output token targets (ms)")
    parser.add_argument("--out", default=str(OUT / "pricing"))
    args = parser.parse_args()
    slos = tuple(float(v) for v in args.slo_ms.split(","))
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    chosen = (QUICK if args.quick else tuple(FAMILIES[int(i)] for i in args.families.split(",")) if args.families
              else FAMILIES)
    families = [run_family(f, slos, acceptance) for f in chosen]
    result = {"command": COMMAND + (" --quick" if args.quick else ""), "when": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime()),
              "inputs": (f"Qwen3-32B target, H200 curves, acceptance {ACCEPTANCE}, k {KS}, {HOST_MS} ms host work "
                         f"per step, {OUTPUT_TOKENS} output tokens, prefill and KV capacity priced, example prices "
                         f"({EXAMPLE_PRICES.source}); H100 and drafter devices: roofline estimates."),
              "slos_ms": slos, "families": families}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
