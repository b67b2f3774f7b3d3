"""Plain inputs against a real server: nested lists from Python, NAME=JSON from the shell
(converted to the input's datatype from the model's metadata, asked once per model and
version, and not at all for numpy arrays), JSON output by --json-output, and values that
cannot be converted named with the input and the datatype wanted, before anything is
sent."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, Process

pytestmark = pytest.mark.e2e

SAMPLE = SAMPLES[3]  # FP32 [1, 64], whole numbers: the README's example digit


def sluice(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "sluice"), *argv], capture_output=True, text=True, timeout=60)


def test_the_python_client_takes_nested_lists_and_tuples(
    server: Process, reference: ort.InferenceSession
) -> None:
    (want,) = reference.run(["label"], {"input": SAMPLE.input})
    rows = SAMPLE.input.tolist()
    with SluiceClient(server.address) as client:
        for plain in (rows, tuple(tuple(row) for row in rows)):
            got = client.predict({"input": plain}, outputs=["label"])
            np.testing.assert_array_equal(got["label"], want)


WHOLE = [[int(v) for v in SAMPLE.input.ravel()]]  # a list of ints: INT64 to numpy
METADATA = "/sluice.v1.Inference/Metadata"
PREDICT = "/sluice.v1.Inference/Predict"


@dataclass
class Recorder:
    """A forwarding hop in front of the real server that records each method called through
    it: what went over the wire, not what the client meant to send."""

    address: str
    methods: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def seen(self) -> list[str]:
        with self.lock:
            return list(self.methods)


@pytest.fixture
def recorder(server: Process) -> Iterator[Recorder]:
    upstream = grpc.insecure_channel(server.address)
    hop = grpc.server(ThreadPoolExecutor(max_workers=4))
    recorded = Recorder("")

    class Forward(grpc.GenericRpcHandler):  # type: ignore[type-arg]
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[bytes, bytes]:
            method = str(details.method)
            with recorded.lock:
                recorded.methods.append(method)
            send = upstream.unary_unary(method)

            def forward(body: bytes, context: grpc.ServicerContext) -> bytes:
                metadata = tuple(context.invocation_metadata() or ())
                try:
                    reply: bytes = send(body, timeout=context.time_remaining(), metadata=metadata)
                except grpc.RpcError as exc:  # relayed as the server said it
                    context.abort(exc.code(), exc.details() or "")
                return reply

            return grpc.unary_unary_rpc_method_handler(forward)

    hop.add_generic_rpc_handlers((Forward(),))
    recorded.address = f"127.0.0.1:{hop.add_insecure_port('127.0.0.1:0')}"
    hop.start()
    try:
        yield recorded
    finally:
        hop.stop(None)
        upstream.close()


def test_both_clients_send_whole_numbers_in_the_models_datatype(server: Process) -> None:
    with SluiceClient(server.address) as client:
        assert client.predict({"input": WHOLE})["label"] == [3]

    async def predict() -> list[int]:
        async with AsyncSluiceClient(server.address) as client:
            answer = await client.predict({"input": WHOLE})
        return list(answer["label"])

    assert asyncio.run(predict()) == [3]


@pytest.fixture
def dead() -> Iterator[str]:
    """An address that refuses every connection at once: a bound socket that never listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def test_plain_values_are_asked_past_a_target_that_is_down(server: Process, dead: str) -> None:
    """With several targets the model's datatypes are asked as calls are routed: the first
    target refusing connections is passed over, as it is for a numpy array."""
    with SluiceClient([dead, server.address]) as client:
        assert client.predict({"input": WHOLE})["label"] == [3]

    async def predict() -> list[int]:
        async with AsyncSluiceClient([dead, server.address]) as client:
            answer = await client.predict({"input": WHOLE})
        return list(answer["label"])

    assert asyncio.run(predict()) == [3]


def test_a_list_that_does_not_convert_names_the_models_datatype(server: Process) -> None:
    with (
        SluiceClient(server.address) as client,
        pytest.raises(TypeError, match=r"input 'input' cannot be converted to FP32: .*differ"),
    ):
        client.predict({"input": [[1.0, 2.0], [3.0]]})


def test_the_model_is_asked_its_datatypes_once_and_never_for_arrays(
    recorder: Recorder,
) -> None:
    with SluiceClient(recorder.address) as client:
        client.predict({"input": SAMPLE.input})
        assert recorder.seen() == [PREDICT]  # an array goes as it is: no Metadata call
        for _ in range(2):
            assert client.predict({"input": WHOLE})["label"] == [3]
        assert recorder.seen() == [PREDICT, METADATA, PREDICT, PREDICT]  # asked once

    async def predict() -> None:
        async with AsyncSluiceClient(recorder.address) as client:
            await client.predict({"input": SAMPLE.input})
            for _ in range(2):
                await client.predict({"input": WHOLE})

    del recorder.methods[:]
    asyncio.run(predict())
    assert recorder.seen() == [PREDICT, METADATA, PREDICT, PREDICT]


def test_a_refused_plain_call_asks_the_datatypes_again(recorder: Recorder) -> None:
    """A swap may change an input's datatype: after INVALID_ARGUMENT the client asks anew."""
    with SluiceClient(recorder.address) as client:
        assert client.predict({"input": WHOLE})["label"] == [3]
        with pytest.raises(grpc.RpcError) as refused:
            client.predict({"input": [[1.0] * 63]})  # the model takes 64 values
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.predict({"input": WHOLE})["label"] == [3]
    assert recorder.seen() == [METADATA, PREDICT, PREDICT, METADATA, PREDICT]


def test_json_input_takes_the_models_datatype_and_json_output_is_json(server: Process) -> None:
    whole = json.dumps([[int(v) for v in SAMPLE.input.ravel()]])  # ints, as a user types them
    done = sluice("predict", "--target", server.address, "--json-output", f"input={whole}")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["outputs"]["label"] == {"datatype": "INT64", "shape": [1], "data": [3]}


def test_health_and_metadata_print_json_on_request(server: Process) -> None:
    health = sluice("health", "--target", server.address, "--json-output")
    assert health.returncode == 0, health.stderr
    assert len(health.stdout.splitlines()) == 1
    assert json.loads(health.stdout)["node_id"] == "test-node"
    meta = sluice("metadata", "--target", server.address, "--json-output")
    assert meta.returncode == 0, meta.stderr
    assert json.loads(meta.stdout)["model"]["inputs"][0]["datatype"] == "FP32"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('[["a", 1]]', "it holds strings"),
        ("[[1, 2], [3]]", "its nested lists differ in length"),
        ("[[1, null]]", "it holds None"),
        ("[[1e39]]", "it holds finite values outside the range of FP32"),
    ],
)
def test_a_value_that_does_not_convert_names_the_input_and_datatype(
    server: Process, value: str, reason: str
) -> None:
    done = sluice("predict", "--target", server.address, f"input={value}")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: sluice predict"), done.stderr
    assert f"sluice predict: error: input 'input' cannot be converted to FP32: {reason}" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr
