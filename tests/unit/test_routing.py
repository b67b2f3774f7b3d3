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
from sluice.routing.hedge import Silence
from sluice.routing.p2c import PeakEwma, p2c
from sluice.routing.pool import Backend, Health, OutlierSettings, Pool
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
    """One caller's bad requests could trip every breaker: breakers may hold out at most
    max_ejection_percent (50%) of the live backends, rounded down; a breaker that would
    open beyond that stays closed, its failures still counted."""
    pool = make_pool(3, FakeClock())
    first, second, third = pool.backends.values()
    assert pool.ejection_cap() == 1
    trip(pool, first)
    assert first.breaker.state is State.OPEN and not pool.panicking()
    assert {pool.choose(None).backend for _ in range(50)} == {second, third}
    trip(pool, second)  # beyond the cap: it stays in
    assert second.breaker.state is State.CLOSED and second.failures == 2
    assert pool.held_out() == 1 and not pool.panicking()
    assert routable(pool) == {second, third}  # (P2C shuns second's failures' latency)
    third.health = Health.NOT_SERVING  # what the health watch says is never overruled
    assert {pool.choose(None).backend for _ in range(50)} == {second}


def routable(pool: Pool) -> set[Backend]:
    tried: list[Backend] = []
    while (backend := pool.choose(None, tried).backend) is not None:
        tried.append(backend)
    return set(tried)


def test_when_the_live_set_shrinks_under_open_breakers_they_are_overruled() -> None:
    """Held out beyond the cap is possible only when backends go NOT_SERVING; then every
    breaker is overruled (the panic threshold is 100% - max_ejection_percent)."""
    pool = make_pool(3, FakeClock())
    first, second, third = pool.backends.values()
    trip(pool, first)
    second.health = third.health = Health.NOT_SERVING  # one live backend: cap 0
    assert pool.ejection_cap() == 0 and pool.panicking()
    assert pool.choose(None).backend is first and pool.serving()
    assert pool.start(first)
    pool.finish(first, 0.001, "ok")
    second.health = Health.SERVING  # two live: cap 1, first may stay out again
    assert not pool.panicking()
    assert {pool.choose(None).backend for _ in range(50)} == {second}


def test_not_serving_is_never_capped() -> None:
    pool = make_pool(3, FakeClock())
    for backend in pool.backends.values():
        backend.health = Health.NOT_SERVING
        for _ in range(pool.breaker_settings.failures_to_open):
            pool.unreachable(backend)  # the watch broke: counted, and not capped
    assert all(b.breaker.state is State.OPEN for b in pool.backends.values())
    assert pool.choose(None).backend is None and not pool.serving()


@pytest.mark.parametrize(("percent", "n", "cap"), [(0, 3, 0), (50, 1, 0), (50, 5, 2), (100, 3, 3)])
def test_max_ejection_percent_is_a_share_of_the_live_backends_rounded_down(
    percent: float, n: int, cap: int
) -> None:
    pool = Pool(
        breaker=BreakerSettings(failures_to_open=2, jitter=0.0),
        clock=FakeClock(),
        rng=random.Random(0),
        table_size=SMALL_TABLE,
        max_ejection_percent=percent,
    )
    pool.set_addresses(f"h{i}:1" for i in range(n))
    assert pool.ejection_cap() == cap
    for backend in list(pool.backends.values()):
        trip(pool, backend)
    assert pool.held_out() == cap
    tried: list[Backend] = []
    while (backend := pool.choose(None, tried).backend) is not None:
        tried.append(backend)
    assert len(tried) == n - cap
    with pytest.raises(ValueError):
        Pool(max_ejection_percent=101)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["failed", "slow", "ok"])), max_size=60),
)
def test_at_least_the_panic_threshold_of_serving_backends_stay_routable(
    n: int, failing: list[tuple[int, str]]
) -> None:
    """Whatever mix of failures, timeouts and slow answers callers provoke, breakers and
    outlier ejection hold out at most half of the live backends."""
    clock = FakeClock()
    pool = make_pool(n, clock)
    backends = list(pool.backends.values())
    for i, verdict in failing:
        backend = backends[i % n]
        if pool.start(backend):
            clock.now += 0.1
            pool.finish(backend, 0.001 if verdict == "failed" else 0.5 * (i % 3), verdict)
        assert pool.held_out() <= pool.ejection_cap()
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


def picks_of(pool: Pool, calls: int = 100) -> Counter[str]:
    return Counter(pool.choose(None).backend.address for _ in range(calls))  # type: ignore[union-attr]


def test_a_backend_silent_on_an_attempt_given_up_on_is_shunned_until_it_answers() -> None:
    """A hedge cancelled the attempt (its in-flight slot is back, its latency estimate
    untouched), but the backend still owes that answer: calls stay off it."""
    clock = FakeClock()
    pool = make_pool(2, clock)
    silence = pool.cost = Silence(pool)  # hedging's rule
    paused, other = pool.backends["h0:1"], pool.backends["h1:1"]
    assert pool.start(paused)
    clock.now += 0.006
    pool.finish(paused, 0.006, "neutral", answered=False)
    assert paused.in_flight == 0 and silence.silence(paused) == pytest.approx(0.006)
    assert picks_of(pool)["h1:1"] == 100
    # It answers another attempt (a hedge sent to it): what it owed is paid, calls return.
    assert pool.start(paused) and pool.start(other)
    pool.finish(paused, 0.001, "ok")
    assert silence.silence(paused) == 0.0
    pool.finish(other, 0.001, "ok")
    assert 30 < picks_of(pool)["h0:1"] < 70


def test_a_backend_silent_past_its_mean_latency_loses_to_one_with_slow_peaks() -> None:
    """On a loaded host the others' peak estimates reach tens of ms; a backend silent for
    3x its own mean latency is stalled and loses anyway, and wins again once it answers."""
    clock = FakeClock()
    pool = make_pool(2, clock)
    pool.cost = Silence(pool)  # hedging's rule
    paused, other = pool.backends["h0:1"], pool.backends["h1:1"]
    for backend in (paused, other):
        for _ in range(20):
            backend.latency.observe(0.002)
    other.latency.observe(0.040)  # a slow peak
    assert pool.start(paused)
    clock.now += 0.005  # under the other's peak estimate, but 2.5x its own mean
    assert picks_of(pool)["h0:1"] == 100  # its silence alone does not outweigh the peak
    clock.now += 0.002  # 3.5x: stalled
    assert picks_of(pool)["h1:1"] == 100
    pool.finish(paused, 0.007, "ok")
    assert picks_of(pool)["h0:1"] == 100  # the other's peak costs more


def test_a_stalled_owners_keys_go_on_along_the_ring_until_it_answers() -> None:
    """Its attempt cancelled by a hedge, the owner holds no call in flight and is within
    its load bound: its silence moves its keys to the next on each key's ring."""
    clock = FakeClock()
    pool = make_pool(3, clock)
    silence = pool.cost = Silence(pool)  # hedging's rule
    for backend in pool.backends.values():
        for _ in range(20):
            backend.latency.observe(0.002)
    sample = keys(60)
    owners = {k: pool.choose(k).backend for k in sample}
    paused = pool.backends["h0:1"]
    mine = [k for k in sample if owners[k] is paused]
    assert mine
    assert pool.start(paused)
    clock.now += 0.007
    pool.finish(paused, 0.007, "neutral", answered=False)
    assert silence.stalled(paused)
    assert all(pool.choose(k).backend is not paused for k in mine)
    assert all(pool.choose(k).backend is owners[k] for k in sample if k not in mine)
    assert pool.start(paused)
    pool.finish(paused, 0.001, "ok")  # it answers: its keys come back
    assert all(pool.choose(k).backend is paused for k in mine)


def test_a_silent_backend_with_nothing_in_flight_is_tried_again_after_the_probe_delay() -> None:
    clock = FakeClock()
    pool = make_pool(2, clock)
    silence = pool.cost = Silence(pool)  # hedging's rule
    paused = pool.backends["h0:1"]
    assert pool.start(paused)
    clock.now += 0.006
    pool.finish(paused, 0.006, "neutral", answered=False)
    clock.now += pool.probe_after_s
    assert silence.silence(paused) == 0.0 and 30 < picks_of(pool)["h0:1"] < 70
    # The probe is owed from its own sending, not from the attempt forgiven.
    assert pool.start(paused)
    assert silence.silence(paused) == 0.0
    clock.now += 0.002
    assert silence.silence(paused) == pytest.approx(0.002)


def test_silence_counts_an_attempt_in_flight_from_its_sending_and_ends_with_an_answer() -> None:
    clock = FakeClock()
    pool = make_pool(2, clock)
    silence = pool.cost = Silence(pool)  # hedging's rule
    backend = pool.backends["h0:1"]
    assert pool.start(backend)
    clock.now += 0.5  # well past the probe delay: an attempt in flight is never forgiven
    assert pool.start(backend)
    assert silence.silence(backend) == pytest.approx(0.5)
    pool.finish(backend, 0.5, "ok")
    assert silence.silence(backend) == 0.0  # it answers: the other is counted from now
    clock.now += 0.003
    assert silence.silence(backend) == pytest.approx(0.003)
    pool.withdraw(backend)  # never sent: owes nothing
    assert backend.owed == 0 and silence.silence(backend) == 0.0


def test_without_hedging_a_backend_holding_a_long_call_still_takes_its_share() -> None:
    """The silence rule is hedging's: off, one long call does not turn its backend's keys
    and least-loaded share away (it would get nothing else until that call ended)."""
    clock = FakeClock()
    pool = make_pool(2, clock)
    assert not isinstance(pool.cost, Silence)
    a = pool.backends["h0:1"]
    for backend in pool.backends.values():
        for _ in range(30):
            assert pool.start(backend)
            clock.now += 0.02
            pool.finish(backend, 0.02, "ok")
    assert pool.start(a)  # one long call
    assert pool.start(pool.backends["h1:1"])  # and one on the other, begun later
    clock.now += 100.0
    assert not pool.cost.shunned(a)
    assert picks_of(pool)["h0:1"] > 10
    assert any(pool.choose(k).backend is a for k in keys(50))


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


def test_keys_of_a_hung_backend_move_to_the_next_on_the_ring_and_come_back() -> None:
    """A hung server (its connection closed by unanswered pings: NOT_SERVING) loses its
    keys to the next backend in each key's preference order until it answers again."""
    pool = make_pool(4, FakeClock())
    sample = keys(200)
    owners = {k: pool.choose(k).backend for k in sample}
    hung = pool.backends["h2:1"]
    hung.health = Health.NOT_SERVING
    pool.unreachable(hung)
    for k in sample:
        chosen = pool.choose(k).backend
        assert chosen is not None and chosen is not hung
        if owners[k] is hung:  # the next on its ring, not any backend
            order = [a for a in pool.ring.preference(k) if a != hung.address]
            assert chosen.address == order[0]
        else:
            assert chosen is owners[k]
    hung.health = Health.SERVING  # it answers again (its breaker: one probe at a time)
    pool.clock.now = hung.breaker.open_until  # type: ignore[attr-defined]
    for _ in range(pool.breaker_settings.successes_to_close):
        assert pool.start(hung)
        pool.finish(hung, 0.001, "ok")
    assert all(pool.choose(k).backend is owners[k] for k in sample)


def outlier_pool(n: int, clock: FakeClock, **kw: float) -> Pool:
    pool = Pool(
        breaker=BreakerSettings(failures_to_open=3, base_cooldown_s=1.0, jitter=0.0),
        clock=clock,
        rng=random.Random(0),
        table_size=SMALL_TABLE,
        outlier=OutlierSettings(
            **{"factor": 3.0, "min_calls": 10, "min_latency_s": 0.02, "interval_s": 0.25, **kw}  # type: ignore[arg-type]
        ),
    )
    pool.set_addresses(f"h{i}:1" for i in range(n))
    return pool


def serve(pool: Pool, clock: FakeClock, latencies: dict[str, float], rounds: int) -> None:
    """`rounds` calls on each backend in rotation, answered after its latency."""
    for _ in range(rounds):
        for address, seconds in latencies.items():
            backend = pool.backends[address]
            if pool.start(backend):
                clock.now += 0.01
                pool.finish(backend, seconds, "ok")


def test_repeated_timeouts_open_the_breaker_of_a_backend_that_stopped_answering() -> None:
    clock = FakeClock()
    pool = outlier_pool(3, clock)
    serve(pool, clock, {"h0:1": 0.002, "h1:1": 0.002, "h2:1": 0.002}, 20)
    slow = pool.backends["h0:1"]
    for _ in range(2):
        assert pool.start(slow)
        pool.finish(slow, 1.0, "slow")  # its caller gave it a second; others answer in 2 ms
    pool.start(slow)
    pool.finish(slow, 0.002, "ok")  # an answer in between breaks the streak
    for _ in range(2):
        assert pool.start(slow)
        pool.finish(slow, 1.0, "slow")
    assert slow.breaker.state is State.CLOSED
    assert pool.start(slow)
    pool.finish(slow, 1.0, "slow")
    assert slow.breaker.state is State.OPEN and slow.timeouts == 5 and slow.failures == 0
    assert all(pool.choose(None).backend is not slow for _ in range(50))


def test_a_callers_too_short_deadline_does_not_count_against_backends() -> None:
    """Timeouts shorter than factor x what backends usually take (or than min_latency_s)
    are the caller's: no backend's breaker is told."""
    clock = FakeClock()
    pool = outlier_pool(3, clock)
    serve(pool, clock, {"h0:1": 0.010, "h1:1": 0.010, "h2:1": 0.010}, 20)
    for backend in pool.backends.values():
        for _ in range(10):
            assert pool.start(backend)
            pool.finish(backend, 0.015, "slow")  # a 15 ms deadline on 10 ms calls
    assert all(b.breaker.state is State.CLOSED for b in pool.backends.values())
    assert all(b.timeouts == 0 for b in pool.backends.values())


def test_a_latency_outlier_is_ejected_with_backoff_and_comes_back() -> None:
    clock = FakeClock()
    pool = outlier_pool(3, clock)
    normal = {"h0:1": 0.002, "h1:1": 0.003}
    serve(pool, clock, {**normal, "h2:1": 0.080}, 20)
    outlier = pool.backends["h2:1"]
    assert outlier.breaker.state is State.OPEN and pool.ejections == 1
    assert outlier.failures == 0  # not a failure: slow
    assert outlier.breaker.open_until - clock.now <= 1.0
    assert all(pool.choose(k).backend is not outlier for k in keys(100))
    assert routable(pool) == {pool.backends["h0:1"], pool.backends["h1:1"]}
    # Back on probation, still slow: ejected again for twice as long.
    clock.now = outlier.breaker.open_until
    serve(pool, clock, {**normal, "h2:1": 0.080}, 20)
    ejected_at = clock.now
    assert outlier.breaker.state is State.OPEN and pool.ejections == 2
    assert outlier.breaker.open_until - ejected_at > 1.5
    # Recovered: judged fine after enough calls, its backoff forgotten.
    clock.now = outlier.breaker.open_until
    serve(pool, clock, {**normal, "h2:1": 0.003}, 20)
    assert outlier.breaker.state is State.CLOSED and outlier.breaker.ejections == 0
    assert pool.ejections == 2


def test_an_ejected_outlier_whose_probe_answers_slowly_is_out_again_at_once() -> None:
    """A slow answer is no proof of health: the probe after a cooldown ejects it again, not
    the `min_calls` slow calls that would follow if the probe closed its breaker."""
    clock = FakeClock()
    pool = outlier_pool(3, clock)
    normal = {"h0:1": 0.002, "h1:1": 0.003}
    serve(pool, clock, {**normal, "h2:1": 0.080}, 20)
    outlier = pool.backends["h2:1"]
    assert outlier.breaker.state is State.OPEN and pool.ejections == 1
    clock.now = outlier.breaker.open_until
    calls = outlier.calls
    serve(pool, clock, {**normal, "h2:1": 0.080}, 20)
    assert outlier.calls == calls + 1  # the probe only
    assert outlier.breaker.state is State.OPEN and pool.ejections == 2
    # Fast probes close it as before.
    clock.now = outlier.breaker.open_until
    serve(pool, clock, {**normal, "h2:1": 0.003}, 3)
    assert outlier.breaker.state is State.CLOSED


def test_one_slow_call_or_a_few_calls_do_not_make_an_outlier() -> None:
    clock = FakeClock()
    pool = outlier_pool(3, clock)
    serve(pool, clock, {"h0:1": 0.002, "h1:1": 0.002, "h2:1": 0.002}, 20)
    spiky = pool.backends["h2:1"]
    assert pool.start(spiky)
    pool.finish(spiky, 0.300, "ok")  # one pause; its mean moves by a tenth of it
    serve(pool, clock, {"h0:1": 0.002, "h1:1": 0.002, "h2:1": 0.002}, 20)
    assert spiky.breaker.state is State.CLOSED and pool.ejections == 0
    fresh = outlier_pool(3, clock)
    serve(fresh, clock, {"h0:1": 0.002, "h1:1": 0.002, "h2:1": 0.500}, 9)  # < min_calls
    assert fresh.ejections == 0
    fast = outlier_pool(3, clock)
    serve(fast, clock, {"h0:1": 0.001, "h1:1": 0.001, "h2:1": 0.010}, 20)  # 10x, but < 20 ms
    assert fast.ejections == 0


def test_outlier_ejection_respects_the_cap_and_can_be_turned_off() -> None:
    clock = FakeClock()
    pool = outlier_pool(3, clock)
    trip(pool, pool.backends["h0:1"])  # the one backend the cap allows out
    serve(pool, clock, {"h1:1": 0.002, "h2:1": 0.200}, 20)
    assert pool.backends["h2:1"].breaker.state is State.CLOSED and pool.ejections == 0
    off = outlier_pool(3, clock, factor=0.0)
    serve(off, clock, {"h0:1": 0.002, "h1:1": 0.002, "h2:1": 0.500}, 20)
    for _ in range(5):
        assert off.start(off.backends["h0:1"])
        off.finish(off.backends["h0:1"], 2.0, "slow")
    assert off.ejections == 0 and off.held_out() == 0


def test_the_latency_mean_ignores_failures_and_resets() -> None:
    clock = FakeClock()
    ewma = PeakEwma(decay_s=1.0, clock=clock, window=10)
    ewma.observe(0.010)
    assert ewma.mean == pytest.approx(0.010) and ewma.samples == 1
    ewma.observe(0.110)
    assert ewma.mean == pytest.approx(0.020)
    ewma.fail()
    assert ewma.mean == pytest.approx(0.020) and ewma.samples == 2
    assert ewma.estimate == pytest.approx(1.0)
    ewma.reset_mean()
    assert ewma.samples == 0
    ewma.observe(0.005)
    assert ewma.mean == pytest.approx(0.005)


def test_breaker_may_be_forbidden_to_open_and_ejection_has_its_own_backoff() -> None:
    clock = FakeClock()
    b = breaker(clock)
    for _ in range(5):
        b.failure(may_open=False)
    assert b.state is State.CLOSED and b.consecutive_failures == 5
    b.failure()
    assert b.state is State.OPEN
    clock.now = b.open_until
    assert b.acquire()  # the probe
    b.failure(may_open=False)  # fails, but may not reopen: the probe slot is free again
    assert b.state is State.HALF_OPEN and b.acquire()
    fresh = breaker(clock)
    cooldowns = []
    for _ in range(3):
        fresh.eject()
        cooldowns.append(fresh.open_until - clock.now)
        assert fresh.held_out and not fresh.available()
        clock.now = fresh.open_until
        for _ in range(2):
            assert fresh.acquire()
            fresh.success()  # a slow backend's probes succeed: the ejection backoff stays
        assert fresh.state is State.CLOSED and not fresh.held_out
    assert cooldowns == [1.0, 2.0, 4.0]
    fresh.cleared()
    fresh.eject()
    assert fresh.open_until - clock.now == 1.0


def test_balancer_settings_check_the_ejection_and_outlier_flags() -> None:
    from sluice.balancer.settings import BalancerSettings

    assert BalancerSettings(backend=["a:1"]).max_ejection_percent == 50.0
    for bad in ({"max_ejection_percent": 101.0}, {"max_ejection_percent": math.nan}):
        with pytest.raises(ValueError, match="max-ejection-percent"):
            BalancerSettings(backend=["a:1"], **bad)  # type: ignore[arg-type]
    for factor in (0.5, -1.0, math.nan):
        with pytest.raises(ValueError, match="outlier-factor"):
            BalancerSettings(backend=["a:1"], outlier_factor=factor)
    assert BalancerSettings(backend=["a:1"], outlier_factor=0.0).outlier_factor == 0.0


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


async def test_discovery_says_a_failing_name_once_and_keeps_its_last_answer(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluice.balancer import discovery as module

    answers: list[list[str] | OSError] = [
        ["10.0.0.1:8001"],
        OSError("no such name"),
        OSError("no such name"),
        ["10.0.0.2:8001"],
    ]

    async def resolve(name_port: str) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    monkeypatch.setattr(module, "resolve", resolve)
    found = module.Discovery([], dns="servers.test:8001")
    with caplog.at_level("INFO", logger=module.log.name):
        assert await found.current() == ["10.0.0.1:8001"]
        assert await found.current() == ["10.0.0.1:8001"]  # the last answer stands
        assert await found.current() == ["10.0.0.1:8001"]
        assert await found.current() == ["10.0.0.2:8001"]
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "cannot resolve servers.test:8001: no such name (keeping its last answer)",
        "servers.test:8001 resolves again",
    ]


def test_a_backend_on_probation_after_an_ejection_does_not_keep_a_broken_one_in() -> None:
    """Three backends, cap one: A ejected for latency, then on HALF_OPEN probation; B fails
    every call. B's breaker may open once A is no longer OPEN."""
    clock = FakeClock()
    pool = Pool(
        breaker=BreakerSettings(failures_to_open=2, base_cooldown_s=1.0, jitter=0.0),
        clock=clock,
        rng=random.Random(1),
    )
    pool.set_addresses(["a:1", "b:1", "c:1"])
    a, b = pool.backends["a:1"], pool.backends["b:1"]
    a.breaker.eject()
    assert pool.held_out() == 1
    for _ in range(2):
        b.in_flight += 1
        pool.finish(b, 0.01, "failed")
    assert not b.breaker.is_open  # the cap is spent on A
    clock.now += 1.5  # A's cooldown ends: on probation, it takes calls again
    assert not a.breaker.is_open and a.breaker.held_out
    for _ in range(2):
        b.in_flight += 1
        pool.finish(b, 0.01, "failed")
    assert b.breaker.is_open


def test_with_no_other_backend_to_compare_a_timeout_is_not_held_against_it() -> None:
    clock = FakeClock()
    pool = Pool(breaker=BreakerSettings(failures_to_open=1, jitter=0.0), clock=clock)
    pool.set_addresses(["a:1", "b:1"])
    a = pool.backends["a:1"]
    for _ in range(3):
        a.in_flight += 1
        pool.finish(a, 0.5, "slow")  # long timeouts, but nothing to say they are its fault
    assert a.timeouts == 0 and not a.breaker.held_out
