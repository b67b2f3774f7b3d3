"""Hedged requests: when a call's attempt has not answered after a delay, a copy goes to
another backend and the first good answer wins (Envoy's `hedge_on_per_try_timeout`). A layer
around the planner's drivers: `policy` (settings, delay, budget, counts), `race` (the
decisions and the two drivers), `silence` (the pool cost it brings)."""

from sluice.routing.hedge.policy import AUTO, MIN_SAMPLES, HedgeSettings, Hedging
from sluice.routing.hedge.race import CROWDED_S, LOST, Future, Race, hedged, hedged_sync
from sluice.routing.hedge.silence import STALL_FACTOR, Silence

__all__ = [
    "AUTO",
    "CROWDED_S",
    "LOST",
    "MIN_SAMPLES",
    "STALL_FACTOR",
    "Future",
    "HedgeSettings",
    "Hedging",
    "Race",
    "Silence",
    "hedged",
    "hedged_sync",
]
