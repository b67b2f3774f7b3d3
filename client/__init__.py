"""Sluice's Python client: `SluiceClient` (blocking) and `AsyncSluiceClient` (asyncio)."""

from client.client import AsyncSluiceClient, Prediction, SluiceClient

__all__ = ["AsyncSluiceClient", "Prediction", "SluiceClient"]
