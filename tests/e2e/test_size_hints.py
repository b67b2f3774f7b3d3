"""A message over a size limit names the limit that was hit and how to raise it: the client's
own (its `max_message_bytes=`; the commands' `--max-message-bytes`), or the server's or
balancer's (`--max-message-bytes`, SLUICE_MAX_MESSAGE_BYTES), with grpc's sizes kept; on real
processes."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice.client import SluiceClient, diagnose
from sluice.core import limits
from tests.e2e.harness import BIN, Process, running, server_argv

pytestmark = pytest.mark.e2e

SERVER_LIMIT = 1 << 20  # the server's --max-message-bytes
BALANCER_LIMIT = 4 << 20  # the balancer's, above the server's
ROWS_2MIB = np.zeros((8192, 64), np.float32)  # a 2 MiB request for the digits model


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with running(server_argv("--max-message-bytes", str(SERVER_LIMIT))) as proc:
        yield proc


@pytest.fixture(scope="module")
def balancer(server: Process) -> Iterator[Process]:
    argv = [
        str(BIN / "sluice-balancer"), "--port", "0", "--backend", server.address,
        "--max-message-bytes", str(BALANCER_LIMIT),
    ]  # fmt: skip
    with running(argv) as proc:
        yield proc


def refusal(target: str, rows: np.ndarray, **options: int) -> grpc.RpcError:
    with SluiceClient(target, **options) as client, pytest.raises(grpc.RpcError) as failed:
        client.predict({"input": rows})
    return failed.value


def sizes(details: str) -> tuple[int, int]:
    found = re.search(r"\((\d+) vs\. (\d+)\)", details)
    assert found, details
    return int(found[1]), int(found[2])


def test_over_the_clients_own_send_limit_names_max_message_bytes(server: Process) -> None:
    error = refusal(server.address, ROWS_2MIB, max_message_bytes=SERVER_LIMIT)
    details = error.details() or ""
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "this client's limit" in details and "max_message_bytes=" in details, details
    assert "--max-message-bytes" not in details  # the client's keyword, not the commands' flag
    assert limits.RAISE not in details  # not the server's to raise
    assert sizes(details)[1] == SERVER_LIMIT


def test_over_the_servers_limit_names_its_flag_and_variable(server: Process) -> None:
    error = refusal(server.address, ROWS_2MIB)  # the client's default limit lets it out
    details = error.details() or ""
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"the server or balancer at {server.address}" in details, details
    assert limits.RAISE in details
    assert "max_message_bytes=" not in details  # raising the client's would not help
    assert sizes(details)[1] == SERVER_LIMIT


def test_over_the_balancers_limit_names_its_flag(balancer: Process) -> None:
    error = refusal(balancer.address, np.zeros((3 * 8192, 64), np.float32))  # 6 MiB
    details = error.details() or ""
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"the server or balancer at {balancer.address}" in details, details
    assert "--max-message-bytes" in details and "SLUICE_MAX_MESSAGE_BYTES" in details
    assert sizes(details)[1] == BALANCER_LIMIT


def test_over_the_limit_of_a_server_behind_the_balancer_names_the_flag(
    balancer: Process,
) -> None:
    error = refusal(balancer.address, ROWS_2MIB)  # under the balancer's, over the server's
    details = error.details() or ""
    assert "--max-message-bytes" in details and "SLUICE_MAX_MESSAGE_BYTES" in details, details
    # The balancer refuses it before writing it (its own words, not grpc's "N vs. M").
    assert f"({SERVER_LIMIT})" in details, details


def test_a_reply_over_the_clients_receive_limit_names_max_message_bytes(server: Process) -> None:
    # A Metadata reply is larger than its request: a limit between the two lets the request
    # out and refuses the reply.
    with (
        SluiceClient(server.address, max_message_bytes=64) as client,
        pytest.raises(grpc.RpcError) as failed,
    ):
        client.metadata()
    details = failed.value.details() or ""
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "reply" in details and "max_message_bytes=" in details, details
    assert sizes(details)[1] == 64


def test_the_cli_prints_the_hint(server: Process, tmp_path: Path) -> None:
    rows = tmp_path / "rows.npy"
    np.save(rows, ROWS_2MIB)
    done = subprocess.run(
        [str(BIN / "sluice"), "predict", "--target", server.address, f"input={rows}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "--max-message-bytes" in done.stderr, done.stderr
    assert "SLUICE_MAX_MESSAGE_BYTES" in done.stderr
    assert "max_message_bytes=" not in done.stderr  # the command's flag, not the keyword


def predict_rows(address: str, rows: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`sluice predict` of `rows` with the client's limit at 1 MiB by the variable the server
    reads too (unless a flag says otherwise)."""
    return subprocess.run(
        [str(BIN / "sluice"), "predict", "--target", address, *flags, f"input={rows}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SLUICE_MAX_MESSAGE_BYTES": str(SERVER_LIMIT)},
    )


def test_the_cli_takes_its_limit_from_the_servers_variable_and_names_its_flag(
    server: Process, tmp_path: Path
) -> None:
    rows = tmp_path / "rows.npy"
    np.save(rows, ROWS_2MIB)
    done = predict_rows(server.address, rows)
    assert done.returncode == 1
    assert "this client's limit" in done.stderr, done.stderr
    assert "--max-message-bytes" in done.stderr and limits.RAISE not in done.stderr
    assert diagnose.CLIENT_LIMIT[diagnose.Audience.COMMANDS] in done.stderr
    assert sizes(done.stderr)[1] == SERVER_LIMIT


def test_the_clis_max_message_bytes_lets_a_big_input_out_to_the_servers_limit(
    server: Process, tmp_path: Path
) -> None:
    rows = tmp_path / "rows.npy"
    np.save(rows, ROWS_2MIB)
    done = predict_rows(server.address, rows, "--max-message-bytes", str(4 * SERVER_LIMIT))
    assert done.returncode == 1, done.stderr
    assert f"the server or balancer at {server.address}" in done.stderr, done.stderr
    assert limits.RAISE in done.stderr
    assert sizes(done.stderr)[1] == SERVER_LIMIT  # the server's limit, not the client's
