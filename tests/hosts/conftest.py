"""The hosts tier: real Sluice processes on hosts made of network namespaces (perf.hosts),
the balancer finding its servers through a name a real DNS server answers, faults made in
the network (perf.netfaults). Skips, saying why, where hosts cannot be made (not Linux, not
root, no netns, no dnsmasq). Every lab is removed after its test, failed or not, and the
session ends by checking that nothing with this run's prefix is left."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from itertools import count
from pathlib import Path

import pytest

from perf.hostcluster import Cluster
from perf.hosts import PREFIX, Lab, leftovers, why_not

RUN = f"{PREFIX}{secrets.token_hex(2)}"  # this session's prefix
_labs = count()
_started: list[int] = []  # the pid of every process any lab of this session started


@pytest.fixture(scope="session", autouse=True)
def nothing_left() -> Iterator[None]:
    yield
    from tests.e2e.harness import alive

    stray = [pid for pid in _started if alive(pid)]
    left = leftovers(RUN)
    assert not stray and not left, f"the hosts tier left processes {stray} and {left}"


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    if reason := why_not():
        pytest.skip(reason)
    made = Lab(tmp_path, run_id=f"{RUN[len(PREFIX) :]}{next(_labs)}")
    try:
        yield made
    finally:
        _started.extend(made.pids())
        made.close()


@pytest.fixture
def cluster(lab: Lab, tmp_path: Path) -> Cluster:
    """Three servers behind one balancer that finds them through DNS, and a client host."""
    return Cluster.make(lab, tmp_path, servers=3)
