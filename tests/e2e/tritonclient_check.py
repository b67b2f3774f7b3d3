"""Triton's own client against a Sluice address: run INSIDE a venv that holds
`tritonclient[grpc]` (it pins protobuf<7; Sluice's venv has protobuf 7), so only the standard
library, numpy and tritonclient here. Prints one JSON object for the test to judge.

    python tritonclient_check.py HOST:PORT MODEL INPUT.npy

The input goes in as raw bytes (as tritonclient always sends it over gRPC); the same script
runs against a server or a balancer."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException


def failure(call: Any) -> dict[str, str]:
    """The status and message a call fails with."""
    try:
        call()
    except InferenceServerException as exc:
        return {"status": str(exc.status()), "message": str(exc.message())}
    return {"status": "OK", "message": ""}


def main(address: str, model: str, path: str) -> dict[str, Any]:
    x = np.load(path)
    client = triton.InferenceServerClient(url=address)
    try:

        def infer(request_id: str = "", *outputs: str, **kw: Any) -> Any:
            given = triton.InferInput("input", list(x.shape), "FP32")
            given.set_data_from_numpy(x)
            asked = [triton.InferRequestedOutput(name) for name in outputs]
            return client.infer(model, [given], outputs=asked or None, request_id=request_id, **kw)

        answers = {}
        for request_id in ("first", "second", ""):
            result = infer(request_id)
            response = result.get_response()
            answers[request_id or "none"] = {
                "id": response.id,
                "model_name": response.model_name,
                "model_version": response.model_version,
                "outputs": {
                    o.name: {
                        "datatype": o.datatype,
                        "shape": list(o.shape),
                        "dtype": str(result.as_numpy(o.name).dtype),
                        "data": result.as_numpy(o.name).tolist(),
                    }
                    for o in response.outputs
                },
            }
        subset = infer("subset", "label").get_response()
        wrong = triton.InferInput("input", [1, 63], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 63), np.float32))
        return {
            "live": client.is_server_live(),
            "ready": client.is_server_ready(),
            "model_ready": client.is_model_ready(model),
            "unknown_model_ready": client.is_model_ready("no-such-model"),
            "server_metadata": client.get_server_metadata(as_json=True),
            "model_metadata": client.get_model_metadata(model, as_json=True),
            "answers": answers,
            "subset": [o.name for o in subset.outputs],
            "errors": {
                "unknown_model": failure(lambda: client.infer("no-such-model", [wrong])),
                "wrong_shape": failure(lambda: client.infer(model, [wrong])),
                "model_metadata": failure(lambda: client.get_model_metadata("no-such-model")),
                "repository_index": failure(lambda: client.get_model_repository_index()),
            },
        }
    finally:
        client.close()


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
