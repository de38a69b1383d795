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


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _samples(run: dict[str, Any]) -> list[float]:
    """A run's repeated measurements (tokens/s), in round order; one when it was measured once."""
    return [float(v) for v in run.get("samples") or [run["tokens_per_second"]]]


def _spread(samples: list[float]) -> float:
    """(max - min) / median: how far apart one mode's repeats landed."""
    median = _median(samples)
    return (max(samples) - min(samples)) / median if median > 0 else 0.0


def contention(runs: list[dict[str, Any]], cores: int, own_processes: int = 2) -> str | None:
    """Why the runs cannot rank the modes on a CPU, or None. Pure.

    When more runnable processes compete for the cores than the engine's own (its target and drafter processes on
    `cores` cores), the kernel shares the cores by process: a mode that keeps more processes busy (psd: target and
    drafter at once) gets a larger share than one that keeps fewer (ar, sd), whatever each would do alone. That bias
    is the same in every round, so no spread reveals it; the 1-minute load average taken after each run does."""
    loads = [value for r in runs for value in r.get("load_average", [])]
    if not loads:
        return None
    limit = cores + own_processes
    peak = max(loads)
    if peak <= limit:
        return None
    return (f"the machine was busy (load average up to {peak:.1f} on {cores} cores, more than the engine's own "
            f"{limit}): modes with more busy processes get more of the CPU there")


def verdict(runs: list[dict[str, Any]], margin: float = 0.02, contended: str | None = None) -> dict[str, Any]:
    """Per load: the best psd (over k, by median) against the best of sd and ar. Pure.

    Runs measured in rounds (`samples`: one tokens/s per round, every mode once per round, interleaved) are compared
    round by round: psd's ratio to the rival in each round (both measured minutes apart at most, under the same
    background load). PSD pays at a load when every round's ratio exceeds 1 + `margin` and the spread - the larger
    of the ratios' range (max - min) and each of the two modes' own range across its repeats, relative to its
    median - is smaller than the median ratio's distance from 1; the rival wins when every ratio is below
    1 - margin under the same spread condition; otherwise the load is undecided: the repeats disagree by more than
    the difference they would decide on. A verdict taken on a busy machine can thus be weaker than an idle one, never
    the opposite one unless every round of it points the other way by more than its own spread."""
    per_load: list[dict[str, Any]] = []
    for concurrency in sorted({r["concurrency"] for r in runs}):
        at = [r for r in runs if r["concurrency"] == concurrency]
        best = {m: max((r for r in at if r["mode"] == m), key=lambda r: _median(_samples(r)), default=None)
                for m in ("ar", "sd", "psd")}
        psd = best["psd"]
        rivals = [r for m, r in best.items() if m != "psd" and r is not None]
        rival = max(rivals, key=lambda r: _median(_samples(r)), default=None)
        winner = max((r for r in best.values() if r is not None), key=lambda r: _median(_samples(r)))
        entry: dict[str, Any] = {"concurrency": concurrency, "psd_pays": False, "decision": "undecided",
                                 "best": f"{winner['mode']} k={winner['k']}", "psd_k": psd["k"] if psd else None,
                                 "psd_vs_sd": _ratio(psd, best["sd"]), "psd_vs_ar": _ratio(psd, best["ar"]),
                                 "spread": {f"{r['mode']} k={r['k']}": round(_spread(_samples(r)), 3) for r in at}}
        if psd is not None and rival is not None:
            ours, theirs = _samples(psd), _samples(rival)
            rounds = min(len(ours), len(theirs))
            ratios = [a / b for a, b in zip(ours[:rounds], theirs[:rounds], strict=True) if b > 0] or [0.0]
            difference = _median(ratios) - 1.0
            # The spread a decision must beat: the paired ratios' own, and each mode's across its repeats.
            spread = max(max(ratios) - min(ratios), _spread(ours), _spread(theirs))
            entry.update(rival=f"{rival['mode']} k={rival['k']}", rounds=rounds,
                         ratio_median=round(_median(ratios), 3), ratio_spread=round(spread, 3))
            if spread < abs(difference):
                if min(ratios) > 1.0 + margin:
                    entry.update(psd_pays=True, decision="psd")
                elif max(ratios) < 1.0 - margin:
                    entry.update(decision=rival["mode"])
        elif psd is None or rival is None:
            entry["decision"] = winner["mode"]
        per_load.append(entry)
    if contended is not None:  # a systematic bias no spread shows: nothing is decided
        for entry in per_load:
            entry.update(psd_pays=False, decision="undecided", measured_decision=entry["decision"])
        return {"psd_pays": False, "decision": "undecided", "contention": contended, "per_load": per_load,
                "summary": f"undecided: {contended}; rerun on a quiet machine (measured: best " + ", ".join(
                    f"{p['best']} at {p['concurrency']}" for p in per_load) + ")"}
    paying = [p for p in per_load if p["psd_pays"]]
    undecided = [p for p in per_load if p["decision"] == "undecided"]
    parts: list[str] = []
    if paying:
        parts.append("PSD pays here at " + ", ".join(f"{p['concurrency']} requests (k={p['psd_k']}, "
                                                     f"{p['psd_vs_sd']}x sd, {p['psd_vs_ar']}x ar)" for p in paying))
    if undecided:
        parts.append("undecided at " + ", ".join(
            f"{p['concurrency']} requests (psd/{p.get('rival', '?')} {p.get('ratio_median')}, rounds spread "
            f"{p.get('ratio_spread')})" for p in undecided) + ": the repeats differ by more than the modes do")
    if not paying and not undecided:
        parts.append("PSD does not pay here at the measured loads; best: " + ", ".join(
            f"{p['best']} at {p['concurrency']}" for p in per_load))
    elif not paying:
        decided = [p for p in per_load if p["decision"] != "undecided"]
        if decided:
            parts.append("PSD does not pay at " + ", ".join(f"{p['concurrency']} (best {p['best']})" for p in decided))
    overall = "psd" if paying else ("undecided" if undecided else "no")
    return {"psd_pays": bool(paying), "decision": overall, "summary": "; ".join(parts), "per_load": per_load}


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if a is None or b is None:
        return None
    theirs = _median(_samples(b))
    return round(_median(_samples(a)) / theirs, 3) if theirs else None


def cpu_features() -> list[str]:
    """The CPU's matrix and vector features that decide a CPU's speed in bf16 and float32 (from /proc/cpuinfo)."""
    wanted = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512f", "avx2", "fma")
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def measure_interleaved(measure_one: Any, loads: list[int], settings: list[tuple[Any, int]],
                        repeats: int) -> list[dict[str, Any]]:
    """Every (mode, k) at every load, `repeats` rounds; each round runs every setting once, in an order that
    rotates by round (no setting always first after a load change), so a background load that comes and goes
    touches every mode alike. `measure_one(mode, k, load)` returns one run's report; the result holds one report
    per (mode, k, load) with `samples` (tokens/s by round) and `tokens_per_second` (their median)."""
    collected: dict[tuple[int, str, int], dict[str, Any]] = {}
    for round_index in range(repeats):
        for concurrency in loads:
            shift = round_index % len(settings)
            for mode, k in settings[shift:] + settings[:shift]:
                run = measure_one(mode, k, concurrency)
                key = (concurrency, run["mode"], run["k"])
                kept = collected.setdefault(key, {**run, "samples": [], "load_average": []})
                kept["samples"].append(run["tokens_per_second"])
                kept["load_average"].append(round(load_average(), 2))
    out = []
    for run in collected.values():
        run["tokens_per_second"] = round(_median(run["samples"]), 2)
        run["spread"] = round(_spread(run["samples"]), 3)
        out.append(run)
    return out


def run_doctor(settings: Any, loads: list[int], ks: list[int], seconds: float, max_tokens: int,
               prompts_text: list[str], repeats: int = 3) -> dict[str, Any]:
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

        def measure_one(mode: Mode, k: int, concurrency: int) -> dict[str, Any]:
            run = measure(engine, mode, k, concurrency, seconds, prompts, max_tokens)
            print(f"doctor: {run['mode']} k={run['k']} at {concurrency}: {run['tokens_per_second']} tokens/s",
                  file=sys.stderr, flush=True)
            return run

        settings_list = [(Mode.AR, 0)] + [(mode, k) for k in ks for mode in (Mode.SD, Mode.PSD)]
        runs = measure_interleaved(measure_one, loads, settings_list, repeats)
        report["runs"] = runs
        on_cpu = not report["checks"]["devices"]["visible_gpus"]
        cores = len(report["checks"]["devices"]["cpu_cores"])
        report["verdict"] = verdict(runs, contended=contention(runs, cores) if on_cpu else None)
        report["verdict"]["decided_by"] = {
            "dtype": report["checks"]["dtype"]["dtype"], "dtype_note": report["checks"]["dtype"]["note"],
            "device": "gpu" if report["checks"]["devices"]["visible_gpus"] else "cpu",
            "cpu_features": cpu_features(), "cpu_fast_bf16": report["checks"]["devices"]["cpu_fast_bf16"],
            "cpu_cores": report["checks"]["devices"]["cpu_cores"], "repeats": repeats,
            "load_average": [round(v, 2) for v in os.getloadavg()]}
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
        print(f"\n{'load':>5} {'mode':<5} {'k':>2} {'tokens/s':>10} {'spread':>7} {'accept':>7} {'overlap':>8}")
        for r in sorted(report["runs"], key=lambda r: (r["concurrency"], r["mode"], r["k"])):
            print(f"{r['concurrency']:>5} {r['mode']:<5} {r['k']:>2} {r['tokens_per_second']:>10.1f} "
                  f"{r.get('spread', 0.0):>7.3f} {r['acceptance_rate']:>7.3f} {r['overlap_fraction']:>8.3f}")
    print(f"\nverdict: {report['verdict']['summary']}")
    decided = report["verdict"].get("decided_by")
    if decided:
        print(f"decided by: {decided['device']}, dtype {decided['dtype']} ({decided['dtype_note']}); CPU features "
              f"{', '.join(decided['cpu_features']) or 'none of note'}; {decided['repeats']} interleaved rounds; "
              f"load average {decided['load_average']}")


def add_subcommands(sub: Any) -> None:
    from minedraft.engine_options import add_engine_arguments

    doctor = sub.add_parser("doctor", help="check devices, dtype, memory and vocabulary, load the pair and measure "
                            "ar / sd / psd at three loads: does PSD pay on this node?")
    add_engine_arguments(doctor)
    doctor.add_argument("--loads", default="4,16,64", help="concurrencies to measure (comma-separated)")
    doctor.add_argument("--ks", default="2,3,5", help="draft lengths to try for sd and psd (comma-separated)")
    doctor.add_argument("--seconds", type=float, default=7.0,
                        help="seconds per mode, k, load and round (the default totals ~20 s per mode and load)")
    doctor.add_argument("--repeats", type=int, default=3,
                        help="interleaved rounds: every mode once per round; the verdict compares them round by "
                        "round and says 'undecided' when the rounds spread more than the modes differ")
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
    if args.repeats < 1:
        raise SettingsError("repeats", f"must be >= 1, got {args.repeats}")
    prompts = bench_prompts(ensure_pair(_pair_dir(args.pair)), 64)
    report = run_doctor(settings, loads, ks, args.seconds, args.max_tokens, prompts, args.repeats)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report.get("ok") else 1
