"""Where a call's tensors lie in shared memory: a region's bytes (`Ref`), the views a reader
takes of them (`Memory`: a server's lease, a client's arena), and the outputs placed there
(`OutputSlot`), written once by `SlotWrites`. Transport-free: the codec and both faces use it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

Buffer = bytes | memoryview  # flat bytes


class Memory(Protocol):
    """Byte views of registered regions (a server's Lease, a client's arena); each refuses a
    region it does not know or a range outside it. `wrote`: how many bytes the writer put at
    an output view's start (all a copying lease writes back)."""

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
    """The one writer of outputs placed in shared memory, both faces, server and balancer:
    every output checked first (`missing`, `too_small`: each face's refusal), then, once the
    rest of the answer is made, each written once (`land`) and marked on its memory."""

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
