"""How many of the product's functions one unary Predict runs: a server on the bundled model, in
this process on 127.0.0.1 port 0, called over a real grpc.aio channel with unique inputs (every
call a cache miss, batch of one, one call at a time), with a profile hook on every thread.

  python -m perf.callpath [--calls 20] [--list]

Functions are counted while a call is in flight, less those seen while the server sat idle
(its timers and pollers); "ours" is code under sluice/, server/, balancer/, client/, protos/.
"""

from __future__ import annotations

import argparse
import asyncio
import dis
import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import grpc
import numpy as np

from sluice.runtime.process import event_loop

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = tuple(f"{ROOT / d}{os.sep}" for d in ("sluice", "server", "balancer", "client", "protos"))
PREDICT = "/sluice.v1.Inference/Predict"
RESUME = dis.opmap["RESUME"]
IDLE_S = 1.5  # long enough to see what the server runs unasked (timers, pollers)


class Recorder:
    """A profile hook that counts calls of the product's functions into `into` (None: not
    recording). A coroutine's resumption is a call to the hook, not counted as a call."""

    def __init__(self) -> None:
        self.into: Counter[CodeType] | None = None
        self._ours: dict[CodeType, bool] = {}

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        into = self.into
        if into is None or event != "call":
            return
        code = frame.f_code
        ours = self._ours.get(code)
        if ours is None:
            ours = self._ours[code] = os.path.realpath(code.co_filename).startswith(PRODUCT)
        if ours:  # a call starts at RESUME 0; a resumed coroutine or generator does not
            at = frame.f_lasti
            into[code] += code.co_code[at] == RESUME and code.co_code[at + 1] == 0

    def install(self) -> None:
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)

    def remove(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


@dataclass
class Profile:
    calls: int  # Predict calls profiled
    functions: dict[str, int]  # "path:line qualname" -> calls, idle ones left out

    @property
    def distinct(self) -> int:
        return len(self.functions)

    @property
    def per_call(self) -> float:
        return sum(self.functions.values()) / self.calls


def _name(code: CodeType) -> str:
    path = Path(os.path.realpath(code.co_filename)).relative_to(ROOT)
    return f"{path}:{code.co_firstlineno} {code.co_qualname}"


def _bodies(count: int, seed: int) -> list[bytes]:
    from sluice.v1 import inference_pb2 as pb

    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        x = rng.random((1, 64), dtype=np.float32)
        tensor = pb.Tensor(name="input", datatype="FP32", shape=[1, 64], raw_data=x.tobytes())
        bodies.append(pb.PredictRequest(inputs=[tensor]).SerializeToString())
    return bodies


class _Port(logging.Handler):
    """The port the server announces in its "listening on HOST:PORT" line."""

    def __init__(self) -> None:
        super().__init__()
        self.port = asyncio.get_running_loop().create_future()

    def emit(self, record: logging.LogRecord) -> None:
        if "listening on" in record.msg and not self.port.done():
            self.port.set_result(record.args[-1])  # type: ignore[index]


async def profile(calls: int = 20, extra: Sequence[str] = ()) -> Profile:
    """Profile `calls` unique-input Predicts (after as many unprofiled ones, to warm up)."""
    from sluice.runtime import config
    from sluice.server.main import serve
    from sluice.server.settings import ServerSettings

    argv = ["--port", "0", "--host", "127.0.0.1", "--device", "cpu", *extra]
    settings = config.parse(ServerSettings, argv, ServerSettings.PROG, "")
    recorder = Recorder()
    recorder.install()  # before the server starts a thread
    found = _Port()
    log = logging.getLogger("sluice.server")
    log.addHandler(found)
    level, log.level = log.level, logging.INFO
    stop = asyncio.Event()
    running = asyncio.create_task(serve(settings, [], stop=stop))
    in_flight: Counter[CodeType] = Counter()
    idle: Counter[CodeType] = Counter()
    try:
        await asyncio.wait([found.port, running], return_when=asyncio.FIRST_COMPLETED)
        if running.done():  # it could not start: its error
            raise RuntimeError(f"the server did not start: {running.result()}")
        port = found.port.result()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            predict = channel.unary_unary(PREDICT, None, None)
            for body in _bodies(calls, seed=1):  # warm: first calls import and allocate
                await predict(body)
            recorder.into = idle
            await asyncio.sleep(IDLE_S)
            for body in _bodies(calls, seed=2):
                recorder.into = in_flight
                await predict(body)
                recorder.into = None
            recorder.into = idle
            await asyncio.sleep(IDLE_S)
    finally:
        recorder.remove()
        log.removeHandler(found)
        log.level = level
        stop.set()
        await running
    kept = {_name(c): n for c, n in in_flight.items() if c not in idle}
    return Profile(calls, dict(sorted(kept.items())))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.callpath", description=__doc__)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--list", action="store_true", help="print each function and its calls")
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=event_loop) as runner:  # the server's own loop
        found = runner.run(profile(args.calls))
    if args.list:
        for name, n in found.functions.items():
            print(f"{n / found.calls:6.2f}  {name}")
    print(f"{found.distinct} distinct functions of ours, {found.per_call:.1f} calls per Predict")
    return 0


if __name__ == "__main__":
    sys.exit(main())
