"""The Python cost of one call, in process and without gRPC: the server's request path
(`InferenceService.predict`, cache off, the bundled model) or the balancer's routing
(`BalancerService.forward` over three backends that answer at once). Runs in any install,
this one's or an older one's (it imports whichever layout it finds), so two installs can be
compared. Under callgrind the difference of two runs is exact instructions per call:

  for n in 1 2001; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
    ../baseline/.venv/bin/python perf/pathcost.py balancer $n 2>&1 | grep Collected; done

(instructions per call = (count at 2001 - count at 1) / 2000; the same with .venv/bin/python
for this install). Without valgrind it prints microseconds per call.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import random
import sys
import time
from typing import Any


def server() -> Any:
    """`predict(body, call)` of a server on the bundled model, and the bodies to send."""
    from sluice.v1 import inference_pb2 as pb

    try:
        from sluice import models
        from sluice.server.dataplane.batcher import Batcher
        from sluice.server.dataplane.cache import LRUCache
        from sluice.server.dataplane.engine import Engine
        from sluice.server.dataplane.models import Model, Models
        from sluice.server.dataplane.plane import Dataplane
        from sluice.server.service import Call, InferenceService
        from sluice.wire import codec

        engine = Engine(models.DIGITS, device="cpu", inline_max_s=100e-6)
        plane = Dataplane(Models([Model(engine, Batcher(engine.instances))]), LRUCache(0, 0))
        predict: Any = InferenceService(plane, node_id="n").predict
        make_call: Any = Call
        encode: Any = codec.encode
        x = models.samples()[3].input
    except ImportError:  # the layout before sluice.* (server/, protos/sluice/)
        import numpy as np

        def old(name: str) -> Any:
            return importlib.import_module(name)

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models")
        engine = old("server.engine").Engine(
            os.path.join(path, "digits.onnx"), device="cpu", inline_max_s=100e-6
        )
        batcher = old("server.batcher").Batcher(engine.instances)
        cache = old("server.cache").LRUCache(0, 0)
        service = old("server.service").InferenceService(engine, batcher, cache, node_id="n")
        predict, make_call = service.predict, old("server.service").Call
        encode = old("sluice.codec").encode
        x = np.load(os.path.join(path, "samples", "digit-3.npy"))
    bodies = [
        pb.PredictRequest(inputs=[encode("input", x + i * 1e-3)]).SerializeToString()
        for i in range(50)
    ]
    return lambda i: predict(bodies[i % 50], make_call([("x-node-id", "n")], None))


def balancer() -> Any:
    """`forward` of a balancer over three backends that answer at once."""
    try:
        from sluice.balancer.service import BalancerService
        from sluice.routing.budget import RetryBudget
        from sluice.routing.pool import Pool
        from sluice.wire.mux import Reply

        kinds: tuple[Any, ...] = (BalancerService, RetryBudget, Pool, Reply)
    except ImportError:  # the layout before sluice.*
        kinds = tuple(
            getattr(importlib.import_module(f"balancer.{module}"), name)
            for module, name in (
                ("service", "BalancerService"),
                ("budget", "RetryBudget"),
                ("pool", "Pool"),
                ("mux", "Reply"),
            )
        )
    service_kind, budget_kind, pool_kind, reply_kind = kinds

    class Instant:
        async def predict(self, body: bytes, metadata: Any, timeout: float | None) -> Any:
            return reply_kind(0, "", b"x", {"x-node-id": "n"})

    pool = pool_kind(rng=random.Random(0))
    pool.set_addresses(["a:1", "b:1", "c:1"])
    for backend in pool.backends.values():
        backend.transport = Instant()
        backend.health = "SERVING"
    service = service_kind(pool, budget_kind(), node_id="b")
    bodies = [random.Random(i).randbytes(300) for i in range(50)]
    metadata = {"x-request-id": "abcdef0123456789"}
    return lambda i: service.forward(bodies[i % 50], metadata, None)


async def run(call: Any, count: int) -> float:
    started = time.perf_counter()
    for i in range(count):
        await call(i)
    return (time.perf_counter() - started) / max(count, 1) * 1e6


def main() -> int:
    what, count = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    call = {"server": server, "balancer": balancer}[what]()
    print(f"{what}: {asyncio.run(run(call, count)):.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
