"""How a count reads in a message: "1 call", "2 calls", "1,024 calls"."""

from __future__ import annotations


def counted(n: int, word: str, many: str = "") -> str:
    """`n` and `word`, plural unless n is 1 (`many`: an irregular plural)."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"
