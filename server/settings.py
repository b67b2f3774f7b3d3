"""The server's settings: every one a flag and a `SLUICE_` environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from sluice.models import DIGITS
from sluice.runtime import config
from sluice.runtime.settings import ProgramSettings
from sluice.server.dataplane.modelsettings import (
    WIRE_SYNTAX,
    ModelSettings,
    WireType,
    check_lengths,
    parse_buckets,
    parse_pad,
    parse_wire_types,
)

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ServerSettings(ProgramSettings):
    PROG = "sluice-server"
    DESCRIPTION = "Serve an ONNX model over gRPC."

    model: list[str] = field(
        default_factory=list,
        metadata={
            "list": True,
            "help": "an ONNX model to serve, as PATH or NAME=PATH (version 1); repeat for "
            "more. Without it and without --model-repository: the bundled digits model",
        },
    )
    model_repository: str = field(
        default="",
        metadata={
            "help": "serve the models of this folder, in Triton's layout "
            "(DIR/NAME/VERSION/model.onnx, optional DIR/NAME/config.pbtxt), watched for new "
            "and removed versions"
        },
    )
    default_model: str = field(
        default="",
        metadata={
            "help": "the model that calls naming none get (default: the only one, or the "
            "first --model)"
        },
    )
    repository_poll_s: float = field(
        default=2.0, metadata={"help": "how often the model repository is looked at, in seconds"}
    )
    repository_api: bool = field(
        default=False,
        metadata={
            "help": "serve the KServe v2 repository extension (RepositoryIndex, "
            "RepositoryModelLoad, RepositoryModelUnload): callers may load and unload models"
        },
    )
    port: int = config.inherit(ProgramSettings, "port", 8001)
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    intra_op_threads: str = field(
        default="auto",
        metadata={
            "help": "ONNX Runtime threads inside one run: N, 0 (its default), or auto: 1, "
            "unless a batch of one takes 1 ms or more and more threads (up to the cores, 4) "
            "make it faster, measured when the model loads"
        },
    )
    ort_spinning: bool = field(
        default=False,
        metadata={
            "help": "let ONNX Runtime's intra-op threads spin while they wait for work (on or "
            "off): a multi-threaded run alone gets faster, but spinning threads take the "
            "cores the event loop and gRPC's threads need, so a served convnet used more CPU "
            "per call, for no shorter calls, with it on"
        },
    )
    ort_arena: bool = field(
        default=False,
        metadata={
            "help": "ONNX Runtime's CPU memory arena (on or off): a convnet's intermediate "
            "tensors are reused instead of mapped and faulted in anew on every run (a served "
            "SqueezeNet: ~0.8x the CPU per call), at the price of memory kept: the arena "
            "keeps its peak, given back only after a run whose inputs exceed 4 MiB (a 25 MB "
            "request left 20-40 MiB more behind with it on)"
        },
    )
    accept: list[str] = field(
        default_factory=list,
        metadata={
            "list": True,
            "help": "a compact wire type an FP32 (or FP16) input of a --model also takes, as "
            "[MODEL:]INPUT=UINT8|INT8|UINT16|FP16[*SCALE][+OFFSET] (cast once by the server "
            "as x * SCALE + OFFSET; MODEL: the NAME of a --model NAME=PATH, needed with more "
            "than one); repeat for more",
        },
    )
    pad: list[str] = field(
        default_factory=list,
        metadata={
            "list": True,
            "help": "an input of a --model that may be padded, so requests of different "
            "lengths share batches, as [MODEL:]INPUT=VALUE (VALUE: what the padding holds, "
            "e.g. 0 for token ids and attention masks): padded along its dynamic non-batch "
            "dimensions, named in the model (e.g. 'sequence'), to a length bucket, outputs "
            "along them cut back to each request's length; every input along those "
            "dimensions must be marked; repeat for more",
        },
    )
    buckets: str = field(
        default="",
        metadata={
            "help": "the lengths padded inputs round up to, comma-separated (e.g. "
            "16,32,64,128); default: powers of two, up to --max-length where given. A "
            "repository model's config sets its own (parameter sluice.buckets)",
        },
    )
    max_length: int = field(
        default=0,
        metadata={
            "help": "the longest length a padded input takes (0: the largest of --buckets, "
            "or 512 without them); longer requests are refused with INVALID_ARGUMENT. A "
            "repository model's config sets its own (parameter sluice.max_length)",
        },
    )
    workers: str = field(
        default="1",
        metadata={
            "help": "server processes sharing the port (SO_REUSEPORT), each with its own "
            "models, cache and event loop: N, or auto (one per core on the CPU; 1 on a GPU, "
            "where each process would hold its own CUDA context and copy of the model)"
        },
    )
    instances: int = field(
        default=1, metadata={"help": "model instances (sessions), each runs one batch at a time"}
    )
    max_batch: int = field(
        default=1, metadata={"help": "most rows per batch; 1 turns the micro-batcher off"}
    )
    batch_budget_ms: float = field(
        default=5.0,
        metadata={
            "help": "a batch takes only requests that arrived within this of its oldest "
            "(padded requests: every waiting one of its length bucket)"
        },
    )
    max_queue: int = field(
        default=1024, metadata={"help": "requests that may wait; beyond, RESOURCE_EXHAUSTED"}
    )
    cache_entries: int = field(default=10_000, metadata={"help": "result cache entries; 0: off"})
    cache_bytes: int = field(default=64 << 20, metadata={"help": "result cache size in bytes"})
    buffer_pool_bytes: int = field(
        default=256 << 20, metadata={"help": "staging buffers kept for reuse, in bytes"}
    )
    cuda_options: str = field(
        default="",
        metadata={
            "help": "options for ONNX Runtime's CUDA execution provider, KEY=VALUE,... "
            "(e.g. prefer_nhwc=1,cudnn_conv_algo_search=HEURISTIC)"
        },
    )
    pinned_staging: bool = field(
        default=True,
        metadata={
            "help": "on CUDA, stage batches in page-locked host memory (needs CuPy, in the "
            "gpu extra), which the GPU copies asynchronously; false: pageable memory"
        },
    )
    inline_max_us: float = field(
        default=100.0,
        metadata={"help": "on the CPU, runs expected to take less than this run on the event loop"},
    )
    drain_delay_s: float = field(
        default=0.0,
        metadata={"help": "on SIGTERM, how long to report NOT_SERVING before refusing calls"},
    )

    def provider_options(self) -> dict[str, str]:
        """--cuda-options as a mapping."""
        pairs = [p.strip() for p in self.cuda_options.split(",") if p.strip()]
        found = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--cuda-options takes KEY=VALUE,..., not {pair!r}")
            found[key.strip()] = value.strip()
        return found

    def __post_init__(self) -> None:
        super().__post_init__()
        self.provider_options()  # refuse a malformed --cuda-options at start
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        for name in ("instances", "max_batch", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("cache_entries", "cache_bytes", "buffer_pool_bytes", "batch_budget_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative")
        if self.intra_op_threads != "auto" and not self.intra_op_threads.isdigit():
            raise ValueError("--intra-op-threads must be a number (0 or more) or auto")
        if self.drain_delay_s < 0:
            raise ValueError("--drain-delay-s must not be negative")
        if self.workers != "auto" and not (self.workers.isdigit() and int(self.workers) >= 1):
            raise ValueError(
                f"--workers must be a number of processes or auto, not {self.workers!r}"
            )
        if self.repository_poll_s <= 0:
            raise ValueError("--repository-poll-s must be more than 0")
        if self.repository_api and not self.model_repository:
            raise ValueError("--repository-api needs --model-repository")
        names = [name for name, _ in self.models() if name]
        if len(names) != len(set(names)):
            raise ValueError("two --model entries have one name")
        if not self.model and not self.model_repository:
            object.__setattr__(self, "model", [str(DIGITS)])
        self.accepts()  # refuse a malformed --accept, or one naming no --model, at start
        self.pads()  # and a malformed --pad
        try:
            check_lengths(self.length_buckets(), self.max_length)
        except ValueError as exc:
            raise ValueError(f"--max-length {self.max_length}: {exc}") from None

    def processes(self) -> int:
        return int(self.workers) if self.workers.isdigit() else os.cpu_count() or 1

    def threads(self) -> int | None:
        """--intra-op-threads as the engine takes it: None to choose at load."""
        return None if self.intra_op_threads == "auto" else int(self.intra_op_threads)

    def length_buckets(self) -> tuple[int, ...]:
        """--buckets as a tuple, ascending."""
        if not self.buckets.strip():
            return ()
        try:
            return parse_buckets(self.buckets)
        except ValueError as exc:
            raise ValueError(f"--buckets {self.buckets!r}: {exc}") from None

    def model_settings(self, entry: str | None = None) -> ModelSettings:
        """What every model serves with where its config sets nothing; with `entry` (a --model
        NAME, "" unnamed), that one's --accept and --pad too."""
        if entry is not None:
            return replace(
                self.model_settings(),
                accepts=self.accepts().get(entry, {}),
                pads=self.pads().get(entry, {}),
            )
        return ModelSettings(
            device=self.device,
            intra_op_threads=self.threads(),
            instances=self.instances,
            max_batch=self.max_batch,
            batch_budget_s=self.batch_budget_ms / 1000,
            max_queue=self.max_queue,
            pool_bytes=self.buffer_pool_bytes,
            pinned=self.pinned_staging,
            cuda_options=self.provider_options(),
            inline_max_s=self.inline_max_us / 1e6,
            spinning=self.ort_spinning,
            arena=self.ort_arena,
            buckets=self.length_buckets(),
            max_length=self.max_length,
        )

    def worker_count(self, gpu: bool) -> int:
        """How many processes `--workers` asks for; `gpu`: the models would run on CUDA."""
        if self.workers != "auto":
            return int(self.workers)
        return 1 if gpu else os.cpu_count() or 1

    def accepts(self) -> dict[str, dict[str, tuple[WireType, ...]]]:
        """The --accept wire types, by --model entry NAME and input."""
        syntax = f"[MODEL:]INPUT={WIRE_SYNTAX}"
        if self.accept and not self.model:
            raise ValueError(
                "--accept is for --model models; a repository model names its wire types in "
                'its config.pbtxt: parameters { key: "sluice.accept.INPUT" value: '
                '{ string_value: "UINT8*0.00392157" } }'
            )
        found: dict[str, dict[str, tuple[WireType, ...]]] = {}
        for entry in self.accept:
            model, name, written = self._per_model("--accept", entry, syntax)
            if "," in written:  # SLUICE_ACCEPT's commas part entries: one type to an entry
                raise ValueError(f"--accept {entry!r}: one wire type each; repeat it for more")
            try:
                wires = parse_wire_types(written)
            except ValueError as exc:
                raise ValueError(f"--accept {entry!r}: {exc}; it takes {syntax}") from None
            inputs = found.setdefault(model, {})
            before = inputs.get(name, ())
            twice = {w.datatype for w in before} & {w.datatype for w in wires}
            if twice:
                raise ValueError(f"--accept gives input {name!r} {', '.join(sorted(twice))} twice")
            inputs[name] = before + wires
        return found

    def pads(self) -> dict[str, dict[str, str]]:
        """The --pad values, by --model entry NAME and input."""
        syntax = "[MODEL:]INPUT=VALUE"
        if self.pad and not self.model:
            raise ValueError(
                "--pad is for --model models; a repository model names its padded inputs in "
                'its config.pbtxt: parameters { key: "sluice.pad.INPUT" value: '
                '{ string_value: "0" } }'
            )
        found: dict[str, dict[str, str]] = {}
        for entry in self.pad:
            model, name, written = self._per_model("--pad", entry, syntax)
            try:
                value = parse_pad(written)
            except ValueError as exc:
                raise ValueError(f"--pad {entry!r}: {exc}; it takes {syntax}") from None
            inputs = found.setdefault(model, {})
            if name in inputs:
                raise ValueError(f"--pad gives input {name!r} a value twice")
            inputs[name] = value
        return found

    def _per_model(self, flag: str, entry: str, syntax: str) -> tuple[str, str, str]:
        """A per-input entry of `flag` as (--model entry NAME, input, what follows "=")."""
        entries = [name for name, _ in self.models()]
        target, equals, written = entry.partition("=")
        model, colon, name = target.partition(":")
        if not (colon and model.strip() and model.strip() in entries and name.strip()):
            # No MODEL: the whole is the input's name (TensorFlow's hold colons: "x:0").
            if len(entries) > 1:
                named = ", ".join(repr(n) for n in entries if n) or "none"
                raise ValueError(
                    f"{flag} {entry!r} names none of the {len(entries)} --model "
                    f"entries (named: {named}): say which, as MODEL:INPUT=..., with "
                    "MODEL the NAME of a --model NAME=PATH"
                )
            model, name = entries[0], target
        model, name = model.strip(), name.strip()
        if not equals or not name:
            raise ValueError(f"{flag} takes {syntax}, not {entry!r}")
        return model, name, written

    def models(self) -> list[tuple[str, str]]:
        """The --model entries as (name, path); an empty name: the model's own."""
        pairs = []
        for entry in self.model:
            name, equals, path = entry.partition("=")
            if not equals:
                name, path = "", entry
            if not path or (equals and not name):
                raise ValueError(f"--model takes PATH or NAME=PATH, not {entry!r}")
            pairs.append((name, path))
        return pairs
