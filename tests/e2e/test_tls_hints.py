"""A connection that fails for a TLS mismatch says which one and the option that fixes it:
plaintext to a TLS port, TLS without the client certificate a mutual-TLS port requires, TLS
to a plaintext port. On real processes, with certificates made here. (That the programs log
no grpc-core lines for such handshakes is test_grpc_quiet's.)"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from perf.certs import Authority
from perf.tls import mutual
from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.client.connect import Connection
from sluice.runtime.tls import ClientTLS, blocking_channel
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from tests.e2e.harness import BIN, Process, running_tls, server_argv

pytestmark = pytest.mark.e2e


@dataclass
class Ports:
    ca: Authority
    mutual: Process  # TLS, requiring a client certificate
    one_way: Process  # TLS, no client certificate asked for
    plain: Process


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    ca = Authority(tmp_path_factory.mktemp("ca"))
    client = ca.issue("client")
    shown = ClientTLS.of(ca=str(ca.cert), cert=str(client.cert), key=str(client.key))
    trusting = ClientTLS.of(ca=str(ca.cert))
    one_way = ca.issue("one-way")
    with (
        running_tls(server_argv(*mutual(ca, ca.issue("server"))), shown) as mtls,
        running_tls(
            server_argv("--tls-cert", str(one_way.cert), "--tls-key", str(one_way.key)), trusting
        ) as tls,
        running_tls(server_argv(), None) as plain,
    ):
        yield Ports(ca, mtls, tls, plain)


def refusal(target: str, **options: str) -> str:
    with SluiceClient(target, **options) as client, pytest.raises(grpc.RpcError) as failed:
        client.health(timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    return failed.value.details() or ""


@pytest.mark.parametrize("port", ["one_way", "mutual"])
def test_plaintext_to_a_tls_port_says_it_wants_tls(ports: Ports, port: str) -> None:
    target = getattr(ports, port).address
    details = refusal(target)
    assert f"{target} speaks TLS" in details, details
    assert "tls_ca=" in details and "--tls-ca" not in details  # the client's words, not the CLI's
    assert ("client certificate" in details) == (port == "mutual"), details
    assert "failed to connect to all addresses" in details  # grpc's own words kept


def test_tls_without_a_client_certificate_says_one_is_required(ports: Ports) -> None:
    target = ports.mutual.address
    details = refusal(target, tls_ca=str(ports.ca.cert))
    assert f"{target} requires a client certificate" in details, details
    assert "tls_cert=" in details and "tls_key=" in details and "--tls-cert" not in details


def test_the_asyncio_client_says_it_too(ports: Ports) -> None:
    async def health() -> None:
        async with AsyncSluiceClient(ports.one_way.address) as client:
            await client.health(timeout=10)

    with pytest.raises(grpc.RpcError) as failed:
        asyncio.run(health())
    assert f"{ports.one_way.address} speaks TLS" in (failed.value.details() or "")


def test_a_commands_own_channel_is_explained_by_its_connection(ports: Ports) -> None:
    """`sluice perf` calls over channels of its own: its Connection explains their errors."""
    target = ports.mutual.address
    connection = Connection(tls_ca=str(ports.ca.cert))
    with blocking_channel(target, connection.client_tls()) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            stub.Health(pb.HealthRequest(), timeout=10)
    details = connection.explained(failed.value, target).details() or ""
    assert f"{target} requires a client certificate" in details, details
    assert "--tls-cert" in details and "tls_cert=" not in details  # the commands' words


def test_tls_to_a_plaintext_port_says_it_is_plaintext(ports: Ports) -> None:
    target = ports.plain.address
    details = refusal(target, tls_ca=str(ports.ca.cert))
    assert f"{target} speaks plaintext" in details, details


def test_a_certificate_for_another_name_says_which_option(ports: Ports) -> None:
    target = ports.one_way.address
    details = refusal(target, tls_ca=str(ports.ca.cert), server_name="elsewhere.test")
    assert f"{target}'s certificate is for another name" in details, details
    assert "server_name=" in details and "--server-name" not in details


def test_an_untrusted_certificate_says_which_option(
    ports: Ports, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = Authority(tmp_path_factory.mktemp("other-ca"))
    target = ports.one_way.address
    details = refusal(target, tls_ca=str(other.cert))
    assert f"this client does not trust {target}'s certificate" in details, details


def test_a_reachable_port_in_the_right_mode_is_not_diagnosed(ports: Ports) -> None:
    with SluiceClient(ports.one_way.address, tls_ca=str(ports.ca.cert)) as client:
        assert client.health().node_id == "test-node"


def test_the_cli_and_top_print_the_diagnosis(ports: Ports) -> None:
    target = ports.mutual.address
    for argv in (["predict", "--sample", "1"], ["top", "--once"]):
        done = subprocess.run(
            [str(BIN / "sluice"), *argv, "--target", target],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, done.stderr
        assert f"{target} speaks TLS" in done.stderr and "--tls-ca" in done.stderr, done.stderr
        assert "SLUICE_TLS_CA" in done.stderr and "tls_ca=" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("port", "options", "said"),
    [
        ("one_way", (), "speaks TLS"),
        ("mutual", ("--tls-ca", "CA"), "requires a client certificate"),
    ],
)
def test_perf_prints_the_diagnosis(
    ports: Ports, port: str, options: tuple[str, ...], said: str
) -> None:
    target = getattr(ports, port).address
    given = [str(ports.ca.cert) if o == "CA" else o for o in options]
    done = subprocess.run(
        [str(BIN / "sluice"), "perf", "--target", target, "-n", "1", *given],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert f"sluice perf: {target}: UNAVAILABLE: {target} {said}" in done.stderr, done.stderr
    assert "tls_" not in done.stderr, done.stderr
