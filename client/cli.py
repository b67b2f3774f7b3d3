"""`sluice`: predict, health and metadata against a server or a balancer; `up` (a local
cluster), `perf` (a load sweep) and `top` (a live view) parse their own options."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from sluice import models
from sluice.client import connect
from sluice.client.client import Prediction, SluiceClient
from sluice.core import tenants
from sluice.core.datatypes import DATATYPES, name_of
from sluice.runtime import config


def parse_input(text: str, datatypes: dict[str, str]) -> tuple[str, np.ndarray]:
    """`NAME=FILE.npy`, `NAME=FILE.json` or `NAME=JSON`; JSON takes the model's datatype."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"input {text!r} is not NAME=FILE.npy, NAME=FILE.json or NAME=JSON")
    if value.endswith(".npy"):
        return name, np.load(value, allow_pickle=False)
    data = json.loads(Path(value).read_text()) if value.endswith(".json") else json.loads(value)
    datatype = datatypes.get(name)
    dtype = DATATYPES[datatype].dtype if datatype in DATATYPES else None
    return name, np.asarray(data, dtype=dtype)


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
        raise ValueError(f"no bundled sample of digit {digit}")
    if SAMPLE_INPUT in datatypes or not datatypes:
        return SAMPLE_INPUT, sample.input
    if len(datatypes) == 1:
        return next(iter(datatypes)), sample.input
    raise ValueError(
        f"--sample fills one input, and the model has several ({', '.join(datatypes)}): "
        "give them as NAME=VALUE"
    )


def cmd_predict(client: SluiceClient, args: argparse.Namespace) -> str:
    if not args.inputs and args.sample is None:
        raise ValueError("predict needs inputs (NAME=FILE.npy, NAME=JSON, ...) or --sample DIGIT")
    datatypes = {}
    if args.sample is not None or any(
        not v.partition("=")[2].endswith(".npy") for v in args.inputs
    ):
        meta = client.metadata(model=args.model, version=args.version)
        datatypes = {t.name: t.datatype for t in meta.model.inputs}
    inputs = dict(parse_input(text, datatypes) for text in args.inputs)
    if args.sample is not None:
        name, array = sample_input(args.sample, datatypes)
        if name in inputs:
            raise ValueError(f"input {name!r} given twice: by --sample and as {name}=...")
        inputs[name] = array
    answer = client.infer(inputs, outputs=args.output or (), model=args.model, version=args.version)
    return render(answer, args.json)


def cmd_health(client: SluiceClient, args: argparse.Namespace) -> str:
    health = MessageToDict(client.health(model=args.model), preserving_proto_field_name=True)
    return json.dumps(health, indent=None if args.json else 2)


def cmd_metadata(client: SluiceClient, args: argparse.Namespace) -> str:
    meta = client.metadata(model=args.model, version=args.version)
    if args.json:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice command-line client.")
    commands = parser.add_subparsers(dest="command", required=True)

    def client_command(name: str, fn: Command, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        connect.add_target(sub)
        config.add_option(sub, "timeout", "10", "seconds per call", type=float)
        sub.add_argument("--json", action="store_true", help="print JSON for scripts")
        connect.add_options(sub)
        sub.set_defaults(fn=fn)
        return sub

    predict = client_command("predict", cmd_predict, "Run the model on inputs.")
    predict.epilog = (
        "examples: `sluice predict --sample 3` sends the bundled digit 3 to the bundled model "
        "(which answers label 3), from any directory; `sluice predict input=x.npy` and "
        "`sluice predict 'input=[[0, 1, ...]]'` send your own."
    )
    predict.add_argument(
        "inputs",
        nargs="*",
        metavar="NAME=VALUE",
        help="NAME=FILE.npy, NAME=FILE.json or NAME=JSON (JSON takes the model's datatype)",
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
    health = client_command("health", cmd_health, "Show node, model and serving statistics.")
    metadata = client_command("metadata", cmd_metadata, "Show the model's inputs and outputs.")
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
            args.target, timeout=args.timeout, **connection.client_kwargs()
        ) as client:
            print(fn(client, args))
    except grpc.RpcError as exc:
        print(f"sluice: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
