"""gRPC's rich error model for MineDraft's field errors: what the engine server and the fake engine send, what the
gateway passes through, and how either side reads the invalid field back.

A refused request ends with INVALID_ARGUMENT whose `grpc-status-details-bin` trailer is a `google.rpc.Status`
holding a `google.rpc.BadRequest` with one field violation (the field's path, e.g. `sampling_params.max_tokens`,
and what is wrong with it): the standard that grpcurl, Envoy's gRPC-JSON transcoder and the Go/Java/Python clients'
status helpers (`grpc_status.rpc_status.from_call` in Python) read. The older `minedraft-invalid-field` trailer,
which names the field alone, is still sent for one release (0.1.x) so clients written against it keep working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

# The binary trailer gRPC's rich error model travels in (grpc_status.rpc_status's own key).
STATUS_DETAILS_KEY = rpc_status.GRPC_DETAILS_METADATA_KEY
# Deprecated: the trailer that named the invalid field before the rich error model; kept for 0.1.x, removed after.
LEGACY_INVALID_FIELD_KEY = "minedraft-invalid-field"

Trailers = tuple[tuple[str, str | bytes], ...]


def field_violation_status(code: grpc.StatusCode, message: str, field: str, description: str) -> status_pb2.Status:
    """A google.rpc.Status with one BadRequest field violation; `message` is the call's details string."""
    bad_request = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=field, description=description)])
    detail = any_pb2.Any()
    detail.Pack(bad_request)
    return status_pb2.Status(code=code.value[0], message=message, details=[detail])


def field_error_trailers(code: grpc.StatusCode, message: str, field: str, description: str | None = None) -> Trailers:
    """The trailing metadata of a field error: the rich status, and the legacy trailer (see the module docstring).

    `description` defaults to `message` less a leading "FIELD: " (how RequestError words its message)."""
    if description is None:
        description = message.removeprefix(f"{field}: ")
    status = field_violation_status(code, message, field, description)
    return ((STATUS_DETAILS_KEY, status.SerializeToString()), (LEGACY_INVALID_FIELD_KEY, field))


async def abort_field_error(context: grpc.aio.ServicerContext, field: str, message: str,
                            code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> NoReturn:
    """End the call with `code` (INVALID_ARGUMENT by default), `message`, and the field error's trailers."""
    await context.abort(code, message, trailing_metadata=field_error_trailers(code, message, field))
    raise AssertionError("unreachable: context.abort raises")


def rich_status(trailing_metadata: Sequence[tuple[str, Any]] | None) -> status_pb2.Status | None:
    """The google.rpc.Status in a call's trailers, or None (absent or not a valid Status)."""
    for key, value in trailing_metadata or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except Exception:  # DecodeError: a peer's garbage is no status
                return None
    return None


def invalid_field(trailing_metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The path of the first invalid field a call's trailers name: the BadRequest's first field violation, else the
    legacy trailer (a peer of an older release)."""
    status = rich_status(trailing_metadata)
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                if bad_request.field_violations:
                    return str(bad_request.field_violations[0].field)
    for key, value in trailing_metadata or ():
        if key == LEGACY_INVALID_FIELD_KEY and isinstance(value, str):
            return value
    return None


def status_matches(status: status_pb2.Status, code: grpc.StatusCode, message: str) -> bool:
    """Whether a rich status agrees with a call's code and details (clients reject one that does not)."""
    return status.code == code.value[0] and status.message == message


__all__ = ["LEGACY_INVALID_FIELD_KEY", "STATUS_DETAILS_KEY", "Trailers", "abort_field_error", "field_error_trailers",
           "field_violation_status", "invalid_field", "rich_status", "status_matches"]
