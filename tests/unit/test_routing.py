"""The balancer's routing core: ring fairness and stability, bounded loads, P2C, the
breaker under a fake clock, the retry budget, and the pool's choices."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.routing.breaker import Breaker, BreakerSettings, State
from sluice.routing.budget import RetryBudget
from sluice.routing.p2c import PeakEwma, p2c
from sluice.routing.pool import Backend, Health, Pool
from sluice.routing.ring import MaglevRing, load_bound, pick_bounded

SMALL_TABLE = 5_003  # prime; keeps property tests quick


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(count)]


@settings(max_examples=20, deadline=None)
@given(st.integers(3, 10), st.integers(0, 1000))
def test_each_backend_gets_its_fair_share_of_keys(n: int, salt: int) -> None:
    ring = MaglevRing([f"10.0.{salt}.{i}:8001" for i in range(n)])
    shares = Counter(ring.owner(k) for k in keys(40_000, seed=salt))
    fair = 40_000 / n
    for node in ring.nodes:
        assert abs(shares[node] - fair) <= 0.10 * fair, (node, shares[node], fair)


@settings(max_examples=20, deadline=None)
@given(st.integers(3, 10), st.booleans(), st.integers(0, 1000))
def test_a_join_or_leave_moves_about_one_nth_of_keys(n: int, join: bool, salt: int) -> None:
    nodes = [f"b{salt}-{i}" for i in range(n)]
    before = MaglevRing(nodes, SMALL_TABLE)
    after = MaglevRing([*nodes, "newcomer"] if join else nodes[1:], SMALL_TABLE)
    sample = keys(20_000, seed=salt)
    moved = sum(before.owner(k) != after.owner(k) for k in sample) / len(sample)
    expected = 1 / (n + 1) if join else 1 / n
    assert moved <= 1.6 * expected, (moved, expected)
    if not join:  # keys of the survivors stay where they were... up to Maglev's small churn
        kept = [k for k in sample if before.owner(k) != nodes[0]]
        stayed = sum(before.owner(k) == after.owner(k) for k in kept) / len(kept)
        assert stayed >= 0.9


def test_preference_lists_every_backend_once_owner_first() -> None:
    ring = MaglevRing(["a", "b", "c", "d"], SMALL_TABLE)
    for k in keys(200):
        order = list(ring.preference(k))
        assert order[0] == ring.owner(k)
        assert sorted(order) == ["a", "b", "c", "d"]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 8),
    factor=st.sampled_from([1.1, 1.25, 1.5, 2.0]),
    hot=st.integers(1, 5),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=400),
)
def test_no_backend_exceeds_the_bounded_load_under_skew(
    n: int, factor: float, hot: int, steps: list[tuple[bool, int]]
) -> None:
    """A skewed stream (most calls on `hot` keys) of arrivals and completions: every placement
    keeps its backend within ceil(c x mean) counting itself."""
    nodes = [f"n{i}" for i in range(n)]
    ring = MaglevRing(nodes, SMALL_TABLE)
    load: Counter[str] = Counter()
    placed: list[str] = []
    for arrive, k in steps:
        if arrive or not placed:
            key = k % hot if k % 10 else k  # 90% of calls on a few hot keys
            node = pick_bounded(ring, key, nodes, lambda b: load[b], factor)
            assert node is not None
            total = sum(load.values()) + 1
            load[node] += 1
            placed.append(node)
            assert load[node] <= math.ceil(factor * total / n)
        else:
            load[placed.pop(k % len(placed))] -= 1


def test_load_bound() -> None:
    assert load_bound(0, 3, 1.25) == 1
    assert load_bound(11, 3, 1.25) == 5


def test_p2c_two_choices_are_always_distinct() -> None:
    rng = random.Random(1)
    seen: list[tuple[int, int]] = []

    def cost(x: int) -> float:
        seen.append((x, len(seen)))
        return float(x)

    for _ in range(500):
        seen.clear()
        choice = p2c([0, 1, 2, 3, 4], cost, rng)
        assert seen[0][0] != seen[1][0]
        assert choice == min(seen[0][0], seen[1][0])
    assert p2c([7], cost, rng) == 7 and p2c([], cost, rng) is None


def test_peak_ewma_jumps_up_and_decays_down() -> None:
    clock = FakeClock()
    ewma = PeakEwma(decay_s=1.0, initial_s=0.001, clock=clock)
    ewma.observe(0.100)
    assert ewma.estimate == pytest.approx(0.100)  # peaks are taken at once
    clock.now += 1.0
    ewma.observe(0.001)
    assert ewma.estimate == pytest.approx(0.100 * math.exp(-1) + 0.001 * (1 - math.exp(-1)))
    ewma.fail()
    assert ewma.estimate == pytest.approx(1.0)  # a fast failure looks slow


def breaker(clock: FakeClock, **kw: float) -> Breaker:
    values = {"failures_to_open": 3, "successes_to_close": 2, "base_cooldown_s": 1.0}
    values.update(kw)
    return Breaker(BreakerSettings(**values, jitter=0.0), clock, random.Random(0))  # type: ignore[arg-type]


def test_breaker_opens_after_consecutive_failures_only() -> None:
    clock = FakeClock()
    b = breaker(clock)
    for _ in range(2):
        assert b.acquire()
        b.failure()
    b.success()  # the streak is broken
    for _ in range(2):
        b.failure()
    assert b.state is State.CLOSED
    b.failure()
    assert b.state is State.OPEN and not b.available() and not b.acquire()


def test_breaker_half_open_lets_one_probe_and_closes_after_m_successes() -> None:
    clock = FakeClock()
    b = breaker(clock)
    for _ in range(3):
        b.failure()
    clock.now += 0.999
    assert not b.available()
    clock.now += 0.002
    assert b.available() and b.state is State.HALF_OPEN
    assert b.acquire()
    assert not b.acquire()  # one probe at a time
    b.success()
    assert b.state is State.HALF_OPEN and b.acquire()
    b.success()
    assert b.state is State.CLOSED and b.trips == 0


def test_breaker_failed_probe_reopens_with_longer_cooldown() -> None:
    clock = FakeClock()
    b = breaker(clock, max_cooldown_s=3.0)
    for _ in range(3):
        b.failure()
    cooldowns = []
    for _ in range(4):
        opened = clock.now
        cooldowns.append(b.open_until - opened)
        clock.now = b.open_until
        assert b.acquire()
        b.failure()
    assert cooldowns == [1.0, 2.0, 3.0, 3.0]  # doubling, capped


def test_breaker_jitter_spreads_cooldowns() -> None:
    clock = FakeClock()
    spread = set()
    for seed in range(20):
        b = Breaker(BreakerSettings(failures_to_open=1, jitter=0.2), clock, random.Random(seed))
        b.failure()
        spread.add(round(b.open_until - clock.now, 6))
        assert 0.4 <= b.open_until - clock.now <= 0.6
    assert len(spread) > 10


def test_retry_budget_allows_about_the_ratio_plus_a_floor() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, min_per_s=10, clock=clock)
    spent_floor = sum(budget.withdraw() for _ in range(50))
    assert spent_floor == 10  # the floor's tokens, then nothing
    allowed = 0
    for _ in range(1000):  # every call fails and wants a retry
        budget.deposit()
        allowed += budget.withdraw()
    assert allowed == pytest.approx(200, abs=2)
    clock.now += 1.0
    assert sum(budget.withdraw() for _ in range(50)) == 10


def make_pool(n: int, clock: FakeClock) -> Pool:
    pool = Pool(
        breaker=BreakerSettings(failures_to_open=2, jitter=0.0),
        clock=clock,
        rng=random.Random(0),
        table_size=SMALL_TABLE,
    )
    pool.set_addresses(f"h{i}:1" for i in range(n))
    return pool


def test_pool_keys_stick_to_one_backend_and_move_when_it_is_out() -> None:
    clock = FakeClock()
    pool = make_pool(3, clock)
    owners = {k: pool.choose(k).backend for k in keys(50)}
    assert all(pool.choose(k).backend is owners[k] for k in owners)
    assert len({b.address for b in owners.values() if b}) == 3
    victim = pool.backends["h0:1"]
    victim.health = Health.NOT_SERVING
    for k, owner in owners.items():
        chosen = pool.choose(k).backend
        assert chosen is not victim
        if owner is not victim:
            assert chosen is owner  # only the victim's keys move


def test_pool_breaker_takes_a_failing_backend_out_and_back() -> None:
    clock = FakeClock()
    pool = make_pool(2, clock)
    bad = pool.backends["h1:1"]
    for _ in range(2):
        assert pool.start(bad)
        pool.finish(bad, 0.001, "failed")
    assert bad.breaker.state is State.OPEN
    assert all(pool.choose(None).backend is not bad for _ in range(50))
    clock.now = bad.breaker.open_until
    assert pool.start(bad)  # the probe
    pool.finish(bad, 0.001, "ok")
    assert pool.start(bad)
    pool.finish(bad, 0.001, "ok")
    assert bad.breaker.state is State.CLOSED


def trip(pool: Pool, backend: Backend) -> None:
    for _ in range(pool.breaker_settings.failures_to_open):
        assert pool.start(backend)
        pool.finish(backend, 0.001, "failed")


def test_no_run_of_failures_can_make_the_pool_refuse_every_call() -> None:
    """One caller's bad requests could trip every breaker: past the panic threshold (half of
    the serving backends held out) the breakers are overruled, as in Envoy."""
    pool = make_pool(3, FakeClock())
    first, second, third = pool.backends.values()
    trip(pool, first)
    assert not pool.panicking()  # one of three out: it stays out
    assert {pool.choose(None).backend for _ in range(50)} == {second, third}
    trip(pool, second)
    assert pool.panicking()  # two of three out: everyone serves again
    chosen = {pool.choose(None).backend for _ in range(100)}
    assert chosen == {first, second, third}
    assert pool.start(first) and pool.serving()
    pool.finish(first, 0.001, "ok")
    third.health = Health.NOT_SERVING  # what the health watch says is never overruled
    assert {pool.choose(None).backend for _ in range(50)} == {first, second}


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 7), max_size=20))
def test_at_least_the_panic_threshold_of_serving_backends_stay_routable(
    n: int, failing: list[int]
) -> None:
    pool = make_pool(n, FakeClock())
    backends = list(pool.backends.values())
    for i in failing:
        backend = backends[i % n]
        if pool.start(backend):
            pool.finish(backend, 0.001, "failed")
    routable: list[Backend] = []  # every backend a call may still go to
    while (backend := pool.choose(None, routable).backend) is not None:
        routable.append(backend)
    assert routable, "the pool refused every call"
    assert len(routable) >= min(n, -(-n // 2))  # ceil(n / 2) of them, or all when panicking


def test_pool_least_loaded_avoids_the_busy_backend() -> None:
    clock = FakeClock()
    pool = make_pool(2, clock)
    busy = pool.backends["h0:1"]
    busy.in_flight = 50
    picks = Counter(pool.choose(None).backend.address for _ in range(100))  # type: ignore[union-attr]
    assert picks["h1:1"] == 100


def test_pool_says_why_nothing_is_available() -> None:
    clock = FakeClock()
    assert "no backends are configured" in make_pool(0, clock).choose(None).why
    pool = make_pool(2, clock)
    for b in pool.backends.values():
        b.health = Health.NOT_SERVING
    why = pool.choose(7).why
    assert "h0:1 not_serving" in why and "h1:1 not_serving" in why
    assert not pool.serving()
    assert "every backend was tried" in pool.choose(None, list(pool.backends.values())).why


async def test_discovery_merges_flags_file_and_dns(tmp_path: Path) -> None:
    from sluice.balancer.discovery import Discovery

    listing = tmp_path / "backends"
    listing.write_text("10.0.0.2:8001  # a comment\n\n10.0.0.1:8001\n")
    discovery = Discovery(["10.0.0.1:8001"], str(listing), "localhost:8001")
    found = await discovery.current()
    assert found[:2] == ["10.0.0.1:8001", "10.0.0.2:8001"]  # flags first, no duplicates
    assert "127.0.0.1:8001" in found or "[::1]:8001" in found  # localhost, resolved
    listing.write_text("10.0.0.3:8001\n")
    assert "10.0.0.3:8001" in await discovery.current()
    listing.unlink()  # unreadable: the last answer stands
    assert "10.0.0.3:8001" in await discovery.current()
