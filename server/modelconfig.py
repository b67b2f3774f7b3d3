"""Triton's config.pbtxt, read into a model's `Config`: the subset Sluice honors.

Honored: max_batch_size (0: no batching), instance_group (the sum of the counts; all
KIND_CPU: on the CPU; all Triton's default KIND_AUTO: the server's --device),
dynamic_batching.max_queue_delay_microseconds (the batch budget, unless 0), version_policy,
default_model_filename, and parameters `sluice.accept.INPUT` (the compact wire types an
FP32 or FP16 input also takes, as "UINT8*0.00392157+0", comma-separated: cast by the server
as x * scale + offset), `sluice.pad.INPUT` (the value an input is padded with, as "0", so
requests of different lengths share batches), `sluice.buckets` (the lengths padding rounds
up to, as "16,32,64,128") and `sluice.max_length` (the longest length taken). Other known
fields (input and output dims: the ONNX file's own
signature rules; other parameters) are read and logged as ignored; unknown fields are
skipped, and named in the log.
"""

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

# A parameter naming the wire types an input also takes: this, then the input's name.
ACCEPT = "sluice.accept."
# A parameter giving the value an input is padded with: this, then the input's name.
PAD = "sluice.pad."
# The parameters of padded lengths: the buckets, and the longest taken.
BUCKETS = "sluice.buckets"
MAX_LENGTH = "sluice.max_length"

# The platform and backend names Triton gives ONNX Runtime models; others cannot serve here.
ONNX_PLATFORMS = ("", "onnxruntime_onnx")
ONNX_BACKENDS = ("", "onnxruntime")

# Triton writes repeated messages as `input [ {...} ]`; text_format can skip an unknown field
# written so only in its `name: [ ... ]` form, so the colon goes in first (strings and
# comments kept as they are).
_LIST_WITHOUT_COLON = re.compile(
    r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|\#[^\n]*)|\b([A-Za-z_]\w*)(\s*)\["""
)

# Strings, comments, brackets and field names: enough to find the top-level fields.
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
    """The top-level fields of config.pbtxt text that ModelConfig does not declare (parsing
    skips them silently)."""
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
        # Triton's count defaults to 1 per group.
        instances = sum(max(g.count, 1) for g in message.instance_group)
        # Triton's default kind, KIND_AUTO (a GPU if there is one, else the CPU), is what the
        # server's --device does; KIND_CPU throughout is honoured. GPUs named, KIND_GPU,
        # KIND_MODEL or a mix of kinds are not.
        kinds = {g.kind for g in message.instance_group}
        named = any(g.gpus for g in message.instance_group)
        if kinds == {pb.ModelInstanceGroup.KIND_CPU} and not named:
            device = "cpu"
        elif kinds != {pb.ModelInstanceGroup.KIND_AUTO} or named:
            ignored.append("instance_group kind/gpus (the device is the server's --device)")

    budget_s = None
    if message.HasField("dynamic_batching"):
        batching = message.dynamic_batching
        # Triton's delay is how long a batch may wait to fill; here the budget bounds how far
        # apart the requests that join a batch arrived, so Triton's 0 ("do not wait") keeps
        # the server's budget rather than batching nothing.
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
    """What the config's `PREFIX.INPUT` parameters give, parsed, by input name; LoadFailed
    naming the parameter for one that does not parse."""
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
    """The wire types the config's `sluice.accept.INPUT` parameters give, by input name."""
    return _by_input(message, source, ACCEPT, parse_wire_types)


def _pads(message: pb.ModelConfig, source: str) -> dict[str, str]:
    """The pad values the config's `sluice.pad.INPUT` parameters give, by input name (each
    a number; its datatype is checked when the model loads)."""
    return _by_input(message, source, PAD, parse_pad)


def _lengths(message: pb.ModelConfig, source: str) -> tuple[tuple[int, ...] | None, int | None]:
    """The config's length buckets and longest length (None: not set); LoadFailed naming
    the parameter for one that does not parse, or a longest beyond the largest bucket."""
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
    """The `Config` of a model's config.pbtxt at `path`: the server's defaults when there is
    no such file; raises LoadFailed (naming the file) for one that does not parse or that
    Sluice cannot serve."""
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
