"""Sluice's Python client: `SluiceClient` (blocking) and `AsyncSluiceClient` (asyncio)."""

from sluice.client.client import AsyncSluiceClient, Prediction, SluiceClient

__all__ = ["AsyncSluiceClient", "Prediction", "SluiceClient"]
