"""`minedraft drafter`: the shared drafter service (minedraft/engine/drafter/service.py) as a command, with the
pool's Prometheus endpoint (`minedraft_drafter_*`, minedraft/server/drafter_metrics.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

# The drafter's modules (msgspec, zmq) are imported when the command runs, not when `minedraft` builds its parser:
# the gateway and operator images install neither (pyproject.toml's extras).


def add_subcommand(sub: Any) -> None:
    parser = sub.add_parser("drafter", help="serve draft jobs to many engine replicas over TCP (a shared drafter)",
                            description="A drafter service that engines started with --drafter-address use instead "
                            "of a drafter process of their own. Engines and service share a token (a file).")
    parser.add_argument("--model", help="draft model directory (default: the local pair's draft)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=50061)
    parser.add_argument("--token-file", required=True, help="file holding the token engines must present")
    parser.add_argument("--backend", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--device", default="cpu", help="torch backend: cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="longest context in tokens (0: the draft model's own max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="requests the drafter holds (all engines)")
    parser.add_argument("--window", type=int, default=0,
                        help="torch backend: draft from at most the last W tokens of each context plus a few "
                        "attention-sink tokens (0: the whole context)")
    parser.add_argument("--hf-overrides", type=_json_object, default=None,
                        help="JSON: the draft model's context stretch, as the engines' targets get it through vLLM's "
                        "--hf-overrides (only rope_scaling, rope_parameters, rope_theta and max_position_embeddings "
                        "are applied)")
    parser.add_argument("--cores", help="comma-separated CPU cores for the drafter")
    parser.add_argument("--max-queued-jobs", type=int, default=None,
                        help="jobs queued across engines (default: the service's own, ServiceSettings)")
    parser.add_argument("--session-timeout-seconds", type=float, default=None,
                        help="an engine silent this long is dropped (default: the service's own, ServiceSettings)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus /metrics of the pool (jobs, batch sizes, queue, utilisation, per-engine job "
                        "latency) on this port (0: not served)")
    parser.set_defaults(func=cmd_drafter)


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--hf-overrides: not JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("--hf-overrides: expected a JSON object")
    return parsed


def cmd_drafter(args: argparse.Namespace) -> int:
    from minedraft.engine.drafter import wire
    from minedraft.engine.drafter.backends import context_overrides
    from minedraft.engine.drafter.service import ServiceSettings, serve
    from minedraft.models.spec import default_pair_dir

    token = wire.read_token(args.token_file)
    model = args.model or str(default_pair_dir() / "draft")
    overrides = context_overrides(args.hf_overrides)
    max_model_len = args.max_model_len
    if not max_model_len and args.backend == "torch":
        # The torch drafter sizes its RoPE table by it (the vLLM backend fits its own).
        from transformers import AutoConfig

        from minedraft.engine.drafter.torch_backend import apply_config_overrides

        config = apply_config_overrides(AutoConfig.from_pretrained(model), overrides)
        max_model_len = int(config.max_position_embeddings)
    settings: dict[str, Any] = {
        "model": model,
        "backend": args.backend,
        "device": args.device,
        "dtype": args.dtype,
        "max_model_len": max_model_len,
        # The torch backend keeps 2 * max_num_seqs + 8 slots.
        "max_num_seqs": args.max_num_seqs,
        "cpu_cores": [int(c) for c in args.cores.split(",")] if args.cores else [],
        "drafter_window": args.window,
        "hf_overrides": overrides,
        "kv_cache_gib": 1,
    }
    given = {"max_queued_jobs": args.max_queued_jobs, "session_timeout_seconds": args.session_timeout_seconds}
    service = ServiceSettings(**{k: v for k, v in given.items() if v is not None})
    on_core = None
    if args.metrics_port:
        from prometheus_client import CollectorRegistry, start_http_server

        from minedraft.server.drafter_metrics import DrafterServiceCollector

        registry = CollectorRegistry()
        collector = DrafterServiceCollector()
        registry.register(collector)
        start_http_server(args.metrics_port, addr=args.host, registry=registry)
        on_core = collector.attach
    return serve(settings, args.host, args.port, token, service, on_core=on_core)
