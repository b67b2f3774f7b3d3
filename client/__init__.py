"""Sluice's Python client: `SluiceClient` (blocking) and `AsyncSluiceClient` (asyncio)."""

from sluice.client.aio import AsyncSluiceClient
from sluice.client.blocking import SluiceClient
from sluice.client.core import Prediction

__all__ = ["AsyncSluiceClient", "Prediction", "SluiceClient"]
