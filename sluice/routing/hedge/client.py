"""Hedging in the proxyless client (sluice.client.core), given several servers: its
`hedge_after_ms` option, as the balancer's --hedge-after-ms (a balancer hedges itself)."""

from __future__ import annotations

from collections.abc import Sequence

from sluice.routing.hedge.policy import HedgeSettings, Hedging


def option(hedge_after_ms: float | str | None, targets: Sequence[str]) -> Hedging | None:
    """The hedging `hedge_after_ms` asks for (None or 0: off; ms or "auto"); it needs
    several targets, ValueError otherwise."""
    if hedge_after_ms is None or (not isinstance(hedge_after_ms, str) and not hedge_after_ms):
        return None  # 0 and 0.0 are off, as "0" is (str(0.0) is not a word parse takes)
    hedge = HedgeSettings.parse(str(hedge_after_ms))
    if hedge is not None and len(targets) < 2:
        raise ValueError(
            "hedge_after_ms needs several targets (servers this client balances); "
            "for a balancer, start it with --hedge-after-ms"
        )
    return Hedging.of(hedge)
