"""The regime map: which way of decoding wins at which load, per replica and per GPU."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from minedraft.twin.sweep import BASELINE_FAMILIES, LoadResult, _family

COLOURS = {"ar": "#7f7f7f", "vllm-ar": "#8c564b", "sd": "#1f77b4", "psd": "#d62728", "psd-async": "#ff7f0e",
           "vllm-sd": "#2ca02c", "auto": "#000000"}
FAMILY_NAMES = {"vllm-ar": "plain vLLM (vllm-ar)", "psd-async": "psd, async steps"}


def regime_map(loads: Sequence[LoadResult], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = [load.concurrency for load in loads]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for ax, per_gpu, heading in ((axes[0], False, "output tokens/s per replica"),
                                 (axes[1], True, "output tokens/s per GPU")):
        present = {_family(label) for load in loads for label in load.runs}
        for family in [f for f in COLOURS if f in present]:
            best = []
            for load in loads:
                runs = [r for label, r in load.runs.items() if _family(label) == family]
                best.append(max((r.tokens_per_s_per_gpu if per_gpu else r.tokens_per_s) for r in runs)
                            if runs else float("nan"))
            ax.plot(concurrencies, best, marker="o", color=COLOURS[family],
                    label=FAMILY_NAMES.get(family, family) + ("" if family in ("ar", "vllm-ar") else " (best k)"))
        if all(load.auto is not None for load in loads):
            ax.plot(concurrencies, [(load.auto.tokens_per_s_per_gpu if per_gpu else load.auto.tokens_per_s)
                                    for load in loads if load.auto is not None],
                    color=COLOURS["auto"], linestyle="--", marker="x", label="auto")
        # Shade each load by the fixed mode that wins it (per replica: the engine's own modes or plain vLLM).
        for i, load in enumerate(loads):
            families = (*BASELINE_FAMILIES, "vllm-sd") if per_gpu else BASELINE_FAMILIES
            winner = load.best(families, per_gpu=per_gpu)
            low = concurrencies[i - 1] if i else concurrencies[i] / 1.5
            high = concurrencies[i + 1] if i + 1 < len(concurrencies) else concurrencies[i] * 1.5
            ax.axvspan((low * load.concurrency) ** 0.5, (load.concurrency * high) ** 0.5,
                       color=COLOURS[_family(winner.mode)], alpha=0.08)
            ax.annotate(winner.mode, (load.concurrency, 0), xytext=(0, 4), textcoords="offset points",
                        ha="center", fontsize=7, rotation=90, xycoords=("data", "axes fraction"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight per replica")
        ax.set_ylabel(heading)
        ax.set_title(heading + (" (shade: winner incl. vllm-sd)" if per_gpu else " (shade: winner, plain vLLM incl.)"),
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    ks = sorted({int(label.split("-k")[1]) for label in loads[0].runs if label.startswith("psd-k")})
    for k in ks:
        ratios = [load.runs[f"psd-k{k}"].tokens_per_s / load.runs[f"sd-k{k}"].tokens_per_s
                  for load in loads if f"psd-k{k}" in load.runs and f"sd-k{k}" in load.runs]
        ax.plot(concurrencies[: len(ratios)], ratios, marker="o", label=f"k={k}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight per replica")
    ax.set_ylabel("psd / sd throughput (same k, same concurrency)")
    ax.set_title("where PSD pays: above 1", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
