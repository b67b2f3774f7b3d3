"""Where a call's tensors lie in shared memory: a region's bytes (`Ref`), the views a reader
takes of them (`Memory`: a server's lease, a client's arena), and the outputs placed there
(`OutputSlot`), written once by `SlotWrites`. Transport-free: the codec and both faces use it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

Buffer = bytes | memoryview  # flat bytes


class Memory(Protocol):
    """Byte views of registered shared memory regions (the server's: a call's
    sluice.shm.registry.Lease; a client's: its own regions). Each raises a SluiceError (or a
    TensorError) for a region it does not know or a range outside it. `wrote` is told how
    many bytes the writer put at the start of an output view (a copying lease writes back
    those only)."""

    def input(self, region: str, offset: int, byte_size: int) -> memoryview: ...

    def output(self, region: str, offset: int, byte_size: int) -> memoryview: ...

    def wrote(self, view: memoryview, nbytes: int) -> None: ...


class Ref(NamedTuple):
    """Bytes in a shared memory region, as a SharedMemoryRef names them."""

    region: str
    offset: int
    byte_size: int


class OutputSlot(NamedTuple):
    """An output's region, as its request named it, the writable view of it, and the
    `memory` it is of (told what is written into it)."""

    ref: Ref
    view: memoryview
    memory: Memory


class SlotWrites:
    """The one writer of outputs placed in shared memory, for both faces, in the server and
    the balancer: every placed output checked first (one the answer has, `missing` if not;
    within its view, `too_small` if not: each face's refusal), then, once the caller has
    made the rest of its answer, each written into its view, once (`land`), and marked on
    its memory (a copying lease writes back those bytes only). A refused answer writes
    nothing. `data`: each output's bytes, by name."""

    def __init__(
        self,
        placed: Mapping[str, OutputSlot],
        data: Mapping[str, Buffer],
        too_small: Callable[[str, OutputSlot, int], Exception],
        missing: Callable[[str], Exception],
    ) -> None:
        for name, place in placed.items():
            if name not in data:
                raise missing(name)
            if len(data[name]) > len(place.view):
                raise too_small(name, place, len(data[name]))
        self.placed = placed
        self.data = data

    def size(self, name: str) -> int:
        """The bytes output `name` takes in its region."""
        return len(self.data[name])

    def refs(self) -> dict[str, Ref]:
        """Where each output goes, as an answer names it (byte_size: the bytes it takes)."""
        return {
            name: Ref(p.ref.region, p.ref.offset, self.size(name))
            for name, p in self.placed.items()
        }

    def land(self) -> None:
        """Write each output into its view."""
        for name, place in self.placed.items():
            data = self.data[name]
            place.view[: len(data)] = data
            place.memory.wrote(place.view, len(data))
