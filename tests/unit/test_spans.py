"""The spans as observers on the one request path (sluice.runtime.spans): off, or for a call
that is not sampled, no span code runs past the flag (and the sampling decision); on, an
attempt that raised, a retry after it, and a model run that failed are recorded as the
traced twins used to record them; a span that cannot be made leaves no call in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import SpanKind, StatusCode

from sluice.balancer.service import ATTEMPT, CHUNK, FANOUT_CHUNKS
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.runtime import spans as observers
from sluice.runtime import tracing
from sluice.runtime.spans import ATTEMPTS
from sluice.server.dataplane.batcher import Batcher, Pending
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import MODEL_RUN, Dataplane
from sluice.server.service import SPAN as SERVER_SPAN
from sluice.server.service import InferenceService
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from sluice.wire.mux import Reply, StreamBroken
from tests.unit.test_fanout import answer, batch, fanout_service
from tests.unit.test_tracing import (
    BODY,
    PARENT,
    TRACE_ID,
    Details,
    FakeContext,
    balancer,
    named,
    only,
    parent_id,
    serve_calls,
)

# Everything that makes, reads or writes a span or a trace context.
SPAN_CODE = {
    tracing: ("extract", "inject", "opened", "tracer", "timed", "annotate"),
    observers: ("served", "Attempts", "Sending"),
}


def forbid(monkeypatch: pytest.MonkeyPatch, names: dict[Any, Sequence[str]]) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("span code ran")

    for module, found in names.items():
        for name in found:
            monkeypatch.setattr(module, name, forbidden)


def test_off_neither_program_runs_span_code(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not tracing.ON
    forbid(monkeypatch, SPAN_CODE)
    service, upstreams = balancer({"a:1": [Reply(0), Reply(0)]})
    for metadata in ({"traceparent": PARENT}, {"x-cache-control": "no-cache"}):
        assert asyncio.run(service.forward(BODY, metadata, None, stream=True)).code == 0
    assert upstreams["a:1"].sent[0] == {"traceparent": PARENT}  # the caller's, as it came
    fanned, _ = fanout_service(2, fanout_rows=4)
    _, body = batch(8)
    assert asyncio.run(fanned.forward(body, {"traceparent": PARENT}, None)).code == 0
    assert fanned.fanned.chunks == 2
    calls = [("Predict", {"traceparent": PARENT}), ("PredictStream", {"traceparent": PARENT})]
    assert len(asyncio.run(serve_calls(engine, calls))) == 2


@pytest.fixture
def unsampled() -> Iterator[InMemorySpanExporter]:
    """Tracing on, sampling nothing that does not come sampled."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider.get_tracer("test"))
    yield exporter
    tracing.uninstall()
    provider.shutdown()


def test_an_unsampled_call_runs_no_span_code_past_its_decision(
    engine: Engine, unsampled: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the SERVER span's sampling decision: no attempt, chunk or model run spans.
    forbid(monkeypatch, {tracing: ("opened", "timed"), observers: ("Attempts", "Sending")})
    not_sampled = PARENT[:-2] + "00"
    service, upstreams = balancer({"a:1": [Reply(0)]})
    assert asyncio.run(service.forward(BODY, {"traceparent": not_sampled}, None)).code == 0
    fanned, chunks = fanout_service(2, fanout_rows=4)
    _, body = batch(8)
    assert asyncio.run(fanned.forward(body, {"traceparent": not_sampled}, None)).code == 0
    sent = upstreams["a:1"].sent + [m for model in chunks for m in model.sent]
    assert len(sent) == 3
    for metadata in sent:  # the balancer's own span, unsampled, is the next hop's parent
        _, trace_id, span_id, flags = metadata["traceparent"].split("-")
        assert (trace_id, flags) == (f"{TRACE_ID:032x}", "00")
        assert span_id != PARENT.split("-")[2]
    calls = [("Predict", {"traceparent": not_sampled}), ("PredictStream", {})]
    assert len(asyncio.run(serve_calls(engine, calls))) == 2
    assert unsampled.get_finished_spans() == ()


class Raises:
    """A fake upstream that raises the next of `errors` (shared), and answers OK when none is
    left."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = errors
        self.sent: list[dict[str, str]] = []

    async def predict(
        self, body: bytes, metadata: dict[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        self.sent.append(dict(metadata))
        if self.errors:
            raise self.errors.pop(0)
        return Reply(0, body=b"ok")


def test_an_attempt_that_raised_is_recorded_and_its_retry_says_after_what(
    spans: InMemorySpanExporter,
) -> None:
    service, _ = balancer({"a:1": [], "b:2": []})
    upstreams, errors = {}, [StreamBroken("stream reset")]  # the first attempt's, wherever
    for backend in service.pool.backends.values():
        backend.transport = upstreams[backend.address] = Raises(errors)
    reply = asyncio.run(service.forward(BODY, {"traceparent": PARENT}, None))
    assert reply.code == 0
    call = only(spans, "sluice.balancer/Predict")
    first, second = sorted(named(spans, ATTEMPT), key=lambda s: s.start_time or 0)
    assert call.attributes is not None and call.attributes[ATTEMPTS] == 2
    assert first.status.status_code is StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception"]
    assert first.attributes is not None and second.attributes is not None
    assert tracing.RPC_STATUS not in first.attributes  # no reply, so no status code
    assert str(second.attributes["sluice.routing.why"]).startswith(
        f"retry after {first.attributes['server.address']}: StreamBroken; "
    )
    assert second.attributes[tracing.RPC_STATUS] == 0
    assert second.status.status_code is StatusCode.UNSET
    for span in (first, second):  # each attempt carried its own span's context
        assert span.kind is SpanKind.CLIENT and parent_id(span) == call.context.span_id
        assert span.attributes is not None
        sent = upstreams[str(span.attributes["server.address"])].sent[0]
        assert sent["traceparent"].split("-")[2] == f"{span.context.span_id:016x}"


class Failing:
    """A model instance whose runs fail."""

    async def run(self, batch: Sequence[Pending]) -> list[dict[str, np.ndarray]]:
        raise RuntimeError("the device fell over")

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> dict[str, np.ndarray] | None:
        return None


def test_a_failed_model_run_is_recorded_on_its_span_with_the_wait_it_took(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    async def run() -> None:
        batcher = Batcher([Failing()])  # type: ignore[list-item]
        plane = Dataplane(Models([Model(engine, batcher)]), LRUCache(16, 1 << 20))
        found = InferenceService(plane, node_id="n1").handler().service(Details("Predict"))
        assert found is not None
        context = FakeContext((("traceparent", PARENT),))
        try:
            await found.unary_unary(BODY, context)  # type: ignore[arg-type, misc]
        except AssertionError as exc:  # FakeContext.abort
            assert "internal error" in str(exc)
        else:
            raise AssertionError("the call should have failed")
        finally:
            await batcher.close()

    asyncio.run(run())
    served = only(spans, SERVER_SPAN)
    assert served.attributes is not None and served.attributes[tracing.RPC_STATUS] == 13
    assert served.status.status_code is StatusCode.ERROR
    ran = only(spans, MODEL_RUN)
    assert parent_id(ran) == served.context.span_id
    assert ran.status.status_code is StatusCode.ERROR
    assert [e.name for e in ran.events] == ["exception"]
    steps = {s.name for s in spans.get_finished_spans() if parent_id(s) == ran.context.span_id}
    assert tracing.QUEUE_WAIT in steps and tracing.ENCODE not in steps


def test_a_span_that_fails_to_be_made_leaves_no_balancer_call_in_flight(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no span today")

    monkeypatch.setattr(observers, "served", broken)
    service, upstreams = balancer({"a:1": [Reply(0)]})
    with pytest.raises(RuntimeError, match="no span today"):
        asyncio.run(service.forward(BODY, {"traceparent": PARENT}, None))
    assert service.stats.in_flight == 0 and upstreams["a:1"].sent == []


def test_a_fanned_out_call_that_went_whole_counts_no_chunks(spans: InMemorySpanExporter) -> None:
    service, _ = fanout_service(2, fanout_rows=4)

    async def summed(
        body: bytes, metadata: Mapping[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        x = codec.decode_all(pb.PredictRequest.FromString(body).inputs)["x"]
        return Reply(0, body=answer({"total": x.sum(axis=0, keepdims=True)}))

    for backend in service.pool.backends.values():
        backend.transport.predict = summed
    _, body = batch(8)
    assert asyncio.run(service.forward(body, {"traceparent": PARENT}, None)).code == 0
    call = only(spans, "sluice.balancer/Predict")
    assert call.attributes is not None and FANOUT_CHUNKS not in call.attributes
    assert len(named(spans, CHUNK)) == 2 and len(named(spans, ATTEMPT)) == 1  # then whole


def test_only_a_predict_on_a_stream_is_marked_as_one(spans: InMemorySpanExporter) -> None:
    service, _ = balancer({"a:1": [Reply(0), Reply(0)]})
    infer = kpb.ModelInferRequest(model_name="digits").SerializeToString()
    assert asyncio.run(service.forward(infer, {}, None, stream=True, method="ModelInfer")).code == 0
    assert asyncio.run(service.forward(BODY, {}, None, stream=True)).code == 0
    (model_infer,) = named(spans, "sluice.balancer/ModelInfer")
    (predict,) = named(spans, "sluice.balancer/Predict")
    assert model_infer.attributes is not None and tracing.STREAM not in model_infer.attributes
    assert model_infer.attributes[tracing.RPC_METHOD] == "ModelInfer"
    assert predict.attributes is not None and predict.attributes[tracing.STREAM] is True
    assert predict.attributes[tracing.RPC_METHOD] == "PredictStream"
