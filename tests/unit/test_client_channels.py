"""The options of the channels a client makes: with several targets, keepalive pings and a
connect bound, so a target that goes dark (no RST) fails its calls within their deadline and
the planner retries them on another; with one target, grpc's defaults. No socket is used:
channels are made, never connected."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sluice.client import AsyncSluiceClient, SluiceClient, aio, blocking, core
from sluice.client.core import channel_options, keepalive_of

TWO = ["127.0.0.1:1", "127.0.0.1:2"]  # never dialled: no call is made
KEEPALIVE_KEYS = {"grpc.keepalive_time_ms", "grpc.min_reconnect_backoff_ms"}


def options_of(settings: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(settings)


def test_keepalive_pings_while_calls_are_out_and_bounds_a_connect() -> None:
    got = options_of(channel_options(1024, (), keepalive_s=0.3))
    assert got["grpc.keepalive_time_ms"] == 90  # 0.3 x keepalive_s without a byte read
    assert got["grpc.keepalive_timeout_ms"] == 300
    assert got["grpc.http2.ping_timeout_ms"] == 300
    assert got["grpc.keepalive_permit_without_calls"] == 0  # idle clients do not ping
    assert got["grpc.http2.max_pings_without_data"] == 0
    assert got["grpc.http2.bdp_probe"] == 0
    # grpc bounds a connect attempt by max(min_reconnect_backoff, the backoff so far).
    assert got["grpc.min_reconnect_backoff_ms"] == 300
    assert got["grpc.max_reconnect_backoff_ms"] == 300
    assert got["grpc.initial_reconnect_backoff_ms"] <= 300
    # Found within (1 + 0.3) x keepalive_s, well within a 1 s deadline.
    assert got["grpc.keepalive_time_ms"] + got["grpc.keepalive_timeout_ms"] < 500
    assert got["grpc.max_receive_message_length"] == 1024


def test_no_keepalive_leaves_grpcs_defaults() -> None:
    got = options_of(channel_options(1024, ()))
    assert not KEEPALIVE_KEYS & got.keys()


def test_the_callers_options_come_last_so_they_win() -> None:
    settings = channel_options(1024, [("grpc.keepalive_time_ms", 5000)], keepalive_s=0.3)
    assert settings[-1] == ("grpc.keepalive_time_ms", 5000)


def test_keepalive_is_on_by_default_with_several_targets_only() -> None:
    assert keepalive_of(None, TWO) == core.KEEPALIVE_S > 0
    assert keepalive_of(None, TWO[:1]) == 0.0
    assert keepalive_of(0.5, TWO[:1]) == 0.5  # asked for, one target gets it too
    assert keepalive_of(0, TWO) == 0.0
    with pytest.raises(ValueError, match="keepalive_s"):
        keepalive_of(-1.0, TWO)


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, dict[str, Any]]]:
    """The options of each channel the clients make, by target (real channels, unused)."""
    seen: dict[str, dict[str, Any]] = {}
    blocking_channel, aio_channel = blocking.blocking_channel, aio.aio_channel

    def record_blocking(target: str, tls: Any, settings: list[tuple[str, Any]]) -> Any:
        seen[target] = options_of(settings)
        return blocking_channel(target, tls, settings)

    def record_aio(target: str, tls: Any, settings: list[tuple[str, Any]]) -> Any:
        seen[target] = options_of(settings)
        return aio_channel(target, tls, settings)

    monkeypatch.setattr(blocking, "blocking_channel", record_blocking)
    monkeypatch.setattr(aio, "aio_channel", record_aio)
    yield seen


def test_a_blocking_client_of_several_targets_keeps_them_alive(
    made: dict[str, dict[str, Any]],
) -> None:
    with SluiceClient(TWO):
        pass
    assert sorted(made) == TWO
    assert all(m["grpc.keepalive_timeout_ms"] == 300 for m in made.values())


def test_a_blocking_client_of_one_target_is_left_as_grpc_makes_it(
    made: dict[str, dict[str, Any]],
) -> None:
    with SluiceClient(TWO[0]):
        pass
    assert not KEEPALIVE_KEYS & made[TWO[0]].keys()


async def test_an_asyncio_client_takes_keepalive_s(made: dict[str, dict[str, Any]]) -> None:
    async with AsyncSluiceClient(TWO, keepalive_s=0.5):
        pass
    assert all(m["grpc.keepalive_timeout_ms"] == 500 for m in made.values())
    async with AsyncSluiceClient(TWO, keepalive_s=0):
        pass
    assert all(not KEEPALIVE_KEYS & m.keys() for m in made.values())


def test_a_negative_keepalive_is_refused() -> None:
    with pytest.raises(ValueError, match="keepalive_s"):
        SluiceClient(TWO, keepalive_s=-0.1)
