"""The loaded models: each one's name and version, its engine and batcher, and the checks of a
request against its inputs and outputs; `Models`, the set a node serves, by name and
version, which the repository changes while calls go on. Transport-free.

The dataplane asks `Models` for a model by name and version and keys its cache by both, so
a new version never meets an old one's answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from sluice.core.datatypes import DATATYPES, name_of
from sluice.core.errors import InvalidInput, LoadFailed, ModelNotFound
from sluice.core.version_order import version_key
from sluice.server.dataplane import padding, staging
from sluice.server.dataplane.batcher import Arrays, Batcher, Trip
from sluice.server.dataplane.engine import Engine, TensorSpec
from sluice.server.dataplane.modelsettings import Accepts, Pads, WireType

# What a node remembers of removals, to say why a call's model or version is not loaded: the
# latest versions removed of each model, of the latest models.
GONE_VERSIONS = 8
GONE_MODELS = 32


def holds_nonfinite(array: np.ndarray) -> bool:
    """Whether a float array holds NaN or infinity. A NaN carries through min and max, and an
    infinity is one of them: two passes that allocate nothing, where np.isfinite makes a flag
    per element (150 KB for a 602 KB image, on every call)."""
    if array.dtype.kind != "f" or array.size == 0:
        return False
    if array.dtype == np.float16:
        # numpy reduces FP16 an element at a time (1.2 ms for a 150,528-value image, where
        # FP32 takes 17 us): its bits tell in two integer passes. NaN and infinity are the
        # FP16s whose exponent bits are all set: read as int16, the positive ones from
        # 0x7c00 up; as uint16, the negative ones from 0xfc00 up.
        return bool(array.view(np.int16).max() >= 0x7C00 or array.view(np.uint16).max() >= 0xFC00)
    return not (np.isfinite(array.min()) and np.isfinite(array.max()))


# The model datatypes an input may take another wire type into.
CAST_INTO = ("FP32", "FP16")


def wire_inputs(specs: Sequence[TensorSpec], accepts: Accepts) -> list[TensorSpec]:
    """`specs` with the wire types `accepts` gives each input; raises LoadFailed naming an
    input the model lacks, one that is not FP32 or FP16, or a wire type whose values would
    not all be finite once cast (so the cast never makes NaN or infinity of its own)."""
    by_name = {s.name: s for s in specs}
    for name in accepts:
        if name not in by_name:
            raise LoadFailed(
                f"wire types are given for input {name!r}, which the model does not have; "
                "its inputs are " + ", ".join(f"{s.name!r} {s.describe()}" for s in specs)
            )
    found = []
    for spec in specs:
        wires = tuple(accepts.get(spec.name, ()))
        if wires and spec.datatype not in CAST_INTO:
            raise LoadFailed(
                f"input {spec.name!r} is {spec.datatype}: only an FP32 or FP16 input takes "
                f"another wire type ({', '.join(w.describe() for w in wires)} given)"
            )
        for wire in wires:
            if wire.datatype == spec.datatype:
                raise LoadFailed(f"input {spec.name!r} is {spec.datatype} already")
            _check_range(spec, wire)
        found.append(replace(spec, accepts=wires) if wires else spec)
    return found


def _check_range(spec: TensorSpec, wire: WireType) -> None:
    """Refuse a wire type whose extreme values cast to infinity: the cast rounds
    monotonically, so every value between them is then finite too."""
    sent = DATATYPES[wire.datatype].dtype
    info = np.iinfo(sent.name) if sent.kind in "iu" else np.finfo(sent.name)
    extremes = np.array([info.min, info.max], sent)
    with np.errstate(over="ignore", invalid="ignore"):
        cast = staging.cast(extremes, _cast_of(spec, wire))
    if not np.isfinite(cast).all():
        raise LoadFailed(
            f"input {spec.name!r}: {wire.describe()} would make {wire.datatype}'s "
            f"{info.min:g}..{info.max:g} {cast[0]:g}..{cast[1]:g}, beyond {spec.datatype}"
        )


def _cast_of(spec: TensorSpec, wire: WireType) -> staging.Cast:
    return staging.Cast(spec.dtype, np.float32(wire.scale), np.float32(wire.offset))


class Model:
    """A loaded model. `accepts`: the wire types its inputs also take, by input name; `pads`:
    the inputs padded to share batches, with their pad values, and `buckets` and
    `max_length` the lengths they pad to (padding.plan). Both checked here: LoadFailed for a
    declaration the model cannot take."""

    def __init__(
        self,
        engine: Engine,
        batcher: Batcher,
        *,
        name: str = "",
        version: str = "1",
        tag: str = "",
        accepts: Accepts | None = None,
        pads: Pads | None = None,
        buckets: tuple[int, ...] = (),
        max_length: int = 0,
    ) -> None:
        self.name = name or engine.name
        self.version = version
        self.tag = tag  # what else tells this load apart (its file's stamp)
        self.engine = engine
        self.batcher = batcher
        self.inputs = wire_inputs(engine.inputs, accepts or {})
        self.outputs = engine.outputs
        self.padding = padding.plan(self.inputs, self.outputs, pads or {}, buckets, max_length)
        # By input name and the dtype sent. Where every batch is staged into pooled buffers
        # (CUDA), the instances cast as they stage; elsewhere `run` casts at once.
        self._casts: staging.Casts = {
            (s.name, DATATYPES[w.datatype].dtype): _cast_of(s, w)
            for s in self.inputs
            for w in s.accepts
        }
        self._cast_now = bool(self._casts) and not engine.staged
        for instance in engine.instances:
            instance.casts = self._casts
        self.pad_with(self.padding)
        # Padded batches are priced as the instances run them: staged ones at the bucket.
        batcher.queue.to_bucket = engine.staged
        batcher.pad_rows = engine.padded
        self._inputs_by_name = {s.name: s for s in self.inputs}
        self._output_names = [s.name for s in self.outputs]
        self._batchable = engine.batchable
        self._batching = batcher.queue.max_rows > 1
        # What follows the protocol's name in the cache key of this model's requests: the
        # same bytes for another model, version or load meet another answer.
        self.scope = f"\0{self.name}\0{self.version}\0{self.tag}\0".encode()
        self.calls = 0  # calls holding this model now (`hold`)
        self._idle: asyncio.Event | None = None  # set when `calls` falls to 0, once retired

    def __repr__(self) -> str:
        return f"Model({self.name!r}, version {self.version!r})"

    def pad_with(self, plan: padding.Padding | None) -> None:
        """Serve with `plan` (what warm-up learned of the outputs, before serving)."""
        self.padding = plan
        for instance in self.engine.instances:
            instance.padding = plan

    def describe(self) -> str:
        """The settings this model serves with, as loaded (its config's over the server's):
        for the lines that say what a node serves."""
        rows = self.batcher.queue.max_rows
        # Inputs with a fixed first dimension never share a run, whatever the setting.
        batch = (
            f"max batch {rows}"
            if self._batchable or rows == 1
            else "max batch 1 (its first dimension is fixed)"
        )
        count = len(self.engine.instances)
        wires = "".join(
            f", {s.name} also takes {', '.join(w.describe() for w in s.accepts)}"
            for s in self.inputs
            if s.accepts
        )
        pads = f", {self.padding.describe()}" if self.padding is not None else ""
        return f"{batch}, {count} instance{'s' if count > 1 else ''}{wires}{pads}"

    async def run(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        deadline: float | None,
        trip: Trip | None = None,
        priority: int = 0,
    ) -> tuple[Arrays, list[str]]:
        """Check the request, run it through the batcher (in its `priority` class); the
        outputs asked for (all when none are named) and the inputs that held NaN or infinity.
        The batcher fills in `trip`, if given, with the request's queue wait and batch (for
        tracing)."""
        nonfinite, rows = self._fits(inputs)  # padded lengths are measured below, once
        if self._cast_now:
            inputs = self.cast(inputs)
        names = self.select(outputs) if outputs else self._output_names
        if not self._batchable:
            rows = None
        # Requests that cannot share a batch get a group of their own.
        batching = self._batching and rows is not None
        lengths: padding.Lengths = ()
        bucket: padding.Lengths = ()
        if self.padding is None:
            group = staging.group_key(inputs, names, self._casts) if batching else object()
        else:
            lengths, bucket = self.padding.measure(inputs)
            group = (
                self.padding.group_key(inputs, names, bucket, self._casts) if batching else object()
            )
        results = await self.batcher.submit(
            inputs,
            names,
            rows=rows or 1,
            group=group,
            deadline=deadline,
            trip=trip,
            priority=priority,
            lengths=lengths,
            bucket=bucket,
        )
        return results, nonfinite

    def check(self, inputs: Mapping[str, np.ndarray]) -> list[str]:
        """Raise InvalidInput unless `inputs` fit the model; return the names of inputs that
        hold NaN or infinity (allowed, but worth telling the caller). An input sent in one
        of its wire types is checked as sent: the cast keeps NaN and infinity and makes
        none (`wire_inputs`), and integers hold neither (that check costs nothing)."""
        nonfinite, _ = self._fits(inputs)
        if self.padding is not None:  # padded inputs agree in length, within the longest
            self.padding.measure(inputs)
        return nonfinite

    def _fits(self, inputs: Mapping[str, np.ndarray]) -> tuple[list[str], int | None]:
        """`check` but for the padded lengths, which `run` measures itself; and the request's
        rows, the first dimension its inputs share (None: none)."""
        if inputs.keys() != self._inputs_by_name.keys():  # compared as sets
            unknown = [n for n in inputs if n not in self._inputs_by_name]
            if unknown:
                raise InvalidInput(
                    f"unknown input {unknown[0]!r}; the model's inputs are "
                    + ", ".join(f"{s.name!r} {s.describe()}" for s in self.inputs)
                )
            missing = [s for s in self.inputs if s.name not in inputs]
            raise InvalidInput(
                "missing input " + ", ".join(f"{s.name!r} {s.describe()}" for s in missing)
            )
        nonfinite = []
        firsts: set[int | None] = set()
        for spec in self.inputs:
            array = inputs[spec.name]
            if array.dtype != spec.dtype and (spec.name, array.dtype) not in self._casts:
                also = ", ".join(w.describe() for w in spec.accepts)
                raise InvalidInput(
                    f"input {spec.name!r} is {name_of(array.dtype)} "
                    f"but the model takes {spec.datatype}"
                    + (f" (or, cast by the server, {also})" if also else "")
                )
            if array.ndim != len(spec.shape):
                raise InvalidInput(
                    f"input {spec.name!r} has rank {array.ndim} (shape {list(array.shape)}) "
                    f"but the model takes rank {len(spec.shape)}: {spec.describe()}"
                )
            for axis, (got, want) in enumerate(zip(array.shape, spec.shape, strict=True)):
                if want is not None and got != want:
                    raise InvalidInput(
                        f"input {spec.name!r} has size {got} in dimension {axis} "
                        f"(shape {list(array.shape)}) but the model needs {want}: "
                        f"{spec.describe()}"
                    )
            if array.size == 0:
                raise InvalidInput(
                    f"input {spec.name!r} is empty (shape {list(array.shape)}); "
                    "the model needs at least one row"
                )
            firsts.add(array.shape[0] if array.ndim else None)
            if holds_nonfinite(array):
                nonfinite.append(spec.name)
        return nonfinite, firsts.pop() if len(firsts) == 1 else None

    def cast(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Checked `inputs` as the model takes them: each one sent in a wire type cast into
        an array of its own, in one pass; the others as they are."""
        casts = self._casts
        if not any((n, a.dtype) in casts for n, a in inputs.items()):
            return inputs
        return {
            n: a if (how := casts.get((n, a.dtype))) is None else staging.cast(a, how)
            for n, a in inputs.items()
        }

    def select(self, names: Sequence[str]) -> list[str]:
        """The output names to compute: all when `names` is empty."""
        if not names:
            return self._output_names
        for name in names:
            if name not in self._output_names:
                raise InvalidInput(
                    f"unknown output {name!r}; the model's outputs are "
                    + ", ".join(repr(n) for n in self._output_names)
                )
        return list(dict.fromkeys(names))

    def hold(self) -> None:
        """A call will use this model: `retire` waits for it to `release`."""
        self.calls += 1

    def release(self) -> None:
        self.calls -= 1
        if self.calls == 0 and self._idle is not None:
            self._idle.set()

    async def retire(self) -> None:
        """Once its calls in flight are answered (it no longer takes new ones: see
        Models.remove), release the model's sessions and threads."""
        if self.calls:
            self._idle = asyncio.Event()
            await self._idle.wait()
        await self.close()

    async def close(self) -> None:
        """Let running batches finish, then release the model's sessions and threads."""
        await self.batcher.close()
        self.engine.close()


class Listener(Protocol):
    """What wants to know when the served set changes (metrics, readiness)."""

    def installed(self, model: Model) -> None: ...

    def removed(self, model: Model) -> None: ...


class Models:
    """The models a node serves: by name, each with its ready versions. The newest ready
    version answers calls that name none; installing a version and removing one are single
    steps, so every call sees either the old set or the new. The empty name asks for the
    default model: the one named as default, else the only one."""

    def __init__(self, models: Iterable[Model] = (), *, default: str = "") -> None:
        self._versions: dict[str, dict[str, Model]] = {}
        self._newest: dict[str, Model] = {}
        self._default = default
        # The versions removed, by name, with why: a call that names one hears it was, not
        # that the model is unknown. A version installed again leaves it; past the caps the
        # oldest go, so a server that swaps versions for months does not keep them all.
        self._gone: dict[str, dict[str, str]] = {}
        self.listeners: list[Listener] = []  # told of every install and removal
        # What a call that names no model gets; None when the node serves several and none
        # is named as default (such a call is refused). Kept as the set changes.
        self.default: Model | None = None
        for model in models:
            if model.version in self._versions.get(model.name, {}):
                raise ValueError(f"two models are named {model.name!r}, version {model.version}")
            self.install(model)

    def __iter__(self) -> Iterator[Model]:
        return (m for versions in list(self._versions.values()) for m in list(versions.values()))

    def __len__(self) -> int:
        return len(self._newest)

    def _chosen(self) -> Model | None:
        """The default model: the one named as default, else the only one."""
        if self._default:
            return self._newest.get(self._default)
        if len(self._newest) == 1:
            return next(iter(self._newest.values()))
        return None

    def install(self, model: Model) -> Model | None:
        """Make `model` ready; returns the version it replaced (same name and version)."""
        versions = self._versions.setdefault(model.name, {})
        replaced = versions.get(model.version)
        # No await between the two: no call sees one updated without the other.
        self._versions[model.name] = {**versions, model.version: model}
        self._newest[model.name] = max(self._versions[model.name].values(), key=_order)
        self.default = self._chosen()
        gone = self._gone.get(model.name, {})
        if gone.pop(model.version, None) is not None and not gone:
            del self._gone[model.name]
        for listener in self.listeners:
            if replaced is not None:
                listener.removed(replaced)
            listener.installed(model)
        return replaced

    def remove(self, name: str, version: str, why: str = "unloaded") -> Model | None:
        """Stop giving calls to this version (its calls in flight go on); returns it. Calls
        that name it from now on are told `why`."""
        versions = self._versions.get(name, {})
        model = versions.get(version)
        if model is None:
            return None
        # The latest removal last, of the model's versions and of the models.
        gone = self._gone.pop(name, {})
        gone.pop(version, None)
        gone[version] = why
        self._gone[name] = dict(list(gone.items())[-GONE_VERSIONS:])
        for forgotten in list(self._gone)[:-GONE_MODELS]:
            del self._gone[forgotten]
        left = {v: m for v, m in versions.items() if v != version}
        if left:
            self._versions[name] = left
            self._newest[name] = max(left.values(), key=_order)
        else:
            del self._versions[name], self._newest[name]
        self.default = self._chosen()
        for listener in self.listeners:
            listener.removed(model)
        return model

    def versions(self, name: str) -> list[Model]:
        """The ready versions of a model, newest first."""
        return sorted(self._versions.get(name, {}).values(), key=_order, reverse=True)

    def names(self) -> list[str]:
        return sorted(self._newest)

    def get(self, name: str = "", version: str = "") -> Model:
        """The model a call asks for; raises ModelNotFound."""
        if not name:
            model = self.default
            if model is None:
                raise ModelNotFound(self._no_default())
            if not version:
                return model
            name = model.name
        found = self._versions.get(name, {}).get(version) if version else self._newest.get(name)
        if found is None:
            raise ModelNotFound(self._missing(name, version))
        return found

    def _no_default(self) -> str:
        if self._default:
            return f"the default model {self._default!r} is not loaded" + (
                f"{self._why(self._default)}; this node serves {self._served()}"
            )
        if not self._newest:
            gone = [f"{n!r} is not loaded{self._why(n)}" for n in self._gone]
            return "this node serves no model" + (f": {', '.join(gone)}" if gone else "")
        return "this node serves several models and none is the default: name one of " + (
            self._served()
        )

    def _missing(self, name: str, version: str) -> str:
        asked = f"model {name!r}" + (f" version {version!r}" if version else "")
        why = self._why(name, version)
        if name not in self._newest:
            why = why or self._why(name)  # a version it never had: why the model went
            if why:
                return f"{asked} is not loaded{why}; this node serves {self._served()}"
            return f"unknown model {name!r}; this node serves {self._served()}"
        ready = ", ".join(m.version for m in self.versions(name))
        if why:
            return f"{asked} is not loaded{why}; ready: {ready}"
        return f"model {name!r} has no ready version {version!r}; ready: {ready}"

    def _served(self) -> str:
        return ", ".join(repr(n) for n in self.names()) or "none"

    def _why(self, name: str, version: str = "") -> str:
        """Why `name` (`version`: that version; "": its latest removal) no longer serves, as
        " (why)"; "" when it was never removed."""
        gone = self._gone.get(name, {})
        why = gone.get(version) if version else next(reversed(gone.values()), None)
        return f" ({why})" if why else ""


def _order(model: Model) -> tuple[int, int | str]:
    return version_key(model.version)
