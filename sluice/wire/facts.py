"""What a request body says about where it goes, read off the wire in one pass over its
top-level fields (sluice.wire.peek), nothing decoded: the model and version it names, its
per-call id (KServe's `id`) and where that sits, and, when asked, the first dimension its
inputs share (the rows fan-out splits on). The balancer routes on these facts, the server
keys its cache on them, fan-out splits on them.

The field numbers of the request messages, and of the stream messages that carry them
(sluice.wire.stream frames and reads those), live here and in the generated code only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.v1 import inference_pb2 as pb
from sluice.wire import peek

# sluice.v1.Tensor's fields (codec.decode_predict reads them too).
TENSOR_NAME = pb.Tensor.NAME_FIELD_NUMBER
TENSOR_DATATYPE = pb.Tensor.DATATYPE_FIELD_NUMBER
TENSOR_SHAPE = pb.Tensor.SHAPE_FIELD_NUMBER
TENSOR_RAW_DATA = pb.Tensor.RAW_DATA_FIELD_NUMBER
TENSOR_SHARED_MEMORY = pb.Tensor.SHARED_MEMORY_FIELD_NUMBER
TENSOR_TYPED = frozenset(
    {
        pb.Tensor.BOOL_DATA_FIELD_NUMBER,
        pb.Tensor.INT_DATA_FIELD_NUMBER,
        pb.Tensor.INT64_DATA_FIELD_NUMBER,
        pb.Tensor.UINT_DATA_FIELD_NUMBER,
        pb.Tensor.UINT64_DATA_FIELD_NUMBER,
        pb.Tensor.FP32_DATA_FIELD_NUMBER,
        pb.Tensor.FP64_DATA_FIELD_NUMBER,
    }
)
# sluice.v1.PredictRequest's.
PREDICT_INPUTS = pb.PredictRequest.INPUTS_FIELD_NUMBER
PREDICT_OUTPUTS = pb.PredictRequest.OUTPUTS_FIELD_NUMBER
PREDICT_TYPED_OUTPUTS = pb.PredictRequest.TYPED_OUTPUTS_FIELD_NUMBER
PREDICT_MODEL = pb.PredictRequest.MODEL_FIELD_NUMBER
PREDICT_VERSION = pb.PredictRequest.VERSION_FIELD_NUMBER
PREDICT_OUTPUT_MEMORY = pb.PredictRequest.OUTPUT_MEMORY_FIELD_NUMBER
# sluice.v1.SharedMemoryRef's (a reply's, written by hand: sluice.wire.codec).
MEMORY_REGION = pb.SharedMemoryRef.REGION_FIELD_NUMBER
MEMORY_OFFSET = pb.SharedMemoryRef.OFFSET_FIELD_NUMBER
MEMORY_BYTE_SIZE = pb.SharedMemoryRef.BYTE_SIZE_FIELD_NUMBER

# sluice.v1.PredictResponse's (a reply written by hand: sluice.wire.codec).
RESPONSE_MODEL = pb.PredictResponse.MODEL_FIELD_NUMBER
RESPONSE_OUTPUTS = pb.PredictResponse.OUTPUTS_FIELD_NUMBER
RESPONSE_VERSION = pb.PredictResponse.VERSION_FIELD_NUMBER
# sluice.v1.StreamRequest's and StreamResponse's, and their maps' entries'.
_Request, _Response = pb.StreamRequest, pb.StreamResponse
STREAM_REQUEST_ID = _Request.ID_FIELD_NUMBER
STREAM_REQUEST_BODY = _Request.REQUEST_FIELD_NUMBER
STREAM_REQUEST_TIMEOUT = _Request.TIMEOUT_S_FIELD_NUMBER
STREAM_REQUEST_METADATA = _Request.METADATA_FIELD_NUMBER
STREAM_REQUEST_METHOD = _Request.METHOD_FIELD_NUMBER
STREAM_RESPONSE_ID = _Response.ID_FIELD_NUMBER
STREAM_RESPONSE_CODE = _Response.CODE_FIELD_NUMBER
STREAM_RESPONSE_MESSAGE = _Response.MESSAGE_FIELD_NUMBER
STREAM_RESPONSE_BODY = _Response.RESPONSE_FIELD_NUMBER
STREAM_RESPONSE_TRAILERS = _Response.TRAILERS_FIELD_NUMBER
STREAM_RESPONSE_RETRYABLE = _Response.RETRYABLE_FIELD_NUMBER
ENTRY_KEY = _Request.MetadataEntry.KEY_FIELD_NUMBER
ENTRY_VALUE = _Request.MetadataEntry.VALUE_FIELD_NUMBER

MAX_RANK = 64  # a tensor's most dimensions: numpy's own limit (NPY_MAXDIMS)
# A packed shape of MAX_RANK dimensions takes at most 10 bytes each.
MAX_SHAPE_BYTES = 10 * MAX_RANK


@dataclass(frozen=True, slots=True)
class Kind:
    """A request message `read` takes: its full name (for messages) and the numbers of the
    fields that hold the facts (0: it has none)."""

    message: str
    model: int  # a string
    version: int  # a string
    id: int = 0  # a string that changes no answer: left out of the cache and affinity keys
    inputs: int = 0  # repeated tensor messages ...
    shape: int = 0  # ... whose repeated int64 shape starts with their rows


PREDICT = Kind(
    pb.PredictRequest.DESCRIPTOR.full_name,
    PREDICT_MODEL,
    PREDICT_VERSION,
    inputs=PREDICT_INPUTS,
    shape=TENSOR_SHAPE,
)
_Infer = kpb.ModelInferRequest
MODEL_INFER = Kind(
    _Infer.DESCRIPTOR.full_name,
    _Infer.MODEL_NAME_FIELD_NUMBER,
    _Infer.MODEL_VERSION_FIELD_NUMBER,
    _Infer.ID_FIELD_NUMBER,
    _Infer.INPUTS_FIELD_NUMBER,
    _Infer.InferInputTensor.SHAPE_FIELD_NUMBER,
)
# KServe v2's raw tensor bytes, read and written by hand (sluice.server.kserve).
INFER_RAW_INPUTS = _Infer.RAW_INPUT_CONTENTS_FIELD_NUMBER
# The request's tensors, whose parameters may place them in shared memory (sluice.shm.scan).
INFER_PLACED = frozenset({_Infer.INPUTS_FIELD_NUMBER, _Infer.OUTPUTS_FIELD_NUMBER})
INFER_RESPONSE_RAW_OUTPUTS = kpb.ModelInferResponse.RAW_OUTPUT_CONTENTS_FIELD_NUMBER
METADATA = Kind(
    pb.MetadataRequest.DESCRIPTOR.full_name,
    pb.MetadataRequest.MODEL_FIELD_NUMBER,
    pb.MetadataRequest.VERSION_FIELD_NUMBER,
)


class Facts(NamedTuple):
    """What one body says about its routing (a tuple: made on every call, it must be cheap)."""

    model: str  # empty: the default model
    version: str  # empty: its newest ready version
    # KServe's `id` ('' where the message has none). Read for its UTF-8 check, which the
    # parser makes too: the balancer and the server's route (KServeV2.route) both refuse a
    # bad id by it. Neither uses the value: the answer takes the id's bytes by its span.
    request_id: str
    # The id field, its tag to its value's end (None: absent): left out of the cache and
    # affinity keys, and put in front of the answer.
    id_span: tuple[int, int] | None
    # With `rows`: the first dimension every input shares; None when not asked, or when
    # there is none to split on (no inputs, a scalar, dimensions that differ, an input the
    # walk cannot read: the server judges it).
    rows: int | None

    def keyed(self, body: bytes) -> bytes:
        """The body less its id field: what cache and affinity keys are taken of (the
        balancer's over views of its two parts in place, keys.affinity_key's `cut`)."""
        span = self.id_span
        return body if span is None else body[: span[0]] + body[span[1] :]


def read(body: bytes, kind: Kind, rows: bool = False) -> Facts:
    """The facts a `kind` message's body holds, in one walk of its top-level fields (the
    last occurrence of each, as a parser keeps; `rows`: the inputs' first dimension too).
    Raises peek.Malformed, its message naming the message, on top-level bytes no parser
    would take or a string fact that is not UTF-8; what lies inside the inputs is left to
    the parser (rows None)."""
    # Read on every call by both programs: the kind's numbers in locals, no call per field.
    model_field, version_field, id_field = kind.model, kind.version, kind.id
    inputs_field = kind.inputs if rows else -1
    model = version = call_id = b""
    span = None
    found: int | None = None
    # One budget of fields for the whole walk, inputs' fields included, as the server's
    # own wire reader keeps (codec.decode_predict).
    budget = peek.MAX_FIELDS
    try:
        for tag, number, wire, a, b in peek.walk(body, 0, len(body), peek.MAX_FIELDS):
            budget -= 1
            if wire != 2:
                continue
            if number == model_field:
                model = body[a:b]
            elif number == version_field:
                version = body[a:b]
            elif number == id_field:
                call_id, span = body[a:b], (tag, b)
            elif number == inputs_field:
                first, budget = _first(body, a, b, kind.shape, budget)
                if first is None or (found is not None and first != found):
                    inputs_field, found = -1, None  # nothing to split on
                else:
                    found = first
        # UTF-8 is judged on the occurrence a parser keeps (the last).
        strings = (
            model.decode() if model else "",
            version.decode() if version else "",
            call_id.decode() if call_id else "",
        )
    except peek.Malformed as exc:
        raise peek.Malformed(f"request body is not a valid {kind.message}: {exc}") from None
    except UnicodeDecodeError:
        raise peek.Malformed(
            f"request body is not a valid {kind.message}: a string field is not UTF-8"
        ) from None
    return _new(Facts, (*strings, span, found))


# Facts made by the tuple's own constructor: NamedTuple's, which takes keywords, costs twice
# as much (0.3 us), on every call.
_new = tuple.__new__


def _first(body: bytes, start: int, end: int, shape: int, budget: int) -> tuple[int | None, int]:
    """The first dimension of the tensor message in body[start:end] (the first value of its
    first `shape` field), or None; and the budget left."""
    try:
        for number, wire, a, b in peek.fields(body, start, end, budget):
            budget -= 1
            if number != shape:
                continue
            if wire == 0:
                return peek.int64(a), budget
            if wire != 2 or not a < b <= a + MAX_SHAPE_BYTES:
                return None, budget  # no dimension, or surely over the rank limit
            return peek.varints(body, a, b)[0], budget
    except peek.Malformed:
        pass
    return None, budget
