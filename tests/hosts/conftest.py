"""The hosts tier: real Sluice processes on hosts made of network namespaces (perf.hosts),
the balancer finding its servers through a name a real DNS server answers, faults made in
the network (perf.netfaults). Skips, saying why, where hosts cannot be made (not Linux, not
root, no netns, no dnsmasq). Every lab is removed after its test, failed or not; the session
begins by removing what crashed runs left (and saying so) and ends by checking that nothing
with this run's prefix is left, nor any process in a namespace it made."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count
from pathlib import Path

import pytest

from perf.hosts import PREFIX, Lab, leftovers, remove_stale, run_prefix, why_not

RUN = run_prefix()  # this session's prefix
_labs = count()
_inodes: set[int] = set()  # the network namespace of every lab this session made
_earlier: list[str] = []  # what earlier runs left, for the summary


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _earlier:
        terminalreporter.write_line(f"hosts tier: {line}")


@pytest.fixture(scope="session", autouse=True)
def nothing_left() -> Iterator[None]:
    if why_not():  # no labs can be made here, so none can be left (and `ip` may be missing)
        yield
        return
    removed, kept = remove_stale()
    if removed:
        _earlier.append(f"removed what crashed runs left: {', '.join(removed)}")
    if kept:
        _earlier.append(f"left alone (a live run's, or no owner in the name): {', '.join(kept)}")
    yield
    left = leftovers(RUN, _inodes)
    assert not left, f"the hosts tier left {left}"


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    if reason := why_not():
        pytest.skip(reason)
    made = Lab(tmp_path, run_id=f"{RUN[len(PREFIX) :]}{next(_labs)}")
    try:
        yield made
    finally:
        _inodes.update(made.inodes)
        made.close()
