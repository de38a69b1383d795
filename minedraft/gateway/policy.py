"""The gateway's decisions as pure code over plain data: the endpoint set, power-of-two-choices routing on
outstanding streams, admission, retry classification, bearer-token checks. No I/O here; tested in tests/unit."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

import grpc


@dataclass
class EndpointState:
    address: str
    # From the endpoint's grpc.health.v1 status.
    healthy: bool = False
    # Streams the gateway has open to it now: the load signal for routing.
    outstanding: int = 0
    # After a failed call, not picked again until this time (monotonic seconds), whatever health says: health only
    # reports changes, and a replica can fail calls while still claiming SERVING.
    cooldown_until_seconds: float = 0.0
    # A call to it stalled (a frozen process keeps its connections open and its health watch silent): out of
    # routing until a health check answers again.
    unresponsive: bool = False
    # It refused the gateway's own credential (UNAUTHENTICATED: a token rotated on one side only, a mismatch): out of
    # routing until an authenticated call succeeds again (its health, which needs no credential, cannot tell).
    credential_refused: bool = False

    def ready(self, now_seconds: float) -> bool:
        return (self.healthy and not self.unresponsive and not self.credential_refused
                and now_seconds >= self.cooldown_until_seconds)

    @property
    def routable(self) -> bool:
        """Ready but for a failure cool-down (which ends without an event)."""
        return self.healthy and not self.unresponsive and not self.credential_refused


class EndpointSet:
    """The engines the gateway knows, keyed by host:port."""

    def __init__(self) -> None:
        self._endpoints: dict[str, EndpointState] = {}

    def replace(self, addresses: Iterable[str]) -> tuple[set[str], set[str]]:
        """Make the set exactly `addresses`; returns (added, removed). Known endpoints keep their state."""
        wanted = set(addresses)
        current = set(self._endpoints)
        added, removed = wanted - current, current - wanted
        for address in removed:
            del self._endpoints[address]
        for address in sorted(added):
            self._endpoints[address] = EndpointState(address)
        return added, removed

    def get(self, address: str) -> EndpointState | None:
        return self._endpoints.get(address)

    def __len__(self) -> int:
        return len(self._endpoints)

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(list(self._endpoints.values()))

    @property
    def addresses(self) -> list[str]:
        return sorted(self._endpoints)

    def set_healthy(self, address: str, healthy: bool) -> bool:
        """Returns whether the endpoint is known (a removed one's late health report is ignored)."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            return False
        endpoint.healthy = healthy
        return True

    def ready(self, now_seconds: float, exclude: Iterable[str] = ()) -> list[EndpointState]:
        excluded = set(exclude)
        return [e for e in self._endpoints.values() if e.address not in excluded and e.ready(now_seconds)]

    def num_ready(self, now_seconds: float) -> int:
        return len(self.ready(now_seconds))

    def acquire(self, address: str) -> None:
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            endpoint.outstanding += 1

    def release(self, address: str) -> None:
        endpoint = self._endpoints.get(address)
        if endpoint is not None and endpoint.outstanding > 0:
            endpoint.outstanding -= 1

    def set_unresponsive(self, address: str, unresponsive: bool) -> None:
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            endpoint.unresponsive = unresponsive

    def set_credential_refused(self, address: str, refused: bool) -> None:
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            endpoint.credential_refused = refused

    def cool_down(self, address: str, until_seconds: float) -> None:
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            endpoint.cooldown_until_seconds = until_seconds


def choose_two(candidates: Sequence[EndpointState], rng: random.Random) -> EndpointState | None:
    """Power of two choices: sample two distinct candidates, take the one with fewer outstanding streams.

    Near least-loaded balance without every gateway herding onto the same single least-loaded engine.
    """
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    first, second = rng.sample(list(candidates), 2)
    return second if second.outstanding < first.outstanding else first


def pick(endpoints: EndpointSet, rng: random.Random, now_seconds: float,
         exclude: Iterable[str] = ()) -> EndpointState | None:
    return choose_two(endpoints.ready(now_seconds, exclude), rng)


class Admission:
    """Bounded in-flight streams per gateway: past the bound, refuse at once (RESOURCE_EXHAUSTED), never queue."""

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def try_acquire(self) -> bool:
        if self.in_flight >= self.max_in_flight:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)


class FailureAction(Enum):
    RETRY = "retry"  # no token streamed yet and the engine is unreachable or going away: try another engine
    PASS_THROUGH = "pass-through"  # the answer is about the request (bad request, deadline, cancel, an error the
    # request caused): it is the request's outcome, not retried, and the engine stays in rotation
    UNAVAILABLE_AFTER_TOKENS = "unavailable-after-tokens"  # tokens already out: end with UNAVAILABLE, say how many
    CREDENTIAL_REFUSED = "credential-refused"  # the engine refused the gateway's own credential: the engine out of
    # rotation, the stream tried elsewhere (the caller's credential is never forwarded, so this is never the caller's)


# Only these say the engine (not the request) failed: the channel's own UNAVAILABLE (connection refused or reset,
# keepalive timeout) and a replica's "I am draining/loading". UNKNOWN and INTERNAL are what a request that crashes
# the handler gets: retrying it would fail it on every engine and bench them all.
ENGINE_DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


def classify_failure(code: grpc.StatusCode, responses_sent: int) -> FailureAction:
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return FailureAction.CREDENTIAL_REFUSED
    if code not in ENGINE_DOWN_CODES:
        return FailureAction.PASS_THROUGH
    return FailureAction.RETRY if responses_sent == 0 else FailureAction.UNAVAILABLE_AFTER_TOKENS
