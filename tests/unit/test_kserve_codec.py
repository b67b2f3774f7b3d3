"""The KServe v2 codec and servicer without a socket: ModelInferRequest bodies to arrays and
back against numpy, each refusal's message, the id echo that leaves the cache key alone, and
the protocol's metadata calls on the bundled model."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from perf import make_pool
from sluice.core.datatypes import DATATYPES
from sluice.core.errors import InvalidInput, ModelNotFound, Unimplemented
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import Dataplane
from sluice.server.dataplane.repository import LoadReport
from sluice.server.kserve import (
    INFER,
    PLATFORM,
    REPOSITORY_OFF,
    KServeService,
    KServeV2,
)
from sluice.server.service import Call, InferenceService
from tests.conftest import SAMPLES

KSERVE = KServeV2()  # the server's KServe v2 protocol, shared memory off

InputTensor = kpb.ModelInferRequest.InferInputTensor


def raw_body(arrays: dict[str, np.ndarray], *, model: str = "", id: str = "", **kw: Any) -> bytes:
    """A ModelInferRequest as tritonclient sends it: raw_input_contents."""
    request = kpb.ModelInferRequest(
        model_name=model,
        id=id,
        inputs=[InputTensor(name=n, datatype=_name(a), shape=a.shape) for n, a in arrays.items()],
        raw_input_contents=[a.tobytes() for a in arrays.values()],
        **kw,
    )
    return request.SerializeToString()


def _name(array: np.ndarray) -> str:
    return next(d.name for d in DATATYPES.values() if d.dtype == array.dtype)


def typed(name: str, datatype: str, shape: Sequence[int], **contents: Any) -> InputTensor:
    return InputTensor(
        name=name, datatype=datatype, shape=shape, contents=kpb.InferTensorContents(**contents)
    )


def body_of(*inputs: InputTensor, **kw: Any) -> bytes:
    return kpb.ModelInferRequest(inputs=inputs, **kw).SerializeToString()


# Decoding, against numpy.

VALUES = {
    "BOOL": [True, False, True, True],
    "UINT8": [0, 1, 200, 255],
    "UINT16": [0, 1, 60000, 65535],
    "UINT32": [0, 1, 2**31, 2**32 - 1],
    "UINT64": [0, 1, 2**63, 2**64 - 1],
    "INT8": [-128, -1, 0, 127],
    "INT16": [-32768, -1, 0, 32767],
    "INT32": [-(2**31), -1, 0, 2**31 - 1],
    "INT64": [-(2**63), -1, 0, 2**63 - 1],
    "FP16": [-1.5, 0.0, 0.25, 65504.0],
    "FP32": [-1.5, 0.0, 0.25, 3.0e38],
    "FP64": [-1.5, 0.0, 0.25, 1e300],
}


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_raw_inputs_decode_to_the_same_arrays(datatype: str) -> None:
    want = np.array(VALUES[datatype], DATATYPES[datatype].dtype).reshape(2, 2)
    got = KSERVE.decode(raw_body({"x": want})).inputs["x"]
    assert got.dtype == want.dtype and got.shape == (2, 2)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != "FP16"])
def test_typed_inputs_decode_to_the_same_arrays(datatype: str) -> None:
    dt = DATATYPES[datatype]
    field = dt.typed_field.replace("_data", "_contents")
    want = np.array(VALUES[datatype], dt.dtype).reshape(2, 2)
    got = KSERVE.decode(body_of(typed("x", datatype, (2, 2), **{field: VALUES[datatype]})))
    array = got.inputs["x"]
    assert array.dtype == want.dtype and array.shape == (2, 2)
    np.testing.assert_array_equal(array, want)


def test_outputs_asked_for_and_parameters_that_change_nothing() -> None:
    request = KSERVE.decode(
        raw_body(
            {"input": SAMPLES[0].input},
            outputs=[kpb.ModelInferRequest.InferRequestedOutputTensor(name="label")],
            parameters={"priority": kpb.InferParameter(int64_param=1)},
        )
    )
    assert list(request.outputs) == ["label"]
    assert KSERVE.decode(raw_body({"input": SAMPLES[0].input})).outputs == []


# Each refusal names its fault.

X = np.zeros((1, 4), np.float32)
CLASSIFY = kpb.ModelInferRequest.InferRequestedOutputTensor(
    name="label", parameters={"classification": kpb.InferParameter(int64_param=3)}
)
SHM = {"shared_memory_region": kpb.InferParameter(string_param="r")}
BAD = {
    "raw count": (
        kpb.ModelInferRequest(
            inputs=[InputTensor(name="a", datatype="FP32", shape=[1, 4])] * 2,
            raw_input_contents=[X.tobytes()],
        ),
        "raw_input_contents has 1 entries but the request has 2 inputs",
    ),
    "raw and contents": (
        kpb.ModelInferRequest(
            inputs=[typed("a", "FP32", (1, 4), fp32_contents=[0.0] * 4)],
            raw_input_contents=[X.tobytes()],
        ),
        "input 'a' fills contents.fp32_contents but the request uses raw_input_contents",
    ),
    "repeated input": (
        kpb.ModelInferRequest(
            inputs=[typed("a", "FP32", (1,), fp32_contents=[0.0])] * 2,
        ),
        "input 'a' appears more than once",
    ),
    "bytes": (
        kpb.ModelInferRequest(inputs=[typed("a", "BYTES", (1,), bytes_contents=[b"x"])]),
        "input 'a' is BYTES, which Sluice does not serve",
    ),
    "unknown datatype": (
        kpb.ModelInferRequest(inputs=[typed("a", "FP8", (1,))]),
        "input 'a' has unknown datatype 'FP8'; expected one of BOOL, UINT8",
    ),
    "no name": (
        kpb.ModelInferRequest(inputs=[typed("", "FP8", (1,))]),
        "an input with no name has unknown datatype",
    ),
    "shared memory input": (
        kpb.ModelInferRequest(
            inputs=[InputTensor(name="a", datatype="FP32", shape=[1], parameters=SHM)]
        ),
        "input 'a' names a shared memory region; Sluice does not serve shared memory",
    ),
    "shared memory output": (
        kpb.ModelInferRequest(
            outputs=[kpb.ModelInferRequest.InferRequestedOutputTensor(name="label", parameters=SHM)]
        ),
        "output 'label' names a shared memory region",
    ),
    "classification": (
        kpb.ModelInferRequest(outputs=[CLASSIFY]),
        "output 'label' asks for classification, which Sluice does not serve",
    ),
    "rank": (
        kpb.ModelInferRequest(inputs=[typed("a", "FP32", (1,) * 65)]),
        "input 'a' has 65 dimensions; at most 64 are allowed",
    ),
    "negative": (
        kpb.ModelInferRequest(inputs=[typed("a", "FP32", (1, -4))]),
        "input 'a' has a negative dimension in shape [1, -4]",
    ),
    "huge": (
        kpb.ModelInferRequest(inputs=[typed("a", "FP32", (2**30, 2**30))]),
        "input 'a' has shape [1073741824, 1073741824], over 281474976710656 elements",
    ),
    "huge but empty": (
        kpb.ModelInferRequest(inputs=[typed("a", "FP32", (0, 2**30, 2**30))]),
        "over 281474976710656 elements",
    ),
    "raw length": (
        kpb.ModelInferRequest(
            inputs=[InputTensor(name="a", datatype="FP32", shape=[1, 64])],
            raw_input_contents=[b"\0" * 255],
        ),
        "input 'a' has 255 bytes in raw_input_contents but FP32 shape [1, 64] needs 256 "
        "(64 x 4 bytes)",
    ),
    "raw bool": (
        kpb.ModelInferRequest(
            inputs=[InputTensor(name="a", datatype="BOOL", shape=[2])],
            raw_input_contents=[b"\x01\x02"],
        ),
        "input 'a' is BOOL but its raw_input_contents hold bytes other than 0 and 1",
    ),
    "several fields": (
        kpb.ModelInferRequest(
            inputs=[typed("a", "FP32", (1,), fp32_contents=[1.0], int_contents=[1])]
        ),
        "input 'a' fills several contents fields (fp32_contents, int_contents); use one",
    ),
    "typed fp16": (
        kpb.ModelInferRequest(inputs=[typed("a", "FP16", (1,), fp32_contents=[1.0])]),
        "input 'a' is FP16, whose values travel only in raw_input_contents",
    ),
    "wrong field": (
        kpb.ModelInferRequest(inputs=[typed("a", "INT64", (1,), int_contents=[1])]),
        "input 'a' is INT64 but fills contents.int_contents; INT64 values go in "
        "contents.int64_contents",
    ),
    "count": (
        kpb.ModelInferRequest(inputs=[typed("a", "FP32", (1, 64), fp32_contents=[1.0] * 63)]),
        "input 'a' has 63 values in contents.fp32_contents but shape [1, 64] needs 64",
    ),
    "no values": (
        kpb.ModelInferRequest(inputs=[typed("a", "FP32", (1, 2))]),
        "input 'a' has 0 values in contents.fp32_contents but shape [1, 2] needs 2",
    ),
    "out of range": (
        kpb.ModelInferRequest(inputs=[typed("a", "UINT8", (1,), uint_contents=[256])]),
        "input 'a' has values outside the range of UINT8",
    ),
    "finite out of range": (
        kpb.ModelInferRequest(inputs=[typed("a", "INT8", (1,), int_contents=[-129])]),
        "input 'a' has values outside the range of INT8",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=lambda c: c.replace(" ", "-"))
def test_bad_requests_are_invalid_input_naming_the_fault(case: str) -> None:
    request, message = BAD[case]
    with pytest.raises(InvalidInput) as caught:
        KSERVE.decode(request.SerializeToString())
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"\xff\xff", "not a valid inference.ModelInferRequest: truncated varint"),
        (b"\x1a\x02\xc3\x28", "not a valid inference.ModelInferRequest: a string field"),
    ],
)
def test_bodies_that_are_not_requests_are_refused_before_any_work(
    body: bytes, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        KSERVE.route(body)
    with pytest.raises(InvalidInput, match=r"not a valid inference\.ModelInferRequest"):
        KSERVE.decode(body)


def test_route_reads_model_version_and_the_id_span() -> None:
    body = raw_body({"x": X}, model="digits", id="req-7", model_version="3")
    route = KSERVE.route(body)
    assert (route.model, route.version) == ("digits", "3")
    assert route.echo is not None
    start, end = route.echo
    assert kpb.ModelInferResponse.FromString(body[start:end]).id == "req-7"
    assert KSERVE.route(raw_body({"x": X})).echo is None


@pytest.mark.parametrize("field", [b"\x0a", b"\x12"], ids=["model_name", "model_version"])
def test_a_model_name_or_version_that_is_not_utf8_is_invalid_input(field: bytes) -> None:
    """Found by tests/fuzz: the route read let peek.Malformed out here (an INTERNAL answer)."""
    body = raw_body({"x": X}) + field + b"\x02\xc3\x28"
    with pytest.raises(InvalidInput, match="ModelInferRequest: a string field is not UTF-8"):
        KSERVE.route(body)


# The request path, on the bundled model.


@pytest.fixture
def plane(engine: Engine) -> Dataplane:
    return Dataplane(Models([Model(engine, Batcher(engine.instances))]), LRUCache(100, 1 << 20))


def outputs_of(response: kpb.ModelInferResponse) -> dict[str, np.ndarray]:
    assert len(response.outputs) == len(response.raw_output_contents)
    return {
        t.name: np.frombuffer(raw, DATATYPES[t.datatype].dtype).reshape(t.shape)
        for t, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


async def test_answers_match_onnxruntime_and_are_always_raw(
    plane: Dataplane, reference: ort.InferenceSession
) -> None:
    x = np.concatenate([s.input for s in SAMPLES])
    flat = x.reshape(-1).tolist()
    for body in (
        raw_body({"input": x}, model="digits"),
        body_of(typed("input", "FP32", x.shape, fp32_contents=flat)),
    ):
        entry, _ = await plane.infer(body, KSERVE)
        response = kpb.ModelInferResponse.FromString(entry.body)
        assert (response.model_name, response.model_version, response.id) == ("digits", "1", "")
        assert [(t.name, t.datatype, list(t.shape)) for t in response.outputs] == [
            ("label", "INT64", [10]),
            ("probabilities", "FP32", [10, 10]),
        ]
        assert not any(t.HasField("contents") for t in response.outputs)
        got = outputs_of(response)
        label, probabilities = reference.run(None, {"input": x})
        np.testing.assert_array_equal(got["label"], label)
        np.testing.assert_array_equal(got["probabilities"], probabilities)


async def test_the_id_is_echoed_and_left_out_of_the_cache_key(plane: Dataplane) -> None:
    x = SAMPLES[4].input
    first, cached = await plane.infer(raw_body({"input": x}, id="first"), KSERVE)
    assert cached == "miss"
    second, cached = await plane.infer(raw_body({"input": x}, id="second-call"), KSERVE)
    assert cached == "hit"
    bare, cached = await plane.infer(raw_body({"input": x}), KSERVE)
    assert cached == "hit"
    answers = [kpb.ModelInferResponse.FromString(e.body) for e in (first, second, bare)]
    assert [a.id for a in answers] == ["first", "second-call", ""]
    assert answers[0].raw_output_contents == answers[1].raw_output_contents
    # Uncached calls echo it too.
    entry, cached = await plane.infer(raw_body({"input": x}, id="off"), KSERVE, cache=False)
    assert cached is None and kpb.ModelInferResponse.FromString(entry.body).id == "off"


async def test_a_cache_hit_with_an_id_copies_nothing_of_the_body(tmp_path: Path) -> None:
    """The cache key of a body with an id is taken of the body around the id, not of a copy
    of it: a 602 KB image answered from the cache allocates nothing of its size."""
    path = tmp_path / "pool.onnx"
    path.write_bytes(make_pool.build(224))
    engine = Engine(path, device="cpu")
    try:
        plane = Dataplane(
            Models([Model(engine, Batcher(engine.instances))]), LRUCache(100, 1 << 20)
        )
        image = np.ones((1, 3, 224, 224), np.float32)
        await plane.infer(raw_body({"input": image}, id="first"), KSERVE)  # stored
        second = raw_body({"input": image}, id="second")
        tracemalloc.start()
        try:
            entry, cached = await plane.infer(second, KSERVE)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert cached == "hit" and kpb.ModelInferResponse.FromString(entry.body).id == "second"
        assert peak < image.nbytes // 10
    finally:
        engine.close()


async def test_an_output_subset_and_the_model_checks(plane: Dataplane) -> None:
    label = kpb.ModelInferRequest.InferRequestedOutputTensor(name="label")
    entry, _ = await plane.infer(raw_body({"input": SAMPLES[0].input}, outputs=[label]), KSERVE)
    assert [t.name for t in kpb.ModelInferResponse.FromString(entry.body).outputs] == ["label"]
    with pytest.raises(InvalidInput, match="size 63 in dimension 1"):
        await plane.infer(raw_body({"input": np.zeros((1, 63), np.float32)}), KSERVE)
    with pytest.raises(ModelNotFound, match="unknown model 'nope'; this node serves 'digits'"):
        await plane.infer(raw_body({"input": SAMPLES[0].input}, model="nope"), KSERVE)


# The servicer's calls.


@dataclass(frozen=True)
class Row:
    name: str
    version: str
    state: str
    reason: str = ""


class FakeRepository:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def index(self) -> list[Row]:
        return [Row("digits", "1", "READY"), Row("broken", "", "UNAVAILABLE", "bad file")]

    async def load(self, name: str) -> LoadReport:
        self.calls.append(f"load {name}")
        if name == "missing":
            raise ModelNotFound("no 'missing'")
        return LoadReport(name, [1], {})

    async def unload(self, name: str) -> None:
        self.calls.append(f"unload {name}")


def call() -> Call:
    return Call(trailers=[], deadline=None)


async def test_server_and_model_metadata(plane: Dataplane) -> None:
    service = InferenceService(plane, node_id="n")
    kserve = KServeService(service)
    assert service.stream_methods[INFER] == kserve.model_infer
    live = kpb.ServerLiveResponse.FromString(await kserve.server_live(b"", call()))
    meta = kpb.ServerMetadataResponse.FromString(await kserve.server_metadata(b"", call()))
    assert live.live and await server_ready(kserve)
    assert meta.name == "sluice" and meta.version and list(meta.extensions) == []
    assert [
        await model_ready(kserve, name, version)
        for name, version in (("digits", ""), ("digits", "1"), ("", ""), ("x", ""), ("digits", "2"))
    ] == [True, True, True, False, False]

    body = kpb.ModelMetadataRequest(name="digits").SerializeToString()
    model = kpb.ModelMetadataResponse.FromString(await kserve.model_metadata(body, call()))
    assert (model.name, list(model.versions), model.platform) == ("digits", ["1"], PLATFORM)
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("input", "FP32", [-1, 64])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [
        ("label", "INT64", [-1]),
        ("probabilities", "FP32", [-1, 10]),
    ]
    with pytest.raises(ModelNotFound, match="unknown model 'x'"):
        await kserve.model_metadata(kpb.ModelMetadataRequest(name="x").SerializeToString(), call())
    with pytest.raises(InvalidInput, match=r"not a valid inference\.ModelMetadataRequest"):
        await kserve.model_metadata(b"\xff", call())

    service.serving = False  # draining: neither the server nor its models are ready
    assert not await server_ready(kserve)
    assert not await model_ready(kserve, "digits")


async def server_ready(kserve: KServeService) -> bool:
    return kpb.ServerReadyResponse.FromString(await kserve.server_ready(b"", call())).ready


async def model_ready(kserve: KServeService, name: str, version: str = "") -> bool:
    body = kpb.ModelReadyRequest(name=name, version=version).SerializeToString()
    return kpb.ModelReadyResponse.FromString(await kserve.model_ready(body, call())).ready


async def test_metadata_lists_versions_newest_first(engine: Engine) -> None:
    served = [Model(engine, Batcher(engine.instances), version=v) for v in ("2", "10", "3")]
    plane = Dataplane(Models(served), LRUCache(100, 1 << 20))
    kserve = KServeService(InferenceService(plane, node_id="n"))
    body = kpb.ModelMetadataRequest(name="digits", version="3").SerializeToString()
    model = kpb.ModelMetadataResponse.FromString(await kserve.model_metadata(body, call()))
    assert list(model.versions) == ["10", "3", "2"]
    assert await model_ready(kserve, "digits", "3")


REPOSITORY_CALLS = [
    ("repository_index", kpb.RepositoryIndexRequest()),
    ("repository_load", kpb.RepositoryModelLoadRequest(model_name="digits")),
    ("repository_unload", kpb.RepositoryModelUnloadRequest(model_name="digits")),
]


@pytest.mark.parametrize(
    ("method", "request_"), REPOSITORY_CALLS, ids=[m for m, _ in REPOSITORY_CALLS]
)
async def test_the_repository_api_is_unimplemented_when_off(
    plane: Dataplane, method: str, request_: Any
) -> None:
    kserve = KServeService(InferenceService(plane, node_id="n"))
    with pytest.raises(Unimplemented) as caught:
        await getattr(kserve, method)(request_.SerializeToString(), call())
    assert str(caught.value) == REPOSITORY_OFF


async def test_the_repository_api_when_on(plane: Dataplane) -> None:
    repository = FakeRepository()
    kserve = KServeService(InferenceService(plane, node_id="n"), repository)
    meta = kpb.ServerMetadataResponse.FromString(await kserve.server_metadata(b"", call()))
    assert list(meta.extensions) == ["model_repository"]

    async def index(ready: bool) -> list[tuple[str, str, str, str]]:
        body = kpb.RepositoryIndexRequest(ready=ready).SerializeToString()
        reply = kpb.RepositoryIndexResponse.FromString(await kserve.repository_index(body, call()))
        return [(m.name, m.version, m.state, m.reason) for m in reply.models]

    assert await index(False) == [
        ("digits", "1", "READY", ""),
        ("broken", "", "UNAVAILABLE", "bad file"),
    ]
    assert await index(True) == [("digits", "1", "READY", "")]
    for method, request in REPOSITORY_CALLS[1:]:
        await getattr(kserve, method)(request.SerializeToString(), call())
    assert repository.calls == ["load digits", "unload digits"]
    missing = kpb.RepositoryModelLoadRequest(model_name="missing").SerializeToString()
    with pytest.raises(ModelNotFound):
        await kserve.repository_load(missing, call())
    config = kpb.RepositoryModelLoadRequest(
        model_name="digits", parameters={"config": kpb.ModelRepositoryParameter(string_param="{}")}
    )
    with pytest.raises(InvalidInput, match=r"RepositoryModelLoad takes no parameters \(config"):
        await kserve.repository_load(config.SerializeToString(), call())
    dependents = kpb.RepositoryModelUnloadRequest(
        model_name="digits",
        parameters={"unload_dependents": kpb.ModelRepositoryParameter(bool_param=False)},
    )
    await kserve.repository_unload(dependents.SerializeToString(), call())  # Triton's client
    assert repository.calls[-1] == "unload digits"
    other = kpb.RepositoryModelUnloadRequest(
        model_name="digits", parameters={"force": kpb.ModelRepositoryParameter(bool_param=True)}
    )
    with pytest.raises(InvalidInput, match=r"RepositoryModelUnload takes no parameters \(force"):
        await kserve.repository_unload(other.SerializeToString(), call())
