"""Generated protobuf/gRPC code for the MineDraft API (from proto/; regenerate with scripts/gen_proto.sh).

`from minedraft.api import pb, pb_grpc` gives the messages and the service stubs/servicers of minedraft.v1.
"""

from minedraft.api.minedraft.v1 import generation_pb2 as pb
from minedraft.api.minedraft.v1 import generation_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name

__all__ = ["SERVICE_NAME", "pb", "pb_grpc"]
