"""Sluice: fast, predictable ONNX model serving over gRPC.

    from sluice import SluiceClient

The layout: docs/DESIGN.md."""

from __future__ import annotations

import os

# The real folders, not a path entry's link to sluice/ (scripts/bootstrap) nor the links in it.
__path__[:] = [os.path.realpath(p) for p in __path__]

from typing import TYPE_CHECKING, Any

from sluice.core import paths

paths.install()

if TYPE_CHECKING:
    from sluice.client import AsyncSluiceClient, Prediction, SluiceClient

__all__ = ["AsyncSluiceClient", "Prediction", "SluiceClient"]

# What the generated *_pb2 modules were made for; pyproject's floor.
NEEDS_PROTOBUF = "7.35.1"


def _check_protobuf() -> None:
    """ImportError saying what to do when protobuf is older than NEEDS_PROTOBUF (protobuf's
    own mismatch error says neither). Imports inside: `sluice.re` is no API."""
    import re
    import sys

    import google.protobuf

    found = google.protobuf.__version__
    parts = re.match(r"(\d+)\.(\d+)\.(\d+)", found)
    needed = tuple(map(int, NEEDS_PROTOBUF.split(".")))
    if parts is None or tuple(map(int, parts.groups())) >= needed:
        return
    where = google.protobuf.__path__[0]
    raise ImportError(
        f"sluice needs protobuf>={NEEDS_PROTOBUF}, and this environment has protobuf {found} "
        f"({where}). Something installed after sluice downgraded it: most often "
        "tritonclient[grpc], which pins protobuf<7. Fix it with "
        f"`{sys.executable} -m pip install 'protobuf>={NEEDS_PROTOBUF}'`, and give "
        "tritonclient an environment of its own (the README's KServe section says how)."
    )


_check_protobuf()


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


def __getattr__(name: str) -> Any:
    # Lazy, so that `import sluice.server` does not load the client.
    if name in __all__:
        from sluice import client

        return getattr(client, name)
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")
