"""Triton's config.pbtxt read into the repository's Config: a realistic Triton config parses
(unknown fields skipped), the honored fields map, the rest is logged as ignored, and what
Sluice cannot serve is refused with the file named."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sluice.core.errors import LoadFailed
from sluice.server.dataplane.modelsettings import Config, VersionPolicy
from sluice.server.modelconfig import parse, read_config
from sluice.v1 import model_config_pb2 as pb

# As Triton's docs and model zoos write them: repeated messages as `name [ {...} ]`, fields
# Sluice does not declare (optimization, model_warmup, response_cache, rate_limiter), comments.
TRITON = """
# The classifier, as Triton serves it.
name: "resnet"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest: { num_versions: 2 } }
input [
  {
    name: "input"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape: { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "probabilities"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "labels.txt"
  }
]
instance_group [
  { count: 2, kind: KIND_CPU },
  { count: 1, kind: KIND_CPU, rate_limiter { resources [ { name: "R1" count: 4 } ] } }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
}
parameters { key: "note" value: { string_value: "a [ b ] # not a comment" } }
optimization { execution_accelerators {
  cpu_execution_accelerator [ { name: "openvino" } ]
  gpu_execution_accelerator : [ { name : "tensorrt"
    parameters { key: "precision_mode" value: "FP16" } } ]
} }
model_warmup [
  {
    name: "zeros"
    batch_size: 1
    inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
  }
]
response_cache { enable: true }
default_model_filename: "resnet.onnx"
"""


def write(tmp_path: Path, text: str, model: str = "resnet") -> Path:
    path = tmp_path / model / "config.pbtxt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_realistic_triton_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sluice.modelconfig")
    config = read_config(write(tmp_path, TRITON))
    assert config == Config(
        max_batch=8,
        instances=3,
        batch_budget_s=100e-6,
        device="cpu",
        policy=VersionPolicy("latest", latest=2),
        default_model_filename="resnet.onnx",
    )
    assert "ignores input/output" in caplog.text and "parameters" in caplog.text
    assert "preferred_batch_size" in caplog.text
    assert "does not know: optimization, model_warmup, response_cache" in caplog.text


def test_known_fields_keep_their_values() -> None:
    message = parse(TRITON)
    assert [i.name for i in message.input] == ["input"]
    assert list(message.input[0].dims) == [3, 224, 224]
    assert message.input[0].data_type == pb.TYPE_FP32
    assert message.input[0].format == pb.ModelInput.FORMAT_NCHW
    assert message.output[0].label_filename == "labels.txt"
    # The colon added before `[` leaves strings alone.
    assert message.parameters["note"].string_value == "a [ b ] # not a comment"


def test_an_absent_file_gives_the_defaults(tmp_path: Path) -> None:
    assert read_config(tmp_path / "m" / "config.pbtxt") == Config()


def test_no_batching_no_dynamic_batching(tmp_path: Path) -> None:
    config = read_config(write(tmp_path, 'name: "resnet"\nbackend: "onnxruntime"\n'))
    assert config.max_batch == 1  # Triton's max_batch_size 0: no batching
    assert config.batch_budget_s is None  # the server's budget
    assert config.instances is None and config.device is None
    assert config.policy == VersionPolicy()  # Triton's default: the latest 1


def test_a_zero_queue_delay_keeps_the_servers_budget(tmp_path: Path) -> None:
    config = read_config(write(tmp_path, "max_batch_size: 4 dynamic_batching { }"))
    assert config.max_batch == 4 and config.batch_budget_s is None


def test_gpu_instance_groups_leave_the_device_to_the_server(tmp_path: Path) -> None:
    config = read_config(write(tmp_path, "instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]"))
    assert config.instances == 1  # Triton's count defaults to 1
    assert config.device is None


@pytest.mark.parametrize(
    ("groups", "instances", "device"),
    [
        ("{ count: 2 }", 2, None),  # Triton's default kind, KIND_AUTO: the server's device
        ("{ count: 2 kind: KIND_AUTO }, { }", 3, None),
        ("{ count: 2 kind: KIND_CPU }", 2, "cpu"),
    ],
)
def test_instance_groups_sluice_honours_are_not_said_to_be_ignored(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    groups: str,
    instances: int,
    device: str | None,
) -> None:
    with caplog.at_level(logging.INFO, "sluice.modelconfig"):
        config = read_config(write(tmp_path, f"instance_group [ {groups} ]"))
    assert (config.instances, config.device) == (instances, device)
    assert "instance_group" not in caplog.text


@pytest.mark.parametrize(
    "groups",
    [
        "{ kind: KIND_GPU }",
        "{ kind: KIND_MODEL }",
        "{ count: 2 gpus: [ 0, 1 ] }",  # KIND_AUTO, but on these GPUs
        "{ kind: KIND_CPU gpus: [ 0 ] }",
        "{ kind: KIND_CPU }, { kind: KIND_AUTO }",  # some on the CPU, some on the server's device
    ],
)
def test_instance_group_kinds_and_gpus_sluice_does_not_honour_are_said_to_be_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, groups: str
) -> None:
    with caplog.at_level(logging.INFO, "sluice.modelconfig"):
        config = read_config(write(tmp_path, f"instance_group [ {groups} ]"))
    assert config.device is None
    assert "Sluice ignores instance_group kind/gpus" in caplog.text


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("version_policy: { all: {} }", VersionPolicy("all")),
        (
            "version_policy { specific { versions: [ 1, 3 ] } }",
            VersionPolicy("specific", 1, (1, 3)),
        ),
        ("version_policy { latest { num_versions: 3 } }", VersionPolicy("latest", 3)),
    ],
)
def test_version_policies(tmp_path: Path, text: str, policy: VersionPolicy) -> None:
    assert read_config(write(tmp_path, text)).policy == policy


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("max_batch_size: {{ nonsense", "does not parse"),
        ("max_batch_size: 4 max_batch_size: 5", "does not parse"),
        ('platform: "tensorrt_plan"', "ONNX models only"),
        ('backend: "python"', "ONNX models only"),
        ('name: "other"', "its directory is 'resnet'"),
        ("max_batch_size: -1", "negative"),
        ("version_policy { specific { } }", "positive versions"),
        ('default_model_filename: "../x.onnx"', "not a file name"),
    ],
)
def test_what_is_refused(tmp_path: Path, text: str, why: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(LoadFailed, match=why) as caught:
        read_config(path)
    assert str(path) in str(caught.value)


# Triton's own numbers (model_config.proto): a real config's binary form must mean the same.
TRITON_FIELDS = {
    "ModelConfig": {
        "name": 1,
        "platform": 2,
        "backend": 17,
        "version_policy": 3,
        "max_batch_size": 4,
        "input": 5,
        "output": 6,
        "instance_group": 7,
        "default_model_filename": 8,
        "dynamic_batching": 11,
        "parameters": 14,
    },
    "ModelInput": {
        "name": 1,
        "data_type": 2,
        "format": 3,
        "dims": 4,
        "reshape": 5,
        "is_shape_tensor": 6,
        "allow_ragged_batch": 7,
        "optional": 8,
    },
    "ModelOutput": {
        "name": 1,
        "data_type": 2,
        "dims": 3,
        "reshape": 5,
        "label_filename": 4,
        "is_shape_tensor": 6,
    },
    "ModelInstanceGroup": {"name": 1, "kind": 4, "count": 2, "gpus": 3},
    "ModelDynamicBatching": {
        "preferred_batch_size": 1,
        "max_queue_delay_microseconds": 2,
        "preserve_ordering": 3,
    },
    "ModelVersionPolicy": {"latest": 1, "all": 2, "specific": 3},
}


def test_field_numbers_are_tritons() -> None:
    for message, fields in TRITON_FIELDS.items():
        descriptor = getattr(pb, message).DESCRIPTOR
        assert {f.name: f.number for f in descriptor.fields} == fields, message
    assert pb.DataType.Value("TYPE_FP32") == 11
    assert pb.DataType.Value("TYPE_BF16") == 14
    assert pb.ModelInstanceGroup.Kind.Value("KIND_MODEL") == 3
