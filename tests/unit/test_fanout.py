"""Fan-out (sluice.balancer.fanout and the balancer's use of it): split and merge are exact
for any datatype and shape, bodies that cannot be cut go whole, and a split call's chunks
go to several backends at once, the first failure failing the call."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sluice.balancer import fanout
from sluice.balancer.metrics import RoutingCollector
from sluice.balancer.service import CHUNK, FANOUT_CHUNKS, FANOUT_ROWS, BalancerService
from sluice.core.datatypes import DATATYPES
from sluice.core.errors import Code
from sluice.routing.budget import RetryBudget
from sluice.routing.pool import Pool
from sluice.runtime import tracing
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec, facts
from sluice.wire.mux import Reply, StreamBroken

DTYPES = [d.dtype.newbyteorder("=") for d in DATATYPES.values()]


def request(inputs: Mapping[str, np.ndarray], *, typed: bool = False) -> pb.PredictRequest:
    return pb.PredictRequest(inputs=codec.encode_all(inputs, typed=typed))


def answer(outputs: Mapping[str, np.ndarray], version: str = "1", typed: bool = False) -> bytes:
    return pb.PredictResponse(
        model="m", version=version, outputs=codec.encode_all(outputs, typed=typed)
    ).SerializeToString()


def rows_then(dtype: np.dtype[np.generic], rows: int) -> st.SearchStrategy[np.ndarray]:
    """Arrays of `dtype` with `rows` rows and 0-2 more dimensions of 0-3."""
    rest = st.lists(st.integers(0, 3), min_size=0, max_size=2)
    return rest.flatmap(lambda r: hnp.arrays(dtype, (rows, *r)))


@st.composite
def batches(draw: st.DrawFn) -> dict[str, np.ndarray]:
    """One to three inputs sharing their first dimension, of any datatypes."""
    rows = draw(st.integers(1, 40))
    names = draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=3, unique=True))
    return {n: draw(st.sampled_from(DTYPES).flatmap(lambda d: rows_then(d, rows))) for n in names}


@settings(max_examples=150, deadline=None)
@given(inputs=batches(), most=st.integers(1, 16), typed=st.booleans(), typed_out=st.booleans())
def test_merge_of_the_answers_to_the_chunks_is_the_answer_to_the_whole(
    inputs: dict[str, np.ndarray], most: int, typed: bool, typed_out: bool
) -> None:
    whole = request(inputs, typed=typed)
    whole.outputs.append("a")
    whole.model, whole.version, whole.typed_outputs = "m", "7", typed_out
    body = whole.SerializeToString()
    total = len(next(iter(inputs.values())))
    assert rows(body) == total
    parts = fanout.split(body, most)
    if total <= most:
        assert parts is None
        return
    assert parts is not None
    assert [b - a for a, b in parts.bounds] == [min(most, total - a) for a in range(0, total, most)]
    answers = []
    for chunk_body, (start, stop) in zip(parts.bodies, parts.bounds, strict=True):
        chunk = pb.PredictRequest.FromString(chunk_body)
        # Each chunk keeps everything but its rows.
        assert (list(chunk.outputs), chunk.model, chunk.version) == (["a"], "m", "7")
        assert chunk.typed_outputs == typed_out
        got = codec.decode_all(chunk.inputs)
        assert list(got) == list(inputs)
        for name, array in inputs.items():
            np.testing.assert_array_equal(got[name], array[start:stop])
            assert got[name].dtype == array.dtype
        answers.append(answer(got, typed=typed_out))  # an identity model
    merged = pb.PredictResponse.FromString(fanout.merge(answers, parts))
    back = codec.decode_all(merged.outputs)
    assert (merged.model, merged.version) == ("m", "1")
    assert list(back) == list(inputs)
    for name, array in inputs.items():
        np.testing.assert_array_equal(back[name], array)
        assert back[name].shape == array.shape


def body_of(*tensors: pb.Tensor) -> bytes:
    return pb.PredictRequest(inputs=tensors).SerializeToString()


def rows(body: bytes) -> int | None:
    """The rows fan-out splits on, read with the body's other facts (sluice.wire.facts)."""
    return facts.read(body, facts.PREDICT, rows=True).rows


def test_rows_is_the_first_dimension_the_inputs_share() -> None:
    x = np.zeros((5, 2), np.float32)
    assert rows(body_of(codec.encode("x", x), codec.encode("y", x[:, 0]))) == 5
    # Unpacked shape values are read too, as a parser reads them.
    unpacked = b"\x0a\x08\x1a\x01\x07\x1a\x01\x03\x12\x00"  # Tensor{shape: 7, shape: 3, ...}
    assert rows(unpacked) == 7
    assert rows(body_of(codec.encode("x", x), codec.encode("y", x[:3]))) is None
    assert rows(body_of(codec.encode("x", np.float32(1)))) is None  # a scalar
    assert rows(pb.PredictRequest(model="m").SerializeToString()) is None
    assert fanout.split(b"\x0a\xff", 1) is None  # no protobuf message


@pytest.mark.parametrize(
    ("why", "tensors"),
    [
        (
            "first dimensions differ",
            [
                codec.encode("x", np.zeros((9, 2), np.float32)),
                codec.encode("y", np.zeros((8, 2), np.float32)),
            ],
        ),
        (
            "bytes short of the shape",
            [pb.Tensor(name="x", datatype="FP32", shape=[9], raw_data=b"\0")],
        ),
        ("unknown datatype", [pb.Tensor(name="x", datatype="FP8", shape=[9], raw_data=b"\0" * 9)]),
        ("negative dimension", [pb.Tensor(name="x", datatype="FP32", shape=[9, -1])]),
        (
            "a repeated name",
            [
                codec.encode("x", np.zeros(9, np.float32)),
                codec.encode("x", np.zeros(9, np.float32)),
            ],
        ),
        (
            "raw and typed",
            [
                pb.Tensor(
                    name="x", datatype="FP32", shape=[9], raw_data=b"\0" * 36, fp32_data=[1.0] * 9
                )
            ],
        ),
        (
            "the wrong typed field",
            [pb.Tensor(name="x", datatype="FP32", shape=[9], int_data=[1] * 9)],
        ),
        (
            "too few typed values",
            [pb.Tensor(name="x", datatype="INT64", shape=[9], int64_data=[1])],
        ),
    ],
)
def test_a_body_that_cannot_be_cut_faithfully_goes_whole(
    why: str, tensors: list[pb.Tensor]
) -> None:
    assert fanout.split(body_of(*tensors), 4) is None, why


def test_answers_of_different_versions_abort_the_call() -> None:
    y = np.zeros((4, 2), np.float32)
    parts = fanout.split(body_of(codec.encode("x", np.zeros((8, 1), np.float32))), 4)
    assert parts is not None
    with pytest.raises(fanout.MergeError, match="different model versions") as raised:
        fanout.merge([answer({"y": y}, "1"), answer({"y": y}, "2")], parts)
    assert raised.value.code == Code.ABORTED
    assert "'m' version '1', 'm' version '2'" in str(raised.value)


@pytest.mark.parametrize(
    "second",
    [
        {"y": np.zeros((1, 2), np.float32)},  # not the chunk's rows: a reduction
        {"y": np.zeros((4, 3), np.float32)},  # other trailing dimensions
        {"z": np.zeros((4, 2), np.float32)},
        {"y": np.zeros((4, 2), np.float64)},
        {"y": np.zeros((4, 2), np.float32), "z": np.zeros(4, np.float32)},
    ],
)
def test_outputs_that_do_not_follow_the_rows_send_the_request_whole(
    second: dict[str, np.ndarray],
) -> None:
    parts = fanout.split(body_of(codec.encode("x", np.zeros((8, 1), np.float32))), 4)
    assert parts is not None
    with pytest.raises(fanout.NotRowWise):
        fanout.merge([answer({"y": np.zeros((4, 2), np.float32)}), answer(second)], parts)


def test_a_chunk_answer_that_is_no_message_is_an_internal_error() -> None:
    parts = fanout.split(body_of(codec.encode("x", np.zeros((8, 1), np.float32))), 4)
    assert parts is not None
    with pytest.raises(fanout.MergeError, match=r"chunk 2 of 2 \(rows 4-7 of 8") as raised:
        fanout.merge([answer({"y": np.zeros((4, 2), np.float32)}), b"\xff"], parts)
    assert raised.value.code == Code.INTERNAL


def test_trailers_merge_per_key() -> None:
    merged = fanout.merge_trailers(
        [
            {"x-node-id": "a", "x-request-id": "r1", "x-cache": "hit"},
            {"x-node-id": "b", "x-request-id": "r1", "x-cache": "miss", "x-nonfinite-inputs": "x"},
            {"x-node-id": "a", "x-request-id": "r1", "x-cache": "hit", "x-nonfinite-inputs": "x,y"},
        ]
    )
    assert merged == {
        "x-node-id": "a,b,a",
        "x-request-id": "r1",
        "x-cache": "miss",
        "x-nonfinite-inputs": "x,y",
    }
    assert fanout.merge_trailers([{"x-cache": "hit"}, {"x-cache": "hit"}])["x-cache"] == "hit"


class Model:
    """A fake server: answers a Predict with y = 2x, in version `version`; `fail` gives its
    status instead, `broken` breaks the stream, `hold` waits before answering."""

    def __init__(self, address: str, version: str = "1") -> None:
        self.address = address
        self.version = version
        self.fail: Reply | None = None
        self.broken = False
        self.hold: asyncio.Event | None = None
        self.rows: list[int] = []
        self.sent: list[dict[str, str]] = []  # the metadata of each call
        self.cancelled = 0

    async def predict(
        self, body: bytes, metadata: Mapping[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        x = codec.decode_all(pb.PredictRequest.FromString(body).inputs)["x"]
        self.rows.append(len(x))
        self.sent.append(dict(metadata))
        try:
            await asyncio.sleep(0)  # as a transport does: the other chunks go out meanwhile
            if self.hold is not None:
                await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.broken:
            raise StreamBroken("the stream ended")
        if self.fail is not None:
            return self.fail
        trailers = {"x-node-id": self.address, **metadata}
        return Reply(0, body=answer({"y": x * 2}, self.version), trailers=trailers)


def fanout_service(count: int, fanout_rows: int) -> tuple[BalancerService, list[Model]]:
    pool = Pool()
    pool.set_addresses(f"s{i}:1" for i in range(count))
    models = []
    for address, backend in pool.backends.items():
        backend.transport = Model(address)
        models.append(backend.transport)
    return BalancerService(pool, RetryBudget(), node_id="b", fanout_rows=fanout_rows), models


def batch(rows: int) -> tuple[np.ndarray, bytes]:
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    return x, body_of(codec.encode("x", x))


def test_a_big_call_goes_as_chunks_to_several_backends_and_comes_back_whole() -> None:
    service, models = fanout_service(4, fanout_rows=8)
    x, body = batch(30)
    reply = asyncio.run(service.forward(body, {"x-request-id": "r"}, None))
    assert reply.code == 0, reply.message
    y = codec.decode_all(pb.PredictResponse.FromString(reply.body).outputs)["y"]
    np.testing.assert_array_equal(y, x * 2)
    assert sorted(r for m in models for r in m.rows) == [6, 8, 8, 8]
    assert [len(m.rows) for m in models] == [1, 1, 1, 1]  # one chunk a server
    assert len(reply.trailers["x-node-id"].split(",")) == 4
    assert reply.trailers["x-request-id"] == "r"
    assert (service.fanned.calls, service.fanned.chunks, service.stats.requests) == (1, 4, 1)
    for _ in range(20):  # two random choices would put two of the four on one server
        nodes = asyncio.run(service.forward(body, {}, None)).trailers["x-node-id"].split(",")
        assert len(set(nodes)) == 4, nodes
    collected = {
        m.name: m.samples[0].value
        for m in RoutingCollector(
            service.pool, service.budget, service.planner, service.fanned
        ).collect()
        if m.name.startswith("sluice_fanout")
    }
    assert collected == {"sluice_fanout_calls": 21, "sluice_fanout_chunks": 84}


def test_chunks_skip_backends_that_are_out_or_busy_with_other_calls() -> None:
    service, models = fanout_service(4, fanout_rows=4)
    busy, out = list(service.pool.backends.values())[:2]
    busy.in_flight = 3  # other calls keep it busy: over its bounded load
    out.breaker.eject()
    _, body = batch(12)
    assert asyncio.run(service.forward(body, {}, None)).code == 0
    assert [len(m.rows) for m in models[:2]] == [0, 0]
    assert sorted(len(m.rows) for m in models[2:]) == [1, 2]


def test_calls_at_or_under_the_threshold_and_with_fanout_off_go_whole() -> None:
    for rows, fanout_rows in ((8, 8), (30, 0)):
        service, models = fanout_service(4, fanout_rows=fanout_rows)
        _, body = batch(rows)
        assert asyncio.run(service.forward(body, {}, None)).code == 0
        assert [r for m in models for r in m.rows] == [rows]
        assert service.fanned.calls == 0


def test_the_first_failing_chunk_fails_the_call_and_the_others_are_cancelled() -> None:
    service, models = fanout_service(2, fanout_rows=4)
    _, body = batch(8)

    async def call() -> Reply:
        gate = asyncio.Event()  # never set: the healthy server's chunk waits until cancelled
        models[0].hold = gate
        models[1].fail = Reply(Code.INVALID_ARGUMENT, "bad input", trailers={"x-node-id": "s1"})
        return await service.forward(body, {}, None)

    reply = asyncio.run(call())
    assert reply.code == Code.INVALID_ARGUMENT
    assert "split by the balancer's --fanout-rows): bad input" in reply.message
    assert reply.message.startswith("chunk ")
    assert reply.trailers == {"x-node-id": "s1"}
    assert models[0].cancelled == 1
    assert all(b.in_flight == 0 for b in service.pool.backends.values())
    assert service.stats.requests == 1


def test_a_chunk_whose_backend_breaks_is_retried_on_another() -> None:
    service, models = fanout_service(2, fanout_rows=4)
    models[0].broken = True
    x, body = batch(8)
    reply = asyncio.run(service.forward(body, {}, None))
    assert reply.code == 0, reply.message
    y = codec.decode_all(pb.PredictResponse.FromString(reply.body).outputs)["y"]
    np.testing.assert_array_equal(y, x * 2)
    assert reply.trailers["x-node-id"] == "s1:1,s1:1"
    assert service.budget.retries >= 1


def test_chunks_answered_by_different_versions_abort() -> None:
    service, models = fanout_service(2, fanout_rows=4)
    models[1].version = "2"
    _, body = batch(8)
    reply = asyncio.run(service.forward(body, {}, None))
    assert reply.code == Code.ABORTED
    assert "different model versions" in reply.message


def test_a_model_whose_outputs_do_not_follow_the_rows_gets_the_request_whole() -> None:
    service, models = fanout_service(2, fanout_rows=4)

    async def summed(
        body: bytes, metadata: Mapping[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        x = codec.decode_all(pb.PredictRequest.FromString(body).inputs)["x"]
        models[0].rows.append(len(x))
        return Reply(0, body=answer({"total": x.sum(axis=0, keepdims=True)}))

    for backend in service.pool.backends.values():
        backend.transport.predict = summed
    x, body = batch(8)
    reply = asyncio.run(service.forward(body, {}, None))
    assert reply.code == 0
    total = codec.decode_all(pb.PredictResponse.FromString(reply.body).outputs)["total"]
    np.testing.assert_array_equal(total, x.sum(axis=0, keepdims=True))
    assert models[0].rows == [4, 4, 8]  # the chunks, then the whole


def test_a_traced_fanned_out_call_has_a_span_per_chunk(spans: InMemorySpanExporter) -> None:
    service, models = fanout_service(2, fanout_rows=4)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    _, body = batch(12)
    reply = asyncio.run(service.forward(body, {"traceparent": parent, "x-request-id": "r"}, None))
    assert reply.code == 0
    (call,) = [s for s in spans.get_finished_spans() if s.name == "sluice.balancer/Predict"]
    chunks = [s for s in spans.get_finished_spans() if s.name == CHUNK]
    assert call.kind is SpanKind.SERVER and call.attributes is not None
    assert call.parent is not None and call.parent.span_id == int("b7ad6b7169203331", 16)
    assert call.attributes[FANOUT_CHUNKS] == 3 and call.attributes[tracing.REQUEST_ID] == "r"
    assert sorted(str((c.attributes or {})[FANOUT_ROWS]) for c in chunks) == ["0-3", "4-7", "8-11"]
    for span in chunks:
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None and span.parent.span_id == call.context.span_id
    # Each server got its chunk's span as the parent of its own.
    sent = [m["traceparent"].split("-")[2] for model in models for m in model.sent]
    assert sorted(sent) == sorted(f"{c.context.span_id:016x}" for c in chunks)
