"""How the commands that call a target (`sluice predict/health/metadata`, `sluice top`,
`sluice perf`) reach it: TLS and an API key, one set of flags and SLUICE_ variables; and,
when they cannot, what to fix (sluice.client.diagnose)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import grpc

from sluice.client import diagnose
from sluice.runtime import config
from sluice.runtime.tls import ClientTLS, FileNames, asks_for_tls

DEFAULT_TARGET = "127.0.0.1:8000"  # a balancer's default port on this machine
FLAGS = FileNames("--tls-ca {}", "--tls-cert {}", "--tls-key {}")  # a TLS file, in errors
# grpc's target schemes that need no port or check their own (ipv4:/ipv6: list addresses);
# dns: and a plain HOST[:PORT] dial port 443 when none is given.
OWN_RULES = ("unix", "unix-abstract", "vsock", "ipv4", "ipv6")


@dataclass(frozen=True)
class Connection:
    """TLS files and an API key, as given: plain values, so load-generator processes can be
    handed one and build their own channels."""

    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    server_name: str = ""
    api_key: str = ""

    @property
    def secure(self) -> bool:
        """Whether calls go over TLS (any TLS option asks for it)."""
        return asks_for_tls(self.tls, self.tls_ca, self.tls_cert, self.tls_key, self.server_name)

    def client_tls(self) -> ClientTLS | None:
        """The channel credentials (None: plaintext); OSError naming the flag and the file if
        one does not load."""
        return ClientTLS.of(
            tls=self.tls,
            ca=self.tls_ca,
            cert=self.tls_cert,
            key=self.tls_key,
            server_name=self.server_name,
            names=FLAGS,
        )

    def client_kwargs(self) -> dict[str, Any]:
        """The SluiceClient / AsyncSluiceClient keyword arguments (hints on failed calls
        name the commands' flags and variables, not the client's keywords)."""
        return {
            "tls": self.tls,
            "tls_ca": self.tls_ca,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
            "server_name": self.server_name,
            "api_key": self.api_key,
            "hints": diagnose.Audience.COMMANDS,
        }

    def explained(self, error: grpc.RpcError, target: str) -> grpc.RpcError:
        """`error` of a call to `target` on channels of this connection (`sluice perf`'s own),
        with what to fix when diagnose sees it (SluiceClient does this itself)."""
        shown = diagnose.Shown(tls=self.secure, certificate=bool(self.tls_cert))
        return diagnose.explained(error, target, shown, diagnose.Audience.COMMANDS)


PLAINTEXT = Connection()  # no TLS, no API key


def add_target(
    parser: argparse.ArgumentParser, help: str = "HOST:PORT of a server or balancer"
) -> None:
    """--target, defaulting to SLUICE_TARGET, then DEFAULT_TARGET; refused without a port."""
    config.add_option(parser, "target", DEFAULT_TARGET, help, type=target)


def target(text: str) -> str:
    """A --target as given (several, comma-separated, for `sluice perf`), each with a port:
    grpc would dial 443 in silence."""
    for part in text.split(","):
        if not has_port(part):
            where = "" if part == text else f"{text}: "
            raise argparse.ArgumentTypeError(f"{where}{part} has no port: give HOST:PORT")
    return text


def has_port(target: str) -> bool:
    """Whether grpc dials `target` at a port it names (HOST:PORT, [IPV6]:PORT, dns:[//AUTHORITY/]
    HOST:PORT), or resolves it by a scheme of its own rules (unix:PATH, ...)."""
    scheme, colon, rest = target.partition(":")
    if colon and scheme in OWN_RULES:
        return True
    if colon and scheme == "dns":
        target = rest.split("/", 3)[3] if rest.startswith("//") and rest.count("/") >= 3 else rest
    host, colon, port = target.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    return bool(colon and host) and port.isdigit() and (":" not in host or bracketed)


# The string options `add_options` adds: (flag, its SLUICE_ variable, metavar, help).
STRING_OPTIONS = (
    ("--tls-ca", "SLUICE_TLS_CA", "PEM", "TLS, trusting the CAs in this PEM bundle"),
    (
        "--tls-cert",
        "SLUICE_CLIENT_TLS_CERT",
        "PEM",
        "client certificate for mutual TLS; needs --tls-key",
    ),
    ("--tls-key", "SLUICE_CLIENT_TLS_KEY", "PEM", "the private key of --tls-cert"),
    (
        "--server-name",
        "SLUICE_SERVER_NAME",
        None,
        "check the server's certificate against this name, not the target's host",
    ),
    ("--api-key", "SLUICE_API_KEY", None, "send 'authorization: Bearer KEY' on every call"),
)


def add_options(parser: argparse.ArgumentParser) -> None:
    """--tls, --tls-ca, --tls-cert, --tls-key, --server-name and --api-key, each defaulting to
    its SLUICE_ variable."""
    env = os.environ.get
    parser.add_argument(
        "--tls",
        action="store_true",
        default=env("SLUICE_TLS", "") not in ("", "0", "false"),
        help="TLS, trusting the system's CAs (implied by the options below) [env SLUICE_TLS]",
    )
    for flag, variable, metavar, words in STRING_OPTIONS:
        parser.add_argument(
            flag, default=env(variable, ""), metavar=metavar, help=f"{words} [env {variable}]"
        )


def from_args(args: argparse.Namespace) -> Connection:
    """The options `add_options` added; ValueError for a certificate without its key, OSError
    naming the flag and the file for a TLS file that does not load (read now, before a
    connection is tried)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    connection = Connection(
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        server_name=args.server_name,
        api_key=args.api_key,
    )
    connection.client_tls()
    return connection
