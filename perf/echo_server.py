"""The echo floor: a bare grpc.aio server for the sluice.v1 API on uvloop, with identity
serializers and no model. Predict answers every call with one fixed reply the size of the
bundled digits model's reply; Metadata describes the digits input, so the sweep can drive it.

With --model PATH it is the floor of a served model instead: each Predict parses the request,
runs ONNX Runtime on a view of its first input's bytes, on the event loop (no thread hop),
with the server's session options, and answers with the model's outputs. Nothing else: no
checks, no cache, no routing, no metrics.

With --shared-memory as well it is the floor of a served model reading shared memory: it
takes sluice.v1's region calls (sluice.shm.calls over a sluice.shm.registry registry, mapped,
one caller), and a Predict that names regions is read and answered by the functions the
server's own path uses: its inputs views of the caller's region through the call's lease,
the outputs output_memory names written into theirs and answered by reference. A refusal
there (a region unknown, an output region too small) answers the status its error names.

  python -m perf.echo_server --port 0
  python -m perf.echo_server --port 0 --model squeezenet.onnx --threads 2
  python -m perf.echo_server --port 0 --model squeezenet.onnx --threads 2 --shared-memory
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice.core.errors import InvalidInput, SluiceError
from sluice.runtime.listener import MAX_PENDING_CALLS
from sluice.runtime.process import event_loop
from sluice.runtime.status import status_of
from sluice.shm import placement, scan
from sluice.shm.calls import V1_CALLS, RegionCalls, unserved
from sluice.shm.registry import Regions
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from sluice.wire.body import parse

log = logging.getLogger("sluice.echo")

PROG = "perf/echo_server.py --model"  # named where its shared memory is off
NO_SHARED_MEMORY = unserved(PROG)
Handler = Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]], Awaitable[bytes]]

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


def model_floor(
    path: str, threads: int, regions: Regions | None = None
) -> tuple[Callable[[bytes], bytes], bytes]:
    """Predict's answer and Metadata's reply for the model at `path`, as the server's CPU
    session options run it (no arena, no spinning). `regions`: the callers' shared memory,
    read and written as the server's path does (None: off, bytes only). The answer raises a
    SluiceError, its status named, for a request that names regions it cannot take."""
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
        if regions is not None and scan.uses_regions(body):
            return shared(body, regions)
        tensor = pb.PredictRequest.FromString(body).inputs[0]
        array = np.frombuffer(tensor.raw_data, dtype).reshape(tuple(tensor.shape))
        outputs = session.run(None, {first.name: array})
        return codec.encode_predict_response(
            "floor", "", dict(zip(names, outputs, strict=True)), typed=False
        )

    def shared(body: bytes, regions: Regions) -> bytes:
        request = parse(pb.PredictRequest, body)
        with regions.lease("") as lease:
            inputs, memory = placement.predict_tensors(request, lease, NO_SHARED_MEMORY)
            array = next(iter(inputs.values()))  # the first input, a view of its region
            outputs = session.run(None, {first.name: array})
            try:
                return codec.encode_predict_response(
                    "floor", "", dict(zip(names, outputs, strict=True)), False, memory
                )
            except codec.TensorError as exc:  # an output region too small: as the server
                raise InvalidInput(str(exc)) from None

    spec = pb.TensorSpec(
        name=first.name,
        datatype="FP32" if dtype == np.float32 else "INT64",
        shape=[d if isinstance(d, int) else -1 for d in first.shape],
    )
    metadata = pb.MetadataResponse(
        model=pb.ModelInfo(name="floor", inputs=[spec]), platform="floor", provider="none"
    ).SerializeToString()
    return answer, metadata


def handlers(
    model: str = "", threads: int = 1, regions: Regions | None = None
) -> dict[str, Handler]:
    """sluice.v1.Inference's handlers by method name: the echo's, or with `model` its
    floor's (`regions`: its callers' shared memory, None: off)."""
    calls = 0
    answer, described = model_floor(model, threads, regions) if model else (None, METADATA)

    async def predict(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        nonlocal calls
        calls += 1
        if answer is None:
            return REPLY
        try:
            return answer(body)
        except SluiceError as exc:
            await context.abort(status_of(exc), str(exc))

    async def health_info(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return pb.HealthResponse(
            node_id="echo", status="SERVING", requests=calls
        ).SerializeToString()

    async def metadata(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return described

    region_calls = RegionCalls(regions, PROG)

    def region_call(call: Callable[[RegionCalls, str, bytes], bytes]) -> Handler:
        async def handle(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            try:
                return call(region_calls, "", body)  # one caller: no tenants
            except SluiceError as exc:
                await context.abort(status_of(exc), str(exc))

        return handle

    return {
        "Predict": predict,
        "Health": health_info,
        "Metadata": metadata,
        **{name: region_call(call) for name, call in V1_CALLS.items()},
    }


async def serve(
    host: str, port: int, model: str = "", threads: int = 1, shared_memory: bool = False
) -> None:
    regions = Regions() if shared_memory else None
    try:
        await _serve(host, port, handlers(model, threads, regions))
    finally:
        if regions is not None:
            regions.close()


async def _serve(host: str, port: int, methods: dict[str, Handler]) -> None:
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
                {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()},
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
    parser.add_argument(
        "--shared-memory",
        action="store_true",
        help="with --model: take the callers' shared memory regions (callers on this host)",
    )
    args = parser.parse_args(argv)
    if args.shared_memory and not args.model:
        parser.error("--shared-memory needs --model: the echo reads no request")
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    with asyncio.Runner(loop_factory=event_loop) as runner:
        runner.run(serve(args.host, args.port, args.model, args.threads, args.shared_memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
