"""Command-line flags with `SLUICE_` environment fallbacks, for any settings dataclass.

Each field becomes `--field-name`, else `SLUICE_FIELD_NAME`; its metadata holds `help` and,
for lists, `list=True` (a repeated flag; comma-separated in the environment)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


WANTED = {"int": "an integer", "float": "a number", "bool": "true or false"}


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
    """`base`'s field `name` (its flag, variable and help) with another default."""
    return dataclasses.field(default=default, metadata=base.__dataclass_fields__[name].metadata)


def add_option(
    parser: argparse.ArgumentParser,
    name: str,
    default: str,
    help: str,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> None:
    """`--NAME`, else `SLUICE_NAME`, else `default` (as typed on the command line)."""
    env = "SLUICE_" + name.upper().replace("-", "_")
    raw = (os.environ if environ is None else environ).get(env)
    given = _FromEnv(raw) if raw else default
    if raw and "type" in kwargs:
        kwargs["type"] = _env_aware(kwargs["type"], env, "--" + name)
    parser.add_argument("--" + name, default=given, help=f"{help} [env {env}; {default}]", **kwargs)


class _FromEnv(str):
    """A flag's default read from its variable, so a bad value is blamed on the variable."""


def _env_aware(convert: Any, env: str, flag: str) -> Any:
    """`convert`, whose error for the variable's value names the variable and the flag."""

    def converted(text: str) -> Any:
        if not isinstance(text, _FromEnv):
            return convert(text)
        try:
            return convert(text)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            wanted = _wanted(getattr(convert, "__name__", ""), exc)
            raise argparse.ArgumentTypeError(_env_error(env, text, flag, wanted)) from None

    converted.__name__ = getattr(convert, "__name__", "value")  # argparse's "invalid int value"
    return converted


def _env_error(env: str, raw: str, flag: str, wanted: str) -> str:
    return f"{env}={str(raw)!r} (read as {flag} was not given): {wanted}"


def _wanted(kind: str, exc: Exception) -> str:
    return f"expected {WANTED[kind]}" if kind in WANTED else str(exc)


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
        kind = field_type(field)
        convert = _converter(kind)
        try:
            if field.metadata.get("list"):
                values[field.name] = [convert(p.strip()) for p in raw.split(",") if p.strip()]
            else:
                values[field.name] = convert(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            env, flag = "SLUICE_" + field.name.upper(), "--" + field.name.replace("_", "-")
            wanted = _wanted(kind, exc)
            raise SystemExit(_env_error(env, raw, flag, wanted)) from None
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
