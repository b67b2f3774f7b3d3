"""Hostile request content on the server's request path, without a socket: whatever a caller
sends as a Predict body (random tensors, shapes, datatypes, data, or plain random bytes), the
sluice.v1 codec and the dataplane answer it or refuse it with a status the caller can act on
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED). Nothing reaches the server's
catch-all, which would answer INTERNAL."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sluice.balancer.service import refusal
from sluice.core.calls import stream_timeout
from sluice.core.datatypes import DATATYPES
from sluice.core.errors import Code, InvalidInput, SluiceError
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import Dataplane
from sluice.server.service import InferenceService
from sluice.server.v1 import SluiceV1
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.conftest import SAMPLES

V1 = SluiceV1()  # the server's plain sluice.v1 protocol

ACCEPTED = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
ACCEPTED_CODES = {Code.OK, *(Code[name] for name in ACCEPTED)}
VALID = pb.PredictRequest(inputs=[codec.encode("input", SAMPLES[0].input)]).SerializeToString()
DEEP = pb.PredictRequest(
    inputs=[pb.Tensor(name="input", datatype="FP32", shape=[1] * 65, raw_data=bytes(4))]
).SerializeToString()

TYPED_VALUES = {
    "bool_data": st.booleans(),
    "int_data": st.integers(-(2**31), 2**31 - 1),
    "int64_data": st.integers(-(2**63), 2**63 - 1),
    "uint_data": st.integers(0, 2**32 - 1),
    "uint64_data": st.integers(0, 2**64 - 1),
    "fp32_data": st.floats(width=32),
    "fp64_data": st.floats(),
}
HUGE = [2**31, 2**48, 2**62, 2**63 - 1, -(2**63)]

names = st.sampled_from(["input", "", "label", "probabilities"]) | st.text(max_size=4)
datatypes = st.one_of(
    st.sampled_from(list(DATATYPES)),
    st.sampled_from(["FP32", "BOOL", "FP16"]),
    st.sampled_from(["", "fp32", "BF16", "STRING"]),
    st.text(max_size=5),
)
shapes = st.one_of(
    st.just([1, 64]),
    st.lists(st.sampled_from([1, 2, 64]), max_size=3),
    st.lists(st.integers(-2, 4), max_size=5),
    st.lists(st.integers(0, 1), min_size=60, max_size=70),  # numpy allows at most 64
    st.lists(st.sampled_from([0, 1, *HUGE]), max_size=5),
)


@st.composite
def tensors(draw: st.DrawFn) -> pb.Tensor:
    datatype, shape = draw(datatypes), draw(shapes)
    tensor = pb.Tensor(name=draw(names), datatype=datatype, shape=shape)
    dt = DATATYPES.get(datatype)
    count = math.prod(shape) if all(d >= 0 for d in shape) else -1
    fits = dt is not None and 0 <= count <= 256
    how = draw(
        st.sampled_from(
            ["raw", "raw", "typed", "typed", "random raw", "random typed", "none", "both"]
        )
    )
    if how == "raw" and fits:
        assert dt is not None
        tensor.raw_data = draw(st.binary(min_size=count * dt.dtype.itemsize, max_size=count * 8))
    elif how == "typed" and fits:
        assert dt is not None
        values = draw(st.lists(TYPED_VALUES[dt.typed_field], min_size=count, max_size=count))
        getattr(tensor, dt.typed_field).extend(values)
    elif how in ("random typed", "both"):
        field = draw(st.sampled_from(sorted(TYPED_VALUES)))
        getattr(tensor, field).extend(draw(st.lists(TYPED_VALUES[field], max_size=8)))
    if how in ("random raw", "both"):
        tensor.raw_data = draw(st.binary(max_size=64))
    return tensor


requests = st.builds(
    pb.PredictRequest,
    inputs=st.lists(tensors(), max_size=3),
    outputs=st.lists(
        st.sampled_from(["label", "probabilities", ""]) | st.text(max_size=4), max_size=3
    ),
    typed_outputs=st.booleans(),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid body with a few bytes changed, cut short or grown."""
    body = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(body) - 1))
        body[at] = draw(st.integers(0, 255))
    return bytes(body[: draw(st.integers(0, len(body)))]) + draw(st.binary(max_size=8))


bodies = st.one_of(
    requests.map(lambda r: r.SerializeToString()),
    requests.map(lambda r: r.SerializeToString()),
    st.binary(max_size=128),
    mutated(),
)


@settings(max_examples=500, deadline=None)
@given(tensors=st.lists(tensors(), max_size=3))
def test_the_codec_refuses_only_with_tensor_error(tensors: list[pb.Tensor]) -> None:
    try:
        arrays = codec.decode_all(tensors)
    except codec.TensorError:
        return
    for tensor in tensors:
        assert arrays[tensor.name].shape == tuple(tensor.shape)


async def outcome(plane: Dataplane, body: bytes, deadline: float | None, cache: bool) -> str:
    try:
        entry, _ = await plane.infer(body, V1, deadline=deadline, cache=cache)
    except SluiceError as exc:
        return exc.status
    pb.PredictResponse.FromString(entry.body)
    return "OK"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=bodies,
    deadline=st.sampled_from([None, -1.0, 0.0, 5.0]),
    cache=st.booleans(),
    beside_valid=st.booleans(),
)
@example(body=DEEP, deadline=None, cache=True, beside_valid=False)
def test_no_request_content_reaches_an_unexpected_failure(
    engine: Engine, body: bytes, deadline: float | None, cache: bool, beside_valid: bool
) -> None:
    async def run() -> None:
        # A batcher that merges: a hostile body may share a batch with a valid one.
        batcher = Batcher(engine.instances, max_rows=8, budget_s=0.001, max_queue=4)
        plane = Dataplane(Models([Model(engine, batcher)]), LRUCache(16, 1 << 20))
        try:
            at = None if deadline is None else time.monotonic() + deadline
            calls = [outcome(plane, body, at, cache)]
            if beside_valid:
                calls.append(outcome(plane, VALID, None, cache))
            got = await asyncio.gather(*calls)
            assert got[0] in ACCEPTED | {"OK"}, got
            assert got[1:] in ([], ["OK"]), got
        finally:
            await batcher.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (pb.Tensor(name="input", datatype="FP32", shape=[1] * 65), "65 dimensions"),
        (pb.Tensor(name="input", datatype="FP32", shape=[0, 2**62, 2**62]), "elements"),
        (pb.Tensor(name="input", datatype="BOOL", shape=[2], raw_data=b"\1\2"), "0 and 1"),
        (pb.Tensor(name="input", datatype="FP16", shape=[1], fp32_data=[1e6]), "range of FP16"),
    ],
)
def test_hostile_tensors_are_invalid_argument(
    engine: Engine, tensor: pb.Tensor, message: str
) -> None:
    body = pb.PredictRequest(inputs=[tensor]).SerializeToString()

    async def run() -> None:
        batcher = Batcher(engine.instances)
        plane = Dataplane(Models([Model(engine, batcher)]), LRUCache(16, 1 << 20))
        try:
            with pytest.raises(SluiceError, match=message) as raised:
                await plane.infer(body, V1)
            assert raised.value.status == "INVALID_ARGUMENT"
        finally:
            await batcher.close()

    asyncio.run(run())


def test_fp16_keeps_nonfinite_typed_values() -> None:
    tensor = pb.Tensor(name="x", datatype="FP16", shape=[3], fp32_data=[np.inf, np.nan, 65504])
    array = codec.decode(tensor)
    assert np.isinf(array[0]) and np.isnan(array[1]) and array[2] == 65504


# The server's gRPC face, without a socket: metadata and stream frames.


class Aborted(Exception):
    pass


class FakeContext:
    """What the service uses of a grpc.aio ServicerContext."""

    def __init__(self, metadata: tuple[tuple[str, Any], ...] = (), remaining: float | None = None):
        self.metadata = metadata
        self.remaining = remaining
        self.trailers: tuple[tuple[str, str], ...] = ()
        self.written: list[bytes] = []

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return self.remaining

    def set_trailing_metadata(self, trailers: tuple[tuple[str, str], ...]) -> None:
        self.trailers = tuple(trailers)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    async def write(self, message: bytes) -> None:
        self.written.append(message)


class Details:
    def __init__(self, method: str) -> None:
        self.method = f"/sluice.v1.Inference/{method}"


def printable(value: str) -> bool:
    return all(" " <= c <= "~" for c in value)


request_ids = st.one_of(st.just("req-1"), st.text(max_size=6), st.binary(max_size=6))
timeouts = st.one_of(
    st.sampled_from([0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e300, 5.0]),
    st.floats(),
)
frames = st.one_of(
    st.builds(
        lambda ident, body, timeout, rid: pb.StreamRequest(
            id=ident,
            request=body,
            timeout_s=timeout,
            metadata={} if rid is None else {"x-request-id": rid},
        ).SerializeToString(),
        st.integers(1, 2**64 - 1),
        st.one_of(st.just(VALID), bodies),
        timeouts,
        st.none() | st.text(max_size=6),
    ),
    st.binary(max_size=32),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.one_of(st.just(VALID), bodies),
    request_id=st.none() | request_ids,
    remaining=st.sampled_from([None, 5.0, 0.0, -1.0]),
    messages=st.lists(frames, max_size=4),
)
def test_the_server_face_answers_hostile_calls_with_a_status(
    engine: Engine,
    body: bytes,
    request_id: str | bytes | None,
    remaining: float | None,
    messages: list[bytes],
) -> None:
    """Predict and PredictStream on the real servicer: every outcome is OK or a caller's
    status, and every trailer it would send is printable ASCII (grpc cannot send others)."""

    async def run() -> None:
        batcher = Batcher(engine.instances, max_rows=8, budget_s=0.001, max_queue=4)
        plane = Dataplane(Models([Model(engine, batcher)]), LRUCache(16, 1 << 20))
        handler = InferenceService(plane, node_id="n").handler()
        try:
            metadata = () if request_id is None else (("x-request-id", request_id),)
            context = FakeContext(metadata, remaining)
            predict = handler.service(Details("Predict"))  # type: ignore[arg-type]
            assert predict is not None
            try:
                await predict.unary_unary(body, context)  # type: ignore[arg-type, misc]
            except Aborted as aborted:
                code, _ = aborted.args
                assert code.name in ACCEPTED, aborted
            assert all(printable(v) for _, v in context.trailers), context.trailers

            async def frames() -> AsyncIterator[bytes]:
                for message in messages:
                    yield message

            stream = handler.service(Details("PredictStream"))  # type: ignore[arg-type]
            assert stream is not None
            context = FakeContext()
            await stream.stream_stream(frames(), context)  # type: ignore[arg-type, misc]
            for raw in context.written:
                reply = pb.StreamResponse.FromString(raw)
                assert reply.code in ACCEPTED_CODES, reply
                assert all(printable(v) for v in reply.trailers.values()), reply
        finally:
            await batcher.close()

    asyncio.run(run())


@given(timeout=timeouts)
def test_stream_timeouts_mean_the_same_on_server_and_balancer(timeout: float) -> None:
    """NaN and negative: refused; 0 and infinity: no deadline; else the time left."""
    try:
        left = stream_timeout(timeout)
    except InvalidInput:
        assert math.isnan(timeout) or timeout < 0
        assert refusal({}, timeout) is not None
        return
    assert refusal({}, timeout) is None
    assert left is None if timeout in (0, math.inf) else left == timeout


@given(request_id=st.text(max_size=8))
def test_request_ids_mean_the_same_on_server_and_balancer(request_id: str) -> None:
    refused = refusal({"x-request-id": request_id})
    assert (refused is None) == printable(request_id)
