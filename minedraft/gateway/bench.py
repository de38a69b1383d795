"""The gateway's own cost: the same streams straight to a fake engine and through the gateway, in one run.

Processes: a fake engine replica (`minedraft.testing.fake_engine`, streaming tokens at a fixed rate and stamping
each response with its send time), a gateway in front of it (`minedraft gateway`), and this process as the client.
Both paths hit the same fake, interleaved round by round. Per-token latency is one-way: the fake's send stamp to the
client's receipt (CLOCK_MONOTONIC is shared by processes on one machine); time to first token is measured from the
call's start. Added latency = gateway minus direct, at p50 and p99. Then the number of concurrent streams is raised
until errors appear (or the top level is reached): the most concurrent streams one gateway process sustained.

Layout (`--layout`): `pinned` (the default, on a machine with two or more usable cores) gives the gateway a core
of its own and keeps the fake engine and the client on the others, as a deployment would (a gateway pod has its own
CPU; engines and clients run elsewhere), so the added latency is the gateway's hop and not the harness crowding a
third process onto two cores. `shared` lets all three processes share every core (the contention is then part of the
figure). Both paths of a level run under the same layout, interleaved.
HTTP streams (the gateway's OpenAI API): the same fake and gateway process, `POST /v1/completions` with
`stream: true` read as Server-Sent Events by a minimal HTTP/1.1 client in this process (one connection per stream,
as OpenAI SDK clients open them), each event's text the fake's stamp; measured as a third path beside direct and
gateway gRPC, and in a concurrency run of its own.
`python -m minedraft.gateway.bench --json benchmarks/results/gateway.json` (also `minedraft bench-gateway`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from minedraft.api import pb, pb_grpc
from minedraft.api.grpc_policy import CHANNEL_OPTIONS
from minedraft.testing.fake_engine import INTERVAL_METADATA_KEY

# Per-token targets of the issue (added latency, milliseconds).
TARGET_ADDED_P50_MS = 0.5
TARGET_ADDED_P99_MS = 2.0
TARGET_STREAMS = 1000


@dataclass
class StreamResult:
    ttft_seconds: float | None = None
    token_latencies_seconds: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str | None = None


@dataclass
class BenchConfig:
    # Concurrent streams in the latency comparison: one (the hop's own cost) and a loaded gateway.
    latency_streams: tuple[int, ...] = (1, 16)
    latency_tokens: int = 100
    latency_interval_seconds: float = 0.01
    latency_rounds: int = 3
    capacity_levels: tuple[int, ...] = (250, 500, 1000, 2000, 3000)
    capacity_tokens: int = 10
    capacity_interval_seconds: float = 0.5
    capacity_deadline_seconds: float = 60.0
    layout: str = "pinned"
    # Another source tree whose gateway runs beside this one, interleaved in the same rounds (before vs after).
    baseline_tree: str | None = None


LAYOUTS = ("pinned", "shared")


def cpu_layout(available: set[int], layout: str) -> tuple[set[int], set[int], str]:
    """(gateway's cores, the fake engine's and client's cores, the layout used) for the usable cores.

    Pinned: the highest-numbered core to the gateway, the rest to the harness; with a single core there is nothing
    to pin apart, so it falls back to shared (and says so).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "pinned" and len(available) >= 2:
        gateway = {max(available)}
        return gateway, available - gateway, "pinned"
    return set(available), set(available), "shared"


QUICK = BenchConfig(latency_streams=(4,), latency_tokens=20, latency_rounds=1, capacity_levels=(50, 100),
                    capacity_tokens=5, capacity_interval_seconds=0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc): the gateway's own work, however busy the machine is."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


async def _wait_serving(target: str, timeout_seconds: float = 30.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_seconds
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target} did not become SERVING within {timeout_seconds}s")
            await asyncio.sleep(0.05)


async def _one_stream(stub: Any, index: int, tokens: int, interval_seconds: float, deadline_seconds: float,
                      open_streams: list[int], peak: list[int]) -> StreamResult:
    result = StreamResult()
    request = pb.GenerateRequest(prompt_token_ids=[index % 2048 + 1],
                                 sampling_params=pb.SamplingParams(max_tokens=tokens))
    started = time.perf_counter()
    streaming = False
    try:
        call = stub.Generate(request, timeout=deadline_seconds,
                             metadata=((INTERVAL_METADATA_KEY, str(interval_seconds)),))
        async for response in call:
            received_ns = time.perf_counter_ns()
            if result.ttft_seconds is None:
                result.ttft_seconds = time.perf_counter() - started
                streaming = True
                open_streams[0] += 1
                peak[0] = max(peak[0], open_streams[0])
            result.token_latencies_seconds.append((received_ns - int(response.text)) / 1e9)
            result.num_tokens += len(response.token_ids)
        if result.num_tokens != tokens:
            result.error = f"short stream: {result.num_tokens} of {tokens} tokens"
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    finally:
        if streaming:
            open_streams[0] -= 1
    return result


async def _one_http_stream(address: str, index: int, tokens: int, interval_seconds: float, deadline_seconds: float,
                           open_streams: list[int], peak: list[int]) -> StreamResult:
    """One SSE completion stream over its own HTTP/1.1 connection; each event's text is the fake's send stamp."""
    result = StreamResult()
    host, port = address.rsplit(":", 1)
    body = json.dumps({"model": "fake", "prompt": [index % 2048 + 1], "max_tokens": tokens, "stream": True}).encode()
    started = time.perf_counter()
    streaming = False
    writer = None
    try:
        async with asyncio.timeout(deadline_seconds):
            reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 20)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         + f"{INTERVAL_METADATA_KEY}: {interval_seconds}\r\n".encode()
                         + b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            status = await reader.readline()
            if not status.startswith(b"HTTP/1.1 200"):
                rest = await reader.read()
                result.error = f"HTTP {status.decode(errors='replace').strip()}: {rest[-200:].decode(errors='replace')}"
                return result
            done = False
            # Chunked transfer encoding: size lines, event lines and blank lines; only `data: ` lines matter (each
            # event arrives whole: the server writes one or more complete events per chunk).
            while line := await reader.readline():
                if not line.startswith(b"data: "):
                    continue
                received_ns = time.perf_counter_ns()
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = f"stream error: {event['error']['message']}"
                    break
                text = event["choices"][0]["text"] if event["choices"] else ""
                if not text:
                    continue  # the finish chunk
                if result.ttft_seconds is None:
                    result.ttft_seconds = time.perf_counter() - started
                    streaming = True
                    open_streams[0] += 1
                    peak[0] = max(peak[0], open_streams[0])
                result.token_latencies_seconds.append((received_ns - int(text)) / 1e9)
                result.num_tokens += 1
            if result.error is None and (not done or result.num_tokens != tokens):
                result.error = f"short stream: {result.num_tokens} of {tokens} tokens{'' if done else ', no [DONE]'}"
    except (OSError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if streaming:
            open_streams[0] -= 1
        if writer is not None:
            writer.close()
    return result


async def _run_streams(target: str, count: int, tokens: int, interval_seconds: float,
                       deadline_seconds: float) -> tuple[list[StreamResult], int, float]:
    """`count` concurrent streams to a gRPC target (host:port) or, for http://host:port, the OpenAI HTTP API."""
    open_streams, peak = [0], [0]
    if target.startswith("http://"):
        address = target.removeprefix("http://")
        started = time.perf_counter()
        results = await asyncio.gather(*(
            _one_http_stream(address, i, tokens, interval_seconds, deadline_seconds, open_streams, peak)
            for i in range(count)))
        return list(results), peak[0], time.perf_counter() - started
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)
        started = time.perf_counter()
        results = await asyncio.gather(*(
            _one_stream(stub, i, tokens, interval_seconds, deadline_seconds, open_streams, peak)
            for i in range(count)))
        return list(results), peak[0], time.perf_counter() - started


def _summary(results: list[StreamResult]) -> dict[str, Any]:
    ttfts = [r.ttft_seconds * 1000 for r in results if r.ttft_seconds is not None]
    per_token = [x * 1000 for r in results for x in r.token_latencies_seconds[1:]]  # after the first token
    errors = [r.error for r in results if r.error]
    return {
        "streams": len(results),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "tokens": sum(r.num_tokens for r in results),
        "ttft_ms": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
        "per_token_ms": {"p50": percentile(per_token, 50), "p99": percentile(per_token, 99),
                         "samples": len(per_token)},
        "_ttft_ms": ttfts,
        "_per_token_ms": per_token,
    }


async def _wait_http_ready(address: str, timeout_seconds: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    host, port = address.removeprefix("http://").rsplit(":", 1)
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /ready HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            status = await reader.readline()
            writer.close()
            if status.startswith(b"HTTP/1.1 200"):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{address} did not become ready within {timeout_seconds}s")
        await asyncio.sleep(0.05)


def _added(level: dict[str, Any], name: str) -> dict[str, dict[str, float]]:
    return {metric: {q: level[name][metric][q] - level["direct"][metric][q] for q in ("p50", "p99")}
            for metric in ("ttft_ms", "per_token_ms")}


async def _capacity(config: BenchConfig, target: str) -> tuple[list[dict[str, Any]], int]:
    capacity = []
    for count in config.capacity_levels:
        results, peak, wall_seconds = await _run_streams(target, count, config.capacity_tokens,
                                                         config.capacity_interval_seconds,
                                                         config.capacity_deadline_seconds)
        summary = _summary(results)
        summary.update(level=count, peak_concurrent_streams=peak, wall_seconds=wall_seconds)
        capacity.append(summary)
        print(f"  {target}: {count} streams: {summary['errors']} errors, peak {peak} open at once, "
              f"per-token p99 {summary['per_token_ms']['p99']:.1f} ms", file=sys.stderr, flush=True)
        if summary["errors"]:
            break
    return capacity, max((c["peak_concurrent_streams"] for c in capacity if c["errors"] == 0), default=0)


async def _bench(config: BenchConfig, direct: str, gateways: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """`gateways`: name -> (target, pid); "gateway" is this tree's, "baseline" (optional) another tree's."""
    await _wait_serving(direct)
    for target, _ in gateways.values():
        await (_wait_http_ready(target) if target.startswith("http://") else _wait_serving(target))
    # Warm-up: connections, code paths.
    for target in (direct, *(t for t, _ in gateways.values())):
        await _run_streams(target, 8, 5, 0.001, 30)
    latency = []
    for streams in config.latency_streams:
        paths = [("direct", direct), *((name, target) for name, (target, _) in gateways.items())]
        pooled: dict[str, list[StreamResult]] = {name: [] for name, _ in paths}
        cpu_seconds = dict.fromkeys(gateways, 0.0)
        for round_index in range(config.latency_rounds):
            for name, target in paths if round_index % 2 == 0 else reversed(paths):
                pid = gateways[name][1] if name in gateways else None
                cpu_before = process_cpu_seconds(pid) if pid is not None else 0.0
                results, _, _ = await _run_streams(target, streams, config.latency_tokens,
                                                   config.latency_interval_seconds, 60)
                if pid is not None:
                    cpu_seconds[name] += process_cpu_seconds(pid) - cpu_before
                pooled[name].extend(results)
        level: dict[str, Any] = {"streams": streams, **{name: _summary(r) for name, r in pooled.items()}}
        for name in gateways:
            forwarded = level[name]["tokens"]
            # The gateway's CPU per forwarded token (one response per token here), idle overhead included.
            key = "gateway_cpu_us_per_token" if name == "gateway" else f"{name}_cpu_us_per_token"
            level[key] = cpu_seconds[name] / forwarded * 1e6 if forwarded else float("nan")
            level["added" if name == "gateway" else f"added_{name}"] = _added(level, name)
        latency.append(level)
    capacity, sustained = await _capacity(config, gateways["gateway"][0])
    report: dict[str, Any] = {"latency": latency, "capacity": capacity,
                              "max_concurrent_streams_without_error": sustained}
    if "gateway_http" in gateways:
        report["capacity_http"], report["max_concurrent_http_streams_without_error"] = await _capacity(
            config, gateways["gateway_http"][0])
    if "baseline" in gateways:
        baseline_capacity, baseline_sustained = await _capacity(config, gateways["baseline"][0])
        report["baseline_capacity"] = baseline_capacity
        report["baseline_max_concurrent_streams_without_error"] = baseline_sustained
    return report


def _spawn(args: list[str], cpus: set[int], source_tree: str | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if source_tree is not None:  # that tree's `minedraft` first on the path
        env["PYTHONPATH"] = str(Path(source_tree).resolve())
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def run(config: BenchConfig) -> dict[str, Any]:
    available = os.sched_getaffinity(0)
    gateway_cpus, harness_cpus, layout = cpu_layout(available, config.layout)
    fake_port = _free_port()
    fake = _spawn(["-m", "minedraft.testing.fake_engine", "--port", str(fake_port), "--stamp-text",
                   "--token-interval-seconds", str(config.latency_interval_seconds)], harness_cpus)
    processes = {}
    targets = {}
    trees: dict[str, str | None] = {"gateway": None}
    if config.baseline_tree:
        trees["baseline"] = config.baseline_tree
    http_port = _free_port()
    for name, tree in trees.items():
        port = _free_port()
        # This tree's gateway also serves its OpenAI HTTP API: a third path through the same process.
        http = ["--http-port", str(http_port)] if name == "gateway" else []
        processes[name] = _spawn(["-m", "minedraft.cli", "--log-level", "WARNING", "gateway", "--port", str(port),
                                  "--engines", f"127.0.0.1:{fake_port}", "--max-in-flight", "100000",
                                  "--grace-seconds", "1", "--metrics-port", "0", *http], gateway_cpus, tree)
        targets[name] = (f"127.0.0.1:{port}", processes[name].pid)
    targets["gateway_http"] = (f"http://127.0.0.1:{http_port}", processes["gateway"].pid)
    load_before = os.getloadavg()[0]
    os.sched_setaffinity(0, harness_cpus)  # this process is the client
    try:
        started = time.perf_counter()
        results = asyncio.run(_bench(config, f"127.0.0.1:{fake_port}", targets))
        results["bench_seconds"] = time.perf_counter() - started
    finally:
        os.sched_setaffinity(0, available)
        for process in (*processes.values(), fake):
            process.terminate()
        for process in (*processes.values(), fake):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
    results["config"] = asdict(config)
    results["machine"] = {"cpus": os.cpu_count(), "affinity": len(available), "layout": layout,
                          "gateway_cpus": sorted(gateway_cpus), "fake_engine_and_client_cpus": sorted(harness_cpus),
                          "python": platform.python_version(), "grpcio": grpc.__version__,
                          # Other work on a shared machine inflates latencies: record how busy it was.
                          "load_average_1min_before": round(load_before, 2),
                          "load_average_1min_after": round(os.getloadavg()[0], 2),
                          "note": "fake engine, gateway and client are three processes on this machine"}
    results["targets"] = {
        "added_per_token_p50_ms": {"target": TARGET_ADDED_P50_MS, "met_at_streams": [
            level["streams"] for level in results["latency"]
            if level["added"]["per_token_ms"]["p50"] < TARGET_ADDED_P50_MS]},
        "added_per_token_p99_ms": {"target": TARGET_ADDED_P99_MS, "met_at_streams": [
            level["streams"] for level in results["latency"]
            if level["added"]["per_token_ms"]["p99"] < TARGET_ADDED_P99_MS]},
        "concurrent_streams": {"target": TARGET_STREAMS,
                               "met": results["max_concurrent_streams_without_error"] >= TARGET_STREAMS},
    }
    if "capacity_http" in results:
        results["targets"]["http_added_per_token_p50_ms"] = {"target": TARGET_ADDED_P50_MS, "met_at_streams": [
            level["streams"] for level in results["latency"]
            if level["added_gateway_http"]["per_token_ms"]["p50"] < TARGET_ADDED_P50_MS]}
        results["targets"]["http_concurrent_streams"] = {
            "target": TARGET_STREAMS, "met": results["max_concurrent_http_streams_without_error"] >= TARGET_STREAMS}
    return results


def _layout_words(machine: dict[str, Any]) -> str:
    if machine.get("layout") == "pinned":
        return (f"{machine['affinity']} CPU cores, pinned: the gateway alone on core(s) "
                f"{', '.join(map(str, machine['gateway_cpus']))}, the fake engine and the client on "
                f"{', '.join(map(str, machine['fake_engine_and_client_cpus']))}")
    return f"{machine['affinity']} CPU cores shared by the fake engine, the gateway and the client"


def markdown(results: dict[str, Any], command: str) -> str:
    cfg = results["config"]
    lines = [
        "# Gateway overhead (fake engine, same run)",
        "",
        f"`{command}` — {_layout_words(results['machine'])} "
        f"(1-minute load average {results['machine']['load_average_1min_before']} before the run, "
        f"{results['machine']['load_average_1min_after']} after); per level, {cfg['latency_rounds']} interleaved "
        f"rounds direct/gateway of N concurrent streams x {cfg['latency_tokens']} tokens, one token every "
        f"{cfg['latency_interval_seconds'] * 1000:.0f} ms per stream. Per-token latency: the fake's send stamp to the "
        "client's receipt.",
        "",
        "| streams | path | TTFT p50 (ms) | TTFT p99 (ms) | per-token p50 (ms) | per-token p99 (ms) | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for level in results["latency"]:
        n = level["streams"]
        for name in ("direct", "gateway", "gateway_http", "baseline"):
            if name not in level:
                continue
            s = level[name]
            label = {"baseline": "gateway (baseline tree)", "gateway_http": "gateway HTTP (SSE)"}.get(name, name)
            lines.append(f"| {n} | {label} | {s['ttft_ms']['p50']:.2f} | {s['ttft_ms']['p99']:.2f} | "
                         f"{s['per_token_ms']['p50']:.3f} | {s['per_token_ms']['p99']:.3f} | {s['errors']} |")
        a = level["added"]
        lines.append(f"| {n} | **added by the gateway** | {a['ttft_ms']['p50']:.2f} | {a['ttft_ms']['p99']:.2f} | "
                     f"**{a['per_token_ms']['p50']:.3f}** | **{a['per_token_ms']['p99']:.3f}** | |")
        if "added_gateway_http" in level:
            h = level["added_gateway_http"]
            lines.append(f"| {n} | **added by the gateway, HTTP** | {h['ttft_ms']['p50']:.2f} | "
                         f"{h['ttft_ms']['p99']:.2f} | **{h['per_token_ms']['p50']:.3f}** | "
                         f"**{h['per_token_ms']['p99']:.3f}** | |")
        if "added_baseline" in level:
            b = level["added_baseline"]
            lines.append(f"| {n} | added by the baseline gateway | {b['ttft_ms']['p50']:.2f} | "
                         f"{b['ttft_ms']['p99']:.2f} | {b['per_token_ms']['p50']:.3f} | {b['per_token_ms']['p99']:.3f} "
                         "| |")
    lines += ["", "Gateway CPU time per forwarded token (whatever else the machine runs): " + ", ".join(
        f"{level['gateway_cpu_us_per_token']:.0f} µs at {level['streams']} stream(s)"
        + (f" (baseline {level['baseline_cpu_us_per_token']:.0f} µs)" if "baseline_cpu_us_per_token" in level else "")
        for level in results["latency"]) + "."]
    t = results["targets"]

    def met(key: str) -> str:
        levels = t[key]["met_at_streams"]
        return f"met at {', '.join(map(str, levels))} stream(s)" if levels else "NOT met"

    lines += [
        "",
        f"Targets: added per-token p50 < {t['added_per_token_p50_ms']['target']} ms: {met('added_per_token_p50_ms')}"
        f"; p99 < {t['added_per_token_p99_ms']['target']} ms: {met('added_per_token_p99_ms')} "
        f"(of {', '.join(str(level['streams']) for level in results['latency'])}).",
        "",
        f"## Concurrent streams through one gateway ({cfg['capacity_tokens']} tokens each, one every "
        f"{cfg['capacity_interval_seconds'] * 1000:.0f} ms, all started at once)",
        "",
        "| streams started | peak open at once | errors | TTFT p99 (ms) | per-token p50 (ms) | per-token p99 (ms) "
        "| wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in results["capacity"]:
        lines.append(f"| {c['level']} | {c['peak_concurrent_streams']} | {c['errors']} | {c['ttft_ms']['p99']:.1f} | "
                     f"{c['per_token_ms']['p50']:.2f} | {c['per_token_ms']['p99']:.2f} | {c['wall_seconds']:.1f} |")
    lines += [
        "",
        f"Most concurrent streams sustained without an error: **{results['max_concurrent_streams_without_error']}** "
        f"(target >= {t['concurrent_streams']['target']}: {'met' if t['concurrent_streams']['met'] else 'NOT met'}).",
        "",
    ]
    if any("gateway_http_cpu_us_per_token" in level for level in results["latency"]):
        lines += ["Over HTTP (SSE: JSON encoding per chunk, HTTP/1.1 framing; `POST /v1/completions`, `stream: true`, "
                  "one connection per stream, read by a minimal HTTP/1.1 client), gateway CPU per token: " + ", ".join(
                      f"{level['gateway_http_cpu_us_per_token']:.0f} µs at {level['streams']} stream(s)"
                      for level in results["latency"]) + ". Added HTTP latency is against the direct gRPC path (the "
                  "engine side is gRPC either way), so it includes the client's SSE parsing.", ""]
    if "capacity_http" in results:
        lines += [
            "## Concurrent HTTP (SSE) streams through one gateway (same streams)",
            "",
            "| streams started | peak open at once | errors | TTFT p99 (ms) | per-token p50 (ms) | per-token p99 (ms) "
            "| wall (s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in results["capacity_http"]:
            lines.append(f"| {c['level']} | {c['peak_concurrent_streams']} | {c['errors']} | "
                         f"{c['ttft_ms']['p99']:.1f} | {c['per_token_ms']['p50']:.2f} | {c['per_token_ms']['p99']:.2f} "
                         f"| {c['wall_seconds']:.1f} |")
        if any(c["errors"] for c in results["capacity_http"]):
            lines += ["", "Errors seen: " + "; ".join(
                e for c in results["capacity_http"] for e in c["error_examples"])]
        http_met = t["http_concurrent_streams"]["met"]
        lines += [
            "",
            f"Most concurrent SSE streams sustained without an error: "
            f"**{results['max_concurrent_http_streams_without_error']}** (target >= "
            f"{t['http_concurrent_streams']['target']}: {'met' if http_met else 'NOT met'}); added HTTP per-token p50 "
            f"< {t['http_added_per_token_p50_ms']['target']} ms: {met('http_added_per_token_p50_ms')}.",
            "",
        ]
    if "baseline_capacity" in results:
        lines += [f"Baseline tree `{cfg['baseline_tree']}`, same levels after this tree's: " + ", ".join(
            f"{c['level']}: {c['errors']} errors, per-token p50/p99 {c['per_token_ms']['p50']:.2f}/"
            f"{c['per_token_ms']['p99']:.2f} ms" for c in results["baseline_capacity"])
            + f"; sustained **{results['baseline_max_concurrent_streams_without_error']}**.", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for level in results["latency"]:
        for name in ("direct", "gateway", "gateway_http"):
            if name not in level:
                continue
            values = sorted(level[name]["_per_token_ms"])
            if values:
                left.plot(values, [i / len(values) for i in range(len(values))],
                          label=f"{name}, {level['streams']} stream(s)")
    left.set_xscale("log")
    left.set_xlabel("per-token latency, send to receipt (ms, log)")
    left.set_ylabel("fraction of tokens")
    left.set_title("per-token latency: direct vs through the gateway")
    left.legend()
    levels = [c["level"] for c in results["capacity"]]
    right.plot(levels, [c["per_token_ms"]["p50"] for c in results["capacity"]], marker="o", label="p50")
    right.plot(levels, [c["per_token_ms"]["p99"] for c in results["capacity"]], marker="o", label="p99")
    for c in results["capacity"]:
        if c["errors"]:
            right.annotate(f"{c['errors']} errors", (c["level"], c["per_token_ms"]["p99"]))
    right.set_xlabel("concurrent streams through one gateway")
    right.set_ylabel("per-token latency (ms)")
    right.set_title("load")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict[str, Any], json_path: Path, command: str) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    plot(results, json_path.with_suffix(".png"))

    def strip(value: Any) -> Any:  # raw samples go to the plot, not the committed JSON
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not k.startswith("_")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    json_path.write_text(json.dumps({"command": command, **strip(results)}, indent=2) + "\n")
    json_path.with_suffix(".md").write_text(markdown(results, command))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="benchmarks/results/gateway.json")
    parser.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    parser.add_argument("--baseline-tree", help="a source tree (e.g. a checkout of the previous commit) whose gateway "
                                                "runs beside this one, interleaved in the same rounds")
    parser.add_argument("--layout", choices=LAYOUTS, default="pinned",
                        help="pinned: the gateway on a core of its own, fake engine and client on the others "
                             "(default); shared: all three processes on every core")
    args = parser.parse_args(argv)
    config = replace(QUICK if args.quick else BenchConfig(), layout=args.layout, baseline_tree=args.baseline_tree)
    command = ("python -m minedraft.gateway.bench" + (" --quick" if args.quick else "")
               + ("" if args.layout == "pinned" else f" --layout {args.layout}")
               + (f" --baseline-tree {args.baseline_tree}" if args.baseline_tree else "") + f" --json {args.json}")
    results = run(config)
    write_outputs(results, Path(args.json), command)
    print(Path(args.json).with_suffix(".md").read_text(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
