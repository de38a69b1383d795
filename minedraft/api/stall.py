"""Server-streaming writes with a stall watch: a gRPC caller that accepts nothing for a set time is cut.

A caller that stops reading leaves its call's flow-control window full, and the handler's next write waits for as
long as the caller stays connected (holding, at the gateway, an admission slot and an engine request). The handler
writes with `context.write` through a `StallWatch` instead of yielding: a write that has not returned after the limit
is cancelled, and the handler ends the call with UNAVAILABLE (`end_stalled_call`: the caller reads what was
buffered, then the status). Cancelling the handler's task alone would leave the call open on the caller's side with
no status at all; waiting for the status would hold the handler until the caller reads again.

One timer per stream, re-armed lazily (as the HTTP front end's send watch): each write costs two attribute writes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

# How long ending a cut call may wait for its status to go out. The status queues behind the unsent response (gRPC
# core sends it once the caller reads again), so the handler does not wait for it: the caller still reads it then.
STATUS_WAIT_S = 1.0


def stall_message(limit_s: float, tokens_sent: int) -> str:
    return f"stream cut: the client accepted nothing for {limit_s:g} s (after {tokens_sent} tokens)"


async def end_stalled_call(context: grpc.aio.ServicerContext, limit_s: float, tokens_sent: int) -> None:
    """End a call cut by its StallWatch with UNAVAILABLE (raises AbortError when the status went out at once; returns
    when it is left queued for the caller)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(context.abort(grpc.StatusCode.UNAVAILABLE, stall_message(limit_s, tokens_sent)),
                               STATUS_WAIT_S)


class StallWatch:
    """Watches one handler's writes (`await watch.write(context, response)`); `limit_s` None: never cut."""

    __slots__ = ("_handle", "_limit_s", "_loop", "_task", "expired", "since")

    def __init__(self, limit_s: float | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._limit_s = limit_s
        self.since: float | None = None  # when the write in progress started (None: not writing)
        self.expired = False
        self._handle: asyncio.TimerHandle | None = (
            self._loop.call_later(limit_s, self._fire) if limit_s is not None else None)

    @property
    def limit_s(self) -> float | None:
        return self._limit_s

    def _fire(self) -> None:
        assert self._limit_s is not None and self._task is not None
        since = self.since
        now = self._loop.time()
        if since is not None and now - since >= self._limit_s:
            # The task is waiting inside the write (since is set only there): the cancellation lands in it.
            self.expired = True
            self._handle = None
            self._task.cancel()
            return
        self._handle = self._loop.call_at((now if since is None else since) + self._limit_s, self._fire)

    async def write(self, context: grpc.aio.ServicerContext, message: Any) -> bool:
        """Write one message; False when the caller accepted nothing for the limit (the write was given up: end
        the call, e.g. with `context.abort(UNAVAILABLE, stall_message(...))`)."""
        if self._handle is None and not self.expired:
            await context.write(message)
            return True
        self.since = self._loop.time()
        try:
            await context.write(message)
        except asyncio.CancelledError:
            if not self.expired:
                raise  # the caller went away (or the server stops): not ours to absorb
            assert self._task is not None
            self._task.uncancel()
            return False
        finally:
            self.since = None
        return True

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
