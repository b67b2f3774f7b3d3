"""Tenants: who is calling, and what each caller may take. Transport-free; the clock is
injected.

A tenants file (TOML, the README's "Tenants" shows one) names each tenant, the SHA-256
digests of its API keys (never the keys: `sluice key` makes a key and its line), its
priority, rate, burst and concurrency, and whether it is an admin. A call names its key as
`authorization: Bearer KEY`. The file is re-read when it changes; one that does not parse is
refused and the one before it stays; a tenant's bucket and counts survive a re-read that
keeps its name. Quotas are per process: N processes behind one port give N times the rate.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.core.errors import QuotaExceeded, Unauthenticated
from sluice.core.files import stamp
from sluice.core.words import counted

INTERACTIVE, BATCH = 0, 1  # priority classes: a lower number is served first
PRIORITIES = {"interactive": INTERACTIVE, "batch": BATCH}
PRIORITY_NAMES = {number: name for name, number in PRIORITIES.items()}
HEADER = "authorization"
SCHEME = "bearer "
PREFIX = "sha256:"
KNOWN = {"keys", "priority", "rate", "burst", "concurrency", "admin"}
NO_KEY = "unauthenticated: the call carries no API key (send 'authorization: Bearer KEY')"
BAD_KEY = "unauthenticated: the API key is not one this node knows"


class TenantsFileError(ValueError):
    """A tenants file that cannot be used, with what is wrong in it."""


def digest(key: str) -> str:
    """The line that stands for `key` in a tenants file. Keys are random and long (`new_key`),
    so a plain digest is enough: nothing short is there to guess."""
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-" + secrets.token_urlsafe(32)


def authorization(key: str) -> tuple[str, str]:
    """The metadata entry that carries `key` on a call."""
    return HEADER, f"Bearer {key}"


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: frozenset[str]  # digests
    priority: int = INTERACTIVE
    rate: float = 0.0  # calls/s; 0: no quota
    burst: float = 0.0
    concurrency: int = 0  # 0: no limit
    admin: bool = False

    @property
    def priority_name(self) -> str:
        return PRIORITY_NAMES[self.priority]


class Bucket:
    """A token bucket: `rate` tokens a second, holding at most `burst`."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.at = now

    def take(self, now: float) -> float:
        """Take a token: 0.0 if there was one, else the seconds until there will be."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass
class Account:
    """A tenant's state in this process: its bucket, calls in flight, and counts."""

    tenant: Tenant
    bucket: Bucket | None
    in_flight: int = 0
    calls: int = 0  # admitted
    ok: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # by reason
    failed: Counter[str] = field(default_factory=Counter)  # admitted, then failed: by status


def tenant_name(account: Account | None) -> str:
    """The name of a caller's tenant, its shared memory regions' name space: "" with auth
    off (or no key, where a call may be made without one)."""
    return account.tenant.name if account is not None else ""


def parse(text: str) -> dict[str, Tenant]:
    """The tenants of a file's text; TenantsFileError says what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"not TOML: {exc}") from None
    section = data.get("tenants")
    if not isinstance(section, dict) or not section:
        raise TenantsFileError("no [tenants.NAME] tables")
    tenants: dict[str, Tenant] = {}
    owners: dict[str, str] = {}
    for name, spec in section.items():
        if not isinstance(spec, dict):
            raise TenantsFileError(f"tenants.{name} is not a table")
        tenant = _tenant(name, spec)
        for key in tenant.keys:
            if key in owners:
                raise TenantsFileError(f"tenants {owners[key]} and {name} hold the same key")
            owners[key] = name
        tenants[name] = tenant
    return tenants


def _tenant(name: str, spec: Mapping[str, Any]) -> Tenant:
    where = f"tenants.{name}"
    unknown = set(spec) - KNOWN
    if unknown:
        raise TenantsFileError(f"{where}: unknown settings {', '.join(sorted(unknown))}")
    keys = spec.get("keys", [])
    if not isinstance(keys, list) or not keys:
        raise TenantsFileError(f"{where}: keys must be a list of at least one 'sha256:...'")
    for key in keys:
        if not (
            isinstance(key, str)
            and key.startswith(PREFIX)
            and len(key) == len(PREFIX) + 64
            and all(c in "0123456789abcdef" for c in key[len(PREFIX) :])
        ):
            raise TenantsFileError(
                f"{where}: {key!r} is not 'sha256:' and 64 lowercase hex digits "
                "(store digests, not keys: `sluice key` makes both)"
            )
    priority = spec.get("priority", "interactive")
    if priority not in PRIORITIES:
        raise TenantsFileError(f"{where}: priority must be interactive or batch")
    rate = _number(spec, "rate", where)
    burst = _number(spec, "burst", where) or max(rate, 1.0)
    concurrency = _number(spec, "concurrency", where)
    if concurrency != int(concurrency):
        raise TenantsFileError(f"{where}: concurrency must be a whole number")
    admin = spec.get("admin", False)
    if not isinstance(admin, bool):
        raise TenantsFileError(f"{where}: admin must be true or false")
    if rate and burst < 1:
        raise TenantsFileError(f"{where}: burst must be at least 1")
    return Tenant(name, frozenset(keys), PRIORITIES[priority], rate, burst, int(concurrency), admin)


def _number(spec: Mapping[str, Any], name: str, where: str) -> float:
    value = spec.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TenantsFileError(f"{where}: {name} must be a number")
    if value < 0 or not math.isfinite(value):
        raise TenantsFileError(f"{where}: {name} must be 0 or more")
    return float(value)


class Tenants:
    """The tenants of one process: who a key belongs to, and the door each call passes."""

    def __init__(
        self, tenants: Mapping[str, Tenant], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock
        self.accounts: dict[str, Account] = {}
        self._by_key: dict[str, Account] = {}
        self.replace(tenants)

    @classmethod
    def load(cls, path: str, clock: Callable[[], float] = time.monotonic) -> Tenants:
        """The tenants of the file at `path`; TenantsFileError (naming it) if it is unusable."""
        return cls(read(path), clock)

    def replace(self, tenants: Mapping[str, Tenant]) -> None:
        """Take a new set of tenants: a kept name keeps its bucket level and counts."""
        now = self.clock()
        accounts: dict[str, Account] = {}
        for name, tenant in tenants.items():
            old = self.accounts.get(name)
            bucket = Bucket(tenant.rate, tenant.burst, now) if tenant.rate else None
            if bucket is not None and old is not None and old.bucket is not None:
                bucket.tokens, bucket.at = min(old.bucket.tokens, tenant.burst), old.bucket.at
            if old is None:
                accounts[name] = Account(tenant, bucket)
            else:
                old.tenant, old.bucket = tenant, bucket
                accounts[name] = old
        self.accounts = accounts
        self._by_key = {key: a for a in accounts.values() for key in a.tenant.keys}

    def __iter__(self) -> Iterator[Account]:
        return iter(self.accounts.values())

    def identify(self, authorization: str | None) -> Account | None:
        """The account an `authorization` header value names; None when there is none;
        Unauthenticated when it names no tenant."""
        if not authorization:
            return None
        if authorization[: len(SCHEME)].lower() == SCHEME:
            authorization = authorization[len(SCHEME) :]
        account = self._by_key.get(digest(authorization.strip()))
        if account is None:
            raise Unauthenticated(BAD_KEY)
        return account

    def authenticate(self, authorization: str | None) -> Account:
        """The caller's account; Unauthenticated unless its key is known."""
        account = self.identify(authorization)
        if account is None:
            raise Unauthenticated(NO_KEY)
        return account

    def enter(self, account: Account) -> None:
        """Admit one call of `account` (`settle` it when it ends), or raise QuotaExceeded."""
        tenant = account.tenant
        if tenant.concurrency and account.in_flight >= tenant.concurrency:
            raise QuotaExceeded(
                f"quota: tenant {tenant.name} has {counted(account.in_flight, 'call')} in "
                f"flight, its share; retry when one ends"
            )
        if account.bucket is not None:
            wait = account.bucket.take(self.clock())
            if wait:
                raise QuotaExceeded(
                    f"quota: tenant {tenant.name} is over its {tenant.rate:g} calls/s "
                    f"(burst {tenant.burst:g}); retry in {math.ceil(wait * 1000)} ms",
                    retry_after_s=wait,
                )
        account.in_flight += 1
        account.calls += 1

    @staticmethod
    def settle(account: Account, entered: bool, status: str | None, reason: str) -> None:
        """A call of `account` ended: `entered` (it passed `enter`), OK (`status` None), or
        with that status, refused for `reason` ("" if it was not a refusal)."""
        if entered:
            account.in_flight -= 1
        if reason:
            account.refused[reason] += 1
        elif status is not None:
            account.failed[status] += 1
        else:
            account.ok += 1


def read(path: str) -> dict[str, Tenant]:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as exc:
        raise TenantsFileError(f"tenants file {path}: {exc.strerror or exc}") from None
    try:
        return parse(text)
    except TenantsFileError as exc:
        raise TenantsFileError(f"tenants file {path}: {exc}") from None


class Watched:
    """A tenants file and the Tenants it fills, re-read when its stat changes."""

    def __init__(self, path: str, tenants: Tenants) -> None:
        self.path = path
        self.tenants = tenants
        self._seen = stamp(path)

    def check(self) -> str | None:
        """Re-read the file if it changed: None when it did not, else what happened (a
        line to log; on a bad file the tenants before it stay)."""
        seen = stamp(self.path)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            tenants = read(self.path)
        except TenantsFileError as exc:
            return f"{exc}; the tenants before it stay"
        self.tenants.replace(tenants)
        return f"tenants file {self.path} re-read: {counted(len(tenants), 'tenant')}"
