"""Traces without a socket: the on/off rule, W3C context through metadata (dicts, grpc's
pairs, a StreamRequest's map), and the spans the server's face, the dataplane, the balancer
and the clients make, with an in-memory exporter. Off, nothing reads a header."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import opentelemetry.trace as trace_api
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.trace import NoOpTracerProvider, SpanKind, StatusCode

from sluice.balancer.service import ATTEMPT, BalancerService
from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.client.core import SPAN as CLIENT_SPAN
from sluice.core.errors import DeadlineExpired
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.routing.budget import RetryBudget
from sluice.routing.pool import Pool
from sluice.runtime import tracing
from sluice.runtime.spans import served
from sluice.server.dataplane import plane as plane_module
from sluice.server.dataplane.batcher import BUDGET, DRAINED, FULL, Batcher, Pending, Trip
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import MODEL_RUN, Asked, Dataplane, Request
from sluice.server.service import SPAN as SERVER_SPAN
from sluice.server.service import InferenceService
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from sluice.wire.mux import Reply
from tests.conftest import SAMPLES

BODY = pb.PredictRequest(inputs=[codec.encode("input", SAMPLES[0].input)]).SerializeToString()
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID = int("0af7651916cd43dd8448eb211c80319c", 16)
PARENT_SPAN = int("b7ad6b7169203331", 16)


@pytest.fixture
def application(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """An application that installed a TracerProvider of its own (no setup)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace_api, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def only(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = named(exporter, name)
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


# The rule: off unless OTEL_TRACES_EXPORTER asks.


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": ""}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": " OTLP , console,otlp"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, []),
    ],
)
def test_tracing_is_off_unless_an_exporter_is_named(
    environ: dict[str, str], wanted: list[str]
) -> None:
    assert tracing.exporters(environ) == wanted


def test_setup_with_nothing_asked_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.setattr(trace_api, "_TRACER_PROVIDER", None)
    assert tracing.setup("sluice-test") is False
    assert not tracing.enabled() and not tracing.ON
    assert trace_api._TRACER_PROVIDER is None
    assert tracing.client_tracer() is None


def test_an_unknown_exporter_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "sluice.tracing"):
        assert tracing.provider("s", {"OTEL_TRACES_EXPORTER": "zipkin"}) is None
    assert "zipkin" in caplog.text


@pytest.mark.parametrize(
    "sampler", ["", "always_on", "traceidratio", "parentbased_traceidratio", "always_off"]
)
def test_the_provider_samples_by_the_parent_and_names_the_service(
    monkeypatch: pytest.MonkeyPatch, sampler: str
) -> None:
    if sampler:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.01")
    environ = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "edge-7"}
    made = tracing.provider("sluice-server", environ)
    assert made is not None
    try:
        assert isinstance(made.sampler, ParentBased)
        assert made.resource.attributes["service.name"] == "edge-7"
        # A sampled caller's trace goes on here whatever the root sampler says.
        tracer = made.get_tracer("t")
        with tracer.start_as_current_span("s", tracing_context(PARENT)) as span:
            assert span.is_recording()
    finally:
        made.shutdown()
    named_default = tracing.provider("sluice-server", {"OTEL_TRACES_EXPORTER": "console"})
    assert named_default is not None
    assert named_default.resource.attributes["service.name"] == "sluice-server"
    named_default.shutdown()


def test_otlp_exports_over_grpc_only() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    made = tracing.provider("s", {"OTEL_TRACES_EXPORTER": "otlp"})
    assert made is not None
    processors = made._active_span_processor._span_processors
    assert [type(p._batch_processor._exporter) for p in processors] == [OTLPSpanExporter]  # type: ignore[attr-defined]
    made.shutdown()
    http = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert tracing.provider("s", http) is None


def tracing_context(traceparent: str) -> Any:
    return tracing.extract({"traceparent": traceparent})


# W3C trace context through metadata.


def test_inject_and_extract_round_trip_through_every_metadata_shape(
    spans: InMemorySpanExporter,
) -> None:
    caller = tracing.opened("caller")
    carrier = tracing.inject({"x-request-id": "r1"})
    caller.end()
    assert carrier["x-request-id"] == "r1"
    assert set(carrier) >= {"traceparent"}
    sent = caller.span.get_span_context()
    message = pb.StreamRequest(id=1, metadata=carrier)
    shapes: list[Any] = [
        carrier,
        tuple(carrier.items()),
        tuple((k, v.encode()) for k, v in carrier.items()),  # grpc may hand bytes
        message.metadata,  # a StreamRequest's map
        pb.StreamRequest.FromString(message.SerializeToString()).metadata,
    ]
    for shape in shapes:
        got = trace_api.get_current_span(tracing.extract(shape)).get_span_context()
        assert (got.trace_id, got.span_id, got.trace_flags) == (
            sent.trace_id,
            sent.span_id,
            sent.trace_flags,
        )
        assert got.is_remote


def test_tracestate_travels_and_garbage_starts_a_new_trace(spans: InMemorySpanExporter) -> None:
    incoming = {"traceparent": PARENT, "tracestate": "vendor=abc,other=1"}
    hop = served("hop", incoming, "Predict", node_id="n1")
    assert hop is not None  # sampled: its caller's trace is
    onwards = tracing.inject({})
    hop.end(0)
    assert onwards["traceparent"].split("-")[1] == f"{TRACE_ID:032x}"
    assert onwards["tracestate"] == "vendor=abc,other=1"
    for bad in ({"traceparent": "garbage"}, {}, (("traceparent", b"00-zz"),)):
        context = trace_api.get_current_span(tracing.extract(bad)).get_span_context()
        assert not context.is_valid


def test_a_server_span_is_the_child_of_the_callers(spans: InMemorySpanExporter) -> None:
    call = served("s", (("traceparent", PARENT),), "Predict", node_id="n1")
    assert call is not None  # sampled: its caller's trace is
    opened = tracing.opened("inner")
    tracing.annotate("k", "v")
    opened.end()
    call.end(14, "down")
    server, inner = only(spans, "s"), only(spans, "inner")
    assert server.kind is SpanKind.SERVER
    assert server.context.trace_id == TRACE_ID and parent_id(server) == PARENT_SPAN
    assert parent_id(inner) == server.context.span_id
    assert inner.attributes == {"k": "v"}
    assert server.attributes is not None
    assert server.attributes[tracing.RPC_STATUS] == 14
    assert server.status.status_code is StatusCode.ERROR


def test_a_callers_error_is_no_server_fault(spans: InMemorySpanExporter) -> None:
    call = served("s", {}, "Predict", node_id="n1")
    assert call is not None  # a root: sampled, always on
    call.end(3, "bad input")  # INVALID_ARGUMENT
    assert only(spans, "s").status.status_code is StatusCode.UNSET


def test_log_records_carry_the_trace_id(spans: InMemorySpanExporter) -> None:
    previous = logging.getLogRecordFactory()
    tracing._log_trace_ids()
    try:
        call = served("s", {"traceparent": PARENT}, "Predict", node_id="n1")
        assert call is not None  # sampled: its caller's trace is
        try:
            inside = logging.getLogRecordFactory()("x", logging.INFO, "", 0, "m", (), None)
        finally:
            call.end(0)
        outside = logging.getLogRecordFactory()("x", logging.INFO, "", 0, "m", (), None)
    finally:
        logging.setLogRecordFactory(previous)
    assert inside.trace_id == f"{TRACE_ID:032x}"
    assert len(inside.span_id) == 16
    assert outside.trace_id == ""


# The server's face and the dataplane, without a socket.


class FakeContext:
    def __init__(self, metadata: tuple[tuple[str, Any], ...] = ()) -> None:
        self.metadata = metadata
        self.trailers: tuple[tuple[str, str], ...] = ()
        self.written: list[bytes] = []

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, trailers: tuple[tuple[str, str], ...]) -> None:
        self.trailers = tuple(trailers)

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")

    async def write(self, message: bytes) -> None:
        self.written.append(message)


class Details:
    def __init__(self, method: str) -> None:
        self.method = f"/sluice.v1.Inference/{method}"


async def serve_calls(engine: Engine, calls: list[tuple[str, dict[str, str]]]) -> list[bytes]:
    """Each (method, metadata) through the real servicer: Predict, or one StreamRequest."""
    batcher = Batcher(engine.instances)
    plane = Dataplane(Models([Model(engine, batcher)]), LRUCache(16, 1 << 20))
    handler = InferenceService(plane, node_id="n1").handler()
    replies = []
    try:
        for method, metadata in calls:
            found = handler.service(Details(method))  # type: ignore[arg-type]
            assert found is not None
            if method == "Predict":
                context = FakeContext(tuple(metadata.items()))
                reply = await found.unary_unary(BODY, context)  # type: ignore[arg-type, misc]
                replies.append(reply)
            else:
                message = pb.StreamRequest(id=7, request=BODY, metadata=metadata)

                async def frames(raw: bytes = message.SerializeToString()) -> AsyncIterator[bytes]:
                    yield raw

                context = FakeContext()
                await found.stream_stream(frames(), context)  # type: ignore[arg-type, misc]
                answer = pb.StreamResponse.FromString(context.written[0])
                assert answer.code == 0, answer
                replies.append(answer.response)
    finally:
        await batcher.close()
    return replies


def test_the_server_spans_each_call_and_stream_message_with_its_model_run(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    calls = [
        ("Predict", {"traceparent": PARENT, "x-request-id": "u1"}),
        ("PredictStream", {"traceparent": PARENT, "x-request-id": "s1"}),  # a hit now
        ("PredictStream", {"x-cache-control": "no-cache", "x-request-id": "s2"}),
    ]
    asyncio.run(serve_calls(engine, calls))
    served = named(spans, SERVER_SPAN)
    assert [s.attributes and s.attributes[tracing.REQUEST_ID] for s in served] == [
        "u1",
        "s1",
        "s2",
    ]
    unary, hit, uncached = served
    for span in served:
        assert span.kind is SpanKind.SERVER
        assert span.attributes is not None
        assert span.attributes[tracing.RPC_STATUS] == 0
        assert span.attributes["sluice.node_id"] == "n1"
    assert unary.attributes is not None and hit.attributes is not None
    assert uncached.attributes is not None
    assert unary.attributes[tracing.RPC_METHOD] == "Predict"
    assert hit.attributes[tracing.RPC_METHOD] == "PredictStream"
    assert hit.attributes[tracing.STREAM] is True
    assert (unary.attributes[tracing.CACHE], hit.attributes[tracing.CACHE]) == ("miss", "hit")
    assert uncached.attributes[tracing.CACHE] == "off"
    assert parent_id(unary) == parent_id(hit) == PARENT_SPAN
    assert unary.context.trace_id == hit.context.trace_id == TRACE_ID
    assert uncached.parent is None  # no context came: a trace of its own
    runs = named(spans, MODEL_RUN)  # the hit ran nothing
    assert [parent_id(r) for r in runs] == [unary.context.span_id, uncached.context.span_id]
    assert runs[0].attributes is not None and runs[0].attributes["sluice.model.version"] == "1"
    # Each model run's steps: the queue wait, its batch (alone, on an idle server), the encode.
    for run in runs:
        wait, batch, _ = steps(spans, run)
        assert batch.attributes is not None
        assert batch.attributes[tracing.BATCH_ROWS] == 1
        assert batch.attributes[tracing.BATCH_REQUESTS] == 1
        # Queued, a one-row batch is full (max_rows 1); the fast path counts as drained.
        inline = batch.attributes[tracing.BATCH_INLINE]
        assert isinstance(inline, bool)
        assert batch.attributes[tracing.BATCH_REASON] == (DRAINED if inline else FULL)
        if inline:
            assert wait.start_time == wait.end_time  # the fast path waits for nothing


def steps(
    exporter: InMemorySpanExporter, run: ReadableSpan
) -> tuple[ReadableSpan, ReadableSpan, ReadableSpan]:
    """A model run's child spans: its queue wait, batch run and encode, checked in order."""
    children = [s for s in exporter.get_finished_spans() if parent_id(s) == run.context.span_id]
    by_name = {s.name: s for s in children}
    assert sorted(by_name) == sorted([tracing.QUEUE_WAIT, tracing.BATCH_RUN, tracing.ENCODE])
    assert len(children) == 3
    wait, batch, encode = (
        by_name[n] for n in (tracing.QUEUE_WAIT, tracing.BATCH_RUN, tracing.ENCODE)
    )
    for span in (wait, batch, encode):
        assert span.context.trace_id == run.context.trace_id
        assert span.kind is SpanKind.INTERNAL
        assert span.start_time is not None and span.end_time is not None
        assert span.start_time <= span.end_time
    assert wait.end_time is not None and batch.start_time is not None
    assert batch.end_time is not None and encode.start_time is not None
    assert wait.end_time <= batch.start_time <= batch.end_time <= encode.start_time
    assert not wait.attributes and not encode.attributes
    return wait, batch, encode


# The batcher tells a caller's Trip where its request's time went (it imports no tracing).


class Gate:
    """A model instance whose runs wait for the test to open the gate; never inline."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.batches: list[int] = []

    async def run(self, batch: Sequence[Pending]) -> list[dict[str, np.ndarray]]:
        self.batches.append(len(batch))
        await self.opened.wait()
        return [{"y": np.zeros((p.rows, 1), np.float32)} for p in batch]

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> dict[str, np.ndarray] | None:
        return None


class Inline(Gate):
    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> dict[str, np.ndarray] | None:
        return {"y": np.zeros((rows, 1), np.float32)}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_trip_tells_the_queue_wait_and_the_batch() -> None:
    clock, gate = Clock(), Gate()
    batcher = Batcher([gate], max_rows=2, budget_s=10.0, clock=clock)  # type: ignore[list-item]

    async def run() -> list[Trip]:
        trips = [Trip() for _ in range(4)]
        submitted = []
        for i, trip in enumerate(trips):
            clock.now = 100.0 + i
            submitted.append(
                asyncio.ensure_future(batcher.submit({}, ["y"], rows=1, group="g", trip=trip))
            )
            await asyncio.sleep(0)
        clock.now = 110.0
        gate.opened.set()
        await asyncio.gather(*submitted)
        await batcher.close()
        return trips

    first, second, third, fourth = asyncio.run(run())
    assert gate.batches == [1, 2, 1]
    # The first ran alone at once; the next two waited for it and filled a batch; the last
    # waited for that one too.
    assert (first.arrival, first.taken) == (100.0, 100.0)
    assert first.started >= first.taken  # its run's task began on the loop's next turn
    assert (first.requests, first.rows, first.reason, first.inline) == (1, 1, DRAINED, False)
    for trip, arrival in ((second, 101.0), (third, 102.0)):
        assert (trip.arrival, trip.taken, trip.started, trip.ended) == (
            arrival,
            110.0,
            110.0,
            110.0,
        )
        assert (trip.requests, trip.rows, trip.reason, trip.inline) == (2, 2, FULL, False)
    assert (fourth.arrival, fourth.taken, fourth.requests, fourth.reason) == (
        103.0,
        110.0,
        1,
        DRAINED,
    )


def test_a_trip_tells_a_budget_close_and_the_inline_fast_path() -> None:
    clock, gate = Clock(), Gate()
    batcher = Batcher([gate], max_rows=8, budget_s=0.5, clock=clock)  # type: ignore[list-item]

    async def run() -> list[Trip]:
        trips = [Trip() for _ in range(3)]
        submitted = []
        for trip, at in zip(trips, (100.0, 101.0, 102.0), strict=True):
            clock.now = at
            submitted.append(
                asyncio.ensure_future(batcher.submit({}, ["y"], rows=1, group="g", trip=trip))
            )
            await asyncio.sleep(0)
        gate.opened.set()
        await asyncio.gather(*submitted)
        await batcher.close()
        return trips

    _, second, third = asyncio.run(run())
    assert (second.requests, second.reason) == (1, BUDGET)  # the third came too late for it
    assert (third.requests, third.reason) == (1, DRAINED)

    inline = Batcher([Inline()], clock=Clock())  # type: ignore[list-item]
    trip = Trip()
    asyncio.run(inline.submit({}, ["y"], rows=3, group="g", trip=trip))
    assert (trip.arrival, trip.taken, trip.started, trip.ended) == (100.0, 100.0, 100.0, 100.0)
    assert (trip.requests, trip.rows, trip.reason, trip.inline) == (1, 3, DRAINED, True)


def test_an_expired_request_waited_but_ran_in_no_batch() -> None:
    clock, gate = Clock(), Gate()
    batcher = Batcher([gate], clock=clock)  # type: ignore[list-item]

    async def run() -> Trip:
        trip = Trip()
        busy = asyncio.ensure_future(batcher.submit({}, ["y"], rows=1, group="a"))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(
            batcher.submit({}, ["y"], rows=1, group="b", deadline=100.5, trip=trip)
        )
        await asyncio.sleep(0)
        clock.now = 101.0
        gate.opened.set()
        await busy
        with pytest.raises(DeadlineExpired):
            await waiting
        await batcher.close()
        return trip

    trip = asyncio.run(run())
    assert (trip.arrival, trip.taken, trip.requests) == (100.0, 101.0, 0)


class Raw:
    """A codec for the dataplane without a wire format: the body is the input's bytes."""

    name = "raw"

    def route(self, body: bytes) -> Asked:
        return Asked()

    def decode(self, body: bytes, lease: object = None) -> Request[None]:
        return Request({"input": np.frombuffer(body, np.float32).reshape(1, 64)}, (), None)

    def encode(self, model: Model, request: Request[None], outputs: dict[str, np.ndarray]) -> bytes:
        return b"ok"


def test_the_model_runs_spans_show_the_queue_wait_and_the_shared_batch(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    gate = Gate()
    batcher = Batcher([gate], max_rows=8, budget_s=10.0)  # type: ignore[list-item]
    plane = Dataplane(Models([Model(engine, batcher)]), LRUCache(16, 1 << 20))
    body = SAMPLES[0].input.astype(np.float32).tobytes()

    async def call(request_id: str) -> None:
        span = tracing.opened("call", {tracing.REQUEST_ID: request_id})
        try:
            await plane.infer(body, Raw(), cache=False)
        finally:
            span.end()

    async def run() -> None:
        first = asyncio.ensure_future(call("a"))
        await asyncio.sleep(0.01)  # "a" runs: "b" and "c" queue behind it
        rest = [asyncio.ensure_future(call(r)) for r in ("b", "c")]
        await asyncio.sleep(0.02)
        gate.opened.set()
        await asyncio.gather(first, *rest)
        await batcher.close()

    asyncio.run(run())
    calls = {s.attributes[tracing.REQUEST_ID]: s for s in named(spans, "call") if s.attributes}
    runs = {parent_id(r): r for r in named(spans, MODEL_RUN)}
    assert len(runs) == 3
    found = {}
    for request_id, call_span in calls.items():
        found[request_id] = steps(spans, runs[call_span.context.span_id])
    a_wait, a_batch, _ = found["a"]
    assert a_batch.attributes is not None
    assert a_batch.attributes[tracing.BATCH_REQUESTS] == 1
    assert a_batch.attributes[tracing.BATCH_INLINE] is False
    for request_id in ("b", "c"):
        wait, batch, _ = found[request_id]
        assert batch.attributes is not None
        assert batch.attributes[tracing.BATCH_REQUESTS] == 2
        assert batch.attributes[tracing.BATCH_ROWS] == 2
        assert batch.attributes[tracing.BATCH_REASON] == DRAINED
        assert wait.start_time is not None and wait.end_time is not None
        assert wait.end_time - wait.start_time >= 15_000_000  # it waited for "a"'s run
    assert a_wait.start_time is not None and a_wait.end_time is not None
    assert a_wait.end_time - a_wait.start_time < 10_000_000


def test_an_admission_refusal_is_an_event(
    engine: Engine, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluice.core.errors import Overloaded

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Overloaded("queued rows would end after the deadline")

    monkeypatch.setattr(Dataplane, "infer", refuse)

    async def run() -> None:
        plane = Dataplane(Models([Model(engine, Batcher(engine.instances))]), LRUCache(1, 1))
        handler = InferenceService(plane, node_id="n1").handler()
        found = handler.service(Details("PredictStream"))  # type: ignore[arg-type]
        assert found is not None
        raw = pb.StreamRequest(id=1, request=BODY, metadata={"traceparent": PARENT})

        async def frames() -> AsyncIterator[bytes]:
            yield raw.SerializeToString()

        context = FakeContext()
        await found.stream_stream(frames(), context)  # type: ignore[arg-type, misc]
        assert pb.StreamResponse.FromString(context.written[0]).retryable

    asyncio.run(run())
    span = only(spans, SERVER_SPAN)
    assert span.attributes is not None and span.attributes[tracing.RPC_STATUS] == 8
    assert [e.name for e in span.events] == ["sluice.admission.refused"]


def test_off_no_span_is_made_and_no_header_is_read(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not tracing.ON

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tracing work while tracing is off")

    for name in ("extract", "inject", "opened", "annotate", "tracer", "timed"):
        monkeypatch.setattr(tracing, name, forbidden)
    monkeypatch.setattr(plane_module, "Trip", forbidden)  # the batcher is told nothing
    calls = [
        ("Predict", {"traceparent": PARENT}),
        ("PredictStream", {"traceparent": PARENT}),
        ("PredictStream", {"x-cache-control": "no-cache"}),
    ]
    replies = asyncio.run(serve_calls(engine, calls))
    assert len(replies) == 3 and len(set(replies)) == 1


# The balancer: a SERVER span per call, a CLIENT span per attempt whose context goes on.


class FakeUpstream:
    def __init__(self, address: str, replies: list[Reply]) -> None:
        self.address = address
        self.replies = replies
        self.sent: list[dict[str, str]] = []

    async def predict(
        self, body: bytes, metadata: dict[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        self.sent.append(dict(metadata))
        return self.replies.pop(0)


def balancer(replies: dict[str, list[Reply]]) -> tuple[BalancerService, dict[str, FakeUpstream]]:
    pool = Pool()
    added, _ = pool.set_addresses(list(replies))
    upstreams = {}
    for backend in added:
        backend.transport = upstreams[backend.address] = FakeUpstream(
            backend.address, replies[backend.address]
        )
    return BalancerService(pool, RetryBudget(), node_id="b1"), upstreams


def test_the_balancer_spans_the_call_and_each_attempt(spans: InMemorySpanExporter) -> None:
    refused = Reply(14, "draining", retryable=True)
    service, upstreams = balancer({"a:1": [refused], "b:2": [refused]})
    metadata = {"traceparent": PARENT, "tracestate": "v=1", "x-request-id": "r9", "other": "x"}

    async def run() -> Reply:
        return await service.forward(BODY, metadata, None, stream=True)

    reply = asyncio.run(run())
    assert reply.code == 14
    call = only(spans, "sluice.balancer/Predict")
    attempts = sorted(named(spans, ATTEMPT), key=lambda s: s.start_time or 0)
    assert call.kind is SpanKind.SERVER and parent_id(call) == PARENT_SPAN
    assert call.attributes is not None
    assert call.attributes[tracing.REQUEST_ID] == "r9"
    assert call.attributes[tracing.STREAM] is True
    assert call.attributes["sluice.attempts"] == 2
    assert call.status.status_code is StatusCode.ERROR
    assert len(attempts) == 2
    first, second = (a.attributes for a in attempts)
    assert first is not None and second is not None
    assert first["sluice.routing"] == "affinity" and first["sluice.attempt"] == 1
    assert first["sluice.routing.why"] == "the key's owner on the ring"
    assert second["sluice.attempt"] == 2
    assert str(second["sluice.routing.why"]).startswith(f"retry after {first['server.address']}")
    for attempt in attempts:
        assert attempt.kind is SpanKind.CLIENT and parent_id(attempt) == call.context.span_id
    # Each server got its attempt's context (not the caller's), and no other header.
    for span in attempts:
        assert span.attributes is not None
        sent = upstreams[str(span.attributes["server.address"])].sent[0]
        assert set(sent) == {"traceparent", "tracestate", "x-request-id"}
        assert sent["traceparent"] == f"00-{TRACE_ID:032x}-{span.context.span_id:016x}-01"
        assert sent["tracestate"] == "v=1"


def test_the_balancer_routes_no_cache_calls_by_load(spans: InMemorySpanExporter) -> None:
    service, _ = balancer({"a:1": [Reply(0, body=b"ok")]})

    async def run() -> Reply:
        return await service.forward(BODY, {"x-cache-control": "no-cache"}, None)

    assert asyncio.run(run()).body == b"ok"
    attempt = only(spans, ATTEMPT)
    assert attempt.attributes is not None
    assert attempt.attributes["sluice.routing"] == "least-loaded"
    assert only(spans, "sluice.balancer/Predict").parent is None


def test_the_balancer_names_a_model_infer_span_for_its_service(
    spans: InMemorySpanExporter,
) -> None:
    service, _ = balancer({"a:1": [Reply(0, body=b"ok")]})
    body = kpb.ModelInferRequest(model_name="digits").SerializeToString()
    assert asyncio.run(service.forward(body, {}, None, method="ModelInfer")).body == b"ok"
    call = only(spans, "sluice.balancer/ModelInfer")
    assert call.attributes is not None
    assert call.attributes["rpc.service"] == "inference.GRPCInferenceService"
    assert call.attributes["rpc.method"] == "ModelInfer"


def test_off_the_balancer_passes_the_callers_context_on() -> None:
    assert not tracing.ON
    service, upstreams = balancer({"a:1": [Reply(0)]})
    metadata = {"traceparent": PARENT, "tracestate": "v=1", "x-request-id": "r9", "other": "x"}
    asyncio.run(service.forward(BODY, metadata, None))
    assert upstreams["a:1"].sent == [
        {k: metadata[k] for k in ("traceparent", "tracestate")} | {"x-request-id": "r9"}
    ]


# The clients: spans only when the application installed a provider.


def fake_send(sent: list[dict[str, str]]) -> Any:
    def send(client: Any, target: str, body: bytes, metadata: Any, timeout: Any) -> Reply:
        sent.append(dict(metadata))
        response = pb.PredictResponse(outputs=codec.encode_all({"y": np.zeros(1, np.float32)}))
        return Reply(0, "", response.SerializeToString(), {})

    return send


def test_without_a_provider_the_client_sends_no_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_api, "_TRACER_PROVIDER", None)
    sent: list[dict[str, str]] = []
    monkeypatch.setattr(SluiceClient, "_send", fake_send(sent))
    with SluiceClient("127.0.0.1:1") as client:
        client.predict({"input": SAMPLES[0].input})
    assert "traceparent" not in sent[0]
    monkeypatch.setattr(trace_api, "_TRACER_PROVIDER", NoOpTracerProvider())
    assert tracing.client_tracer() is None


def test_the_clients_span_each_call_and_send_its_context(
    application: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[dict[str, str]] = []
    send = fake_send(sent)

    async def send_async(*args: Any) -> Reply:
        reply: Reply = send(*args)
        return reply

    monkeypatch.setattr(SluiceClient, "_send", send)
    monkeypatch.setattr(AsyncSluiceClient, "_send", send_async)
    with SluiceClient("127.0.0.1:1") as client:
        client.predict({"input": SAMPLES[0].input}, request_id="c1")

    async def run() -> None:
        async with AsyncSluiceClient(["127.0.0.1:1", "127.0.0.1:2"]) as client:
            await client.predict({"input": SAMPLES[0].input}, request_id="c2")

    asyncio.run(run())
    made = named(application, CLIENT_SPAN)
    assert len(made) == 2 and len(sent) == 2
    for span, metadata in zip(made, sent, strict=True):
        assert span.kind is SpanKind.CLIENT
        assert metadata["traceparent"].split("-")[2] == f"{span.context.span_id:016x}"
        assert span.attributes is not None and span.attributes[tracing.RPC_STATUS] == 0
    assert made[0].attributes is not None and made[1].attributes is not None
    assert made[0].attributes["server.address"] == "127.0.0.1:1"
    assert made[0].attributes[tracing.REQUEST_ID] == "c1"
    assert made[1].attributes["sluice.targets"] == "127.0.0.1:1,127.0.0.1:2"


def test_a_client_span_records_a_failed_call(
    application: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluice.client.core import rpc_error

    def fail(*args: Any) -> Reply:
        raise rpc_error(Reply(14, "down"))

    monkeypatch.setattr(SluiceClient, "_send", fail)
    with SluiceClient("127.0.0.1:1") as client, pytest.raises(Exception, match="down"):
        client.predict({"input": SAMPLES[0].input})
    span = only(application, CLIENT_SPAN)
    assert span.attributes is not None and span.attributes[tracing.RPC_STATUS] == 14
    assert span.status.status_code is StatusCode.ERROR


def test_an_unsampled_call_makes_no_spans_and_passes_its_decision_on() -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider.get_tracer("test"))
    try:
        service, upstreams = balancer({"a:1": [Reply(0)], "b:2": [Reply(0)]})
        unsampled = PARENT[:-2] + "00"
        asyncio.run(service.forward(BODY, {"traceparent": unsampled}, None))
        asyncio.run(service.forward(BODY, {"x-cache-control": "no-cache"}, None))  # a root
    finally:
        tracing.uninstall()
        provider.shutdown()
    sent = [m for u in upstreams.values() for m in u.sent]
    assert len(sent) == 2
    passed = [m["traceparent"].split("-") for m in sent]
    assert [int(p[3], 16) & 1 for p in passed] == [0, 0]  # not sampled, downstream too
    assert f"{TRACE_ID:032x}" in {p[1] for p in passed}
    assert exporter.get_finished_spans() == ()
