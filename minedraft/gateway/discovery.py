"""Where the engines are: a static list, or the EndpointSlices of a Kubernetes Service, watched.

The watch speaks the Kubernetes API directly over aiohttp (list, then watch from the list's resourceVersion; on
any break, list again), so replicas that come and go are picked up without a restart. What counts as an address
is pure code (addresses_from_slice, SliceTracker) tested without I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def parse_engines(value: str) -> list[str]:
    """`host:port,host:port` -> addresses (each must have a port)."""
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"engines: {address!r} is not host:port")
    return addresses


def parse_service(value: str) -> tuple[str, str]:
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"kubernetes-service: {value!r} is not NAMESPACE/NAME")
    return namespace, name


def _format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def addresses_from_slice(endpoint_slice: Mapping[str, Any], port_name: str | None) -> set[str]:
    """Ready endpoints of one EndpointSlice as host:port.

    `conditions.ready` unset means ready (the API's own rule); terminating endpoints report ready=false. The port is
    the one named port_name, or the only port when the slice has exactly one.
    """
    ports = endpoint_slice.get("ports") or []
    port: int | None = None
    for candidate in ports:
        if port_name is not None and candidate.get("name") == port_name:
            port = candidate.get("port")
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if port is None:
        return set()
    addresses: set[str] = set()
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False:
            continue
        addresses.update(_format_address(ip, int(port)) for ip in endpoint.get("addresses") or [])
    return addresses


@dataclass
class SliceTracker:
    """The union of ready addresses over a Service's EndpointSlices, kept up to date from list and watch events."""

    service: str
    port_name: str | None
    by_slice: dict[str, set[str]] = field(default_factory=dict)

    def _belongs(self, obj: Mapping[str, Any]) -> bool:
        # Filtered here as well as by the label selector sent to the API (some API emulators ignore selectors).
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return labels.get(SERVICE_NAME_LABEL) == self.service

    @property
    def addresses(self) -> set[str]:
        return set().union(*self.by_slice.values()) if self.by_slice else set()

    def reset(self, items: list[Mapping[str, Any]]) -> None:
        self.by_slice = {
            obj["metadata"]["name"]: addresses_from_slice(obj, self.port_name) for obj in items if self._belongs(obj)
        }

    def apply(self, event: Mapping[str, Any]) -> bool:
        """Apply one watch event; returns whether the address set changed."""
        obj = event.get("object") or {}
        if event.get("type") not in ("ADDED", "MODIFIED", "DELETED") or not self._belongs(obj):
            return False
        before = self.addresses
        name = obj["metadata"]["name"]
        if event["type"] == "DELETED":
            self.by_slice.pop(name, None)
        else:
            self.by_slice[name] = addresses_from_slice(obj, self.port_name)
        return self.addresses != before


@dataclass(frozen=True)
class KubernetesApi:
    """How to reach the API server: in-cluster service account by default, or an explicit URL (kubectl proxy,
    tests).

    With token_file, the token is read from that file for every request: projected service-account tokens expire
    (about an hour) and the kubelet rewrites the file before they do, so a token read once stops working.
    """

    base_url: str
    token: str | None = None
    ca_file: str | None = None
    token_file: str | None = None

    @classmethod
    def in_cluster(cls) -> KubernetesApi:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a cluster (KUBERNETES_SERVICE_HOST unset): pass --kubernetes-api URL")
        token_file = SERVICE_ACCOUNT_DIR / "token"
        return cls(base_url=f"https://{_format_address(host, int(port))}",
                   token_file=str(token_file) if token_file.exists() else None,
                   ca_file=str(SERVICE_ACCOUNT_DIR / "ca.crt"))

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None

    def current_token(self) -> str | None:
        if self.token_file is not None:
            try:
                return Path(self.token_file).read_text().strip() or self.token
            except OSError as exc:  # mid-rotation (the kubelet swaps a symlink): the next request reads again
                log.warning("cannot read the service-account token %s: %s", self.token_file, exc)
        return self.token

    def headers(self) -> dict[str, str]:
        """Request headers with the token as it is now (read again for every request)."""
        token = self.current_token()
        return {"Authorization": f"Bearer {token}"} if token else {}


class EndpointSliceWatcher:
    """Calls on_change(addresses) with the Service's ready engine addresses whenever they change."""

    # The API server ends each watch after this long (the watch's timeoutSeconds) and the loop lists again; a
    # watch that receives nothing for longer than that plus a margin is a dead connection (a NAT or load balancer
    # that dropped it without a FIN or RST): it is abandoned and the Service listed again, never waited on forever.
    WATCH_TIMEOUT_SECONDS = 300
    READ_MARGIN_SECONDS = 30

    def __init__(self, api: KubernetesApi, namespace: str, service: str, port_name: str | None,
                 on_change: Callable[[set[str]], None], retry_seconds: float = 1.0,
                 watch_timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
                 read_margin_seconds: float = READ_MARGIN_SECONDS) -> None:
        self.api = api
        self.namespace = namespace
        self.tracker = SliceTracker(service, port_name)
        self.on_change = on_change
        self.retry_seconds = retry_seconds
        self.watch_timeout_seconds = watch_timeout_seconds
        self.read_margin_seconds = read_margin_seconds
        self.num_lists = 0

    @property
    def _url(self) -> str:
        return f"{self.api.base_url}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def _params(self) -> dict[str, str]:
        return {"labelSelector": f"{SERVICE_NAME_LABEL}={self.tracker.service}"}

    async def run(self) -> None:
        import aiohttp

        # sock_read: the longest silence on a watch (the server's own end of it, plus a margin) before the
        # connection counts as dead.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10,
                                        sock_read=self.watch_timeout_seconds + self.read_margin_seconds)
        # No session-wide headers: each request carries the token current at that moment (rotation).
        async with aiohttp.ClientSession(timeout=timeout) as session:
            ssl_context = self.api.ssl_context()
            while True:
                try:
                    await self._list_and_watch(session, ssl_context)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # API restarts, network blips, expired resourceVersions: list again
                    log.warning("endpointslice watch of %s/%s broke: %s; listing again in %.1fs",
                                self.namespace, self.tracker.service, exc, self.retry_seconds)
                await asyncio.sleep(self.retry_seconds)

    async def _list_and_watch(self, session: Any, ssl_context: ssl.SSLContext | None) -> None:
        async with session.get(self._url, params=self._params(), ssl=ssl_context,
                               headers=self.api.headers()) as response:
            response.raise_for_status()  # a 401 (token expired) lists again, with the token read again
            listing = await response.json()
        self.num_lists += 1
        before = self.tracker.addresses
        self.tracker.reset(listing.get("items") or [])
        if self.num_lists == 1 or self.tracker.addresses != before:
            self.on_change(self.tracker.addresses)
        params = {**self._params(), "watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.watch_timeout_seconds)}
        resource_version = (listing.get("metadata") or {}).get("resourceVersion")
        if resource_version:
            params["resourceVersion"] = resource_version
        async with session.get(self._url, params=params, ssl=ssl_context, headers=self.api.headers()) as response:
            response.raise_for_status()
            async for raw_line in response.content:
                line = raw_line.strip()
                if not line:
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old
                    raise RuntimeError(f"watch error: {event.get('object')}")
                if self.tracker.apply(event):
                    self.on_change(self.tracker.addresses)
        # The server closed the watch (its timeout): the loop lists and watches again.
