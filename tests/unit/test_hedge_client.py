"""Hedging in the proxyless client: either client given several servers hedges as the
balancer does; one target refuses the option aloud."""

from __future__ import annotations

import pytest

from sluice.client import AsyncSluiceClient, SluiceClient

SERVERS = ["127.0.0.1:1", "127.0.0.1:2"]  # never dialled: channels connect on first use


@pytest.mark.parametrize(("hedge_after_ms", "after_s"), [(5, 0.005), ("auto", None)])
async def test_the_async_client_over_several_servers_hedges(
    hedge_after_ms: float | str, after_s: float | None
) -> None:
    async with AsyncSluiceClient(SERVERS, hedge_after_ms=hedge_after_ms) as client:
        router = client._router
        assert router is not None and router.hedging is not None
        assert router.hedging.settings.after_s == after_s


@pytest.mark.parametrize("hedge_after_ms", [None, 0, 0.0, "0", "off"])
async def test_hedging_is_off_unless_asked_for(hedge_after_ms: float | str | None) -> None:
    async with AsyncSluiceClient(SERVERS, hedge_after_ms=hedge_after_ms) as client:
        assert client._router is not None and client._router.hedging is None


async def test_one_target_has_nothing_to_hedge_to() -> None:
    with pytest.raises(ValueError, match=r"several targets.*--hedge-after-ms"):
        AsyncSluiceClient(SERVERS[0], hedge_after_ms=5)


@pytest.mark.parametrize(("hedge_after_ms", "after_s"), [(5, 0.005), ("auto", None)])
def test_the_blocking_client_over_several_servers_hedges(
    hedge_after_ms: float | str, after_s: float | None
) -> None:
    with SluiceClient(SERVERS, hedge_after_ms=hedge_after_ms) as client:
        router = client._router
        assert router is not None and router.hedging is not None
        assert router.hedging.settings.after_s == after_s
    with SluiceClient(SERVERS, hedge_after_ms=0) as client:  # off is no hedging
        assert client._router is not None and client._router.hedging is None
    with pytest.raises(ValueError, match=r"several targets.*--hedge-after-ms"):
        SluiceClient(SERVERS[0], hedge_after_ms=5)
