"""sluice.v1's SharedMemoryRef: the bytes a tensor names in a shared memory region, read
through a call's `Memory`, and a reply's outputs written into the regions the request
placed them in (the codec calls these; `placement` reads the rest of a placed request)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sluice.core.datatypes import DataType, bytes_of, datatype_of
from sluice.core.errors import SluiceError, TensorError
from sluice.shm.slots import Memory as Memory
from sluice.shm.slots import OutputSlot as OutputSlot
from sluice.shm.slots import Ref as Ref
from sluice.shm.slots import SlotWrites
from sluice.v1 import inference_pb2 as pb


class Unshared(TensorError):
    """A tensor (or an output) names a shared memory region where none can be read: the
    reader was given no `Memory` (a node that takes no shared memory)."""


# In the message that refuses an output region too small for its output: a client that
# sized it from an earlier answer sends that output's bytes instead (sluice.shm.client).
TOO_SMALL = "too small for"


def ref_of(message: pb.SharedMemoryRef) -> Ref:
    return Ref(message.region, message.offset, message.byte_size)


def input_bytes(
    label: str,
    dt: DataType,
    shape: tuple[int, ...],
    count: int,
    tensor: pb.Tensor,
    carried: str,
    memory: Memory | None,
) -> memoryview:
    """The bytes `tensor`'s shared_memory names in `memory` (`carried`: the field that also
    holds its values, if any); `memory`'s own refusals raised as they are, their message led
    by the tensor's."""
    if carried:
        raise TensorError(
            f"{label} carries both {carried} and shared_memory; send its bytes one way"
        )
    ref = ref_of(tensor.shared_memory)
    expected = count * dt.dtype.itemsize
    if ref.byte_size != expected:
        raise TensorError(
            f"{label} has shared_memory byte_size {ref.byte_size} but {dt.name} shape "
            f"{list(shape)} needs {expected} ({count} x {dt.dtype.itemsize} bytes)"
        )
    if memory is None:
        raise Unshared(f"{label} names shared memory region {ref.region!r}")
    try:
        return memory.input(*ref)
    except SluiceError as exc:
        raise led(label, exc) from None


def led(label: str, exc: SluiceError) -> SluiceError:
    """A Memory's refusal as it was (its status), its message led by what it refused."""
    return type(exc)(f"{label}: {exc}")


def shared_tensor(name: str, array: np.ndarray, ref: Ref) -> pb.Tensor:
    """A Tensor message for `array` whose bytes lie at `ref` (its writer put them there)."""
    dt = datatype_of(array.dtype)
    memory = pb.SharedMemoryRef(region=ref.region, offset=ref.offset, byte_size=ref.byte_size)
    return pb.Tensor(name=name, datatype=dt.name, shape=array.shape, shared_memory=memory)


def output_writes(
    outputs: Mapping[str, np.ndarray], memory: Mapping[str, OutputSlot]
) -> SlotWrites:
    """sluice.v1's placed outputs (output_memory), checked in its words, each to be copied
    once into its region (`land`, once the rest of the answer is made)."""

    def missing(name: str) -> TensorError:
        return TensorError(
            f"output_memory names output {name!r}, which this call does not return "
            f"(it returns {', '.join(repr(o) for o in outputs) or 'nothing'})"
        )

    def too_small(name: str, placed: OutputSlot, needed: int) -> TensorError:
        array, ref = outputs[name], placed.ref
        return TensorError(
            f"output_memory of output {name!r} ({ref.byte_size} bytes at offset "
            f"{ref.offset} of region {ref.region!r}) is {TOO_SMALL} its {needed} bytes "
            f"({datatype_of(array.dtype).name} shape {list(array.shape)})"
        )

    data = {name: bytes_of(outputs[name]) for name in memory if name in outputs}
    return SlotWrites(memory, data, too_small, missing)
