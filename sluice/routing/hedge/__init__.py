"""Hedged requests: when a call's attempt has not answered after a delay, a copy goes to
another backend and the first good answer wins (Envoy's `hedge_on_per_try_timeout`). A layer
around the planner's drivers: `policy` (settings, delay, budget, counts, the layer's
install), `race` (the decisions and the two drivers), `silence` (the pool cost it brings);
and what the programs wire in: `client` (the client's option), `flags` (the balancer's),
`report` (metrics, Health's fields), `marks` (an attempt span's attributes)."""

from sluice.routing.hedge.policy import AUTO, MIN_SAMPLES, HedgeSettings, Hedging
from sluice.routing.hedge.race import CROWDED_S, LOST, Race, hedged, hedged_sync
from sluice.routing.hedge.silence import STALL_FACTOR, Silence

__all__ = [
    "AUTO",
    "CROWDED_S",
    "LOST",
    "MIN_SAMPLES",
    "STALL_FACTOR",
    "HedgeSettings",
    "Hedging",
    "Race",
    "Silence",
    "hedged",
    "hedged_sync",
]
