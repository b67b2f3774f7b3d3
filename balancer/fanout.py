"""Fan-out: a Predict with more rows than the balancer's `--fanout-rows` is split along the
first dimension into chunks, each a Predict of its own (sent in parallel to several servers),
and their answers are merged back in order. The only place the balancer parses tensors.

Whether a body needs it is read off the wire with its model (its inputs' first dimensions,
sluice.wire.facts) without parsing it; only a body over the threshold is parsed. A body the
split cannot cut faithfully (inputs whose first dimensions differ, a tensor whose bytes do not
match its shape, an unknown datatype, a repeated name, bytes no parser takes) is forwarded
whole: the server's word on it, its message about the request as sent, is the answer. Some
models take inputs whose first dimensions differ; the balancer cannot tell, the server can.

The answers merge only when one model version gave them all (else ABORTED: a new version
went live mid-call, and mixing versions in one answer would be wrong) and every output
follows its chunk's rows; a model whose outputs do not (a reduction over the rows, say)
gets the request again, whole."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

from google.protobuf.message import DecodeError

from sluice.core.datatypes import DATATYPES
from sluice.core.errors import Code
from sluice.v1 import inference_pb2 as pb
from sluice.wire import facts, peek

TYPED_FIELDS = sorted({d.typed_field for d in DATATYPES.values()})
NODE_ID = "x-node-id"
CACHE = "x-cache"


@dataclass
class FanoutStats:
    """What fan-out did: calls split, and the chunks they were split into."""

    calls: int = 0
    chunks: int = 0


@dataclass(frozen=True)
class Split:
    """A request cut into chunks: each chunk's body and its rows [start, stop)."""

    bodies: list[bytes]
    bounds: list[tuple[int, int]]

    @property
    def rows(self) -> int:
        return self.bounds[-1][1]

    def where(self, index: int) -> str:
        """Which part of the request chunk `index` is, for a message."""
        start, stop = self.bounds[index]
        return (
            f"chunk {index + 1} of {len(self.bodies)} (rows {start}-{stop - 1} of {self.rows}, "
            "split by the balancer's --fanout-rows)"
        )


class NotRowWise(ValueError):
    """The chunks' outputs do not follow their rows (an output of another first dimension,
    or different outputs): the model does not answer row by row, so the request runs whole."""


class MergeError(Exception):
    """The chunks' answers cannot be one answer; the call fails with `code`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def split(body: bytes, most: int, read: facts.Facts | None = None) -> Split | None:
    """The request cut into chunks of at most `most` rows, or None when it has no more rows
    than that or cannot be cut faithfully (forward it whole). `read`: the body's facts with
    its rows, when the caller has read them."""
    if read is None:
        try:
            read = facts.read(body, facts.PREDICT, rows=True)
        except peek.Malformed:
            return None
    total = read.rows
    if total is None or total <= most:
        return None
    try:
        request = pb.PredictRequest.FromString(body)
    except DecodeError:
        return None
    inputs = list(request.inputs)
    if len({t.name for t in inputs}) != len(inputs):
        return None
    found = [_cutter(t, total) for t in inputs]
    cutters = [c for c in found if c is not None]
    if len(cutters) != len(found):
        return None
    del request.inputs[:]  # what is left (outputs, options, model, version) goes to every chunk
    bounds = [(a, min(a + most, total)) for a in range(0, total, most)]
    bodies = []
    for start, stop in bounds:
        chunk = pb.PredictRequest()
        chunk.CopyFrom(request)
        chunk.inputs.extend(cut(start, stop) for cut in cutters)
        bodies.append(chunk.SerializeToString())
    return Split(bodies, bounds)


Cutter = Callable[[int, int], pb.Tensor]


def _cutter(tensor: pb.Tensor, total: int) -> Cutter | None:
    """A function giving `tensor`'s rows [start, stop) as a Tensor, or None when its
    contents do not match its declared shape and datatype (the server judges it)."""
    dt = DATATYPES.get(tensor.datatype)
    shape = list(tensor.shape)
    if dt is None or not shape or shape[0] != total or any(d < 0 for d in shape):
        return None
    name, datatype, rest = tensor.name, tensor.datatype, shape[1:]
    per_row = math.prod(rest)
    typed = [f for f in TYPED_FIELDS if len(getattr(tensor, f))]
    if not typed:
        raw, width = tensor.raw_data, per_row * dt.dtype.itemsize
        if len(raw) != total * width:
            return None
        return lambda start, stop: pb.Tensor(
            name=name,
            datatype=datatype,
            shape=[stop - start, *rest],
            raw_data=raw[start * width : stop * width],
        )
    values = list(getattr(tensor, dt.typed_field))
    if tensor.raw_data or typed != [dt.typed_field] or len(values) != total * per_row:
        return None

    def cut(start: int, stop: int) -> pb.Tensor:
        part = pb.Tensor(name=name, datatype=datatype, shape=[stop - start, *rest])
        getattr(part, dt.typed_field).extend(values[start * per_row : stop * per_row])
        return part

    return cut


def merge(bodies: Sequence[bytes], parts: Split) -> bytes:
    """The chunks' PredictResponse bodies (in chunk order) as one: each output's rows
    concatenated in order. MergeError when they cannot be one answer (ABORTED: versions
    differ); NotRowWise when the model's outputs do not follow the rows."""
    answers = []
    for index, body in enumerate(bodies):
        try:
            answers.append(pb.PredictResponse.FromString(body))
        except DecodeError as exc:
            raise MergeError(
                Code.INTERNAL, f"{parts.where(index)}: its answer is not a PredictResponse: {exc}"
            ) from None
    versions = list(dict.fromkeys((a.model, a.version) for a in answers))
    if len(versions) > 1:
        named = ", ".join(f"{m!r} version {v!r}" for m, v in versions)
        raise MergeError(
            Code.ABORTED,
            f"the chunks of this request were answered by different model versions ({named}): "
            "a new version went live during the call; retry it, or name a version",
        )
    first = answers[0]
    if any(len(a.outputs) != len(first.outputs) for a in answers):
        raise NotRowWise("the chunks' answers hold different outputs")
    merged = pb.PredictResponse(model=first.model, version=first.version)
    for position, head in enumerate(first.outputs):
        pieces = [a.outputs[position] for a in answers]
        for piece, (start, stop) in zip(pieces, parts.bounds, strict=True):
            if (
                piece.name != head.name
                or piece.datatype != head.datatype
                or not piece.shape
                or piece.shape[0] != stop - start
                or piece.shape[1:] != head.shape[1:]
            ):
                raise NotRowWise(f"output {head.name!r} does not follow the rows of the request")
        tensor = merged.outputs.add(
            name=head.name, datatype=head.datatype, shape=[parts.rows, *head.shape[1:]]
        )
        tensor.raw_data = b"".join(p.raw_data for p in pieces)
        for typed in TYPED_FIELDS:
            if any(len(getattr(p, typed)) for p in pieces):
                getattr(tensor, typed).extend(
                    chain.from_iterable(getattr(p, typed) for p in pieces)
                )
    return merged.SerializeToString()


def merge_trailers(trailers: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The chunks' trailers (in chunk order) as one call's: x-node-id lists each chunk's
    node in chunk order; x-cache is a hit only when every chunk's was; any other key keeps
    its distinct comma-separated items (x-request-id, one value, stays as it was)."""
    merged: dict[str, str] = {}
    for key in dict.fromkeys(chain.from_iterable(trailers)):
        values = [t[key] for t in trailers if key in t]
        if key == NODE_ID:
            merged[key] = ",".join(values)
        elif key == CACHE:
            merged[key] = "hit" if all(t.get(key) == "hit" for t in trailers) else "miss"
        else:
            merged[key] = ",".join(dict.fromkeys(_items(values)))
    return merged


def _items(values: Sequence[str]) -> Iterator[str]:
    for value in values:
        yield from value.split(",")
