"""How model versions order: numbers as numbers, any other name before them, as text."""

from __future__ import annotations


def version_key(version: str) -> tuple[int, int | str]:
    return (1, int(version)) if version.isdigit() else (0, version)
