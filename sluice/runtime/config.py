"""Command-line flags with `SLUICE_` environment fallbacks, for any settings dataclass.

Each dataclass field becomes `--field-name`, read from `SLUICE_FIELD_NAME` when the
flag is absent. A field's metadata holds its help text (`help`) and, for lists,
`list=True` (repeatable flag; comma-separated in the environment). A command with a few
options and no settings class (the client's) adds each by the same rule (`add_option`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _converter(kind: Any) -> Any:
    if kind in (bool, "bool"):
        return _parse_bool
    if kind in (int, "int"):
        return int
    if kind in (float, "float"):
        return float
    return str


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def field_type(field: dataclasses.Field[Any]) -> str:
    """The scalar type name of a field: 'bool', 'int', 'float' or 'str'."""
    text = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "str")
    for name in ("bool", "int", "float"):
        if text.startswith(name) or text.startswith(f"list[{name}"):
            return name
    return "str"


def inherit(base: type[Any], name: str, default: Any) -> Any:
    """`base`'s field `name` with another default, for a subclass that declares it again: its
    flag, variable and help stay the ones `base` declares."""
    return dataclasses.field(default=default, metadata=base.__dataclass_fields__[name].metadata)


def add_option(
    parser: argparse.ArgumentParser,
    name: str,
    default: str,
    help: str,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> None:
    """`--NAME`, read from `SLUICE_NAME` when the flag is absent, else `default` (as typed on
    the command line: argparse converts either with `type`); its help names both."""
    env = "SLUICE_" + name.upper().replace("-", "_")
    given = (os.environ if environ is None else environ).get(env) or default
    parser.add_argument("--" + name, default=given, help=f"{help} [env {env}; {default}]", **kwargs)


def build_parser(cls: type[Any], prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls)
    return parser


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        env = "SLUICE_" + field.name.upper()
        help_text = f"{field.metadata.get('help', '')} [env {env}]"
        convert = _converter(field_type(field))
        if field.metadata.get("list"):
            parser.add_argument(flag, action="append", type=convert, default=None, help=help_text)
        elif convert is _parse_bool:  # `--flag` alone turns it on; `--flag false` too
            parser.add_argument(
                flag, nargs="?", const=True, type=convert, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, type=convert, default=None, help=help_text)


def from_namespace(
    cls: type[T], args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> T:
    """Settings from parsed flags, then the environment, then the dataclass defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
            continue
        raw = environ.get("SLUICE_" + field.name.upper())
        if raw is None or raw == "":
            continue
        convert = _converter(field_type(field))
        try:
            if field.metadata.get("list"):
                values[field.name] = [convert(p.strip()) for p in raw.split(",") if p.strip()]
            else:
                values[field.name] = convert(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise SystemExit(f"SLUICE_{field.name.upper()}={raw!r}: {exc}") from None
    return cls(**values)


def parse(
    cls: type[T],
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    environ: Mapping[str, str] | None = None,
) -> T:
    parser = build_parser(cls, prog, description)
    return from_namespace(cls, parser.parse_args(argv), environ)
