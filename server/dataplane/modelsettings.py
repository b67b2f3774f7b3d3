"""A model's serving settings: the server's own (from its flags) overlaid by what the model's
config file sets, and clamped once, here, so every consumer (engine, batcher, admission)
reads a value it can use as it is. Transport-free; seconds, bytes and counts.

`Config` is what a model's config file said, None where it said nothing; `ModelSettings` is
what a model serves with: `defaults.overlay(config)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal


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


# The fields of `Config` that override the server's settings of the same name.
_OVERRIDES = ("max_batch", "instances", "batch_budget_s", "device")


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "instances", max(self.instances, 1))
        object.__setattr__(self, "max_batch", max(self.max_batch, 1))

    def overlay(self, config: Config) -> ModelSettings:
        """These settings with what `config` sets in their place (clamped like any)."""
        changes: dict[str, Any] = {
            name: getattr(config, name) for name in _OVERRIDES if getattr(config, name) is not None
        }
        return replace(self, **changes)
