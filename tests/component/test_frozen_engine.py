"""A frozen engine (its process stopped: the kernel keeps its TCP connections open and its health watch just goes
quiet) is noticed by the gateway within the channels' keepalive time plus timeout, as the gRPC policy says: gRPC
core also times keepalive pings by its own ping timeout (60 s by default), which the policy sets to the keepalive
timeout. Measured before the fix: an idle engine frozen this way stayed ready at the gateway for 79 s (20 + 60)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from minedraft.api import grpc_policy
from minedraft.gateway import pool
from minedraft.gateway.app import Gateway

from .gateway_stack import fast_config
from .grpc_helpers import wait_for

SHORT_MS = 500  # keepalive time and timeout here, for a quick test (the policy's: 20 s and 10 s)


@pytest.fixture
def short_keepalive(monkeypatch):
    """The gateway's engine channels with the policy's options, the keepalive time and every timeout equal to the
    keepalive timeout shortened (so a policy without its ping timeout keeps gRPC's 60 s)."""
    def shortened(key: str, value: int) -> int:
        return SHORT_MS if key == "grpc.keepalive_time_ms" or value == grpc_policy.KEEPALIVE_TIMEOUT_MS else value

    monkeypatch.setattr(pool, "ENGINE_CHANNEL_OPTIONS",
                        tuple((key, shortened(key, value)) for key, value in pool.ENGINE_CHANNEL_OPTIONS))


async def test_an_idle_frozen_engine_leaves_rotation_within_keepalive(short_keepalive):
    engine = subprocess.Popen([sys.executable, "-m", "minedraft.testing.fake_engine", "--port", "0"],
                              stderr=subprocess.PIPE, text=True)
    gateway = Gateway(fast_config())
    try:
        assert engine.stderr is not None
        address = engine.stderr.readline().split()[-1]  # "fake engine on 127.0.0.1:PORT"
        await gateway.start()
        gateway.set_engines([address])
        await wait_for(gateway.ready, what="the engine ready")
        os.kill(engine.pid, signal.SIGSTOP)
        # Within keepalive time plus timeout (1 s here) and the health watch's retry, with room for a loaded
        # machine; gRPC's default ping timeout alone is 60 s.
        await wait_for(lambda: not gateway.ready(), timeout_seconds=30, what="the frozen engine out of rotation")
    finally:
        engine.kill()
        engine.wait()
        await gateway.stop()
