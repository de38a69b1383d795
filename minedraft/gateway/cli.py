"""`minedraft gateway`: the front door that routes client streams across engine replicas."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TOKEN_ENV_DEFAULT = "MINEDRAFT_GATEWAY_TOKENS"


def add_subcommands(sub: Any) -> None:
    gateway = sub.add_parser("gateway", help="route client streams across engine replicas")
    gateway.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    gateway.add_argument("--port", type=int, default=50050)
    engines = gateway.add_mutually_exclusive_group(required=True)
    engines.add_argument("--engines", help="static engine list: host:port,host:port")
    engines.add_argument("--kubernetes-service", metavar="NAMESPACE/NAME",
                         help="watch this Service's EndpointSlices for engines")
    gateway.add_argument("--kubernetes-port-name", default="grpc",
                         help="the EndpointSlice port to use (the only port is used when there is just one)")
    gateway.add_argument("--kubernetes-api", help="API server URL (default: in-cluster service account)")
    gateway.add_argument("--max-in-flight", type=int, default=4096,
                         help="streams in flight past which new ones get RESOURCE_EXHAUSTED")
    gateway.add_argument("--max-attempts", type=int, default=3,
                         help="engines tried per stream (only before its first token), >= 1")
    gateway.add_argument("--first-response-timeout-s", type=float, default=60.0,
                         help="an engine that sends a stream nothing for this long is taken as stalled: the stream "
                              "is retried elsewhere and the engine left out until its health answers (0: off)")
    gateway.add_argument("--idle-timeout-s", type=float, default=30.0,
                         help="the same between two responses of a stream (0: off)")
    gateway.add_argument("--client-stall-timeout-s", type=float, default=60.0,
                         help="an HTTP or gRPC stream whose client accepts nothing for this long is cut "
                              "(UNAVAILABLE, or the connection closed) and its engine request aborted (0: off)")
    gateway.add_argument("--cors-origins", default="",
                         help="comma-separated origins allowed to call the HTTP API from a browser (default: CORS off)")
    gateway.add_argument("--engine-wait-timeout-s", type=float, default=300.0,
                         help="with no engine ready, how long a stream waits for one before UNAVAILABLE")
    gateway.add_argument("--max-waiting-streams", type=int, default=1024,
                         help="streams that may wait for an engine at once; more get UNAVAILABLE")
    gateway.add_argument("--ready-without-engines", action="store_true",
                         help="report ready (gRPC health, HTTP /ready) with no engine too, as streams wait for one: "
                              "for engines scaled to zero behind a Service that routes only to ready pods")
    gateway.add_argument("--token-file", help="accepted bearer tokens, one per line (enables authentication)")
    gateway.add_argument("--token-env", default=TOKEN_ENV_DEFAULT,
                         help="environment variable with accepted bearer tokens, comma-separated "
                              "(enables authentication when set)")
    gateway.add_argument("--engine-token-file", action="append", default=[],
                         help="bearer token presented to engines (the first of the file, re-read when it changes), "
                              "for engines serving with --token-file; repeatable: an engine that refuses one is "
                              "offered the next (an upgrade's mixed fleet)")
    gateway.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                         help="the names clients address the model by (as the engines' --served-model-name): "
                              "/v1/models lists them and requests may name any; default: the engines' answer")
    gateway.add_argument("--tls-cert", help="PEM certificate (with --tls-key: serve TLS)")
    gateway.add_argument("--tls-key", help="PEM private key")
    gateway.add_argument("--grace-seconds", type=float, default=20.0)
    gateway.add_argument("--metrics-port", type=int, default=9401, help="Prometheus /metrics (0: do not serve)")
    gateway.add_argument("--http-port", type=int, default=0,
                         help="OpenAI-compatible HTTP API on this port, with the same routing, admission, bearer "
                              "tokens and TLS as the gRPC port (0: do not serve)")
    gateway.set_defaults(func=cmd_gateway)

    bench = sub.add_parser("bench-gateway", help="the gateway's own cost against a fake engine, and its stream limit")
    bench.add_argument("--json", default="benchmarks/results/gateway.json", help="output (.md and .png beside it)")
    bench.add_argument("--quick", action="store_true", help="a smaller run (smoke test)")
    bench.add_argument("--layout", choices=("pinned", "shared"), default="pinned",
                       help="pinned: the gateway on a core of its own (default); shared: every process on every core")
    bench.set_defaults(func=cmd_bench_gateway)


def load_tokens(token_file: str | None, token_env: str | None) -> Sequence[bytes]:
    """The accepted tokens; a token file's are read again whenever the file changes (a rotated Secret takes effect
    without a restart)."""
    from minedraft.api.auth import LiveTokens, TokenFile, parse_tokens

    fixed: tuple[bytes, ...] = ()
    if token_env and os.environ.get(token_env):
        try:
            fixed = parse_tokens(os.environ[token_env], comma_separated=True)
        except ValueError as exc:
            raise ValueError(f"token-env: ${token_env}: {exc}") from None
    if token_file:
        try:
            text = Path(token_file).read_text()
        except OSError as exc:
            raise ValueError(f"token-file: cannot read {token_file}: {exc.strerror or exc}") from None
        try:
            found = parse_tokens(text)
        except ValueError as exc:
            raise ValueError(f"token-file: {token_file}: {exc}") from None
        if not found:
            raise ValueError(f"token-file: {token_file} holds no tokens")
        return LiveTokens(TokenFile(token_file).tokens, fixed)
    return fixed


def engine_tokens(paths: Sequence[str]) -> tuple[Callable[[], str], ...]:
    """The engine credentials, in the order they are offered, each a callable (re-read when its file changes)."""
    from minedraft.api.auth import TokenFile

    return tuple(TokenFile(path, "engine-token-file").first for path in paths)


def config_from_args(args: argparse.Namespace) -> Any:
    from minedraft.gateway.app import GatewayConfig, TlsFiles

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("tls: --tls-cert and --tls-key go together")
    tls = TlsFiles(Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None
    if args.max_in_flight < 1:
        raise ValueError(f"max-in-flight: must be >= 1, got {args.max_in_flight}")
    if args.max_attempts < 1:
        raise ValueError(f"max-attempts: must be >= 1, got {args.max_attempts}")
    for flag in ("first_response_timeout_s", "idle_timeout_s", "engine_wait_timeout_s", "client_stall_timeout_s"):
        if not getattr(args, flag) >= 0:
            raise ValueError(f"{flag.replace('_', '-')}: must be >= 0, got {getattr(args, flag)}")
    if args.max_waiting_streams < 0:
        raise ValueError(f"max-waiting-streams: must be >= 0, got {args.max_waiting_streams}")
    if tls is not None:
        tls.server_credentials()  # a missing or non-PEM file is named now, not as gRPC's "Failed to bind"
    credentials = engine_tokens(args.engine_token_file or ())
    return GatewayConfig(max_in_flight=args.max_in_flight, max_attempts=args.max_attempts,
                         tokens=load_tokens(args.token_file, args.token_env), tls=tls,
                         first_response_timeout_seconds=args.first_response_timeout_s or None,
                         idle_timeout_seconds=args.idle_timeout_s or None,
                         engine_wait_timeout_seconds=args.engine_wait_timeout_s,
                         max_waiting_streams=args.max_waiting_streams,
                         ready_without_engines=args.ready_without_engines,
                         engine_token=next(iter(credentials), None), engine_fallback_tokens=credentials[1:],
                         served_model_names=tuple(args.served_model_name),
                         client_stall_timeout_seconds=args.client_stall_timeout_s or None,
                         cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()))


def cmd_gateway(args: argparse.Namespace) -> int:
    from minedraft.gateway.app import Gateway, run_gateway
    from minedraft.gateway.discovery import KubernetesApi, parse_engines, parse_service

    try:
        config = config_from_args(args)
        engines = parse_engines(args.engines) if args.engines is not None else None
        if engines is not None and not engines:
            raise ValueError("engines: no engine address given (host:port,host:port)")
        service = parse_service(args.kubernetes_service) if args.kubernetes_service else None
    except (ValueError, OSError) as exc:
        print(f"minedraft gateway: error: {exc}", file=sys.stderr)
        return 2

    registry = None
    if args.metrics_port:
        from prometheus_client import CollectorRegistry, start_http_server

        # A registry of its own (not the process-global one): only the gateway's metrics, nothing else's.
        registry = CollectorRegistry()
        try:
            start_http_server(args.metrics_port, addr=args.host, registry=registry)
        except OSError as exc:
            print(f"minedraft gateway: error: metrics-port: cannot bind {args.host}:{args.metrics_port}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 2

    async def main() -> int:
        gateway = Gateway(config, registry)
        if engines is not None:
            gateway.set_engines(engines)
        else:
            assert service is not None
            api = KubernetesApi(args.kubernetes_api) if args.kubernetes_api else KubernetesApi.in_cluster()
            gateway.watch_kubernetes(api, service[0], service[1], args.kubernetes_port_name)
        def on_started(port: int) -> None:  # only once bound: "on" means reachable
            print(f"minedraft gateway: on {args.host}:{port} ({'TLS' if config.tls else 'plaintext'}, "
                  f"auth {'on' if config.tokens else 'off'})", file=sys.stderr, flush=True)

        return await run_gateway(gateway, f"{args.host}:{args.port}", args.grace_seconds, on_started=on_started,
                                 http_address=(args.host, args.http_port) if args.http_port else None)

    try:
        return asyncio.run(main())
    except OSError as exc:  # the port in use, or an address not of this host
        print(f"minedraft gateway: error: port: {exc}", file=sys.stderr)
        return 2


def cmd_bench_gateway(args: argparse.Namespace) -> int:
    from minedraft.gateway.bench import main

    return main(["--json", args.json, "--layout", args.layout, *(["--quick"] if args.quick else [])])
