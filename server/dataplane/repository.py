"""The model repository in Triton's layout, polled, each change applied as a hot swap.

A version is loaded beside what serves, checked, warmed up and installed in one step; only
then do unwanted versions stop taking calls, each unloading once its calls are answered. A
version that fails is logged once and not retried until its file's stamp changes, and what
served keeps serving. The config reader is injected (sluice.server.modelconfig)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sluice.core import files
from sluice.core.errors import LoadFailed, ModelNotFound
from sluice.server.dataplane import staging
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.engine import Engine, Instance, zeros
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.modelsettings import Config, ModelSettings

CONFIG_FILE = "config.pbtxt"
READY, UNAVAILABLE, LOADING = "READY", "UNAVAILABLE", "LOADING"

# The model file's stamp and config.pbtxt's: a change to either reloads the version.
Stamp = tuple[files.Stamp, files.Stamp | None]


@dataclass(frozen=True)
class IndexEntry:
    """One row of the repository index; version "" speaks for the whole model."""

    name: str
    version: str
    state: str
    reason: str = ""


@dataclass(frozen=True)
class LoadReport:
    """What a load request left: the versions that serve, and those refused with why."""

    name: str
    serving: list[int]
    refused: dict[int, str]

    def describe(self) -> str:
        serving = _versions(self.serving) + (" serve" if len(self.serving) > 1 else " serves")
        refused = "; ".join(f"version {v} refused: {why}" for v, why in self.refused.items())
        return f"{serving}; {refused}" if refused else serving


def _versions(numbers: list[int]) -> str:
    return ("versions " if len(numbers) > 1 else "version ") + ", ".join(map(str, numbers))


def no_config(path: Path) -> Config:
    """The reader used when none is injected: the defaults, and no config file allowed."""
    if path.exists():
        raise LoadFailed(f"{path}: this repository was set up without a config reader")
    return Config()


async def load_model(name: str, version: int | str, path: Path, settings: ModelSettings) -> Model:
    """Load, check and warm up `path` as `name` `version` (in a thread, so serving goes on);
    LoadFailed naming the file and why."""
    before = files.stamp(path)
    building = asyncio.ensure_future(
        asyncio.to_thread(
            Engine,
            path,
            device=settings.device,
            intra_op_threads=settings.intra_op_threads,
            instances=settings.instances,
            pool_bytes=settings.pool_bytes,
            pinned=settings.pinned,
            cuda_options=settings.cuda_options,
            max_batch=settings.max_batch,
            inline_max_s=settings.inline_max_s,
            spinning=settings.spinning,
            arena=settings.arena,
            lengths=bool(settings.pads),
        )
    )
    try:
        engine = await asyncio.shield(building)
    except asyncio.CancelledError:
        # The thread cannot be stopped: close the engine it builds once it is done.
        building.add_done_callback(_close_built)
        raise
    except Exception as exc:
        raise LoadFailed(f"{path}: {_reason(exc)}") from exc
    batcher = Batcher(
        engine.instances,
        max_rows=settings.max_batch,
        budget_s=settings.batch_budget_s,
        max_queue=settings.max_queue,
    )
    # The stamp in the cache key keeps a file rewritten in place from getting the old one's
    # answers; rewritten while it loaded, which bytes were read is unknown.
    if files.stamp(path) != before:
        engine.close()
        raise LoadFailed(f"{path}: the file changed while it loaded")
    tag = ":".join(map(str, before)) if before else ""
    try:
        model = Model(
            engine,
            batcher,
            name=name,
            version=str(version),
            tag=tag,
            accepts=settings.accepts,
            pads=settings.pads,
            buckets=settings.buckets,
            max_length=settings.max_length,
        )
    except LoadFailed as exc:
        engine.close()
        raise LoadFailed(f"{path}: {exc}") from None
    try:
        await asyncio.to_thread(warm_up, model)
    except BaseException as exc:
        await model.close()
        if isinstance(exc, Exception):
            raise LoadFailed(f"{path}: {_reason(exc)}") from exc
        raise
    return model


def _close_built(task: asyncio.Future[Engine]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0] if len(text) > 300 else text


def warm_up(model: Model) -> None:
    """Run zeros through each instance at each batch size and length bucket it will see, so
    first-run allocation and GPU algorithm search happen before it serves, and check the
    outputs' datatypes; padded inputs first learn which output axes follow the length.
    Blocking: call it in a thread."""
    names = [s.name for s in model.outputs]
    engine = model.engine
    if model.padding is not None:
        model.pad_with(
            model.padding.follow(model.outputs, lambda lengths: _shapes_at(model, lengths))
        )
    padding = model.padding
    buckets = padding.buckets.listed() if padding is not None and engine.staged else ()
    for rows in engine.warm_rows():
        for length in buckets or (0,):
            inputs = zeros(model.inputs, rows)
            lengths: tuple[int, ...] = ()
            if padding is not None and length:
                inputs = padding.shaped(inputs, length)
                lengths = (length,) * len(padding.dims)
            model.check(inputs)
            held: list[np.ndarray] = []  # given back once every instance ran this size
            try:
                for instance in engine.instances:
                    _warm(model, instance, inputs, names, rows, lengths, held)
            finally:
                for buffer in held:
                    engine.pool.give(buffer)


def _shapes_at(model: Model, lengths: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The output shapes of one run of zeros, padded inputs at `lengths`."""
    assert model.padding is not None
    inputs = model.padding.shaped(zeros(model.inputs), lengths)
    held: list[np.ndarray] = []
    try:
        results = _warm(
            model,
            model.engine.instances[0],
            inputs,
            [s.name for s in model.outputs],
            1,
            lengths,
            held,
        )
    finally:
        for buffer in held:
            model.engine.pool.give(buffer)
    return {name: array.shape for name, array in results.items()}


def _warm(
    model: Model,
    instance: Instance,
    inputs: dict[str, np.ndarray],
    names: list[str],
    rows: int,
    lengths: tuple[int, ...],
    held: list[np.ndarray],
) -> dict[str, np.ndarray]:
    """One warm-up run, staged as requests are; its pooled buffers go to `held`."""
    try:
        staged = inputs
        if instance.stage_always:
            staged, taken = staging.merge([inputs], instance.pool, rows if instance.pad else 0)
            held += taken
        results, pooled = instance.run_sync(staged, names, rows, instance.stage_always, lengths)
        held += pooled
    except Exception as exc:
        shapes = ", ".join(f"{s.name} {list(inputs[s.name].shape)}" for s in model.inputs)
        raise LoadFailed(f"a warm-up run of zeros ({shapes}) failed: {exc}") from exc
    for spec in model.outputs:
        got = results[spec.name].dtype
        if got != spec.dtype:
            raise LoadFailed(
                f"output {spec.name!r} is declared {spec.datatype} but a run of zeros gave {got}"
            )
    return results


@dataclass
class _Loaded:
    model: Model
    stamp: Stamp


@dataclass
class _Found:
    """One model directory as a scan saw it."""

    name: str
    config: Config | None
    error: str  # why the config is refused
    config_stamp: files.Stamp | None
    versions: dict[int, tuple[Path, Stamp]] = field(default_factory=dict)


class Repository:
    """Keeps `models` in step with the repository at `root`, changing only what it loaded;
    one step (`poll`, `load`, `unload`) at a time."""

    def __init__(
        self,
        root: Path,
        models: Models,
        defaults: ModelSettings,
        *,
        read_config: Callable[[Path], Config] = no_config,
        poll_s: float = 5.0,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        loader: Callable[[str, int, Path, ModelSettings], Awaitable[Model]] | None = None,
    ) -> None:
        self.root = Path(root)
        self.models = models
        self.defaults = defaults
        self.read_config = read_config
        self.poll_s = poll_s
        self.log = log or logging.getLogger("sluice.repository")
        self.clock = clock
        self._load = loader or load_model
        self._lock = asyncio.Lock()
        self._loaded: dict[str, dict[int, _Loaded]] = {}
        self._loading: set[tuple[str, int]] = set()
        self._failed: dict[tuple[str, int], tuple[Stamp, str]] = {}
        self._config_failed: dict[str, tuple[files.Stamp | None, str]] = {}
        self._configs: dict[str, tuple[files.Stamp | None, Config | str]] = {}
        self._found: dict[str, _Found] = {}
        self._unloaded: set[str] = set()  # by `unload`: not loaded again until `load`
        self._retiring: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None

    async def poll(self) -> None:
        """One sync step: scan the repository and bring the loaded versions in line."""
        async with self._lock:
            found = await asyncio.to_thread(self._scan)
            self._found = found
            for name, model in found.items():
                if name not in self._unloaded:
                    await self._sync(model)
            for name in [n for n in self._loaded if n not in found]:
                self._unload_all(name, "its directory is gone")
            for key in [k for k in self._failed if k[0] not in found]:
                del self._failed[key]

    async def run(self) -> None:
        """Poll every `poll_s` seconds until cancelled (or `close`)."""
        self._runner = asyncio.current_task()
        failing = ""
        try:
            while True:
                try:
                    await self.poll()
                    failing = ""
                except Exception as exc:  # a bad scan must not stop the watching
                    if str(exc) != failing:  # once, not every poll
                        failing = str(exc)
                        self.log.error("model repository: poll failed: %s", _reason(exc))
                await asyncio.sleep(self.poll_s)
        finally:
            self._runner = None

    async def close(self) -> None:
        """Stop polling and wait for retired versions to unload (the dataplane closes the
        serving ones)."""
        if self._runner is not None and self._runner is not asyncio.current_task():
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        async with self._lock:
            pass
        await self.settle()

    async def settle(self) -> None:
        """Wait until the versions taken out of service have unloaded."""
        while self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    # KServe's model repository extension.

    async def load(self, name: str) -> LoadReport:
        """Load or reload `name` now, retrying failed files; what serves and what was refused.
        ModelNotFound without a directory; LoadFailed if its config is refused or no version
        serves."""
        async with self._lock:
            self._dir(name)
            self._unloaded.discard(name)
            found = await asyncio.to_thread(self._scan, name)
            if name not in found:
                raise ModelNotFound(f"the model repository {str(self.root)!r} has no {name!r}")
            self._found[name] = found[name]
            for key in [k for k in self._failed if k[0] == name]:
                del self._failed[key]
            self._config_failed.pop(name, None)
            refused = await self._sync(found[name])
            config = found[name].config
            if config is None:  # nothing of it was loaded: what served before serves on
                raise LoadFailed(f"model {name}: {found[name].error}; {self._serving_now(name)}")
            serving = sorted(self._loaded.get(name, {}))
            if not serving:
                why = "; ".join(f"version {v}: {reason}" for v, reason in refused.items())
                raise LoadFailed(
                    f"model {name!r} has no version to serve: "
                    + (
                        why
                        or f"no numbered directory under {str(self.root / name)!r} holds "
                        f"{config.default_model_filename}"
                    )
                    + f" (version policy: {config.policy.describe()})"
                )
            report = LoadReport(name, serving, dict(sorted(refused.items())))
            if refused:
                self.log.warning("model %s load requested: %s", name, report.describe())
            return report

    async def unload(self, name: str) -> None:
        """Stop serving every version of `name` and keep it unloaded until `load(name)`."""
        async with self._lock:
            if name not in self._loaded and not self._dir(name).is_dir():
                raise ModelNotFound(f"the model repository {str(self.root)!r} has no {name!r}")
            self._unloaded.add(name)
            self._unload_all(name, "unloaded on request")

    def index(self) -> list[IndexEntry]:
        """Every model directory found (and every model loaded) with its versions' states."""
        entries: list[IndexEntry] = []
        for name in sorted(set(self._found) | set(self._loaded)):
            rows: dict[int, IndexEntry] = {}
            found = self._found.get(name)
            for (model, version), (stamp, reason) in self._failed.items():
                current = found.versions.get(version) if found and model == name else None
                if current is not None and current[1] == stamp:  # not since changed
                    rows[version] = IndexEntry(name, str(version), UNAVAILABLE, reason)
            for model, version in self._loading:
                if model == name:
                    rows[version] = IndexEntry(name, str(version), LOADING)
            for version in self._loaded.get(name, {}):
                rows[version] = IndexEntry(name, str(version), READY)
            if not rows:
                if name in self._unloaded:
                    reason = "unloaded"
                elif name in self._config_failed:
                    reason = self._config_failed[name][1]
                else:
                    reason = "no version to serve"
                rows[0] = IndexEntry(name, "", UNAVAILABLE, reason)
            entries += [rows[v] for v in sorted(rows)]
        return entries

    def _scan(self, only: str | None = None) -> dict[str, _Found]:
        """The model directories under root (or just `only`), their configs and versions.
        Blocking."""
        found: dict[str, _Found] = {}
        try:
            dirs = [self.root / only] if only else sorted(self.root.iterdir())
        except OSError as exc:
            raise LoadFailed(f"model repository {str(self.root)!r}: {exc}") from exc
        for folder in dirs:
            if folder.name.startswith(".") or not folder.is_dir():
                continue
            name = folder.name
            config_path = folder / CONFIG_FILE
            config_stamp = files.stamp(config_path)
            cached = self._configs.get(name)
            if cached is not None and cached[0] == config_stamp:
                config_or_error = cached[1]
            else:
                try:
                    config_or_error = self.read_config(config_path)
                except Exception as exc:
                    config_or_error = _reason(exc)
                self._configs[name] = (config_stamp, config_or_error)
            if isinstance(config_or_error, str):
                found[name] = _Found(name, None, config_or_error, config_stamp)
                continue
            model = found[name] = _Found(name, config_or_error, "", config_stamp)
            try:
                subs = list(folder.iterdir())
            except OSError as exc:  # unreadable now: refuse it, but what serves keeps serving
                found[name] = _Found(name, None, f"{folder}: {exc}", config_stamp)
                continue
            for sub in subs:
                # '²' is a digit to isdigit() but not to int(); '03' would be a second 3.
                canonical = sub.name.isascii() and sub.name.isdigit() and sub.name[0] != "0"
                if not canonical or not sub.is_dir():
                    continue
                path = sub / config_or_error.default_model_filename
                stamp = files.stamp(path) if path.is_file() else None
                if stamp is not None:
                    model.versions[int(sub.name)] = (path, (stamp, config_stamp))
        for name in [n for n in self._configs if n not in found and only is None]:
            del self._configs[name]
        return found

    async def _sync(self, found: _Found) -> dict[int, str]:
        """Bring one model's loaded versions in line with the scan; those refused, with why."""
        name = found.name
        if found.config is None:
            known = self._config_failed.get(name)
            if known is None or known[0] != found.config_stamp:  # logged once per file
                self._config_failed[name] = (found.config_stamp, found.error)
                self.log.warning(
                    "model %s refused: %s; %s", name, found.error, self._serving_now(name)
                )
            return {}
        self._config_failed.pop(name, None)
        loaded = self._loaded.setdefault(name, {})
        failures: dict[int, str] = {}

        def refused(version: int) -> bool:
            failed = self._failed.get((name, version))
            return failed is not None and failed[0] == found.versions[version][1]

        while True:
            # A loaded version whose changed file was refused keeps serving the old one.
            usable = [v for v in found.versions if v in loaded or not refused(v)]
            wanted = found.config.policy.choose(usable)
            todo = [
                v
                for v in sorted(wanted)
                if not refused(v) and (v not in loaded or loaded[v].stamp != found.versions[v][1])
            ]
            if not todo:
                break
            for version in todo:
                path, stamp = found.versions[version]
                failure = await self._load_version(name, version, path, stamp, found.config)
                if failure:
                    failures[version] = failure
        for version in sorted(set(loaded) - wanted):
            self._take_out(name, version, "not picked by its version policy")
        if not loaded:
            del self._loaded[name]
        return failures

    async def _load_version(
        self, name: str, version: int, path: Path, stamp: Stamp, config: Config
    ) -> str:
        """Load, check and install one version; the refusal ("" if none)."""
        loaded = self._loaded.setdefault(name, {})
        again = version in loaded
        started = self.clock()
        self._loading.add((name, version))
        try:
            model = await self._load(name, version, path, self.defaults.overlay(config))
        except Exception as exc:
            reason = str(exc) if isinstance(exc, LoadFailed) else f"{path}: {_reason(exc)}"
            self._failed[(name, version)] = (stamp, reason)
            self.log.warning(
                "model %s version %d refused: %s; %s",
                name,
                version,
                reason,
                self._serving_now(name),
            )
            return reason
        finally:
            self._loading.discard((name, version))
        self._failed.pop((name, version), None)
        replaced = self.models.install(model)  # the switch: calls from now on get it
        loaded[version] = _Loaded(model, stamp)
        self.log.info(
            "model %s version %d %s in %.2f s, takes traffic (%s)",
            name,
            version,
            "reloaded (its file changed)" if again else "loaded",
            self.clock() - started,
            model.describe(),
        )
        if replaced is not None:
            self._retire(replaced)
        return ""

    def _take_out(self, name: str, version: int, why: str) -> None:
        entry = self._loaded[name].pop(version)
        # A same-named model may be another source's.
        if any(m is entry.model for m in self.models.versions(name)):
            self.models.remove(name, str(version), why)
            self.log.debug("model %s version %d stops taking calls: %s", name, version, why)
        self._retire(entry.model)

    def _unload_all(self, name: str, why: str) -> None:
        for version in sorted(self._loaded.get(name, {})):
            self._take_out(name, version, why)
        self._loaded.pop(name, None)

    def _retire(self, model: Model) -> None:
        """Unload `model` once its calls are answered, without holding up the poll."""

        async def retire() -> None:
            try:
                await model.retire()
            except Exception:
                self.log.exception(
                    "model %s version %s: unloading failed", model.name, model.version
                )
            else:
                self.log.info("model %s version %s unloaded", model.name, model.version)

        task = asyncio.create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _serving_now(self, name: str) -> str:
        versions = sorted(self._loaded.get(name, {}), reverse=True)
        if not versions:
            return "no version of it serves"
        if len(versions) == 1:
            return f"version {versions[0]} keeps serving"
        return "versions " + ", ".join(map(str, versions)) + " keep serving"

    def _dir(self, name: str) -> Path:
        """The directory of model `name`; ModelNotFound for a name that is not one."""
        if not name or name.startswith(".") or "/" in name or "\\" in name:
            raise ModelNotFound(f"{name!r} cannot name a model in the repository")
        return self.root / name
