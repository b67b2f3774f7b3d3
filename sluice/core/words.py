"""How a count reads in a message: "1 call", "2 calls", "1,024 calls"."""

from __future__ import annotations


def counted(n: int, word: str) -> str:
    return f"{n:,} {word if n == 1 else word + 's'}"
