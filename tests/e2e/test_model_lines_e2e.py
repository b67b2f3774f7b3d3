"""What a real server says about what it serves: its start line gives each model's settings in
force (a config's max_batch_size, not the --max-batch default), and once a model is unloaded
a call hears that it is not loaded and why, not that no model is served "yet"."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import scale_model
from tests.e2e.harness import running, server_argv

pytestmark = pytest.mark.e2e


def test_the_start_line_and_the_after_unload_answer_say_what_is_in_force(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    (root / "scale" / "1").mkdir(parents=True)
    (root / "scale" / "1" / "model.onnx").write_bytes(scale_model(1.0))
    (root / "scale" / "config.pbtxt").write_text("max_batch_size: 8\n")
    argv = server_argv("--model-repository", str(root), "--repository-api")
    with running(argv) as proc, grpc.insecure_channel(proc.address) as channel:
        line = next(s for s in proc.lines if "listening on" in s)
        # One parenthesis: the model's settings, with the node's cache among them.
        assert (
            "node test-node serving scale 1 on CPUExecutionProvider "
            "(max batch 8, 1 instance, cache 10000 entries), listening on 127.0.0.1:"
        ) in line
        assert "max batch 1" not in line

        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="scale"))
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as unnamed:
            stub.Metadata(pb.MetadataRequest())
        assert unnamed.value.code() == grpc.StatusCode.NOT_FOUND
        assert unnamed.value.details() == (
            "this node serves no model: 'scale' is not loaded (unloaded on request)"
        )
        with pytest.raises(grpc.RpcError) as named:
            stub.Metadata(pb.MetadataRequest(model="scale", version="1"))
        assert named.value.details() == (
            "model 'scale' version '1' is not loaded (unloaded on request); this node serves none"
        )


def test_the_start_line_of_a_node_with_several_models_names_its_cache_once(
    tmp_path: Path,
) -> None:
    root = tmp_path / "repository"
    for name, config in (("one", "max_batch_size: 8\n"), ("two", "")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.onnx").write_bytes(scale_model(1.0))
        (root / name / "config.pbtxt").write_text(config)
    argv = server_argv("--model-repository", str(root), "--cache-entries", "64")
    with running(argv) as proc:
        line = next(s for s in proc.lines if "listening on" in s)
    assert (
        "node test-node serving one 1 on CPUExecutionProvider (max batch 8, 1 instance), "
        "two 1 on CPUExecutionProvider (max batch 1, 1 instance); cache 64 entries, "
        "listening on 127.0.0.1:"
    ) in line
