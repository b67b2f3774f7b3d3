"""Balancing inside the client (proxyless): given several servers, the client routes each
call itself with the balancer's own policies, with no extra hop. Identical requests go to
the same server (its cache), others to the least loaded; a server that fails is taken out
by its breaker; a call refused before reaching a model (UNAVAILABLE) is retried on another
server within the retry budget."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from sluice.core.keys import affinity_key
from sluice.routing.breaker import BreakerSettings
from sluice.routing.budget import RetryBudget
from sluice.routing.pool import Backend, Pool

# Statuses that say the server failed, not the caller.
BACKEND_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class NoBackendError(grpc.RpcError):
    """No server can take the call; reads like any RpcError (UNAVAILABLE)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"no backend can take the call: {self.why}"


@dataclass
class Attempt:
    backend: Backend
    started: float


class Router:
    """The routing state of one client: the pool and the retry budget. Not thread-safe; one
    per client, used from one thread or one event loop."""

    def __init__(self, targets: Sequence[str], breaker: BreakerSettings | None = None) -> None:
        self.pool = Pool(breaker=breaker)
        self.pool.set_addresses(targets)
        self.budget = RetryBudget()

    def first(self, body: bytes, metadata: Mapping[str, str]) -> tuple[int | None, list[Backend]]:
        self.budget.deposit()
        return affinity_key(body, metadata), []

    def next(self, key: int | None, tried: list[Backend]) -> Attempt:
        """The next server to try; raises NoBackendError."""
        while True:
            choice = self.pool.choose(key, tried)
            if choice.backend is None:
                raise NoBackendError(choice.why)
            tried.append(choice.backend)
            if self.pool.start(choice.backend):
                return Attempt(choice.backend, time.monotonic())

    def done(self, attempt: Attempt) -> None:
        self.pool.finish(attempt.backend, time.monotonic() - attempt.started, "ok")

    def failed(self, attempt: Attempt, error: grpc.RpcError) -> bool:
        """Record a failed attempt; True when the call may be retried elsewhere."""
        code = error.code()
        verdict = "failed" if code in BACKEND_FAILURES else "ok"
        self.pool.finish(attempt.backend, time.monotonic() - attempt.started, verdict)
        return code == grpc.StatusCode.UNAVAILABLE and self.budget.withdraw()
