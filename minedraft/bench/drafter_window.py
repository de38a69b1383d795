"""Acceptance of a context-bounded drafter (--drafter-window) against the whole-context drafter on long prompts.

    python -m minedraft.bench.drafter_window --out benchmarks/results/drafter/window

Greedy speculative decoding simulated exactly, without an engine: the target's greedy continuation of each prompt is
computed once (what any lossless speculative mode outputs at temperature 0), then each drafter variant drafts k
tokens from the committed context, the longest prefix matching the continuation is accepted, the target's own next
token is added (the bonus), and so on to the end. Acceptance = accepted / drafted tokens; the same prompts and
continuation for every variant. A window changes only what the drafter proposes, never the output.

Past the pair's own length (max_position_embeddings 2,048) both models are stretched the way a user stretches a
model's context in vLLM: the same `hf_overrides` dict (`--rope-scaling yarn:4`: YaRN RoPE scaling, factor 4, and
max_position_embeddings 4 x 2,048) applied to the target and the draft, whose torch drafter computes its rotary
tables as transformers does. Prompts are cut from long held-out standard-library files (`--text files`), all ending
at the same point of each file: every context length continues the same text and differs only in how much of what
precedes it the models see. Also recorded per context: the target's and the draft's top-1 accuracy on the prompt's
own last 256 tokens (whether the stretched models still read text at that length at all).

Also recorded: KV entries each draft step reads (the window's point: bounded, whatever the context) and the drafter's
cache bytes per slot. Drafter times on this CPU are shown but say little about a GPU, where the KV reads dominate at
long contexts.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_CONTEXTS = (256, 1024, 2048, 4096, 8064)
DEFAULT_WINDOWS = ("full", "512", "256", "64", "512/nosink", "256/nosink", "64/nosink")
DEFAULT_ROPE_SCALINGS = ("none", "yarn:4", "linear:4")
# Prompt tokens over which the models' own next-token accuracy is measured.
TAIL_TOKENS = 256


def _variant(name: str) -> tuple[int, int]:
    """"full" -> (0, 0); "256" -> (256, 4 sinks); "64/nosink" -> (64, 0)."""
    if name == "full":
        return 0, 0
    window, _, flag = name.partition("/")
    return int(window), 0 if flag == "nosink" else 4


def rope_overrides(spec: str, native_len: int) -> tuple[dict[str, Any] | None, int]:
    """"none" -> (None, native length); "yarn:4" / "linear:4" -> (the hf_overrides dict a user gives vLLM for both
    models, the stretched length)."""
    if spec == "none":
        return None, native_len
    kind, _, factor_text = spec.partition(":")
    if kind not in ("linear", "yarn") or not factor_text:
        raise SystemExit(f"--rope-scaling: expected none, linear:F or yarn:F, got {spec!r}")
    factor = float(factor_text)
    if factor <= 1:
        raise SystemExit(f"--rope-scaling: the factor must be above 1, got {spec!r}")
    stretched = int(native_len * factor)
    rope: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = native_len
    return {"rope_parameters": rope, "max_position_embeddings": stretched}, stretched


def _heldout_prompts(pair: Path, tokenizer: Any, length: int, count: int) -> list[list[int]]:
    """The pair's held-out snippets, concatenated, cut into `count` prompts (the earlier sets' text: unrelated
    800-character snippets end to end, so a long prompt is not one document)."""
    from minedraft.models.check import load_heldout

    stream: list[int] = []
    for snippet in load_heldout(pair):
        stream.extend(tokenizer.encode(snippet + "\n"))
    if len(stream) < length + count:
        raise SystemExit(f"held-out text has {len(stream)} tokens, fewer than a {length}-token prompt needs")
    stride = max(1, (len(stream) - length) // max(1, count))
    return [stream[i * stride: i * stride + length] for i in range(count)]


def long_documents(tokenizer: Any, min_tokens: int, count: int) -> list[tuple[str, list[int]]]:
    """`count` held-out standard-library files (never trained on) of at least `min_tokens` tokens, chosen by a fixed
    shuffle: (name, the first min_tokens tokens)."""
    from minedraft.models.corpus import split_stdlib, stdlib_root
    from minedraft.models.spec import RECIPE

    files = list(split_stdlib(RECIPE.heldout_modulus).heldout_files)
    random.Random(7).shuffle(files)
    root = stdlib_root()
    documents: list[tuple[str, list[int]]] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < min_tokens:  # (a token is at least one character)
            continue
        tokens = tokenizer.encode(text)
        if len(tokens) >= min_tokens:
            documents.append((path.relative_to(root).as_posix(), tokens[:min_tokens]))
        if len(documents) == count:
            return documents
    raise SystemExit(f"only {len(documents)} held-out standard-library files have {min_tokens} tokens; "
                     f"--prompts {count} needs {count}")


def _target_continuation(model: Any, prompt: list[int], num_tokens: int) -> tuple[list[int], float]:
    """The target's greedy continuation, one token at a time over its KV cache (HF generate's per-step overhead was
    ten times this on the shared machine), and its top-1 accuracy on the prompt's own last TAIL_TOKENS tokens."""
    import torch

    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        accuracy = _tail_accuracy(out.logits[0], prompt)
        for _ in range(num_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, accuracy


def _tail_accuracy(logits: Any, prompt: list[int]) -> float:
    import torch

    tail = min(TAIL_TOKENS, len(prompt) - 1)
    predicted = logits[len(prompt) - 1 - tail: len(prompt) - 1].argmax(dim=-1)
    return float((predicted == torch.tensor(prompt[len(prompt) - tail:])).float().mean())


def _draft_tail_accuracy(model: Any, prompt: list[int]) -> float:
    import torch

    with torch.no_grad():
        return _tail_accuracy(model(input_ids=torch.tensor([prompt])).logits[0], prompt)


def simulate(drafter: Any, prompts: list[list[int]], continuations: list[list[int]], k: int
             ) -> dict[str, float]:
    """Greedy SD over all prompts at once (one batched draft job per round, as an engine's sub-batch)."""
    done = [0] * len(prompts)
    drafted = accepted = rounds = verifications = 0
    seconds = 0.0
    while True:
        live = [i for i in range(len(prompts)) if done[i] < len(continuations[i]) - 1]
        if not live:
            break
        items = []
        for i in live:
            room = len(continuations[i]) - done[i] - 1
            items.append((f"p{i}", prompts[i] + continuations[i][:done[i]], min(k, room)))
        started = time.perf_counter()
        drafts = drafter.draft(items, want_logprobs=False)
        seconds += time.perf_counter() - started
        rounds += 1
        for i, (tokens, _) in zip(live, drafts, strict=True):
            truth = continuations[i][done[i]:]
            n = 0
            while n < len(tokens) and tokens[n] == truth[n]:
                n += 1
            drafted += len(tokens)
            accepted += n
            verifications += 1
            done[i] += n + 1  # the accepted drafts and the target's own next token
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            # Tokens per request per verification (accepted drafts + the target's own).
            "mean_accepted_length": 1.0 + accepted / verifications if verifications else 1.0,
            "draft_jobs": rounds, "draft_seconds_per_job": seconds / rounds if rounds else 0.0}


def _load(path: Path, overrides: dict[str, Any] | None) -> Any:
    from transformers import AutoConfig, LlamaForCausalLM

    from minedraft.engine.drafter.torch_backend import apply_config_overrides

    config = apply_config_overrides(AutoConfig.from_pretrained(str(path)), overrides)
    return LlamaForCausalLM.from_pretrained(str(path), config=config).eval()


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter
    from minedraft.engine.drafter.torch_window import WindowedTorchDrafter
    from minedraft.models.spec import default_pair_dir

    torch.manual_seed(0)
    # One thread: the figures are acceptance (independent of threads); times are only indicative on a CPU.
    torch.set_num_threads(1)
    pair = Path(args.pair) if args.pair else default_pair_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(pair / "target"))
    native_len = int(AutoConfig.from_pretrained(str(pair / "target")).max_position_embeddings)
    documents: list[tuple[str, list[int]]] = []
    if args.text == "files":
        # Every prompt ends at the same point of its file, whatever its length.
        documents = long_documents(tokenizer, max(args.contexts), args.prompts)
    rows: list[dict[str, Any]] = []
    contexts_rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for scaling in args.rope_scaling:
        overrides, max_len = rope_overrides(scaling, native_len)
        target, draft = _load(pair / "target", overrides), _load(pair / "draft", overrides)
        for context in args.contexts:
            if context + args.max_tokens > max_len:
                skipped.append(f"{context} tokens with rope scaling {scaling} (past {max_len} positions)")
                print(f"rope {scaling}, context {context}: past the {max_len} positions, skipped", file=sys.stderr,
                      flush=True)
                continue
            prompts = ([tokens[len(tokens) - context:] for _, tokens in documents] if documents
                       else _heldout_prompts(pair, tokenizer, context, args.prompts))
            print(f"rope {scaling}, context {context}: target continuations of {len(prompts)} prompts",
                  file=sys.stderr, flush=True)
            followed = [_target_continuation(target, p, args.max_tokens) for p in prompts]
            continuations = [tokens for tokens, _ in followed]
            contexts_rows.append({
                "rope_scaling": scaling, "context": context,
                "target_tail_top1": sum(a for _, a in followed) / len(followed),
                "draft_tail_top1": sum(_draft_tail_accuracy(draft, p) for p in prompts) / len(prompts),
                "distinct_continuation_tokens": sum(len(set(c)) for c in continuations) / len(continuations),
            })
            for name in args.windows:
                window, sinks = _variant(name)
                slots = len(prompts) + 2
                if window:
                    drafter: Any = WindowedTorchDrafter(str(pair / "draft"), max_slots=slots, max_model_len=max_len,
                                                        window=window, num_sink_tokens=sinks,
                                                        config_overrides=overrides)
                    cache_bytes = drafter.cache_bytes // slots
                else:
                    drafter = TorchLlamaDrafter(str(pair / "draft"), max_slots=slots, max_model_len=max_len,
                                                config_overrides=overrides)
                    cache_bytes = sum(c.numel() * c.element_size()
                                      for c in (*drafter.k_cache, *drafter.v_cache)) // slots
                result = simulate(drafter, prompts, continuations, args.k)
                keys_read = min(context + args.max_tokens, sinks + window) if window else context + args.max_tokens
                rows.append({"rope_scaling": scaling, "context": context, "variant": name, "window": window,
                             "sink_tokens": sinks, "max_kv_entries_read_per_step": keys_read,
                             "cache_bytes_per_slot": cache_bytes, **result})
                print(f"  {name:>10}: acceptance {result['acceptance_rate']:.3f}", file=sys.stderr, flush=True)
                del drafter
    return {
        "benchmark": "drafter-window",
        "config": {"command": command, "contexts": list(args.contexts), "windows": list(args.windows),
                   "rope_scalings": list(args.rope_scaling),
                   "rope_overrides": {s: rope_overrides(s, native_len)[0] for s in args.rope_scaling},
                   "skipped": skipped, "text": args.text, "documents": [name for name, _ in documents],
                   "prompts_per_context": args.prompts, "generated_tokens": args.max_tokens, "k": args.k,
                   "tail_tokens": TAIL_TOKENS,
                   "pair": pair.name, "pair_max_position_embeddings": native_len,
                   "pair_training_sequence_length": _training_length(pair),
                   "machine": f"{platform.machine()} CPU (1 thread), torch {torch.__version__}"},
        "contexts": contexts_rows,
        "rows": rows,
    }


def _training_length(pair: Path) -> int | None:
    build = pair / "build.json"
    if not build.exists():
        return None
    return json.loads(build.read_text()).get("recipe", {}).get("sequence_length")


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]
    text = ("long held-out standard-library files (" + ", ".join(config["documents"]) + "), every prompt ending at "
            "the same point of its file" if config["text"] == "files" else "the pair's held-out snippets")
    lines = [
        "# Drafter window: acceptance with and without a context bound",
        "",
        f"`{config['command']}` on a {config['machine']}. Local pair `{config['pair']}` (max_position_embeddings "
        f"{config['pair_max_position_embeddings']}, trained on {config['pair_training_sequence_length']}-token "
        f"sequences); {config['prompts_per_context']} prompts per context length from {text}; "
        f"{config['generated_tokens']} tokens generated, k={config['k']}, greedy. Window W with 4 attention-sink "
        "tokens unless `nosink`; `full`: the whole context. Outputs are the target's whatever the drafter proposes.",
        "",
        "RoPE scaling (the same `hf_overrides` for the target and the draft, as a user stretches a vLLM model):",
        "",
    ]
    for scaling, overrides in config["rope_overrides"].items():
        lines.append(f"- `{scaling}`: " + (f"`{json.dumps(overrides)}`" if overrides else "the pair as trained"))
    if config["skipped"]:
        lines.append("- not measured (past the positions the scaling allows): " + "; ".join(config["skipped"]))
    lines += [
        "",
        "## Acceptance rate",
        "",
        "| rope | context | " + " | ".join(config["windows"]) + " |",
        "|---|---|" + "---|" * len(config["windows"]),
    ]
    by_key = {(r["rope_scaling"], r["context"], r["variant"]): r for r in results["rows"]}
    for c in results["contexts"]:
        cells = [f"{by_key[(c['rope_scaling'], c['context'], v)]['acceptance_rate']:.3f}" for v in config["windows"]]
        lines.append(f"| {c['rope_scaling']} | {c['context']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Do the models still read text at that length? (top-1 accuracy on each prompt's last "
        f"{config['tail_tokens']} tokens)",
        "",
        "| rope | context | target top-1 | draft top-1 | distinct tokens in the target's continuation |",
        "|---|---|---|---|---|",
    ]
    for c in results["contexts"]:
        lines.append(f"| {c['rope_scaling']} | {c['context']} | {c['target_tail_top1']:.3f} | "
                     f"{c['draft_tail_top1']:.3f} | {c['distinct_continuation_tokens']:.0f} of "
                     f"{config['generated_tokens']} |")
    lines += [
        "",
        "## Every run",
        "",
        "| rope | context | drafter | acceptance | mean accepted length | KV entries read per step (max) | cache per "
        "slot (KiB) | draft ms/job (CPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(f"| {r['rope_scaling']} | {r['context']} | {r['variant']} | {r['acceptance_rate']:.3f} | "
                     f"{r['mean_accepted_length']:.2f} | {r['max_kv_entries_read_per_step']} | "
                     f"{r['cache_bytes_per_slot'] / 1024:.0f} | {r['draft_seconds_per_job'] * 1000:.1f} |")
    lines += [
        "",
        "Reading it: the drafter's memory and per-step KV reads are bounded by the window (the cache column; the "
        "dense drafter's cache is sized by the longest context). Acceptance is what a window may cost. This pair was "
        f"trained on {config['pair_training_sequence_length']}-token sequences and never saw a stretched RoPE: past "
        "its training length the whole-context drafter attends over distances it never learned, which a window "
        "avoids, and the stretched rows measure models used far outside what they were trained for (the top-1 "
        "table says how far they still read the text). The rows show what a window does to *this* pair's "
        "agreement at these lengths; what it costs a drafter trained on long contexts needs such a pair.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalings = results["config"]["rope_scalings"]
    fig, axes = plt.subplots(1, len(scalings), figsize=(6 * len(scalings), 4), sharey=True, squeeze=False)
    for ax, scaling in zip(axes[0], scalings, strict=True):
        for variant in results["config"]["windows"]:
            rows = [r for r in results["rows"] if r["variant"] == variant and r["rope_scaling"] == scaling]
            ax.plot([r["context"] for r in rows], [r["acceptance_rate"] for r in rows], marker="o", label=variant,
                    linestyle="--" if variant.endswith("/nosink") else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_title(f"rope scaling: {scaling}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"acceptance rate (k={results['config']['k']})")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("Drafter window vs whole context (local pair)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="result path without suffix (.json, .md, .png)")
    parser.add_argument("--pair", help="pair directory (default: the committed local pair)")
    parser.add_argument("--contexts", type=lambda v: [int(c) for c in v.split(",")], default=list(DEFAULT_CONTEXTS))
    parser.add_argument("--windows", type=lambda v: v.split(","), default=list(DEFAULT_WINDOWS),
                        help="variants: full, W, W/nosink")
    parser.add_argument("--rope-scaling", type=lambda v: v.split(","), default=list(DEFAULT_ROPE_SCALINGS),
                        help="none, linear:F, yarn:F (comma-separated; contexts past a scaling's length are skipped)")
    parser.add_argument("--text", choices=("files", "heldout"), default="files",
                        help="prompts from long held-out stdlib files, or the pair's held-out snippets")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=3)
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = "python -m minedraft.bench.drafter_window " + " ".join(shlex.quote(a) for a in given)
    results = run(args, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    args.out.with_suffix(".md").write_text(table)
    plot(results, args.out.with_suffix(".png"))
    print(table, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
