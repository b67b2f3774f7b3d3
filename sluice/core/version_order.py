"""How model versions order: as numbers (Triton's version directories), any other name
before them, as text. One rule for the server's registry and the balancer's view of it."""

from __future__ import annotations


def version_key(version: str) -> tuple[int, int | str]:
    return (1, int(version)) if version.isdigit() else (0, version)
