"""Hostile callers against a real server behind a real balancer: request content that once
reached the server's catch-all (INTERNAL) gets its own status through the server and through
the balancer, and the balancer holds nothing of it against the server (its breaker stays
CLOSED). The request path's property test is tests/unit/test_hostile.py."""

from __future__ import annotations

import math
import socket
import struct

import grpc
import numpy as np
import pytest

from sluice.client import SluiceClient
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec
from tests.conftest import SAMPLES
from tests.e2e.harness import Cluster

pytestmark = pytest.mark.e2e

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
VALID = pb.PredictRequest(inputs=[codec.encode("input", SAMPLES[0].input)])
VIA = ["server", "balancer"]


SERVERS = 1  # the module's cluster: one server behind the balancer


def address_of(cluster: Cluster, via: str) -> str:
    return cluster.servers[0].address if via == "server" else cluster.balancer.address


def stream(address: str, *messages: pb.StreamRequest) -> dict[int, pb.StreamResponse]:
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream("/sluice.v1.Inference/PredictStream")
        raw = iter([m.SerializeToString() for m in messages])
        replies = [pb.StreamResponse.FromString(r) for r in call(raw, timeout=10)]
    return {r.id: r for r in replies}


def assert_nothing_held_against_the_server(cluster: Cluster) -> None:
    health = cluster.health()
    assert [b.breaker for b in health.backends] == ["CLOSED"]
    assert health.backends[0].failures == 0
    with SluiceClient(cluster.servers[0].address) as client:
        server = client.health()
    assert "INTERNAL" not in server.errors_by_code
    assert "INTERNAL" not in health.errors_by_code
    with SluiceClient(cluster.balancer.address) as client:  # and both still serve
        assert client.predict({"input": SAMPLES[0].input})["label"].shape == (1,)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize(
    ("shape", "message"),
    [([1] * 65, "65 dimensions; at most 64"), ([0, 2**62, 2**62], "elements")],
    ids=["65-dimensions", "absurd-shape"],
)
def test_absurd_shapes_are_invalid_argument(
    cluster: Cluster, via: str, shape: list[int], message: str
) -> None:
    tensor = pb.Tensor(name="input", datatype="FP32", shape=shape, raw_data=bytes(4))
    with (
        grpc.insecure_channel(address_of(cluster, via)) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        pb_grpc.InferenceStub(channel).Predict(pb.PredictRequest(inputs=[tensor]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    assert_nothing_held_against_the_server(cluster)


@pytest.mark.parametrize("via", VIA)
def test_a_request_id_that_is_not_printable_ascii_is_invalid_argument(
    cluster: Cluster, via: str
) -> None:
    """On a stream the metadata map takes any string: the call is refused before any work,
    and the id is not echoed. A printable id on the same stream is echoed."""
    body = VALID.SerializeToString()
    replies = stream(
        address_of(cluster, via),
        pb.StreamRequest(id=1, request=body, metadata={"x-request-id": "héllo"}),
        pb.StreamRequest(id=2, request=body, metadata={"x-request-id": "a\nb"}),
        pb.StreamRequest(id=3, request=body, metadata={"x-request-id": "fine-1"}),
    )
    for ident in (1, 2):
        assert replies[ident].code == INVALID, replies[ident]
        assert "x-request-id must be printable ASCII" in replies[ident].message
        assert "x-request-id" not in replies[ident].trailers
    assert replies[3].code == 0 and replies[3].trailers["x-request-id"] == "fine-1"
    assert_nothing_held_against_the_server(cluster)


def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + struct.pack(">I", stream) + payload
    )


def hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header as HPACK "literal without indexing, new name", no Huffman coding."""
    assert len(name) < 127 and len(value) < 127
    return b"\0" + bytes([len(name)]) + name + bytes([len(value)]) + value


def raw_predict(address: str, body: bytes, request_id: bytes) -> bytes:
    """One Predict over a bare HTTP/2 connection, sending `request_id` as it is (grpc's own
    clients refuse to send a value that is not printable ASCII); the frames received until
    the call ends, as bytes."""
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", b"/sluice.v1.Inference/Predict"),
        (b":authority", address.encode()),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"x-request-id", request_id),
    ]
    block = b"".join(hpack_literal(k, v) for k, v in headers)
    message = b"\0" + struct.pack(">I", len(body)) + body
    host, port = address.rsplit(":", 1)
    received = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            + h2_frame(4, 0, 0)  # SETTINGS
            + h2_frame(1, 4, 1, block)  # HEADERS, END_HEADERS
            + h2_frame(0, 1, 1, message)  # DATA, END_STREAM
        )
        buffer = b""
        while True:
            while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
                chunk = sock.recv(65536)
                if not chunk:
                    return received
                buffer += chunk
            size = int.from_bytes(buffer[:3], "big")
            kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big")
            payload, buffer = buffer[9 : 9 + size], buffer[9 + size :]
            received += payload
            if kind == 4 and not flags & 1:
                sock.sendall(h2_frame(4, 1, 0))  # SETTINGS ACK
            ended = kind == 3 or (kind == 1 and flags & 1)  # RST_STREAM, or trailers
            if kind == 7 or (stream == 1 and ended):  # GOAWAY
                return received


def errors(address: str) -> dict[str, int]:
    with SluiceClient(address) as client:
        return dict(client.health().errors_by_code)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize(
    "request_id", ["héllo".encode(), b"a\x01b", b"\xff\xfe"], ids=["utf8", "control", "not-utf8"]
)
def test_a_unary_request_id_that_is_not_printable_ascii_is_invalid_argument(
    cluster: Cluster, via: str, request_id: bytes
) -> None:
    """Sent over bare HTTP/2 (grpc core accepts such a value on arrival): refused before the
    model runs, where it used to answer INTERNAL once the reply's trailers could not be sent."""
    address = address_of(cluster, via)
    before = errors(address)
    received = raw_predict(address, VALID.SerializeToString(), request_id)
    after = errors(address)
    assert after.get("INVALID_ARGUMENT", 0) == before.get("INVALID_ARGUMENT", 0) + 1
    assert "INTERNAL" not in after
    assert b"printable ASCII" in received  # grpc-message (grpc sends it unindexed, plain)
    assert_nothing_held_against_the_server(cluster)


@pytest.mark.parametrize("via", VIA)
def test_grpc_python_will_not_send_a_non_ascii_request_id(cluster: Cluster, via: str) -> None:
    """Unary metadata: grpc (python, and grpc core beneath it) refuses to send a header value
    that is not printable ASCII, so the call fails in the client and never arrives. A caller
    whose HTTP/2 stack does send one gets INVALID_ARGUMENT from the server's and the
    balancer's check (above, over bare HTTP/2)."""
    with (
        grpc.insecure_channel(address_of(cluster, via)) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        pb_grpc.InferenceStub(channel).Predict(
            VALID, metadata=(("x-request-id", "héllo"),), timeout=10
        )
    assert caught.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
    assert_nothing_held_against_the_server(cluster)


@pytest.mark.parametrize("via", VIA)
def test_stream_timeouts_nan_and_negative_are_invalid_argument(cluster: Cluster, via: str) -> None:
    """NaN and negative `timeout_s` are refused; 0 (unset) and infinity mean no deadline."""
    body = VALID.SerializeToString()
    timeouts = {1: math.nan, 2: -1.0, 3: -math.inf, 4: 0.0, 5: math.inf, 6: 1e300}
    replies = stream(
        address_of(cluster, via),
        *(pb.StreamRequest(id=i, request=body, timeout_s=t) for i, t in timeouts.items()),
    )
    for ident in (1, 2, 3):
        assert replies[ident].code == INVALID, replies[ident]
        assert "timeout_s must be a number >= 0" in replies[ident].message
    for ident in (4, 5, 6):
        assert replies[ident].code == 0, replies[ident]
        label = codec.decode_all(pb.PredictResponse.FromString(replies[ident].response).outputs)
        assert np.array_equal(label["label"], [SAMPLES[0].label])
    assert_nothing_held_against_the_server(cluster)
