"""Triton's config.pbtxt, read into a model's `Config`: the subset Sluice honors.

Honored: max_batch_size, instance_group (counts; all KIND_CPU: the CPU), the dynamic
batching delay (the batch budget, unless 0), version_policy, default_model_filename, and
the parameters `sluice.accept.INPUT`, `sluice.pad.INPUT`, `sluice.buckets` and
`sluice.max_length`. Other fields are logged as ignored (the ONNX file's signature rules)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from google.protobuf import text_format

from sluice.core.errors import LoadFailed
from sluice.server.dataplane.modelsettings import (
    Config,
    VersionPolicy,
    WireType,
    check_lengths,
    parse_buckets,
    parse_pad,
    parse_wire_types,
)
from sluice.v1 import model_config_pb2 as pb

log = logging.getLogger("sluice.modelconfig")

ACCEPT = "sluice.accept."  # then the input's name
PAD = "sluice.pad."
BUCKETS = "sluice.buckets"
MAX_LENGTH = "sluice.max_length"

ONNX_PLATFORMS = ("", "onnxruntime_onnx")
ONNX_BACKENDS = ("", "onnxruntime")

# Triton writes `input [ {...} ]`; text_format skips an unknown field only in its
# `name: [ ... ]` form, so the colon goes in first.
_LIST_WITHOUT_COLON = re.compile(
    r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|\#[^\n]*)|\b([A-Za-z_]\w*)(\s*)\["""
)

# Enough to find the top-level fields.
_TOKENS = re.compile(
    r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|\#[^\n]*)"""  # kept whole
    r"|([{<\[])|([}>\]])"  # nesting
    r"|([A-Za-z_]\w*)\s*[:{<\[]"  # a field's name
)


def _colon(match: re.Match[str]) -> str:
    if match.group(1) is not None:
        return match.group(1)
    return f"{match.group(2)}:{match.group(3)}["


def unknown_fields(text: str) -> list[str]:
    """The top-level fields ModelConfig does not declare (parsing skips them silently)."""
    depth = 0
    names: list[str] = []
    for match in _TOKENS.finditer(text):
        opening, closing, name = match.group(2), match.group(3), match.group(4)
        if opening:
            depth += 1
        elif closing:
            depth -= 1
        elif name and depth == 0 and name not in pb.ModelConfig.DESCRIPTOR.fields_by_name:
            names.append(name)
        if name and match.group(0)[-1] in "{<[":
            depth += 1  # the field's own bracket, matched with its name
    return list(dict.fromkeys(names))


def parse(text: str, source: str = "config.pbtxt") -> pb.ModelConfig:
    """Parse config.pbtxt text; raises LoadFailed saying where and why."""
    message = pb.ModelConfig()
    try:
        text_format.Parse(_LIST_WITHOUT_COLON.sub(_colon, text), message, allow_unknown_field=True)
    except text_format.ParseError as exc:
        raise LoadFailed(f"{source}: does not parse: {exc}") from None
    return message


def convert(message: pb.ModelConfig, source: str = "config.pbtxt", name: str = "") -> Config:
    """The `Config` a parsed ModelConfig says; raises LoadFailed for one Sluice cannot serve."""
    if name and message.name and message.name != name:
        raise LoadFailed(f"{source}: names model {message.name!r}, but its directory is {name!r}")
    if message.platform not in ONNX_PLATFORMS or message.backend not in ONNX_BACKENDS:
        raise LoadFailed(
            f"{source}: platform {message.platform!r}, backend {message.backend!r}: "
            "Sluice serves ONNX models only (onnxruntime_onnx)"
        )
    if message.max_batch_size < 0:
        raise LoadFailed(f"{source}: max_batch_size {message.max_batch_size} is negative")
    ignored = []
    if message.input or message.output:
        ignored.append("input/output (the ONNX file's own inputs and outputs rule)")
    accepts = _accepts(message, source)
    pads = _pads(message, source)
    buckets, max_length = _lengths(message, source)
    others = sorted(
        k
        for k in message.parameters
        if not k.startswith((ACCEPT, PAD)) and k not in (BUCKETS, MAX_LENGTH)
    )
    if others:
        ignored.append(f"parameters {', '.join(others)}")

    instances = None
    device = None
    if message.instance_group:
        instances = sum(max(g.count, 1) for g in message.instance_group)
        # KIND_AUTO is what --device does; GPUs named, KIND_GPU, KIND_MODEL or a mix are not.
        kinds = {g.kind for g in message.instance_group}
        named = any(g.gpus for g in message.instance_group)
        if kinds == {pb.ModelInstanceGroup.KIND_CPU} and not named:
            device = "cpu"
        elif kinds != {pb.ModelInstanceGroup.KIND_AUTO} or named:
            ignored.append("instance_group kind/gpus (the device is the server's --device)")

    budget_s = None
    if message.HasField("dynamic_batching"):
        batching = message.dynamic_batching
        # Here the budget bounds how far apart a batch's requests arrived, so Triton's 0
        # ("do not wait") keeps the server's budget rather than batching nothing.
        if batching.max_queue_delay_microseconds:
            budget_s = batching.max_queue_delay_microseconds / 1e6
        if batching.preferred_batch_size or batching.preserve_ordering:
            ignored.append("dynamic_batching.preferred_batch_size/preserve_ordering")

    policy = VersionPolicy()
    which = message.version_policy.WhichOneof("policy_choice")
    if which == "all":
        policy = VersionPolicy("all")
    elif which == "specific":
        versions = tuple(message.version_policy.specific.versions)
        if not versions or min(versions) <= 0:
            raise LoadFailed(f"{source}: version_policy.specific needs positive versions")
        policy = VersionPolicy("specific", versions=versions)
    elif which == "latest":
        policy = VersionPolicy("latest", latest=message.version_policy.latest.num_versions)

    filename = message.default_model_filename or Config.default_model_filename
    if "/" in filename or filename in (".", ".."):
        raise LoadFailed(f"{source}: default_model_filename {filename!r} is not a file name")
    if ignored:
        log.info("%s: Sluice ignores %s", source, "; ".join(ignored))
    return Config(
        max_batch=message.max_batch_size or 1,  # Triton's 0: no batching
        instances=instances,
        batch_budget_s=budget_s,
        device=device,
        policy=policy,
        default_model_filename=filename,
        accepts=accepts or None,
        pads=pads or None,
        buckets=buckets,
        max_length=max_length,
    )


T = TypeVar("T")


def _by_input(
    message: pb.ModelConfig, source: str, prefix: str, parse: Callable[[str], T]
) -> dict[str, T]:
    """The config's `PREFIX.INPUT` parameters parsed, by input; LoadFailed naming a bad one."""
    found = {}
    for key in sorted(message.parameters):
        if not key.startswith(prefix):
            continue
        name = key.removeprefix(prefix)
        if not name:
            raise LoadFailed(f"{source}: parameter {key!r} names no input ({prefix}INPUT)")
        try:
            found[name] = parse(message.parameters[key].string_value)
        except ValueError as exc:
            raise LoadFailed(f"{source}: parameter {key!r} (input {name!r}): {exc}") from None
    return found


def _accepts(message: pb.ModelConfig, source: str) -> dict[str, tuple[WireType, ...]]:
    return _by_input(message, source, ACCEPT, parse_wire_types)


def _pads(message: pb.ModelConfig, source: str) -> dict[str, str]:
    return _by_input(message, source, PAD, parse_pad)


def _lengths(message: pb.ModelConfig, source: str) -> tuple[tuple[int, ...] | None, int | None]:
    """The config's length buckets and longest length (None: not set); LoadFailed if bad."""
    buckets = max_length = None
    if BUCKETS in message.parameters:
        try:
            buckets = parse_buckets(message.parameters[BUCKETS].string_value)
        except ValueError as exc:
            raise LoadFailed(f"{source}: parameter {BUCKETS!r}: {exc}") from None
    if MAX_LENGTH in message.parameters:
        written = message.parameters[MAX_LENGTH].string_value.strip()
        if not (written.isascii() and written.isdigit() and int(written) > 0):
            raise LoadFailed(
                f"{source}: parameter {MAX_LENGTH!r}: {written!r} is not a positive whole number"
            )
        max_length = int(written)
    try:
        check_lengths(buckets or (), max_length or 0)
    except ValueError as exc:
        raise LoadFailed(f"{source}: parameter {MAX_LENGTH!r}: {exc}") from None
    return buckets, max_length


def read_config(path: Path) -> Config:
    """The `Config` of the config.pbtxt at `path` (none: the defaults); LoadFailed naming
    the file for one that does not parse or cannot serve."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Config()
    except (OSError, UnicodeDecodeError) as exc:
        raise LoadFailed(f"{path}: cannot be read: {exc}") from None
    config = convert(parse(text, str(path)), str(path), path.parent.name)
    unknown = unknown_fields(text)
    if unknown:
        log.info("%s: skipping fields Sluice does not know: %s", path, ", ".join(unknown))
    return config
