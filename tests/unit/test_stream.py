"""The receiving side of PredictStream (sluice.wire.stream.serve) without sockets: a fake
sender that counts the messages pulled from it and a fake writer that blocks until allowed,
so backpressure (reading stops at the bound, resumes as replies are written), completion
order, refusals, garbage, stop and cancellation are checked step by step."""

from __future__ import annotations

import asyncio
import math

import pytest

from sluice.core.errors import Code
from sluice.v1 import inference_pb2 as pb
from sluice.wire import stream


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


async def echo(message: pb.StreamRequest) -> bytes:
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

    async def slow(message: pb.StreamRequest) -> bytes:
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

    async def answer(message: pb.StreamRequest) -> bytes:
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
    def refuse(message: pb.StreamRequest) -> bytes | None:
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

    async def slow(message: pb.StreamRequest) -> bytes:
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

    async def slow(message: pb.StreamRequest) -> bytes:
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
    async def flaky(message: pb.StreamRequest) -> bytes:
        if message.id <= 3:
            raise RuntimeError("boom")
        return pb.StreamResponse(id=message.id).SerializeToString()

    sender, writer = Sender([request(i) for i in range(1, 11)]), Writer(math.inf)
    await asyncio.wait_for(stream.serve(sender, writer, flaky, max_pending=3), 5)
    assert sorted(ids(writer.written)) == list(range(4, 11))


async def test_cancellation_cancels_the_calls_running() -> None:
    started: list[asyncio.Task[object] | None] = []

    async def forever(message: pb.StreamRequest) -> bytes:
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
