"""The balancer's membership against fake transports: what discovery lists is what the pool
holds, each backend's health and models reach the pool, and readiness hears of each change."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from sluice.balancer.discovery import Discovery
from sluice.balancer.membership import Membership
from sluice.balancer.upstream import Models
from sluice.routing.pool import Health, Pool


class FakeTransport:
    def __init__(self, address: str) -> None:
        self.address = address
        self.health: Callable[[str, bool, str], None] | None = None
        self.models: Callable[[Models | None, str], None] | None = None
        self.every_s = 0.0
        self.closed = 0

    def watch_health(self, report: Callable[[str, bool, str], None]) -> None:
        self.health = report

    def watch_models(self, every_s: float, report: Callable[[Models | None, str], None]) -> None:
        self.every_s, self.models = every_s, report

    async def close(self) -> None:
        await asyncio.sleep(0)
        self.closed += 1


class Fixture:
    def __init__(self) -> None:
        self.pool = Pool()
        self.transports: dict[str, FakeTransport] = {}
        self.told = 0  # times readiness was told of a change
        self.membership = Membership(self.pool, self.connect, self.changed, models_refresh_s=0.25)

    def connect(self, address: str) -> FakeTransport:
        self.transports[address] = FakeTransport(address)
        return self.transports[address]

    def changed(self) -> None:
        self.told += 1


async def test_the_pool_holds_what_discovery_lists_and_gone_backends_are_closed() -> None:
    fx = Fixture()
    fx.membership.apply(["a:1", "b:1"])
    assert sorted(fx.pool.backends) == ["a:1", "b:1"]
    assert fx.pool.backends["a:1"].transport is fx.transports["a:1"]
    assert all(t.health is not None and t.every_s == 0.25 for t in fx.transports.values())
    assert fx.told == 1
    gone = fx.transports["a:1"]
    fx.membership.apply(["b:1", "c:1"])
    assert sorted(fx.pool.backends) == ["b:1", "c:1"]
    assert fx.told == 2
    await fx.membership.close()  # also waits for the closes under way
    assert gone.closed == 1
    assert [fx.transports[a].closed for a in ("b:1", "c:1")] == [1, 1]


async def test_health_reports_reach_the_pool_and_readiness() -> None:
    fx = Fixture()
    fx.membership.apply(["a:1"])
    backend = fx.pool.backends["a:1"]
    report = fx.transports["a:1"].health
    assert report is not None
    report(Health.SERVING, False, "")
    assert backend.health == Health.SERVING and fx.pool.serving()
    assert fx.told == 2
    before = backend.failures
    report(
        Health.NOT_SERVING, True, "refuses connections"
    )  # unreachable: a failure against its breaker
    assert backend.health == Health.NOT_SERVING and not fx.pool.serving()
    assert backend.failures == before + 1
    assert fx.told == 3


async def test_models_are_learned_and_logged_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fx = Fixture()
    fx.membership.apply(["a:1"])
    learn = fx.transports["a:1"].models
    assert learn is not None
    with caplog.at_level(logging.INFO, logger="sluice.balancer"):
        learn({"digits": ("2", "1")}, "digits")
        learn({"digits": ("2", "1")}, "digits")  # the same again: nothing new
        learn(None, "")
    backend = fx.pool.backends["a:1"]
    assert backend.models is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend a:1")]
    assert lines == [
        "backend a:1 serves digits (versions 2, 1); default digits",
        "backend a:1 lists no models: it may take any call",
    ]


async def test_the_breaker_tick_tells_readiness_on_its_clock() -> None:
    slept: list[float] = []

    class Stop(Exception):
        pass

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) > 3:
            raise Stop

    fx = Fixture()
    fx.membership = Membership(fx.pool, fx.connect, fx.changed, models_refresh_s=1.0, sleep=sleep)
    with pytest.raises(Stop):
        await fx.membership.tick(0.5)
    assert slept == [0.5] * 4
    assert fx.told == 3


async def test_discovery_applies_only_what_was_not_applied_already() -> None:
    applied: list[list[str]] = []
    flags = Discovery(["a:1", "b:1"])
    await flags.watch(1.0, applied.append, last=["a:1", "b:1"])  # applied before listening
    assert applied == []
    await flags.watch(1.0, applied.append)
    assert applied == [["a:1", "b:1"]]
