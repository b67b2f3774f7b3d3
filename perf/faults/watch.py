"""A balancer's view of its backends over time (its Health, sampled in a thread), to time
when a backend is marked out and when it is back in."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from sluice.client import SluiceClient
from sluice.v1 import inference_pb2 as pb

BackendView = dict[str, tuple[str, str, int]]  # address -> (health, breaker, calls)


class Watch:
    """A balancer's Health every `interval`, in a thread of its own, each sample timed."""

    def __init__(self, address: str, interval: float = 0.05) -> None:
        self.address = address
        self.interval = interval
        self.samples: list[tuple[float, BackendView]] = []
        self.last: pb.HealthResponse | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with SluiceClient(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) as c:
            while not self._stop.wait(self.interval):
                try:
                    health = c.health(timeout=1.0)
                except grpc.RpcError:
                    continue
                view = {b.address: (b.health, b.breaker, int(b.calls)) for b in health.backends}
                self.samples.append((time.monotonic(), view))
                self.last = health

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def first(self, after: float, condition: Callable[[BackendView], bool]) -> float | None:
        """Seconds from `after` to the first sample that meets `condition`."""
        for at, view in list(self.samples):
            if at >= after and condition(view):
                return at - after
        return None

    def states(self, address: str) -> list[str]:
        """The backend's distinct health/breaker states in order."""
        seen: list[str] = []
        for _, view in list(self.samples):
            if address in view:
                state = f"{view[address][0]}/{view[address][1]}"
                if not seen or seen[-1] != state:
                    seen.append(state)
        return seen


def out_of(address: str) -> Callable[[BackendView], bool]:
    def condition(view: BackendView) -> bool:
        state = view.get(address)
        return state is None or state[0] != "SERVING" or state[1] == "OPEN"

    return condition


def back_in(address: str) -> Callable[[BackendView], bool]:
    def condition(view: BackendView) -> bool:
        state = view.get(address)
        return state is not None and state[0] == "SERVING" and state[1] == "CLOSED"

    return condition
