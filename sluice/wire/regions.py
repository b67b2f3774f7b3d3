"""Shared memory on the wire, as both programs answer it (each takes the regions of callers
on its host, sluice.core.shm, with --shared-memory): the region calls of sluice.v1
(RegisterRegion, RegionStatus, UnregisterRegion) and of KServe (Triton's SystemSharedMemory*,
and its CudaSharedMemory* as Triton without GPUs answers them) for one caller's tenant; the
tensors a call places in regions, read and checked (for KServe, Triton's parameters, checks
and words) and, for KServe, an output's place written into its answer; and the words that
refuse shared memory where a program takes none, naming that program (sluice-server,
sluice-balancer) to start with the flag. Its `parse` refuses a body that does not parse in
both programs' words, for their other calls too."""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from sluice.core.datatypes import DATATYPES, DataType
from sluice.core.errors import (
    InvalidInput,
    PermissionDenied,
    RegionNotFound,
    SluiceError,
    Unimplemented,
)
from sluice.core.shm import Lease, Regions
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec, facts

M = TypeVar("M", bound=Message)
Input = kpb.ModelInferRequest.InferInputTensor
Output = kpb.ModelInferRequest.InferRequestedOutputTensor
OutputTensor = kpb.ModelInferResponse.InferOutputTensor
Parameters = Mapping[str, kpb.InferParameter]

SYSTEM_SHARED_MEMORY = "system_shared_memory"  # the extension's name in ServerMetadata
# Triton's answer where it has no GPU; Sluice maps no CUDA memory of other processes.
NO_CUDA = "GPUs not supported: Sluice takes system shared memory only"
# Triton's parameters of a tensor in shared memory (an input's bytes, an output's place).
REGION = facts.INFER_REGION_KEY.decode()
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"


# A registration from elsewhere is refused: a region is an object on this host, which the
# program would read inputs from and write outputs into.
LOCAL_ONLY = (
    "shared memory regions are registered by callers on this host only (this call came from {peer})"
)


def on_this_host(peer: str) -> bool:
    """Whether a call's peer, as grpc names it (`context.peer()`: "ipv4:127.0.0.1:5000",
    "ipv6:%5B::1%5D:5000", "unix:..."), is on this host: a unix socket, or a loopback
    address (an IPv4 one mapped into IPv6 too)."""
    scheme, _, rest = urllib.parse.unquote(peer).partition(":")
    if scheme in ("unix", "unix-abstract"):
        return True
    if scheme not in ("ipv4", "ipv6"):
        return False
    host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def off(program: str) -> str:
    """The region calls' refusal (UNIMPLEMENTED) where `program` takes no shared memory."""
    return f"shared memory is off; start {program} with --shared-memory (for callers on its host)"


def unserved(program: str) -> str:
    """The words after what names a region in a body (INVALID_ARGUMENT) where `program`
    takes no shared memory."""
    return (
        f"Sluice does not serve shared memory here: start {program} with --shared-memory "
        "(for callers on its host), or send the values in the request"
    )


def parse(kind: type[M], body: bytes) -> M:
    """A request body as `kind` (any call's), refused (INVALID_ARGUMENT) in the parser's
    words."""
    try:
        return kind.FromString(body)
    except DecodeError as exc:
        raise InvalidInput(
            f"request body is not a valid {kind.DESCRIPTOR.full_name} message: {exc}"
        ) from None


# The empty replies, serialized once.
_REGISTERED = pb.RegisterRegionResponse().SerializeToString()
_UNREGISTERED = pb.UnregisterRegionResponse().SerializeToString()
_SYSTEM_REGISTERED = kpb.SystemSharedMemoryRegisterResponse().SerializeToString()
_SYSTEM_UNREGISTERED = kpb.SystemSharedMemoryUnregisterResponse().SerializeToString()
_CUDA_STATUS = kpb.CudaSharedMemoryStatusResponse().SerializeToString()
_CUDA_UNREGISTERED = kpb.CudaSharedMemoryUnregisterResponse().SerializeToString()


class RegionCalls:
    """A program's region calls, request bytes to reply bytes for a caller whose regions are
    `tenant`'s ("" with tenants off). `regions`: the program's registry (None: shared memory
    is off, and every call but CUDA's is refused UNIMPLEMENTED, naming `program`). Each
    refusal is a SluiceError naming its status."""

    def __init__(self, regions: Regions | None, program: str) -> None:
        self.regions = regions
        self.off = off(program)

    def _on(self) -> Regions:
        if self.regions is None:
            raise Unimplemented(self.off)
        return self.regions

    def call(self, fn: RegionCall, tenant: str, peer: str, body: bytes) -> bytes:
        """The region call `fn` for a caller of `tenant`'s at `peer` (grpc's name for it):
        a registration only from this host (PERMISSION_DENIED: on another, the caller
        would name this host's objects, not its own). Status and unregistering stay open to
        the region's tenant, wherever it calls from."""
        if fn in _REGISTERING:
            self._on()  # off: that first
            if not on_this_host(peer):
                raise PermissionDenied(LOCAL_ONLY.format(peer=peer))
        return fn(self, tenant, body)

    # sluice.v1's.

    def register(self, tenant: str, body: bytes) -> bytes:
        """RegisterRegion: map the caller's object as its region (a name it holds already:
        ALREADY_EXISTS; past its bounds: RESOURCE_EXHAUSTED)."""
        regions = self._on()
        r = parse(pb.RegisterRegionRequest, body)
        regions.register(tenant, r.name, r.key, r.offset, r.byte_size)
        return _REGISTERED

    def status(self, tenant: str, body: bytes) -> bytes:
        """RegionStatus: the caller's region by name (NOT_FOUND: none), or all of them."""
        regions = self._on()
        found = regions.status(tenant, parse(pb.RegionStatusRequest, body).name)
        return pb.RegionStatusResponse(
            regions=[
                pb.RegisterRegionRequest(
                    name=i.name, key=i.key, offset=i.offset, byte_size=i.byte_size
                )
                for i in found
            ]
        ).SerializeToString()

    def unregister(self, tenant: str, body: bytes) -> bytes:
        """UnregisterRegion: forget the caller's region by name (one it never registered
        is no error), or all of them; a call still using one keeps it until it ends."""
        regions = self._on()
        regions.unregister(tenant, parse(pb.UnregisterRegionRequest, body).name)
        return _UNREGISTERED

    # Triton's system shared memory, the same regions.

    def system_register(self, tenant: str, body: bytes) -> bytes:
        regions = self._on()
        r = parse(kpb.SystemSharedMemoryRegisterRequest, body)
        regions.register(tenant, r.name, r.key, r.offset, r.byte_size)
        return _SYSTEM_REGISTERED

    def system_status(self, tenant: str, body: bytes) -> bytes:
        regions = self._on()
        found = regions.status(tenant, parse(kpb.SystemSharedMemoryStatusRequest, body).name)
        status = kpb.SystemSharedMemoryStatusResponse.RegionStatus
        return kpb.SystemSharedMemoryStatusResponse(
            regions={
                i.name: status(name=i.name, key=i.key, offset=i.offset, byte_size=i.byte_size)
                for i in found
            }
        ).SerializeToString()

    def system_unregister(self, tenant: str, body: bytes) -> bytes:
        regions = self._on()
        regions.unregister(tenant, parse(kpb.SystemSharedMemoryUnregisterRequest, body).name)
        return _SYSTEM_UNREGISTERED

    # CUDA shared memory, as Triton without GPUs answers it: none is ever registered.

    def cuda_status(self, tenant: str, body: bytes) -> bytes:
        name = parse(kpb.CudaSharedMemoryStatusRequest, body).name
        if name:
            raise RegionNotFound(f"Unable to find cuda shared memory region: {name!r}")
        return _CUDA_STATUS

    def cuda_register(self, tenant: str, body: bytes) -> bytes:
        name = parse(kpb.CudaSharedMemoryRegisterRequest, body).name
        raise InvalidInput(
            f"failed to register CUDA shared memory region: {name[:256]!r}, {NO_CUDA}"
        )

    def cuda_unregister(self, tenant: str, body: bytes) -> bytes:
        parse(kpb.CudaSharedMemoryUnregisterRequest, body)  # none is there to unregister
        return _CUDA_UNREGISTERED


RegionCall = Callable[[RegionCalls, str, bytes], bytes]
_REGISTERING: tuple[RegionCall, ...] = (RegionCalls.register, RegionCalls.system_register)
# Each face's region calls by method name: sluice.v1.Inference's, and
# inference.GRPCInferenceService's.
V1_CALLS: dict[str, RegionCall] = {
    "RegisterRegion": RegionCalls.register,
    "RegionStatus": RegionCalls.status,
    "UnregisterRegion": RegionCalls.unregister,
}
KSERVE_CALLS: dict[str, RegionCall] = {
    "SystemSharedMemoryStatus": RegionCalls.system_status,
    "SystemSharedMemoryRegister": RegionCalls.system_register,
    "SystemSharedMemoryUnregister": RegionCalls.system_unregister,
    "CudaSharedMemoryStatus": RegionCalls.cuda_status,
    "CudaSharedMemoryRegister": RegionCalls.cuda_register,
    "CudaSharedMemoryUnregister": RegionCalls.cuda_unregister,
}


# A Predict's tensors in regions (sluice.v1).


def predict_tensors(
    request: pb.PredictRequest, lease: Lease | None, refusal: str
) -> tuple[dict[str, np.ndarray], dict[str, codec.Placed]]:
    """A PredictRequest's inputs (those in regions: views of them, through the call's
    `lease`) and the views its output_memory outputs are to be written into, taken now: a
    bad region refuses the call before any model runs. No `lease`: shared memory is off,
    and a region named is refused, `refusal` after what names it."""
    refs = {name: codec.ref_of(ref) for name, ref in request.output_memory.items()}
    try:
        return codec.decode_all(request.inputs, lease), codec.placed(lease, refs)
    except codec.Unshared as exc:
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


def triton_inputs(
    inputs: Sequence[Input], lease: Lease | None, refusal: str
) -> list[codec.Ref | None]:
    """Where each of a ModelInferRequest's inputs lies in a region (None: in the body); the
    label is made only for one with parameters (the common input has none)."""
    return [
        triton_ref(t.parameters, input_label(t), lease, refusal) if t.parameters else None
        for t in inputs
    ]


def triton_ref(
    parameters: Parameters, label: str, lease: Lease | None, refusal: str
) -> codec.Ref | None:
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
    return codec.Ref(region.string_param, offset or 0, byte_size)


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
    tensor: Input, model: str, ref: codec.Ref, lease: Lease
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


def triton_output(output: Output, lease: Lease | None, refusal: str) -> codec.Placed | None:
    """The view a requested output is to be written into (None: its parameters place it
    nowhere), taken now: an unknown region, a range past its end or one another call writes
    into is refused before the call goes on. No `lease`: as `triton_ref`."""
    ref = triton_ref(output.parameters, output_label(output), lease, refusal)
    if ref is None:
        return None
    assert lease is not None  # triton_ref refused a region without one
    return codec.Placed(ref, lease.output(*ref), lease)


def triton_writes(
    places: Mapping[str, codec.Placed],
    tensors: Iterable[OutputTensor],
    data: Mapping[str, codec.Buffer],
) -> codec.Writes:
    """A KServe answer's outputs placed in regions (`places`, by name; `data`: each one's
    bytes), checked as Triton checks them (each one the answer has; each within the bytes
    its request placed it in); their `tensors` then say where each went and how many bytes
    it took, as Triton answers (their raw entries are the caller's to empty). The caller
    makes the rest of its answer, then lands the writes."""
    writes = codec.Writes(places, data, _too_small, _lacking)
    for tensor in tensors:
        placed = places.get(tensor.name)
        if placed is not None:
            parameters = tensor.parameters
            parameters[REGION].string_param = placed.ref.region
            parameters[BYTE_SIZE].int64_param = writes.size(tensor.name)
            if placed.ref.offset:
                parameters[OFFSET].int64_param = placed.ref.offset
    return writes


def _too_small(name: str, placed: codec.Placed, size: int) -> InvalidInput:
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
