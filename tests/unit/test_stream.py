"""The receiving side of PredictStream (sluice.wire.stream.serve) without sockets: a fake
sender that counts the messages pulled from it and a fake writer that blocks until allowed,
so backpressure (reading stops at the bound, resumes as replies are written), completion
order, refusals, garbage, stop and cancellation are checked step by step."""

from __future__ import annotations

import asyncio
import math

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.errors import Code
from sluice.v1 import inference_pb2 as pb
from sluice.wire import peek, stream


def request(i: int) -> bytes:
    return pb.StreamRequest(id=i).SerializeToString()


def ids(written: list[bytes]) -> list[int]:
    return [pb.StreamResponse.FromString(raw).id for raw in written]


class Sender:
    """An async iterator over `messages` that counts how many were pulled; with `hold`, it
    then waits as a sender that keeps the stream open would."""

    def __init__(self, messages: list[bytes], *, hold: bool = False) -> None:
        self.messages = messages
        self.hold = hold
        self.pulled = 0

    def __aiter__(self) -> Sender:
        return self

    async def __anext__(self) -> bytes:
        await asyncio.sleep(0)
        if self.pulled >= len(self.messages):
            if self.hold:
                await asyncio.Event().wait()
            raise StopAsyncIteration
        self.pulled += 1
        return self.messages[self.pulled - 1]


class Writer:
    """A write that completes only as far as `allow` lets it (a reader that does not read)."""

    def __init__(self, allowed: float = 0) -> None:
        self.written: list[bytes] = []
        self.allowed = allowed
        self._changed = asyncio.Event()

    def allow(self, more: float = math.inf) -> None:
        self.allowed += more
        self._changed.set()

    async def __call__(self, raw: bytes) -> None:
        while len(self.written) >= self.allowed:
            self._changed.clear()
            await self._changed.wait()
        self.written.append(raw)


async def echo(message: stream.Request) -> bytes:
    await asyncio.sleep(0)
    return pb.StreamResponse(id=message.id).SerializeToString()


async def settle(rounds: int = 100) -> None:
    """Let every runnable task run until nothing more happens (`rounds` turns of the loop)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_reading_stops_at_the_bound_and_resumes_as_replies_are_written() -> None:
    sender, writer = Sender([request(i) for i in range(1, 101)]), Writer()
    serving = asyncio.create_task(stream.serve(sender, writer, echo, max_pending=4))
    await settle()
    assert sender.pulled == 4  # every call answered, none written: reading stopped
    writer.allow(1)
    await settle()
    assert (sender.pulled, len(writer.written)) == (5, 1)
    writer.allow(3)
    await settle()
    assert (sender.pulled, len(writer.written)) == (8, 4)
    writer.allow()
    await asyncio.wait_for(serving, 5)
    assert sender.pulled == 100
    assert sorted(ids(writer.written)) == list(range(1, 101))


async def test_calls_in_flight_count_towards_the_bound() -> None:
    gate = asyncio.Event()

    async def slow(message: stream.Request) -> bytes:
        await gate.wait()
        return pb.StreamResponse(id=message.id).SerializeToString()

    sender, writer = Sender([request(i) for i in range(1, 21)]), Writer(math.inf)
    serving = asyncio.create_task(stream.serve(sender, writer, slow, max_pending=3))
    await settle()
    assert sender.pulled == 3  # three calls running, none answered: reading stopped
    gate.set()
    await asyncio.wait_for(serving, 5)
    assert sorted(ids(writer.written)) == list(range(1, 21))


async def test_the_default_bound_holds() -> None:
    sender, writer = Sender([request(i) for i in range(1, 2001)]), Writer()
    serving = asyncio.create_task(stream.serve(sender, writer, echo))
    await settle(10 * stream.MAX_PENDING)  # room to pull every message, were it unbounded
    assert sender.pulled == stream.MAX_PENDING
    writer.allow()
    await asyncio.wait_for(serving, 10)
    assert sorted(ids(writer.written)) == list(range(1, 2001))


async def test_replies_are_written_in_completion_order() -> None:
    gates = {i: asyncio.Event() for i in (1, 2, 3)}

    async def answer(message: stream.Request) -> bytes:
        await gates[message.id].wait()
        return pb.StreamResponse(id=message.id).SerializeToString()

    sender, writer = Sender([request(i) for i in (1, 2, 3)]), Writer(math.inf)
    serving = asyncio.create_task(stream.serve(sender, writer, answer, max_pending=3))
    for i in (3, 1, 2):
        gates[i].set()
        await settle()
    await asyncio.wait_for(serving, 5)
    assert ids(writer.written) == [3, 1, 2]


async def test_refusals_are_written_and_count_towards_the_bound() -> None:
    def refuse(message: stream.Request) -> bytes | None:
        if message.id % 2:
            return None
        return pb.StreamResponse(id=message.id, code=Code.UNAVAILABLE).SerializeToString()

    sender, writer = Sender([request(i) for i in range(1, 11)]), Writer()
    serving = asyncio.create_task(stream.serve(sender, writer, echo, refuse=refuse, max_pending=2))
    await settle()
    assert sender.pulled == 2
    writer.allow()
    await asyncio.wait_for(serving, 5)
    replies = [pb.StreamResponse.FromString(raw) for raw in writer.written]
    assert sorted(r.id for r in replies) == list(range(1, 11))
    assert all((r.code == Code.UNAVAILABLE) == (r.id % 2 == 0) for r in replies)


async def test_garbage_ends_the_stream_after_the_calls_already_read() -> None:
    gate = asyncio.Event()

    async def slow(message: stream.Request) -> bytes:
        await gate.wait()
        return pb.StreamResponse(id=message.id).SerializeToString()

    messages = [request(1), request(2), b"\xff\xff\xff", request(3)]
    sender, writer = Sender(messages), Writer(math.inf)
    serving = asyncio.create_task(stream.serve(sender, writer, slow, max_pending=8))
    await settle()
    assert sender.pulled == 3  # nothing read after the garbage
    assert writer.written == [stream.BAD_MESSAGE]
    assert not serving.done()  # the calls already read are still answered
    gate.set()
    await asyncio.wait_for(serving, 5)
    assert writer.written[0] == stream.BAD_MESSAGE
    assert sorted(ids(writer.written[1:])) == [1, 2]
    assert sender.pulled == 3


async def test_stop_ends_the_stream_once_the_calls_read_are_answered() -> None:
    gate = asyncio.Event()

    async def slow(message: stream.Request) -> bytes:
        await gate.wait()
        return pb.StreamResponse(id=message.id).SerializeToString()

    stop = asyncio.Event()
    sender, writer = Sender([request(1), request(2)], hold=True), Writer(math.inf)
    serving = asyncio.create_task(stream.serve(sender, writer, slow, stop=stop, max_pending=8))
    await settle()
    stop.set()
    await settle()
    assert not serving.done()
    gate.set()
    await asyncio.wait_for(serving, 5)
    assert sorted(ids(writer.written)) == [1, 2]


async def test_stop_while_reading_is_held_by_the_bound() -> None:
    stop = asyncio.Event()
    sender, writer = Sender([request(i) for i in range(1, 11)]), Writer()
    serving = asyncio.create_task(stream.serve(sender, writer, echo, stop=stop, max_pending=2))
    await settle()
    stop.set()
    writer.allow()
    await asyncio.wait_for(serving, 5)
    assert sender.pulled == 2
    assert sorted(ids(writer.written)) == [1, 2]


async def test_a_failed_answer_frees_its_place() -> None:
    async def flaky(message: stream.Request) -> bytes:
        if message.id <= 3:
            raise RuntimeError("boom")
        return pb.StreamResponse(id=message.id).SerializeToString()

    sender, writer = Sender([request(i) for i in range(1, 11)]), Writer(math.inf)
    await asyncio.wait_for(stream.serve(sender, writer, flaky, max_pending=3), 5)
    assert sorted(ids(writer.written)) == list(range(4, 11))


async def test_cancellation_cancels_the_calls_running() -> None:
    started: list[asyncio.Task[object] | None] = []

    async def forever(message: stream.Request) -> bytes:
        started.append(asyncio.current_task())
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    before = asyncio.all_tasks()
    sender, writer = Sender([request(i) for i in range(1, 5)], hold=True), Writer(math.inf)
    serving = asyncio.create_task(stream.serve(sender, writer, forever, max_pending=8))
    await settle()
    assert len(started) == 4
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    await settle()
    assert all(task is not None and task.cancelled() for task in started)
    assert asyncio.all_tasks() == before  # nothing left behind


async def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        await stream.serve(Sender([]), Writer(), echo, max_pending=0)


# The stream messages framed and read by hand (sluice.wire.stream): the bytes written parse,
# under protobuf, as the message protobuf would have written, and what is read off any bytes
# is what protobuf parses of them, or a refusal where protobuf refuses them.
texts = st.text(max_size=12)
pairs = st.dictionaries(texts, texts, max_size=4)
ids_ = st.integers(0, 2**64 - 1)
bodies = st.binary(max_size=300)
seconds = st.floats(allow_nan=False)
codes = st.integers(-(2**31), 2**31 - 1)


@settings(max_examples=300, deadline=None)
@given(ident=ids_, body=bodies, timeout=seconds, metadata=pairs, method=texts)
def test_a_framed_request_is_the_message_protobuf_writes(
    ident: int, body: bytes, timeout: float, metadata: dict[str, str], method: str
) -> None:
    raw = stream.write_request(ident, body, timeout, metadata, method)
    want = pb.StreamRequest(
        id=ident, request=body, timeout_s=timeout, metadata=metadata, method=method
    )
    assert pb.StreamRequest.FromString(raw) == want


@settings(max_examples=300, deadline=None)
@given(ident=ids_, code=codes, text=texts, body=bodies, trailers=pairs, retryable=st.booleans())
def test_a_framed_response_is_the_message_protobuf_writes(
    ident: int, code: int, text: str, body: bytes, trailers: dict[str, str], retryable: bool
) -> None:
    raw = stream.write_response(ident, body, code, text, trailers.items(), retryable)
    want = pb.StreamResponse(
        id=ident,
        code=code,
        message=text,
        response=body,
        trailers=trailers,
        retryable=retryable,
    )
    assert pb.StreamResponse.FromString(raw) == want


def unknown(draw: st.DrawFn) -> bytes:
    """A field no stream message has, or one of theirs of another wire type: kept by the
    parser as unknown, skipped by the read."""
    number = draw(st.integers(1, 40))
    wire = draw(st.sampled_from([0, 1, 2, 5]))
    key = bytes(_varint(number << 3 | wire))
    if wire == 0:
        return key + bytes(_varint(draw(st.integers(0, 2**64 - 1))))
    if wire == 2:
        value = draw(st.binary(max_size=8))
        return key + bytes(_varint(len(value))) + value
    return key + draw(st.binary(min_size=8 if wire == 1 else 4, max_size=8 if wire == 1 else 4))


def _varint(value: int) -> bytearray:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return out


@st.composite
def wire_messages(draw: st.DrawFn, message: type[pb.StreamRequest | pb.StreamResponse]) -> bytes:
    """Messages as a sender may write them: protobuf's own bytes, cut into pieces with
    unknown fields and repeats between, some cut short or with a byte changed."""
    if message is pb.StreamRequest:
        one = pb.StreamRequest(
            id=draw(ids_),
            request=draw(bodies),
            timeout_s=draw(st.floats()),
            metadata=draw(pairs),
            method=draw(texts),
        )
    else:
        one = pb.StreamResponse(
            id=draw(ids_),
            code=draw(codes),
            message=draw(texts),
            response=draw(bodies),
            trailers=draw(pairs),
            retryable=draw(st.booleans()),
        )
    raw = one.SerializeToString()
    parts = [raw]
    for _ in range(draw(st.integers(0, 3))):
        parts.insert(draw(st.integers(0, len(parts))), draw(st.composite(unknown)()))
    if draw(st.booleans()):
        parts.append(raw)  # a second copy: the last of each field wins, map entries add up
    whole = b"".join(parts)
    change = draw(st.sampled_from(["none", "cut", "byte"]))
    if change == "cut" and whole:
        whole = whole[: draw(st.integers(0, len(whole) - 1))]
    elif change == "byte" and whole:
        at = draw(st.integers(0, len(whole) - 1))
        whole = whole[:at] + bytes([draw(st.integers(0, 255))]) + whole[at + 1 :]
    return whole


def parsed(message: type[pb.StreamRequest | pb.StreamResponse], raw: bytes) -> tuple | None:
    try:
        got = message.FromString(raw)
    except DecodeError:
        return None
    if isinstance(got, pb.StreamRequest):
        return (got.id, got.request, got.timeout_s, dict(got.metadata), got.method)
    return (got.id, got.code, got.message, got.response, dict(got.trailers), got.retryable)


def same(a: tuple | None, b: tuple | None) -> bool:
    """Equal, a NaN timeout equal to itself."""
    if a is None or b is None:
        return a is b
    return all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))


def quirky(raw: bytes, pairs_field: int) -> bool:
    """Bytes where the read may refuse what protobuf takes: a group (a wire type no sender of
    ours writes, which the walk does not take), or a map entry holding a field besides its
    key and value (protobuf drops such an entry, or refuses the whole message, by the
    entry's bytes; the read drops it)."""
    try:
        for number, wire, a, b in peek.fields(raw, 0, len(raw)):
            if number == pairs_field and wire == 2:
                inner = [(n, w) for n, w, _, _ in peek.fields(raw, a, b)]
                if any(field not in ((1, 2), (2, 2)) for field in inner):
                    return True
    except peek.Malformed as exc:
        return "wire type 3" in str(exc) or "wire type 4" in str(exc)
    return False


READS = {
    pb.StreamRequest: (stream.wire_request, pb.StreamRequest.METADATA_FIELD_NUMBER),
    pb.StreamResponse: (stream.wire_response, pb.StreamResponse.TRAILERS_FIELD_NUMBER),
}


def check_read(message: type[pb.StreamRequest | pb.StreamResponse], raw: bytes) -> None:
    read, pairs_field = READS[message]
    got, want = read(raw), parsed(message, raw)
    if not same(None if got is None else tuple(got), want):
        assert quirky(raw, pairs_field), (raw, got, want)


@settings(max_examples=1000, deadline=None)
@given(raw=wire_messages(pb.StreamRequest))
def test_a_request_read_off_the_wire_is_what_protobuf_parses(raw: bytes) -> None:
    check_read(pb.StreamRequest, raw)


@settings(max_examples=1000, deadline=None)
@given(raw=wire_messages(pb.StreamResponse))
def test_a_response_read_off_the_wire_is_what_protobuf_parses(raw: bytes) -> None:
    check_read(pb.StreamResponse, raw)


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=64))
def test_bytes_protobuf_refuses_are_refused(raw: bytes) -> None:
    for message in READS:
        check_read(message, raw)


@pytest.mark.parametrize("size", [1, peek.WIRE_READ_FROM])
def test_small_messages_are_parsed_and_large_ones_read_alike(size: int) -> None:
    """Under peek.WIRE_READ_FROM bytes protobuf parses a message, from there it is read by hand: the
    same fields either way, and garbage refused either way."""
    body = b"x" * size
    request = pb.StreamRequest(id=7, request=body, timeout_s=1.5, metadata={"a": "b"}, method="M")
    raw = request.SerializeToString()
    assert stream.read_request(raw) == (7, body, 1.5, {"a": "b"}, "M")
    assert stream.read_request(raw[:-1]) is None
    response = pb.StreamResponse(
        id=7, code=-3, message="m", response=body, trailers={"c": "d"}, retryable=True
    )
    raw = response.SerializeToString()
    assert stream.read_response(raw) == (7, -3, "m", body, {"c": "d"}, True)
    assert stream.read_response(raw[:-1]) is None


# Messages to measure: empty, small, with wide characters in their map, read by hand.
MEASURED = [
    (0, b"", {}, None, ""),
    (7, b"x" * 200, {"key": "value", "ключ": "значение" * 10}, 1.5, "ModelInfer"),
    (2**64 - 1, b"y" * 70_000, {f"k{i}": "\U0001f600" * i for i in range(30)}, 0.25, "M"),
    (300, b"z", {"a": "b" * 5000}, -0.0, ""),
]


@pytest.mark.parametrize(("ident", "body", "pairs", "timeout", "method"), MEASURED)
def test_a_message_is_measured_as_it_is_written(
    ident: int, body: bytes, pairs: dict[str, str], timeout: float | None, method: str
) -> None:
    """framed() counts the bytes write_response/write_request give, and near() never lets a
    message over the limit go unmeasured: one byte over, its size; at the limit, 0."""
    reply = len(stream.write_response(ident, body, trailers=pairs.items()))
    head = pb.StreamResponse(id=ident, trailers=pairs)
    assert stream.framed(head, body) == reply
    assert stream.near(reply - 1, body, pairs.items())
    assert stream.response_size(reply - 1, ident, body, list(pairs.items())) == reply
    assert stream.response_size(reply, ident, body, list(pairs.items())) == 0
    assert stream.response_size(0, ident, body, list(pairs.items())) == 0
    request = len(stream.write_request(stream.WIDEST_ID, body, timeout or 0.0, pairs, method))
    head_ = pb.StreamRequest(
        id=stream.WIDEST_ID, timeout_s=timeout or 0.0, metadata=pairs, method=method
    )
    assert stream.framed(head_, body) == request
    assert stream.near(request - 1, body, pairs.items())
    assert stream.request_size(request - 1, body, pairs, timeout, method) == request
    assert stream.request_size(request, body, pairs, timeout, method) == 0
    assert stream.request_size(0, body, pairs, timeout, method) == 0


@pytest.mark.parametrize("number", [1, 15, 16, 2047, 2048, 2**29 - 1])
@pytest.mark.parametrize("wire", [0, 1, 2, 5])
def test_a_tag_is_written_as_the_walk_reads_it(number: int, wire: int) -> None:
    """peek.tag, the writers' one tag (stream's, the codec's, KServe's), reads back as its
    number and wire type, a length-delimited one by default."""
    value = {0: b"\x00", 1: bytes(8), 2: b"\x00", 5: bytes(4)}[wire]
    raw = peek.tag(number, wire) + value
    assert [(n, w) for n, w, _, _ in peek.fields(raw, 0, len(raw))] == [(number, wire)]
    assert peek.tag(number) == peek.tag(number, 2)
