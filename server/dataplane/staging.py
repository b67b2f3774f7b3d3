"""Merging requests into one batch and splitting the outputs back, along the first
dimension. Batch inputs are copied straight into pooled staging buffers (no concatenate);
outputs are cut back into per-request copies where they sit in pooled buffers, so the
buffers can return to the pool, and into views where ONNX Runtime allocated them."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from sluice.server.dataplane.buffers import BufferPool


def merge(
    requests: Sequence[Mapping[str, np.ndarray]], pool: BufferPool, padded: int = 0
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Batch inputs by name as views of pooled buffers, and the buffers to give back later.
    Every request holds the same names with equal non-batch dimensions and dtypes; each
    input's rows are its own first dimension (one request of a model without a batch
    dimension is copied whole). `padded`: zero rows are added up to this many."""
    merged: dict[str, np.ndarray] = {}
    taken: list[np.ndarray] = []
    for name, first in requests[0].items():
        if first.ndim == 0:  # a scalar: nothing to stage
            merged[name] = np.array(first)
            continue
        parts = [request[name] for request in requests]
        total = sum(len(part) for part in parts)
        size = max(total, padded)
        buffer = pool.take(first.dtype, first.shape[1:], size)
        taken.append(buffer)
        view = buffer[:size]
        offset = 0
        for part in parts:
            view[offset : offset + len(part)] = part
            offset += len(part)
        view[total:] = 0  # padding rows: never stale bytes of an earlier batch
        merged[name] = view
    return merged, taken


def split(
    outputs: Mapping[str, np.ndarray], rows: Sequence[int], views: Collection[str] = ()
) -> list[dict[str, np.ndarray]]:
    """Each output's rows per request, in request order: copies (the arrays may sit in pooled
    buffers, which go back to the pool), but views for the outputs named in `views` (arrays
    of their own, such as ONNX Runtime's: a view keeps the batch's array alive as long as a
    request's reply needs it)."""
    results: list[dict[str, np.ndarray]] = [{} for _ in rows]
    for name, array in outputs.items():
        if len(array) != sum(rows):
            raise ValueError(
                f"output {name!r} has {len(array)} rows for a batch of {sum(rows)}; "
                "the model's first dimension is not the batch"
            )
        offset = 0
        for result, n in zip(results, rows, strict=True):
            rows_of_one = array[offset : offset + n]
            result[name] = rows_of_one if name in views else rows_of_one.copy()
            offset += n
    return results


def rows_of(inputs: Mapping[str, np.ndarray]) -> int | None:
    """The batch rows of a request: the shared first dimension of its inputs, else None."""
    firsts = {a.shape[0] if a.ndim else None for a in inputs.values()}
    if len(firsts) != 1:
        return None
    return firsts.pop()


def group_key(inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> tuple[object, ...]:
    """Requests with equal keys can share a batch."""
    return (
        tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in inputs.items())),
        tuple(outputs),
    )
