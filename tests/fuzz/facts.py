"""Fuzz target: the routing read (sluice.wire.facts.read: model, version, KServe id and its
span, the rows fan-out splits on) against protobuf's parser on the same bytes, for each kind
of body it reads: sluice.v1 PredictRequest and MetadataRequest, KServe ModelInferRequest.

The oracle for model, version and id is protobuf's parser on a message declaring only those
fields (tests/fuzz/skeleton.py): the read judges a body's top level and leaves its inputs to
the server's full parse. Agreement:
- the parser takes the body: the read gives the same strings (the last occurrence of each),
  the id's span is exactly the last `id` field (its tag to its value's end) and `keyed`
  leaves just that out;
- the parser refuses it, or a kept string is not UTF-8: the read raises peek.Malformed;
- narrower, on purpose: the read also refuses a top-level group (wire type 3, in no proto3
  message; protobuf skips it as an unknown field) and more than peek.MAX_FIELDS top-level
  fields (a bound on a Python walk); a refusal for any other reason, where the parser takes
  the body, is a disagreement;
- wider, on purpose: UTF-8 is checked on the occurrence kept, where protobuf checks every
  occurrence of a string field; the server's full parse refuses a body with an earlier one.
Rows: where protobuf takes the whole message, an answer n means it has inputs and every
input's shape starts with n; None (nothing to split on) is always allowed: the balancer then
forwards the body whole. `rows=False` reads the same facts, rows None. The server's route
reads (SluiceV1.route, KServeV2.route) give the same facts, and InvalidInput exactly where
the read raises. Anything else raised is a crash.

    python -m tests.fuzz.facts -runs=1000000 -seed=1 [CORPUS_DIR]
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable

import atheris  # type: ignore[import-untyped]  # no stubs

with atheris.instrument_imports(
    include=["sluice.wire", "sluice.server.v1", "sluice.server.kserve"]
):
    from google.protobuf.message import DecodeError, Message
    from google.protobuf.unknown_fields import UnknownFieldSet

    from sluice.core.errors import InvalidInput
    from sluice.kserve import grpc_predict_v2_pb2 as kpb
    from sluice.server.dataplane.plane import Asked
    from sluice.server.kserve import KServeV2
    from sluice.server.v1 import SluiceV1
    from sluice.v1 import inference_pb2 as pb
    from sluice.wire import facts, peek
    from tests.fuzz import corpus, harness, skeleton

Outcome = tuple[object, ...]
seen: Counter[str] = Counter()
REPORT_EVERY = 250_000
# The read's refusals narrower than the parser's, on purpose.
NARROWER = ("wire type 3", f"more than {peek.MAX_FIELDS} fields")
Route = Callable[[bytes], Asked]
# Each kind, its oracle, the full message whose inputs `rows` reads and the server's route.
KINDS: list[tuple[str, facts.Kind, type[Message], type[Message] | None, Route | None]] = [
    ("Predict", facts.PREDICT, skeleton.Predict, pb.PredictRequest, SluiceV1().route),
    ("ModelInfer", facts.MODEL_INFER, skeleton.ModelInfer, kpb.ModelInferRequest, KServeV2().route),
    ("Metadata", facts.METADATA, skeleton.Metadata, None, None),
]


class Disagreement(AssertionError):
    """The routing read and the parser read one body differently."""


def parser(body: bytes, oracle: type[Message]) -> Outcome:
    """The strings the parser keeps (model, version, id), or a refusal."""
    try:
        message = oracle.FromString(body)
    except DecodeError:
        return ("refused",)
    names = [f.name for f in message.DESCRIPTOR.fields]
    try:
        found = {name: getattr(message, name).decode() for name in names}
    except UnicodeDecodeError:
        return ("refused",)
    return ("accepted", found["model"], found["version"], found.get("id", ""))


def check_kind(
    label: str,
    body: bytes,
    kind: facts.Kind,
    oracle: type[Message],
    full: type[Message] | None,
    route: Route | None,
) -> None:
    expected = parser(body, oracle)
    try:
        read = facts.read(body, kind, rows=True)
    except peek.Malformed as exc:
        if expected[0] == "accepted" and not any(r in str(exc) for r in NARROWER):
            fail(label, body, f"refuses it ({exc})", expected)
        seen[f"{label}: refused" + (", narrower" if expected[0] == "accepted" else "")] += 1
        _route(label, body, route, None)
        return
    _route(label, body, route, read)
    got = ("accepted", read.model, read.version, read.request_id)
    if got != expected:
        fail(label, body, f"gives {got!r}", expected)
    if facts.read(body, kind) != read._replace(rows=None):
        fail(label, body, "reads other facts with rows=False", expected)
    _id_span(label, body, oracle, kind.id, read)
    _rows(label, body, full, read.rows)
    seen[f"{label}: accepted"] += 1


def _route(label: str, body: bytes, route: Route | None, read: facts.Facts | None) -> None:
    """The server's route read: the same facts, or InvalidInput where the read refuses."""
    if route is None:
        return
    try:
        asked = route(body)
    except InvalidInput as exc:
        if read is not None:
            fail(label, body, f"is refused by the server's route ({exc})", read)
        return
    if read is None or asked != Asked(read.model, read.version, read.id_span):
        fail(label, body, f"routes as {asked!r} on the server", read)


def _id_span(
    label: str, body: bytes, oracle: type[Message], kind_id: int, read: facts.Facts
) -> None:
    """The span must be exactly the last `id` field, and `keyed` the body without it."""
    span = read.id_span
    has_id = "id" in oracle.DESCRIPTOR.fields_by_name
    if span is None:
        if has_id and oracle.FromString(body).HasField("id"):
            fail(label, body, "finds no id field", "one")
        if read.keyed(body) != body:
            fail(label, body, f"keys {read.keyed(body)!r}", "the whole body")
        return
    start, end = span
    if not has_id:
        fail(label, body, f"finds an id span {span}", "none: the message has no id")
    try:
        # One field, whatever its encoding (a padded tag or length is still one field) ...
        fields = UnknownFieldSet(skeleton.Empty.FromString(body[start:end]))
        alone = [(fields[i].field_number, fields[i].wire_type) for i in range(len(fields))]
        # ... the id, starting where a field starts, and the last one.
        oracle.FromString(body[:start])
        last = not oracle.FromString(body[end:]).HasField("id")
        value = getattr(oracle.FromString(body[start:end]), "id")  # noqa: B009
    except DecodeError:
        alone, last, value = [], False, None
    kept = getattr(oracle.FromString(body), "id")  # noqa: B009
    if not (alone == [(kind_id, 2)] and last and value == kept):
        fail(label, body, f"gives the span {span}", "the last id field's")
    if read.keyed(body) != body[:start] + body[end:]:
        fail(label, body, f"keys {read.keyed(body)!r}", "the body less its id field")


def _rows(label: str, body: bytes, full: type[Message] | None, rows: int | None) -> None:
    if rows is None:
        seen[f"{label}: rows none"] += 1
        return
    if full is None:
        fail(label, body, f"reads {rows} rows", "none: the message has no inputs")
        return
    try:
        message = full.FromString(body)
    except DecodeError:
        seen[f"{label}: rows, parser refuses"] += 1  # fan-out parses it before it splits
        return
    firsts = {tensor.shape[0] if tensor.shape else None for tensor in message.inputs}  # type: ignore[attr-defined]
    if firsts != {rows}:
        fail(label, body, f"reads {rows} rows", f"first dimensions {firsts}")
    seen[f"{label}: rows answered"] += 1


def fail(label: str, body: bytes, got: str, expected: object) -> None:
    raise Disagreement(f"facts.read({label}) of {body!r} {got}; the parser: {expected!r}")


def check(body: bytes) -> None:
    for label, kind, oracle, full, route in KINDS:
        check_kind(label, body, kind, oracle, full, route)
    seen["inputs"] += 1
    if seen["inputs"] % REPORT_EVERY == 0:
        print(f"#{seen['inputs']} {dict(seen)}", file=sys.stderr, flush=True)


def seeds() -> list[bytes]:
    return [*corpus.predict(), *corpus.model_infer(), *corpus.metadata()]


if __name__ == "__main__":
    harness.main("facts", check, seeds)
