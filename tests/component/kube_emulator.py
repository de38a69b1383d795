"""The Kubernetes API emulator the operator, gateway and Helm tests run against: tests/component/kmock_store.py's
generic store (on kmock's public API) plus what MineDraft's tests need of an API server beyond it:

- server-side apply, emulated as a replace of everything but status: right for one field manager applying full
  objects (the operator), wrong where several managers share an object;
- the /scale subresource of the MineDraft CRD (an autoscaling/v1 Scale view of spec.replicas);
- bearer tokens: with `accepted_tokens` set, only requests bearing one are served (others get 401), as with bound
  tokens that expire;
- ending open watches (`end_watches`), as an API server does at its request timeout: clients then list again, with
  whatever credentials they hold by then.
Still not emulated (tests assert on requests instead): real server-side apply field ownership.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator

import attrs
from kmock import KubernetesError, KubernetesObjectNotFoundError, Payload, Request

from tests.component.kmock_store import KubernetesStore, Verdict

APPLY_PATCH = "application/apply-patch+yaml"
# Above any reaction a test adds: a request without an accepted token is refused before anything else sees it.
AUTH_PRIORITY = 1000


@attrs.define(kw_only=True)
class KubeEmulator(KubernetesStore):
    # When set, only requests bearing one of these tokens are served (others get 401); None serves everyone.
    accepted_tokens: set[str] | None = None
    watch_epoch: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        (self ** AUTH_PRIORITY)[Verdict(self.unauthorised)] << KubernetesError(status=401, reason="Unauthorized",
                                                                                 message="Unauthorized")

    def unauthorised(self, request: Request) -> bool:
        if self.accepted_tokens is None:
            return False
        auth = request.headers.get("Authorization") or ""
        return auth.removeprefix("Bearer ").strip() not in self.accepted_tokens

    async def serve(self, request: Request) -> Payload:
        if request.subresource == "scale":
            return await self.scale(request)
        return await super().serve(request)

    async def patch(self, request: Request) -> Payload:
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        if content_type != APPLY_PATCH or request.subresource == "status":
            return await super().patch(request)
        old = self.current(request)
        if old is None:
            return await self.create(attrs.evolve(request, name=None), request.data)
        # One field manager applying its full object: what it no longer sets goes (see the module docstring).
        new = copy.deepcopy(request.data or {})
        if "status" in old:
            new["status"] = old["status"]
        return await self.update(request, old, new, status_only=False)

    async def scale(self, request: Request) -> Payload:
        """The /scale subresource: an autoscaling/v1 Scale view of spec.replicas (as the CRD's paths declare)."""
        old = self.current(request)
        if old is None:
            raise KubernetesObjectNotFoundError()
        if str(request.method.value).upper() in ("PATCH", "PUT"):
            data = request.data or {}
            replicas = (data.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise KubernetesError(status=422, reason="Invalid", message="spec.replicas: must be an integer >= 0")
            new = copy.deepcopy(old)
            new.setdefault("spec", {})["replicas"] = replicas
            await self.update(attrs.evolve(request, subresource=None), old, new, status_only=False)
            old = self.current(request) or new
        meta = old["metadata"]
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta},
            "spec": {"replicas": (old.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": (old.get("status") or {}).get("replicas", 0),
                       "selector": (old.get("status") or {}).get("selector", "")},
        }

    async def end_watches(self, namespace: str) -> None:
        """End every open watch stream in a namespace (an API server ends each at its request timeout)."""
        self.watch_epoch += 1
        for bus in list(self.buses.values()):
            # Wakes the streams up; they see the new epoch and end without sending this event.
            await bus.put({"type": "BOOKMARK", "object": {"metadata": {"namespace": namespace, "name": "",
                                                                       "resourceVersion": "0"}}})

    async def watch(self, request: Request) -> AsyncIterator[Payload]:
        epoch = self.watch_epoch
        async for item in super().watch(request):
            if self.watch_epoch != epoch:
                return
            yield item


__all__ = ["APPLY_PATCH", "KubeEmulator"]
