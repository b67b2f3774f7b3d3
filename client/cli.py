"""`sluice`: predict, health and metadata against a server or a balancer; `up` (a local
cluster), `perf` (a load sweep) and `top` (a live view) parse their own options."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from sluice import models
from sluice.client import connect
from sluice.client.blocking import SluiceClient
from sluice.client.core import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Prediction,
    declared,
    plain,
)
from sluice.core import tenants
from sluice.core.datatypes import name_of
from sluice.runtime import config
from sluice.wire import codec


class BadInput(ValueError):
    """An argument to fix; shown as argparse shows its own errors (usage, exit status 2)."""


class Failed(Exception):
    """A call a command made on its own behalf failed: what it was for, and grpc's error."""

    def __init__(self, doing: str, error: grpc.RpcError) -> None:
        super().__init__(doing)
        self.doing = doing
        self.error = error


INPUT_FORMS = "NAME=FILE.npy, NAME=FILE.json or NAME=JSON"


def read_input(text: str) -> tuple[str, Any]:
    """`NAME=FILE.npy` (an array, sent as stored), `NAME=FILE.json` or `NAME=JSON` (plain
    values, converted once the model's datatypes are known); BadInput names the input."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise BadInput(f"{text!r} is not NAME=VALUE; give {INPUT_FORMS}")
    if value.endswith(".npy"):
        try:
            return name, np.load(value, allow_pickle=False)
        except FileNotFoundError as exc:
            raise BadInput(f"input {name!r}: cannot read {value}: {exc.strerror}") from None
        except (OSError, ValueError, EOFError) as exc:
            raise BadInput(f"input {name!r}: cannot read {value} as a .npy file: {exc}") from None
    if value.endswith(".json"):
        try:
            source, what = Path(value).read_text(), value
        except OSError as exc:
            raise BadInput(f"input {name!r}: cannot read {value}: {exc.strerror}") from None
    else:
        source, what = value, "its value"
    try:
        return name, json.loads(source)
    except ValueError as exc:  # a JSONDecodeError, or text that is not UTF-8
        raise BadInput(
            f"input {name!r}: {what} is not JSON ({exc}); expected a number or nested lists "
            f"of numbers, e.g. {name}=[[0.5, 1]], in one of {INPUT_FORMS}"
        ) from None


def input_array(name: str, value: Any, datatypes: dict[str, str]) -> np.ndarray:
    """An input's value as the array to send, in the datatype the model declares for it."""
    try:
        return codec.array_of(name, value, datatypes.get(name, ""))
    except TypeError as exc:
        raise BadInput(str(exc)) from None


def render(answer: Prediction, as_json: bool) -> str:
    if as_json:
        outputs = {
            name: {
                "datatype": name_of(array.dtype),
                "shape": list(array.shape),
                "data": array.tolist(),
            }
            for name, array in answer.outputs.items()
        }
        return json.dumps(
            {
                "model": answer.model,
                "version": answer.version,
                "outputs": outputs,
                "metadata": answer.metadata,
            }
        )
    lines = []
    with np.printoptions(precision=4, suppress=True, threshold=64, linewidth=100):
        for name, array in answer.outputs.items():
            head = f"{name} {name_of(array.dtype)}{list(array.shape)}:"
            body = np.array2string(array)
            lines.append(f"{head} {body}" if "\n" not in body else f"{head}\n{body}")
    lines.append(
        f"(model {answer.model} version {answer.version}, node {answer.node_id}, "
        f"request {answer.request_id})"
    )
    warning = answer.metadata.get("x-nonfinite-inputs")
    if warning:
        lines.append(f"note: input {warning} holds NaN or infinity")
    return "\n".join(lines)


SAMPLE_INPUT = "input"  # the bundled digits model's input, which its samples fill


def sample_input(digit: int, datatypes: dict[str, str]) -> tuple[str, np.ndarray]:
    """The bundled sample of `digit`, for the model's input: the one named `input`, or its only
    input (from the model's metadata)."""
    sample = next((s for s in models.samples() if s.label == digit), None)
    if sample is None:
        raise BadInput(f"no bundled sample of digit {digit}")
    if SAMPLE_INPUT in datatypes or not datatypes:
        return SAMPLE_INPUT, sample.input
    if len(datatypes) == 1:
        return next(iter(datatypes)), sample.input
    raise BadInput(
        f"--sample fills one input, and the model has several ({', '.join(datatypes)}): "
        "give them as NAME=VALUE"
    )


def cmd_predict(client: SluiceClient, args: argparse.Namespace) -> str:
    if not args.inputs and args.sample is None:
        raise BadInput(f"predict needs inputs ({INPUT_FORMS}) or --sample DIGIT")
    values: dict[str, Any] = {}
    for text in args.inputs:  # read before any call: a typo is named without a round trip
        name, value = read_input(text)
        if name in values:
            raise BadInput(f"input {name!r} is given twice")
        values[name] = value
    datatypes = {}
    if args.sample is not None or plain(values):
        # .npy arrays carry their datatype: only plain values and --sample ask the model.
        need = "the inputs' datatypes" if values else "the input --sample fills"
        try:
            meta = client.metadata(model=args.model, version=args.version)
        except grpc.RpcError as exc:
            raise Failed(f"could not ask the model's metadata (needed for {need})", exc) from exc
        datatypes = declared(meta)
    inputs = {name: input_array(name, value, datatypes) for name, value in values.items()}
    if args.sample is not None:
        name, array = sample_input(args.sample, datatypes)
        if name in inputs:
            raise BadInput(f"input {name!r} is given twice: by --sample and as {name}=...")
        inputs[name] = array
    answer = client.infer(inputs, outputs=args.output or (), model=args.model, version=args.version)
    return render(answer, args.json_output)


def cmd_health(client: SluiceClient, args: argparse.Namespace) -> str:
    health = MessageToDict(client.health(model=args.model), preserving_proto_field_name=True)
    return json.dumps(health, indent=None if args.json_output else 2)


def cmd_metadata(client: SluiceClient, args: argparse.Namespace) -> str:
    meta = client.metadata(model=args.model, version=args.version)
    if args.json_output:
        return json.dumps(MessageToDict(meta, preserving_proto_field_name=True))
    lines = [
        f"model {meta.model.name} version {meta.model.version} ({meta.platform}, {meta.provider})"
    ]
    for kind, specs in (("input", meta.model.inputs), ("output", meta.model.outputs)):
        for spec in specs:
            dims = ", ".join("N" if d < 0 else str(d) for d in spec.shape)
            lines.append(f"  {kind:6} {spec.name}: {spec.datatype}[{dims}]")
    return "\n".join(lines)


Command = Callable[[SluiceClient, argparse.Namespace], str]


class Renamed(argparse.Action):
    """`--json`, refused with what took its place: it read as "the input is JSON" in
    `sluice predict --json 'input=[...]'`, and unclaimed, argparse would take it as an
    abbreviation of --json-output."""

    def __init__(self, option_strings: Sequence[str], dest: str, hint: str = "") -> None:
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS)
        self.hint = hint

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.error(f"--json is now --json-output (print the answer as JSON){self.hint}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice command-line client.")
    commands = parser.add_subparsers(dest="command", required=True)

    def client_command(name: str, fn: Command, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        connect.add_target(sub)
        config.add_option(sub, "timeout", "10", "seconds per call", type=float)
        # The server's variable too: one export raises both ends' limits.
        config.add_option(
            sub,
            "max-message-bytes",
            str(DEFAULT_MAX_MESSAGE_BYTES),
            "largest request or reply, in bytes",
            type=int,
        )
        sub.add_argument(
            "--json-output", action="store_true", help="print the answer as one line of JSON"
        )
        connect.add_options(sub)
        sub.set_defaults(fn=fn, parser=sub)
        return sub

    predict = client_command("predict", cmd_predict, "Run the model on inputs.")
    predict.epilog = (
        "examples: `sluice predict --sample 3` sends the bundled digit 3 to the bundled model "
        "(which answers label 3), from any directory; `sluice predict input=x.npy` and "
        "`sluice predict 'input=[[0, 1, ...]]'` send your own; add --json-output for the "
        "answer as JSON."
    )
    predict.add_argument(
        "inputs",
        nargs="*",
        metavar="NAME=VALUE",
        help="an input: NAME=FILE.npy (sent as stored), NAME=FILE.json or NAME=JSON (a number "
        "or nested lists of numbers, converted to the input's datatype from the model's "
        "metadata)",
    )
    predict.add_argument(
        "--json",
        action=Renamed,
        hint="; JSON inputs need no option: NAME=JSON, e.g. 'input=[[0.5, 1]]'",
    )
    predict.add_argument(
        "--sample",
        type=int,
        choices=range(10),
        metavar="DIGIT",
        help="send the bundled sample of this digit, 0 to 9 (FP32 [1, 64], shipped with Sluice)"
        " as the model's input `input` (or its only input)",
    )
    predict.add_argument("--output", action="append", help="return only this output (repeatable)")
    predict.add_argument(
        "--shared-memory",
        action="store_true",
        help="send the tensors through POSIX shared memory this command creates (and removes) "
        "instead of in the messages: for a server or balancer on this host started with "
        "--shared-memory",
    )
    health = client_command("health", cmd_health, "Show node, model and serving statistics.")
    metadata = client_command("metadata", cmd_metadata, "Show the model's inputs and outputs.")
    for sub in (health, metadata):
        sub.add_argument("--json", action=Renamed)
    for sub in (predict, health, metadata):
        sub.add_argument("--model", default="", help="the model by name (default: the default)")
    for sub in (predict, metadata):
        sub.add_argument("--version", default="", help="its version (default: the newest ready)")
    commands.add_parser(
        "up",
        help="Start a local cluster: servers behind a balancer; `sluice up --help`.",
        add_help=False,
    )
    commands.add_parser(
        "perf", help="Load sweep (ghz-style); `sluice perf --help` for its options.", add_help=False
    )
    commands.add_parser(
        "top", help="Live view of a server or balancer; `sluice top --help`.", add_help=False
    )
    key = commands.add_parser(
        "key",
        help="Make a new API key and its tenants-file line.",
        description="Print a new random API key (give it to the caller) and the table to add "
        "to the --tenants file (it holds only the key's SHA-256 digest).",
    )
    key.add_argument("tenant", help="the tenant's name")
    key.add_argument(
        "--priority", choices=["interactive", "batch"], default="interactive", help="its class"
    )
    return parser


def cmd_key(args: argparse.Namespace) -> str:
    secret = tenants.new_key()
    return (
        f"# the API key (send as 'authorization: Bearer KEY'; shown once, not stored):\n"
        f"{secret}\n"
        f"# for the tenants file:\n"
        f"[tenants.{args.tenant}]\n"
        f'keys = ["{tenants.digest(secret)}"]\n'
        f'priority = "{args.priority}"'
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`sluice`'s exit status. A reader that closed our stdout (`sluice health | head -5`)
    ends the command quietly, with 141 (128 + SIGPIPE): what a shell reports of any Unix
    tool killed by the signal, so `set -o pipefail` scripts see sluice as they see cat or
    grep (Python ignores SIGPIPE, so without this the write raised and was printed)."""
    try:
        status = run(argv)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        # The interpreter flushes stdout again at exit: let that find somewhere to go.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return status


def run(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["perf"]:  # the sweep parses its own options
        from sluice.perf.sweep import main as perf_main

        return perf_main(argv[1:])
    if argv[:1] == ["up"]:
        from sluice.client.cluster import main as up_main

        return up_main(argv[1:])
    if argv[:1] == ["top"]:  # the live view parses its own options
        from sluice.client.top import main as top_main

        return top_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "key":
        print(cmd_key(args))
        return 0
    fn: Any = args.fn
    try:
        connection = connect.from_args(args)
        with SluiceClient(
            args.target,
            timeout=args.timeout,
            max_message_bytes=args.max_message_bytes,
            shared_memory=getattr(args, "shared_memory", False),  # predict's alone
            **connection.client_kwargs(),
        ) as client:
            print(fn(client, args))
    except BadInput as exc:
        args.parser.error(str(exc))
    except Failed as exc:
        error = exc.error
        print(
            f"sluice {args.command}: {exc.doing}: {error.code().name}: {error.details()}",
            file=sys.stderr,
        )
        return 1
    except grpc.RpcError as exc:
        print(f"sluice {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # stdout closed: main's to end quietly
    except (OSError, ValueError) as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
