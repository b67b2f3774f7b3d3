"""Hedging's flags, a settings group a program's settings dataclass inherits (the balancer's:
`--hedge-after-ms`, `--hedge-ratio`, with their `SLUICE_` variables, sluice.runtime.config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.routing.hedge.policy import HedgeSettings


@dataclass(frozen=True)
class HedgeFlags:
    hedge_after_ms: str = field(
        default="",
        metadata={
            "help": "send a second copy of a call (a hedge) to another server when its attempt "
            "has not answered after this many ms, or 'auto' (past the servers' recent p99 or "
            "twice their median, whichever is larger); the first OK answer wins, the other is "
            "cancelled (default: off)"
        },
    )
    hedge_ratio: float = field(
        default=0.1, metadata={"help": "hedges allowed as a share of calls (their own budget)"}
    )

    @property
    def hedge(self) -> HedgeSettings | None:
        """Hedging, as --hedge-after-ms and --hedge-ratio set it (None: off; ValueError when
        either is bad, so a program reads it once at start)."""
        return HedgeSettings.parse(self.hedge_after_ms, self.hedge_ratio)
