"""TLS credentials: the listener's files re-read only when they change, a broken file warned
about once while the last good certificate serves, and the client's options. One in-process
grpc.aio server shows grpc asking the fetcher at each new handshake."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from perf.certs import Authority, Pair
from sluice.core.errors import SluiceError
from sluice.runtime.security import SecuritySettings
from sluice.runtime.tls import ClientTLS, ServerFiles, server_credentials


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def replace(target: Path, source: Path) -> None:
    """Put `source`'s bytes at `target` in one step (a rename, as a secret mount does)."""
    partial = target.with_suffix(".partial")
    partial.write_bytes(source.read_bytes())
    os.replace(partial, target)


def served(ca: Authority, pair: Pair) -> tuple[Path, Path]:
    """Copies of `pair` at fixed paths, for a listener to serve (and the test to swap)."""
    cert, key = ca.folder / "served.pem", ca.folder / "served-key.pem"
    replace(cert, pair.cert)
    replace(key, pair.key)
    return cert, key


def test_unchanged_files_are_not_read_again(ca: Authority) -> None:
    cert, key = served(ca, ca.issue("first"))
    files = ServerFiles(str(cert), str(key), str(ca.cert))
    files.load()
    assert [files.fetch() for _ in range(3)] == [None, None, None]
    assert files.reloads == 0


def test_changed_files_are_read_at_the_next_fetch(ca: Authority) -> None:
    cert, key = served(ca, ca.issue("first"))
    files = ServerFiles(str(cert), str(key))
    files.load()
    second = ca.issue("second")
    replace(key, second.key)
    replace(cert, second.cert)
    assert isinstance(files.fetch(), grpc.ServerCertificateConfiguration)
    assert files.fetch() is None  # taken: nothing new until the files change again
    assert files.reloads == 1


def test_a_broken_file_is_warned_about_once_and_the_old_config_stays(
    ca: Authority, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = served(ca, ca.issue("first"))
    files = ServerFiles(str(cert), str(key))
    files.load()
    (ca.folder / "garbage.pem").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n")
    replace(cert, ca.folder / "garbage.pem")
    with caplog.at_level(logging.WARNING, "sluice.tls"):
        assert [files.fetch() for _ in range(3)] == [None, None, None]
    assert len(caplog.records) == 1
    assert str(cert) in caplog.text and "still serving" in caplog.text
    replace(cert, ca.issue("first-again", hosts=("localhost",)).cert)  # the key of another
    caplog.clear()
    with caplog.at_level(logging.WARNING, "sluice.tls"):
        assert files.fetch() is None
    assert len(caplog.records) == 1  # a certificate whose key is not this key
    good = ca.issue("good")
    replace(key, good.key)
    replace(cert, good.cert)
    assert files.fetch() is not None
    assert files.reloads == 1


def test_files_that_do_not_load_at_start_name_themselves(ca: Authority) -> None:
    pair = ca.issue("server")
    with pytest.raises(SluiceError, match=r"missing\.pem"):
        ServerFiles(str(ca.folder / "missing.pem"), str(pair.key)).load()
    with pytest.raises(SluiceError, match=r"server-key\.pem"):
        ServerFiles(str(ca.cert), str(pair.key)).load()  # the CA's certificate, not its key


def test_server_credentials_follow_the_settings(ca: Authority) -> None:
    assert server_credentials(SecuritySettings()) is None
    pair = ca.issue("server")
    settings = SecuritySettings(tls_cert=str(pair.cert), tls_key=str(pair.key))
    assert isinstance(server_credentials(settings), grpc.ServerCredentials)


def test_client_tls_options(ca: Authority) -> None:
    assert ClientTLS.of() is None
    assert ClientTLS.of(tls=True) is not None  # the system's CAs
    pair = ca.issue("client")
    tls = ClientTLS.of(ca=str(ca.cert), cert=str(pair.cert), key=str(pair.key), server_name="x")
    assert tls is not None and tls.options() == [("grpc.ssl_target_name_override", "x")]
    plain = ClientTLS.of(ca=str(ca.cert))
    assert plain is not None and plain.options() == []
    with pytest.raises(ValueError, match="go together"):
        ClientTLS.of(ca=str(ca.cert), cert=str(pair.cert))
    with pytest.raises(OSError):
        ClientTLS.of(ca=str(ca.folder / "missing.pem"))
    with pytest.raises(ssl.SSLError):
        ClientTLS.of(ca=str(ca.cert), cert=str(pair.cert), key=str(ca.issue("other").key))


def peer_name(port: int, ca: Authority, client: Pair) -> str:
    """The common name of the certificate a new TLS connection to `port` is shown."""
    context = ssl.create_default_context(cafile=str(ca.cert))
    context.load_cert_chain(client.cert, client.key)
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        seen = tls.getpeercert()
    assert seen is not None
    return str(dict(rdn[0] for rdn in seen["subject"])["commonName"])


async def test_grpc_aio_serves_a_swapped_certificate_to_new_connections(ca: Authority) -> None:
    cert, key = served(ca, ca.issue("first"))
    client = ca.issue("client")
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    files = ServerFiles(str(cert), str(key), str(ca.cert))
    port = server.add_secure_port("127.0.0.1:0", files.credentials())
    await server.start()
    tls = ClientTLS.of(ca=str(ca.cert), cert=str(client.cert), key=str(client.key))
    assert tls is not None
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", tls.credentials) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert await asyncio.to_thread(peer_name, port, ca, client) == "first"
            second = ca.issue("second")
            replace(key, second.key)
            replace(cert, second.cert)
            assert await asyncio.to_thread(peer_name, port, ca, client) == "second"
            assert files.reloads == 1
            # The connection open before the swap keeps working.
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        # Without a client certificate: refused at the handshake.
        anonymous = ClientTLS.of(ca=str(ca.cert))
        assert anonymous is not None
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", anonymous.credentials) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
