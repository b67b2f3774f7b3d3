"""Sluice's Python client: `SluiceClient` (blocking) and `AsyncSluiceClient` (asyncio)."""

from sluice.core.paths import sole_name

sole_name(__name__, "sluice.client")

from sluice.client.aio import AsyncSluiceClient
from sluice.client.blocking import SluiceClient
from sluice.client.core import Prediction

__all__ = ["AsyncSluiceClient", "Prediction", "SluiceClient"]
