"""Padding on a real sluice-server: a small masked encoder, and one whose only output is
pooled, served with --pad; requests of different lengths wait behind a long call, then
share padded batches, and each answer equals the request's answer alone; bad requests in
the same burst are refused naming the input, and the rest are answered as if they were not
there; Health and /metrics count real and padded tokens; a declaration that does not fit
stops the start."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.v1 import inference_pb2 as pb
from tests.e2e.harness import Process, running, server_argv, wait_for
from tests.e2e.test_metrics_e2e import free_port, scrape, total
from tests.unit.test_padding import assert_close, encoder, texts

pytestmark = pytest.mark.e2e

LONGEST = 64
BLOCKER_ROWS = 8192  # a third of a second or so here: what is sent next waits behind it
MODELS = ("enc", "pooled")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("padding")
    found = {}
    for name, pooled_only in [("enc", False), ("pooled", True)]:
        found[name] = folder / f"{name}.onnx"
        found[name].write_bytes(encoder(pooled_only=pooled_only))
    return found


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(paths: dict[str, Path], metrics_port: int) -> Iterator[Process]:
    pads = [f"--pad={m}:{i}=0" for m in MODELS for i in ("input_ids", "attention_mask")]
    argv = server_argv(
        *(f"--model={m}={paths[m]}" for m in MODELS),
        *pads,
        *("--max-length", str(LONGEST)),
        *("--max-batch", "16", "--batch-budget-ms", "5000"),
        *("--intra-op-threads", "1", "--cache-entries", "0"),
        *("--max-message-bytes", str(64 << 20)),
        *("--metrics-port", str(metrics_port)),
    )
    with running(argv, start_s=60.0) as proc:
        yield proc


async def _burst(
    address: str, model: str, requests: Sequence[dict[str, np.ndarray]]
) -> list[dict[str, np.ndarray] | BaseException]:
    """`requests` sent at once while a long call holds the model's only instance, so they
    wait together and leave the queue in batches."""
    async with AsyncSluiceClient(address, timeout=120) as client:
        blocker = texts([LONGEST] * 1)[0]
        blocker = {n: a.repeat(BLOCKER_ROWS, axis=0) for n, a in blocker.items()}
        holding = asyncio.create_task(client.predict(blocker, model=model, outputs=["pooled"]))
        await asyncio.to_thread(
            health, address, model, lambda h: h.batcher.busy_instances == 1, "the long call"
        )
        calls = [client.predict(r, model=model) for r in requests]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        await holding
        return answers


def burst(
    address: str, model: str, requests: Sequence[dict[str, np.ndarray]]
) -> list[dict[str, np.ndarray] | BaseException]:
    return asyncio.run(_burst(address, model, requests))


def alone(
    address: str, model: str, requests: Sequence[dict[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """Each request sent after the last was answered: it runs alone, unpadded."""

    async def each() -> list[dict[str, np.ndarray]]:
        async with AsyncSluiceClient(address, timeout=60) as client:
            return [await client.predict(r, model=model) for r in requests]

    return asyncio.run(each())


def health(
    address: str,
    model: str,
    condition: Callable[[pb.HealthResponse], bool] = lambda h: True,
    what: str = "its health",
) -> pb.HealthResponse:
    """The first Health report of `model` that meets `condition` (bounded), over a
    connection of its own so it does not queue behind big requests."""
    with SluiceClient(address, options=[("grpc.use_local_subchannel_pool", 1)]) as watcher:

        def probe() -> pb.HealthResponse | None:
            found = watcher.health(model=model)
            return found if condition(found) else None

        return wait_for(probe, f"{model}: {what}", timeout=60)


LENGTHS = [5, 7, 8, 3, 12, 16, 9, 30, 31, 32, 17, 6, 60, 64, 1, 2]


@pytest.mark.parametrize("model", MODELS)
def test_padded_batches_answer_as_each_request_alone(server: Process, model: str) -> None:
    requests = texts(LENGTHS, seed=MODELS.index(model))
    wanted = alone(server.address, model, requests)
    before = health(server.address, model).batcher
    got = burst(server.address, model, requests)
    for want, answer in zip(wanted, got, strict=True):
        assert not isinstance(answer, BaseException), answer
        assert answer.keys() == want.keys()
        for output in want:
            assert_close(answer[output], want[output])
    if model == "enc":  # cut back to its own length; the pooled output as it is
        assert [a["hidden"].shape[1] for a in got if isinstance(a, dict)] == LENGTHS
    after = health(server.address, model).batcher
    runs = after.batches - before.batches
    assert runs < len(LENGTHS) + 1  # the blocker, then fewer runs than requests
    assert after.padded_tokens - before.padded_tokens > after.real_tokens - before.real_tokens
    assert 0 < after.padding_efficiency < 1
    assert list(after.buckets) == [1, 2, 4, 8, 16, 32, 64] and after.max_length == LONGEST
    assert after.bucket_batches["64"] >= 1


BAD = [
    (
        {**texts([5])[0], "attention_mask": np.ones((1, 6), np.int64)},
        "input 'attention_mask' has length 6 along 'sequence' (dimension 1, shape [1, 6]) "
        "but input 'input_ids' has 5",
    ),
    (
        texts([LONGEST + 1])[0],
        f"input 'input_ids' has length {LONGEST + 1} along 'sequence', above",
    ),
    ({"input_ids": texts([5])[0]["input_ids"]}, "missing input 'attention_mask'"),
]


def test_bad_requests_are_refused_naming_the_input_and_leave_their_batch_be(
    server: Process,
) -> None:
    good = texts([4, 6, 9, 15, 30, 33], seed=3)
    wanted = alone(server.address, "enc", good)
    sent = good[:3] + [r for r, _ in BAD] + good[3:]
    got = burst(server.address, "enc", sent)
    answers = got[:3] + got[3 + len(BAD) :]
    for want, answer in zip(wanted, answers, strict=True):
        assert not isinstance(answer, BaseException), answer
        for output in want:
            assert_close(answer[output], want[output])
    for (_, words), refused in zip(BAD, got[3 : 3 + len(BAD)], strict=True):
        assert isinstance(refused, grpc.RpcError)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in str(refused.details())


def test_metrics_count_real_and_padded_tokens_by_model(server: Process, metrics_port: int) -> None:
    burst(server.address, "pooled", texts([3, 5, 6, 7, 8]))
    samples = scrape(metrics_port)
    real = total(samples, "sluice_real_tokens_total", model="pooled")
    padded = total(samples, "sluice_padded_tokens_total", model="pooled")
    assert 0 < real < padded
    assert total(samples, "sluice_padding_efficiency", model="pooled") == pytest.approx(
        real / padded
    )


@pytest.mark.parametrize(
    ("pads", "words"),
    [
        (
            ["input_ids=0.5", "attention_mask=0"],
            "input 'input_ids': pad value '0.5' is not a whole",
        ),
        (
            ["input_ids=0"],
            "input 'attention_mask' INT64\\[N, N\\] has dimension 1 \\('sequence'\\)",
        ),
        (["input_ids=0", "attention_mask=0", "token_type_ids=0"], "padding is given for input "),
    ],
)
def test_a_declaration_that_does_not_fit_stops_the_start(
    paths: dict[str, Path], pads: list[str], words: str
) -> None:
    argv = server_argv("--model", str(paths["enc"]), *(f"--pad={p}" for p in pads))
    with pytest.raises(RuntimeError, match=words), running(argv, start_s=60.0):
        pass
