"""A body's routing facts read off the wire (sluice.wire.facts) against protobuf's own parser:
the same model, version, id and rows on any message, the id's span where the parser finds
the id, and a refusal exactly where the parser refuses the top-level framing."""

from __future__ import annotations

import ast
import os
import tracemalloc
from pathlib import Path

import pytest
import xxhash
from google.protobuf.message import DecodeError, Message
from hypothesis import given, settings
from hypothesis import strategies as st

import sluice
from sluice.core.keys import affinity_key
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.v1 import inference_pb2 as pb
from sluice.wire import facts, peek

Infer = kpb.ModelInferRequest
InferInput = kpb.ModelInferRequest.InferInputTensor

texts = st.text(max_size=6)
# Small first dimensions, so that inputs often share one; any int64 beyond them.
dims = st.lists(st.integers(-2, 3) | st.integers(-(2**63), 2**63 - 1), max_size=4)


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


@st.composite
def tensor_bytes(draw: st.DrawFn, kind: type[Message]) -> bytes:
    """A tensor message's bytes: one serialized message, or several run together (what a
    parser merges: their shapes concatenated, the first shape field first), some with the
    shape unpacked."""
    parts = []
    for _ in range(draw(st.integers(1, 2))):
        shape = draw(dims)
        tensor = kind(name=draw(texts), datatype=draw(st.sampled_from(["FP32", "INT64", ""])))
        if draw(st.booleans()):
            tensor.shape.extend(shape)  # type: ignore[attr-defined]
            shape = []
        if kind is pb.Tensor and draw(st.booleans()):
            tensor.raw_data = draw(st.binary(max_size=8))  # type: ignore[attr-defined]
        # Unpacked values (wire type 0), as a parser takes them too.
        unpacked = b"".join(varint(3 << 3) + varint(d) for d in shape)
        parts.append(tensor.SerializeToString() + unpacked)
    return b"".join(parts)


@st.composite
def predicts(draw: st.DrawFn) -> bytes:
    inputs = [field(1, t) for t in draw(st.lists(tensor_bytes(pb.Tensor), max_size=4))]
    rest = pb.PredictRequest(
        outputs=draw(st.lists(texts, max_size=2)),
        typed_outputs=draw(st.booleans()),
        model=draw(texts),
        version=draw(texts),
    ).SerializeToString()
    return _shuffled(draw, [*inputs, rest])


@st.composite
def infers(draw: st.DrawFn) -> bytes:
    inputs = [field(5, t) for t in draw(st.lists(tensor_bytes(InferInput), max_size=3))]
    rest = Infer(
        model_name=draw(texts),
        model_version=draw(texts),
        id=draw(texts),
        outputs=[Infer.InferRequestedOutputTensor(name=n) for n in draw(st.lists(texts))],
        raw_input_contents=draw(st.lists(st.binary(max_size=4), max_size=2)),
    ).SerializeToString()
    return _shuffled(draw, [*inputs, rest])


def _shuffled(draw: st.DrawFn, parts: list[bytes]) -> bytes:
    """The parts in any order: a parser takes fields in any order."""
    return b"".join(draw(st.permutations(parts)))


def parsed_rows(inputs: list[pb.Tensor] | list[InferInput]) -> int | None:
    firsts = {t.shape[0] if len(t.shape) else None for t in inputs}
    return None if len(firsts) != 1 else firsts.pop()


def check(body: bytes, kind: facts.Kind) -> None:
    """read's facts are the parser's, wherever the parser takes the body."""
    got = facts.read(body, kind, rows=True)
    if kind is facts.PREDICT:
        request = pb.PredictRequest.FromString(body)
        parsed = (request.model, request.version, "", parsed_rows(list(request.inputs)))
        assert got.id_span is None
    else:
        infer = Infer.FromString(body)
        parsed = (infer.model_name, infer.model_version, infer.id, parsed_rows(list(infer.inputs)))
        if got.id_span is None:
            assert infer.id == ""
        else:
            start, end = got.id_span
            assert Infer.FromString(body[start:end]).id == infer.id
    assert (got.model, got.version, got.request_id, got.rows) == parsed
    assert facts.read(body, kind).rows is None  # not asked


@settings(max_examples=300, deadline=None)
@given(body=predicts(), more=predicts())
def test_a_predicts_facts_are_the_parsers(body: bytes, more: bytes) -> None:
    check(body, facts.PREDICT)
    check(body + more, facts.PREDICT)  # two messages run together are one, merged


@settings(max_examples=300, deadline=None)
@given(body=infers(), more=infers())
def test_a_model_infers_facts_are_the_parsers(body: bytes, more: bytes) -> None:
    check(body, facts.MODEL_INFER)
    check(body + more, facts.MODEL_INFER)


@settings(max_examples=100, deadline=None)
@given(model=texts, version=texts)
def test_a_metadata_requests_facts_are_the_parsers(model: str, version: str) -> None:
    body = pb.MetadataRequest(model=model, version=version).SerializeToString()
    assert facts.read(body, facts.METADATA, rows=True) == (model, version, "", None, None)


@settings(max_examples=300, deadline=None)
@given(
    case=st.tuples(st.just(facts.PREDICT), predicts())
    | st.tuples(st.just(facts.MODEL_INFER), infers()),
    data=st.data(),
)
def test_a_cut_body_is_refused_exactly_where_the_parser_refuses_it(
    case: tuple[facts.Kind, bytes], data: st.DataObject
) -> None:
    kind, body = case
    cut = body[: data.draw(st.integers(0, len(body)))]
    message = pb.PredictRequest if kind is facts.PREDICT else Infer
    try:
        message.FromString(cut)
    except DecodeError:
        with pytest.raises(peek.Malformed, match=f"not a valid {kind.message}: "):
            facts.read(cut, kind, rows=True)
    else:
        check(cut, kind)


@settings(max_examples=200, deadline=None)
@given(body=infers())
def test_the_key_leaves_the_id_out(body: bytes) -> None:
    request = Infer.FromString(body)
    got = facts.read(body, facts.MODEL_INFER)
    if got.id_span is None:
        assert got.keyed(body) is body
        return
    request.ClearField("id")
    assert Infer.FromString(got.keyed(body)) == request
    # Two messages that differ in their id only have one key.
    other = Infer.FromString(body)
    other.id = got.request_id + "-other"
    again = other.SerializeToString()
    assert facts.read(again, facts.MODEL_INFER).keyed(again) == request.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(body=infers())
def test_the_affinity_key_is_the_digest_of_the_body_less_its_id(body: bytes) -> None:
    """Taken over the two parts around the id in place, it is the key of the joined bytes
    (`keyed`) that the ring placed calls by: no call moves to another server."""
    got = facts.read(body, facts.MODEL_INFER)
    want = xxhash.xxh3_64_intdigest(got.keyed(body))
    assert affinity_key(body, {}, got.id_span) == want


def test_the_affinity_key_of_a_large_body_with_an_id_copies_nothing() -> None:
    """The body less its id was two new blocks (the two slices) and a third (their join)."""
    body = Infer(id="call-1", model_name="m", raw_input_contents=[bytes(602_112)])
    raw = body.SerializeToString()
    span = facts.read(raw, facts.MODEL_INFER).id_span
    assert span is not None
    affinity_key(raw, {}, span)
    tracemalloc.start()
    try:
        affinity_key(raw, {}, span)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4096


def rows(body: bytes) -> int | None:
    return facts.read(body, facts.PREDICT, rows=True).rows


def test_an_input_the_walk_cannot_read_leaves_the_rows_to_the_server() -> None:
    """Bytes inside an input are the parser's to judge: the facts still route the body."""
    body = field(1, b"\x1a\x05\x07") + pb.PredictRequest(model="m").SerializeToString()
    got = facts.read(body, facts.PREDICT, rows=True)
    assert (got.model, got.rows) == ("m", None)
    with pytest.raises(DecodeError):
        pb.PredictRequest.FromString(body)
    # A packed shape longer than MAX_RANK dimensions could take is not read.
    long = field(1, field(3, b"\x08" * (facts.MAX_SHAPE_BYTES + 1)))
    assert rows(long) is None
    assert rows(field(1, field(3, b"\x08" * facts.MAX_SHAPE_BYTES))) == 8


def test_the_id_field_is_the_responses_too() -> None:
    """The server puts the request's id field in front of a cached answer as it is."""
    assert facts.MODEL_INFER.id == kpb.ModelInferResponse.ID_FIELD_NUMBER
    field_ = kpb.ModelInferResponse.DESCRIPTOR.fields_by_name["id"]
    assert field_.type == Infer.DESCRIPTOR.fields_by_name["id"].type


def test_the_last_of_each_field_is_the_one_a_parser_keeps() -> None:
    twice = Infer(id="a", model_name="m").SerializeToString() + (Infer(id="b").SerializeToString())
    assert Infer.FromString(twice).id == "b"
    got = facts.read(twice, facts.MODEL_INFER)
    assert (got.model, got.request_id) == ("m", "b")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\x22\x05ab", "runs past the end"),  # length 5, 2 bytes left
        (b"\x22", "truncated varint"),
        (b"\x80" * 11, "truncated varint"),
        (b"\x00\x01", "field number 0"),
        (b"\x23", "wire type 3"),  # groups are not in these messages
        (b"\x78\x00" * (peek.MAX_FIELDS + 1), "more than"),  # a flood of tiny fields
        (b"\x22\x02\xff\xfe", "not UTF-8"),  # the model
        (b"\x2a\x01\xff", "not UTF-8"),  # the version
    ],
)
def test_malformed_bodies_are_refused(body: bytes, why: str) -> None:
    with pytest.raises(peek.Malformed, match=f"sluice.v1.PredictRequest: .*{why}"):
        facts.read(body, facts.PREDICT, rows=True)


def test_an_id_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(peek.Malformed, match=r"inference\.ModelInferRequest: a string field"):
        facts.read(b"\x1a\x02\xc3\x28", facts.MODEL_INFER)
    assert facts.read(b"\x1a\x02\xc3\x28", facts.PREDICT).model == ""  # not Predict's


# The modules that walk a message's fields by hand: this reader, the tensor codec's and the
# KServe protocol's large-body decoders, the stream messages' framing and shared memory's
# scans (their field numbers from here).
WALKERS = {"facts.py", "codec.py", "peek.py", "kserve.py", "stream.py", "scan.py"}
# Importing either makes a module a body reader, where a bare tuple of small ints is suspect.
WIRE_READERS = {"sluice.wire.facts", "sluice.wire.peek"}


def _fields_of(*messages: type[Message]) -> dict[str, int]:
    """The field names of these messages and of the ones nested in them, with their numbers
    (map entries aside: `key` and `value` would name too much else)."""
    found: dict[str, int] = {}
    descriptors = [m.DESCRIPTOR for m in messages]
    while descriptors:
        descriptor = descriptors.pop()
        if not descriptor.GetOptions().map_entry:
            found.update((f.name, f.number) for f in descriptor.fields)
        descriptors.extend(descriptor.nested_types)
    return found


# The messages read off the wire, and ModelInfer's answer (the id is put in front of it).
FIELDS = _fields_of(
    pb.PredictRequest, pb.PredictResponse, pb.MetadataRequest, Infer, kpb.ModelInferResponse
)
MOST = max(FIELDS.values())  # an int above every one of their numbers is no field number


def _small(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and 0 < node.value <= MOST


def _says_field(name: str) -> bool:
    """A name for a field's number: `number` in it, or a word like `field` or `tag`."""
    name = name.lower()
    return "number" in name or bool({"field", "fields", "tag", "tags"} & set(name.split("_")))


def _names_a_field(name: str) -> bool:
    """A constant's name that says a field, or ends in one of the fields' own names (`_ID`,
    `MODEL_NAME`): a name a value may well have, so only constants are judged by it."""
    name = name.strip("_").lower()
    return _says_field(name) or any(name == f or name.endswith("_" + f) for f in FIELDS)


def _label(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _reads_bodies(tree: ast.Module) -> bool:
    """Whether a module imports a wire reader, or calls peek."""
    taken = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            taken |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            taken |= {a.name for a in node.names}
        elif isinstance(node, ast.Attribute) and _label(node.value) == "peek":
            return True
    return bool(taken & WIRE_READERS)


def _constants(tree: ast.Module) -> list[tuple[int, str, ast.expr]]:
    """Each name the module binds at its top level, with the value it is given (one to one
    where a tuple of names is given a tuple)."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                pairs = list(zip(target.elts, value.elts, strict=False))
            else:
                pairs = [(target, value)]
            found += [(node.lineno, t.id, v) for t, v in pairs if isinstance(t, ast.Name)]
    return found


def _product_sources() -> list[Path]:
    """Every module of the installed package (through its links), generated code aside."""
    found: dict[Path, Path] = {}
    for root, _, files in os.walk(Path(sluice.__file__).parent, followlinks=True):
        for name in files:
            if name.endswith(".py") and "_pb2" not in name:
                path = Path(root, name)
                found.setdefault(path.resolve(), path)
    return sorted(found)


def faults_in(name: str, source: str) -> list[str]:
    """Where a module writes a field number of its own (a generated constant, a comparison or
    match on a field, a constant named for one, a bare tuple of them in a module that reads
    bodies), or walks a body by hand."""
    faults = []
    tree = ast.parse(source)
    reads = _reads_bodies(tree)
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute):
            if node.attr.endswith("_FIELD_NUMBER") and name != "facts.py":
                faults.append(f"{where}: {node.attr} (take it from sluice.wire.facts)")
            walks = isinstance(node.value, ast.Name) and node.value.id == "peek"
            if walks and node.attr in ("fields", "walk", "spans") and name not in WALKERS:
                faults.append(f"{where}: peek.{node.attr} (read a body with facts.read)")
        elif isinstance(node, ast.Compare):
            names = [_label(n) for n in (node.left, *node.comparators)]
            numbers = [
                n.value
                for n in ast.walk(node)
                if isinstance(n, ast.Constant) and type(n.value) is int and n.value > 0
            ]
            if any(_says_field(n) for n in names) and numbers:
                faults.append(f"{where}: a field number compared with {numbers}")
        elif isinstance(node, ast.Match) and _says_field(_label(node.subject)):
            if any(_small(p.value) for p in ast.walk(node) if isinstance(p, ast.MatchValue)):
                faults.append(f"{where}: a field number matched")
        elif isinstance(node, ast.Tuple | ast.Set | ast.List) and reads and name not in WALKERS:
            # Ints alone, one a field's number at least: a route table's numbers.
            values = [i.value if isinstance(i, ast.Constant) else None for i in node.elts]
            ints = len(values) > 1 and all(type(v) is int for v in values)
            if ints and any(map(_small, node.elts)):
                faults.append(f"{where}: field numbers {ast.unparse(node)}")
    if name not in WALKERS:
        for line, constant, value in _constants(tree):
            if _names_a_field(constant) and any(map(_small, ast.walk(value))):
                faults.append(f"{name}:{line}: {constant} holds a field number")
    return faults


def test_the_check_finds_field_numbers_written_by_hand() -> None:
    """What the three route reads and fan-out held before this module."""
    assert faults_in("v1.py", "found = peek.spans(body, (4, 5))")
    assert faults_in("codec.py", "if number in (4, 5):\n    pass")
    assert faults_in("fanout.py", "if field_number == 3:\n    pass")
    assert faults_in("kserve.py", "x = kpb.ModelInferRequest.ID_FIELD_NUMBER")
    assert not faults_in("peek.py", "if number == 0:\n    pass")  # no field has number 0
    assert not faults_in("codec.py", "if number == facts.TENSOR_NAME:\n    pass")
    # What the second restructure found written by hand: the balancer's route table, the
    # KServe read's constants, fan-out's test of a field.
    assert faults_in("service.py", 'ROUTE_FIELDS = {"": ((4, 5, 0), "x")}')
    assert faults_in("plane.py", "_NAME, _VERSION, _ID = 1, 2, 3")
    assert faults_in("fanout.py", "if field == 3: pass")
    assert faults_in("fanout.py", "match tag:\n    case 3:\n        pass")
    assert faults_in("v1.py", "from sluice.wire import facts\nwanted = (4, 5)")
    assert not faults_in("top.py", "widths = (0, 4)")  # a module that reads no body
    assert not faults_in("v1.py", "from sluice.wire import facts\nWORKERS = 4")


def test_no_field_number_of_the_request_messages_is_written_outside_this_module() -> None:
    sources = _product_sources()
    assert any(p.name == "fanout.py" for p in sources)  # the links are followed
    faults = [f for p in sources for f in faults_in(p.name, p.read_text())]
    assert faults == []
