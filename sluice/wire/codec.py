"""Tensor codec for the sluice.v1 API: numpy arrays to `Tensor` messages and back.

Shared by the server and the client so that both sides agree on datatype names,
byte order and the typed fields. Decoding checks the message against itself
(known datatype, sane shape, element count); checking against a model is the
server's job. Encoding also takes plain Python values (nested lists, tuples, scalars),
converted to the input's declared datatype (`array_of`). Predict's request and response
bodies are written here by hand (`encode_predict`, `encode_predict_response`): the arrays'
bytes copied once, each request input aligned for the server to read it in place.

A tensor placed in shared memory decodes to a view of a `Memory` (sluice.shm.refs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from sluice.core.datatypes import BY_KIND, DATATYPES, DataType
from sluice.core.datatypes import bytes_of as bytes_of
from sluice.core.datatypes import datatype_of as datatype_of
from sluice.core.errors import TensorError as TensorError
from sluice.shm import refs
from sluice.v1 import inference_pb2 as pb
from sluice.wire import facts, peek

# The most elements a shape may describe, counting its non-zero dimensions only (numpy
# refuses even an empty array whose other dimensions overflow its sizes); far beyond any
# message gRPC lets through, and far within numpy's byte count.
MAX_ELEMENTS = 2**48


_TYPED_FIELDS = sorted({d.typed_field for d in DATATYPES.values()})


def encode(
    name: str, value: npt.ArrayLike, *, typed: bool = False, datatype: str = ""
) -> pb.Tensor:
    """A Tensor message for `value` (see `array_of`): raw little-endian bytes, or the typed
    field."""
    array = array_of(name, value, datatype)
    dt = datatype_of(array.dtype)
    tensor = pb.Tensor(name=name, datatype=dt.name, shape=array.shape)
    if typed:
        getattr(tensor, dt.typed_field).extend(array.reshape(-1).tolist())
    else:
        tensor.raw_data = np.ascontiguousarray(array, dtype=dt.dtype).tobytes()
    return tensor


# A tensor's raw_data starts at a multiple of this from the start of a body written here:
# read as a view of the body, an input is then aligned for every datatype (numpy flags it
# and ORT runs it; an unaligned one is copied first), and on a cache line.
ALIGN = 64
# The Tensor field that pads before raw_data (reserved in inference.proto): every parser
# keeps it as an unknown field, and the wire read skips it.
PADDING = 15


def encode_predict(
    inputs: Mapping[str, npt.ArrayLike],
    outputs: Sequence[str] = (),
    model: str = "",
    version: str = "",
    datatypes: Mapping[str, str] | None = None,
) -> bytes:
    """A PredictRequest's body: the message protobuf writes (raw_data; `datatypes` as in
    `encode_all`), each raw_data padded to start at a multiple of ALIGN, and the arrays'
    bytes copied once, into the body."""
    declared = datatypes or {}
    parts: list[bytes | memoryview] = []
    at = 0
    for name, value in inputs.items():
        array = array_of(name, value, declared.get(name, ""))
        at = _tensor(parts, at, _INPUTS, name, array, align=True)
    parts += [_string(_OUTPUTS, output, repeated=True) for output in outputs]
    parts += [_string(_MODEL, model), _string(_VERSION, version)]
    return b"".join(parts)


def encode_predict_response(
    model: str,
    version: str,
    outputs: Mapping[str, np.ndarray],
    typed: bool,
    memory: Mapping[str, refs.OutputSlot] | None = None,
) -> bytes:
    """A PredictResponse's bytes, as protobuf writes them. Raw outputs are written here, the
    arrays' bytes copied once, into the reply (ORT's outputs are views of its own memory;
    through protobuf they were copied three times). Typed outputs go through protobuf. The
    outputs `memory` places are written by `refs.output_writes` once the whole answer is
    made (a refused one writes nothing): their tensors carry only where they lie."""
    writes = refs.output_writes(outputs, memory) if memory else None
    placed = {} if writes is None else writes.refs()
    if typed:
        tensors = [
            refs.shared_tensor(name, array, placed[name])
            if name in placed
            else encode(name, array, typed=True)
            for name, array in outputs.items()
        ]
        body = pb.PredictResponse(model=model, version=version, outputs=tensors)
        answer = body.SerializeToString()
    else:
        parts: list[bytes | memoryview] = [_string(_REPLY_MODEL, model)]
        at = len(parts[0])
        for name, array in outputs.items():
            ref = placed.get(name)
            if ref is None:
                at = _tensor(parts, at, _REPLY_OUTPUTS, name, array, align=False)
            else:
                # Protobuf writes it: only a few bytes, where it lies.
                tensor = refs.shared_tensor(name, array, ref).SerializeToString()
                parts.append(_REPLY_OUTPUTS + peek.varint(len(tensor)) + tensor)
                at += len(parts[-1])
        parts.append(_string(_REPLY_VERSION, version))
        answer = b"".join(parts)
    if writes is not None:
        writes.land()
    return answer


def _tensor(
    parts: list[bytes | memoryview], at: int, tag: bytes, name: str, array: np.ndarray, align: bool
) -> int:
    """Append the Tensor field `tag` carrying `array` as raw_data to `parts`, whose bytes so
    far end at offset `at`; with `align`, raw_data padded to start at a multiple of ALIGN.
    The offset after it."""
    # On every output: the datatype looked up here, datatype_of only to refuse one.
    dt = BY_KIND.get((array.dtype.kind, array.dtype.itemsize)) or datatype_of(array.dtype)
    dims = array.shape  # before ascontiguousarray: it makes a [] a [1]
    # Dimensions under 128 are their own varints: the common case, without a call each.
    shape = bytes(dims) if max(dims, default=0) < 0x80 else b"".join(peek.varint(d) for d in dims)
    head = _string(_TENSOR_NAME, name) + _string(_TENSOR_DATATYPE, dt.name)
    head += _TENSOR_SHAPE + peek.varint(len(shape)) + shape if shape else b""
    array = np.ascontiguousarray(array, dtype=dt.dtype)  # ORT's outputs as they are
    n = array.nbytes
    raw = _TENSOR_RAW + peek.varint(n) if n else b""  # proto3 leaves an empty one out
    before = len(head) + len(raw)
    pad = 0
    # Padding lengthens the tensor, whose length may then take a byte more: a second round
    # pads past the next boundary, and a third finds it on one.
    while align and n:
        gap = -(at + len(tag) + len(peek.varint(before + pad + n)) + before + pad) % ALIGN
        if not gap:
            break
        pad += gap if pad + gap > 1 else gap + ALIGN  # a field takes 2 bytes at least
    if pad:
        head += _TENSOR_PADDING + bytes([pad - 2]) + bytes(pad - 2)
    size = len(head) + len(raw) + n
    outer = tag + peek.varint(size)
    parts += [outer, head, raw, array.data]  # a view of the array's bytes, whatever its shape
    return at + len(outer) + size


# The same few strings on every call (a model's name, version and outputs, datatypes):
# their fields are made once.
@functools.lru_cache(maxsize=1024)
def _string(tag: bytes, text: str, repeated: bool = False) -> bytes:
    """A string field; an empty one is written only as an element of a repeated field."""
    value = text.encode()
    return tag + peek.varint(len(value)) + value if value or repeated else b""


_INPUTS = peek.tag(facts.PREDICT_INPUTS)
_OUTPUTS = peek.tag(facts.PREDICT_OUTPUTS)
_MODEL = peek.tag(facts.PREDICT_MODEL)
_VERSION = peek.tag(facts.PREDICT_VERSION)
_REPLY_MODEL = peek.tag(facts.RESPONSE_MODEL)
_REPLY_OUTPUTS = peek.tag(facts.RESPONSE_OUTPUTS)
_REPLY_VERSION = peek.tag(facts.RESPONSE_VERSION)
_TENSOR_NAME = peek.tag(facts.TENSOR_NAME)
_TENSOR_DATATYPE = peek.tag(facts.TENSOR_DATATYPE)
_TENSOR_SHAPE = peek.tag(facts.TENSOR_SHAPE)
_TENSOR_RAW = peek.tag(facts.TENSOR_RAW_DATA)
_TENSOR_PADDING = peek.tag(PADDING)


def encode_all(
    values: Mapping[str, npt.ArrayLike],
    *,
    typed: bool = False,
    datatypes: Mapping[str, str] | None = None,
) -> list[pb.Tensor]:
    """Tensor messages by name; `datatypes`: the inputs' declared datatypes, where known."""
    declared = datatypes or {}
    return [
        encode(name, value, typed=typed, datatype=declared.get(name, ""))
        for name, value in values.items()
    ]


def array_of(name: str, value: npt.ArrayLike, datatype: str = "") -> np.ndarray:
    """`value` as the array that input `name` sends. A numpy array as it is (no copy; a
    datatype the model does not take is the server's to name). Nested lists, tuples, Python
    and numpy scalars converted to `datatype`, or without one: numpy scalars keep their type,
    bools are BOOL, integers INT64, anything with a fraction FP32 (what most models take).
    TypeError naming the input and the datatype wanted for what cannot be converted exactly
    (ragged lists, strings, None, fractions for an integer type, values out of range)."""
    if isinstance(value, np.ndarray):
        return value
    want = DATATYPES.get(datatype)
    wanted = datatype or "a numeric datatype"

    def refuse(why: str) -> TypeError:
        return TypeError(f"input {name!r} cannot be converted to {wanted}: {why}")

    if datatype and want is None:
        raise refuse(f"this client has no numpy type for {datatype}")
    try:
        found = np.asarray(value)
    except ValueError:  # numpy's own message names no input
        raise refuse("its nested lists differ in length or depth") from None
    kind = found.dtype.kind
    if kind not in "biuf":
        raise refuse(_NOT_NUMBERS.get(kind, "it holds values that are not numbers"))
    if want is None:
        if isinstance(value, np.generic):
            return found
        want = DATATYPES["FP32" if kind == "f" else "BOOL" if kind == "b" else "INT64"]
    _check_fits(found, want, refuse)
    return found.astype(want.dtype)


_NOT_NUMBERS = {
    "U": "it holds strings, not numbers",
    "S": "it holds strings, not numbers",
    "c": "it holds complex numbers",
    # What numpy cannot type: None, objects, or integers wider than 64 bits.
    "O": "it holds None or values that are not numbers (or integers beyond 64 bits)",
}


def _check_fits(found: np.ndarray, want: DataType, refuse: Callable[[str], TypeError]) -> None:
    """Refuse values `want` cannot hold exactly: numpy's casts would wrap, truncate or
    overflow them without a word."""
    if not found.size or found.dtype.kind == "b":
        return
    kind = want.dtype.kind
    if kind == "b":
        if not np.isin(found, (0, 1)).all():
            raise refuse("a BOOL takes only true, false, 0 and 1")
    elif kind in "iu":
        if found.dtype.kind == "f" and not (np.isfinite(found) & (found == np.trunc(found))).all():
            raise refuse(f"it holds values that are not whole numbers, which {want.name} needs")
        info = np.iinfo(want.dtype)  # type: ignore[type-var]  # integer kinds only, checked above
        if found.min() < info.min or found.max() > info.max:
            raise refuse(
                f"it holds values outside the range of {want.name} ({info.min} to {info.max})"
            )
    else:
        largest = float(np.finfo(want.dtype).max)  # type: ignore[type-var]  # float kinds only
        if (np.isfinite(found) & (np.abs(found.astype(np.float64)) > largest)).any():
            raise refuse(f"it holds finite values outside the range of {want.name}")


def decode(tensor: pb.Tensor, memory: refs.Memory | None = None) -> np.ndarray:
    """The array a Tensor message carries; TensorError names the tensor and the fault. One
    in shared memory is a view of `memory`'s bytes (no copy; Unshared without `memory`);
    `memory`'s own refusals are raised as they are, their message led by the tensor's."""
    label = f"tensor {tensor.name!r}" if tensor.name else NAMELESS
    shape = tuple(tensor.shape)
    dt, count = DATATYPES.get(tensor.datatype), math.prod(shape)
    # The common shape passes on one test; any other (and an unknown datatype) is judged.
    if dt is None or not 0 < count <= MAX_ELEMENTS or len(shape) > facts.MAX_RANK:
        dt, count = _checked(label, tensor.datatype, shape)
    elif min(shape, default=0) < 0:  # an even number of negative dimensions
        element_count(label, shape)
    present = []  # a loop: a comprehension would be one more call on every decode
    for typed_field in _TYPED_FIELDS:
        if len(getattr(tensor, typed_field)):
            present.append(typed_field)
    if tensor.HasField("shared_memory"):
        carried = "raw_data" if tensor.raw_data else present[0] if present else ""
        view = refs.input_bytes(label, dt, shape, count, tensor, carried, memory)
        return view_of(label, view, dt, shape, RAW_DATA)
    if tensor.raw_data and present:
        raise TensorError(
            f"{label} carries both raw_data and {present[0]}; send exactly one of them"
        )
    if len(present) > 1:
        raise TensorError(f"{label} fills several typed fields ({', '.join(present)}); use one")
    if present and present[0] != dt.typed_field:
        raise TensorError(
            f"{label} is {dt.name} but fills {present[0]}; {dt.name} values go in {dt.typed_field}"
        )
    if present:
        values = getattr(tensor, dt.typed_field)
        if len(values) != count:
            raise TensorError(
                f"{label} has {len(values)} values in {dt.typed_field} "
                f"but shape {list(shape)} needs {count}"
            )
        return typed_array(values, dt, label).reshape(shape)
    return view_of(label, tensor.raw_data, dt, shape, RAW_DATA, "of raw_data")


NAMELESS = "a tensor with no name"  # a tensor's label without one (else "tensor 'x'")


def _checked(label: str, datatype: str, shape: tuple[int, ...]) -> tuple[DataType, int]:
    """`datatype_named` and `element_count` at once, which name a fault."""
    return datatype_named(label, datatype), element_count(label, shape)


def datatype_named(label: str, datatype: str) -> DataType:
    """The datatype a tensor names; TensorError for one the API does not have."""
    dt = DATATYPES.get(datatype)
    if dt is None:
        raise TensorError(
            f"{label} has unknown datatype {datatype!r}; expected one of {', '.join(DATATYPES)}"
        )
    return dt


def element_count(label: str, shape: tuple[int, ...]) -> int:
    """The element count of a shape; TensorError where no message could carry the array."""
    if len(shape) > facts.MAX_RANK:
        raise TensorError(
            f"{label} has {len(shape)} dimensions; at most {facts.MAX_RANK} are allowed"
        )
    if shape and min(shape) < 0:
        raise TensorError(f"{label} has a negative dimension in shape {list(shape)}")
    count = math.prod(shape)
    # An empty shape is judged by its other dimensions (only those pay for a generator).
    if count > MAX_ELEMENTS or (not count and math.prod(d for d in shape if d) > MAX_ELEMENTS):
        raise TensorError(
            f"{label} has shape {list(shape)}, over {MAX_ELEMENTS} elements; "
            "no message can carry it"
        )
    return count


def view_of(
    label: str,
    data: bytes | memoryview,
    dt: DataType,
    shape: tuple[int, ...],
    where: str,
    field: str = "",
) -> np.ndarray:
    """A view of `data` as the tensor's array; TensorError for BOOL bytes other than 0 and 1
    (`where`: whose bytes they are, RAW_DATA) and, given the `field` they came in ("of
    raw_data"), for a size other than the shape's."""
    itemsize = dt.dtype.itemsize
    if field and len(data) != (count := math.prod(shape)) * itemsize:
        raise TensorError(
            f"{label} has {len(data)} bytes {field} but {dt.name} shape {list(shape)} "
            f"needs {count * itemsize} ({count} x {itemsize} bytes)"
        )
    array = np.frombuffer(data, dtype=dt.dtype)
    # A view at an odd offset (a body not written by encode_predict): ORT runs it, but
    # slower and rounded differently, so it gets an aligned copy.
    if not array.flags.aligned:
        array = array.copy()
    if dt.dtype.kind == "b" and array.view(np.uint8).max(initial=0) > 1:
        raise TensorError(f"{label} is BOOL but {where} bytes other than 0 and 1")
    return array.reshape(shape)


RAW_DATA = "its raw_data holds"


def decode_predict(
    body: bytes | memoryview,
) -> tuple[dict[str, np.ndarray], list[str], bool] | None:
    """A PredictRequest's inputs, outputs and typed_outputs read off the wire from `body`
    (bytes, or a byte view such as a stream message's body), each raw_data array a view of
    it where aligned (encode_predict aligns them): no parsed copy of the message and no copy
    of its tensor bytes, which for a 602 KB image were two fresh 602 KB blocks a call. None
    where the body holds what only the full parser judges (typed values, a field of an
    unexpected wire type, text that is not UTF-8): the caller parses it then. TensorError as
    `decode_all`."""
    try:
        return _predict(body)
    except (peek.Malformed, UnicodeDecodeError, _FullParse):
        return None


class _FullParse(Exception):
    """What this reader leaves to the full parser."""


# The wire type each PredictRequest field takes here (bool: varint; the rest: length-
# delimited), and each Tensor field it reads (shape: packed or not).
_PREDICT_FIELDS = {
    facts.PREDICT_INPUTS: 2,
    facts.PREDICT_OUTPUTS: 2,
    facts.PREDICT_TYPED_OUTPUTS: 0,
    facts.PREDICT_MODEL: 2,
    facts.PREDICT_VERSION: 2,
}
_TENSOR_FIELDS = {
    facts.TENSOR_NAME: (2,),
    facts.TENSOR_DATATYPE: (2,),
    facts.TENSOR_SHAPE: (0, 2),
    facts.TENSOR_RAW_DATA: (2,),
}


def _predict(given: bytes | memoryview) -> tuple[dict[str, np.ndarray], list[str], bool]:
    view = memoryview(given)
    body = cast(bytes, view)  # what peek reads of it (lengths and bytes) a view has too
    tensors: list[tuple[int, int]] = []
    outputs: list[str] = []
    typed = False
    # One budget of fields for the whole body, tensors' fields included: what a crafted body
    # of millions of tiny fields would cost this Python walk goes to the parser instead.
    budget = peek.MAX_FIELDS
    for number, wire, a, b in peek.fields(body, 0, len(body), budget):
        budget -= 1
        if number in _PREDICT_FIELDS and wire != _PREDICT_FIELDS[number]:
            raise _FullParse
        if number == facts.PREDICT_OUTPUT_MEMORY:
            raise _FullParse  # outputs into shared memory: the parser reads them
        if number == facts.PREDICT_INPUTS:
            tensors.append((a, b))
        elif number == facts.PREDICT_OUTPUTS:
            outputs.append(str(view[a:b], "utf-8"))
        elif number == facts.PREDICT_TYPED_OUTPUTS:
            typed = bool(a)
        elif number in (facts.PREDICT_MODEL, facts.PREDICT_VERSION):
            str(view[a:b], "utf-8")  # the parser refuses a name that is not UTF-8
    # Every tensor's fields are read before any is judged: a body the parser refuses gets
    # its message, whatever the tensors before the fault hold.
    found: list[tuple[str, str, list[int], tuple[int, int]]] = []
    for start, end in tensors:
        name, datatype, shape, raw = "", "", [], (0, 0)
        for number, wire, a, b in peek.fields(body, start, end, budget):
            budget -= 1
            if number in _TENSOR_FIELDS and wire not in _TENSOR_FIELDS[number]:
                raise _FullParse  # a wire type the parser would judge
            if number in facts.TENSOR_TYPED or number == facts.TENSOR_SHARED_MEMORY:
                raise _FullParse  # typed values, shared memory: the parser reads them
            if number == facts.TENSOR_NAME:
                name = str(view[a:b], "utf-8")
            elif number == facts.TENSOR_DATATYPE:
                datatype = str(view[a:b], "utf-8")
            elif number == facts.TENSOR_SHAPE:
                if wire == 2 and b - a > facts.MAX_SHAPE_BYTES:
                    raise _FullParse  # surely over MAX_RANK: the parser counts, in C
                shape += peek.varints(body, a, b) if wire == 2 else [peek.int64(a)]
            elif number == facts.TENSOR_RAW_DATA:
                raw = (a, b)
        found.append((name, datatype, shape, raw))
    arrays: dict[str, np.ndarray] = {}
    for name, datatype, shape, raw in found:
        if name in arrays:
            raise TensorError(f"tensor {name!r} appears more than once")
        label, dims = f"tensor {name!r}" if name else NAMELESS, tuple(shape)
        dt, _ = _checked(label, datatype, dims)
        arrays[name] = view_of(label, view[raw[0] : raw[1]], dt, dims, RAW_DATA, "of raw_data")
    return arrays, outputs, typed


def typed_array(values: Iterable[object], dt: DataType, label: str) -> np.ndarray:
    array = np.asarray(values, dtype=_WIDE[dt.typed_field])
    if dt.dtype.kind in "iu":
        info = np.iinfo(dt.dtype)  # type: ignore[type-var]  # integer kinds only, checked above
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise TensorError(f"{label} has values outside the range of {dt.name}")
    elif dt.dtype.kind == "f" and dt.dtype.itemsize < array.dtype.itemsize:
        # NaN and infinity are values too; a finite value the narrower type cannot hold
        # would turn into infinity.
        largest = float(np.finfo(dt.dtype).max)  # type: ignore[type-var]  # float kinds only
        if (np.isfinite(array) & (np.abs(array) > largest)).any():
            raise TensorError(f"{label} has finite values outside the range of {dt.name}")
    return array.astype(dt.dtype.newbyteorder("="))


_WIDE = {
    "bool_data": np.dtype("bool"),
    "int_data": np.dtype("int64"),
    "int64_data": np.dtype("int64"),
    "uint_data": np.dtype("uint64"),
    "uint64_data": np.dtype("uint64"),
    "fp32_data": np.dtype("float32"),
    "fp64_data": np.dtype("float64"),
}


def decode_all(
    tensors: Iterable[pb.Tensor], memory: refs.Memory | None = None
) -> dict[str, np.ndarray]:
    """Decode tensors by name (`memory`: as `decode`); TensorError on a fault or a repeated
    name."""
    arrays: dict[str, np.ndarray] = {}
    for tensor in tensors:
        if tensor.name in arrays:
            raise TensorError(f"tensor {tensor.name!r} appears more than once")
        arrays[tensor.name] = decode(tensor, memory)
    return arrays


def write(view: memoryview, array: np.ndarray) -> int:
    """Copy `array`'s bytes (little-endian, row-major) to the start of `view`, which must
    hold them; how many."""
    data = bytes_of(array)
    view[: len(data)] = data
    return len(data)
