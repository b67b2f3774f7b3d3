"""The sluice.v1 protocol on the dataplane: PredictRequest bytes to a core request, outputs
to PredictResponse bytes (both read and written by sluice.wire.codec where it can), a model's
specs to a ModelInfo."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from sluice.core.errors import InvalidInput
from sluice.server.dataplane.batcher import Arrays
from sluice.server.dataplane.engine import TensorSpec
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import Asked, Request
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec, facts, peek

M = TypeVar("M", bound=Message)


def parse(kind: type[M], body: bytes) -> M:
    try:
        return kind.FromString(body)
    except DecodeError as exc:
        raise InvalidInput(
            f"request body is not a valid {kind.DESCRIPTOR.full_name} message: {exc}"
        ) from None


# Bodies from this size are read straight off the wire (codec.decode_predict): a 602 KB
# image's parse and raw_data copies cost 1.1 ms a call in fresh memory; below it the full
# parser is the faster (8.8 us against 10.2 for the digits model's 300 bytes).
WIRE_READ_FROM = 16 << 10


class SluiceV1:
    """Predict's bodies; the option is `typed_outputs`."""

    name = "sluice.v1"

    def route(self, body: bytes) -> Asked:
        try:
            read = facts.read(body, facts.PREDICT)
        except peek.Malformed as exc:
            raise InvalidInput(str(exc)) from None
        return Asked(read.model, read.version)

    def decode(self, body: bytes) -> Request[bool]:
        if len(body) >= WIRE_READ_FROM:  # straight off the wire, where it can
            try:
                read = codec.decode_predict(body)
            except codec.TensorError as exc:
                raise InvalidInput(str(exc)) from None
            if read is not None:
                return Request(*read)
        request = parse(pb.PredictRequest, body)
        try:
            inputs = codec.decode_all(request.inputs)
        except codec.TensorError as exc:
            raise InvalidInput(str(exc)) from None
        return Request(inputs, request.outputs, request.typed_outputs)

    def encode(self, model: Model, request: Request[bool], outputs: Arrays) -> bytes:
        return codec.encode_predict_response(model.name, model.version, outputs, request.options)


V1 = SluiceV1()


def _specs(specs: list[TensorSpec]) -> list[pb.TensorSpec]:
    return [
        pb.TensorSpec(
            name=s.name, datatype=s.datatype, shape=[-1 if d is None else d for d in s.shape]
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
