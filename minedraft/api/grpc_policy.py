"""One gRPC policy for every server and channel the product creates (engine server, gateway, fake engine, client):
keepalive, message sizes, request decoding that answers garbage with INVALID_ARGUMENT, and reflection (v1 and
v1alpha).

Keepalive: channels ping every KEEPALIVE_TIME_MS (a dead peer behind an open TCP connection is noticed within
KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS); servers accept pings that often, with or without calls in flight, so
they never answer a client's pings with a `too_many_pings` GOAWAY (which fails every stream on that connection).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from minedraft.api import SERVICE_NAME, pb, pb_grpc

log = logging.getLogger(__name__)

KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
# Servers accept a ping this often: below the clients' interval, so client pings never count as strikes.
MIN_PING_INTERVAL_MS = KEEPALIVE_TIME_MS // 2

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # How long a ping may go unanswered: gRPC core times keepalive pings by this too (default 60 s), so without it a
    # frozen peer (a stopped process: its kernel still keeps the TCP connection) was noticed only after 20 + 60 s.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)

# Servers do not ping on their own (gRPC's default: every 2 hours): a server ping unanswered within a timeout closes
# the connection and cancels every call on it, which under overload (a client too busy to answer in time) fails
# streams that would have completed. Dead clients are found by the channels' own pings and by TCP.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
)

# The health service name of LIVENESS: SERVING from the moment the server has bound until the process exits
# (readiness is "" and the Generation service's name).
LIVENESS_SERVICE = "minedraft.liveness"

REFLECTION_V1_SERVICE = "grpc.reflection.v1.ServerReflection"


class UndecodableRequest:
    """Stands for request bytes that are not a valid message (the handler answers INVALID_ARGUMENT)."""

    __slots__ = ("error", "num_bytes")

    def __init__(self, num_bytes: int, error: str) -> None:
        self.num_bytes = num_bytes
        self.error = error


def _lenient(message_type: type[Message]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except (DecodeError, RuntimeError, ValueError) as exc:
            return UndecodableRequest(len(data), str(exc) or type(exc).__name__)

    return deserialize


async def reject_undecodable(request: Any, context: grpc.aio.ServicerContext, method: str) -> None:
    """Abort with INVALID_ARGUMENT (and one log line) when `request` could not be decoded."""
    if isinstance(request, UndecodableRequest):
        log.warning("%s: undecodable request of %d bytes from %s (%s)", method, request.num_bytes, context.peer(),
                    request.error)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: not a valid {method} request message")


def add_generation_servicer(servicer: pb_grpc.GenerationServicer, server: grpc.aio.Server) -> None:
    """pb_grpc.add_GenerationServicer_to_server, with requests decoded leniently: garbage bytes reach the handler as
    UndecodableRequest (gRPC's own decoding failure answers UNKNOWN and logs a traceback per request)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=_lenient(pb.GetModelInfoRequest),
            response_serializer=pb.GetModelInfoResponse.SerializeToString),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo, request_deserializer=_lenient(pb.GetServerInfoRequest),
            response_serializer=pb.GetServerInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Server reflection under both grpc.reflection.v1 (current grpcurl, Postman) and v1alpha (older clients).

    The two protocols have the same messages field for field under different package names, so v1alpha's servicer
    answers v1's method too; only the method path differs.
    """
    from grpc_reflection.v1alpha import reflection, reflection_pb2
    from grpc_reflection.v1alpha._async import ReflectionServicer

    _register_reflection_v1(reflection_pb2.DESCRIPTOR)
    names = (*service_names, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE)
    servicer = ReflectionServicer(names)
    for service in (reflection.SERVICE_NAME, REFLECTION_V1_SERVICE):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),))


def _register_reflection_v1(v1alpha: Any) -> None:
    """grpc.reflection.v1's descriptors in the default pool, so that reflection can describe the v1 service it lists
    (`grpcurl describe grpc.reflection.v1.ServerReflection`): grpcio-reflection ships only v1alpha's, and v1's file
    is v1alpha's with the package renamed (same messages, field for field)."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha.CopyToProto(proto)
    old_package, new_package = proto.package, REFLECTION_V1_SERVICE.rsplit(".", 1)[0]
    proto.name, proto.package = name, new_package
    proto.ClearField("options")

    def rename(type_name: str) -> str:
        prefix = f".{old_package}."
        return f".{new_package}.{type_name[len(prefix):]}" if type_name.startswith(prefix) else type_name

    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = rename(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = rename(method.input_type), rename(method.output_type)
    pool.Add(proto)
