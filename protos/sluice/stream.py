"""PredictStream framing shared by the server, the balancer and their clients."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from sluice.v1 import inference_pb2 as pb

INVALID_ARGUMENT = 3  # grpc.StatusCode.INVALID_ARGUMENT, without importing grpc

# The answer to bytes that are not a StreamRequest: the stream cannot be trusted any more,
# so the sender is told with id 0 and the stream ends once earlier calls are answered.
BAD_MESSAGE = pb.StreamResponse(
    id=0,
    code=INVALID_ARGUMENT,
    message="a message on the stream is not a valid sluice.v1.StreamRequest; the stream ends",
).SerializeToString()


def parse_request(raw: bytes) -> pb.StreamRequest | None:
    try:
        return pb.StreamRequest.FromString(raw)
    except DecodeError:
        return None
