"""Whether a request body names shared memory, told by a walk of its fields before any
decode (the server's cache and the balancer's relay ask); field numbers from sluice.wire."""

from __future__ import annotations

from sluice.wire import peek
from sluice.wire.facts import (
    INFER_PLACED,
    PREDICT_INPUTS,
    PREDICT_OUTPUT_MEMORY,
    TENSOR_SHARED_MEMORY,
)

# Triton's parameter of a KServe tensor in shared memory: the region that holds it.
REGION_KEY = b"shared_memory_region"
_SHARED_TAG = peek.tag(TENSOR_SHARED_MEMORY)
_SCAN_MOST = 4 << 10  # bytes of an input scanned for that tag before its fields are walked


def uses_regions(body: bytes) -> bool:
    """Whether a PredictRequest body names shared memory: outputs to write into regions
    (output_memory), or an input whose bytes lie in one (Tensor.shared_memory). Its answer
    then depends on what the regions hold, not on the body alone: no cache may keep it.
    One walk of the top-level fields and of each input's (a raw_data is stepped over, not
    read). A body this walk cannot read is taken to use them: the decode judges it."""
    budget = peek.MAX_FIELDS
    walk = peek.walk  # on every call of a node that takes shared memory: no wrapper
    try:
        for _, number, wire, a, b in walk(body, 0, len(body), budget):
            budget -= 1
            if wire != 2:
                continue  # another wire type is an unknown field to the parser, not these
            if number == PREDICT_OUTPUT_MEMORY:
                return True
            # A small input without the tag's byte anywhere in it has no such field: no
            # walk (a scan of a large one's bytes would cost more than its walk).
            small = b - a <= _SCAN_MOST
            if number == PREDICT_INPUTS and not (small and body.find(_SHARED_TAG, a, b) < 0):
                for _, inner, kind, _, _ in walk(body, a, b, budget):
                    budget -= 1
                    if inner == TENSOR_SHARED_MEMORY and kind == 2:
                        return True
    except peek.Malformed:
        return True
    return False


def infer_uses_regions(body: bytes) -> bool:
    """Whether a ModelInferRequest body may name a shared memory region: a region's
    parameter key in one of its tensors, found by one walk of its top-level fields (the raw
    entries stepped over: a scan of a 602 KB body cost 85 us; a typed value that holds those
    bytes only costs its call the cache). A body the walk cannot read is taken to: the decode
    judges it."""
    try:
        for _, number, wire, a, b in peek.walk(body, 0, len(body), peek.MAX_FIELDS):
            if wire == 2 and number in INFER_PLACED and body.find(REGION_KEY, a, b) >= 0:
                return True
    except peek.Malformed:
        return True
    return False
