"""`minedraft serve`: one engine replica behind the gRPC API, with a Prometheus endpoint."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)


def add_subcommands(sub: Any) -> None:
    from minedraft.engine_options import DEFAULT_SERVE_MODE, add_engine_arguments

    serve = sub.add_parser("serve", help="serve the gRPC API over an engine replica (speculative decoding)")
    add_engine_arguments(serve, default_mode=DEFAULT_SERVE_MODE)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    serve.add_argument("--grpc-port", type=int, default=50051)
    serve.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics (0: do not serve)")
    serve.add_argument("--http-port", type=int, default=0,
                       help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                            "/ready) on this port (0: do not serve)")
    serve.add_argument("--grace-seconds", type=float, default=20.0,
                       help="on SIGTERM, how long open streams may run before they are cancelled")
    serve.add_argument("--token-file", action="append", default=[],
                       help="accepted bearer tokens, one per line, re-read when the file changes: the gRPC (but "
                       "health) and HTTP APIs refuse callers without one; repeatable (a token of any file is "
                       "accepted). The operator sets it to the MineDraft's internal credential behind the gateway")
    serve.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                       help="the names clients address the model by: GetModelInfo's model and /v1/models answer the "
                       "first, requests may name any (aliases); default: the model's path or hub id")
    serve.add_argument("--client-stall-timeout-s", type=float, default=60.0,
                       help="a gRPC or HTTP stream whose client accepts nothing for this long is cut and its request "
                       "aborted (0: off); behind a gateway, keep it at or above the gateway's")
    serve.add_argument("--engine-in-process", action="store_true",
                       help="run the engine's step loop on a thread of the serving process instead of in an engine "
                       "process of its own (the servers then share its GIL; for comparisons and debugging)")
    serve.add_argument("--replica-id", default=os.environ.get("POD_NAME"),
                       help="reported by GetServerInfo (default: $POD_NAME, else the host name)")
    serve.set_defaults(func=cmd_serve)


def start_metrics(host: str, port: int) -> Any:
    """Prometheus endpoint with a registry owned by this server (not the process-global one).

    The engine's metric set (minedraft/server/metrics.py) is registered into this registry when the engine attaches.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    if port:
        start_http_server(port, addr=host, registry=registry)
        log.info("metrics on http://%s:%d/metrics", host, port)
    return registry


def cmd_serve(args: argparse.Namespace) -> int:
    from minedraft.engine.async_engine import AsyncEngine
    from minedraft.engine.engine_process import EngineProcess
    from minedraft.engine.placement import detect_device, resolved_settings
    from minedraft.engine.serving import ServingEngine
    from minedraft.engine_options import settings_from_args
    from minedraft.server.app import serve

    tokens = None
    if args.token_file:
        from minedraft.api.auth import token_files

        try:
            tokens = token_files(args.token_file)
        except ValueError as exc:
            print(f"minedraft serve: error: {exc}", file=sys.stderr)
            return 2
    if not args.client_stall_timeout_s >= 0:
        print(f"minedraft serve: error: client-stall-timeout-s: must be >= 0, got {args.client_stall_timeout_s}",
              file=sys.stderr)
        return 2
    settings = settings_from_args(args)
    registry = start_metrics(args.host, args.metrics_port) if args.metrics_port else None
    # The dtype the engine will compute in ("auto" resolved as the engine resolves it), said before the long load.
    dtype = resolved_settings(settings, detect_device()).dtype

    def on_started(port: int) -> None:
        print(f"minedraft serve: gRPC on {args.host}:{port}, loading the {settings.mode.value} engine ({dtype})",
              file=sys.stderr, flush=True)

    async def start_engine() -> ServingEngine:
        if args.engine_in_process:
            return await AsyncEngine.create(settings)
        # Default: the engine core in a process of its own, apart from the servers' GIL (engine_process.py).
        return await EngineProcess.create(settings)

    return asyncio.run(serve(start_engine, f"{args.host}:{args.grpc_port}",
                             args.grace_seconds, args.replica_id, on_started=on_started, registry=registry,
                             http_address=(args.host, args.http_port) if args.http_port else None, tokens=tokens,
                             served_model_names=tuple(args.served_model_name),
                             client_stall_timeout_s=args.client_stall_timeout_s or None))
