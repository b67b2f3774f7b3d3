"""Oracle messages for the route reads: protobuf's parser on a message that declares only the
fields a route read looks at, as proto2 `optional bytes` (presence, the last occurrence kept,
no UTF-8 check), every other field left unknown. Its verdict is the parser's on the body's
top level alone, which is what a route read judges."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

_F = descriptor_pb2.FieldDescriptorProto


def _build() -> dict[str, type[Message]]:
    file = descriptor_pb2.FileDescriptorProto(
        name="sluice_fuzz/skeleton.proto", package="sluice_fuzz", syntax="proto2"
    )
    layouts = {
        # sluice.v1.PredictRequest's model and version
        "Predict": [("model", 4), ("version", 5)],
        # inference.ModelInferRequest's model_name, model_version and id
        "ModelInfer": [("model", 1), ("version", 2), ("id", 3)],
        # sluice.v1.MetadataRequest's model and version
        "Metadata": [("model", 1), ("version", 2)],
        # No field: every field unknown, one entry each (as sent, however encoded)
        "Empty": [],
    }
    for name, fields in layouts.items():
        message = file.message_type.add(name=name)
        for field, number in fields:
            message.field.add(
                name=field, number=number, type=_F.TYPE_BYTES, label=_F.LABEL_OPTIONAL
            )
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(file.SerializeToString())
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"sluice_fuzz.{name}"))
        for name in layouts
    }


_CLASSES = _build()
Predict = _CLASSES["Predict"]
ModelInfer = _CLASSES["ModelInfer"]
Metadata = _CLASSES["Metadata"]
Empty = _CLASSES["Empty"]
