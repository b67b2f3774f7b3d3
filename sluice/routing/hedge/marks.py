"""What hedging adds to an attempt's CLIENT span (sluice.runtime.spans): a hedge is marked
as one and says whom it went beside; an attempt it cancelled says so, no fault of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sluice.routing.hedge.race import LOST
from sluice.routing.plan import Attempt

HEDGE = "sluice.hedge"  # on an attempt's span: a second copy of an attempt still out
CANCELLED = "sluice.cancelled"  # on an attempt's span: why it was cancelled unanswered


def beside(attempt: Attempt, out: Sequence[str]) -> str:
    """Why `attempt` went while the attempts to `out` (addresses) are out ("": not a hedge)."""
    return f"hedge beside {out[0]}, not answered yet" if attempt.hedge and out else ""


def marked(attempt: Attempt) -> dict[str, bool]:
    return {HEDGE: True} if attempt.hedge else {}


def cancelled(error: BaseException | None) -> dict[str, str]:
    """The attributes of an attempt that ended with `error`: LOST when another answered."""
    lost = isinstance(error, asyncio.CancelledError) and str(error) == LOST
    return {CANCELLED: LOST} if lost else {}
