"""Tenants at a program's door, the parts both programs share: the tenants file loaded and
watched for changes, and what Health shows of the tenants (sluice.core.tenants holds the
policy)."""

from __future__ import annotations

import asyncio
import logging

from sluice.core.errors import PermissionDenied, SluiceError, Unauthenticated
from sluice.core.tenants import NO_KEY, Account, Tenants, TenantsFileError, Watched
from sluice.v1 import inference_pb2 as pb

POLL_S = 1.0  # how often the tenants file is looked at
# Who may make a call when auth is on: anyone (probes; a wrong key is still refused), any
# tenant, or an admin tenant only.
OPEN, TENANT, ADMIN = "open", "tenant", "admin"
ADMIN_ONLY = "permission: this call is for admin tenants (admin = true in the tenants file)"


def caller(tenants: Tenants, authorization: str | None, access: str) -> Account | None:
    """The calling tenant's account (None: no key, where `access` is OPEN); Unauthenticated
    or PermissionDenied when the call may not pass."""
    account = tenants.identify(authorization)
    if account is None and access != OPEN:
        raise Unauthenticated(NO_KEY)
    if access == ADMIN and account is not None and not account.tenant.admin:
        raise PermissionDenied(ADMIN_ONLY)
    return account


def load(path: str) -> Tenants:
    """The tenants of `path`; SluiceError (the program cannot start) if it is unusable."""
    try:
        return Tenants.load(path)
    except TenantsFileError as exc:
        raise SluiceError(str(exc)) from None


async def watch(path: str, tenants: Tenants, log: logging.Logger, poll_s: float = POLL_S) -> None:
    """Re-read the tenants file whenever it changes, until cancelled."""
    watched = Watched(path, tenants)
    while True:
        await asyncio.sleep(poll_s)
        line = watched.check()
        if line is None:
            continue
        if line.endswith("stay"):
            log.warning("%s", line)
        else:
            log.info("%s", line)


def statuses(tenants: Tenants, caller: Account | None) -> list[pb.TenantStatus]:
    """What Health shows of the tenants: every one to an admin, the caller's own to a
    tenant, nothing to a caller without a key."""
    if caller is None:
        return []
    shown = list(tenants) if caller.tenant.admin else [caller]
    return [
        pb.TenantStatus(
            name=a.tenant.name,
            priority=a.tenant.priority_name,
            rate=a.tenant.rate,
            burst=a.tenant.burst if a.tenant.rate else 0.0,
            concurrency=a.tenant.concurrency,
            in_flight=a.in_flight,
            calls=a.calls,
            ok=a.ok,
            refused=dict(a.refused),
            failed=dict(a.failed),
            admin=a.tenant.admin,
        )
        for a in shown
    ]
