"""How clients reach a target: the connection flags and their SLUICE_ variables, the API key
on every call of both clients, and what h2load is handed."""

from __future__ import annotations

import argparse
import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from perf.certs import Authority
from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.client.connect import Connection, add_options, from_args
from sluice.perf import h2engine, sweep
from sluice.v1 import inference_pb2 as pb


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_options(parser)
    return parser.parse_args(argv)


def test_flags_and_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert from_args(parse()) == Connection()
    assert not Connection().secure
    ca = str(Authority(tmp_path).cert)  # read by from_args: a file that does not load is named
    monkeypatch.setenv("SLUICE_TLS_CA", ca)
    monkeypatch.setenv("SLUICE_API_KEY", "k1")
    got = from_args(parse("--server-name", "sluice.test"))
    assert got == Connection(tls_ca=ca, server_name="sluice.test", api_key="k1")
    assert got.secure
    assert from_args(parse("--tls")).secure  # the system's CAs
    with pytest.raises(ValueError, match="go together"):
        from_args(parse("--tls-cert", "c.pem"))


def test_h2load_is_handed_https_and_the_key_and_refuses_client_certificates() -> None:
    argv = h2engine.request_args("127.0.0.1:1", "/m", Connection(tls_ca="ca.pem", api_key="k"))
    assert argv[-1] == "https://127.0.0.1:1/m"
    assert argv[argv.index("authorization: Bearer k") - 1] == "-H"
    assert h2engine.request_args("127.0.0.1:1", "/m", Connection())[-1] == "http://127.0.0.1:1/m"
    args = sweep.build_parser().parse_args(
        ["--engine", "h2load", "--tls-ca", "ca.pem", "--tls-cert", "c.pem", "--tls-key", "k.pem"]
    )
    refusal = sweep.h2load_refusal(args)
    assert "client certificate" in refusal or refusal == h2engine.MISSING


class Recorder:
    """A server that answers every call with an empty message and keeps each call's
    metadata."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []

    def handler(self) -> grpc.GenericRpcHandler:
        async def answer(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            return b""

        recorder = self

        class Handler(grpc.GenericRpcHandler):
            def service(
                self, details: grpc.HandlerCallDetails
            ) -> grpc.RpcMethodHandler[bytes, bytes]:
                recorder.seen.append((details.method, dict(details.invocation_metadata)))
                return grpc.unary_unary_rpc_method_handler(answer)

        return Handler()


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    recording = Recorder()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([recording.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield recording, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_the_api_key_goes_with_every_call(recorder: tuple[Recorder, str]) -> None:
    recording, address = recorder
    x = np.zeros((1, 4), np.float32)
    async with AsyncSluiceClient(address, api_key="s3cret") as client:
        await client.predict({"input": x})
        await client.health()
        await client.metadata()
        await client.call_raw(pb.PredictRequest().SerializeToString())

    def blocking() -> None:
        with SluiceClient(address, api_key="s3cret") as sync:
            sync.predict({"input": x})
            sync.health()

    await asyncio.to_thread(blocking)
    async with AsyncSluiceClient(address) as anonymous:
        await anonymous.health()
    methods = [method.rsplit("/", 1)[1] for method, _ in recording.seen]
    assert methods == ["Predict", "Health", "Metadata", "Predict", "Predict", "Health", "Health"]
    keys = [metadata.get("authorization") for _, metadata in recording.seen]
    assert keys == ["Bearer s3cret"] * 6 + [None]


@pytest.mark.parametrize("keyword", ["tls_ca", "tls_cert", "tls_key"])
def test_a_missing_tls_file_names_the_keyword_and_the_file(keyword: str, tmp_path: Path) -> None:
    pair = Authority(tmp_path).issue("client")
    given = {"tls_ca": str(pair.cert), "tls_cert": str(pair.cert), "tls_key": str(pair.key)}
    given[keyword] = missing = str(tmp_path / "nope.pem")
    with pytest.raises(OSError) as caught:
        SluiceClient("127.0.0.1:1", **given)
    assert str(caught.value) == f"{keyword}={missing!r}: no such file"


def test_a_key_that_is_not_the_certificates_names_both(tmp_path: Path) -> None:
    ca = Authority(tmp_path)
    cert, other = ca.issue("client").cert, ca.issue("other").key
    with pytest.raises(ssl.SSLError) as caught:
        SluiceClient("127.0.0.1:1", tls_cert=str(cert), tls_key=str(other))
    assert str(caught.value).startswith(f"tls_cert={str(cert)!r} with tls_key={str(other)!r}: ")
