"""`--workers N`: the first process binds the port and supervises N-1 copies on it
(SO_REUSEPORT); each is its own scrape target on the metrics port + i."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.runtime.supervise import SLOT_ENV, Supervisor


@dataclass(frozen=True)
class Workers:
    """One program's workers. The variables must not look like a setting's (`SLUICE_WORKERS`
    is `--workers`): a worker reads its settings from the same environment."""

    module: str  # what a worker runs: python -m MODULE ARGV --workers 1 --port PORT
    worker_env: str  # set in the extra processes
    count_env: str  # how many processes in all
    name: str

    def is_worker(self) -> bool:
        return bool(os.environ.get(self.worker_env))

    def metrics_ports(self, first: int, is_worker: bool) -> list[int]:
        """The metrics port(s) this process may take: first + i for worker i (a worker
        without a slot: the first free one of the workers' range)."""
        if not is_worker:
            return [first]
        slot = os.environ.get(SLOT_ENV, "")
        if slot.isdigit():
            return [first + 1 + int(slot)]
        total = int(os.environ.get(self.count_env, "") or 2)
        return [first + i for i in range(1, max(total, 2))]

    def start(self, count: int, argv: Sequence[str], port: int) -> Supervisor | None:
        """The extra processes of `count` in all, on `port`; None in a worker or for one."""
        if count <= 1 or self.is_worker():
            return None
        args = [sys.executable, "-m", self.module, *argv, "--workers", "1", "--port", str(port)]
        env = {**os.environ, self.worker_env: "1", self.count_env: str(count)}
        supervisor = Supervisor(args, count - 1, env=env, name=self.name)
        supervisor.start()
        return supervisor
