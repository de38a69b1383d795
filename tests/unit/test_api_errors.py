"""gRPC's rich error model for field errors (minedraft.api.errors) and what the gateway passes on of it, without a
server: the trailers built, read back as grpcio-status reads them, and dropped where the message changes."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from minedraft.api.errors import (
    LEGACY_INVALID_FIELD_KEY,
    STATUS_DETAILS_KEY,
    field_error_trailers,
    invalid_field,
    rich_status,
)
from minedraft.gateway.router import engine_answer

MESSAGE = "sampling_params.top_p: must be in (0, 1], got 1.5"


class Call:
    """What rpc_status.from_call reads of a finished call (a grpc.Call's code, details and trailers)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str | bytes], ...]) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailers


def violations(status: status_pb2.Status) -> list[tuple[str, str]]:
    out = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        assert detail.Unpack(bad_request), detail.type_url
        out += [(v.field, v.description) for v in bad_request.field_violations]
    return out


def test_a_field_error_reads_back_with_grpcio_status() -> None:
    trailers = field_error_trailers(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE, "sampling_params.top_p")
    status = rpc_status.from_call(Call(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE, trailers))  # type: ignore[arg-type]
    assert status is not None
    assert (status.code, status.message) == (code_pb2.INVALID_ARGUMENT, MESSAGE)
    assert violations(status) == [("sampling_params.top_p", "must be in (0, 1], got 1.5")]
    # The legacy trailer, for 0.1.x clients.
    assert (LEGACY_INVALID_FIELD_KEY, "sampling_params.top_p") in trailers
    assert invalid_field(trailers) == "sampling_params.top_p"


def test_the_invalid_field_is_read_from_the_rich_status_first_then_the_legacy_trailer() -> None:
    rich_only = tuple(t for t in field_error_trailers(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE, "prompt")
                      if t[0] == STATUS_DETAILS_KEY)
    assert invalid_field(rich_only) == "prompt"
    assert invalid_field(((LEGACY_INVALID_FIELD_KEY, "prompt_token_ids"),)) == "prompt_token_ids"
    assert invalid_field(()) is None and invalid_field(None) is None
    assert rich_status(((STATUS_DETAILS_KEY, b"\xff\xff not a status"),)) is None


@pytest.mark.parametrize(("code", "message_kept"), [
    (grpc.StatusCode.INVALID_ARGUMENT, True),
    (grpc.StatusCode.OUT_OF_RANGE, True),
    (grpc.StatusCode.INTERNAL, False),  # the gateway words its own message: a status saying otherwise is dropped
])
def test_the_gateway_passes_the_rich_status_on_only_with_the_engines_message(code: grpc.StatusCode,
                                                                              message_kept: bool) -> None:
    trailers = field_error_trailers(code, MESSAGE, "sampling_params.top_p")
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=MESSAGE)
    answer = engine_answer(error)
    assert (answer.message == MESSAGE) is message_kept
    passed = rich_status(answer.trailing_metadata)
    assert (passed is not None) is message_kept
    assert (LEGACY_INVALID_FIELD_KEY, "sampling_params.top_p") in answer.trailing_metadata
    # Whatever reaches the caller is a status grpcio-status accepts (code and message agree).
    rpc_status.from_call(Call(answer.code, answer.message, answer.trailing_metadata))  # type: ignore[arg-type]
