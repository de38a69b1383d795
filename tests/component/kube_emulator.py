"""A Kubernetes API emulator good enough for the real kopf operator and Helm: kmock's, with what it lacks added.

kmock 0.8's KubernetesEmulator stores objects and serves list/watch/get, but (docs/architecture.md) sets no uid,
resourceVersion or generation (kopf's JSON-patch `test` on resourceVersion then fails), ignores the URL's namespace,
has no PUT, no server-side apply, no /status or /scale separation, reports core's groupVersion as "/v1" and omits
`kind` in lists. This subclass adds those, plus bearer-token checks (accepted_tokens) and ending open watches (as an
API server does at its request timeout). Server-side apply is emulated as a replace of everything but status: right
for one field manager applying full objects (the operator), wrong where several managers share an object. Still not
emulated (tests assert on requests instead): garbage collection through owner references, real server-side apply
field ownership, strategic merge, label selectors, admission.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
from kmock import KubernetesEmulator, KubernetesError, KubernetesObjectNotFoundError, Payload, Request, action, resource

APPLY_PATCH = "application/apply-patch+yaml"


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _without(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what `kubectl patch --type=merge` sends; also the default of kopf's patches): a
    null removes the key, objects merge recursively, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


@attrs.define(kw_only=True)
class KubeEmulator(KubernetesEmulator):
    _versions: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)
    # kmock says 1.26; by default report the version the manifests are validated against (the chart needs >= 1.30).
    server_minor: int = 34
    # When set, only requests bearing one of these tokens are served (others get 401), as with bound tokens that
    # expire; None serves everyone.
    accepted_tokens: set[str] | None = None
    _watch_epoch: int = attrs.field(default=0, init=False)

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _kind(self, res: resource) -> str:
        info = self.resources[res] if res in list(self.resources) else None
        kind = getattr(info, "kind", None) if info is not None else None
        return kind or (res.plural or "").capitalize()

    def _has_subresource(self, res: resource, name: str) -> bool:
        for declared in self.resources:
            if declared == res:
                return name in set(self.resources[declared].subresources)
        return False

    def _stamp(self, new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        meta = new.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._versions))
        if old is None:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            meta["generation"] = 1
        else:
            old_meta = old.get("metadata", {})
            for key in ("uid", "creationTimestamp"):
                if key in old_meta:
                    meta[key] = old_meta[key]
            changed = _without(new, "metadata", "status") != _without(old, "metadata", "status")
            meta["generation"] = int(old_meta.get("generation", 1)) + (1 if changed else 0)
        return new

    def _current(self, request: Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    async def _store(self, request: Request, new: dict[str, Any], event: str) -> dict[str, Any]:
        assert request.resource is not None
        key = (request.resource, request.namespace, new["metadata"]["name"])
        if key in self.objects:
            self.objects[key].create(new)  # a new full version (kmock's create() appends to the history)
        else:
            self.objects[key] = new
        await self._buses[request.resource].put({"type": event, "object": copy.deepcopy(new)})
        return new

    @staticmethod
    def _json(obj: dict[str, Any], status: int = 200) -> aiohttp.web.StreamResponse:
        return aiohttp.web.json_response(obj, status=status)

    # -- verbs ---------------------------------------------------------------------------------------------------

    async def _create(self, request: Request, body: dict[str, Any]) -> aiohttp.web.StreamResponse:
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        if not meta.get("name"):
            raise KubernetesError(status=422, reason="Invalid", message="metadata.name: Required value")
        if request.namespace is not None:
            if meta.get("namespace") not in (None, request.namespace):
                raise KubernetesError(status=400, reason="BadRequest",
                                      message="the namespace of the object does not match the namespace on the URL")
            meta["namespace"] = request.namespace
        request_for_name = attrs.evolve(request, name=meta["name"]) if request.name is None else request
        if self._current(request_for_name) is not None:
            raise KubernetesError(status=409, reason="AlreadyExists", message=f"{meta['name']} already exists")
        return self._json(await self._store(request_for_name, self._stamp(body, None), "ADDED"), 201)

    async def _update(self, request: Request, old: dict[str, Any], new: dict[str, Any],
                      status_only: bool) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        if status_only:
            new = {**old, "status": new.get("status", old.get("status")), "metadata": old["metadata"]}
        elif self._has_subresource(request.resource, "status"):
            new = {**new, "status": old.get("status")} if "status" in old else _without(new, "status")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if want_rv and want_rv != old["metadata"].get("resourceVersion"):
            raise KubernetesError(status=409, reason="Conflict",
                                  message="the object has been modified; please apply your changes to the latest "
                                          "version and try again")
        new.setdefault("metadata", {})
        new["metadata"]["name"], new["metadata"]["namespace"] = old["metadata"]["name"], request.namespace
        stored = await self._store(request, self._stamp(new, old), "MODIFIED")
        meta = stored["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._finish_delete(request)
        return self._json(stored)

    async def _finish_delete(self, request: Request) -> dict[str, Any]:
        assert request.resource is not None
        key = (request.resource, request.namespace, request.name)
        last = copy.deepcopy(self.objects[key].raw)
        self.objects[key].delete()
        await self._buses[request.resource].put({"type": "DELETED", "object": last})
        return last

    async def _patch(self, request: Request) -> aiohttp.web.StreamResponse:
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        old = self._current(request)
        status_only = request.subresource == "status"
        if old is None:
            if content_type == APPLY_PATCH and not status_only:
                return await self._create(attrs.evolve(request, name=None), request.data)
            raise KubernetesObjectNotFoundError()
        if content_type == APPLY_PATCH and not status_only:
            # One field manager applying its full object: what it no longer sets goes (see the module docstring).
            new = copy.deepcopy(request.data or {})
            if "status" in old:
                new["status"] = old["status"]
            return await self._update(request, old, new, status_only)
        try:
            if isinstance(request.data, list):
                new = jsonpatch.apply_patch(old, request.data, in_place=False)
            else:
                new = merge_patch(old, request.data or {})
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
            raise KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        return await self._update(request, old, new, status_only)

    async def _put(self, request: Request) -> aiohttp.web.StreamResponse:
        old = self._current(request)
        if old is None:
            raise KubernetesObjectNotFoundError()
        return await self._update(request, old, copy.deepcopy(request.data), request.subresource == "status")

    async def _delete(self, request: Request) -> aiohttp.web.StreamResponse:
        old = self._current(request)
        if old is None:
            raise KubernetesObjectNotFoundError()
        if old["metadata"].get("finalizers"):
            if not old["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(old)
                new["metadata"]["deletionTimestamp"] = _now()
                return self._json(await self._store(request, self._stamp(new, old), "MODIFIED"))
            return self._json(old)
        return self._json(await self._finish_delete(request))

    async def _scale(self, request: Request) -> aiohttp.web.StreamResponse:
        """The /scale subresource: an autoscaling/v1 Scale view of spec.replicas (as the CRD's paths declare)."""
        old = self._current(request)
        if old is None:
            raise KubernetesObjectNotFoundError()
        if request.method.upper() in ("PATCH", "PUT"):
            data = request.data or {}
            replicas = (data.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise KubernetesError(status=422, reason="Invalid", message="spec.replicas: must be an integer >= 0")
            new = copy.deepcopy(old)
            new.setdefault("spec", {})["replicas"] = replicas
            await self._update(attrs.evolve(request, subresource=None), old, new, status_only=False)
            old = self._current(request) or new
        meta = old["metadata"]
        return self._json({
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta},
            "spec": {"replicas": (old.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": (old.get("status") or {}).get("replicas", 0),
                       "selector": (old.get("status") or {}).get("selector", "")},
        })

    # -- entry point ---------------------------------------------------------------------------------------------

    async def end_watches(self, namespace: str) -> None:
        """End every open watch stream in a namespace (an API server ends each at its request timeout); clients
        then list again, with whatever credentials they hold by then."""
        self._watch_epoch += 1
        for bus in list(self._buses.values()):
            # Wakes the streams up; they see the new epoch and end without sending this event.
            await bus.put({"type": "BOOKMARK", "object": {"metadata": {"namespace": namespace, "name": "",
                                                                       "resourceVersion": "0"}}})

    async def _serve_watch(self, request: Request) -> Any:
        epoch = self._watch_epoch
        async for item in super()._serve_watch(request):
            if self._watch_epoch != epoch:
                return
            yield item

    async def _handle(self, request: Request) -> aiohttp.web.StreamResponse:
        if self.accepted_tokens is not None:
            auth = request.headers.get("Authorization") or ""
            if auth.removeprefix("Bearer ").strip() not in self.accepted_tokens:
                raise KubernetesError(status=401, reason="Unauthorized", message="Unauthorized")
        if request.resource is None or request.resource.plural is None:
            return await super()._handle(request)
        method = request.method.upper()
        if request.subresource == "scale":
            return await self._scale(request)
        if request.action == action.CREATE:
            return await self._create(request, request.data or {})
        if method == "PUT" and request.name is not None:
            return await self._put(request)
        if request.action == action.UPDATE:
            return await self._patch(request)
        if request.action == action.DELETE:
            return await self._delete(request)
        return await super()._handle(request)

    # -- reads: fix what Go clients and kopf need ---------------------------------------------------------------

    async def _serve_server_version(self, request: Request) -> Payload:
        return {"major": "1", "minor": str(self.server_minor), "gitVersion": f"v1.{self.server_minor}.0",
                "platform": "linux/amd64"}

    async def _serve_list(self, request: Request) -> Payload:
        result = await super()._serve_list(request)
        assert isinstance(result, dict) and request.resource is not None
        group, version = request.resource.group, request.resource.version
        return {"apiVersion": f"{group}/{version}" if group else str(version),
                "kind": f"{self._kind(request.resource)}List",
                **result, "metadata": {"resourceVersion": str(next(self._versions))}}

    async def _serve_version(self, request: Request) -> Payload:
        result = await super()._serve_version(request)
        assert isinstance(result, dict) and request.resource is not None
        if request.resource.group == "":
            result["groupVersion"] = str(request.resource.version)
        return result
