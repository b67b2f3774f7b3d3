"""Where the backends come from: flags, a file re-read when it changes, and a DNS name
re-resolved (a Kubernetes headless service lists its ready pods' addresses)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from sluice.core.files import Stamp, stamp

log = logging.getLogger("sluice.discovery")


def read_file(path: str) -> list[str]:
    """HOST:PORT per line; blank lines and # comments are skipped."""
    lines = Path(path).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


async def resolve(name_port: str) -> list[str]:
    host, _, port = name_port.rpartition(":")
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = set()
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)


class Discovery:
    def __init__(self, static: list[str], file: str = "", dns: str = "") -> None:
        self.static = static
        self.file = file
        self.dns = dns
        self._file_stamp: Stamp | None = None
        self._from_file: list[str] = []
        self._from_dns: list[str] = []
        self._dns_error = ""  # the last lookup's failure, said once (lookups run every 0.5 s)

    async def current(self) -> list[str]:
        """The backends now; a file or name that cannot be read keeps its last answer."""
        if self.file:
            await asyncio.to_thread(self._reread_file)
        if self.dns:
            try:
                self._from_dns = await resolve(self.dns)
            except (OSError, ValueError) as exc:
                if str(exc) != self._dns_error:
                    log.warning("cannot resolve %s: %s (keeping its last answer)", self.dns, exc)
                self._dns_error = str(exc)
            else:
                if self._dns_error:
                    log.info("%s resolves again", self.dns)
                self._dns_error = ""
        return list(dict.fromkeys([*self.static, *self._from_file, *self._from_dns]))

    def _reread_file(self) -> None:
        seen = stamp(self.file)
        if seen is not None and seen == self._file_stamp:
            return
        try:
            self._from_file = read_file(self.file)
            self._file_stamp = seen
        except OSError as exc:
            log.warning("cannot read backends file %s: %s", self.file, exc)

    async def watch(
        self,
        interval_s: float,
        apply: Callable[[list[str]], None],
        last: list[str] | None = None,
    ) -> None:
        """Apply the backends now (unless they are `last`) and whenever they change."""
        while True:
            backends = await self.current()
            if backends != last:
                apply(backends)
                last = backends
            if not (self.file or self.dns):
                return  # flags only: nothing can change
            await asyncio.sleep(interval_s)  # files and DNS have no change events to wait on
