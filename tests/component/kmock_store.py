"""A stateful Kubernetes API on kmock's public interface: what kmock's KubernetesEmulator (0.8) lacks, in one place.

kmock's KubernetesEmulator stores objects and serves list/watch/get, but sets no uid, resourceVersion or generation
(kopf's JSON-patch `test` on resourceVersion then fails), ignores the namespace in the URL, has no PUT, keeps no
/status subresource apart, reports core's groupVersion as "/v1" and omits `apiVersion`/`kind` in lists; extending it
meant overriding its private request handling (`_handle`, `_serve_*`, its buses), which pinned kmock to one release.

KubernetesStore instead builds on kmock's public API only: KubernetesScaffold (discovery), the reaction DSL
(`fallback ** 1` so that a test's own reactions still win), kmock.Bus for watch streams, kmock.ObjectsArray for the
objects (`.objects`, as with KubernetesEmulator) and kmock.Request/Response. Each behaviour below is generic
Kubernetes semantics, written so it could go to kmock upstream unchanged; MineDraft's own needs (server-side apply,
bearer tokens, ending watches) are in tests/component/kube_emulator.py.

The generic behaviours, each as the API server does it:
- uid, creationTimestamp and generation on create; a new resourceVersion on every write; generation bumped when
  anything but metadata and status changes; an update naming an older resourceVersion is a 409 Conflict;
- the URL's namespace is the object's (a body naming another is a 400); generateName;
- PUT (replace), PATCH as JSON patch (a list) or JSON merge patch (RFC 7386: an object);
- /status separate from the rest for resources that declare it: writes to the object keep its status, writes to
  /status change nothing else;
- DELETE with finalizers sets deletionTimestamp; the object goes when its last finalizer does;
- lists carry `apiVersion`, `kind: <Kind>List` and a resourceVersion; watches start with the objects there are, then
  follow changes (no event lost in between);
- `/api/v1` reports `groupVersion: v1`; `/version` reports a configurable minor version.
Not emulated (tests assert on requests instead): garbage collection through owner references, strategic merge,
label and field selectors, admission.
"""

from __future__ import annotations

import collections
import copy
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import jsonpatch
from kmock import (
    Bus,
    Criteria,
    KubernetesError,
    KubernetesObjectNotFoundError,
    KubernetesResourceNotFoundError,
    KubernetesScaffold,
    ObjectsArray,
    Payload,
    Request,
    action,
    resource,
)
from kmock import method as http_method


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def without(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (`kubectl patch --type=merge`, kopf's patches): a null removes the key, objects merge
    recursively, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def is_object_request(request: Request) -> bool:
    """A request about a resource's objects (not discovery)."""
    return request.resource is not None and request.resource.plural is not None


def is_get(path: str) -> Callable[[Request], bool]:
    """A GET of exactly `path` (kmock's "get /path")."""
    return lambda request: request.method == http_method.GET and request.url.path == path


def is_create(request: Request) -> bool:
    return request.action == action.CREATE and is_object_request(request)


@attrs.frozen(eq=False)
class Verdict(Criteria):
    """A reaction's criterion, decided once per request.

    kmock tells whether a reaction serves a request by filtering the server's whole request history through the
    reaction's criteria (`request in view`, so that slices such as `kmock[...][:1]` count right), for every request
    and every reaction it tries. kmock's own criteria inspect signatures and typing Protocols on each evaluation, so
    with the thousands of requests an operator test makes (a drift pass every half second) the re-filtering was
    quadratic and dominated the tests (90 of the 100 s of one test, profiled). Here each request's verdict is the
    predicate's, taken when the request is first checked (its own arrival: the only verdict membership of the request
    being served depends on) and looked up on every re-filtering after."""

    predicate: Callable[[Request], bool]
    verdicts: dict[int, tuple[Request, bool]] = attrs.field(factory=dict, init=False)

    def __call__(self, request: Request) -> bool:
        kept = self.verdicts.get(id(request))
        if kept is not None and kept[0] is request:
            return kept[1]
        verdict = bool(self.predicate(request))
        self.verdicts[id(request)] = (request, verdict)  # the request held too: its id is never reused meanwhile
        return verdict


@attrs.define(kw_only=True)
class KubernetesStore(KubernetesScaffold):
    # kmock's scaffold says 1.26; report the version the manifests are validated against (the chart needs >= 1.30).
    server_minor: int = 34
    store: ObjectsArray = attrs.field(factory=ObjectsArray, init=False)
    buses: dict[resource, Bus[dict[str, Any]]] = attrs.field(factory=lambda: collections.defaultdict(Bus), init=False)
    versions: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Just above kmock's own fallbacks (discovery, 404s), below any reaction a test adds.
        # Criteria as Verdicts (above): kmock re-filters every earlier request through them on each request.
        ours = self.fallback ** 1
        ours[Verdict(is_get("/version"))] << self.serve_server_version
        ours[Verdict(is_get("/api/v1"))] << self.serve_core_version
        ours[Verdict(is_object_request)] << self.serve
        # A create answers 201. (A callable returning kmock.Response(status=201) would not do: kmock keeps that status
        # on the reaction, for every later answer.)
        (self.fallback ** 2)[Verdict(is_create)] << 201 << self.serve

    @property
    def objects(self) -> ObjectsArray:
        return self.store

    # -- what the scaffold does not know -----------------------------------------------------------------------------

    def kind_of(self, res: resource) -> str:
        for declared in self.resources:
            if declared == res and self.resources[declared].kind:
                return str(self.resources[declared].kind)
        return (res.plural or "").capitalize()

    def has_subresource(self, res: resource, name: str) -> bool:
        return any(declared == res and name in set(self.resources[declared].subresources)
                   for declared in self.resources)

    def known(self, res: resource) -> bool:
        return any(declared == res for declared in self.resources) or any(r == res for r, _, _ in self.store)

    async def serve_server_version(self) -> Payload:
        return {"major": "1", "minor": str(self.server_minor), "gitVersion": f"v1.{self.server_minor}.0",
                "platform": "linux/amd64"}

    async def serve_core_version(self) -> Payload:
        resources = []
        for res in self.resources:
            if res.group != "" or res.version != "v1" or res.plural is None:
                continue
            info = self.resources[res]
            for sub in {"", *info.subresources}:
                resources.append({"name": f"{res.plural}/{sub}" if sub else res.plural, "kind": self.kind_of(res),
                                  "singularName": info.singular or res.plural, "namespaced": info.namespaced,
                                  "verbs": list(info.verbs), "shortNames": list(info.shortnames),
                                  "categories": list(info.categories)})
        return {"apiVersion": "v1", "kind": "APIResourceList", "groupVersion": "v1", "resources": resources}

    # -- the object store ------------------------------------------------------------------------------------------

    def current(self, request: Request, name: str | None = None) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, name or request.name)
        if key not in self.store or self.store[key].deleted:
            return None
        return copy.deepcopy(dict(self.store[key].raw))

    def stamp(self, new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        meta = new.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self.versions))
        if old is None:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now())
            meta["generation"] = 1
        else:
            old_meta = old.get("metadata", {})
            for key in ("uid", "creationTimestamp"):
                if key in old_meta:
                    meta[key] = old_meta[key]
            changed = without(new, "metadata", "status") != without(old, "metadata", "status")
            meta["generation"] = int(old_meta.get("generation", 1)) + (1 if changed else 0)
        return new

    async def store_object(self, request: Request, new: dict[str, Any], event: str) -> dict[str, Any]:
        assert request.resource is not None
        key = (request.resource, request.namespace, new["metadata"]["name"])
        if key in self.store:
            self.store[key].create(new)  # a new full version (kmock's create() appends to the history)
        else:
            self.store[key] = new
        await self.buses[request.resource].put({"type": event, "object": copy.deepcopy(new)})
        return new

    async def finish_delete(self, request: Request) -> dict[str, Any]:
        assert request.resource is not None
        key = (request.resource, request.namespace, request.name)
        last = copy.deepcopy(dict(self.store[key].raw))
        self.store[key].delete()
        await self.buses[request.resource].put({"type": "DELETED", "object": last})
        return last

    # -- verbs -----------------------------------------------------------------------------------------------------

    async def serve(self, request: Request) -> Payload:
        method = str(request.method.value).upper() if request.method is not None else ""
        if method == "PUT" and request.name is not None:  # kmock's action for a PUT is CREATE
            return await self.put(request)
        if request.action == action.CREATE:
            return await self.create(request, request.data or {})
        if request.action == action.UPDATE:
            return await self.patch(request)
        if request.action == action.DELETE:
            return await self.delete(request)
        if request.action == action.WATCH:
            return self.watch(request)
        if request.action == action.LIST:
            return await self.list(request)
        if request.action == action.FETCH:
            obj = self.current(request)
            if obj is None:
                raise KubernetesObjectNotFoundError()
            return obj
        raise KubernetesError(status=405, reason="MethodNotAllowed", message=f"{method} is not supported here")

    async def create(self, request: Request, body: dict[str, Any]) -> Payload:
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
        named = attrs.evolve(request, name=meta["name"]) if request.name is None else request
        if self.current(named) is not None:
            raise KubernetesError(status=409, reason="AlreadyExists", message=f"{meta['name']} already exists")
        return await self.store_object(named, self.stamp(body, None), "ADDED")

    async def update(self, request: Request, old: dict[str, Any], new: dict[str, Any],
                     status_only: bool) -> dict[str, Any]:
        assert request.resource is not None
        if status_only:
            new = {**old, "status": new.get("status", old.get("status")), "metadata": old["metadata"]}
        elif self.has_subresource(request.resource, "status"):
            new = {**new, "status": old.get("status")} if "status" in old else without(new, "status")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if want_rv and want_rv != old["metadata"].get("resourceVersion"):
            raise KubernetesError(status=409, reason="Conflict",
                                  message="the object has been modified; please apply your changes to the latest "
                                          "version and try again")
        new.setdefault("metadata", {})
        new["metadata"]["name"], new["metadata"]["namespace"] = old["metadata"]["name"], request.namespace
        stored = await self.store_object(request, self.stamp(new, old), "MODIFIED")
        meta = stored["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self.finish_delete(request)
        return stored

    async def patch(self, request: Request) -> Payload:
        old = self.current(request)
        if old is None:
            raise KubernetesObjectNotFoundError()
        try:
            if isinstance(request.data, list):
                new = jsonpatch.apply_patch(old, request.data, in_place=False)
            else:
                new = merge_patch(old, request.data or {})
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
            raise KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        return await self.update(request, old, new, request.subresource == "status")

    async def put(self, request: Request) -> Payload:
        old = self.current(request)
        if old is None:
            raise KubernetesObjectNotFoundError()
        return await self.update(request, old, copy.deepcopy(request.data), request.subresource == "status")

    async def delete(self, request: Request) -> Payload:
        old = self.current(request)
        if old is None:
            raise KubernetesObjectNotFoundError()
        if old["metadata"].get("finalizers"):
            if not old["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(old)
                new["metadata"]["deletionTimestamp"] = now()
                return await self.store_object(request, self.stamp(new, old), "MODIFIED")
            return old
        return await self.finish_delete(request)

    def matching(self, request: Request) -> list[dict[str, Any]]:
        """The live objects a list or watch request covers (all namespaces when the URL names none)."""
        return [copy.deepcopy(dict(obj.raw)) for (res, namespace, name), obj in list(self.store.items())
                if res == request.resource and not obj.deleted
                and request.namespace in (None, namespace) and request.name in (None, name)]

    async def list(self, request: Request) -> Payload:
        assert request.resource is not None
        if not self.known(request.resource):
            raise KubernetesResourceNotFoundError()
        group, version = request.resource.group, request.resource.version
        return {"apiVersion": f"{group}/{version}" if group else str(version),
                "kind": f"{self.kind_of(request.resource)}List",
                "metadata": {"resourceVersion": str(next(self.versions))}, "items": self.matching(request)}

    async def watch(self, request: Request) -> AsyncIterator[Payload]:
        assert request.resource is not None
        yield b""  # the headers go out now, even when nothing happens for a while
        bus = self.buses[request.resource]
        mark = await bus.mark()  # before the snapshot: no change between the two is lost
        try:
            for obj in self.matching(request):
                yield {"type": "ADDED", "object": obj}
            async for event in mark:
                meta = (event.get("object") or {}).get("metadata") or {}
                if request.namespace in (None, meta.get("namespace")) and request.name in (None, meta.get("name")):
                    yield event
        finally:
            await bus.unmark(mark)
