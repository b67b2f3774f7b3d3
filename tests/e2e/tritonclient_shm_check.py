"""Triton's own client and its shared memory utilities against a Sluice address, unmodified:
run INSIDE a venv that holds `tritonclient[grpc]` (see tritonclient_check.py), so only the
standard library, numpy and tritonclient here. Prints one JSON object for the test to judge.

    python tritonclient_shm_check.py HOST:PORT MODEL INPUT.npy on|off

`on` (a server started with --shared-memory): regions made and filled with
tritonclient.utils.shared_memory, registered, listed, an inference with its input and both
outputs in them (and one with each beside raw values), the refusals, unregistered, and one
its caller unlinked swept by the server. `off`: what the calls answer without the option.
The outputs read back from shared memory are judged by the test against ONNX Runtime."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tritonclient.grpc as triton
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

# The test names it (argv[5]), so it can remove what a killed check left behind.
PREFIX = sys.argv[5] if len(sys.argv) > 5 else f"/sluice-tritonclient-{os.getpid()}"


def failure(call: Callable[[], Any]) -> dict[str, str]:
    """The status and message a call fails with."""
    try:
        call()
    except InferenceServerException as exc:
        return {"status": str(exc.status()), "message": str(exc.message())}
    return {"status": "OK", "message": ""}


def contents(handle: Any, output: Any, offset: int) -> list[Any]:
    """An output read back from shared memory, as tritonclient's examples do (a copy, so
    that the region can be destroyed afterwards)."""
    dtype = triton_to_np_dtype(output.datatype)
    values: list[Any] = shm.get_contents_as_numpy(
        handle, dtype, list(output.shape), offset
    ).tolist()
    return values


def parameters(output: Any) -> dict[str, Any]:
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in output.parameters.items()}


def on(client: triton.InferenceServerClient, model: str, x: np.ndarray) -> dict[str, Any]:
    rows = x.shape[0]
    label_size, probabilities_size = rows * 8, rows * 10 * 4  # INT64 [N], FP32 [N, 10]
    handles = []

    def region(name: str, size: int) -> Any:
        handles.append(shm.create_shared_memory_region(name, f"{PREFIX}-{name}", size))
        return handles[-1]

    try:
        client.unregister_system_shared_memory()  # a clean start
        given = region("input_data", x.nbytes)
        shm.set_shared_memory_region(given, [x])
        out = region("output_data", label_size + probabilities_size)
        client.register_system_shared_memory("input_data", f"{PREFIX}-input_data", x.nbytes)
        client.register_system_shared_memory(
            "output_data", f"{PREFIX}-output_data", label_size + probabilities_size
        )
        registered = client.get_system_shared_memory_status(as_json=True)

        def shared_input(byte_size: int = x.nbytes, name: str = "input_data") -> Any:
            tensor = triton.InferInput("input", list(x.shape), "FP32")
            tensor.set_shared_memory(name, byte_size)
            return tensor

        def shared_outputs() -> list[Any]:
            label = triton.InferRequestedOutput("label")
            label.set_shared_memory("output_data", label_size)
            probabilities = triton.InferRequestedOutput("probabilities")
            probabilities.set_shared_memory("output_data", probabilities_size, offset=label_size)
            return [label, probabilities]

        result = client.infer(model, [shared_input()], outputs=shared_outputs(), request_id="s")
        response = result.get_response()
        answer = {
            "id": response.id,
            "outputs": {
                o.name: {
                    "datatype": o.datatype,
                    "shape": list(o.shape),
                    "parameters": parameters(o),
                    "raw": len(response.raw_output_contents[i]),
                }
                for i, o in enumerate(response.outputs)
            },
            "label": contents(out, result.get_output("label"), 0),
            "probabilities": contents(out, result.get_output("probabilities"), label_size),
        }

        # An input in shared memory, the outputs raw; then a raw input, one output in it.
        raw_out = client.infer(model, [shared_input()])
        raw_in = triton.InferInput("input", list(x.shape), "FP32")
        raw_in.set_data_from_numpy(x)
        label = triton.InferRequestedOutput("label")
        label.set_shared_memory("output_data", label_size)
        beside = client.infer(
            model, [raw_in], outputs=[label, triton.InferRequestedOutput("probabilities")]
        )
        mixed = {
            "raw_outputs": {
                "label": raw_out.as_numpy("label").tolist(),
                "probabilities": raw_out.as_numpy("probabilities").tolist(),
            },
            "raw_input": {
                "label": contents(out, beside.get_output("label"), 0),
                "probabilities": beside.as_numpy("probabilities").tolist(),
            },
        }

        errors = {
            "unknown_region": failure(
                lambda: client.infer(model, [shared_input(name="no_such_region")])
            ),
            "size_mismatch": failure(lambda: client.infer(model, [shared_input(x.nbytes - 4)])),
            "bad_key": failure(
                lambda: client.register_system_shared_memory("bad", "/etc/passwd", 8)
            ),
            "missing_key": failure(
                lambda: client.register_system_shared_memory("bad", f"{PREFIX}-none", 8)
            ),
            "past_the_end": failure(
                lambda: client.register_system_shared_memory(
                    "bad", f"{PREFIX}-input_data", x.nbytes + 1
                )
            ),
            "taken": failure(
                lambda: client.register_system_shared_memory(
                    "input_data", f"{PREFIX}-input_data", 8
                )
            ),
            "unknown_status": failure(lambda: client.get_system_shared_memory_status("nope")),
            "cuda_register": failure(
                lambda: client.register_cuda_shared_memory("gpu", b"aGFuZGxl", 0, 8)  # base64
            ),
        }

        client.unregister_system_shared_memory("input_data")
        errors["unregistered"] = failure(lambda: client.infer(model, [shared_input()]))
        client.unregister_system_shared_memory()
        unregistered = client.get_system_shared_memory_status(as_json=True)

        # A region whose caller unlinked its object is let go by the server on its own.
        swept = region("swept", 64)
        client.register_system_shared_memory("swept", f"{PREFIX}-swept", 64)
        listed = "swept" in client.get_system_shared_memory_status(as_json=True).get("regions", {})
        shm.destroy_shared_memory_region(swept)
        handles.remove(swept)
        deadline = time.monotonic() + 60
        while "swept" in client.get_system_shared_memory_status(as_json=True).get("regions", {}):
            if time.monotonic() > deadline:
                raise SystemExit("the server did not sweep an unlinked region in 60 s")
            time.sleep(0.1)
        return {
            "registered": registered,
            "answer": answer,
            "mixed": mixed,
            "errors": errors,
            "unregistered": unregistered,
            "swept": listed,
            "cuda_status": client.get_cuda_shared_memory_status(as_json=True),
        }
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def off(client: triton.InferenceServerClient, model: str, x: np.ndarray) -> dict[str, Any]:
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_shared_memory("input_data", x.nbytes)
    return {
        "register": failure(lambda: client.register_system_shared_memory("r", f"{PREFIX}-none", 8)),
        "status": failure(lambda: client.get_system_shared_memory_status()),
        "unregister": failure(lambda: client.unregister_system_shared_memory()),
        "infer": failure(lambda: client.infer(model, [given])),
        "extensions": client.get_server_metadata(as_json=True).get("extensions", []),
    }


def main(address: str, model: str, path: str, mode: str) -> dict[str, Any]:
    x = np.load(path)
    client = triton.InferenceServerClient(url=address)
    try:
        return (on if mode == "on" else off)(client, model, x)
    finally:
        client.close()


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
