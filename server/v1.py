"""The sluice.v1 protocol on the dataplane: PredictRequest bytes to a core request, outputs
to PredictResponse bytes (both read and written by sluice.wire.codec where it can), a model's
specs to a ModelInfo. Tensors the caller placed (Tensor.shared_memory, output_memory) are
read and written through the call's lease (sluice.shm)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from sluice.core.errors import InvalidInput
from sluice.server.dataplane.batcher import Arrays
from sluice.server.dataplane.engine import TensorSpec
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import Asked, Request
from sluice.server.settings import ServerSettings
from sluice.shm import placement, scan
from sluice.shm.calls import unserved
from sluice.shm.registry import Lease
from sluice.shm.slots import OutputSlot
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec, facts, peek
from sluice.wire.body import parse

# Bodies from this size are read straight off the wire (codec.decode_predict): a 602 KB
# image's parse and raw_data copies cost 1.1 ms a call in fresh memory; below it the full
# parser is the faster (8.8 us against 10.2 for the digits model's 300 bytes).
WIRE_READ_FROM = 16 << 10
# After what names shared memory in a body (both faces), where the node takes none.
NO_SHARED_MEMORY = unserved(ServerSettings.PROG)


class Options(NamedTuple):
    """What a Predict asks of its answer: typed outputs, and the outputs to write into
    shared memory (their views taken at decode, through the call's lease)."""

    typed: bool
    memory: Mapping[str, OutputSlot]


class SluiceV1:
    """Predict's bodies. `shared_memory`: the node takes shared memory, so `route` looks
    for bodies that name a region (off, `decode` refuses them)."""

    name = "sluice.v1"

    def __init__(self, shared_memory: bool = False) -> None:
        self.shared_memory = shared_memory

    def route(self, body: bytes) -> Asked:
        try:
            read = facts.read(body, facts.PREDICT)
        except peek.Malformed as exc:
            raise InvalidInput(str(exc)) from None
        shared = self.shared_memory and scan.uses_regions(body)
        return Asked(read.model, read.version, None, shared)

    def decode(self, body: bytes, lease: Lease | None = None) -> Request[Options]:
        # Straight off the wire where it can (a body that names regions, which has a lease,
        # goes to the parser: the wire read would give it up)
        if lease is None and len(body) >= WIRE_READ_FROM:
            try:
                read = codec.decode_predict(body)  # None for one that names shared memory
            except codec.TensorError as exc:
                raise InvalidInput(str(exc)) from None
            if read is not None:
                inputs, outputs, typed = read
                return Request(inputs, outputs, Options(typed, {}))
        request = parse(pb.PredictRequest, body)
        inputs, memory = placement.predict_tensors(request, lease, NO_SHARED_MEMORY)
        return Request(inputs, request.outputs, Options(request.typed_outputs, memory))

    def encode(self, model: Model, request: Request[Options], outputs: Arrays) -> bytes:
        typed, memory = request.options
        try:
            return codec.encode_predict_response(model.name, model.version, outputs, typed, memory)
        except codec.TensorError as exc:  # an output_memory its output does not fit
            raise InvalidInput(str(exc)) from None


def _specs(specs: list[TensorSpec]) -> list[pb.TensorSpec]:
    return [
        pb.TensorSpec(
            name=s.name,
            datatype=s.datatype,
            shape=[-1 if d is None else d for d in s.shape],
            accepts=[
                pb.WireType(datatype=w.datatype, scale=w.scale, offset=w.offset) for w in s.accepts
            ],
        )
        for s in specs
    ]


def model_info(model: Model) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=model.name,
        version=model.version,
        inputs=_specs(model.inputs),
        outputs=_specs(model.outputs),
    )


def model_statuses(models: Models) -> list[pb.ModelStatus]:
    """Every model a node serves, its ready versions newest first."""
    default = models.default
    statuses = []
    for name in models.names():
        versions = models.versions(name)
        newest = versions[0].engine if versions else None
        statuses.append(
            pb.ModelStatus(
                name=name,
                versions=[m.version for m in versions],
                default=default is not None and default.name == name,
                provider=newest.provider if newest else "",
                fallback=newest.fallback if newest else "",
            )
        )
    return statuses
