"""How many copies of a 602 KB body a call forwarded through the balancer makes, counted in
a process of its own where glibc gives every block of 256 KiB or more a fresh mapping: each
body-sized block written then faults its pages in, so minor faults / the body's pages is
the number of body-sized blocks written, whoever wrote them (protobuf's arenas and grpc's
slices are no Python allocations, and tracemalloc misses them). The backend is a real
process on 127.0.0.1 that answers PredictStream and Predict with a small reply."""

from __future__ import annotations

import selectors
import subprocess
import sys
import textwrap

PORT_WAIT_S = 30  # the fake server starts in well under a second; a hung one fails the test
FAKE_SERVER = textwrap.dedent(
    """
    import asyncio
    import grpc
    from sluice.v1 import inference_pb2 as pb

    REPLY = pb.PredictResponse(model="m").SerializeToString()

    async def stream(requests, context):
        async for raw in requests:
            message = pb.StreamRequest.FromString(raw)
            await context.write(
                pb.StreamResponse(id=message.id, response=REPLY).SerializeToString()
            )

    async def unary(body, context):
        return REPLY

    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1)])
        handlers = {
            "PredictStream": grpc.stream_stream_rpc_method_handler(stream),
            "Predict": grpc.unary_unary_rpc_method_handler(unary),
        }
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("sluice.v1.Inference", handlers)]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination(60)

    asyncio.run(main())
    """
)

# Blocks written per call, the median of CALLS calls after a warm-up, printed one a line.
MEASURE = textwrap.dedent(
    """
    import asyncio, ctypes, resource, statistics, sys
    ctypes.CDLL(None).mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD: a mapping per block
    import numpy as np
    from sluice.balancer.service import BalancerService
    from sluice.balancer.upstream import Upstream
    from sluice.routing.budget import RetryBudget
    from sluice.routing.pool import Pool
    from sluice.v1 import inference_pb2 as pb
    from sluice.wire import codec, stream

    CALLS = 15
    image = np.random.default_rng(1).random((1, 3, 224, 224), np.float32)
    body = pb.PredictRequest(inputs=codec.encode_all({"input": image})).SerializeToString()
    pages = len(body) / 4096

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    async def forwarded(port):
        pool = Pool()
        pool.set_addresses([f"127.0.0.1:{port}"])
        for address, backend in pool.backends.items():
            backend.transport = Upstream(address)
        balancer = BalancerService(pool, RetryBudget(), node_id="b")
        found = []
        for i in range(CALLS + 3):
            before = faults()
            reply = await balancer.forward(body, {}, None)
            assert reply.code == 0, reply
            if i >= 3:
                found.append((faults() - before) / pages)
        for backend in pool.backends.values():
            await backend.transport.close()
        return statistics.median(found)

    def read():
        raw = pb.StreamRequest(id=1, request=body, metadata={"a": "b"}).SerializeToString()
        found = []
        for _ in range(CALLS):
            before = faults()
            message = stream.read_request(raw)
            found.append((faults() - before) / pages)
            del message
        return statistics.median(found)

    print(asyncio.run(forwarded(int(sys.argv[1]))))
    print(read())
    """
)


def blocks() -> tuple[float, float]:
    """(blocks written per forwarded call, blocks written per StreamRequest read)."""
    server = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        with selectors.DefaultSelector() as ready:  # a bounded wait for the port it prints
            ready.register(server.stdout, selectors.EVENT_READ)
            assert ready.select(PORT_WAIT_S), f"the fake server printed no port in {PORT_WAIT_S} s"
        port = server.stdout.readline().strip()
        assert port.isdigit(), "the fake server did not start"
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, port],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        forwarded, read = done.stdout.split()
        return float(forwarded), float(read)
    finally:
        server.kill()
        server.wait(10)
        if server.stdout is not None:
            server.stdout.close()


def test_a_large_body_is_copied_once_in_the_balancer_and_once_read_by_the_server() -> None:
    """Forwarded: grpc's own copy into its send slices and the stream message's one join
    (protobuf made 4 blocks: its arena, its encoding, its bytes, grpc's). Read: the body's
    one slice (protobuf's arena and the `request` getter made 2)."""
    forwarded, read = blocks()
    assert forwarded < 2.5
    assert read < 1.5
