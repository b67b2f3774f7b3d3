"""One trace across the hops: a client in this process, a balancer and two servers as real
processes with tracing on (OTEL_* variables only), exporting over OTLP/gRPC to a collector
this test runs. For a unary Predict and for a call multiplexed on PredictStream, one trace
id links client -> balancer -> attempt -> server -> model run, by parent span ids; under the
model run, the server's steps: queue wait, batch run and encode."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import opentelemetry.trace as trace_api
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sluice.client import SluiceClient
from sluice.client.core import SPAN as CLIENT_SPAN
from sluice.runtime import tracing
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec
from tests.e2e.harness import Process, balancer_argv, server_argv, wait_for

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Exported:
    service: str
    name: str
    kind: int  # OTLP's numbering: 2 SERVER, 3 CLIENT
    trace_id: int
    span_id: int
    parent_id: int
    attributes: dict[str, object]


class Collector(otlp_grpc.TraceServiceServicer):  # type: ignore[misc]
    """An OTLP/gRPC trace receiver that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[Exported] = []
        self._lock = threading.Lock()

    def Export(  # the protocol's name
        self, request: otlp.ExportTraceServiceRequest, context: object
    ) -> otlp.ExportTraceServiceResponse:
        found = []
        for resource in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                for span in scope.spans:
                    found.append(
                        Exported(
                            attributes.get("service.name", ""),
                            span.name,
                            span.kind,
                            int.from_bytes(span.trace_id, "big"),
                            int.from_bytes(span.span_id, "big"),
                            int.from_bytes(span.parent_span_id or bytes(8), "big"),
                            {a.key: value(a.value) for a in span.attributes},
                        )
                    )
        with self._lock:
            self.spans += found
        return otlp.ExportTraceServiceResponse()

    def of(self, trace_id: int) -> list[Exported]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def value(any_value: object) -> object:
    which = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(any_value, which) if which else None


@contextmanager
def collector() -> Iterator[tuple[Collector, int]]:
    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    otlp_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(None)


@contextmanager
def started(argv: list[str], env: dict[str, str]) -> Iterator[Process]:
    proc = Process(argv, env)
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.kill()


@pytest.fixture
def client_spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """This process traces as an application would: a provider of its own, set globally
    for the test only (the client library needs no setup)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace_api, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


def digit(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 16, (1, 64)).astype(np.float32)


def chain(collected: Collector, root: int, trace_id: int, stream: bool) -> list[Exported]:
    """The spans from the client's span down to the model run, each the parent of the
    next; waits until all have arrived (bounded)."""
    wanted = [
        ("sluice-balancer", "sluice.balancer/Predict", 2),
        ("sluice-balancer", "sluice.balancer/attempt", 3),
        ("sluice-server", "sluice.server/Predict", 2),
        ("sluice-server", "sluice.model.run", 1),
    ]

    def linked() -> list[Exported] | None:
        spans = collected.of(trace_id)
        found, parent = [], root
        for service, name, kind in wanted:
            step = [
                s
                for s in spans
                if (s.service, s.name, s.kind, s.parent_id) == (service, name, kind, parent)
            ]
            if len(step) != 1:
                return None
            found.append(step[0])
            parent = step[0].span_id
        return found

    return wait_for(linked, f"the {'stream' if stream else 'unary'} call's spans", 30.0)


def steps(collected: Collector, run: Exported) -> dict[str, Exported]:
    """The model run's steps by name, once all three have arrived (bounded)."""
    wanted = {"sluice.queue.wait", "sluice.batch.run", "sluice.encode"}

    def arrived() -> dict[str, Exported] | None:
        found = {
            s.name: s
            for s in collected.of(run.trace_id)
            if s.parent_id == run.span_id and s.service == "sluice-server"
        }
        return found if set(found) >= wanted else None

    return wait_for(arrived, "the model run's steps", 30.0)


def test_one_trace_links_client_balancer_server_and_model_run(
    client_spans: InMemorySpanExporter,
) -> None:
    with collector() as (collected, port), ExitStack() as stack:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        }
        servers = [
            stack.enter_context(started(server_argv(node_id=f"server-{i}"), env)) for i in range(2)
        ]
        balancer = stack.enter_context(started(balancer_argv(*(s.address for s in servers)), env))

        # A unary Predict through the client library: it makes the client span.
        with SluiceClient(balancer.address) as client:
            answer = client.infer({"input": digit(1)}, request_id="unary-1")
        assert answer.request_id == "unary-1"
        unary = next(s for s in client_spans.get_finished_spans() if s.name == CLIENT_SPAN)
        assert unary.kind is SpanKind.CLIENT

        # One call multiplexed on PredictStream: the context rides in the message's metadata.
        tracer = trace_api.get_tracer("test")
        with tracer.start_as_current_span("test/PredictStream", kind=SpanKind.CLIENT) as span:
            body = pb.PredictRequest(inputs=[codec.encode("input", digit(2))])
            message = pb.StreamRequest(
                id=1,
                request=body.SerializeToString(),
                timeout_s=10.0,
                metadata=tracing.inject({"x-request-id": "stream-1"}),
            )
            with grpc.insecure_channel(balancer.address) as channel:
                replies = list(pb_grpc.InferenceStub(channel).PredictStream(iter([message])))
        assert [(r.id, r.code) for r in replies] == [(1, 0)]
        stream_span = span.get_span_context()

        started_at = time.monotonic()
        for root, trace_id, stream in [
            (unary.context.span_id, unary.context.trace_id, False),
            (stream_span.span_id, stream_span.trace_id, True),
        ]:
            call, attempt, served, run = chain(collected, root, trace_id, stream)
            assert call.attributes.get("sluice.stream", False) is stream
            assert served.attributes["sluice.stream"] is True  # the balancer multiplexes
            assert attempt.attributes["sluice.routing"] == "affinity"
            assert attempt.attributes["server.address"] in {s.address for s in servers}
            assert served.attributes["sluice.request_id"] == ("stream-1" if stream else "unary-1")
            assert served.attributes["sluice.cache"] == "miss"
            assert served.attributes["rpc.grpc.status_code"] == 0
            assert run.attributes["sluice.model.version"] == "1"
            found = steps(collected, run)
            batch = found["sluice.batch.run"].attributes
            assert batch["sluice.batch.requests"] >= 1  # type: ignore[operator]
            assert batch["sluice.batch.rows"] >= 1  # type: ignore[operator]
            assert batch["sluice.batch.reason"] in {"full", "budget", "drained"}
            assert isinstance(batch["sluice.batch.inline"], bool)
            assert all(s.kind == 1 for s in found.values())  # INTERNAL
        assert time.monotonic() - started_at < 30
