"""Benchmark reports people read: a Markdown table of ratios and figures, and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    if "runs" in report:
        return list(report["runs"])
    return [{"concurrency": report["config"]["concurrency"], "modes": report["modes"],
             "greedy_outputs_identical": report["greedy_outputs_identical"]}]


def crossovers(rates: dict[int, dict[str, float]]) -> dict[str, int | None]:
    """Where psd overtakes sd, and where speculation (the better of sd and psd) stops beating ar, by load.

    Each is the first load from which the condition holds at every higher load measured (or predicted).
    """
    loads = sorted(rates)

    def first_from(condition: Any) -> int | None:
        found: int | None = None
        for load in reversed(loads):
            if not condition(rates[load]):
                break
            found = load
        return found

    result: dict[str, int | None] = {}
    if all({"psd", "sd"} <= set(rates[c]) for c in loads):
        result["psd_overtakes_sd"] = first_from(lambda r: r["psd"] > r["sd"])
    if all({"psd", "sd", "ar"} <= set(rates[c]) for c in loads):
        result["speculation_stops_paying"] = first_from(lambda r: max(r["psd"], r["sd"]) < r["ar"])
    return result


def measured_rates(report: dict[str, Any]) -> dict[int, dict[str, float]]:
    return {int(r["concurrency"]): {m: v["output_tokens_per_s"] for m, v in r["modes"].items()}
            for r in _runs(report) if isinstance(r["concurrency"], int)}


def predicted_rates(report: dict[str, Any]) -> dict[int, dict[str, float]]:
    return {int(c): dict(v) for c, v in report.get("predicted_tokens_per_s", {}).items() if v}


def composed_trace_rates(report: dict[str, Any]) -> dict[str, float] | None:
    """Each mode's output tokens/s over the trace as composed from the concurrency levels of the same run (every
    phase's tokens at that mode's rate at the phase's concurrency), and "oracle": the best of ar, sd and psd in
    each phase, what a policy that always knew the best of the modes auto chooses among would reach, switching
    for free. None without a trace or when a phase's concurrency was not measured as a level.

    Transitions and the tails of phases are left out, so it bounds what switching can gain on the trace rather
    than predicting any run of it."""
    measured = measured_rates(report)
    trace = next((r for r in _runs(report) if not isinstance(r["concurrency"], int)), None)
    if trace is None:
        return None
    phases = [tuple(int(v) for v in part.split(":"))
              for part in str(trace["concurrency"]).removeprefix("trace ").split(",")]
    if any(concurrency not in measured for concurrency, _ in phases):
        return None
    fixed = [name for name in measured[phases[0][0]] if name != "auto"]
    own = [name for name in fixed if name in ("ar", "sd", "psd")]
    if not own or any(measured[c][name] <= 0 for c, _ in phases for name in fixed):
        return None
    # Every request of a phase yields the same number of tokens, so phases weigh by their request counts.
    seconds = {name: sum(count / measured[c][name] for c, count in phases) for name in fixed}
    seconds["oracle"] = sum(count / max(measured[c][name] for name in own) for c, count in phases)
    total = sum(count for _, count in phases)
    return {name: total / s for name, s in seconds.items()}


def switching_bound(rates: dict[int, dict[str, float]]) -> tuple[float, dict[int, float]] | None:
    """The most that switching among ar, sd and psd could gain over the best single fixed mode on any trace made of
    these loads, and the trace that gains it (share of output tokens at each load).

    A trace is a mix of loads; each mode's time per token over it is the mix of its times per token at each load,
    and switching's is the mix of the best of ar, sd and psd at each. The gain is the best single mode's time
    against switching's; maximising the smallest ratio over the mixes is a linear program (switching's time
    normalised to 1). When it is below a target, no trace over these loads reaches the target by choosing modes
    (draft lengths aside)."""
    from scipy.optimize import linprog

    loads = sorted(load for load, modes in rates.items() if {"ar", "sd", "psd"} <= set(modes))
    if not loads:
        return None
    fixed = [name for name in rates[loads[0]] if name != "auto" and all(rates[c].get(name, 0) > 0 for c in loads)]
    switching = [1 / max(rates[c][m] for m in ("ar", "sd", "psd")) for c in loads]
    # Variables: token weight per load, then the gain g. Maximise g subject to, for every single mode,
    # g <= its time per token over the mix (switching's time being 1).
    cost = [0.0] * len(loads) + [-1.0]
    upper = [[-1 / rates[c][name] for c in loads] + [1.0] for name in fixed]
    result = linprog(cost, A_ub=upper, b_ub=[0.0] * len(fixed), A_eq=[[*switching, 0.0]], b_eq=[1.0],
                     bounds=[(0, None)] * len(loads) + [(None, None)], method="highs")
    if not result.success:
        return None
    weights = result.x[:-1]
    total = float(sum(weights))
    return float(result.x[-1]), {c: float(w) / total for c, w in zip(loads, weights, strict=True) if w / total > 1e-6}


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
            cells = [name, f"{m['output_tokens_per_s']:.1f}", *ratios, f"{m['ttft_p50_s'] * 1000:.0f} ms",
                     f"{m['tpot_p50_s'] * 1000:.1f} ms", f"{m['tpot_p99_s'] * 1000:.1f} ms", f"{m['e2e_p50_s']:.2f} s",
                     f"{m['e2e_p99_s']:.2f} s", f"{m['acceptance_rate']:.2f}", f"{m['mean_accepted_length']:.2f}",
                     f"{m['overlap_fraction']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if "auto" in modes:
            fixed = {name: m["output_tokens_per_s"] for name, m in modes.items() if name != "auto"}
            if fixed:
                best = max(fixed, key=lambda name: fixed[name])
                ratio = modes["auto"]["output_tokens_per_s"] / fixed[best] if fixed[best] else 0.0
                shares = ", ".join(f"{name} {share:.0%}" for name, share in
                                   modes["auto"].get("output_token_share_by_mode", {}).items())
                # vllm-sd is vLLM's own engine, not a setting auto can switch to: the ratio against the best of
                # the modes it chooses among is reported too.
                own = {name: rate for name, rate in fixed.items() if name in ("ar", "sd", "psd")}
                own_best = max(own, key=lambda name: own[name]) if own else None
                own_text = (f", **{modes['auto']['output_tokens_per_s'] / own[own_best]:.2f}x** the best of the "
                            f"modes it chooses among ({own_best})" if own_best and own[own_best] else "")
                rounds = zip(modes["auto"].get("output_tokens_per_s_by_round", []),
                             modes[best].get("output_tokens_per_s_by_round", []), strict=False)
                by_round = ", ".join(f"{a / b:.2f}" for a, b in rounds if b)
                round_text = f" (by round: {by_round})" if by_round else ""
                lines.append(f"auto = **{ratio:.2f}x** the best fixed mode ({best}){round_text}{own_text}; its output "
                             f"tokens by mode: {shares}; switches: {modes['auto'].get('mode_switches', 0)}")
                lines.append("")
        if not isinstance(run["concurrency"], int):
            composed = composed_trace_rates(report)
            if composed:
                single = max((name for name in composed if name != "oracle"), key=lambda name: composed[name])
                lines.append(
                    f"Composed from the levels of this run (each phase at the level's rate, transitions left out): "
                    f"best single fixed mode {single} {composed[single]:.1f} tok/s; the best of ar, sd and psd in "
                    f"each phase, switching for free, {composed['oracle']:.1f} tok/s = "
                    f"**{composed['oracle'] / composed[single]:.2f}x**: the most that choosing a mode per phase can "
                    f"gain on this trace.")
                lines.append("")
    measured, predicted = measured_rates(report), predicted_rates(report)
    if len(measured) > 1:
        lines.append("## Crossovers (concurrency)")
        lines.append("")
        lines.append("| crossover | measured | predicted by the cost model |")
        lines.append("|---|---|---|")
        measured_x, predicted_x = crossovers(measured), crossovers(predicted) if predicted else {}
        for key in ("psd_overtakes_sd", "speculation_stops_paying"):
            if key in measured_x:
                lines.append(f"| {key.replace('_', ' ')} | {measured_x[key] or 'not within the range'} | "
                             f"{predicted_x.get(key) or 'not within the range'} |")
        lines.append("")
        bound = switching_bound(measured)
        if bound:
            gain, mix = bound
            shares = ", ".join(f"{share:.0%} at {load}" for load, share in sorted(mix.items()))
            lines.append(
                f"Switching among ar, sd and psd (k = {config['num_speculative_tokens']}) can gain at most "
                f"**{gain:.2f}x** over the best single fixed mode on any trace over these levels, as measured here "
                f"(the trace that gains it, by output tokens: {shares}).")
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = report["config"]
    measured = measured_rates(report)
    runs = [r for r in _runs(report) if isinstance(r["concurrency"], int)]
    traces = [r for r in _runs(report) if not isinstance(r["concurrency"], int)]
    panels = 2 + bool(traces)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    mode_names = list((runs or traces)[0]["modes"])
    colors = {name: f"C{i}" for i, name in enumerate(mode_names)}
    if len(runs) > 1:
        loads = sorted(measured)
        for name in mode_names:
            axes[0].plot(loads, [measured[c][name] for c in loads], "o-", color=colors[name], label=name)
            axes[1].plot(loads, [next(r for r in runs if r["concurrency"] == c)["modes"][name]["tpot_p50_s"] * 1000
                                 for c in loads], "o-", color=colors[name], label=name)
        predicted = predicted_rates(report)
        if predicted:
            grid = sorted(predicted)
            for name in ("ar", "sd", "psd"):
                if name in colors and all(name in predicted[c] for c in grid):
                    axes[0].plot(grid, [predicted[c][name] for c in grid], "--", color=colors[name], alpha=0.6,
                                 label=f"{name} (cost model)")
            predicted_x = crossovers(predicted)
            for key, style in (("psd_overtakes_sd", ":"), ("speculation_stops_paying", "-.")):
                if predicted_x.get(key):
                    axes[0].axvline(predicted_x[key], color="grey", linestyle=style, alpha=0.7,
                                    label=f"predicted: {key.replace('_', ' ')}")
        for ax in axes[:2]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(loads, [str(c) for c in loads])
            ax.set_xlabel("concurrency (requests in flight, all modes)")
        axes[0].set_ylabel("output tokens/s")
        axes[0].set_title("Throughput (dashed: cost-model prediction)")
        axes[1].set_ylabel("ms")
        axes[1].set_title("Time per output token p50")
    else:
        width = 0.8 / max(1, len(mode_names))
        for i, name in enumerate(mode_names):
            xs = [j + i * width for j in range(len(runs))]
            axes[0].bar(xs, [r["modes"][name]["output_tokens_per_s"] for r in runs], width, label=name)
            axes[1].bar(xs, [r["modes"][name]["tpot_p50_s"] * 1000 for r in runs], width, label=name)
        for ax, title, unit in ((axes[0], "Throughput", "output tokens/s"),
                                (axes[1], "Time per output token p50", "ms")):
            ax.set_xticks([j + width * (len(mode_names) - 1) / 2 for j in range(len(runs))],
                          [str(r["concurrency"]) for r in runs])
            ax.set_xlabel("concurrency (requests in flight, all modes)")
            ax.set_ylabel(unit)
            ax.set_title(title)
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    if traces:
        trace = traces[0]
        names = list(trace["modes"])
        axes[2].bar(names, [trace["modes"][n]["output_tokens_per_s"] for n in names],
                    color=[colors.get(n, "grey") for n in names])
        axes[2].set_ylabel("output tokens/s over the whole trace")
        axes[2].set_title(f"Load trace {trace['concurrency'].removeprefix('trace ')}", fontsize=9)
    title = f"{config.get('regime', '')}: k={config['num_speculative_tokens']}, {config['max_tokens']} tokens/request"
    if config.get("acceptance_source"):
        title += f", acceptance: {config['acceptance_source']}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
