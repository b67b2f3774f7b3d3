"""The spans of a call's way through a hop, as observers hung on its one path (the planner's
`Observer`, and the hooks of a program's entry): made only while tracing is on
(sluice.runtime.tracing), and only for a sampled call. A program's path holds None in
their place otherwise, and runs no span code.

`served` is a call's SERVER span at this hop; `Attempts` a CLIENT span per attempt the
planner sends (the balancer's `sluice.balancer/attempt`); `Sending` one CLIENT span around a
whole planner call (a fan-out chunk). Each puts its span's context in the headers that the
attempts carry, in place of the caller's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from sluice.core.errors import status_name
from sluice.routing.hedge import LOST
from sluice.routing.plan import Attempt, ReplyLike
from sluice.routing.pool import Backend
from sluice.runtime import tracing

NODE_ID = "sluice.node_id"  # on the SERVER span: the hop's node id
ATTEMPTS = "sluice.attempts"  # on the SERVER span: how many attempts the call took
RETRYABLE = "sluice.retryable"  # on an attempt's span: its answer was a refusal before work
HEDGE = "sluice.hedge"  # on an attempt's span: a second copy of an attempt still out
CANCELLED = "sluice.cancelled"  # on an attempt's span: why it was cancelled unanswered
Metadata = Mapping[str, str] | Iterable[tuple[str, str | bytes]]


class Served(tracing.Current):
    """A call's SERVER span, current from `served` until `end` or `failed`."""

    __slots__ = ()

    def event(self, name: str, attributes: tracing.Attributes) -> None:
        self.span.add_event(name, attributes)

    def end(self, code: int, message: str = "") -> None:
        """The call's status (an error only where the server is at fault), and the end."""
        tracing.set_code(self.span, code, message)
        self.__exit__(None, None, None)

    def failed(self, error: BaseException) -> None:
        """The call left with `error` (cancelled): recorded; its status is the code's."""
        self.__exit__(type(error), error, None)


def served(
    name: str,
    metadata: Metadata,
    method: str,
    service: str = tracing.SERVICE,
    *,
    node_id: str,
    stream: bool = False,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> Served | None:
    """The SERVER span of one call (tracing on), child of the caller's span that `metadata`
    names (none: the root of a trace), with what every hop's says: its `node_id`, `stream`
    (the call was one message on a PredictStream) and the caller's `request_id` (None: it
    gave none). None when the call is not sampled. Then nothing on its path records, and
    `headers` (what a hop forwards) get the span's context, so the decision goes on to the
    next hop."""
    made: dict[str, str | bool] = {
        tracing.RPC_SYSTEM: "grpc",
        tracing.RPC_SERVICE: service,
        tracing.RPC_METHOD: method,
        NODE_ID: node_id,
    }
    if stream:
        made[tracing.STREAM] = True
    if request_id is not None:
        made[tracing.REQUEST_ID] = request_id
    span = tracing.tracer().start_span(name, tracing.extract(metadata), SpanKind.SERVER, made)
    call = Served(span)
    call.__enter__()
    if call.token is not None:  # it records
        return call
    if headers is not None:
        tracing.inject(headers, trace.set_span_in_context(span))
    return None


class Attempts:
    """A planner Observer: a CLIENT span `name` per attempt, child of `parent` (the call's),
    with the routing decision `route(backend)` tells (how, why; a retry says after what, a
    hedge (`sluice.hedge`) which attempt was still out), its context put into `headers`
    before the attempt is sent. Two may be out at once (a hedge beside its attempt). At the
    end, `parent` gets the number of attempts."""

    __slots__ = ("_sending", "headers", "name", "parent", "route", "tried")

    def __init__(
        self,
        name: str,
        parent: Span,
        headers: dict[str, str],
        route: Callable[[Backend], tuple[str, str]],
    ) -> None:
        self.name = name
        self.parent = parent
        self.headers = headers
        self.route = route
        self.tried: list[str] = []  # each attempt ended so far: "address: outcome"
        self._sending: dict[int, tuple[Attempt, tracing.Opened]] = {}  # by id of the attempt

    def attempt_started(self, attempt: Attempt) -> None:
        backend = attempt.backend
        routing, why = self.route(backend)
        out = [a.backend.address for a, _ in self._sending.values()]
        if attempt.hedge and out:
            why = f"hedge beside {out[0]}, not answered yet; {why}"
        elif self.tried:
            why = f"retry after {self.tried[-1]}; {why}"
        attributes: tracing.Attributes = {
            "server.address": backend.address,
            "sluice.attempt": len(self.tried) + len(out) + 1,
            "sluice.routing": routing,
            "sluice.routing.why": why,
            **({HEDGE: True} if attempt.hedge else {}),
        }
        sending = tracing.opened(self.name, attributes, kind=SpanKind.CLIENT, parent=self.parent)
        self._sending[id(attempt)] = (attempt, sending)
        tracing.inject(self.headers)  # the attempt's span is the current one

    def attempt_ended(
        self, attempt: Attempt, reply: ReplyLike | None, error: BaseException | None
    ) -> None:
        started = self._sending.pop(id(attempt), None)
        assert started is not None, "an attempt ended that never started"
        sending = started[1]
        address = attempt.backend.address
        if reply is None:  # the planner decides what it means
            self.tried.append(f"{address}: {type(error).__name__}")
            if isinstance(error, asyncio.CancelledError) and str(error) == LOST:
                sending.span.set_attribute(CANCELLED, LOST)
            sending.end(error)
            return
        self.tried.append(f"{address}: {status_name(reply.code)}")
        tracing.set_code(sending.span, reply.code, reply.message, server=False)
        if reply.retryable:
            sending.span.set_attribute(RETRYABLE, True)
        sending.end()

    def ended(self, answer: ReplyLike | None, error: BaseException | None) -> None:
        if answer is not None:
            self.parent.set_attribute(ATTEMPTS, len(self.tried))


class Sending:
    """A planner Observer: one CLIENT span `name` (child of `parent`) around all of a call's
    attempts, current from now until the call's end; its context is put into `headers` now,
    so every attempt carries it."""

    __slots__ = ("_sending",)

    def __init__(
        self, name: str, parent: Span, attributes: tracing.Attributes, headers: dict[str, str]
    ) -> None:
        self._sending = tracing.opened(name, attributes, kind=SpanKind.CLIENT, parent=parent)
        tracing.inject(headers)

    def attempt_started(self, attempt: Attempt) -> None:
        pass

    def attempt_ended(
        self, attempt: Attempt, reply: ReplyLike | None, error: BaseException | None
    ) -> None:
        pass

    def ended(self, answer: ReplyLike | None, error: BaseException | None) -> None:
        if answer is not None:
            tracing.set_code(self._sending.span, answer.code, answer.message, server=False)
        self._sending.end(error)
