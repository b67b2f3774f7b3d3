"""The loaded models: each one's name and version, its engine and batcher, and the checks of a
request against its inputs and outputs. Transport-free.

`Models` is the seam for a repository of several models and versions: the dataplane asks it
for a model by name and keys its cache by that model's name and version."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from sluice.core.datatypes import name_of
from sluice.core.errors import InvalidInput
from sluice.server.dataplane import staging
from sluice.server.dataplane.batcher import Arrays, Batcher, Trip
from sluice.server.dataplane.engine import Engine


class Model:
    def __init__(
        self, engine: Engine, batcher: Batcher, *, name: str = "", version: str = "1"
    ) -> None:
        self.name = name or engine.name
        self.version = version
        self.engine = engine
        self.batcher = batcher
        self.inputs = engine.inputs
        self.outputs = engine.outputs
        self._inputs_by_name = {s.name: s for s in self.inputs}
        self._output_names = [s.name for s in self.outputs]
        # Requests batch along the first dimension only if every input and output has it.
        self._batchable = all(s.shape and s.shape[0] is None for s in self.inputs + self.outputs)
        self._batching = batcher.queue.max_rows > 1
        self._scopes: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return f"Model({self.name!r}, version {self.version!r})"

    def scope(self, codec: str) -> bytes:
        """What leads the cache key of this model's requests in wire format `codec`: the
        same bytes in another format, or for another model or version, meet another answer."""
        scope = self._scopes.get(codec)
        if scope is None:  # once per codec: this is on every call's path
            scope = self._scopes[codec] = f"{codec}\0{self.name}\0{self.version}\0".encode()
        return scope

    async def run(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        deadline: float | None,
        trip: Trip | None = None,
    ) -> tuple[Arrays, list[str]]:
        """Check the request, run it through the batcher; the outputs asked for (all when
        none are named) and the inputs that held NaN or infinity. The batcher fills in
        `trip`, if given, with the request's queue wait and batch (for tracing)."""
        nonfinite = self.check(inputs)
        names = self.select(outputs)
        rows = staging.rows_of(inputs) if self._batchable else None
        # Requests that cannot share a batch get a group of their own.
        batching = self._batching and rows is not None
        group = staging.group_key(inputs, names) if batching else object()
        results = await self.batcher.submit(
            inputs, names, rows=rows or 1, group=group, deadline=deadline, trip=trip
        )
        return results, nonfinite

    def check(self, inputs: Mapping[str, np.ndarray]) -> list[str]:
        """Raise InvalidInput unless `inputs` fit the model; return the names of inputs that
        hold NaN or infinity (allowed, but worth telling the caller)."""
        unknown = [n for n in inputs if n not in self._inputs_by_name]
        if unknown:
            raise InvalidInput(
                f"unknown input {unknown[0]!r}; the model's inputs are "
                + ", ".join(f"{s.name!r} {s.describe()}" for s in self.inputs)
            )
        missing = [s for s in self.inputs if s.name not in inputs]
        if missing:
            raise InvalidInput(
                "missing input " + ", ".join(f"{s.name!r} {s.describe()}" for s in missing)
            )
        nonfinite = []
        for spec in self.inputs:
            array = inputs[spec.name]
            if array.dtype != spec.dtype:
                raise InvalidInput(
                    f"input {spec.name!r} is {name_of(array.dtype)} "
                    f"but the model takes {spec.datatype}"
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
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                nonfinite.append(spec.name)
        return nonfinite

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

    async def close(self) -> None:
        """Let running batches finish, then release the model's sessions and threads."""
        await self.batcher.close()
        self.engine.close()


class Models:
    """The models a node serves, by name; the empty name asks for the default (the first)."""

    def __init__(self, models: Iterable[Model]) -> None:
        self._by_name: dict[str, Model] = {}
        for model in models:
            if model.name in self._by_name:
                raise ValueError(f"two models are named {model.name!r}")
            self._by_name[model.name] = model
        if not self._by_name:
            raise ValueError("at least one model")
        self.default = next(iter(self._by_name.values()))

    def __iter__(self) -> Iterator[Model]:
        return iter(self._by_name.values())

    def get(self, name: str = "") -> Model:
        if not name:
            return self.default
        found = self._by_name.get(name)
        if found is None:
            raise InvalidInput(
                f"unknown model {name!r}; this node serves "
                + ", ".join(repr(n) for n in self._by_name)
            )
        return found
