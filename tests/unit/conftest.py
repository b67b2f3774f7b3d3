"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice import models
from sluice.runtime import tracing
from sluice.server.dataplane.engine import Engine


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, into memory, without touching the global provider."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider.get_tracer("test"))
    yield exporter
    tracing.uninstall()
    provider.shutdown()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """The bundled digits model on the CPU, one engine a module."""
    engine = Engine(models.DIGITS, device="cpu")
    yield engine
    engine.close()
