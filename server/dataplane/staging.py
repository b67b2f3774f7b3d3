"""Merging requests into one batch (copied straight into pooled buffers, cast on the way in)
and splitting the outputs back (copies out of pooled buffers, views of ORT's own)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from sluice.server.dataplane.buffers import BufferPool


class Cast(NamedTuple):
    """How an input sent in a wire type becomes the model's `dtype`: float32(x) * scale +
    offset."""

    dtype: np.dtype[np.generic]
    scale: np.float32
    offset: np.float32


Casts = Mapping[tuple[str, np.dtype[np.generic]], Cast]


class Pad(NamedTuple):
    """How one input of a batch is padded: (axis, length) for each padded axis, and the value."""

    axes: tuple[tuple[int, int], ...]
    value: np.generic


Pads = Mapping[str, Pad]


# Elements an FP16 cast computes at a time in float32.
CAST_BLOCK = 1 << 16


def cast_into(out: np.ndarray, x: np.ndarray, how: Cast) -> None:
    """Write x * scale + offset into `out` in place, making nothing the size of `x` beside it;
    scale 1 converts only, so the values arrive exactly as sent."""
    if how.dtype != np.float32 and (how.scale != 1 or how.offset):
        _cast_rounded_once(out, x, how)
        return
    if how.scale == 1:
        np.copyto(out, x, casting="unsafe")
    else:
        np.multiply(x, how.scale, out=out, dtype=np.float32, casting="unsafe")
    if how.offset:
        np.add(out, how.offset, out=out, dtype=np.float32, casting="unsafe")


def _cast_rounded_once(out: np.ndarray, x: np.ndarray, how: Cast) -> None:
    """For FP16: computed in float32 blocks and rounded once (x * scale in FP16 first rounds
    twice, and overflows where the result would fit)."""
    if not (out.flags.c_contiguous and x.flags.c_contiguous):
        np.copyto(out, np.asarray(x, np.float32) * how.scale + how.offset, casting="unsafe")
        return
    flat_out, flat_x = out.reshape(-1), x.reshape(-1)
    scratch = np.empty(min(CAST_BLOCK, flat_x.size), np.float32)
    for start in range(0, flat_x.size, CAST_BLOCK):
        part = scratch[: min(CAST_BLOCK, flat_x.size - start)]
        np.multiply(flat_x[start : start + len(part)], how.scale, out=part, casting="unsafe")
        np.add(part, how.offset, out=part)
        flat_out[start : start + len(part)] = part


def cast(x: np.ndarray, how: Cast) -> np.ndarray:
    """x as the model takes it: one new array, written once (see cast_into)."""
    out = np.empty(x.shape, how.dtype)
    cast_into(out, x, how)
    return out


def merge(
    requests: Sequence[Mapping[str, np.ndarray]],
    pool: BufferPool,
    padded: int = 0,
    casts: Casts | None = None,
    pads: Pads | None = None,
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Batch inputs as views of pooled buffers, and the buffers to give back. Rows are added
    up to `padded`; inputs in `pads` are padded along their axes; those in `casts` cast."""
    merged: dict[str, np.ndarray] = {}
    taken: list[np.ndarray] = []
    for name, first in requests[0].items():
        cast_first = casts.get((name, first.dtype)) if casts else None
        if first.ndim == 0:  # a scalar: nothing to stage
            merged[name] = np.array(first) if cast_first is None else cast(first, cast_first)
            continue
        parts = [request[name] for request in requests]
        total = sum(len(part) for part in parts)
        size = max(total, padded)
        dtype = first.dtype if cast_first is None else cast_first.dtype
        pad = pads.get(name) if pads else None
        row_shape = list(first.shape[1:])
        for axis, length in pad.axes if pad is not None else ():
            row_shape[axis - 1] = length
        buffer = pool.take(dtype, tuple(row_shape), size)
        taken.append(buffer)
        view = buffer[:size]
        if pad is not None:
            view[...] = pad.value
        offset = 0
        for part in parts:
            rows = view[offset : offset + len(part)]
            if pad is not None:
                rows = rows[(slice(None), *(slice(0, n) for n in part.shape[1:]))]
            to = casts.get((name, part.dtype)) if casts else None
            if to is None:
                rows[...] = part
            else:
                cast_into(rows, part, to)
            offset += len(part)
        if pad is None:
            view[total:] = 0  # never stale bytes of an earlier batch
        merged[name] = view
    return merged, taken


# By output: (axis, index into a request's lengths) for each axis cut back.
Cuts = Mapping[str, tuple[tuple[int, int], ...]]


def split(
    outputs: Mapping[str, np.ndarray],
    rows: Sequence[int],
    views: Collection[str] = (),
    cuts: Cuts | None = None,
    lengths: Sequence[tuple[int, ...]] = (),
    padded: tuple[int, ...] = (),
) -> list[dict[str, np.ndarray]]:
    """Each output's rows per request: copies (pooled buffers go back), views for those in
    `views` (arrays of their own); outputs in `cuts` cut back to each request's `lengths`."""
    results: list[dict[str, np.ndarray]] = [{} for _ in rows]
    for name, array in outputs.items():
        if len(array) != sum(rows):
            raise ValueError(
                f"output {name!r} has {len(array)} rows for a batch of {sum(rows)}; "
                "the model's first dimension is not the batch"
            )
        axes = cuts.get(name, ()) if cuts else ()
        _check_cut(name, array, axes, padded)
        offset = 0
        for i, (result, n) in enumerate(zip(results, rows, strict=True)):
            rows_of_one = array[offset : offset + n]
            offset += n
            result[name] = _cut(
                rows_of_one, axes, lengths[i] if axes else (), padded, name in views
            )
    return results


def cut(
    outputs: Mapping[str, np.ndarray],
    views: Collection[str] = (),
    cuts: Cuts | None = None,
    lengths: tuple[int, ...] = (),
    padded: tuple[int, ...] = (),
) -> dict[str, np.ndarray]:
    """One request's outputs, run alone, cut back as `split` does but with no rows split off."""
    result = {}
    for name, array in outputs.items():
        axes = cuts.get(name, ()) if cuts else ()
        _check_cut(name, array, axes, padded)
        result[name] = _cut(array, axes, lengths, padded, name in views)
    return result


def _check_cut(
    name: str, array: np.ndarray, axes: tuple[tuple[int, int], ...], padded: tuple[int, ...]
) -> None:
    for axis, dim in axes:
        if axis >= array.ndim or array.shape[axis] != padded[dim]:
            found = array.shape[axis] if axis < array.ndim else "no"
            raise ValueError(
                f"output {name!r} has {found} positions in dimension {axis} "
                f"for inputs padded to {padded[dim]} there; it cannot be cut back"
            )


def _cut(
    array: np.ndarray,
    axes: tuple[tuple[int, int], ...],
    lengths: tuple[int, ...],
    padded: tuple[int, ...],
    view: bool,
) -> np.ndarray:
    """One request's part of an output, cut back along `axes` to its `lengths`."""
    if axes and any(lengths[dim] != padded[dim] for _, dim in axes):
        index = [slice(None)] * array.ndim
        for axis, dim in axes:
            index[axis] = slice(0, lengths[dim])
        return array[tuple(index)].copy()
    return array if view else array.copy()


def key_dtype(name: str, array: np.ndarray, casts: Casts) -> str:
    """The datatype an input batches as: the model's where it is cast, so uint8 and FP32
    requests share a batch."""
    how = casts.get((name, array.dtype)) if casts else None
    return (array.dtype if how is None else how.dtype).str


def group_key(
    inputs: Mapping[str, np.ndarray], outputs: Sequence[str], casts: Casts | None = None
) -> tuple[object, ...]:
    """Requests with equal keys can share a batch."""
    return (
        tuple(sorted((n, key_dtype(n, a, casts or {}), a.shape[1:]) for n, a in inputs.items())),
        tuple(outputs),
    )
