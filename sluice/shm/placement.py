"""The tensors a call places in shared memory regions, read and checked: sluice.v1's
(Tensor.shared_memory, output_memory) and KServe's (Triton's parameters, checks and words,
with a ModelInfer's other inputs beside them), and, for KServe, an output's place written
into its answer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from sluice.core.datatypes import DATATYPES, DataType
from sluice.core.errors import InvalidInput, SluiceError
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.shm import scan
from sluice.shm.refs import Unshared, led, ref_of
from sluice.shm.registry import Lease
from sluice.shm.slots import Buffer, Memory, OutputSlot, Ref, SlotWrites
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

Input = kpb.ModelInferRequest.InferInputTensor
Output = kpb.ModelInferRequest.InferRequestedOutputTensor
OutputTensor = kpb.ModelInferResponse.InferOutputTensor
Parameters = Mapping[str, kpb.InferParameter]

# Triton's parameters of a tensor in shared memory (an input's bytes, an output's place).
REGION = scan.REGION_KEY.decode()
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"


def output_slots(memory: Memory | None, refs: Mapping[str, Ref]) -> dict[str, OutputSlot]:
    """The views an answer's outputs are written into (output_memory), each taken now, so
    that a region unknown or a range outside it refuses the call before the model runs.
    Unshared for any without `memory`."""
    if not refs:
        return {}
    if memory is None:
        names = ", ".join(repr(n) for n in refs)
        raise Unshared(f"output_memory names shared memory for output {names}")
    # `memory` refuses two outputs over each other (a lease compares the objects' bytes,
    # whatever region names reach them).
    views: dict[str, OutputSlot] = {}
    # In the regions' order, so that of two outputs over each other the later is named.
    for name, ref in sorted(refs.items(), key=lambda item: (item[1], item[0])):
        try:
            views[name] = OutputSlot(ref, memory.output(*ref), memory)
        except SluiceError as exc:
            raise led(f"output_memory of output {name!r}", exc) from None
    return {name: views[name] for name in refs}


# A Predict's tensors in regions (sluice.v1).


def predict_tensors(
    request: pb.PredictRequest, lease: Lease | None, refusal: str
) -> tuple[dict[str, np.ndarray], dict[str, OutputSlot]]:
    """A PredictRequest's inputs (those in regions: views of them, through the call's
    `lease`) and the views its output_memory outputs are to be written into, taken now: a
    bad region refuses the call before any model runs. No `lease`: shared memory is off,
    and a region named is refused, `refusal` after what names it."""
    try:
        inputs = codec.decode_all(request.inputs, lease)
        if not request.output_memory:
            return inputs, {}
        refs = {name: ref_of(ref) for name, ref in request.output_memory.items()}
        return inputs, output_slots(lease, refs)
    except Unshared as exc:
        raise InvalidInput(f"{exc}; {refusal}") from None
    except codec.TensorError as exc:
        raise InvalidInput(str(exc)) from None


# KServe's tensors in regions: Triton's parameters, checks and words.


def input_label(tensor: Input) -> str:
    return f"input {tensor.name!r}" if tensor.name else "an input with no name"


def output_label(output: Output) -> str:
    return f"output {output.name!r}"


def input_datatype(label: str, tensor: Input) -> DataType:
    """A KServe input's datatype, refused unless Sluice serves it."""
    if tensor.datatype == "BYTES":
        raise InvalidInput(
            f"{label} is BYTES, which Sluice does not serve: its models take numeric tensors"
        )
    try:
        return codec.datatype_named(label, tensor.datatype)
    except codec.TensorError as exc:
        raise InvalidInput(str(exc)) from None


# KServe's typed fields are sluice.v1's, renamed: int_data is int_contents, and so on.
_CONTENTS = sorted({d.typed_field.replace("_data", "_contents") for d in DATATYPES.values()})
_ALL_CONTENTS = [*_CONTENTS, "bytes_contents"]


def contents_filled(tensor: Input) -> list[str]:
    """The contents fields a KServe input fills (only one that has `contents` pays for
    looking into it)."""
    if not tensor.HasField("contents"):
        return []
    return [f for f in _ALL_CONTENTS if len(getattr(tensor.contents, f))]


def triton_contents(tensor: Input) -> np.ndarray:
    """A KServe input's array from its typed contents (none: no values), checked against
    its datatype and shape. The checks against the model come later."""
    label = input_label(tensor)
    dt = input_datatype(label, tensor)
    shape = tuple(tensor.shape)
    count = element_count(label, shape)
    present = contents_filled(tensor)
    if len(present) > 1:
        raise InvalidInput(f"{label} fills several contents fields ({', '.join(present)}); use one")
    if dt.name == "FP16":  # KServe has no 16-bit float field
        raise InvalidInput(
            f"{label} is FP16, whose values travel only in raw_input_contents "
            "(KServe has no typed field for them)"
        )
    field = dt.typed_field.replace("_data", "_contents")
    if present and present[0] != field:
        raise InvalidInput(
            f"{label} is {dt.name} but fills contents.{present[0]}; "
            f"{dt.name} values go in contents.{field}"
        )
    values = getattr(tensor.contents, field)  # empty when `contents` is absent
    if len(values) != count:
        raise InvalidInput(
            f"{label} has {len(values)} values in contents.{field} "
            f"but shape {list(shape)} needs {count}"
        )
    try:
        # sluice.v1's conversion and range checks: the typed fields are the same types.
        return codec.typed_array(values, dt, label).reshape(shape)
    except codec.TensorError as exc:
        raise InvalidInput(str(exc)) from None


def check_raw_entries(raw: int, unplaced: int) -> None:
    """As in Triton, a request's raw entries are those of its inputs not in shared memory:
    one each, or none (their values typed, in contents)."""
    if raw and raw != unplaced:
        raise InvalidInput(
            f"raw_input_contents has {raw} entries but the request has {unplaced} "
            "inputs not in shared memory; send one entry per such input, in order, or none"
        )


def element_count(label: str, shape: tuple[int, ...]) -> int:
    """The element count of a shape, refused when no array could have it (sluice.v1's
    bounds, sluice.wire.codec)."""
    try:
        return codec.element_count(label, shape)
    except codec.TensorError as exc:
        raise InvalidInput(str(exc)) from None


def triton_inputs(inputs: Sequence[Input], lease: Lease | None, refusal: str) -> list[Ref | None]:
    """Where each of a ModelInferRequest's inputs lies in a region (None: in the body); the
    label is made only for one with parameters (the common input has none)."""
    return [
        triton_ref(t.parameters, input_label(t), lease, refusal) if t.parameters else None
        for t in inputs
    ]


def triton_ref(parameters: Parameters, label: str, lease: Lease | None, refusal: str) -> Ref | None:
    """Where a KServe tensor's parameters place it in a region; None: nowhere. Refused
    where the program takes no shared memory (no `lease`), `refusal` after what names it."""
    if not parameters:
        return None
    region = parameters.get(REGION)
    if region is not None:
        if lease is None:
            raise InvalidInput(f"{label} names a shared memory region; {refusal}")
        if region.WhichOneof("parameter_choice") != "string_param":
            raise InvalidInput(
                f"invalid value type for '{REGION}' parameter for {label}, expected string_param"
            )
    offset = _int64(label, parameters, OFFSET, region is not None)
    byte_size = _int64(label, parameters, BYTE_SIZE, region is not None)
    if region is None:
        return None
    if byte_size is None:
        raise InvalidInput(
            f"'{BYTE_SIZE}' must be specified along with '{REGION}' parameter for {label}"
        )
    return Ref(region.string_param, offset or 0, byte_size)


def _int64(label: str, parameters: Parameters, key: str, placed: bool) -> int | None:
    """An int64 placement parameter's value; None when absent."""
    parameter = parameters.get(key)
    if parameter is None:
        return None
    if not placed:
        raise InvalidInput(f"'{key}' can not be specified without '{REGION}' parameter for {label}")
    if parameter.WhichOneof("parameter_choice") != "int64_param":
        raise InvalidInput(
            f"invalid value type for '{key}' parameter for {label}, expected int64_param"
        )
    return int(parameter.int64_param)


def triton_input(
    tensor: Input, model: str, ref: Ref, lease: Lease
) -> tuple[memoryview, DataType, tuple[int, ...]]:
    """An input in a region (`ref`, read through the call's `lease`): its bytes there, its
    datatype and its shape, checked as Triton checks them (no contents beside; the byte size
    its shape's). `model`: the request's model_name, named in the refusals."""
    label = input_label(tensor)
    dt = input_datatype(label, tensor)
    where = f"{label} for model '{model}'" if model else label
    if tensor.HasField("contents"):
        raise InvalidInput(f"unexpected 'content' provided when using shared memory for {where}")
    shape = tuple(tensor.shape)
    count = element_count(label, shape)
    expected = count * dt.dtype.itemsize
    if ref.byte_size != expected:  # before any byte is read (or, copying, copied)
        raise InvalidInput(
            f"input byte size mismatch for {where}. Expected {expected}, got {ref.byte_size} "
            f"('{BYTE_SIZE}'; {dt.name} shape {list(shape)} is {count} x {dt.dtype.itemsize} "
            "bytes)"
        )
    return lease.input(*ref), dt, shape


def triton_output(output: Output, lease: Lease | None, refusal: str) -> OutputSlot | None:
    """The view a requested output is to be written into (None: its parameters place it
    nowhere), taken now: an unknown region, a range past its end or one another call writes
    into is refused before the call goes on. No `lease`: as `triton_ref`."""
    ref = triton_ref(output.parameters, output_label(output), lease, refusal)
    if ref is None:
        return None
    assert lease is not None  # triton_ref refused a region without one
    return OutputSlot(ref, lease.output(*ref), lease)


def triton_writes(
    places: Mapping[str, OutputSlot],
    tensors: Iterable[OutputTensor],
    data: Mapping[str, Buffer],
) -> SlotWrites:
    """A KServe answer's outputs placed in regions (`places`; `data`: their bytes), checked
    as Triton checks them, their `tensors` then saying where each went and its size. The
    caller makes the rest of its answer (emptying their raw entries), then lands the writes."""
    writes = SlotWrites(places, data, _too_small, _lacking)
    for tensor in tensors:
        placed = places.get(tensor.name)
        if placed is not None:
            parameters = tensor.parameters
            parameters[REGION].string_param = placed.ref.region
            parameters[BYTE_SIZE].int64_param = writes.size(tensor.name)
            if placed.ref.offset:
                parameters[OFFSET].int64_param = placed.ref.offset
    return writes


def _too_small(name: str, placed: OutputSlot, size: int) -> InvalidInput:
    return InvalidInput(
        f"shared memory size specified with the request for output '{name}' "
        f"({len(placed.view)} bytes) should be at least {size} bytes to hold the results"
    )


def _lacking(name: str) -> SluiceError:
    """The answer lacks a placed output: its model's (or its server's) fault, not the
    caller's."""
    return SluiceError(
        f"the answer lacks output {name!r}, which the request placed in shared memory"
    )


# A ModelInfer's tensors, in regions or in its body, and its answer's.


def infer_tensors(
    request: kpb.ModelInferRequest,
    raw: Sequence[bytes | memoryview],
    lease: Lease | None,
    refusal: str,
) -> tuple[dict[str, np.ndarray], dict[str, OutputSlot]]:
    """A ModelInferRequest's inputs (those in regions: views of them, through the call's
    `lease`; the others from `raw`, its raw_input_contents, or their typed contents) and the
    views its placed outputs are to be written into, taken now, as `predict_tensors` takes a
    Predict's. No `lease`: a region named is refused, `refusal` after what names it."""
    model = request.model_name
    places = triton_inputs(request.inputs, lease, refusal)
    check_raw_entries(len(raw), places.count(None))
    inputs: dict[str, np.ndarray] = {}
    at = 0
    for tensor, place in zip(request.inputs, places, strict=True):
        if tensor.name in inputs:
            raise InvalidInput(f"input {tensor.name!r} appears more than once")
        if place is not None:
            assert lease is not None  # triton_ref refused a region without one
            view, dt, shape = triton_input(tensor, model, place, lease)
            where = f"shared memory region '{place.region}' holds"
            inputs[tensor.name] = _array(input_label(tensor), view, dt, shape, where)
        else:
            inputs[tensor.name] = _unplaced(tensor, raw[at] if raw else None)
            at += 1
    placements: dict[str, OutputSlot] = {}
    for output in request.outputs:
        if not output.parameters:
            continue
        if "classification" in output.parameters:
            raise InvalidInput(
                f"{output_label(output)} asks for classification, which Sluice "
                "does not serve; ask for the output itself and take the top classes from it"
            )
        placed = triton_output(output, lease, refusal)
        if placed is not None:
            placements[output.name] = placed
    return inputs, placements


def _unplaced(tensor: Input, raw: bytes | memoryview | None) -> np.ndarray:
    """One input's array, from its raw bytes or its typed contents (unchecked: Model.check)."""
    if raw is None:
        return triton_contents(tensor)
    label = input_label(tensor)
    dt = input_datatype(label, tensor)
    shape = tuple(tensor.shape)
    element_count(label, shape)  # a shape no message could carry: before its contents
    present = contents_filled(tensor)
    if present:
        raise InvalidInput(
            f"{label} fills contents.{present[0]} but the request uses "
            "raw_input_contents; send every input's values there, or none"
        )
    return _array(label, raw, dt, shape, "its raw_input_contents hold", "in raw_input_contents")


def _array(
    label: str,
    data: bytes | memoryview,
    dt: DataType,
    shape: tuple[int, ...],
    where: str,
    field: str = "",
) -> np.ndarray:
    """A view of `data` as the input's array (`field`: as codec.view_of); a copy where it is
    not aligned."""
    try:
        return codec.view_of(label, data, dt, shape, where, field)
    except codec.TensorError as exc:
        raise InvalidInput(str(exc)) from None


_NO_VALUES = np.empty(0, np.uint8)  # an output in shared memory


def infer_outputs(
    outputs: Mapping[str, np.ndarray], places: Mapping[str, OutputSlot]
) -> tuple[list[OutputTensor], list[np.ndarray], SlotWrites | None]:
    """A ModelInfer answer's tensors and their raw entries' arrays, always raw as Triton
    answers (an output placed in a region, by `places`, has an empty entry), and the writes
    of those placed: all checked before any is written, landed by the caller once answered,
    so that a refusal writes nothing."""
    tensors, arrays = [], []
    placed: dict[str, memoryview] = {}
    for name, array in outputs.items():
        dt = codec.datatype_of(array.dtype)
        tensors.append(OutputTensor(name=name, datatype=dt.name, shape=array.shape))
        if name in places:
            placed[name] = codec.bytes_of(array)
            arrays.append(_NO_VALUES)
        else:
            arrays.append(np.ascontiguousarray(array, dtype=dt.dtype))
    writes = triton_writes(places, tensors, placed) if places else None
    return tensors, arrays, writes
