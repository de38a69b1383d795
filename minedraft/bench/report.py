"""Benchmark reports people read: a Markdown table of ratios and figures, and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    if "runs" in report:
        return list(report["runs"])
    return [{"concurrency": report["config"]["concurrency"], "modes": report["modes"],
             "greedy_outputs_identical": report["greedy_outputs_identical"]}]


def markdown_table(report: dict[str, Any]) -> str:
    config = report["config"]
    lines = [
        f"# Benchmark: {', '.join(config['modes'])}",
        "",
        f"- target `{config['target_model']}`, draft `{config['draft_model']}`",
        f"- prompts {config['num_prompts']}, max tokens {config['max_tokens']} (ignore EOS), greedy, "
        f"k = {config['num_speculative_tokens']}, extra drafts e = {config['num_extra_draft_tokens']}, "
        f"rounds {config['rounds']} (modes interleaved)",
        f"- cores: target {config['target_cpu_cores']}, drafter {config['drafter_cpu_cores']} (psd, sd); "
        f"ar and vllm-sd on {config['baseline_cpu_cores']}",
    ]
    for key in ("regime", "acceptance_source", "command"):
        if key in config:
            lines.append(f"- {key.replace('_', ' ')}: {config[key]}")
    lines.append("")
    for run in _runs(report):
        modes = run["modes"]
        lines.append(f"## Concurrency {run['concurrency']} "
                     f"(greedy outputs identical across modes: {run['greedy_outputs_identical']})")
        lines.append("")
        ratio_base = [m for m in ("sd", "vllm-sd", "ar") if m in modes]
        header = ["mode", "tok/s", *[f"vs {b}" for b in ratio_base], "TTFT p50", "TPOT p50", "TPOT p99",
                  "E2E p50", "E2E p99", "accept", "acc. len", "overlap"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for name, m in modes.items():
            ratios = [f"{m['output_tokens_per_s'] / modes[b]['output_tokens_per_s']:.2f}x"
                      if modes[b]["output_tokens_per_s"] else "-" for b in ratio_base]
            lines.append(
                f"| {name} | {m['output_tokens_per_s']:.1f} | " + " | ".join(ratios) + " | "
                f"{m['ttft_p50_s'] * 1000:.0f} ms | {m['tpot_p50_s'] * 1000:.1f} ms | "
                f"{m['tpot_p99_s'] * 1000:.1f} ms | {m['e2e_p50_s']:.2f} s | {m['e2e_p99_s']:.2f} s | "
                f"{m['acceptance_rate']:.2f} | {m['mean_accepted_length']:.2f} | {m['overlap_fraction']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(report)
    mode_names = list(runs[0]["modes"])
    concurrencies = [str(r["concurrency"]) for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(mode_names))
    for i, name in enumerate(mode_names):
        xs = [j + i * width for j in range(len(runs))]
        axes[0].bar(xs, [r["modes"][name]["output_tokens_per_s"] for r in runs], width, label=name)
        axes[1].bar(xs, [r["modes"][name]["tpot_p50_s"] * 1000 for r in runs], width, label=name)
    for ax, title, unit in ((axes[0], "Throughput", "output tokens/s"), (axes[1], "Time per output token p50",
                                                                          "ms")):
        ax.set_xticks([j + width * (len(mode_names) - 1) / 2 for j in range(len(runs))], concurrencies)
        ax.set_xlabel("concurrency (requests in flight, all modes)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend()
    config = report["config"]
    fig.suptitle(f"k={config['num_speculative_tokens']}, {config['max_tokens']} tokens/request, "
                 f"{config['num_prompts']} prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
