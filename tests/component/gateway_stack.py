"""A real gateway routing to fake engine replicas (real aio gRPC servers on loopback), shared by the gateway tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from minedraft.gateway.app import Gateway, GatewayConfig
from minedraft.testing.fake_engine import FakeBehaviour, FakeEngineServer

from .grpc_helpers import wait_for

# Fast failure handling so tests about unhealthy engines take tenths of a second, not the production defaults.
FAST = {"health_retry_seconds": 0.05, "failure_cooldown_seconds": 1.0, "seed": 0}


def fast_config(**changes: Any) -> GatewayConfig:
    return GatewayConfig(**{**FAST, **changes})


@dataclass
class FakeStack:
    gateway: Gateway
    fakes: list[FakeEngineServer]
    target: str  # the gateway's gRPC address
    registry: CollectorRegistry | None
    http_url: str | None = None  # set when the HTTP port was started


@dataclass
class FakeStacks:
    created: list[FakeStack] = field(default_factory=list)

    async def make(self, behaviours: list[FakeBehaviour], config: GatewayConfig | None = None,
                   engines: bool = True, registry: CollectorRegistry | None = None, http: bool = False,
                   scheme: str = "http") -> FakeStack:
        """Fakes started, the gateway started and (with `engines`) routing to them with every one healthy."""
        fakes = [await FakeEngineServer(f"fake-{i}", b).start() for i, b in enumerate(behaviours)]
        gateway = Gateway(config or fast_config(), registry)
        stack = FakeStack(gateway, fakes, "", registry)
        self.created.append(stack)
        await gateway.start()
        stack.target = f"127.0.0.1:{gateway.port}"
        if http:
            stack.http_url = f"{scheme}://127.0.0.1:{await gateway.start_http('127.0.0.1', 0)}"
        if engines:
            gateway.set_engines([f.address for f in fakes])
            await wait_for(lambda: sum(e.healthy for e in gateway.endpoints) == len(fakes), what="engines healthy")
        return stack

    async def close(self) -> None:
        for stack in self.created:
            await stack.gateway.stop()
            for fake in stack.fakes:
                await fake.stop(0)
