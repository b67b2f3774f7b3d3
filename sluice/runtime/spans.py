"""A call's spans at a hop, as observers on its one path; None there when tracing is off or
the call is not sampled. `served`: the SERVER span; `Attempts`: a CLIENT span per attempt;
`Sending`: one CLIENT span around a whole planner call (a fan-out chunk)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from sluice.core.errors import status_name
from sluice.routing.hedge import marks
from sluice.routing.plan import Attempt, ReplyLike
from sluice.routing.pool import Backend
from sluice.runtime import tracing

NODE_ID = "sluice.node_id"  # on the SERVER span: the hop's node id
ATTEMPTS = "sluice.attempts"  # on the SERVER span: how many attempts the call took
RETRYABLE = "sluice.retryable"  # on an attempt's span: its answer was a refusal before work
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
    """The SERVER span of one call, child of the caller's span in `metadata`. None when the
    call is not sampled: then `headers` (what a hop forwards) get the span's context, so the
    next hop keeps the decision."""
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
    """A planner Observer: a CLIENT span per attempt, child of `parent`, saying why it went
    where it did (`route(backend)`); its context goes into `headers` before the send. Two
    may be out at once (sluice.routing.hedge.marks says what a layer adds)."""

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
        self.tried: list[str] = []  # "address: outcome"
        self._sending: dict[int, tuple[Attempt, tracing.Opened]] = {}

    def attempt_started(self, attempt: Attempt) -> None:
        backend = attempt.backend
        routing, why = self.route(backend)
        out = [a.backend.address for a, _ in self._sending.values()]
        beside = marks.beside(attempt, out)
        if beside:
            why = f"{beside}; {why}"
        elif self.tried:
            why = f"retry after {self.tried[-1]}; {why}"
        attributes: tracing.Attributes = {
            "server.address": backend.address,
            "sluice.attempt": len(self.tried) + len(out) + 1,
            "sluice.routing": routing,
            "sluice.routing.why": why,
            **marks.marked(attempt),
        }
        sending = tracing.opened(self.name, attributes, kind=SpanKind.CLIENT, parent=self.parent)
        self._sending[id(attempt)] = (attempt, sending)
        tracing.inject(self.headers)

    def attempt_ended(
        self, attempt: Attempt, reply: ReplyLike | None, error: BaseException | None
    ) -> None:
        started = self._sending.pop(id(attempt), None)
        assert started is not None, "an attempt ended that never started"
        sending = started[1]
        address = attempt.backend.address
        if reply is None:
            self.tried.append(f"{address}: {type(error).__name__}")
            sending.span.set_attributes(marks.cancelled(error))
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
    """A planner Observer: one CLIENT span around all of a call's attempts, whose context
    every attempt carries in `headers`."""

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
