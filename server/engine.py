"""ONNX Runtime engine: loads a model, picks the execution provider, checks and runs inputs.

Transport-free: takes and returns numpy arrays, raises `server.errors` exceptions.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument as OrtInvalidArgument

from server.errors import InvalidInput, ModelFailed, Unavailable
from sluice.datatypes import DATATYPES, name_of

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
    """A model input or output; None in `shape` is a dynamic dimension."""

    name: str
    datatype: str
    shape: tuple[int | None, ...]

    @property
    def dtype(self) -> np.dtype[np.generic]:
        return DATATYPES[self.datatype].dtype

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
    return TensorSpec(arg.name, datatype, shape)


def cuda_device_count() -> int:
    """GPUs the CUDA driver can see, without touching ONNX Runtime (so no log noise)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def choose_providers(device: str) -> list[str]:
    """Providers to ask ONNX Runtime for. `auto` asks for CUDA only if a GPU is present."""
    if device == "cpu":
        return [CPU]
    has_cuda_build = CUDA in ort.get_available_providers()
    if device == "cuda":
        if not has_cuda_build:
            raise Unavailable("--device cuda, but this onnxruntime build has no CUDA provider")
        return [CUDA, CPU]
    return [CUDA, CPU] if has_cuda_build and cuda_device_count() > 0 else [CPU]


class Engine:
    """One model loaded into ONNX Runtime. `run` is thread-safe and releases the GIL."""

    def __init__(self, model_path: str | Path, *, device: str = "auto", intra_op_threads: int = 1):
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"model file {str(path)!r} does not exist")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only: CUDA probing warnings are not news.
        providers = choose_providers(device)
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        self.provider = self.session.get_providers()[0]
        if device == "cuda" and self.provider != CUDA:
            raise Unavailable(
                "--device cuda, but ONNX Runtime could not start its CUDA provider "
                "(check the driver and the CUDA and cuDNN libraries)"
            )
        self.name = self.session.get_modelmeta().graph_name or path.stem
        self.inputs = [_spec(a) for a in self.session.get_inputs()]
        self.outputs = [_spec(a) for a in self.session.get_outputs()]
        self._inputs_by_name = {s.name: s for s in self.inputs}
        self._output_names = [s.name for s in self.outputs]
        log.info(
            "loaded %s (%s) on %s; inputs %s; outputs %s",
            path.name,
            self.name,
            self.provider,
            ", ".join(f"{s.name} {s.describe()}" for s in self.inputs),
            ", ".join(f"{s.name} {s.describe()}" for s in self.outputs),
        )

    @property
    def platform(self) -> str:
        return f"onnxruntime {ort.__version__}"

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

    def check_outputs(self, names: Sequence[str]) -> list[str]:
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

    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Run the model on checked inputs."""
        try:
            results = self.session.run(list(outputs), dict(inputs))
        except OrtInvalidArgument as exc:
            raise InvalidInput(f"the model rejected the input: {exc}") from None
        except Exception as exc:  # any other ONNX Runtime failure is ours, not the caller's
            raise ModelFailed(f"the model failed to run: {exc}") from None
        return dict(zip(outputs, results, strict=True))
