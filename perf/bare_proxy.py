"""The proxy floor: a bare raw-bytes grpc.aio proxy on uvloop. Every unary method is
forwarded as bytes (identity serializers) to one backend with the caller's metadata and
remaining deadline; nothing is parsed. The Python floor for a balancer hop.

  python -m perf.bare_proxy --port 0 --backend 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import grpc

from sluice.runtime.process import event_loop

log = logging.getLogger("sluice.bare_proxy")
Context = grpc.aio.ServicerContext[bytes, bytes]


class Forward(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.methods: dict[str, Any] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[bytes, bytes]:
        method = details.method
        stub = self.methods.get(method)
        if stub is None:
            stub = self.channel.unary_unary(
                method, request_serializer=None, response_deserializer=None
            )
            self.methods[method] = stub

        async def forward(body: bytes, context: Context) -> bytes:
            metadata = tuple(context.invocation_metadata() or ())
            call = stub(body, timeout=context.time_remaining(), metadata=metadata)
            try:
                reply: bytes = await call
            except grpc.aio.AioRpcError as exc:
                context.set_trailing_metadata(tuple(exc.trailing_metadata() or ()))  # type: ignore[arg-type]
                await context.abort(exc.code(), exc.details() or "")
            context.set_trailing_metadata(await call.trailing_metadata() or ())
            return reply

        return grpc.unary_unary_rpc_method_handler(forward)


async def serve(host: str, port: int, backend: str) -> None:
    channel = grpc.aio.insecure_channel(backend, options=[("grpc.max_receive_message_length", -1)])
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", -1)]
    )
    server.add_generic_rpc_handlers([Forward(channel)])
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    log.info("bare proxy to %s listening on %s:%d", backend, host, bound)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    await channel.close(grace=None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bare_proxy", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--backend", required=True, help="HOST:PORT to forward to")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    with asyncio.Runner(loop_factory=event_loop) as runner:
        runner.run(serve(args.host, args.port, args.backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
