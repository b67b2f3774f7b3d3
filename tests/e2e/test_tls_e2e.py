"""TLS on every hop, on real processes: client -> balancer -> server with mutual TLS on both
hops, refusals of clients without a certificate or without TLS, grpcurl, the CLI and the
sweep over TLS, a certificate swapped on disk served to new connections without a restart,
and the warning about plaintext off 127.0.0.1. Certificates come from a CA made here."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from perf.certs import Authority, Pair
from perf.tls import mutual
from sluice.client import SluiceClient
from sluice.perf import sweep
from sluice.runtime.tls import PLAINTEXT_WARNING, ClientTLS
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, grpcurl, loopback, running_tls, server_argv, wait_for

pytestmark = pytest.mark.e2e

SERVER_NAME = "sluice-server.test"  # the servers' certificates name only this


@dataclass
class Cluster:
    ca: Authority
    client: Pair  # the caller's certificate
    server: str
    balancer: str

    def tls(self, **kwargs: str) -> dict[str, str]:
        """SluiceClient's TLS options for this cluster (with the client certificate)."""
        return {
            "tls_ca": str(self.ca.cert),
            "tls_cert": str(self.client.cert),
            "tls_key": str(self.client.key),
            **kwargs,
        }


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One server and a balancer in front of it, mutual TLS on both hops; the balancer checks
    the server's certificate against SERVER_NAME, not the address it dials."""
    ca = Authority(tmp_path_factory.mktemp("ca"))
    client = ca.issue("client")
    upstream = ca.issue("balancer-upstream")
    reach = ClientTLS.of(ca=str(ca.cert), cert=str(client.cert), key=str(client.key))
    with ExitStack() as stack:
        server = stack.enter_context(
            running_tls(
                server_argv(*mutual(ca, ca.issue("server", hosts=(SERVER_NAME,)))),
                ClientTLS.of(
                    ca=str(ca.cert),
                    cert=str(client.cert),
                    key=str(client.key),
                    server_name=SERVER_NAME,
                ),
            )
        )
        balancer_argv = [
            str(BIN / "sluice-balancer"), "--port", "0", "--backend", server.address,
            *mutual(ca, ca.issue("balancer")),
            "--upstream-tls-ca", str(ca.cert), "--upstream-server-name", SERVER_NAME,
            "--upstream-tls-cert", str(upstream.cert), "--upstream-tls-key", str(upstream.key),
        ]  # fmt: skip
        balancer = stack.enter_context(running_tls(balancer_argv, reach))
        yield Cluster(ca, client, server.address, balancer.address)


def test_mutual_tls_on_both_hops_gives_the_right_answers(
    tls_cluster: Cluster, reference: ort.InferenceSession
) -> None:
    with SluiceClient(tls_cluster.balancer, **tls_cluster.tls()) as client:
        for sample in SAMPLES:
            answer = client.infer({"input": sample.input}, no_cache=True)
            label, probabilities = reference.run(None, {"input": sample.input})
            np.testing.assert_array_equal(answer.outputs["label"], label)
            np.testing.assert_allclose(answer.outputs["probabilities"], probabilities, rtol=1e-6)
            assert answer.node_id == "test-node"  # the server answered, through the balancer
        backends = client.health().backends
    assert [(b.address, b.health) for b in backends] == [(tls_cluster.server, "SERVING")]


@pytest.mark.parametrize("hop", ["balancer", "server"])
def test_a_client_without_a_certificate_is_refused_at_the_handshake(
    tls_cluster: Cluster, hop: str
) -> None:
    name = {"server_name": SERVER_NAME} if hop == "server" else {}
    target = getattr(tls_cluster, hop)
    with (
        SluiceClient(target, tls_ca=str(tls_cluster.ca.cert), **name) as client,
        pytest.raises(grpc.RpcError) as refused,
    ):
        client.health(timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_is_refused(tls_cluster: Cluster) -> None:
    for target in (tls_cluster.balancer, tls_cluster.server):
        with SluiceClient(target) as client, pytest.raises(grpc.RpcError) as refused:
            client.health(timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_ca_is_refused(
    tls_cluster: Cluster, tmp_path: Path
) -> None:
    other = Authority(tmp_path, "other-ca")
    with (
        SluiceClient(tls_cluster.balancer, **tls_cluster.tls(tls_ca=str(other.cert))) as client,
        pytest.raises(grpc.RpcError) as refused,
    ):
        client.health(timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpcurl_with_cacert_cert_and_key(tls_cluster: Cluster) -> None:
    tls = [
        "-cacert", str(tls_cluster.ca.cert),
        "-cert", str(tls_cluster.client.cert), "-key", str(tls_cluster.client.key),
    ]  # fmt: skip
    listed = grpcurl(*tls, tls_cluster.balancer, "list", plaintext=False)
    assert "sluice.v1.Inference" in listed.split()
    sample = SAMPLES[3]
    request = {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 64],
                "fp32_data": sample.input.ravel().tolist(),
            }
        ],
        "typed_outputs": True,
    }
    out = grpcurl(
        *tls, "-d", json.dumps(request), tls_cluster.balancer, "sluice.v1.Inference/Predict",
        plaintext=False,
    )  # fmt: skip
    outputs = {o["name"]: o for o in json.loads(out)["outputs"]}
    assert [int(v) for v in outputs["label"]["int64_data"]] == [sample.label]
    # Without a client certificate grpcurl is refused too.
    refused = subprocess.run(
        [str(BIN / "grpcurl"), "-cacert", str(tls_cluster.ca.cert), tls_cluster.balancer, "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0


def test_the_cli_and_the_sweep_over_mutual_tls(tls_cluster: Cluster) -> None:
    flags = [
        "--tls-ca", str(tls_cluster.ca.cert),
        "--tls-cert", str(tls_cluster.client.cert), "--tls-key", str(tls_cluster.client.key),
    ]  # fmt: skip
    done = subprocess.run(
        [str(BIN / "sluice"), "predict", "--target", tls_cluster.balancer, "--sample", "7", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "label INT64[1]: [7]" in done.stdout
    args = sweep.build_parser().parse_args(
        ["--target", tls_cluster.balancer, "-c", "2", "-n", "40", "--unique", "--quiet", *flags]
    )
    level = sweep.sweep(args)["levels"][0]
    assert (level["calls"], level["ok"]) == (40, 40), level["statuses"]
    assert level["server"]["requests"] >= 40  # the balancer's Health, also over TLS
    # h2load cannot show a client certificate: the sweep says so rather than fail at it.
    refused = subprocess.run(
        [
            str(BIN / "sluice"),
            "perf",
            "--engine",
            "h2load",
            "--target",
            tls_cluster.balancer,
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "client certificate" in refused.stderr or "h2load on PATH" in refused.stderr


def served_name(address: str, ca: Authority) -> str:
    """The common name of the certificate a new TLS connection to `address` is shown."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=str(ca.cert))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        seen = tls.getpeercert()
    assert seen is not None
    return str(dict(rdn[0] for rdn in seen["subject"])["commonName"])


def replace(target: Path, source: Path) -> None:
    """Put `source`'s bytes at `target` in one step (a rename, as a secret mount does)."""
    partial = target.with_suffix(".partial")
    partial.write_bytes(source.read_bytes())
    os.replace(partial, target)


def test_a_certificate_swapped_on_disk_serves_new_connections_without_a_restart(
    tmp_path: Path,
) -> None:
    ca = Authority(tmp_path)
    first, second = ca.issue("first"), ca.issue("second")
    cert, key = tmp_path / "served.pem", tmp_path / "served-key.pem"
    replace(cert, first.cert)
    replace(key, first.key)
    tls = ClientTLS.of(ca=str(ca.cert))
    argv = server_argv("--tls-cert", str(cert), "--tls-key", str(key))
    with (
        running_tls(argv, tls) as server,
        SluiceClient(server.address, tls_ca=str(ca.cert)) as before,
    ):
        assert before.health().node_id == "test-node"
        assert served_name(server.address, ca) == "first"
        replace(key, second.key)
        replace(cert, second.cert)
        # The next handshake takes the new files (a bounded poll, though the first should).
        wait_for(lambda: served_name(server.address, ca) == "second", "the new certificate")
        with SluiceClient(server.address, tls_ca=str(ca.cert)) as after:
            assert after.predict({"input": SAMPLES[1].input})["label"].tolist() == [1]
        before.health()  # the connection made before the swap still serves
        # A broken file: one WARNING, and the certificate loaded last keeps serving.
        (tmp_path / "broken.pem").write_text("not a certificate\n")
        replace(cert, tmp_path / "broken.pem")
        assert served_name(server.address, ca) == "second"
        assert served_name(server.address, ca) == "second"
        assert server.proc.poll() is None
    log = server.log()
    assert "TLS certificate" in log and "reloaded" in log
    assert log.count("still serving the certificate loaded before") == 1, log


def test_plaintext_off_loopback_is_warned_about() -> None:
    warning = PLAINTEXT_WARNING.split("%s")[0]  # "plaintext on "
    with running_tls(server_argv("--host", "0.0.0.0"), None) as exposed:
        address = loopback(exposed.address)  # tests connect through 127.0.0.1 only
        with SluiceClient(address) as client:
            assert client.health().node_id == "test-node"
    port = exposed.address.rpartition(":")[2]
    assert f"{warning}0.0.0.0:{port}, no TLS" in exposed.log()
    with running_tls(server_argv(), None) as local:
        assert warning not in local.log()  # plaintext on 127.0.0.1: no warning
