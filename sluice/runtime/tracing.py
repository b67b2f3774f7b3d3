"""OpenTelemetry traces across client, balancer and server, off unless asked for.

A program traces when OTEL_TRACES_EXPORTER names `otlp` and/or `console` (and
OTEL_SDK_DISABLED is not `true`); the SDK reads every other OTEL_* variable. Off, a call
pays one check of `ON`. The client traces whenever the application installed a
TracerProvider. The rules and the spans: docs/DESIGN.md, "Tracing"."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import Token
from typing import TYPE_CHECKING, Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("sluice.tracing")

# The hot paths check this flag alone.
ON = False

INSTRUMENTATION = "sluice"
HEADERS = ("traceparent", "tracestate")  # W3C trace context: what a hop forwards
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_STATUS = "rpc.grpc.status_code"
REQUEST_ID = "sluice.request_id"
STREAM = "sluice.stream"  # the call was one message on a PredictStream
CACHE = "sluice.cache"  # hit, miss, shared (another caller's computation) or off
QUEUE_WAIT = "sluice.queue.wait"
BATCH_RUN = "sluice.batch.run"
ENCODE = "sluice.encode"
BATCH_ROWS = "sluice.batch.rows"
BATCH_REQUESTS = "sluice.batch.requests"
BATCH_REASON = "sluice.batch.reason"  # why the batch closed: full, budget or drained
BATCH_INLINE = "sluice.batch.inline"
BATCH_BUCKET = "sluice.batch.bucket"  # padded inputs: the batch's length bucket ("64x16": several)
SERVICE = "sluice.v1.Inference"
Attributes = Mapping[str, str | int | float | bool]

# The codes that are a server's own fault (OpenTelemetry's gRPC conventions).
SERVER_FAULTS = frozenset({2, 4, 12, 13, 14, 15})
EXPORTERS = ("otlp", "console")

_tracer: Tracer | None = None
_propagator: TextMapPropagator | None = None
_fields: frozenset[str] = frozenset()  # the metadata keys the propagator reads
_client: tuple[object, Tracer | None] = (None, None)  # (the global provider, its tracer)


def enabled() -> bool:
    """Whether `setup` turned tracing on in this process."""
    return ON


def exporters(environ: Mapping[str, str] | None = None) -> list[str]:
    """The exporters asked for: empty means tracing is off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    return [n for n in dict.fromkeys(names) if n and n != "none"]


def provider(service_name: str, environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """A TracerProvider as the environment asks (None: tracing is off), not installed."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    env = os.environ if environ is None else environ
    chosen = []
    for name in exporters(env):
        exporter = _exporter(name, env)
        if exporter is not None:
            chosen.append(exporter)
    if not chosen:
        return None
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service_name})
    made = TracerProvider(resource=resource, sampler=_sampler())
    for exporter in chosen:
        made.add_span_processor(BatchSpanProcessor(exporter))
    return made


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter | None:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        log.warning("OTEL_TRACES_EXPORTER: %r is not one of %s; ignored", name, EXPORTERS)
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol != "grpc":
        log.warning(
            "OTEL_EXPORTER_OTLP_PROTOCOL: only grpc is installed, not %r; ignored", protocol
        )
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, security, headers, timeout: from OTEL_EXPORTER_OTLP_*


def _sampler() -> Any:
    """OTEL_TRACES_SAMPLER's sampler, made parent-based: it decides only for new traces."""
    from opentelemetry.sdk.trace import sampling

    chosen = sampling._get_from_env_or_default()
    if isinstance(chosen, sampling.ParentBased):
        return chosen
    return sampling.ParentBased(chosen)


def setup(service_name: str) -> bool:
    """Turn tracing on if the environment asks: install the global TracerProvider and put
    trace ids in log records. Returns whether tracing is on."""
    made = provider(service_name)
    if made is None:
        return False
    trace.set_tracer_provider(made)
    log.info(
        "tracing on: %s exporting %s",
        made.resource.attributes.get("service.name"),
        ",".join(exporters()),
    )
    install(made.get_tracer(INSTRUMENTATION))
    _log_trace_ids()
    return True


def install(tracer: Tracer) -> None:
    """Trace with `tracer` from now on (setup's last step; tests call it with their own)."""
    global ON, _tracer
    _textmap()
    _tracer = tracer
    ON = True


def uninstall() -> None:
    """Tracing off again (for tests)."""
    global ON, _tracer
    ON = False
    _tracer = None


def _log_trace_ids() -> None:
    """Log records made inside a span carry `trace_id` and `span_id` (hex; empty outside)."""
    previous = logging.getLogRecordFactory()

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = previous(*args, **kwargs)
        context = trace.get_current_span().get_span_context()
        made.trace_id = format(context.trace_id, "032x") if context.is_valid else ""
        made.span_id = format(context.span_id, "016x") if context.is_valid else ""
        return made

    logging.setLogRecordFactory(record)


def _textmap() -> TextMapPropagator:
    global _propagator, _fields
    if _propagator is None:
        from opentelemetry import propagate

        _propagator = propagate.get_global_textmap()
        _fields = frozenset(_propagator.fields)  # computed on each read: once here
    return _propagator


def extract(metadata: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> Context | None:
    """The trace context in a call's metadata (a mapping or grpc's pairs), or None."""
    textmap = _textmap()
    fields = _fields
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    carrier = {
        key: value if isinstance(value, str) else value.decode("latin-1")
        for key, value in pairs
        if key in fields
    }
    return textmap.extract(carrier) if carrier else None


def inject(carrier: dict[str, str], context: Context | None = None) -> dict[str, str]:
    """Put the trace context (the current one, or `context`) into `carrier`; returns it."""
    _textmap().inject(carrier, context)
    return carrier


def tracer() -> Tracer:
    """The process's tracer (tracing must be on)."""
    assert _tracer is not None, "tracing is off"
    return _tracer


class Current:
    """Makes a recording span current for the block and ends it, recording an exception
    (the status is the call's code's). A span that does not record is left alone."""

    __slots__ = ("span", "token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.token: Token[Context] | None = None

    def __enter__(self) -> Span:
        if self.span.is_recording():
            self.token = context_api.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if self.token is None:
            return
        context_api.detach(self.token)
        if exc is not None:
            self.span.record_exception(exc)
        self.span.end()


def opened(
    name: str,
    attributes: Attributes | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: Span | None = None,
) -> Opened:
    """A span, child of `parent` or of the current span, current until its `end`."""
    context = None if parent is None else trace.set_span_in_context(parent)
    return Opened(tracer().start_span(name, context, kind, attributes))


class Opened:
    """A span made current until `end`: for an observer whose hooks start and end it (a
    `with` cannot span two hooks)."""

    __slots__ = ("_token", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._token = context_api.attach(trace.set_span_in_context(span))

    def end(self, error: BaseException | None = None) -> None:
        """End it; an Exception (not a cancellation) is recorded as its error status."""
        context_api.detach(self._token)
        if isinstance(error, Exception):
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.span.end()


def timed(name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
    """A child span of the current one over times taken elsewhere (`time.time_ns`)."""
    made = tracer().start_span(name, attributes=attributes, start_time=start_ns)
    made.end(end_time=max(end_ns, start_ns))


def recording() -> bool:
    """Whether the current span records (its trace is sampled)."""
    return trace.get_current_span().is_recording()


def annotate(key: str, value: str | int | float | bool) -> None:
    """Set an attribute on the current span."""
    trace.get_current_span().set_attribute(key, value)


def set_code(span: Span, code: int, message: str = "", *, server: bool = True) -> None:
    """Record a call's gRPC status on its span (a server's error only for its own faults)."""
    span.set_attribute(RPC_STATUS, code)
    if code and (not server or code in SERVER_FAULTS):
        span.set_status(Status(StatusCode.ERROR, message))


try:
    trace._TRACER_PROVIDER  # noqa: B018  # read on every call, so checked once here
    _HAS_GLOBAL = True
except AttributeError:  # an API without the global: ask it each time (slower)
    _HAS_GLOBAL = False


def client_tracer() -> Tracer | None:
    """The tracer for client spans: this process's, else the application's, else None."""
    global _client
    if ON:
        return _tracer
    if _HAS_GLOBAL:
        provider: object = trace._TRACER_PROVIDER
        if provider is None:
            return None
    else:
        provider = trace.get_tracer_provider()
    if provider is not _client[0]:
        found = provider if isinstance(provider, trace.TracerProvider) else None
        if found is None or isinstance(found, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            _client = (provider, None)
        else:
            _client = (provider, found.get_tracer(INSTRUMENTATION))
    return _client[1]


@contextmanager
def client_span(
    tracer: Tracer,
    name: str,
    metadata: tuple[tuple[str, str], ...],
    targets: Sequence[str],
    code: Callable[[BaseException], int | None] = lambda exc: None,
) -> Iterator[tuple[Span, tuple[tuple[str, str], ...]]]:
    """A CLIENT span for one call; yields it and `metadata` plus the context to send."""
    attributes = {RPC_SYSTEM: "grpc", RPC_SERVICE: SERVICE, RPC_METHOD: "Predict"}
    if len(targets) == 1:
        attributes["server.address"] = targets[0]
    else:  # the client balances them itself
        attributes["sluice.targets"] = ",".join(targets)
    with tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes) as made:
        for key, value in metadata:
            if key == "x-request-id":
                made.set_attribute(REQUEST_ID, value)
        try:
            yield made, metadata + tuple(inject({}).items())
        except BaseException as exc:
            status = code(exc)
            if status is not None:
                set_code(made, status, str(exc), server=False)
            raise
