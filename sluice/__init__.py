"""Sluice: fast, predictable ONNX model serving over gRPC.

    from sluice import SluiceClient

The programs live in sluice.server, sluice.balancer, sluice.client and sluice.perf; what they
share in sluice.core (transport-free basics), sluice.routing (the routing policies and the
call planner), sluice.wire (the sluice.v1 wire format) and sluice.runtime (process plumbing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.client import AsyncSluiceClient, Prediction, SluiceClient

__all__ = ["AsyncSluiceClient", "Prediction", "SluiceClient"]


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


def __getattr__(name: str) -> Any:
    # Lazy, so that `import sluice.server` does not load the client.
    if name in __all__:
        from sluice import client

        return getattr(client, name)
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")
