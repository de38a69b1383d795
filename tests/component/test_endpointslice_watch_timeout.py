"""The gateway's EndpointSlice watch cannot freeze discovery (issue 30, defect 9).

A watch is one long HTTP response. A NAT, a load balancer in front of the API server or a node's conntrack table can
drop it without a FIN or RST: the client then waits for bytes that never come, and engines that come and go are no
longer seen. The watch now asks the API server to end it (timeoutSeconds) and treats a longer silence as a dead
connection. Modelled here with a loopback API server whose watch accepts the request and then never sends anything
(what a silently dropped connection looks like from the client's side); a real dropped connection is the real
cluster's to show.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from minedraft.gateway.discovery import EndpointSliceWatcher, KubernetesApi

pytestmark = pytest.mark.timeout(60)


def slice_with(address: str) -> dict[str, Any]:
    return {"metadata": {"name": "e-1", "labels": {"kubernetes.io/service-name": "e"}},
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": "grpc", "port": 50051}]}


async def test_a_silent_watch_is_abandoned_and_the_service_listed_again() -> None:
    watches: list[dict[str, str]] = []
    listings = [0]
    hang = asyncio.Event()

    async def endpointslices(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") == "true":
            watches.append(dict(request.query))
            response = web.StreamResponse()
            await response.prepare(request)
            await hang.wait()  # the connection is "up" and says nothing, ever
            return response
        listings[0] += 1
        address = "10.0.0.1" if listings[0] == 1 else "10.0.0.2"
        return web.Response(text=json.dumps({"metadata": {"resourceVersion": str(listings[0])},
                                             "items": [slice_with(address)]}), content_type="application/json")

    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", endpointslices)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    seen: list[set[str]] = []
    watcher = EndpointSliceWatcher(KubernetesApi(f"http://127.0.0.1:{port}"), "ns", "e", "grpc", seen.append,
                                   retry_seconds=0.05, watch_timeout_seconds=1, read_margin_seconds=0.5)
    task = asyncio.create_task(watcher.run())
    try:
        for _ in range(400):
            if watcher.num_lists >= 2:
                break
            await asyncio.sleep(0.05)
        # The silent watch was given up and the Service listed again: the engine that replaced the first is seen.
        assert watcher.num_lists >= 2
        assert seen[-1] == {"10.0.0.2:50051"}
        # The API server is asked to end each watch itself.
        assert watches and all(w.get("timeoutSeconds") == "1" for w in watches)
    finally:
        hang.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()


def test_the_default_watch_ends_within_minutes() -> None:
    watcher = EndpointSliceWatcher(KubernetesApi("http://x"), "ns", "e", "grpc", lambda _: None)
    assert 0 < watcher.watch_timeout_seconds <= 600 and watcher.read_margin_seconds > 0
