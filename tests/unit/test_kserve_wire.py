"""ModelInfer's large-body path without copies: the wire read of a ModelInferRequest against
protobuf's full parse (the same arrays, the same refusals in the same words, for any body),
raw inputs as views of the body, and the hand-framed ModelInferResponse against protobuf's
own serialization."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sluice import models
from sluice.core.datatypes import DATATYPES
from sluice.core.errors import InvalidInput
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.server import kserve
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import Model
from sluice.server.dataplane.plane import Request
from sluice.server.kserve import KServeV2
from sluice.wire import peek
from tests.unit.test_kserve_codec import BAD, VALUES

KSERVE = KServeV2()  # the server's KServe v2 protocol, shared memory off

Infer = kpb.ModelInferRequest
InputTensor = Infer.InferInputTensor
Output = Infer.InferRequestedOutputTensor
IMAGE = (1, 3, 224, 224)  # FP32: a 602 KB input

# What the server makes of a body: its inputs (name, dtype, shape, bytes) and outputs, or
# the refusal's words.
Outcome = tuple[object, ...]


def outcome(body: bytes) -> Outcome:
    try:
        request = KSERVE.decode(body)
    except InvalidInput as exc:
        return ("refused", str(exc))
    arrays = request.inputs.values()
    # Kernels get aligned, contiguous arrays, read or parsed.
    assert all(a.flags.aligned and a.flags.c_contiguous for a in arrays)
    tensors = [(n, a.dtype.str, a.shape, a.tobytes()) for n, a in request.inputs.items()]
    return ("accepted", tensors, list(request.outputs))


def agree(body: bytes) -> Outcome:
    """The wire read's outcome, checked against the full parse's: bodies from
    peek.WIRE_READ_FROM bytes take the wire read, smaller ones protobuf's full parse."""
    with pytest.MonkeyPatch.context() as patch:  # a context: @given tests call it too
        patch.setattr(peek, "WIRE_READ_FROM", 0)
        read = outcome(body)
        patch.setattr(peek, "WIRE_READ_FROM", sys.maxsize)
        parsed = outcome(body)
    assert read == parsed
    return read


# A corpus of bodies: each datatype raw and typed, FP16, BOOL, empty tensors, and bodies
# that are not requests at all.


def raw_request(arrays: dict[str, np.ndarray], **kw: Any) -> Infer:
    return Infer(
        inputs=[
            InputTensor(name=n, datatype=_datatype(a), shape=a.shape) for n, a in arrays.items()
        ],
        raw_input_contents=[a.tobytes() for a in arrays.values()],
        **kw,
    )


def _datatype(array: np.ndarray) -> str:
    return next(d.name for d in DATATYPES.values() if d.dtype == array.dtype)


def typed_request(datatype: str, values: list[Any]) -> Infer:
    field = DATATYPES[datatype].typed_field.replace("_data", "_contents")
    contents = kpb.InferTensorContents(**{field: values})
    return Infer(inputs=[InputTensor(name="x", datatype=datatype, shape=[2, 2], contents=contents)])


def _corpus() -> dict[str, bytes]:
    bodies = {
        f"raw {d}": raw_request(
            {"x": np.array(VALUES[d], DATATYPES[d].dtype).reshape(2, 2)}, model_name="m", id="i"
        ).SerializeToString()
        for d in DATATYPES
    }
    bodies |= {
        f"typed {d}": typed_request(d, VALUES[d]).SerializeToString()
        for d in DATATYPES
        if d != "FP16"
    }
    bodies |= {f"bad {case}": request.SerializeToString() for case, (request, _) in BAD.items()}
    two = raw_request({"a": np.ones((2, 3), np.float32), "b": np.arange(3, dtype=np.int64)})
    empty = raw_request({"e": np.zeros((0, 3), np.float32)})
    whole = two.SerializeToString()
    bodies |= {
        "empty body": b"",
        "two inputs": whole,
        "empty tensor": empty.SerializeToString(),
        "truncated": whole[:-3],
        "not a message": b"\xff\xff",
        "name not utf-8": b"\x0a\x02\xc3\x28" + whole,
        "raw as a varint": whole + b"\x38\x05",  # field 7 of the wrong wire type: unknown
        "a group": whole + b"\x7b\x7c",  # wire types 3 and 4, which the walk leaves
        "raw in front": b"\x3a\x00" + whole,  # three entries for two inputs
        "unknown field": b"\xfa\x01\x03abc" + whole,
        "parameters": raw_request(
            {"x": np.ones(2, np.float32)},
            parameters={"priority": kpb.InferParameter(int64_param=1)},
        ).SerializeToString(),
        "outputs": raw_request(
            {"x": np.ones(2, np.float32)}, outputs=[Output(name="label"), Output(name="p")]
        ).SerializeToString(),
    }
    return bodies


CORPUS = _corpus()


@pytest.mark.parametrize("case", list(CORPUS), ids=lambda c: c.replace(" ", "-"))
def test_the_wire_read_agrees_with_the_full_parse_on_the_corpus(case: str) -> None:
    agree(CORPUS[case])


def test_the_corpus_has_both_outcomes() -> None:
    verdicts = {case: agree(body)[0] for case, body in CORPUS.items()}
    assert verdicts["raw FP16"] == verdicts["typed INT64"] == "accepted"
    assert verdicts["bad raw bool"] == verdicts["truncated"] == "refused"


# Any body: requests drawn field by field, then spoilt or padded at random.

_NAMES = st.sampled_from(["", "x", "y", "é"])
_PARAMETER = st.one_of(
    st.builds(kpb.InferParameter, bool_param=st.booleans()),
    st.builds(kpb.InferParameter, int64_param=st.integers(-(2**63), 2**63 - 1)),
    st.builds(kpb.InferParameter, string_param=st.text(max_size=3)),
)
# Mostly none; some that change nothing, some refused.
_PARAMETERS = st.one_of(
    st.just({}),
    st.just({}),
    st.dictionaries(
        st.sampled_from(["shared_memory_region", "classification", "binary", "priority"]),
        _PARAMETER,
        max_size=2,
    ),
)
# Mostly shapes that bytes can fill, now and then one no array could have.
_SHAPES = st.one_of(
    st.lists(st.integers(0, 3), max_size=3),
    st.lists(st.integers(0, 3), max_size=3),
    st.lists(st.integers(-1, 3), max_size=3),
    st.sampled_from([[1] * 65, [2**30, 2**30], [0, 2**30, 2**30]]),
)
_CONTENTS: dict[str, st.SearchStrategy[Any]] = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=2),
}


@st.composite
def _tensor(draw: st.DrawFn, typed: bool) -> tuple[InputTensor, bytes]:
    """One input, its values typed or raw, that fit its shape and datatype more often than
    not."""
    datatype = draw(st.sampled_from([*DATATYPES, "BYTES", "FP8"]))
    shape = draw(_SHAPES)
    tensor = InputTensor(name=draw(_NAMES), datatype=datatype, shape=shape)
    for key, value in draw(_PARAMETERS).items():
        tensor.parameters[key].CopyFrom(value)
    count = int(np.prod(shape)) if min(shape, default=0) >= 0 else 3
    count = count if count <= 64 else 3  # a shape no bytes could fill: a few bytes anyway
    known = DATATYPES.get(datatype)
    own = known.typed_field.replace("_data", "_contents") if known else "bytes_contents"
    fields = st.sampled_from([own, own, own, *sorted(_CONTENTS)])
    # Typed values in a raw request, now and then: refused.
    chosen = typed or not draw(st.integers(0, 4))
    for field in draw(st.lists(fields, max_size=2)) if chosen else []:
        size = draw(st.sampled_from([count, count, count + 1, 0]))
        values = draw(st.lists(_CONTENTS[field], min_size=size, max_size=size))
        getattr(tensor.contents, field).extend(values)
    if draw(st.booleans()):
        tensor.contents.SetInParent()  # present, and empty
    itemsize = known.dtype.itemsize if known else 1
    size = draw(st.sampled_from([count * itemsize, count * itemsize, count * itemsize + 1, 0]))
    raw = draw(st.binary(min_size=size, max_size=size))
    if datatype == "BOOL" and draw(st.booleans()):
        raw = bytes(b & 1 for b in raw)
    return tensor, raw


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    typed = draw(st.booleans())
    inputs = draw(st.lists(_tensor(typed), max_size=3))
    request = Infer(
        model_name=draw(_NAMES),
        id=draw(_NAMES),
        inputs=[t for t, _ in inputs],
        outputs=[
            Output(name=draw(_NAMES), parameters=draw(_PARAMETERS))
            for _ in range(draw(st.integers(0, 2)))
        ],
        parameters=draw(_PARAMETERS),
    )
    raw = [] if typed else [r for _, r in inputs]
    if not draw(st.integers(0, 4)):  # entries that do not match the inputs
        raw = draw(st.lists(st.sampled_from(raw), max_size=len(raw) + 1)) if raw else [b"1"]
    request.raw_input_contents.extend(raw)
    body = request.SerializeToString()
    # An unknown field in front moves every raw entry's offset: aligned or not.
    body = b"\xfa\x01" + bytes([pad := draw(st.integers(0, 9))]) + b"p" * pad + body
    spoil = draw(st.sampled_from(["none"] * 5 + ["cut", "byte", "insert"]))
    if spoil != "none" and body:
        at = draw(st.integers(0, len(body) - 1))
        if spoil == "cut":
            body = body[:at]
        elif spoil == "byte":
            body = body[:at] + bytes([draw(st.integers(0, 255))]) + body[at + 1 :]
        else:
            body = body[:at] + draw(st.binary(min_size=1, max_size=3)) + body[at:]
    return body


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_the_wire_read_agrees_with_the_full_parse_on_any_body(body: bytes) -> None:
    agree(body)


# Raw inputs are views of the body.


def address(buffer: bytes | np.ndarray) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def image_body(aligned: bool) -> tuple[bytes, np.ndarray]:
    """A 602 KB FP32 image's ModelInferRequest whose raw bytes sit at an offset of the body
    that is, or is not, aligned for FP32 (moved by the model name's length)."""
    image = np.arange(np.prod(IMAGE), dtype=np.float32).reshape(IMAGE)
    for pad in range(8):
        body = raw_request({"input": image}, model_name="m" * pad, id="req").SerializeToString()
        if ((address(body) + len(body) - image.nbytes) % 4 == 0) == aligned:
            return body, image
    raise AssertionError("no model name gave the offset wanted")


def test_an_aligned_raw_input_is_a_view_of_the_body() -> None:
    body, image = image_body(aligned=True)
    array = KSERVE.decode(body).inputs["input"]
    assert np.shares_memory(array, np.frombuffer(body, np.uint8))
    np.testing.assert_array_equal(array, image)


def test_an_unaligned_raw_input_is_copied_aligned() -> None:
    body, image = image_body(aligned=False)
    array = KSERVE.decode(body).inputs["input"]
    assert array.flags.aligned and not np.shares_memory(array, np.frombuffer(body, np.uint8))
    np.testing.assert_array_equal(array, image)


def peak_of(work: Callable[[], object]) -> int:
    """The most memory Python and numpy held at once during `work`, above what they held."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_decoding_a_602_kb_request_allocates_none_of_its_size() -> None:
    body, image = image_body(aligned=True)
    KSERVE.decode(body)  # warm
    assert peak_of(lambda: KSERVE.decode(body)) < image.nbytes // 10


# The hand-framed ModelInferResponse.


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    engine = Engine(models.DIGITS, device="cpu")
    yield Model(engine, Batcher(engine.instances))
    engine.close()


def serialized(model: Model, outputs: dict[str, np.ndarray]) -> bytes:
    """The response as protobuf serializes it: the bytes the framing must equal."""
    tensors = [
        kpb.ModelInferResponse.InferOutputTensor(name=n, datatype=_datatype(a), shape=a.shape)
        for n, a in outputs.items()
    ]
    response = kpb.ModelInferResponse(
        model_name=model.name,
        model_version=model.version,
        outputs=tensors,
        raw_output_contents=[a.tobytes() for a in outputs.values()],
    )
    return response.SerializeToString()


_ARRAYS = st.sampled_from(list(DATATYPES)).flatmap(
    lambda d: hnp.arrays(DATATYPES[d].dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0))
)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.dictionaries(_NAMES, _ARRAYS, max_size=3), st.booleans())
def test_the_framed_response_is_protobufs_own_bytes(
    model: Model, outputs: dict[str, np.ndarray], transposed: bool
) -> None:
    if transposed:  # not contiguous, as a model's output may be
        outputs = {n: a.T for n, a in outputs.items()}
    request: Request[None] = Request({}, [], None)
    kept = kserve.FRAMED_FROM
    kserve.FRAMED_FROM = 0  # framed by hand, however small
    try:
        framed = KSERVE.encode(model, request, outputs)
    finally:
        kserve.FRAMED_FROM = kept
    assert framed == KSERVE.encode(model, request, outputs) == serialized(model, outputs)


def test_encoding_a_602_kb_output_copies_it_once(model: Model) -> None:
    image = np.ones(IMAGE, np.float32)
    request: Request[None] = Request({}, [], None)
    KSERVE.encode(model, request, {"output": image})  # warm
    peak = peak_of(lambda: KSERVE.encode(model, request, {"output": image}))
    assert peak < image.nbytes * 1.1  # the reply's bytes, and nothing of the like beside
