"""The dataplane on the bundled model with a real engine, without a socket: model checks, the
registry, the cache keys, single-flight and deadlines, through the sluice.v1 codec and a
second, fake wire protocol."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import pytest

from sluice import models
from sluice.core.errors import DeadlineExpired, InvalidInput, ModelNotFound
from sluice.server.dataplane.batcher import Arrays, Batcher, Pending
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import Engine, Instance
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import Asked, Dataplane, Request
from sluice.server.v1 import Options, SluiceV1
from sluice.shm.registry import Lease
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.conftest import SAMPLES

V1 = SluiceV1()  # the server's plain sluice.v1 protocol

X = SAMPLES[0].input


@dataclass
class Raw:
    """A second wire protocol: the body is FP32 rows of 64 pixels, the answer the labels as
    INT64 bytes. It counts its decodes."""

    name: str = "raw"
    decoded: int = 0

    def route(self, body: bytes) -> Asked:
        return Asked()

    def decode(self, body: bytes, lease: object = None) -> Request[None]:
        self.decoded += 1
        return Request({"input": np.frombuffer(body, np.float32).reshape(-1, 64)}, ["label"], None)

    def encode(self, model: Model, request: Request[None], outputs: Arrays) -> bytes:
        return outputs["label"].astype("<i8").tobytes()


class CountingV1:
    """The sluice.v1 codec, counting its decodes."""

    name = V1.name

    def __init__(self) -> None:
        self.decoded = 0

    def route(self, body: bytes) -> Asked:
        return V1.route(body)

    def decode(self, body: bytes, lease: Lease | None = None) -> Request[Options]:
        self.decoded += 1
        return V1.decode(body, lease)

    def encode(self, model: Model, request: Request[Options], outputs: Arrays) -> bytes:
        return V1.encode(model, request, outputs)


class Gated:
    """The engine's instance, held back until the test opens the gate."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.gate = asyncio.Event()

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        return None

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        await self.gate.wait()
        return await self.instance.run(batch)


def body(x: np.ndarray, outputs: Sequence[str] = (), model: str = "", version: str = "") -> bytes:
    request = pb.PredictRequest(
        inputs=[codec.encode("input", x)], outputs=outputs, model=model, version=version
    )
    return request.SerializeToString()


def answer(raw: bytes) -> dict[str, np.ndarray]:
    return codec.decode_all(pb.PredictResponse.FromString(raw).outputs)


def labels(reference: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return reference.run(["label"], {"input": x})[0]


def plane_of(
    *served: Model, cache: int = 100, clock: Callable[[], float] = time.monotonic
) -> Dataplane:
    return Dataplane(Models(served), LRUCache(cache, 1 << 20), clock=clock)


def model(engine: Engine, **kw: str) -> Model:
    return Model(engine, Batcher(engine.instances), **kw)


# The model: its checks and output selection.


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"input": np.zeros((1, 64), np.float32), "extra": np.zeros(1)}, "unknown input 'extra'"),
        ({}, "missing input 'input' FP32\\[N, 64\\]"),
        ({"input": np.zeros((1, 64), np.int64)}, "is INT64 but the model takes FP32"),
        ({"input": np.zeros((1, 1, 64), np.float32)}, "rank 3"),
        ({"input": np.zeros((2, 65), np.float32)}, "size 65 in dimension 1"),
        ({"input": np.zeros((0, 64), np.float32)}, "is empty"),
    ],
)
def test_check_rejects_inputs_that_do_not_fit(
    engine: Engine, inputs: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        model(engine).check(inputs)


def test_nonfinite_inputs_are_reported_not_rejected(engine: Engine) -> None:
    x = np.zeros((2, 64), np.float32)
    x[1, 5] = -np.inf
    assert model(engine).check({"input": x}) == ["input"]
    assert model(engine).check({"input": X}) == []


def test_output_selection(engine: Engine) -> None:
    digits = model(engine)
    assert digits.select([]) == ["label", "probabilities"]
    assert digits.select(["probabilities", "probabilities"]) == ["probabilities"]
    with pytest.raises(InvalidInput, match="unknown output 'logits'"):
        digits.select(["logits"])


def test_the_registry_finds_models_by_name_and_version(engine: Engine) -> None:
    a, b = model(engine, name="a"), model(engine, name="b", version="7")
    found = Models([a, b], default="a")
    assert (found.get(), found.get("a"), found.get("b"), found.get("b", "7")) == (a, a, b, b)
    assert model(engine).name == "digits" and model(engine).version == "1"
    with pytest.raises(ModelNotFound, match="unknown model 'c'; this node serves 'a', 'b'"):
        found.get("c")
    with pytest.raises(ModelNotFound, match="model 'b' has no ready version '6'; ready: 7"):
        found.get("b", "6")
    with pytest.raises(ValueError, match="two models are named 'a'"):
        Models([a, model(engine, name="a")])
    with pytest.raises(ModelNotFound, match="several models and none is the default"):
        Models([a, b]).get()
    assert Models([b]).get() is b  # the only model is the default


def test_the_newest_version_answers_unversioned_calls_and_swaps_are_single_steps(
    engine: Engine,
) -> None:
    v2, v10, v3 = (model(engine, name="m", version=v) for v in ("2", "10", "3"))
    found = Models([v2])
    assert found.install(v10) is None and found.get("m") is v10  # 10 > 2: numbers, not text
    found.install(v3)
    assert [m.version for m in found.versions("m")] == ["10", "3", "2"]
    assert found.remove("m", "10") is v10 and found.get() is v3
    assert found.get("m", "2") is v2
    found.remove("m", "3"), found.remove("m", "2")
    assert len(found) == 0 and found.names() == []
    with pytest.raises(
        ModelNotFound, match=r"^this node serves no model: 'm' is not loaded \(unloaded\)$"
    ):
        found.get()


async def test_a_retired_model_closes_only_after_its_calls_are_answered(engine: Engine) -> None:
    fresh = Engine(models.DIGITS, device="cpu")
    old = Model(fresh, Batcher(fresh.instances), version="1")
    old.hold()
    retiring = asyncio.create_task(old.retire())
    await asyncio.sleep(0.01)
    assert not retiring.done()  # still open for its call
    old.release()
    await asyncio.wait_for(retiring, 5)


# The request path.


async def test_infer_answers_like_onnxruntime_and_a_hit_parses_nothing(
    engine: Engine, reference: ort.InferenceSession
) -> None:
    plane = plane_of(model(engine))
    v1 = CountingV1()
    first, cached = await plane.infer(body(X), v1)
    assert cached == "miss" and v1.decoded == 1
    got = answer(first.body)
    np.testing.assert_array_equal(got["label"], labels(reference, X))
    assert pb.PredictResponse.FromString(first.body).model == "digits"
    again, cached = await plane.infer(body(X), v1)
    assert cached == "hit" and v1.decoded == 1  # answered from the digest alone
    assert again.body is first.body
    assert (plane.cache.hits, plane.cache.misses) == (1, 1)


async def test_nonfinite_inputs_are_flagged_on_a_miss_and_on_a_hit(engine: Engine) -> None:
    plane = plane_of(model(engine))
    x = X.copy()
    x[0, 3] = np.nan
    for want in ("miss", "hit"):
        entry, cached = await plane.infer(body(x), V1)
        assert (entry.nonfinite, cached) == (("input",), want)


async def test_no_cache_keeps_the_call_out_of_the_cache(engine: Engine) -> None:
    plane = plane_of(model(engine))
    v1 = CountingV1()
    for _ in range(2):
        entry, cached = await plane.infer(body(X), v1, cache=False)
        assert cached is None and "label" in answer(entry.body)
    assert v1.decoded == 2
    assert (len(plane.cache), plane.cache.hits, plane.cache.misses) == (0, 0, 0)
    off = plane_of(model(engine), cache=0)  # a disabled cache: the same
    assert (await off.infer(body(X), V1))[1] is None


async def test_keys_differ_by_codec(engine: Engine, reference: ort.InferenceSession) -> None:
    plane = plane_of(model(engine))
    raw, other = Raw(), Raw(name="raw-too")
    data = X.tobytes()
    assert (await plane.infer(data, raw))[1] == "miss"
    entry, cached = await plane.infer(data, other)
    assert cached == "miss"  # the same bytes, another protocol: not its answer
    assert np.frombuffer(entry.body, "<i8").tolist() == labels(reference, X).tolist()
    assert (await plane.infer(data, raw))[1] == "hit"
    assert (raw.decoded, other.decoded) == (1, 1)


async def test_keys_differ_by_model_and_version(engine: Engine) -> None:
    plane = plane_of(model(engine, name="a"), model(engine, name="b"))
    v1 = CountingV1()
    plane.models = Models(plane.models, default="a")
    got = [(await plane.infer(body(X, model=name), v1))[1] for name in ("a", "b", "a")]
    assert got == ["miss", "miss", "hit"]
    reply = pb.PredictResponse.FromString((await plane.infer(body(X, model="b"), v1))[0].body)
    assert (reply.model, reply.version) == ("b", "1")
    plane.models.install(model(engine, name="a", version="2"))  # a new version takes over
    assert (await plane.infer(body(X, model="a"), v1))[1] == "miss"
    assert (await plane.infer(body(X, model="a", version="1"), v1))[1] == "miss"  # its body differs
    assert v1.decoded == 4


async def test_unknown_model_is_not_found(engine: Engine) -> None:
    plane = plane_of(model(engine))
    with pytest.raises(ModelNotFound, match="unknown model 'resnet'"):
        await plane.infer(body(X, model="resnet"), V1)
    with pytest.raises(ModelNotFound, match="unknown model 'resnet'"):
        await plane.run("resnet", {"input": X})


async def test_bad_bodies_are_invalid_input_and_not_cached(engine: Engine) -> None:
    plane = plane_of(model(engine))
    with pytest.raises(InvalidInput, match=r"not a valid sluice\.v1\.PredictRequest"):
        await plane.infer(b"\xff\xff\xff", V1)
    with pytest.raises(InvalidInput, match="needs 64"):
        await plane.infer(body(np.zeros((1, 3), np.float32)), V1)
    assert len(plane.cache) == 0


async def test_run_takes_arrays(engine: Engine, reference: ort.InferenceSession) -> None:
    plane = plane_of(model(engine))
    batch = np.concatenate([s.input for s in SAMPLES])
    outputs, nonfinite = await plane.run("", {"input": batch}, ["label"])
    assert list(outputs) == ["label"] and nonfinite == []
    np.testing.assert_array_equal(outputs["label"], labels(reference, batch))
    assert len(plane.cache) == 0


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_identical_concurrent_calls_compute_once(engine: Engine) -> None:
    plane = plane_of(model(engine))
    v1 = CountingV1()
    results = await asyncio.gather(*(plane.infer(body(X), v1) for _ in range(10)))
    assert v1.decoded == 1 and plane.flight.joined == 9
    assert sorted(cached for _, cached in results) == ["hit"] * 9 + ["miss"]
    assert len({entry.body for entry, _ in results}) == 1


async def test_an_expired_deadline_runs_nothing(engine: Engine) -> None:
    now = [5.0]
    plane = plane_of(model(engine), clock=lambda: now[0])
    v1 = CountingV1()
    with pytest.raises(DeadlineExpired, match="before the model could run"):
        await plane.infer(body(X), v1, deadline=5.0)
    with pytest.raises(DeadlineExpired):
        await plane.run("", {"input": X}, deadline=4.0)
    assert v1.decoded == 0


async def test_a_follower_outlives_its_leaders_deadline_and_a_cancelled_caller(
    engine: Engine, reference: ort.InferenceSession
) -> None:
    """The one instance is busy; a leader and two followers wait for the same answer. The
    leader's deadline passes in the queue: it fails, a follower whose own deadline allows
    retries; the other follower cancels, which cancels nobody else."""
    now = [0.0]
    gated = Gated(engine.instances[0])
    batcher = Batcher([gated], max_rows=1, clock=lambda: now[0])
    plane = plane_of(Model(engine, batcher), clock=lambda: now[0])
    v1 = CountingV1()
    busy = asyncio.create_task(plane.infer(body(SAMPLES[1].input), V1, cache=False))
    await settle()
    leader = asyncio.create_task(plane.infer(body(X), v1, deadline=1.0))
    await settle()
    follower = asyncio.create_task(plane.infer(body(X), v1, deadline=10.0))
    quitter = asyncio.create_task(plane.infer(body(X), v1, deadline=10.0))
    await settle()
    assert batcher.busy == 1 and len(batcher.queue) == 1 and plane.flight.joined == 2
    quitter.cancel()
    now[0] = 2.0
    gated.gate.set()
    with pytest.raises(DeadlineExpired, match="while the request waited"):
        await leader
    with pytest.raises(asyncio.CancelledError):
        await quitter
    entry, cached = await follower
    assert cached == "miss" and v1.decoded == 2  # it led the retry
    np.testing.assert_array_equal(answer(entry.body)["label"], labels(reference, X))
    assert (await busy)[1] is None
    assert (await plane.infer(body(X), v1))[1] == "hit"
