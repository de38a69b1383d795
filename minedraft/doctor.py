"""`minedraft doctor`: what a user runs on a node before deploying. Does this pair run here, and does PSD pay?

Checks, in order, each reported even when a later one fails: devices (which GPUs the target and the drafter get),
dtype, memory for both models (weights and KV cache per token, from the configs, against what the devices have),
vocabulary (the draft's token ids are the target's), then loads the pair once and runs ar, sd and psd (at each k)
for a fixed time at three loads, printing tokens/s, acceptance and overlap, and a verdict: at which loads PSD beats
both sd and ar, and with which k. `--json` prints the same report as one JSON object on stdout (logs on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

BYTES_PER_DTYPE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelSize:
    """Parameter count and KV cache bytes per token, from a Hugging Face config (arithmetic, no weights read)."""

    parameters: int
    kv_bytes_per_token_per_dtype_byte: int  # multiply by the dtype's bytes

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.parameters * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.kv_bytes_per_token_per_dtype_byte * dtype_bytes


def model_size(config: Any) -> ModelSize:
    """Decoder-only Llama/Qwen3-style: embeddings (+ untied LM head), attention with GQA, gated MLP, norms."""
    c = getattr(config, "text_config", None) or config
    hidden, layers, vocab = int(c.hidden_size), int(c.num_hidden_layers), int(c.vocab_size)
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    intermediate = int(c.intermediate_size)
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    if getattr(c, "attention_bias", False):
        attention += heads * head_dim + 2 * kv_heads * head_dim
    qk_norm = 2 * head_dim if getattr(c, "model_type", "") == "qwen3" else 0
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden + qk_norm
    embeddings = vocab * hidden * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return ModelSize(parameters=embeddings + layers * per_layer + hidden,
                     kv_bytes_per_token_per_dtype_byte=2 * layers * kv_heads * head_dim)


def _dtype_bytes(dtype: str, config: Any) -> int:
    if dtype in BYTES_PER_DTYPE:
        return BYTES_PER_DTYPE[dtype]
    own = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    return BYTES_PER_DTYPE.get(own.replace("torch.", ""), 4)


def dtype_note(requested: str, effective: str, device: Any) -> str:
    """Why the engine loads in `effective` (placement.resolve_dtype decided it), in the doctor's words. Pure."""
    if requested != "auto":
        return "as chosen"
    if device.has_gpu:
        return "the target's own dtype (float32 models in bfloat16)"
    fast = "this CPU has fast bfloat16, but " if device.cpu_fast_bf16 else ""
    return (f"float32 on CPUs: {fast}bf16 greedy output would depend on batch composition and stop being "
            "token-identical to the target alone (--dtype bfloat16 to choose it)")


def _gpu_memory_bytes(visible: tuple[str, ...]) -> list[int] | None:
    """Total memory per visible GPU through NVML (CUDA stays uninitialised); None when NVML is not there."""
    if not visible:
        return None
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByUUID(d) if d.startswith("GPU-") else
                   pynvml.nvmlDeviceGetHandleByIndex(int(d)) for d in visible]
        return [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
    except Exception:  # a report line, not a failure: memory is then not checked
        return None


def static_checks(settings: Any) -> tuple[dict[str, Any], Any]:
    """Devices, dtype, memory and vocabulary, without loading a model. Returns (report, resolved settings)."""
    from transformers import AutoConfig

    from minedraft.engine.placement import check_model_pair, detect_device, plan_devices, resolved_settings
    from minedraft.engine.settings import SettingsError

    report: dict[str, Any] = {"checks": {}}
    checks = report["checks"]
    device = detect_device()
    requested_dtype = settings.dtype
    settings = resolved_settings(settings, device)
    checks["devices"] = {"visible_gpus": list(device.visible_gpus), "cpu_fast_bf16": device.cpu_fast_bf16,
                         "cpu_cores": sorted(os.sched_getaffinity(0))}
    try:
        plan = plan_devices(settings, device)
        checks["devices"].update(ok=True, target=plan.target_visible_devices or "cpu",
                                 drafter=plan.drafter_visible_devices or "cpu",
                                 drafter_backend=settings.drafter.backend,
                                 tensor_parallel_size=settings.tensor_parallel_size)
    except SettingsError as exc:
        checks["devices"].update(ok=False, error=str(exc))
    checks["dtype"] = {"ok": True, "dtype": settings.dtype, "requested": requested_dtype,
                       "note": dtype_note(requested_dtype, settings.dtype, device)}
    memory: dict[str, Any] = {"ok": True}
    per_gpu = _gpu_memory_bytes(device.visible_gpus)
    for role, path in (("target", settings.model), ("draft", settings.drafter.model)):
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as exc:
            memory.update(ok=False, error=f"{role}: cannot read config: {exc}")
            continue
        size = model_size(config)
        dtype_bytes = _dtype_bytes(settings.dtype, config)
        shards = settings.tensor_parallel_size if role == "target" else 1
        memory[role] = {"parameters": size.parameters, "dtype_bytes": dtype_bytes,
                        "weights_gib": round(size.weight_bytes(dtype_bytes) / 2**30, 3),
                        "weights_gib_per_device": round(size.weight_bytes(dtype_bytes) / shards / 2**30, 3),
                        "kv_cache_kib_per_token": round(size.kv_bytes_per_token(dtype_bytes) / 1024, 2)}
        if per_gpu:
            smallest = min(per_gpu)
            memory[role]["device_gib"] = round(smallest / 2**30, 1)
            if size.weight_bytes(dtype_bytes) / shards > 0.9 * smallest:
                memory.update(ok=False, error=f"{role}: weights do not fit one device with room for a KV cache")
    checks["memory"] = memory
    try:
        checks["vocabulary"] = {"ok": True, **check_model_pair(settings.model, settings.drafter.model,
                                                               settings.drafter.backend)}
    except SettingsError as exc:
        checks["vocabulary"] = {"ok": False, "error": str(exc)}
    return report, settings


def measure(engine: Any, mode: Any, k: int, concurrency: int, seconds: float, prompts: list[list[int]],
            max_tokens: int) -> dict[str, Any]:
    """Closed loop: `concurrency` requests in flight for `seconds`, then drain; output tokens/s over the whole run."""
    from minedraft.engine.requests import SamplingSettings
    from minedraft.engine.settings import Mode

    engine.set_mode(mode, None if mode is Mode.AR else k, 0)
    if mode is not Mode.AR:
        engine.wait_for_drafter(300)
    sampling = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)
    before = engine.totals()
    started = time.perf_counter()
    in_flight: set[str] = set()
    issued = tokens = 0
    while True:
        running = time.perf_counter() - started < seconds
        while running and len(in_flight) < concurrency:
            request_id = f"doctor-{mode.value}-{k}-{concurrency}-{issued}"
            engine.add_request(request_id, prompts[issued % len(prompts)], sampling)
            in_flight.add(request_id)
            issued += 1
        if not in_flight:
            break
        for delta in engine.step():
            tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                in_flight.discard(delta.request_id)
    elapsed = time.perf_counter() - started
    totals = engine.totals() - before
    return {"mode": mode.value, "k": 0 if mode is Mode.AR else k, "concurrency": concurrency,
            "requests": issued, "output_tokens": tokens, "seconds": round(elapsed, 3),
            "tokens_per_second": round(tokens / elapsed, 2) if elapsed else 0.0,
            "acceptance_rate": round(totals.acceptance_rate, 4),
            "mean_accepted_length": round(totals.mean_accepted_length, 3),
            "overlap_fraction": round(totals.overlap_fraction, 4)}


def verdict(runs: list[dict[str, Any]], margin: float = 0.02) -> dict[str, Any]:
    """Per load: the best psd (over k) against the best sd and ar. PSD pays where it beats both by `margin`. Pure."""
    per_load: list[dict[str, Any]] = []
    for concurrency in sorted({r["concurrency"] for r in runs}):
        at = [r for r in runs if r["concurrency"] == concurrency]
        best = {m: max((r for r in at if r["mode"] == m), key=lambda r: r["tokens_per_second"], default=None)
                for m in ("ar", "sd", "psd")}
        psd = best["psd"]
        rivals = [r for m, r in best.items() if m != "psd" and r is not None]
        pays = psd is not None and all(psd["tokens_per_second"] > r["tokens_per_second"] * (1 + margin)
                                       for r in rivals)
        winner = max((r for r in best.values() if r is not None), key=lambda r: r["tokens_per_second"])
        per_load.append({
            "concurrency": concurrency, "psd_pays": pays, "best": f"{winner['mode']} k={winner['k']}",
            "psd_k": psd["k"] if psd else None,
            "psd_vs_sd": round(psd["tokens_per_second"] / best["sd"]["tokens_per_second"], 3)
            if psd and best["sd"] and best["sd"]["tokens_per_second"] else None,
            "psd_vs_ar": round(psd["tokens_per_second"] / best["ar"]["tokens_per_second"], 3)
            if psd and best["ar"] and best["ar"]["tokens_per_second"] else None,
        })
    paying = [p for p in per_load if p["psd_pays"]]
    if paying:
        summary = "PSD pays here at " + ", ".join(f"{p['concurrency']} requests (k={p['psd_k']}, "
                                                  f"{p['psd_vs_sd']}x sd, {p['psd_vs_ar']}x ar)" for p in paying)
    else:
        summary = "PSD does not pay here at the measured loads; best: " + ", ".join(
            f"{p['best']} at {p['concurrency']}" for p in per_load)
    return {"psd_pays": bool(paying), "summary": summary, "per_load": per_load}


def run_doctor(settings: Any, loads: list[int], ks: list[int], seconds: float, max_tokens: int,
               prompts_text: list[str]) -> dict[str, Any]:
    from minedraft.engine.core import Engine
    from minedraft.engine.settings import Mode

    report, settings = static_checks(settings)
    failed = [name for name, check in report["checks"].items() if not check.get("ok", True)]
    if failed:
        report.update(ok=False, verdict={"psd_pays": False, "summary": f"checks failed: {', '.join(failed)}"})
        return report
    settings = settings.with_changes(mode=Mode.PSD, num_speculative_tokens=min(ks),
                                     max_num_speculative_tokens=max(ks), max_num_seqs=max(settings.max_num_seqs,
                                                                                          max(loads)))
    started = time.perf_counter()
    engine = Engine(settings)
    try:
        ready = engine.wait_for_drafter(settings.drafter.startup_timeout_seconds)
        report["checks"]["load"] = {"ok": ready, "seconds": round(time.perf_counter() - started, 1),
                                    "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size}
        if not ready:
            report.update(ok=False, verdict={"psd_pays": False, "summary": "the drafter did not start"})
            return report
        prompts = [engine.encode_prompt(t) for t in prompts_text]
        runs: list[dict[str, Any]] = []
        for concurrency in loads:
            runs.append(measure(engine, Mode.AR, 0, concurrency, seconds, prompts, max_tokens))
            for k in ks:
                for mode in (Mode.SD, Mode.PSD):
                    runs.append(measure(engine, mode, k, concurrency, seconds, prompts, max_tokens))
                    print(f"doctor: {runs[-1]['mode']} k={k} at {concurrency}: "
                          f"{runs[-1]['tokens_per_second']} tokens/s", file=sys.stderr, flush=True)
        report["runs"] = runs
        report["verdict"] = verdict(runs)
        report["ok"] = True
    finally:
        engine.shutdown()
    return report


def print_report(report: dict[str, Any]) -> None:
    for name, check in report["checks"].items():
        status = "ok" if check.get("ok", True) else "FAILED"
        detail = {k: v for k, v in check.items() if k != "ok"}
        print(f"{name:<11} {status:<7} {json.dumps(detail)}")
    if report.get("runs"):
        print(f"\n{'load':>5} {'mode':<5} {'k':>2} {'tokens/s':>10} {'accept':>7} {'overlap':>8}")
        for r in report["runs"]:
            print(f"{r['concurrency']:>5} {r['mode']:<5} {r['k']:>2} {r['tokens_per_second']:>10.1f} "
                  f"{r['acceptance_rate']:>7.3f} {r['overlap_fraction']:>8.3f}")
    print(f"\nverdict: {report['verdict']['summary']}")


def add_subcommands(sub: Any) -> None:
    from minedraft.engine_options import add_engine_arguments

    doctor = sub.add_parser("doctor", help="check devices, dtype, memory and vocabulary, load the pair and measure "
                            "ar / sd / psd at three loads: does PSD pay on this node?")
    add_engine_arguments(doctor)
    doctor.add_argument("--loads", default="4,16,64", help="concurrencies to measure (comma-separated)")
    doctor.add_argument("--ks", default="2,3,5", help="draft lengths to try for sd and psd (comma-separated)")
    doctor.add_argument("--seconds", type=float, default=20.0,
                        help="seconds per mode, k and load (the default totals ~a minute per mode)")
    doctor.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    doctor.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from minedraft.bench.workload import bench_prompts
    from minedraft.engine.settings import SettingsError
    from minedraft.engine_options import _pair_dir, ensure_pair, settings_from_args

    settings = settings_from_args(args)
    try:
        loads = [int(c) for c in args.loads.split(",") if c.strip()]
        ks = [int(k) for k in args.ks.split(",") if k.strip()]
    except ValueError:
        raise SettingsError("loads", f"expected comma-separated integers, got {args.loads!r} / {args.ks!r}") from None
    if not loads or min(loads) < 1 or not ks or min(ks) < 1:
        raise SettingsError("loads", "at least one positive load and one positive k are needed")
    prompts = bench_prompts(ensure_pair(_pair_dir(args.pair)), 64)
    report = run_doctor(settings, loads, ks, args.seconds, args.max_tokens, prompts)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report.get("ok") else 1
