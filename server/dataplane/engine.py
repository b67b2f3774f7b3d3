"""ONNX Runtime engine: loads a model as one or more instances, picks the execution
provider, and runs batches (checking a request against the model is `models.Model`'s job).

Transport-free: takes and returns numpy arrays, raises `sluice.core.errors` exceptions.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:
    import onnxruntime as ort
except ModuleNotFoundError as exc:
    if exc.name != "onnxruntime":
        raise
    # `pip install sluice` is the client alone. What to install; an ImportError, so that
    # whoever imports this decides (the server's commands end with this one line: entry.py).
    raise ImportError(
        "sluice-server: ONNX Runtime is not installed: "
        "pip install 'sluice[cpu]' (or 'sluice[gpu]' for NVIDIA GPUs)",
        name="onnxruntime",
    ) from exc
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument as OrtInvalidArgument

from sluice.core.datatypes import DATATYPES
from sluice.core.errors import InvalidInput, ModelFailed, Unavailable
from sluice.server.dataplane import gpu, staging
from sluice.server.dataplane.batcher import Pending, padded_to
from sluice.server.dataplane.buffers import BufferPool, bucket, numpy_allocator
from sluice.server.dataplane.modelsettings import WireType
from sluice.server.dataplane.padding import Lengths, Padding, tokens

log = logging.getLogger("sluice.engine")

# ONNX Runtime's element type names to API datatype names.
_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
}
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output; None in `shape` is a dynamic dimension, and `dims` holds the
    model's symbolic name of each dynamic one (None: static or unnamed; empty: not known).
    `accepts`: the other datatypes an input also takes on the wire (cast by the server:
    `models.Model`)."""

    name: str
    datatype: str
    shape: tuple[int | None, ...]
    accepts: tuple[WireType, ...] = ()
    dims: tuple[str | None, ...] = ()
    # Looked up once: every call's checks read it.
    dtype: np.dtype[np.generic] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DATATYPES[self.datatype].dtype)

    def describe(self) -> str:
        dims = ", ".join("N" if d is None else str(d) for d in self.shape)
        return f"{self.datatype}[{dims}]"


def _spec(arg: ort.NodeArg) -> TensorSpec:
    datatype = _ORT_TYPES.get(arg.type)
    if datatype is None:
        raise ValueError(
            f"model tensor {arg.name!r} has type {arg.type}, which Sluice cannot serve"
        )
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    dims = tuple(d if isinstance(d, str) and d else None for d in arg.shape)
    return TensorSpec(arg.name, datatype, shape, dims=dims)


def choose_providers(device: str) -> list[str]:
    """Providers to ask ONNX Runtime for. `auto` asks for CUDA only if a GPU is present;
    `cuda` refuses to start without one."""
    if device == "cpu":
        return [CPU]
    has_cuda_build = CUDA in ort.get_available_providers()
    if device == "cuda":
        if not has_cuda_build:
            raise Unavailable(
                "--device cuda, but this onnxruntime build has no CUDA provider "
                "(pip install 'sluice[gpu]')"
            )
        if gpu.device_count() == 0:
            raise Unavailable(
                "--device cuda, but the CUDA driver sees no GPU (no libcuda.so.1, or no "
                "GPU given to this process or container)"
            )
        return [CUDA, CPU]
    return [CUDA, CPU] if has_cuda_build and gpu.device_count() > 0 else [CPU]


# How ONNX Runtime's checks of a feed against the model begin (inference_session.cc).
# session.run raises them as InvalidArgument; run_with_iobinding only as a RuntimeError
# with the text.
_INPUT_ERRORS = re.compile(
    r"(Invalid Feed Input Name|Unexpected input data type|Invalid rank for input"
    r"|Got invalid dimensions for input|Missing Input)"
)


def _run_error(exc: Exception) -> Exception:
    """An ONNX Runtime failure as a Sluice error: the caller's when the input did not fit."""
    if isinstance(exc, OrtInvalidArgument):
        return InvalidInput(f"the model rejected the input: {exc}")
    text = str(exc).removeprefix("Error in execution: ")
    if isinstance(exc, RuntimeError) and _INPUT_ERRORS.match(text):
        return InvalidInput(f"the model rejected the input: {text}")
    return ModelFailed(f"the model failed to run: {text}")  # ours, not the caller's


class Instance:
    """One model instance: runs one batch at a time, inline on the event loop when its runs
    are tiny (the thread hop would cost more), else in a thread. Tiny is decided once, from
    `row_seconds`, the cost of a row measured at load: a run slowed by load on the machine
    does not move it.

    Staged (CUDA, or asked for): every batch, even of one request, is copied into pooled
    staging buffers and run through IO binding, outputs written into pooled buffers too
    where their first dimension is the batch. Padded (staged, and every input and output
    has the batch first): batches are zero-padded to the pool's power-of-two row counts. On
    CUDA a session re-plans whenever its input shape changes, so `session` runs batches of
    one row, `by_rows` the padded sizes up to the batcher's largest, and `spill` (made on
    first need) any larger one; where inputs are padded to length buckets (`padding`, which
    models.Model sets), `spill` makes a session for each (rows, bucket) on its first run
    (warm-up runs the ones it knows).

    Padded inputs: a batch runs at its bucket's lengths when staged, else at its longest
    request's (a request alone at its own), and outputs along the padded dimensions are cut
    back to each request's lengths."""

    def __init__(
        self,
        index: int,
        session: ort.InferenceSession,
        *,
        pool: BufferPool,
        executor: Executor,
        output_specs: Sequence[TensorSpec],
        stage_always: bool = False,
        batchable: bool = False,
        inline_max_s: float = 0.0,
        row_seconds: float = math.inf,
        position_seconds: float = 0.0,
        shrink: bool = False,
        stream: Any = None,
        by_rows: Mapping[int | tuple[int, Lengths], ort.InferenceSession] | None = None,
        spill: Callable[[], ort.InferenceSession] | None = None,
    ) -> None:
        self.index = index
        self.session = session
        # Padded batch sizes with a session of their own; (rows, bucket) where lengths pad.
        self.by_rows: dict[int | tuple[int, Lengths], ort.InferenceSession] = dict(by_rows or {})
        self._make_spill = spill
        self._spill: ort.InferenceSession | None = None
        self._spill_lock = threading.Lock()
        self.pool = pool
        self.executor = executor
        self.stage_always = stage_always
        self.pad = stage_always and batchable
        self.inline_max_s = inline_max_s
        self.row_seconds = row_seconds
        self.position_seconds = position_seconds  # what a padded position adds, past one
        self.shrink = shrink  # the CPU arena is on: give back what a large run took
        self.stream = stream  # (stream, handle): keeps a user compute stream alive with the session
        # Where the first dimension of every input and output is the batch, outputs whose
        # other dimensions are known are written into pooled buffers. ONNX Runtime allocates
        # the rest: it alone knows their shapes.
        self._batched = {s.name for s in output_specs} if batchable else set()
        self._row_shapes = {
            s.name: tuple(d for d in s.shape[1:] if d is not None)
            for s in output_specs
            if batchable and all(d is not None for d in s.shape[1:])
        }
        self._dtypes = {s.name: s.dtype for s in output_specs}
        # Inputs sent in a compact wire type, cast as they are staged (models.Model sets it).
        self.casts: staging.Casts = {}
        self.padding: Padding | None = None  # its padded inputs (models.Model sets it)

    def _inline(self, rows: int, lengths: Lengths = ()) -> bool:
        """Whether a run of `rows` rows, padded inputs at `lengths`, is tiny enough to run
        inline."""
        positions = tokens(rows, lengths) - rows if lengths else 0
        padded = self.position_seconds * positions if positions else 0.0
        return self.row_seconds * rows + padded <= self.inline_max_s

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> dict[str, np.ndarray] | None:
        if self.stage_always:
            return None
        if self.padding is None:  # rows alone price the run: the common case, tested here
            if self.row_seconds * rows > self.inline_max_s:
                return None
        elif not self._inline(rows, self.padding.extent(inputs)):
            return None
        return self.run_sync(inputs, outputs, rows)[0]

    async def run(self, batch: Sequence[Pending]) -> list[dict[str, np.ndarray]]:
        rows = [p.rows for p in batch]
        total = sum(rows)
        outputs = batch[0].outputs
        # The lengths the batch runs at, and whether any request holds fewer (then padded).
        lengths = padded_to(batch, self.stage_always) if self.padding is not None else ()
        cut = any(p.lengths != lengths for p in batch) if lengths else False
        if len(batch) == 1 and not self.stage_always:
            inputs, buffers = dict(batch[0].inputs), list[np.ndarray]()
        else:
            padded = bucket(total) if self.pad else 0
            pads = self.padding.fills(lengths) if self.padding is not None and cut else None
            inputs, buffers = staging.merge(
                [p.inputs for p in batch], self.pool, padded, self.casts, pads
            )
        try:
            staged = bool(buffers)
            if self._inline(total, lengths):
                results, out_buffers = self.run_sync(inputs, outputs, total, staged, lengths)
            else:
                loop = asyncio.get_running_loop()
                results, out_buffers = await loop.run_in_executor(
                    self.executor, self.run_sync, inputs, outputs, total, staged, lengths
                )
        finally:
            for buffer in buffers:
                self.pool.give(buffer)
        if len(batch) > 1 or cut:
            # Outputs of a known row shape sit in pooled buffers when there are any; the rest
            # are ONNX Runtime's own arrays, which views keep alive.
            pooled = self._row_shapes if out_buffers else {}
            owned = [name for name in results if name not in pooled]
            cuts = self.padding.outputs if self.padding is not None and cut else None
            try:
                if len(batch) > 1:
                    split = staging.split(
                        results, rows, owned, cuts, [p.lengths for p in batch], lengths
                    )
                else:  # alone, padded: no rows to split (its first dimension may not be any)
                    split = [staging.cut(results, owned, cuts, batch[0].lengths, lengths)]
            except ValueError as exc:  # the model's outputs are not what it declares
                for buffer in out_buffers:
                    self.pool.give(buffer)
                raise ModelFailed(str(exc)) from None
        elif out_buffers:  # copies out of the pooled buffers, which go back now
            split = [{name: array.copy() for name, array in results.items()}]
        else:
            split = [results]
        for buffer in out_buffers:
            self.pool.give(buffer)
        return split

    def run_sync(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        rows: int,
        pooled_inputs: bool = False,
        lengths: Lengths = (),
    ) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """Run on checked inputs of `rows` rows (staged inputs may hold padding rows after
        them), padded inputs at `lengths`; returns the outputs, cut to `rows`, and the pooled
        buffers that hold them (the caller copies out and gives them back). One request on
        the CPU goes through session.run: its arrays are already in place, and IO binding's
        Python calls cost about 30 us more than the whole run of a small model."""
        if not pooled_inputs and not self.stage_always:
            large = self.shrink and sum(a.nbytes for a in inputs.values()) > SHRINK_FROM
            try:
                values = self.session.run(list(outputs), dict(inputs), SHRINK if large else None)
            except Exception as exc:
                raise _run_error(exc) from None
            return dict(zip(outputs, values, strict=True)), []
        # ONNX Runtime keeps raw pointers: every bound array lives until the run ends.
        bound = [np.ascontiguousarray(given) for given in inputs.values()]
        # The rows bound, padding included: batchable inputs all have them first.
        bound_rows = len(bound[0]) if self._batched else rows
        session = self._session_for(bound_rows, lengths)
        binding = session.io_binding()
        for name, array in zip(inputs, bound, strict=True):
            binding.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        results: dict[str, np.ndarray] = {}
        pooled: list[np.ndarray] = []
        dynamic: list[str] = []
        for name in outputs:
            row_shape = self._row_shapes.get(name)
            if row_shape is None:
                dynamic.append(name)
                binding.bind_output(name, "cpu")
                continue
            buffer = self.pool.take(self._dtypes[name], row_shape, bound_rows)
            pooled.append(buffer)
            array = buffer[:bound_rows]
            bound.append(array)
            binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
            results[name] = array[:rows]
        large = self.shrink and sum(a.nbytes for a in bound[: len(inputs)]) > SHRINK_FROM
        try:
            session.run_with_iobinding(binding, SHRINK if large else None)
        except Exception as exc:
            for buffer in pooled:
                self.pool.give(buffer)
            raise _run_error(exc) from None
        if dynamic:
            for name, value in zip(outputs, binding.get_outputs(), strict=True):
                if name not in dynamic:
                    continue
                array = value.numpy()
                if name in self._batched and len(array) != bound_rows:
                    for buffer in pooled:
                        self.pool.give(buffer)
                    raise ModelFailed(
                        f"output {name!r} has {len(array)} rows for a batch of {bound_rows}: "
                        "the model's first dimension is not the batch"
                    )
                results[name] = array[:rows] if name in self._batched else array
        return {name: results[name] for name in outputs}, pooled

    def _session_for(self, rows: int, lengths: Lengths = ()) -> ort.InferenceSession:
        """The session that runs `rows` bound rows, padded inputs at `lengths` (see the
        class's doc)."""
        if lengths and self._make_spill is not None:
            key = (rows, lengths)
            shaped = self.by_rows.get(key)
            if shaped is None:
                with self._spill_lock:
                    shaped = self.by_rows.get(key)
                    if shaped is None:
                        shaped = self.by_rows[key] = self._make_spill()
            return shaped
        found = self.by_rows.get(rows)
        if found is not None or rows == 1 or self._make_spill is None:
            return found or self.session
        with self._spill_lock:
            if self._spill is None:
                self._spill = self._make_spill()
            return self._spill


# With the CPU arena on (--ort-arena), a run whose inputs exceed this gives the arena's
# unused chunks back when it ends: the arena keeps the peak of batch-of-one runs of an image
# model, not that of a rare 25 MB batch.
SHRINK_FROM = 4 << 20
SHRINK = ort.RunOptions()
SHRINK.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


# `intra_op_threads=None`: chosen at load. A batch-of-one run this slow gains from running
# its operators on more threads (a convnet: 8.6 ms on one thread, 5.5 on two, here); a
# faster one would only take CPU from gRPC's threads.
PARALLEL_FROM_S = 0.001
MAX_AUTO_THREADS = 4


def zeros(specs: Sequence[TensorSpec], rows: int = 1, length: int = 1) -> dict[str, np.ndarray]:
    """Inputs of zeros that fit `specs`: dynamic dimensions are `length`, a dynamic first
    `rows`."""
    return {
        s.name: np.zeros(
            tuple((rows if i == 0 else length) if d is None else d for i, d in enumerate(s.shape)),
            s.dtype,
        )
        for s in specs
    }


# Where inputs are padded, the length of the second run at load that tells what a position
# costs beyond the first (for the inline decision).
MEASURED_LENGTH = 32


def run_seconds(
    session: ort.InferenceSession, inputs: Mapping[str, np.ndarray], budget_s: float = math.inf
) -> float:
    """The best of a few timed runs, after one that allocates; fewer once the timed runs
    add up to `budget_s` (a slow model is known slow from one run)."""
    session.run(None, dict(inputs))
    times: list[float] = []
    while len(times) < 5 and sum(times) < budget_s:
        started = time.perf_counter()
        session.run(None, dict(inputs))
        times.append(time.perf_counter() - started)
    return min(times)


def _start_cuda(path: Path, options: ort.SessionOptions, cuda_options: Mapping[str, str]) -> str:
    """ "" if ONNX Runtime's CUDA provider runs the model, else why not (a probe session)."""
    missing = gpu.missing_libraries()
    if missing:
        why = f"missing {', '.join(missing)} (pip install 'sluice[gpu]' brings them)"
    else:
        why = f"(this build needs a driver for CUDA {gpu.cuda_major() or '?'})"
    try:
        probe = _session(path, options, [(CUDA, dict(cuda_options)), CPU])
    except Exception as exc:  # ORT's own fallback is off: its reason, in its words
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"ONNX Runtime could not start its CUDA provider: {first} {why}"
    if probe.get_providers()[0] == CUDA:
        return ""
    return f"ONNX Runtime could not start its CUDA provider: {why}"


def _session(path: Path, options: ort.SessionOptions, providers: list[Any]) -> ort.InferenceSession:
    """A session that fails rather than quietly rebuilding itself on the CPU (onnxruntime's
    Python fallback, on by default, would also move a session to the CPU for good after one
    failed run)."""
    return ort.InferenceSession(str(path), options, providers=providers, enable_fallback=0)


class Engine:
    """A model loaded into ONNX Runtime as one or more instances (sessions).

    `device="auto"` asks for CUDA where a GPU is present; if ONNX Runtime cannot start it
    there, the model serves on the CPU and `fallback` says why (logged as a WARNING and shown
    in Health). `device="cuda"` refuses to load instead. CuPy's pinned memory and streams are
    made only once CUDA is known to run the model; `pinned=False` keeps staging memory
    pageable. `stage` forces the staged path on or off (default: on with CUDA and pinned
    memory). `cuda_options`: CUDA execution provider options (e.g. prefer_nhwc=1).
    `instances` and `max_batch` are taken as they are, at least 1 (`ModelSettings` clamps
    them). `lengths`: inputs will be padded to length buckets (models.Model's padding): on
    CUDA each (rows, bucket) shape then gets its session when it first runs (warm-up runs
    the buckets known), not each row count at load."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "auto",
        intra_op_threads: int | None = 1,
        instances: int = 1,
        pool_bytes: int = 256 << 20,
        inline_max_s: float = 0.0,
        pinned: bool = True,
        stage: bool | None = None,
        cuda_options: Mapping[str, str] | None = None,
        max_batch: int = 1,
        spinning: bool = False,
        arena: bool = False,
        lengths: bool = False,
    ) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"model file {str(path)!r} does not exist")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = intra_op_threads or 0
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only: CUDA probing warnings are not news.
        # The CPU arena keeps each run's peak for good (+230 MB after one 100,000-row run of
        # the digits model); without it small runs were no slower here (40 us against 63).
        options.enable_cpu_mem_arena = False
        # Every session below, the probes of _threads and _start_cuda included, takes these.
        spin = "1" if spinning else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        options.add_session_config_entry("session.inter_op.allow_spinning", spin)
        providers = choose_providers(device)
        self.fallback = ""  # why CUDA was asked for and the CPU serves ("" if it was not)
        if device == "auto" and CUDA not in providers and gpu.device_count() > 0:
            self.fallback = (
                "this onnxruntime build has no CUDA provider (pip install 'sluice[gpu]')"
            )
            log.warning("%s: a GPU is here, serving on the CPU: %s", path.name, self.fallback)
        if CUDA in providers:
            options.intra_op_num_threads = intra_op_threads or 1  # the GPU parallelises
            self.fallback = _start_cuda(path, options, cuda_options or {})
            if self.fallback:
                if device == "cuda":
                    raise Unavailable(f"--device cuda, but {self.fallback}")
                log.warning("%s: CUDA asked for, serving on the CPU: %s", path.name, self.fallback)
                providers = [CPU]
                options.intra_op_num_threads = intra_op_threads or 0
        if intra_op_threads is None:
            options.intra_op_num_threads = self._threads(path, options, providers)
        self.intra_op_threads = options.intra_op_num_threads
        on_cuda = CUDA in providers
        # On CUDA the CPU arena holds only small host-side buffers, and without it each run
        # of a ResNet-50 took 0.5 ms longer on an H200 (docs/BENCHMARKS.md, section 11).
        options.enable_cpu_mem_arena = on_cuda or arena
        self.arena = options.enable_cpu_mem_arena
        allocator = gpu.pinned_allocator() if on_cuda and pinned else None
        self.pinned = allocator is not None
        self.max_batch = max_batch

        def session_on(stream: Any) -> ort.InferenceSession:
            chosen: list[Any] = list(providers)
            if not on_cuda:
                return _session(path, options, chosen)
            handle = {"user_compute_stream": str(stream[1])} if stream else {}
            chosen[0] = (CUDA, {**(cuda_options or {}), **handle})
            try:
                session = _session(path, options, chosen)
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise Unavailable(
                    f"a CUDA session of {path.name} failed to start: {first} (each instance "
                    "holds a copy of the model per padded batch size: lower --instances or "
                    "--max-batch if the GPU's memory ran out)"
                ) from None
            if session.get_providers()[0] != CUDA:
                raise Unavailable(f"ONNX Runtime put a session of {path.name} on the CPU")
            return session

        streams = [gpu.new_stream() if on_cuda else None for _ in range(instances)]
        sessions = [(session_on(stream), stream) for stream in streams]
        first = sessions[0][0]
        self.provider = first.get_providers()[0]
        self.name = first.get_modelmeta().graph_name or path.stem
        self.inputs = [_spec(a) for a in first.get_inputs()]
        self.outputs = [_spec(a) for a in first.get_outputs()]
        # Requests batch along the first dimension only if every input and output has it.
        self.batchable = all(s.shape and s.shape[0] is None for s in self.inputs + self.outputs)
        self.staged = stage if stage is not None else on_cuda
        self.padded = self.staged and self.batchable
        self.pool = BufferPool(
            pool_bytes, allocator or numpy_allocator, keep_bytes=self._full_batch_bytes()
        )
        # On CUDA, ONNX Runtime re-plans a session whenever its input shape changes: ~110 ms
        # a change for a ResNet-50 on an H200, whatever the cuDNN search mode, so batches of
        # changing sizes ran at 55 calls/s where single requests ran at 610. Each padded
        # batch size above 1 gets a session of its own, which only ever sees that shape.
        sizes = self.warm_rows()[1:] if on_cuda and not lengths else []
        inline_max_s = 0.0 if on_cuda else inline_max_s
        row_seconds = self._row_seconds(first, inline_max_s)
        position_seconds = (
            self._position_seconds(first, inline_max_s, row_seconds) if lengths else 0.0
        )
        # Made only once the model is known to load: a refused one leaves no threads behind.
        self.executor = ThreadPoolExecutor(instances, thread_name_prefix="sluice-run")
        self.instances = [
            Instance(
                i,
                session,
                pool=self.pool,
                executor=self.executor,
                output_specs=self.outputs,
                stage_always=self.staged,
                batchable=self.batchable,
                inline_max_s=inline_max_s,
                row_seconds=row_seconds,
                position_seconds=position_seconds,
                shrink=arena and not on_cuda,
                stream=stream,
                by_rows={rows: session_on(stream) for rows in sizes},
                spill=functools.partial(session_on, stream) if on_cuda and self.padded else None,
            )
            for i, (session, stream) in enumerate(sessions)
        ]
        log.info(
            "loaded %s (%s) on %s x%d%s; inputs %s; outputs %s",
            path.name,
            self.name,
            self.provider,
            instances,
            (" with pinned staging buffers" if self.pinned else "")
            + (f", a session per batch size {sizes}" if sizes else ""),
            ", ".join(f"{s.name} {s.describe()}" for s in self.inputs),
            ", ".join(f"{s.name} {s.describe()}" for s in self.outputs),
        )
        if on_cuda and not self.pinned and pinned:
            log.warning("no CuPy: pageable staging memory, ORT's own streams (sluice[gpu])")

    def warm_rows(self, max_rows: int | None = None) -> list[int]:
        """The batch sizes to run once per instance before serving: each padded size up to
        `max_rows` (default: max_batch) where batches are padded (each new shape costs CUDA
        a re-plan and cuDNN's algorithm search, and the pool a staging buffer), else one."""
        if not self.padded:
            return [1]
        return [1 << i for i in range(bucket(max_rows or self.max_batch).bit_length())]

    def _full_batch_bytes(self) -> int:
        """The largest staging buffer a full padded batch takes (0 when not padded)."""
        if not self.padded:
            return 0
        rows = bucket(self.max_batch)
        return max(
            (
                rows * math.prod(d for d in s.shape[1:] if d is not None) * s.dtype.itemsize
                for s in self.inputs + self.outputs
                if all(d is not None for d in s.shape[1:])
            ),
            default=0,
        )

    def _row_seconds(self, session: ort.InferenceSession, inline_max_s: float) -> float:
        """What a run costs per row, measured now on a batch of one (every instance runs the
        same model), for the inline decision: infinite when nothing runs inline."""
        if inline_max_s <= 0:
            return math.inf
        try:
            # Ten times the bound in timed runs tells a model far too slow from one run.
            return run_seconds(session, zeros(self.inputs), budget_s=10 * inline_max_s)
        except Exception:  # the warm-up run says what is wrong, in its words
            return math.inf

    def _position_seconds(
        self, session: ort.InferenceSession, inline_max_s: float, row_seconds: float
    ) -> float:
        """What a position of a padded input adds to a run, past the first: a run at
        MEASURED_LENGTH against the run of length 1 (`row_seconds`), for the inline decision
        (infinite when nothing runs inline, or the run fails)."""
        if not math.isfinite(row_seconds):
            return math.inf
        try:
            longer = run_seconds(
                session, zeros(self.inputs, length=MEASURED_LENGTH), budget_s=10 * inline_max_s
            )
        except Exception:  # the warm-up run says what is wrong, in its words
            return math.inf
        return max(0.0, longer - row_seconds) / (MEASURED_LENGTH - 1)

    @staticmethod
    def _threads(path: Path, options: ort.SessionOptions, providers: list[str]) -> int:
        """Intra-op threads for this model on the CPU: 1, unless a batch-of-one run takes
        PARALLEL_FROM_S or more and more threads (up to the cores, MAX_AUTO_THREADS) make
        it faster. On CUDA the GPU parallelises: 1."""
        cores = min(os.cpu_count() or 1, MAX_AUTO_THREADS)
        if CUDA in providers or cores < 2:
            return 1
        options.intra_op_num_threads = 1
        try:
            probe = ort.InferenceSession(str(path), options, providers=[CPU])
            inputs = zeros([_spec(a) for a in probe.get_inputs()])
            one = run_seconds(probe, inputs)
            if one < PARALLEL_FROM_S:
                return 1
            options.intra_op_num_threads = cores
            many = run_seconds(ort.InferenceSession(str(path), options, providers=[CPU]), inputs)
        except Exception:  # the load or its check run says what is wrong, in its words
            return 1
        chosen = cores if many < one * 0.9 else 1
        log.info(
            "%s: a batch of one takes %.2f ms on 1 thread, %.2f ms on %d: %d intra-op threads",
            path.name,
            one * 1000,
            many * 1000,
            cores,
            chosen,
        )
        return chosen

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    @property
    def platform(self) -> str:
        return f"onnxruntime {ort.__version__}"
