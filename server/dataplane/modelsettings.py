"""A model's serving settings: the server's own (from its flags) overlaid by what the model's
config file sets, and clamped once, here, so every consumer (engine, batcher, admission)
reads a value it can use as it is. Transport-free; seconds, bytes and counts.

`Config` is what a model's config file said, None where it said nothing; `ModelSettings` is
what a model serves with: `defaults.overlay(config)`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# The compact datatypes an FP32 or FP16 input may also take on the wire, cast by the server.
WIRE_TYPES = ("UINT8", "INT8", "UINT16", "FP16")
WIRE_SYNTAX = "UINT8|INT8|UINT16|FP16[*SCALE][+OFFSET]"
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_WIRE = re.compile(
    rf"(?P<type>[A-Za-z0-9]+)(?:\*(?P<scale>[+-]?{_NUMBER}))?(?:(?P<sign>[+-])(?P<offset>{_NUMBER}))?"
)


@dataclass(frozen=True)
class WireType:
    """A datatype an input also takes on the wire, cast once by the server into the input's
    own as x * scale + offset (a uint8 image, normalised as image pipelines do)."""

    datatype: str
    scale: float = 1.0
    offset: float = 0.0

    def describe(self) -> str:
        """As the flag and config write it: UINT8*0.00392157+0.5, UINT8 (scale 1, offset 0)."""
        scale = f"*{_number(self.scale)}" if self.scale != 1 else ""
        sign = "-" if self.offset < 0 else "+"
        offset = f"{sign}{_number(abs(self.offset))}" if self.offset else ""
        return f"{self.datatype}{scale}{offset}"


def _number(value: float) -> str:
    """The shortest text that reads back as `value` (2, not 2.0)."""
    return repr(value).removesuffix(".0")


# The wire types of a model's inputs, by input name.
Accepts = Mapping[str, tuple[WireType, ...]]

# The inputs a model may pad along their dynamic non-batch dimensions, by name, with the
# value the padding holds, as written (its datatype, known at load, checks it: padding.py).
Pads = Mapping[str, str]
PAD_SYNTAX = "a number (whole for an integer input), inf, nan, true or false"


def parse_pad(text: str) -> str:
    """A pad value as written, stripped; raises ValueError for one that is no number."""
    word = text.strip()
    if word.lower() not in ("true", "false"):
        try:
            float(word)
        except ValueError:
            raise ValueError(f"pad value {text.strip()!r} is not {PAD_SYNTAX}") from None
    return word


def parse_buckets(text: str) -> tuple[int, ...]:
    """Length buckets written as comma-separated positive whole numbers, ascending once
    sorted; raises ValueError saying which is wrong."""
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
    """Raise ValueError unless the buckets and the longest length fit together: a longest
    length beyond the largest bucket would have no bucket to pad to."""
    if max_length < 0:
        raise ValueError(f"the longest length {max_length} is negative")
    if buckets and max_length > buckets[-1]:
        raise ValueError(
            f"the longest length {max_length} is above the largest length bucket "
            f"{buckets[-1]}: add a bucket of at least {max_length}"
        )


def parse_wire_types(text: str) -> tuple[WireType, ...]:
    """Wire types written as TYPE[*SCALE][+OFFSET], comma-separated; raises ValueError saying
    which part is wrong."""
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
    """Which of the versions found serve: the newest `latest` (at least 1), all, or the
    `versions` listed."""

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
    """What a model's config file says, as far as Sluice honors it; None: the server's
    setting (`ModelSettings`)."""

    max_batch: int | None = None  # rows per batch; 1: no batching
    instances: int | None = None
    batch_budget_s: float | None = None
    device: str | None = None
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    default_model_filename: str = "model.onnx"
    accepts: Accepts | None = None  # its inputs' wire types (parameters sluice.accept.INPUT)
    pads: Pads | None = None  # its padded inputs' values (parameters sluice.pad.INPUT)
    buckets: tuple[int, ...] | None = None  # length buckets (parameter sluice.buckets)
    max_length: int | None = None  # the longest length taken (parameter sluice.max_length)


# The fields of `Config` that override the server's settings of the same name.
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
    """What a model serves with. A count below 1 (Triton's max_batch_size 0: no batching)
    is read as 1."""

    device: str = "auto"
    intra_op_threads: int | None = None  # None: chosen at load from the model's run time
    instances: int = 1  # sessions, each running one batch at a time
    max_batch: int = 1  # rows per batch; 1: no batching
    batch_budget_s: float = 0.005
    max_queue: int = 1024
    pool_bytes: int = 256 << 20
    pinned: bool = True
    cuda_options: Mapping[str, str] = field(default_factory=dict)
    inline_max_s: float = 100e-6
    spinning: bool = False  # ONNX Runtime's threads spin while they wait for work
    arena: bool = False  # ONNX Runtime's CPU arena (on CUDA it is always on)
    accepts: Accepts = field(default_factory=dict)  # wire types its inputs also take
    pads: Pads = field(default_factory=dict)  # inputs padded to share batches, with values
    # Padded lengths round up to these (ascending); none: powers of two up to max_length.
    buckets: tuple[int, ...] = ()
    max_length: int = 0  # the longest length a padded input takes; 0: the largest bucket

    def __post_init__(self) -> None:
        object.__setattr__(self, "instances", max(self.instances, 1))
        object.__setattr__(self, "max_batch", max(self.max_batch, 1))

    def overlay(self, config: Config) -> ModelSettings:
        """These settings with what `config` sets in their place (clamped like any)."""
        changes: dict[str, Any] = {
            name: getattr(config, name) for name in _OVERRIDES if getattr(config, name) is not None
        }
        if config.buckets is not None and config.max_length is None:
            changes["max_length"] = 0  # a config's buckets bring their own longest: the largest
        return replace(self, **changes)
