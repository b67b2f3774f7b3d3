"""A balancer whose one backend refuses connections says so, for the method that was called:
a Predict, a KServe ModelInfer and a Metadata each answer UNAVAILABLE naming the backend and
that it refuses connections (not `not_serving`, which is what a server says of itself), and
the balancer's log line says it too. The backend's port is held by a socket that is bound but
not listening, so every connect is refused and nothing else can take the port meanwhile.

A TLS mismatch between the balancer and its servers is named with the flag that fixes it, in
a Predict's UNAVAILABLE, in the balancer's Health (each backend's `reason`) and in `sluice
top`: plaintext to a TLS server, TLS without the client certificate a mutual-TLS server
requires, TLS to a plaintext server, TLS with a CA that did not sign the server's certificate
(a second CA), TLS checking a name the server's certificate does not hold. A backend given by
name is probed at the address its name resolves to. Real
servers, certificates made here."""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from rich.console import Console

from perf.certs import Authority
from perf.tls import mutual
from sluice.client import SluiceClient, top
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from sluice.runtime.tls import ClientTLS
from sluice.v1 import inference_pb2 as pb
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, Process, running, running_tls, server_argv, wait_for, wait_health

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def refusing() -> Iterator[str]:
    """An address whose every connect is refused: bound, never listening."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        host, port = held.getsockname()
        yield f"{host}:{port}"


@pytest.fixture(scope="module")
def balancer(refusing: str) -> Iterator[Process]:
    argv = [str(BIN / "sluice-balancer"), "--port", "0", "--backend", refusing]
    with running(argv, serving=False) as proc:  # no usable backend: it is not serving
        wait_health(
            proc.address,
            lambda h: [b.health for b in h.backends] == ["NOT_SERVING"],
            "the balancer to find its backend out",
        )
        yield proc


def refused(call: grpc.RpcError) -> str:
    assert isinstance(call, grpc.Call)
    assert call.code() == grpc.StatusCode.UNAVAILABLE, call
    details: str = call.details() or ""
    return details


def test_predict_names_the_backend_that_refuses_connections(
    balancer: Process, refusing: str
) -> None:
    with SluiceClient(balancer.address) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict({"input": SAMPLES[0].input}, timeout=30)
    details = refused(caught.value)
    assert (
        details == f"no backend can take the call: none is usable ({refusing} refuses connections)"
    )


def test_model_infer_names_the_backend_that_refuses_connections(
    balancer: Process, refusing: str
) -> None:
    x = SAMPLES[1].input
    request = kpb.ModelInferRequest(
        model_name="digits",
        inputs=[
            kpb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=x.shape)
        ],
        raw_input_contents=[np.ascontiguousarray(x).tobytes()],
    )
    with grpc.insecure_channel(balancer.address) as channel, pytest.raises(grpc.RpcError) as caught:
        kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    details = refused(caught.value)
    assert "Metadata" not in details and "not_serving" not in details
    assert f"{refusing} refuses connections" in details


def test_metadata_names_itself_and_the_backend_that_refuses_connections(
    balancer: Process, refusing: str
) -> None:
    with SluiceClient(balancer.address) as client, pytest.raises(grpc.RpcError) as caught:
        client.metadata(timeout=30)
    details = refused(caught.value)
    assert details == (
        "no backend can answer /sluice.v1.Inference/Metadata: "
        f"none is usable ({refusing} refuses connections)"
    )


def test_the_log_says_why_the_backend_is_out(balancer: Process, refusing: str) -> None:
    # At INFO: what a restart shows too, no setting to fix.
    line = f"INFO sluice.balancer backend {refusing} is NOT_SERVING: refuses connections"
    wait_for(lambda: any(line in text for text in list(balancer.lines)), "the log line")


def test_the_start_line_counts_one_backend_in_the_singular(balancer: Process) -> None:
    line = "balancing 1 backend, listening on"
    wait_for(lambda: any(line in text for text in list(balancer.lines)), "the start line")


@dataclass
class Mismatched:
    tls: Process  # TLS, no client certificate asked for
    mutual: Process  # TLS, requiring a client certificate
    plain: Process
    no_tls: Process  # a balancer without --upstream-tls-ca, in front of `tls`
    with_ca: Process  # a balancer with --upstream-tls-ca alone, in front of `mutual` and `plain`
    other_ca: Process  # a balancer trusting another CA, in front of `tls`
    other_name: Process  # a balancer checking a name `tls`'s certificate lacks, in front of it
    by_name: Process  # a balancer without --upstream-tls-ca, in front of `tls` by a name


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mismatched]:
    ca = Authority(tmp_path_factory.mktemp("ca"))
    other = Authority(tmp_path_factory.mktemp("other-ca"), "other")
    client = ca.issue("client")
    one_way = ca.issue("one-way")
    shown = ClientTLS.of(ca=str(ca.cert), cert=str(client.cert), key=str(client.key))
    balancer = [str(BIN / "sluice-balancer"), "--port", "0"]
    with (
        running_tls(
            server_argv("--tls-cert", str(one_way.cert), "--tls-key", str(one_way.key)),
            ClientTLS.of(ca=str(ca.cert)),
        ) as tls,
        running_tls(server_argv(*mutual(ca, ca.issue("server"))), shown) as mtls,
        running(server_argv()) as plain,
        running([*balancer, "--backend", tls.address], serving=False) as no_tls,
        running(
            [
                *balancer,
                *("--upstream-tls-ca", str(ca.cert)),
                *("--backend", mtls.address, "--backend", plain.address),
            ],
            serving=False,
        ) as with_ca,
        running(
            [*balancer, "--upstream-tls-ca", str(other.cert), "--backend", tls.address],
            serving=False,
        ) as other_ca,
        running(
            [
                *balancer,
                *("--upstream-tls-ca", str(ca.cert), "--upstream-server-name", "elsewhere.test"),
                *("--backend", tls.address),
            ],
            serving=False,
        ) as other_name,
        running([*balancer, "--backend", named(tls.address)], serving=False) as by_name,
    ):
        yield Mismatched(tls, mtls, plain, no_tls, with_ca, other_ca, other_name, by_name)


def named(address: str) -> str:
    """`address` (127.0.0.1:PORT) by a name only a resolver turns into 127.0.0.1: the hosts
    file's localhost (names are case-insensitive), not the spelling read without one."""
    assert address.startswith("127.0.0.1:"), address
    return address.replace("127.0.0.1", "LOCALHOST")


def screen_of(health: pb.HealthResponse) -> str:
    """What `sluice top --once` shows of `health`, as text."""
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    console.print(top.render(None, health, 0.0))
    return console.export_text()


def reasons(address: str, count: int) -> pb.HealthResponse:
    """The balancer's Health once each of its `count` backends has a reason it is out."""
    return wait_health(
        address,
        lambda h: len(h.backends) == count and all(b.reason for b in h.backends),
        "the reasons its backends are out",
    )


def test_plaintext_to_a_tls_server_says_to_give_the_ca(mismatched: Mismatched) -> None:
    server = mismatched.tls.address
    health = reasons(mismatched.no_tls.address, 1)
    [backend] = health.backends
    assert backend.reason == "speaks TLS: give the balancer --upstream-tls-ca", backend
    with SluiceClient(mismatched.no_tls.address) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict({"input": SAMPLES[0].input}, timeout=30)
    details = refused(caught.value)
    assert f"{server} speaks TLS: give the balancer --upstream-tls-ca" in details, details
    screen = screen_of(health)
    assert f"{server}: speaks TLS: give the balancer --upstream-tls-ca" in screen, screen


def test_tls_to_a_mutual_tls_server_says_to_give_a_certificate(mismatched: Mismatched) -> None:
    server = mismatched.mutual.address
    health = reasons(mismatched.with_ca.address, 2)
    reason = {b.address: b.reason for b in health.backends}[server]
    assert reason == "wants a client certificate: --upstream-tls-cert/--upstream-tls-key"
    with (
        SluiceClient(mismatched.with_ca.address) as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.predict({"input": SAMPLES[0].input}, timeout=30)
    details = refused(caught.value)
    assert f"{server} wants a client certificate: --upstream-tls-cert" in details, details


def test_tls_to_a_plaintext_server_says_to_drop_the_ca(mismatched: Mismatched) -> None:
    server = mismatched.plain.address
    health = reasons(mismatched.with_ca.address, 2)
    reason = {b.address: b.reason for b in health.backends}[server]
    assert reason == "is plaintext: drop --upstream-tls-ca", reason
    # At WARNING: a setting the user must fix.
    line = (
        f"WARNING sluice.balancer backend {server} is NOT_SERVING: is plaintext: drop "
        "--upstream-tls-ca"
    )
    wait_for(lambda: any(line in text for text in list(mismatched.with_ca.lines)), "the log line")


@pytest.mark.parametrize(
    ("balancer", "said"),
    [
        ("other_ca", "presents a certificate --upstream-tls-ca does not trust"),
        ("other_name", "presents a certificate for another name than the balancer checks"),
    ],
)
def test_a_certificate_the_balancer_refuses_says_which_flag(
    mismatched: Mismatched, balancer: str, said: str
) -> None:
    server, address = mismatched.tls.address, getattr(mismatched, balancer).address
    [backend] = reasons(address, 1).backends
    assert backend.reason.startswith(said), backend
    flag = "--upstream-tls-ca" if balancer == "other_ca" else "--upstream-server-name"
    assert flag in backend.reason, backend
    with SluiceClient(address) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict({"input": SAMPLES[0].input}, timeout=30)
    details = refused(caught.value)
    assert f"{server} {said}" in details, details


def test_a_backend_given_by_name_is_probed_where_it_resolves(mismatched: Mismatched) -> None:
    [backend] = reasons(mismatched.by_name.address, 1).backends
    assert backend.address == named(mismatched.tls.address), backend
    assert backend.reason == "speaks TLS: give the balancer --upstream-tls-ca", backend
