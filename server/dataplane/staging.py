"""Merging requests into one batch and splitting the outputs back, along the first
dimension. Batch inputs are copied straight into pooled staging buffers (no concatenate),
an input sent in a compact wire type cast on the way in; outputs are cut back into
per-request copies where they sit in pooled buffers, so the buffers can return to the pool,
and into views where ONNX Runtime allocated them."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from sluice.server.dataplane.buffers import BufferPool


class Cast(NamedTuple):
    """How an input sent in a wire type becomes the model's: float32(x) * scale + offset,
    computed in float32 (`scale` and `offset` are float32 scalars) and stored in `dtype`,
    the model's (FP32, or FP16)."""

    dtype: np.dtype[np.generic]
    scale: np.float32
    offset: np.float32


# The casts of a model's inputs, by input name and the datatype sent.
Casts = Mapping[tuple[str, np.dtype[np.generic]], Cast]


class Pad(NamedTuple):
    """How one input of a batch is padded (sluice.server.dataplane.padding): the length each
    of its padded axes takes, as (axis, length), and the value the padding holds."""

    axes: tuple[tuple[int, int], ...]
    value: np.generic


# The padding of a batch's padded inputs, by input name.
Pads = Mapping[str, Pad]


# Elements an FP16 cast computes at a time in float32 (256 KiB of scratch).
CAST_BLOCK = 1 << 16


def cast_into(out: np.ndarray, x: np.ndarray, how: Cast) -> None:
    """Write x * scale + offset into `out` (of the model's dtype) in place: ufuncs that
    convert as they go, in blocks, so nothing the size of `x` is made beside `out`. Scale 1
    converts only, so the values arrive exactly as sent."""
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
    """An FP16 model's input: float32(x) * scale + offset computed in float32 blocks and
    rounded to FP16 once (x * scale stored in FP16 first rounds twice, and overflows where
    the result would fit)."""
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
    """Batch inputs by name as views of pooled buffers, and the buffers to give back later.
    Every request holds the same names with equal non-batch dimensions, but for the axes an
    input in `pads` is padded along: there each request's values sit at the start and the
    rest holds the pad value, up to the pad's length. Each input's rows are its own first
    dimension (one request of a model without a batch dimension is copied whole). `padded`:
    rows are added up to this many (zeros; the pad value in a padded input). An input whose
    name and dtype are in `casts` is cast into the buffer as it is copied; the others keep
    their dtype."""
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
            view[...] = pad.value  # what no request's values cover, padding rows too
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
            view[total:] = 0  # padding rows: never stale bytes of an earlier batch
        merged[name] = view
    return merged, taken


# The outputs cut back to each request's lengths, by name: each one's axes along padded
# dimensions, as (axis, index into a request's lengths).
Cuts = Mapping[str, tuple[tuple[int, int], ...]]


def split(
    outputs: Mapping[str, np.ndarray],
    rows: Sequence[int],
    views: Collection[str] = (),
    cuts: Cuts | None = None,
    lengths: Sequence[tuple[int, ...]] = (),
    padded: tuple[int, ...] = (),
) -> list[dict[str, np.ndarray]]:
    """Each output's rows per request, in request order: copies (the arrays may sit in pooled
    buffers, which go back to the pool), but views for the outputs named in `views` (arrays
    of their own, such as ONNX Runtime's: a view keeps the batch's array alive as long as a
    request's reply needs it). An output in `cuts` is cut back along its padded axes to each
    request's `lengths` (a copy, unless the request fills them), from the batch's `padded`
    lengths, which those axes must have."""
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
    """One request's outputs, run alone at the `padded` lengths, each in `cuts` cut back to
    its `lengths`, copies or views as `split` makes them; no rows are split off, so outputs
    whose first dimension is not the batch (a static one, none at all) come back whole."""
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
    """One request's part of an output, cut back along `axes` to its `lengths` (a copy, unless
    it fills them)."""
    if axes and any(lengths[dim] != padded[dim] for _, dim in axes):
        index = [slice(None)] * array.ndim
        for axis, dim in axes:
            index[axis] = slice(0, lengths[dim])
        return array[tuple(index)].copy()
    return array if view else array.copy()


def rows_of(inputs: Mapping[str, np.ndarray]) -> int | None:
    """The batch rows of a request: the shared first dimension of its inputs, else None."""
    firsts = {a.shape[0] if a.ndim else None for a in inputs.values()}
    if len(firsts) != 1:
        return None
    return firsts.pop()


def key_dtype(name: str, array: np.ndarray, casts: Casts) -> str:
    """The datatype an input batches as: the model's where it is cast on the way in, so a
    uint8 request and an FP32 one of the same input share a batch (merge casts each part)."""
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
