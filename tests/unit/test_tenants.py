"""Tenants: the file, keys, the rate quota, the concurrency share, re-reading; and the
batcher's priority classes."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from sluice.core.errors import (
    Code,
    Overloaded,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    reason_of,
)
from sluice.core.tenants import (
    BATCH,
    INTERACTIVE,
    Bucket,
    Tenants,
    TenantsFileError,
    Watched,
    digest,
    new_key,
    parse,
)
from sluice.runtime import door
from sluice.server.dataplane.batcher import SHED, Arrays, Batcher, BatchQueue, Pending

KEY_A, KEY_B = "sk-alpha-key", "sk-batch-key"
FILE = f"""
[tenants.alpha]
keys = ["{digest(KEY_A)}"]
rate = 10
burst = 2

[tenants.bulk]
keys = ["{digest(KEY_B)}"]
priority = "batch"
concurrency = 1
admin = true
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_parse_reads_every_setting() -> None:
    tenants = parse(FILE)
    alpha, bulk = tenants["alpha"], tenants["bulk"]
    assert (alpha.priority, alpha.rate, alpha.burst, alpha.concurrency) == (INTERACTIVE, 10, 2, 0)
    assert (bulk.priority, bulk.rate, bulk.concurrency, bulk.admin) == (BATCH, 0, 1, True)
    assert alpha.keys == {digest(KEY_A)}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants", "not TOML"),
        ("x = 1", "no [tenants.NAME]"),
        ('[tenants.a]\nkeys = ["plain-key"]', "64 lowercase hex"),
        (f'[tenants.a]\nkeys = ["{digest("k")}"]\npriority = "urgent"', "interactive or batch"),
        (f'[tenants.a]\nkeys = ["{digest("k")}"]\nrate = -1', "0 or more"),
        (f'[tenants.a]\nkeys = ["{digest("k")}"]\nrat = 1', "unknown settings rat"),
        (
            f'[tenants.a]\nkeys = ["{digest("k")}"]\n[tenants.b]\nkeys = ["{digest("k")}"]',
            "same key",
        ),
        ("[tenants.a]\nkeys = []", "at least one"),
    ],
)
def test_bad_files_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(TenantsFileError, match=re.escape(message)):
        parse(text)


def test_keys_authenticate_their_tenant_only() -> None:
    tenants = Tenants(parse(FILE))
    assert tenants.authenticate(f"Bearer {KEY_A}").tenant.name == "alpha"
    assert tenants.authenticate(f"bearer {KEY_B}").tenant.name == "bulk"
    assert tenants.identify(None) is None
    with pytest.raises(Unauthenticated, match="no API key"):
        tenants.authenticate("")
    with pytest.raises(Unauthenticated, match="not one this node knows"):
        tenants.authenticate("Bearer sk-wrong")
    key = new_key()
    assert key.startswith("sk-") and len(key) > 40 and digest(key) != digest(new_key())


def test_rate_quota_is_a_token_bucket_with_retry_time() -> None:
    clock = Clock()
    tenants = Tenants(parse(FILE), clock)
    alpha = tenants.accounts["alpha"]
    for _ in range(2):  # the burst
        tenants.enter(alpha)
        Tenants.settle(alpha, True, None, "")
    with pytest.raises(QuotaExceeded, match="over its 10 calls/s") as refused:
        tenants.enter(alpha)
    assert str(refused.value).startswith("quota:")
    assert refused.value.retry_after_s == pytest.approx(0.1)
    Tenants.settle(alpha, False, "RESOURCE_EXHAUSTED", "quota")
    clock.now += 0.101  # one token back
    tenants.enter(alpha)
    Tenants.settle(alpha, True, None, "")
    assert (alpha.calls, alpha.ok, alpha.refused["quota"], alpha.in_flight) == (3, 3, 1, 0)


def test_bucket_refills_to_its_burst_only() -> None:
    bucket = Bucket(rate=100, burst=5, now=0.0)
    assert [bucket.take(10.0) for _ in range(5)] == [0.0] * 5
    assert bucket.take(10.0) == pytest.approx(0.01)


def test_concurrency_share_counts_calls_in_flight() -> None:
    tenants = Tenants(parse(FILE))
    bulk = tenants.accounts["bulk"]
    tenants.enter(bulk)
    with pytest.raises(QuotaExceeded, match="has 1 call in flight"):
        tenants.enter(bulk)
    Tenants.settle(bulk, True, "INTERNAL", "")
    tenants.enter(bulk)  # its call ended: room again
    assert bulk.failed["INTERNAL"] == 1 and bulk.in_flight == 1


def test_reread_keeps_counts_and_bucket_of_kept_tenants(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    clock = Clock()
    tenants = Tenants.load(str(path), clock)
    watched = Watched(str(path), tenants)
    alpha = tenants.accounts["alpha"]
    tenants.enter(alpha)
    tenants.enter(alpha)
    assert watched.check() is None  # unchanged
    new_key_line = digest("sk-new")
    path.write_text(FILE.replace(digest(KEY_B), new_key_line))
    os.utime(path, ns=(1, 1))  # a new stat even within one clock tick
    assert "re-read: 2 tenants" in (watched.check() or "")
    assert tenants.accounts["alpha"] is alpha and alpha.in_flight == 2
    with pytest.raises(QuotaExceeded):  # its bucket was not refilled by the re-read
        tenants.enter(alpha)
    with pytest.raises(Unauthenticated):
        tenants.authenticate(f"Bearer {KEY_B}")
    assert tenants.authenticate("Bearer sk-new").tenant.name == "bulk"
    path.write_text("[tenants")
    os.utime(path, ns=(2, 2))
    assert "stay" in (watched.check() or "")
    assert tenants.authenticate("Bearer sk-new").tenant.name == "bulk"


def item(arrival: float, priority: int, rows: int = 1) -> Pending:
    return Pending({}, (), rows, "g", arrival, priority=priority)


def test_queue_serves_the_urgent_class_first() -> None:
    queue = BatchQueue(max_rows=4, budget_s=5.0, max_queue=10)
    for t in range(3):
        queue.add(item(float(t), BATCH))
    queue.add(item(5.0, INTERACTIVE))
    assert queue.ahead(INTERACTIVE) == (1, 1) and queue.ahead(BATCH) == (4, 4)
    taken = queue.take(now=6.0)
    assert taken is not None and [p.priority for p in taken.batch] == [INTERACTIVE]
    taken = queue.take(now=6.0)
    assert taken is not None and [p.arrival for p in taken.batch] == [0.0, 1.0, 2.0]
    assert queue.rows == 0 and len(queue) == 0


def test_full_queue_sheds_the_newest_lower_class_request() -> None:
    queue = BatchQueue(max_rows=1, budget_s=1.0, max_queue=2)
    old, new = item(0.0, BATCH), item(1.0, BATCH)
    queue.add(old)
    queue.add(new)
    assert queue.add(item(2.0, INTERACTIVE)) is new
    assert queue.rows == 2 and queue.ahead(BATCH) == (2, 2)
    with pytest.raises(Overloaded, match="queue is full"):
        queue.add(item(3.0, BATCH))  # nothing less urgent to shed
    queue.add(item(3.0, INTERACTIVE))  # sheds `old`
    with pytest.raises(Overloaded, match=r"^overloaded: the request queue is full"):
        queue.add(item(4.0, INTERACTIVE))


class Gate:
    """A runner whose runs end when the test says so."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.order: list[float] = []

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        await self.release.wait()
        self.order.extend(p.inputs["x"][0, 0] for p in batch)
        return [{"y": p.inputs["x"]} for p in batch]

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        return None


async def test_batcher_runs_interactive_before_queued_batch_work_and_sheds_for_it() -> None:
    gate = Gate()
    batcher = Batcher([gate], max_rows=1, max_queue=3)

    def submit(value: float, priority: int) -> asyncio.Task[Arrays]:
        x = np.full((1, 1), value, np.float32)
        return asyncio.ensure_future(
            batcher.submit({"x": x}, ["y"], rows=1, group="g", priority=priority)
        )

    first = submit(0, BATCH)  # runs at once, holding the instance
    await asyncio.sleep(0)
    queued = [submit(v, BATCH) for v in (1, 2, 3)]
    await asyncio.sleep(0)
    urgent = submit(9, INTERACTIVE)  # the queue is full: the newest batch call is shed
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match=re.escape(SHED[:20])):
        await queued[2]
    gate.release.set()
    await asyncio.gather(first, urgent, *queued[:2])
    assert gate.order == [0, 9, 1, 2]
    assert batcher.stats.rejected == 1


def test_door_lets_each_call_through_by_its_access() -> None:
    tenants = Tenants(parse(FILE))
    assert door.caller(tenants, None, door.OPEN) is None  # probes need no key
    with pytest.raises(Unauthenticated):
        door.caller(tenants, "Bearer sk-wrong", door.OPEN)  # but a wrong one is refused
    with pytest.raises(Unauthenticated, match="no API key"):
        door.caller(tenants, None, door.TENANT)
    alpha = door.caller(tenants, f"Bearer {KEY_A}", door.TENANT)
    assert alpha is not None and alpha.tenant.name == "alpha"
    with pytest.raises(PermissionDenied, match=r"^permission: .*admin tenants"):
        door.caller(tenants, f"Bearer {KEY_A}", door.ADMIN)
    bulk = door.caller(tenants, f"Bearer {KEY_B}", door.ADMIN)
    assert bulk is not None and bulk.tenant.admin
    assert [s.name for s in door.statuses(tenants, alpha)] == ["alpha"]
    assert sorted(s.name for s in door.statuses(tenants, bulk)) == ["alpha", "bulk"]
    assert door.statuses(tenants, None) == []


@pytest.mark.parametrize(
    ("code", "message", "reason"),
    [
        (Code.RESOURCE_EXHAUSTED, "quota: tenant a is over its 1 calls/s", "quota"),
        (Code.RESOURCE_EXHAUSTED, "overloaded: the request queue is full", "overload"),
        (Code.UNAUTHENTICATED, "unauthenticated: no key", "unauthenticated"),
        (Code.PERMISSION_DENIED, "permission: admins only", "permission"),
        (Code.RESOURCE_EXHAUSTED, "received message larger than max", ""),
        (Code.INVALID_ARGUMENT, "quota: looks like one but is not", ""),
    ],
)
def test_a_forwarded_refusal_is_known_by_its_message(code: int, message: str, reason: str) -> None:
    assert reason_of(code, message) == reason
