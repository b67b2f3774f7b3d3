"""A model's settings: the server's flags (`ModelSettings`, in seconds and bytes) overlaid by
what its config file sets (`Config`, None where it says nothing), clamped once here."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# What an FP32 or FP16 input may also take on the wire, cast by the server.
WIRE_TYPES = ("UINT8", "INT8", "UINT16", "FP16")
WIRE_SYNTAX = "UINT8|INT8|UINT16|FP16[*SCALE][+OFFSET]"
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_WIRE = re.compile(
    rf"(?P<type>[A-Za-z0-9]+)(?:\*(?P<scale>[+-]?{_NUMBER}))?(?:(?P<sign>[+-])(?P<offset>{_NUMBER}))?"
)


@dataclass(frozen=True)
class WireType:
    """A datatype an input also takes on the wire, cast into its own as x * scale + offset."""

    datatype: str
    scale: float = 1.0
    offset: float = 0.0

    def describe(self) -> str:
        """As the flag and config write it: UINT8*0.00392157+0.5."""
        scale = f"*{_number(self.scale)}" if self.scale != 1 else ""
        sign = "-" if self.offset < 0 else "+"
        offset = f"{sign}{_number(abs(self.offset))}" if self.offset else ""
        return f"{self.datatype}{scale}{offset}"


def _number(value: float) -> str:
    """The shortest text that reads back as `value` (2, not 2.0)."""
    return repr(value).removesuffix(".0")


Accepts = Mapping[str, tuple[WireType, ...]]

# Padded inputs' pad values as written (checked at load against the datatype).
Pads = Mapping[str, str]
PAD_SYNTAX = "a number (whole for an integer input), inf, nan, true or false"


def parse_pad(text: str) -> str:
    """A pad value as written, stripped; ValueError for one that is no number."""
    word = text.strip()
    if word.lower() not in ("true", "false"):
        try:
            float(word)
        except ValueError:
            raise ValueError(f"pad value {text.strip()!r} is not {PAD_SYNTAX}") from None
    return word


def parse_buckets(text: str) -> tuple[int, ...]:
    """Comma-separated positive length buckets, sorted; ValueError saying which is wrong."""
    found: list[int] = []
    for part in text.split(","):
        word = part.strip()
        if not (word.isascii() and word.isdigit() and int(word) > 0):
            raise ValueError(f"length bucket {word!r} is not a positive whole number")
        if int(word) in found:
            raise ValueError(f"length bucket {int(word)} is given twice")
        found.append(int(word))
    return tuple(sorted(found))


def check_lengths(buckets: tuple[int, ...], max_length: int) -> None:
    """ValueError for a longest length beyond the largest bucket."""
    if max_length < 0:
        raise ValueError(f"the longest length {max_length} is negative")
    if buckets and max_length > buckets[-1]:
        raise ValueError(
            f"the longest length {max_length} is above the largest length bucket "
            f"{buckets[-1]}: add a bucket of at least {max_length}"
        )


def parse_wire_types(text: str) -> tuple[WireType, ...]:
    """Wire types as TYPE[*SCALE][+OFFSET], comma-separated; ValueError saying which is wrong."""
    found: list[WireType] = []
    for part in text.split(","):
        written = "".join(part.split())
        matched = _WIRE.fullmatch(written)
        if matched is None:
            raise ValueError(f"{part.strip()!r} is not {WIRE_SYNTAX}")
        datatype = matched["type"].upper()
        if datatype not in WIRE_TYPES:
            raise ValueError(
                f"{matched['type']!r} is not a wire type the server casts: " + ", ".join(WIRE_TYPES)
            )
        scale = float(matched["scale"] or 1)
        offset = float(matched["sign"] + matched["offset"]) if matched["offset"] else 0.0
        if not (math.isfinite(scale) and math.isfinite(offset)):
            raise ValueError(f"{written!r}: the scale and offset must be finite")
        if scale == 0:
            raise ValueError(f"{written!r}: a scale of 0 would make every value the offset")
        if any(w.datatype == datatype for w in found):
            raise ValueError(f"{text.strip()!r} names {datatype} twice")
        found.append(WireType(datatype, scale, offset))
    return tuple(found)


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions serve: the newest `latest`, all, or the `versions` listed."""

    kind: Literal["latest", "all", "specific"] = "latest"
    latest: int = 1
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "latest", max(self.latest, 1))

    def choose(self, available: Iterable[int]) -> set[int]:
        found = set(available)
        if self.kind == "all":
            return found
        if self.kind == "specific":
            return found & set(self.versions)
        return set(sorted(found, reverse=True)[: self.latest])

    def describe(self) -> str:
        if self.kind == "all":
            return "all versions"
        if self.kind == "specific":
            return "versions " + ", ".join(map(str, self.versions))
        return f"the latest {self.latest}"


@dataclass(frozen=True)
class Config:
    """What a model's config file says; None: the server's setting."""

    max_batch: int | None = None  # rows per batch; 1: no batching
    instances: int | None = None
    batch_budget_s: float | None = None
    device: str | None = None
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    default_model_filename: str = "model.onnx"
    accepts: Accepts | None = None  # sluice.accept.INPUT
    pads: Pads | None = None  # sluice.pad.INPUT
    buckets: tuple[int, ...] | None = None  # sluice.buckets
    max_length: int | None = None  # sluice.max_length


_OVERRIDES = (
    "max_batch",
    "instances",
    "batch_budget_s",
    "device",
    "accepts",
    "pads",
    "buckets",
    "max_length",
)


@dataclass(frozen=True)
class ModelSettings:
    """What a model serves with; a count below 1 (Triton's max_batch_size 0) reads as 1."""

    device: str = "auto"
    intra_op_threads: int | None = None  # None: chosen at load from the model's run time
    instances: int = 1
    max_batch: int = 1  # rows per batch; 1: no batching
    batch_budget_s: float = 0.005
    max_queue: int = 1024
    pool_bytes: int = 256 << 20
    pinned: bool = True
    cuda_options: Mapping[str, str] = field(default_factory=dict)
    inline_max_s: float = 100e-6
    spinning: bool = False  # ONNX Runtime's threads spin while they wait for work
    arena: bool = False  # ONNX Runtime's CPU arena (on CUDA it is always on)
    accepts: Accepts = field(default_factory=dict)
    pads: Pads = field(default_factory=dict)
    buckets: tuple[int, ...] = ()  # none: powers of two up to max_length
    max_length: int = 0  # 0: the largest bucket

    def __post_init__(self) -> None:
        object.__setattr__(self, "instances", max(self.instances, 1))
        object.__setattr__(self, "max_batch", max(self.max_batch, 1))

    def overlay(self, config: Config) -> ModelSettings:
        """These settings with what `config` sets in their place."""
        changes: dict[str, Any] = {
            name: getattr(config, name) for name in _OVERRIDES if getattr(config, name) is not None
        }
        if config.buckets is not None and config.max_length is None:
            changes["max_length"] = 0  # a config's buckets bring their own longest
        return replace(self, **changes)
