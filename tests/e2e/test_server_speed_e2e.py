"""The result cache, single-flight and the micro-batcher on real server processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.conftest import SAMPLES
from tests.e2e.harness import (
    NOT_INLINE,
    Process,
    hold_the_instance,
    rows,
    running,
    server_argv,
    wait_health,
)

pytestmark = pytest.mark.e2e


def start(model: Path, *extra: str) -> Iterator[Process]:
    with running(server_argv(*extra, model=model)) as proc:
        yield proc


@pytest.fixture(scope="module")
def batching_server(mlp: Path) -> Iterator[Process]:
    yield from start(
        mlp, "--max-batch", "32", "--batch-budget-ms", "50", "--cache-entries", "0", *NOT_INLINE
    )


def test_cache_answers_repeats_and_respects_opt_out(server: Process) -> None:
    x = SAMPLES[4].input
    with SluiceClient(server.address) as client:
        before = client.health().cache
        first = client.infer({"input": x})
        second = client.infer({"input": x})
        third = client.infer({"input": x}, request_id="mine")
        np.testing.assert_array_equal(
            first.outputs["probabilities"], second.outputs["probabilities"]
        )
        assert (first.metadata["x-cache"], second.metadata["x-cache"]) == ("miss", "hit")
        assert third.request_id == "mine"  # the id is metadata: not part of the cache key
        # Opting out: no cache involved at all.
        assert "x-cache" not in client.infer({"input": x}, no_cache=True).metadata
        after = client.health().cache
    assert after.enabled and after.entries >= 1 and after.bytes > 0
    assert after.hits - before.hits == 2
    assert after.misses - before.misses == 1
    assert 0 < after.hit_rate <= 1


def test_each_distinct_input_is_computed_once(
    server: Process, reference: ort.InferenceSession
) -> None:
    inputs = rows(10, seed=11)
    with SluiceClient(server.address) as client:
        before = client.health().batcher.requests
        for _ in range(10):
            for x in inputs:
                got = client.predict({"input": x})
                np.testing.assert_array_equal(
                    got["label"], reference.run(["label"], {"input": x})[0]
                )
        after = client.health().batcher.requests
    assert after - before == 10


async def test_identical_concurrent_requests_run_once(server: Process) -> None:
    x = rows(1, seed=12)[0]
    async with AsyncSluiceClient(server.address) as client:
        before = (await client.health()).batcher.requests
        answers = await asyncio.gather(*(client.infer({"input": x}) for _ in range(40)))
        after = await client.health()
    assert after.batcher.requests - before == 1
    assert sorted({a.metadata["x-cache"] for a in answers}) in (["hit", "miss"], ["miss"])
    assert sum(a.metadata["x-cache"] == "miss" for a in answers) == 1


async def test_concurrent_requests_are_batched_and_split_back_exactly(
    batching_server: Process, mlp: Path
) -> None:
    reference = ort.InferenceSession(str(mlp), providers=["CPUExecutionProvider"])
    inputs = rows(96, seed=13)
    async with AsyncSluiceClient(batching_server.address) as client:
        before = (await client.health()).batcher
        results = await asyncio.gather(*(client.predict({"input": x}) for x in inputs))
        after = (await client.health()).batcher
    for x, got in zip(inputs, results, strict=True):
        want = reference.run(None, {"input": x})[0]
        np.testing.assert_allclose(got["output"], want, rtol=1e-5, atol=1e-5)
    batches = after.batches - before.batches
    assert after.requests - before.requests == 96
    assert batches < 96  # some requests shared a batch
    assert after.max_batch == 32 and after.queue_depth == 0


# A call of this many rows holds the one instance for about 0.5 s here (longer on a loaded
# machine): far longer than the deadline of the call queued behind it.
BIG_ROWS = 16_000
QUEUED_DEADLINE_S = 0.1
STREAM = "/sluice.v1.Inference/PredictStream"


async def test_full_queue_is_resource_exhausted_and_the_rest_succeed(mlp: Path) -> None:
    """One long call holds the only instance; of the small calls sent while it runs, two
    fit the queue and the rest are refused at once. (Sent with nothing ahead, small calls
    could drain as fast as they arrive on a slow machine, and nothing would be refused.)"""
    blocker = rows(1, seed=17)[0].repeat(BIG_ROWS * 4, axis=0)  # seconds of work
    inputs = rows(20, seed=14)
    argv = ("--instances", "1", "--max-queue", "2", "--cache-entries", "0", *NOT_INLINE)
    with running(server_argv(*argv, model=mlp)) as server:
        async with AsyncSluiceClient(server.address, timeout=120) as client:
            running_call = asyncio.create_task(client.predict({"input": blocker}))
            await asyncio.to_thread(
                wait_health,
                server.address,
                lambda h: h.batcher.busy_instances == 1,
                "the long call to hold the instance",
            )
            outcomes = await asyncio.gather(
                *(client.predict({"input": x}) for x in inputs), return_exceptions=True
            )
            refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
            assert refused, "nothing was refused: the queue bound did not act"
            assert all(o.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for o in refused)
            assert "queue is full" in refused[0].details()
            served = [o for o in outcomes if isinstance(o, dict)]
            assert len(served) + len(refused) == len(inputs) and len(served) >= 2
            health = await client.health()
            assert health.batcher.rejected == len(refused)
            assert (await running_call)["output"].shape == (BIG_ROWS * 4, 10)
            assert (await client.predict({"input": inputs[0]}))["output"].shape == (1, 10)


async def stream_once(channel: grpc.aio.Channel, message: pb.StreamRequest) -> pb.StreamResponse:
    """One call on a PredictStream of its own; the stream ends once it is answered."""
    call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
    replies = [
        pb.StreamResponse.FromString(raw)
        async for raw in call(iter([message.SerializeToString()]), timeout=60)
    ]
    assert [r.id for r in replies] == [message.id]
    return replies[0]


async def test_a_request_whose_deadline_passes_in_the_queue_is_dropped(mlp: Path) -> None:
    """The dropped call goes on a PredictStream: its deadline travels in the message, so gRPC
    knows nothing of it and only the server's queue can drop it. (A unary call's deadline
    cancels the call itself, which then leaves the queue as abandoned, not expired.)"""
    big = [x.repeat(BIG_ROWS, axis=0) for x in rows(2, seed=15)]
    small = pb.PredictRequest(inputs=[codec.encode("input", rows(1, seed=16)[0])])
    argv = ("--instances", "1", "--max-batch", "1", "--cache-entries", "0", *NOT_INLINE)
    with running(server_argv(*argv, model=mlp)) as server:
        async with (
            AsyncSluiceClient(server.address, timeout=60) as client,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            await channel.channel_ready()
            before = (await client.health()).batcher
            ahead = [asyncio.create_task(client.predict({"input": x})) for x in big]
            # One big call runs and the other waits: a whole run is ahead of the next call.
            await asyncio.to_thread(
                wait_health,
                server.address,
                lambda h: h.batcher.busy_instances == 1 and h.batcher.queue_depth == 1,
                "one big call running and one queued",
            )
            reply = await stream_once(
                channel,
                pb.StreamRequest(
                    id=1, request=small.SerializeToString(), timeout_s=QUEUED_DEADLINE_S
                ),
            )
            answers = await asyncio.gather(*ahead)
            after = (await client.health()).batcher
    assert reply.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], reply
    assert "while the request waited" in reply.message  # dropped in the queue, not before it
    assert after.expired - before.expired == 1
    assert after.requests - before.requests == 2  # the two big calls ran; the dropped one did not
    assert after.queue_depth == 0
    assert [a["output"].shape for a in answers] == [(BIG_ROWS, 10)] * 2


async def test_a_call_that_cannot_finish_in_time_is_refused_at_the_door(mlp: Path) -> None:
    """Once the server has measured its runs, a call with seconds of work ahead of it and a
    short deadline is refused at once, marked retryable; one with time enough is admitted."""
    small_input = rows(1, seed=20)[0]
    small = pb.PredictRequest(inputs=[codec.encode("input", small_input)])
    argv = ("--instances", "1", "--max-batch", "1", "--cache-entries", "0", *NOT_INLINE)
    with running(server_argv(*argv, model=mlp)) as server:
        async with (
            AsyncSluiceClient(server.address, timeout=300) as client,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            running_call = await hold_the_instance(
                client, server.address, blocker_rows=BIG_ROWS * 4, seed=18
            )
            before = (await client.health()).batcher
            reply = await stream_once(
                channel, pb.StreamRequest(id=1, request=small.SerializeToString(), timeout_s=0.5)
            )
            predict = channel.unary_unary(
                "/sluice.v1.Inference/Predict",
                request_serializer=None,
                response_deserializer=None,
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await predict(small.SerializeToString(), timeout=0.5)
            admitted = await client.predict({"input": small_input})  # 300 s: time enough
            after = (await client.health()).batcher
            await running_call
    assert reply.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], reply
    assert reply.retryable and reply.trailers["x-refused"] == "overloaded"
    assert "cannot answer within the deadline" in reply.message
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cannot answer within the deadline" in (refused.value.details() or "")
    assert ("x-refused", "overloaded") in tuple(refused.value.trailing_metadata() or ())
    assert admitted["output"].shape == (1, 10)
    assert after.rejected - before.rejected == 2
