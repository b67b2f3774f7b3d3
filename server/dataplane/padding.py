"""Padding: requests of different lengths batched. Paddable inputs are padded along their
named dynamic dimensions to a length bucket the batch shares; outputs along them are cut
back to each request's length. `plan` checks the declaration at load, `Padding.measure` a
request's lengths; `staging` pads and cuts the arrays."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from sluice.core.errors import InvalidInput, LoadFailed
from sluice.server.dataplane import staging
from sluice.server.dataplane.modelsettings import Pads, check_lengths
from sluice.server.dataplane.staging import Pad

if TYPE_CHECKING:  # the engine imports this module
    from sluice.server.dataplane.engine import TensorSpec

# Along each padded dimension, in `Padding.dims` order.
Lengths = tuple[int, ...]
# The axes of one tensor that run along padded dimensions: (axis, index into dims).
Axes = tuple[tuple[int, int], ...]


# ONNX states no model's longest length, and unbounded every new bucket is a new shape (on
# CUDA a session of its own, kept).
DEFAULT_MAX_LENGTH = 512


@dataclass(frozen=True)
class Buckets:
    """The lengths padding rounds up to: `sizes` where given, else powers of two capped at
    `longest` (0: the largest size, or none). `defaulted`: `longest` was not given."""

    sizes: tuple[int, ...] = ()
    longest: int = 0
    defaulted: bool = False

    @property
    def limit(self) -> int:
        """The longest length taken; 0: any."""
        return self.longest or (self.sizes[-1] if self.sizes else 0)

    def of(self, length: int) -> int | None:
        """The bucket `length` pads to; None above the limit."""
        limit = self.limit
        if limit and length > limit:
            return None
        if self.sizes:
            return self.sizes[bisect.bisect_left(self.sizes, length)]
        power = 1 << (length - 1).bit_length()
        return min(power, limit) if limit else power

    def listed(self) -> tuple[int, ...]:
        """Every bucket a length can take; () when they have no end (no limit)."""
        limit = self.limit
        if not limit:
            return ()
        top = self.of(limit)
        if self.sizes:
            return tuple(s for s in self.sizes if top is not None and s <= top)
        powers = [1 << i for i in range((limit - 1).bit_length())]
        return (*powers, limit)

    def describe(self) -> str:
        listed = self.listed()
        if not listed:
            return "powers of two"
        if not self.sizes:
            return f"powers of two up to {listed[-1]}"
        return ", ".join(map(str, listed)) + (
            f" (at most {self.longest})" if self.longest and self.longest != listed[-1] else ""
        )


def pad_value(text: str, spec: TensorSpec) -> np.generic:
    """`text` as a value of `spec`'s datatype; ValueError for one that does not fit it."""
    dtype, word = spec.dtype, text.strip().lower()
    if dtype.kind == "b":
        if word not in ("0", "1", "true", "false"):
            raise ValueError(f"{text!r} is not a BOOL: 0, 1, true or false")
        return np.bool_(word in ("1", "true"))
    if dtype.kind in "iu":
        try:
            whole = int(word)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number, as {spec.datatype} needs") from None
        info = np.iinfo(dtype.name)
        if not info.min <= whole <= info.max:
            raise ValueError(f"{whole} is outside {spec.datatype}'s {info.min}..{info.max}")
        return dtype.type(whole)
    try:
        number = float(word)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    with np.errstate(over="ignore"):
        value = dtype.type(number)
    if math.isfinite(number) and not np.isfinite(value):
        largest = np.finfo(dtype.name).max
        raise ValueError(f"{text!r} is beyond {spec.datatype} (its largest is {largest:g})")
    return value


def _where(spec: TensorSpec, axis: int) -> str:
    name = spec.dims[axis] if axis < len(spec.dims) else None
    return f"dimension {axis}" + (f" ({name!r})" if name else "")


def plan(
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    pads: Pads,
    buckets: tuple[int, ...] = (),
    max_length: int = 0,
) -> Padding | None:
    """The padding `pads` declares for this model (None for none); LoadFailed naming the
    input and dimension where it does not fit."""
    if not pads:
        return None
    try:
        check_lengths(buckets, max_length)
    except ValueError as exc:
        raise LoadFailed(str(exc)) from None
    by_name = {s.name: s for s in inputs}
    for name in pads:
        if name not in by_name:
            raise LoadFailed(
                f"padding is given for input {name!r}, which the model does not have; its "
                "inputs are " + ", ".join(f"{s.name!r} {s.describe()}" for s in inputs)
            )
    marked = [s for s in inputs if s.name in pads]
    found: dict[str, tuple[str, ...]] = {}
    for spec in marked:
        dynamic = [a for a in range(1, len(spec.shape)) if spec.shape[a] is None]
        if not dynamic:
            raise LoadFailed(
                f"input {spec.name!r} {spec.describe()} is marked for padding, but it has no "
                "dynamic dimension beyond the batch to pad: "
                + ", ".join(f"dimension {a} is {spec.shape[a]}" for a in range(1, len(spec.shape)))
            )
        names = []
        for axis in dynamic:
            dim = spec.dims[axis] if axis < len(spec.dims) else None
            if dim is None:
                raise LoadFailed(
                    f"input {spec.name!r} {spec.describe()} is marked for padding, but its "
                    f"dynamic dimension {axis} has no name in the model, so no output can be "
                    "cut back along it: name it (e.g. 'sequence') in the ONNX file"
                )
            names.append(dim)
        found[spec.name] = tuple(dict.fromkeys(names))
    first = marked[0]
    for spec in marked[1:]:
        if set(found[spec.name]) != set(found[first.name]):
            raise LoadFailed(
                "inputs padded together must pad the same dimensions: "
                f"input {first.name!r} {_dims(found[first.name])}, "
                f"input {spec.name!r} {_dims(found[spec.name])}"
            )
    dims = found[first.name]
    for spec in inputs:
        if spec.name in pads:
            continue
        for axis, dim in enumerate(spec.dims):
            if axis and dim in dims:
                raise LoadFailed(
                    f"input {spec.name!r} {spec.describe()} has {_where(spec, axis)}, which "
                    f"input {first.name!r} is padded along: mark it for padding too, with "
                    "its own pad value"
                )
    defaulted = not buckets and not max_length
    values = {}
    for spec in marked:
        try:
            values[spec.name] = pad_value(pads[spec.name], spec)
        except ValueError as exc:
            raise LoadFailed(f"input {spec.name!r}: pad value {exc}") from None
    return Padding(
        dims,
        {s.name: _axes(s, dims) for s in marked},
        values,
        {s.name: axes for s in outputs if (axes := _axes(s, dims))},
        Buckets(buckets, max_length or (0 if buckets else DEFAULT_MAX_LENGTH), defaulted),
    )


def _dims(names: Iterable[str]) -> str:
    listed = ", ".join(repr(n) for n in names)
    return f"pads {listed}"


def _axes(spec: TensorSpec, dims: tuple[str, ...]) -> Axes:
    return tuple(
        (axis, dims.index(dim))
        for axis, dim in enumerate(spec.dims)
        if axis and dim is not None and dim in dims
    )


@dataclass(frozen=True)
class Padding:
    """A model's padding, checked against it (`plan` makes one)."""

    dims: tuple[str, ...]
    inputs: Mapping[str, Axes]
    values: Mapping[str, np.generic]
    outputs: Mapping[str, Axes]
    buckets: Buckets

    def measure(self, inputs: Mapping[str, np.ndarray]) -> tuple[Lengths, Lengths]:
        """A checked request's lengths and bucket; InvalidInput naming an input that
        disagrees with the first, or is too long."""
        lengths: list[int | None] = [None] * len(self.dims)
        first: list[str] = [""] * len(self.dims)
        for name, axes in self.inputs.items():
            shape = inputs[name].shape
            for axis, dim in axes:
                length = shape[axis]
                known = lengths[dim]
                if known is None:
                    lengths[dim], first[dim] = length, name
                elif length != known:
                    raise InvalidInput(
                        f"input {name!r} has length {length} along {self.dims[dim]!r} "
                        f"(dimension {axis}, shape {list(shape)}) but input {first[dim]!r} has "
                        f"{known}: inputs padded together must agree on their lengths"
                    )
        measured = tuple(n or 0 for n in lengths)
        bucket = []
        for dim, length in enumerate(measured):
            found = self.buckets.of(length)
            if found is None:
                raise InvalidInput(
                    f"input {first[dim]!r} has length {length} along {self.dims[dim]!r}, above "
                    f"the longest this model takes, {self.buckets.limit}"
                    + (
                        " (the default: --max-length, or sluice.max_length in its config, "
                        "takes longer)"
                        if self.buckets.defaulted
                        else ""
                        if self.buckets.longest
                        else " (its largest length bucket)"
                    )
                )
            bucket.append(found)
        return measured, tuple(bucket)

    def extent(self, inputs: Mapping[str, np.ndarray]) -> Lengths:
        """A request's lengths, unchecked (`measure` checked them)."""
        lengths = [0] * len(self.dims)
        for name, axes in self.inputs.items():
            shape = inputs[name].shape
            for axis, dim in axes:
                lengths[dim] = shape[axis]
        return tuple(lengths)

    def group_key(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        bucket: Lengths,
        casts: staging.Casts | None = None,
    ) -> tuple[object, ...]:
        """Requests with equal keys can share a batch (staging.group_key's, less padded axes)."""
        shapes = []
        for name, array in inputs.items():
            shape: list[int | None] = list(array.shape[1:])
            for axis, _ in self.inputs.get(name, ()):
                shape[axis - 1] = None
            shapes.append((name, staging.key_dtype(name, array, casts or {}), tuple(shape)))
        return bucket, tuple(sorted(shapes)), tuple(outputs)

    def shaped(
        self, inputs: Mapping[str, np.ndarray], length: int | Lengths
    ) -> dict[str, np.ndarray]:
        """Zeros shaped as `inputs` with every padded axis `length` long."""
        lengths = (length,) * len(self.dims) if isinstance(length, int) else length
        shaped = dict(inputs)
        for name, axes in self.inputs.items():
            shape = list(inputs[name].shape)
            for axis, dim in axes:
                shape[axis] = lengths[dim]
            shaped[name] = np.zeros(shape, inputs[name].dtype)
        return shaped

    def follow(
        self,
        outputs: Sequence[TensorSpec],
        shapes_at: Callable[[Lengths], Mapping[str, tuple[int, ...]]],
    ) -> Padding:
        """This padding, also cutting outputs whose axes follow the length under another name
        (an export may call one `Addlast_hidden_state_dim_1`), found by two runs
        (`shapes_at`). LoadFailed for an axis that changes with the length but is not it
        (returned whole it would leak the batch's length)."""
        unmatched = {
            s.name: [
                a
                for a in range(1, len(s.shape))
                if s.shape[a] is None and a not in dict(self.outputs.get(s.name, ()))
            ]
            for s in outputs
        }
        unmatched = {name: axes for name, axes in unmatched.items() if axes}
        if not unmatched:
            return self
        first, second = probes(len(self.dims))
        at_first, at_second = shapes_at(first), shapes_at(second)
        cuts = dict(self.outputs)
        for name, axes in unmatched.items():
            learned = []
            for axis in axes:
                sizes = (at_first[name][axis], at_second[name][axis])
                if sizes[0] == sizes[1]:
                    continue
                dims = [d for d in range(len(self.dims)) if sizes == (first[d], second[d])]
                if not dims:
                    raise LoadFailed(
                        f"output {name!r} dimension {axis} is {sizes[0]} long when the padded "
                        f"inputs are {label(first)} and {sizes[1]} when they are "
                        f"{label(second)}: it changes with the padded length but is not it, "
                        "so a padded batch's answers cannot be cut back to each request's"
                    )
                learned.append((axis, dims[0]))
            if learned:
                cuts[name] = tuple(sorted((*cuts.get(name, ()), *learned)))
        return replace(self, outputs=cuts)

    def fills(self, lengths: Lengths) -> dict[str, Pad]:
        """How staging.merge pads each padded input to `lengths`."""
        return {
            name: Pad(tuple((axis, lengths[dim]) for axis, dim in axes), self.values[name])
            for name, axes in self.inputs.items()
        }

    def describe(self) -> str:
        values = ", ".join(f"{n} with {self.values[n]!s}" for n in self.inputs)
        along = ", ".join(self.dims)
        return f"pads {values} along {along} to buckets of {self.buckets.describe()}"


def probes(count: int) -> tuple[Lengths, Lengths]:
    """The lengths of `Padding.follow`'s two runs: distinct, none 1 (it may be a broadcast)."""
    first = tuple(2 + d for d in range(count))
    return first, tuple(2 * n for n in first)


def label(lengths: Lengths) -> int | str | None:
    """Lengths as Health and messages show them: 64, or "64x16" (None: unpadded)."""
    if not lengths:
        return None
    return lengths[0] if len(lengths) == 1 else "x".join(map(str, lengths))


def run_lengths(lengths: Sequence[Lengths], bucket: Lengths, to_bucket: bool) -> Lengths:
    """The lengths a batch runs at: the bucket with `to_bucket` (on CUDA each shape is a
    re-plan), else the longest of each dimension."""
    if to_bucket or not lengths:
        return bucket
    if len(lengths) == 1:
        return lengths[0]
    return tuple(max(column) for column in zip(*lengths, strict=True))


def tokens(rows: int, lengths: Lengths) -> int:
    """The positions `rows` rows of `lengths` hold: a run's cost measure."""
    return rows * math.prod(lengths)
