"""The echo floor: a bare grpc.aio server for the sluice.v1 API on uvloop, with identity
serializers and no model. Predict answers every call with one fixed reply the size of the
bundled digits model's reply; Metadata describes the digits input, so the sweep can drive it.

With --model PATH it is the floor of a served model instead: each Predict parses the request,
runs ONNX Runtime on a view of its first input's bytes, on the event loop (no thread hop),
with the server's session options, and answers with the model's outputs. Nothing else: no
checks, no cache, no routing, no metrics.

  python -m perf.echo_server --port 0
  python -m perf.echo_server --port 0 --model squeezenet.onnx --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice.runtime.listener import MAX_PENDING_CALLS
from sluice.runtime.process import event_loop
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

log = logging.getLogger("sluice.echo")

REPLY = pb.PredictResponse(
    model="echo",
    outputs=codec.encode_all(
        {"label": np.zeros(1, np.int64), "probabilities": np.zeros((1, 10), np.float32)}
    ),
).SerializeToString()
INPUT = pb.TensorSpec(name="input", datatype="FP32", shape=[-1, 64])
METADATA = pb.MetadataResponse(
    model=pb.ModelInfo(name="echo", inputs=[INPUT]), platform="echo", provider="none"
).SerializeToString()


def model_floor(path: str, threads: int) -> tuple[Callable[[bytes], bytes], bytes]:
    """Predict's answer and Metadata's reply for the model at `path`, as the server's CPU
    session options run it (no arena, no spinning)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = False
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    names = [o.name for o in session.get_outputs()]
    dtype = np.float32 if first.type == "tensor(float)" else np.int64

    def answer(body: bytes) -> bytes:
        tensor = pb.PredictRequest.FromString(body).inputs[0]
        array = np.frombuffer(tensor.raw_data, dtype).reshape(tuple(tensor.shape))
        outputs = session.run(None, {first.name: array})
        return codec.encode_predict_response(
            "floor", "", dict(zip(names, outputs, strict=True)), typed=False
        )

    spec = pb.TensorSpec(
        name=first.name,
        datatype="FP32" if dtype == np.float32 else "INT64",
        shape=[d if isinstance(d, int) else -1 for d in first.shape],
    )
    metadata = pb.MetadataResponse(
        model=pb.ModelInfo(name="floor", inputs=[spec]), platform="floor", provider="none"
    ).SerializeToString()
    return answer, metadata


async def serve(host: str, port: int, model: str = "", threads: int = 1) -> None:
    calls = 0
    answer, described = model_floor(model, threads) if model else (None, METADATA)

    async def predict(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        nonlocal calls
        calls += 1
        return answer(body) if answer else REPLY

    async def health_info(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return pb.HealthResponse(
            node_id="echo", status="SERVING", requests=calls
        ).SerializeToString()

    async def metadata(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return described

    handlers = {
        "Predict": predict,
        "Health": health_info,
        "Metadata": metadata,
    }
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            # As the real servers (sluice.runtime.listener): a burst is not dropped by grpc.
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ]
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "sluice.v1.Inference",
                {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in handlers.items()},
            )
        ]
    )
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("echo floor listening on %s:%d", host, bound)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.echo_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="", help="an ONNX model: the served-model floor")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime's intra-op threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    with asyncio.Runner(loop_factory=event_loop) as runner:
        runner.run(serve(args.host, args.port, args.model, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
