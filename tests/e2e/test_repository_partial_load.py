"""RepositoryModelLoad on a real server whose repository holds a broken version beside good
ones: the load succeeds when a version of the model serves after it, and says which versions
serve and which were refused (trailers, a log warning, RepositoryIndex with the reason); it
fails, naming each version's reason, only when none serves. Its answer has no fields (KServe's
RepositoryModelLoadResponse is empty), so Triton's client, which reads neither trailers nor
logs, learns of a refused version from the repository index: checked with that client too."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from tests.conftest import scale_model
from tests.e2e.harness import running, server_argv, wait_for
from tests.e2e.test_tritonclient_e2e import tritonclient_python

pytestmark = pytest.mark.e2e

MODEL = "scale"
BROKEN = b"this is not an ONNX file"


def repository(root: Path, versions: dict[int, bytes]) -> Path:
    """A repository of MODEL with these versions, every one of them wanted."""
    folder = root / "repository" / MODEL
    for version, content in versions.items():
        (folder / str(version)).mkdir(parents=True)
        (folder / str(version) / "model.onnx").write_bytes(content)
    (folder / "config.pbtxt").write_text("version_policy: { all: {} }\n")
    return folder.parent


def api(root: Path) -> list[str]:
    return server_argv("--model-repository", str(root), "--repository-api")


def index(stub: kpb_grpc.GRPCInferenceServiceStub) -> dict[str, tuple[str, str]]:
    rows = stub.RepositoryIndex(kpb.RepositoryIndexRequest()).models
    return {m.version: (m.state, m.reason) for m in rows if m.name == MODEL}


def test_a_load_with_a_broken_version_reports_what_loaded_and_what_was_refused(
    tmp_path: Path,
) -> None:
    root = repository(tmp_path, {1: scale_model(1.0), 2: scale_model(2.0), 3: BROKEN})
    with running(api(root)) as proc, grpc.insecure_channel(proc.address) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        response, call = stub.RepositoryModelLoad.with_call(
            kpb.RepositoryModelLoadRequest(model_name=MODEL)
        )
        assert response == kpb.RepositoryModelLoadResponse()
        trailers = dict(call.trailing_metadata() or ())
        assert trailers["x-loaded-versions"] == "1,2"
        assert trailers["x-refused-versions"] == "3"

        rows = index(stub)
        assert rows["1"] == ("READY", "") and rows["2"] == ("READY", "")
        state, reason = rows["3"]
        assert state == "UNAVAILABLE" and "3/model.onnx" in reason
        for version in ("1", "2"):
            assert stub.ModelReady(kpb.ModelReadyRequest(name=MODEL, version=version)).ready
        x = np.ones((1, 4), np.float32)
        answer = stub.ModelInfer(
            kpb.ModelInferRequest(
                model_name=MODEL,
                model_version="2",
                inputs=[
                    kpb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
                ],
                raw_input_contents=[x.tobytes()],
            )
        )
        assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [2.0] * 4

        # The server's log says it too: one warning for the request, naming both sides.
        line = wait_for(
            lambda: next((s for s in proc.lines if "load requested" in s), None),
            "the load's log line",
        )
        assert "WARNING" in line and "versions 1, 2 serve" in line
        assert "version 3 refused" in line and "3/model.onnx" in line


def test_a_load_where_no_version_serves_fails_with_each_versions_reason(tmp_path: Path) -> None:
    root = repository(tmp_path, {1: BROKEN, 2: BROKEN})
    with (
        running(api(root), serving=False) as proc,
        grpc.insecure_channel(proc.address) as channel,
    ):
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            stub.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name=MODEL))
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        message = failed.value.details() or ""
        assert f"model {MODEL!r} has no version to serve" in message
        assert "version 1: " in message and "1/model.onnx" in message
        assert "version 2: " in message and "2/model.onnx" in message
        assert {v: s for v, (s, _) in index(stub).items()} == {
            "1": "UNAVAILABLE",
            "2": "UNAVAILABLE",
        }


# Run in tritonclient's own venv (it pins protobuf<7): load, then read the index, as a user of
# that client would; load_model raises on a failed load.
TRITON_LOAD = """
import json, sys
import tritonclient.grpc as triton
client = triton.InferenceServerClient(url=sys.argv[1])
client.load_model(sys.argv[2])
loaded = client.get_model_repository_index(as_json=True)
client.unload_model(sys.argv[2])  # Triton's client always sends unload_dependents
print(json.dumps([loaded, client.get_model_repository_index(as_json=True)]))
client.close()
"""


def test_tritonclient_loads_finds_the_refused_version_and_unloads(
    tmp_path: Path,
) -> None:
    root = repository(tmp_path, {1: scale_model(1.0), 2: scale_model(2.0), 3: BROKEN})
    python = tritonclient_python()
    with running(api(root)) as proc:
        done = subprocess.run(
            [python, "-c", TRITON_LOAD, proc.address, MODEL],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr  # the load succeeded: versions 1 and 2 serve
    loaded, unloaded = json.loads(done.stdout)
    rows = {m["version"]: m for m in loaded["models"] if m["name"] == MODEL}
    assert {v: m["state"] for v, m in rows.items()} == {
        "1": "READY",
        "2": "READY",
        "3": "UNAVAILABLE",
    }
    assert "3/model.onnx" in rows["3"]["reason"]
    after = [m for m in unloaded["models"] if m["name"] == MODEL and m.get("state") == "READY"]
    assert after == []  # and unload_model unloaded it
