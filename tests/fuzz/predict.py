"""Fuzz target: the large-body decoder (codec.decode_predict) against protobuf's parser and
codec.decode_all, the path the server takes below WIRE_READ_FROM or when the wire reader
steps aside.

Agreement: decode_predict may decline (None), and then the parser decides; when it answers,
both refuse with the same TensorError message, or both accept with the same inputs (in
order: name, dtype, shape and bytes), outputs and typed_outputs. An answer where the parser
raises DecodeError is a disagreement. Any other exception is a crash.

    python -m tests.fuzz.predict -runs=1000000 -seed=1 [CORPUS_DIR]
"""

from __future__ import annotations

import sys
from collections import Counter

import atheris  # type: ignore[import-untyped]  # no stubs

with atheris.instrument_imports(include=["sluice.wire"]):
    import numpy as np
    from google.protobuf.message import DecodeError

    from sluice.v1 import inference_pb2 as pb
    from sluice.wire import codec
    from tests.fuzz import corpus, harness

Outcome = tuple[object, ...]
seen: Counter[str] = Counter()
REPORT_EVERY = 250_000


class Disagreement(AssertionError):
    """The wire reader and the parser read one body differently."""


def _read(got: tuple[dict[str, np.ndarray], list[str], bool]) -> Outcome:
    arrays, outputs, typed = got
    tensors = [(name, a.dtype.str, a.shape, a.tobytes()) for name, a in arrays.items()]
    return ("accepted", tensors, list(outputs), bool(typed))


def parser(body: bytes) -> Outcome:
    """What the server's fallback makes of the body."""
    try:
        request = pb.PredictRequest.FromString(body)
    except DecodeError:
        return ("refused", "not a PredictRequest")
    try:
        arrays = codec.decode_all(request.inputs)
    except codec.TensorError as exc:
        return ("refused", str(exc))
    return _read((arrays, list(request.outputs), request.typed_outputs))


def wire(body: bytes) -> Outcome | None:
    """What decode_predict makes of it; None where it declines."""
    try:
        got = codec.decode_predict(body)
    except codec.TensorError as exc:
        return ("refused", str(exc))
    return None if got is None else _read(got)


def check(body: bytes) -> None:
    expected = parser(body)
    got = wire(body)
    seen["declined" if got is None else f"answered, {got[0]}"] += 1
    seen[f"parser {expected[0]}"] += 1
    if sum(seen.values()) % (2 * REPORT_EVERY) == 0:
        print(f"#{sum(seen.values()) // 2} {dict(seen)}", file=sys.stderr, flush=True)
    if got is not None and got != expected:
        raise Disagreement(f"body {body!r}: the wire reader gives {got!r}, the parser {expected!r}")


if __name__ == "__main__":
    harness.main("predict", check, corpus.predict)
