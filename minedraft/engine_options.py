"""The engine's command-line options, shared by every engine command (serve, run, generate, bench, doctor).

A module of its own so `minedraft.cli` and `minedraft.server.cli` both import it instead of each other.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from minedraft.engine.settings import (
    DEFAULT_HANG_SECONDS,
    DEFAULT_LOOKAHEAD_FANOUT,
    DRAFT_LENGTHS,
    DRAFTER_BACKENDS,
    DTYPES,
)

# Requests batched at once without --max-num-seqs.
DEFAULT_MAX_NUM_SEQS = 64
# `serve`'s mode without --mode: auto picks ar, sd, psd or lookahead and k from the costs it measures, so a replica
# is not left in a mode that loses at its load (psd k=3, the old default, was the slowest setting on the H200 curves
# below ~64 requests). The other engine commands (run, generate, bench, doctor) keep psd.
DEFAULT_SERVE_MODE = "auto"


def _pair_dir(value: str | None) -> Path:
    from minedraft.models.spec import default_pair_dir

    return Path(value) if value else default_pair_dir()


def ensure_pair(pair_dir: Path) -> Path:
    """The local pair, built on demand when neither the committed copy nor the cache has it."""
    from minedraft.models.spec import is_complete_pair

    if not is_complete_pair(pair_dir):
        from minedraft.models.build import build_pair

        print(f"building the local model pair into {pair_dir} (one time)", file=sys.stderr)
        build_pair(pair_dir)
    return pair_dir


def add_engine_arguments(parser: argparse.ArgumentParser, default_mode: str = "psd") -> None:
    parser.add_argument("--pair", help="local pair directory (default: the committed pair, else the cache)")
    parser.add_argument("--model", help="target model directory or id (default: the local pair's target)")
    parser.add_argument("--draft", help="draft model directory or id (default: the local pair's draft)")
    parser.add_argument("--mode", default=default_mode, help="psd | sd | ar | vllm-sd | auto | lookahead")
    parser.add_argument("--lookahead-fanout", type=int, default=DEFAULT_LOOKAHEAD_FANOUT,
                        help="lookahead: most branches (accepted length x bonus token) pre-drafted per request per "
                        "round; fewer when the drafter's measured time says they would outlast the verification")
    parser.add_argument("--no-lookahead-backups", action="store_true",
                        help="lookahead: a request no branch matched decodes without drafts for a step instead of "
                        "verifying the likeliest branch drafted for its accepted length")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=3, help="draft length k")
    parser.add_argument("--draft-length", choices=DRAFT_LENGTHS, default="fixed",
                        help="sd, psd (and auto's choices of them): fixed drafts and verifies k tokens per request; "
                        "adaptive gives each request its own length (0..k) from its acceptance and caps each step's "
                        "verify tokens at the measured verify curve's knee (steps not padded to k)")
    parser.add_argument("--num-extra-draft-tokens", type=int, default=0,
                        help="extra drafts e (top-C selection by cumulative draft log-probability)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"most requests batched at once (default {DEFAULT_MAX_NUM_SEQS}; with "
                        "--max-num-seqs-from-kv, given: the ceiling of the sized limit)")
    parser.add_argument("--max-num-seqs-from-kv", type=int, default=None, metavar="TOKENS",
                        help="size --max-num-seqs from the target GPU's KV pool at TOKENS per request (prompt + "
                        "output): with the drafter off the target's GPU the memory it would take is KV too (GPUs "
                        "with NVML; elsewhere --max-num-seqs stays)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest context in tokens (default: the model's own, capped by what the KV cache holds)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache size on CPUs (GiB)")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES),
                        help="target and drafter dtype (auto: the target's own on GPUs, bfloat16 for float32 "
                        "models; float32 on every CPU, where bf16 would break token-identical greedy output)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="target GPUs (tensor parallel; on CPUs, worker processes)")
    parser.add_argument("--target-gpus", help="comma-separated indices into the visible GPUs (CUDA_VISIBLE_DEVICES) "
                        "for the target (default: the first --tensor-parallel-size ones not the drafter's)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="share of each target GPU's memory vLLM may use (default: vLLM's)")
    parser.add_argument("--target-cores", help="comma-separated CPU cores for the target (default: first half)")
    parser.add_argument("--drafter-cores", help="comma-separated CPU cores for the drafter (default: the rest)")
    parser.add_argument("--drafter-gpu", type=int,
                        help="index into the visible GPUs for the drafter (default on GPU machines: the first one "
                        "after the target's)")
    parser.add_argument("--drafter-gpu-memory-utilization", type=float,
                        help="share of the drafter GPU's memory its vLLM may use (default: vLLM's)")
    parser.add_argument("--draft-deadline-seconds", type=float, default=5.0,
                        help="the longest a step waits for drafts before verifying without them (a cap: once step "
                        "times are measured the wait is a fraction of a step)")
    parser.add_argument("--drafter-hang-seconds", type=float, default=DEFAULT_HANG_SECONDS,
                        help="restart the drafter when it reports no progress this long with a job outstanding (a "
                        "slow drafter keeps reporting progress and is not restarted)")
    parser.add_argument("--drafter-catch-up-tokens", type=int, default=2048,
                        help="most tokens of catch-up (a new prompt, whole contexts after a drafter restart) one draft "
                        "job carries; the rest follows in later jobs while the request decodes without drafts")
    parser.add_argument("--drafter-backend", default="auto", choices=list(DRAFTER_BACKENDS),
                        help="auto: vllm on GPU machines, torch on CPUs; torch: plain-torch Llama/Qwen3 drafter with "
                        "a per-request KV cache (CPUs only); vllm: the draft model in vLLM (any architecture)")
    parser.add_argument("--drafter-address", metavar="HOST:PORT",
                        help="draft with a shared drafter service (`minedraft drafter`) instead of a drafter process "
                        "of this engine's own")
    parser.add_argument("--drafter-token-file",
                        help="file holding the token shared with the drafter service (required with "
                        "--drafter-address)")
    parser.add_argument("--drafter-window", type=int, default=0,
                        help="torch drafter: each draft step reads at most the last W tokens' KV plus a few "
                        "attention-sink tokens (0: the whole context)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="--FLAG[=VALUE]",
                        help="any other vLLM engine argument, checked by vLLM's own parser; repeat for more "
                        "(e.g. --vllm-arg=--enable-prefix-caching --vllm-arg=--max-num-batched-tokens=8192)")
    parser.add_argument("--async-psd-steps", action=argparse.BooleanOptionalAction, default=False,
                        help="psd (and auto while it runs psd): schedule each step while the target computes the "
                        "previous one (the two verify disjoint sub-batches: nothing speculative, no rollback), at any "
                        "tensor-parallel size; sd and ar run synchronous steps")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant numerics: greedy and seeded output token-identical whatever the load "
                        "and mode (GPUs: vLLM's batch-invariant mode, slower; CPUs: float32 only)")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (per-request seeds are separate)")
    parser.add_argument("--max-num-speculative-tokens", type=int,
                        help="the longest draft the engine can switch to at run time (auto mode's k range)")
    parser.add_argument("--auto-modes", help="the modes auto mode chooses among (comma-separated subset of ar, sd, "
                        "psd, lookahead; default all four)")
    parser.add_argument("--auto-k", help="the draft lengths auto mode chooses among (comma-separated; default 1 to "
                        "the engine's longest draft)")
    parser.add_argument("--constructed-acceptance", type=float,
                        help="use the cost-realistic constructed pair with this per-position acceptance "
                        "(built into the cache on first use; see `minedraft models build-constructed`)")


def _cores(value: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(c) for c in value.split(",")) if value else default


def constructed_pair(acceptance: float) -> Path:
    """The cost-realistic pair with the given acceptance, built into the cache on first use (about a minute)."""
    from minedraft.models.constructed import ConstructedRecipe, build_constructed_pair, constructed_pair_dir
    from minedraft.models.spec import cache_root, is_complete_pair

    if not 0.0 <= acceptance <= 1.0:
        from minedraft.engine.settings import SettingsError

        raise SettingsError("constructed_acceptance", f"must be within [0, 1], got {acceptance}")
    out = constructed_pair_dir(cache_root(), acceptance)
    if not is_complete_pair(out):
        print(f"building the constructed pair (acceptance {acceptance}) into {out} (one time)", file=sys.stderr)
        build_constructed_pair(out, ensure_pair(_pair_dir(None)) / "target", ConstructedRecipe(acceptance=acceptance))
    return out


def settings_from_args(args: argparse.Namespace) -> Any:
    from minedraft.engine.settings import (
        DrafterSettings,
        EngineSettings,
        Mode,
        SettingsError,
        default_core_split,
        parse_vllm_args,
    )

    if getattr(args, "constructed_acceptance", None) is not None:
        built = constructed_pair(args.constructed_acceptance)
        args.model, args.draft = args.model or str(built / "target"), args.draft or str(built / "draft")
    pair = None if (args.model and args.draft) else ensure_pair(_pair_dir(getattr(args, "pair", None)))
    target_default, drafter_default = default_core_split()
    mode = Mode.parse(args.mode)
    auto: dict[str, Any] = {}
    if getattr(args, "auto_modes", None):
        auto["allowed_modes"] = tuple(m.strip() for m in args.auto_modes.split(",") if m.strip())
    if getattr(args, "auto_k", None):
        try:
            auto["k_candidates"] = tuple(int(k) for k in args.auto_k.split(",") if k.strip())
        except ValueError:
            raise SettingsError("auto.k_candidates",
                                f"expected comma-separated integers, got {args.auto_k!r}") from None
    # The engine is built for the longest draft auto may switch to.
    max_k = args.max_num_speculative_tokens
    if auto.get("k_candidates") and not max_k:
        max_k = max(max(auto["k_candidates"]), args.num_speculative_tokens + args.num_extra_draft_tokens)
    settings = EngineSettings(
        model=args.model or str(pair / "target"),  # type: ignore[operator]
        drafter=DrafterSettings(
            model=args.draft or str(pair / "draft"),  # type: ignore[operator]
            cpu_cores=_cores(args.drafter_cores, drafter_default),
            gpu_index=args.drafter_gpu,
            deadline_seconds=args.draft_deadline_seconds,
            backend=args.drafter_backend,
            gpu_memory_utilization=args.drafter_gpu_memory_utilization,
            hang_seconds=args.drafter_hang_seconds,
            address=getattr(args, "drafter_address", None),
            token_file=getattr(args, "drafter_token_file", None),
            window=getattr(args, "drafter_window", 0) or 0,
            catch_up_tokens_per_job=args.drafter_catch_up_tokens,
        ),
        mode=mode,
        num_speculative_tokens=args.num_speculative_tokens,
        num_extra_draft_tokens=args.num_extra_draft_tokens,
        lookahead_fanout=getattr(args, "lookahead_fanout", DEFAULT_LOOKAHEAD_FANOUT),
        lookahead_backup_drafts=not getattr(args, "no_lookahead_backups", False),
        draft_length=getattr(args, "draft_length", "fixed"),
        max_num_seqs=DEFAULT_MAX_NUM_SEQS if args.max_num_seqs is None else args.max_num_seqs,
        max_model_len=args.max_model_len or 0,
        kv_cache_gib=args.kv_cache_gib,
        target_cpu_cores=_cores(args.target_cores, target_default),
        seed=args.seed,
        max_num_speculative_tokens=max_k,
        auto=auto,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        target_gpus=_indices("target_gpus", args.target_gpus),
        gpu_memory_utilization=args.gpu_memory_utilization,
        extra_vllm_args=parse_vllm_args(_split_vllm_args(args.vllm_arg)),
        async_psd_steps=bool(getattr(args, "async_psd_steps", False)),
        deterministic=bool(getattr(args, "deterministic", False)),
    )
    tokens = getattr(args, "max_num_seqs_from_kv", None)
    if tokens is not None:
        if tokens < 1:
            raise SettingsError("--max-num-seqs-from-kv", f"must be a positive number of tokens, got {tokens}")
        from minedraft.engine.batch_limit import CEILING, resize

        # A --max-num-seqs given with it caps the sized limit (the operator's maxNumSeqs: the drafter pool and the
        # autoscaler are sized from it); without one, only the engine's own ceiling does.
        settings = resize(settings, tokens, log=lambda line: print(line, file=sys.stderr, flush=True),
                          ceiling=CEILING if args.max_num_seqs is None else args.max_num_seqs)
    return settings


def _indices(field_name: str, value: str | None) -> tuple[int, ...]:
    from minedraft.engine.settings import SettingsError

    if not value:
        return ()
    try:
        return tuple(int(c) for c in value.split(",") if c.strip())
    except ValueError:
        raise SettingsError(field_name, f"expected comma-separated integers, got {value!r}") from None


def _split_vllm_args(values: list[str]) -> list[str]:
    """`--vllm-arg=--flag=value` and `--vllm-arg "--flag value"` both reach vLLM's parser as its own argv.

    Only a space before any `=` separates a flag from its value: after `--flag=` everything is the value, spaces
    included (JSON-valued flags such as `--hf-overrides={"rope_scaling": {...}}` pass through intact)."""
    argv: list[str] = []
    for value in values:
        space, equals = value.find(" "), value.find("=")
        separates = value.startswith("--") and space > 0 and (equals < 0 or space < equals)
        argv.extend([value[:space], value[space + 1:].lstrip(" ")] if separates else [value])
    return argv


