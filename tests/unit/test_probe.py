"""sluice.runtime.probe: what a port speaks, found by one bounded handshake, with a target's
host read as an address without asking a resolver (the blocking probe, the client's), or a
name resolved within the bound (the asyncio probe, the balancer's). The ports probed are
sockets on 127.0.0.1 made here: a TLS one served from a thread, one that answers plaintext
bytes, one that never answers."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from perf.certs import Authority
from sluice.runtime import probe
from sluice.runtime.probe import Port

NOWHERE = "127.0.0.1:9"  # the discard port: nothing listens on it here
# A name the resolver answers from the hosts file (names are case-insensitive) that is no
# address written out: only a resolver turns it into 127.0.0.1.
NAME = "LOCALHOST"
SERVE_S = 60.0  # how long a port made here serves at most


@pytest.fixture
def tls_port(tmp_path: Path) -> Iterator[int]:
    """A port that completes a TLS handshake and then speaks (one byte), as a gRPC server
    does (its settings)."""
    pair = Authority(tmp_path).issue("server")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pair.cert, pair.key)
    with serving(lambda conn: _speak_tls(context, conn)) as port:
        yield port


@pytest.fixture
def plaintext_port() -> Iterator[int]:
    """A port that answers a TLS hello with bytes that are not TLS (an HTTP/2 SETTINGS
    frame, as a plaintext gRPC server sends)."""
    with serving(lambda conn: conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")) as port:
        yield port


def _speak_tls(context: ssl.SSLContext, conn: socket.socket) -> None:
    with context.wrap_socket(conn, server_side=True) as tls:
        tls.sendall(b"\x00")


@contextmanager
def serving(answer: Callable[[socket.socket], object]) -> Iterator[int]:
    """A port on 127.0.0.1 whose connections `answer` handles, one at a time, from a thread
    that ends with the block (or after SERVE_S)."""
    stop = threading.Event()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.settimeout(0.05)

        def serve() -> None:
            for _ in range(int(SERVE_S / 0.05)):
                if stop.is_set():
                    return
                try:
                    conn, _ = sock.accept()
                except TimeoutError:
                    continue
                # OSError: the probe hung up first, nothing to answer.
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(5)
                    answer(conn)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield int(sock.getsockname()[1])
        finally:
            stop.set()
            thread.join(5)


@pytest.mark.parametrize(
    ("target", "split"),
    [
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:8000", ("::1", 8000)),
        ("dns:///127.0.0.1:443", ("127.0.0.1", 443)),
        ("ipv4:10.0.0.1:80", ("10.0.0.1", 80)),
        ("dns:///example.org:443", ("example.org", 443)),
        ("server-1:8001", ("server-1", 8001)),
        ("unix:/tmp/sock", None),
        ("ipv4:10.0.0.1:80,10.0.0.2:80", None),
        ("example.org", None),
    ],
)
def test_split(target: str, split: tuple[str, int] | None) -> None:
    assert probe.split(target) == split


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("localhost", "127.0.0.1"),  # loopback, without asking a resolver
        ("example.org", None),  # a name: only a resolver knows it
        (NAME, None),
    ],
)
def test_literal(host: str, address: str | None) -> None:
    assert probe.literal(host) == address


def test_a_port_nothing_listens_on_is_unknown() -> None:
    assert probe.probe(NOWHERE, bound_s=0.5) is Port.UNKNOWN


def test_what_a_port_speaks(tls_port: int, plaintext_port: int) -> None:
    assert probe.probe(f"127.0.0.1:{tls_port}") is Port.TLS
    assert probe.probe(f"localhost:{plaintext_port}") is Port.PLAINTEXT


def test_the_blocking_probe_asks_no_resolver(tls_port: int) -> None:
    # The client probes a failed call's target in the call's thread: a resolver that drops
    # packets would hold it past the bound.
    assert probe.probe(f"{NAME}:{tls_port}") is Port.UNKNOWN


async def test_the_asyncio_probe_resolves_a_name(tls_port: int) -> None:
    # A balancer's backend given by name (a flag, a file; Compose's service names): found.
    assert await probe.resolving(f"{NAME}:{tls_port}") is Port.TLS
    assert await probe.resolving(f"127.0.0.1:{tls_port}") is Port.TLS


async def test_a_name_that_does_not_resolve_is_unknown() -> None:
    # .invalid never resolves (RFC 6761); where the resolver does not answer at all, the
    # bound ends the wait.
    assert await probe.resolving("sluice-probe.invalid:443", bound_s=0.5) is Port.UNKNOWN
    assert await probe.resolving("unix:/tmp/sock") is Port.UNKNOWN
