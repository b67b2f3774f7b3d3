"""`--workers N` for either program: the first process binds the port, then starts N-1
copies of itself on that port (SO_REUSEPORT, so the kernel spreads connections over them),
supervised: respawned with backoff when one dies, stopped with the first. Each process is
its own metrics scrape target: worker i (0 the first) on the metrics port + i."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.runtime.supervise import SLOT_ENV, Supervisor


@dataclass(frozen=True)
class Workers:
    """One program's workers. The environment names must not start like a setting's
    (`SLUICE_WORKERS` is `--workers`): a worker reads its settings from the same
    environment."""

    module: str  # what a worker runs: python -m MODULE ARGV --workers 1 --port PORT
    worker_env: str  # set in the extra processes
    count_env: str  # in a worker: how many processes there are in all
    name: str  # in the supervisor's log lines

    def is_worker(self) -> bool:
        return bool(os.environ.get(self.worker_env))

    def metrics_ports(self, first: int, is_worker: bool) -> list[int]:
        """The metrics port(s) this process may take: `first` for the first process,
        first + i for worker i (1 to N-1). A worker whose slot the supervisor does not say
        takes the first free port of the workers' range."""
        if not is_worker:
            return [first]
        slot = os.environ.get(SLOT_ENV, "")
        if slot.isdigit():
            return [first + 1 + int(slot)]
        total = int(os.environ.get(self.count_env, "") or 2)
        return [first + i for i in range(1, max(total, 2))]

    def start(self, count: int, argv: Sequence[str], port: int) -> Supervisor | None:
        """The extra processes of `count` in all, on `port` (the one this process bound);
        None in a worker, or for one process."""
        if count <= 1 or self.is_worker():
            return None
        args = [sys.executable, "-m", self.module, *argv, "--workers", "1", "--port", str(port)]
        env = {**os.environ, self.worker_env: "1", self.count_env: str(count)}
        supervisor = Supervisor(args, count - 1, env=env, name=self.name)
        supervisor.start()
        return supervisor
