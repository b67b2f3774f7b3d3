"""`sluice-balancer`: the sidecar balancer in front of Sluice servers."""

from __future__ import annotations

from sluice.runtime.process import quiet_grpc_core

# For `python -m` (workers run so): quiet grpc-core before the imports below load grpc.
if __name__ == "__main__":
    quiet_grpc_core()

import asyncio
import contextlib
import functools
import logging
import random
import sys
from collections.abc import Sequence

from sluice.balancer.discovery import Discovery
from sluice.balancer.kserve import SERVICE as KSERVE
from sluice.balancer.kserve import KServeFacade
from sluice.balancer.membership import Membership, upstreams
from sluice.balancer.metrics import RoutingCollector
from sluice.balancer.service import SERVICE, BalancerService
from sluice.balancer.settings import BalancerSettings
from sluice.routing.budget import RetryBudget
from sluice.routing.pool import Pool
from sluice.runtime import door, program
from sluice.runtime.health import Readiness
from sluice.runtime.supervise import SLOT_ENV
from sluice.runtime.workers import Workers
from sluice.shm.setup import closers, regions_of, sweeps

log = logging.getLogger("sluice.balancer")
WORKER_ENV = "SLUICE_BALANCER_WORKER"  # set in the extra worker processes
WORKERS_ENV = "SLUICE_BALANCER_WORKERS"  # in a worker: how many processes there are in all
WORKER_SLOT_ENV = SLOT_ENV  # in a worker: its slot among the extra processes (supervisor)
WORKERS = Workers("sluice.balancer.main", WORKER_ENV, WORKERS_ENV, "balancer worker")


async def serve(settings: BalancerSettings, argv: Sequence[str]) -> int:
    pool = Pool(
        breaker=settings.breaker,
        outlier=settings.outlier,
        balance_factor=settings.balance_factor,
        ewma_decay_s=settings.ewma_decay_s,
        max_ejection_percent=settings.max_ejection_percent,
        rng=random.Random(),
    )
    budget = RetryBudget(settings.retry_ratio, settings.retry_min_per_s)
    tenants = door.load(settings.tenants) if settings.tenants else None
    regions = regions_of(settings)
    service = BalancerService(
        pool,
        budget,
        node_id=settings.node_id,
        default_timeout_s=settings.default_timeout_s or None,
        fanout_rows=settings.fanout_rows,
        tenants=tenants,
        max_message_bytes=settings.max_message_bytes,
        regions=regions,
        hedge=settings.hedge,
    )
    readiness = Readiness(pool.serving)
    membership = Membership(
        pool, upstreams(settings), readiness.changed, models_refresh_s=settings.models_refresh_s
    )
    discovery = Discovery(settings.backend, settings.backends_file, settings.backends_dns)
    # Known before listening, so health is true from the first check; a slow name server
    # delays the bind by one refresh at most.
    try:
        known = await asyncio.wait_for(discovery.current(), settings.refresh_s)
    except TimeoutError:
        log.warning(
            "backends not known within %.1fs: listening with the static ones", settings.refresh_s
        )
        known = list(discovery.static)
    membership.apply(known)
    return await program.run(
        program.Program(
            settings,
            WORKERS,
            log,
            services={SERVICE: service.methods(), KSERVE: KServeFacade(service).methods()},
            stats=service.stats,
            readiness=readiness,
            processes=settings.workers,
            banner=lambda: banner(settings.node_id, len(pool.backends)),
            collectors=[RoutingCollector(pool, budget, service.planner, service.fanned)],
            tenants=tenants,
            background=[
                functools.partial(discovery.watch, settings.refresh_s, membership.apply, known),
                membership.tick,
                *sweeps(regions, log),
            ],
            closing=[membership.close, *closers(regions)],
        ),
        argv,
    )


def banner(node_id: str, backends: int) -> str:
    """The start line's words: the backends known at start (flags, a file or DNS)."""
    return f"{node_id} balancing {backends} backend{'' if backends == 1 else 's'}"


def main(argv: Sequence[str] | None = None) -> int:
    return program.main(BalancerSettings, serve, argv, log, workers=WORKERS)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
