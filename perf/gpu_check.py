"""GPU check, for a machine with an NVIDIA GPU (scripts/gpu-check installs what it needs and
runs it). Asserts, on a ResNet-50 (perf/make_resnet.py, dynamic batch) and a wide MLP:

1. every node runs on CUDA (ONNX Runtime's CPU fallback disabled for the check);
2. `--device cuda` loads on CUDA with no fallback; each instance's `user_compute_stream` is
   registered with its session; staging memory is page-locked (a pageable array, checked the
   same way, is not);
3. two instances run at once, and batches through the staged, padded path equal ONNX Runtime
   on the CPU.

Then measures, one run: ONNX Runtime alone at batch 1 (session.run; IO binding with
pageable memory; IO binding with pinned memory); the per-call overhead of a server on the
CPU (a model as cheap as possible with the same 602 KB input: server p50 - ORT p50); the
server on the GPU at concurrency 1 (a plain client loop) and 32 (the sweep), 1 against 2
instances, pinned against pageable staging, and the micro-batcher. Exits 1 when a check
fails; prints and writes (--out) a JSON summary.

`--device cpu` runs the same script on the CPU (checks of CUDA skipped, small images), to
try it where there is no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort

from perf import make_mlp, make_pool, make_resnet, paired
from perf.launch import module_argv, running
from sluice.perf.sweep import request_body
from sluice.server.dataplane import gpu
from sluice.server.dataplane.batcher import Pending
from sluice.server.dataplane.engine import CPU, CUDA, Engine, zeros
from sluice.v1 import inference_pb2 as pb

PREDICT = "/sluice.v1.Inference/Predict"
NHWC = {"prefer_nhwc": "1"}  # cuDNN's channels-last kernels: an option worth measuring
# glibc keeps up to 128 MiB of freed heap instead of its default 128 KiB: a 602 KB request's
# blocks are then reused rather than faulted in afresh each call (README, "On a GPU").
KEEP_HEAP = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=134217728"}


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, condition: bool, what: str) -> bool:
        print(("ok    " if condition else "FAIL  ") + what, flush=True)
        if not condition:
            self.failures.append(what)
        return condition


def environment() -> dict[str, Any]:
    try:
        import cupy

        cupy_version = str(cupy.__version__)
    except Exception as exc:
        cupy_version = f"unavailable: {exc}"
    return {
        "onnxruntime": ort.__version__,
        "built_for_cuda": gpu.cuda_major(),
        "providers": ort.get_available_providers(),
        "gpus": gpu.device_count(),
        "missing_libraries": list(gpu.missing_libraries()),
        "cupy": cupy_version,
    }


# -- checks -----------------------------------------------------------------------------------


def all_nodes_on_cuda(model: Path, check: Checks) -> None:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        ort.InferenceSession(str(model), options, providers=[CUDA])
        placed = ""
    except Exception as exc:
        placed = str(exc).splitlines()[0]
    check(not placed, f"{model.name}: every node on CUDA (CPU fallback disabled) {placed}")


def streams_and_memory(engine: Engine, check: Checks) -> None:
    name = engine.name
    check(engine.provider == CUDA and not engine.fallback, f"{name}: on CUDA, no fallback")
    check(engine.staged and engine.pinned, f"{name}: staged through pinned buffers")
    handles = []
    for instance in engine.instances:
        handle = instance.stream[1] if instance.stream else None
        handles.append(handle)
        sessions = {1: instance.session, **instance.by_rows}
        for rows, session in sessions.items():
            options = session.get_provider_options().get(CUDA, {})
            check(
                handle is not None
                and session.get_providers()[0] == CUDA
                and options.get("has_user_compute_stream") == "1"
                and options.get("user_compute_stream") == str(handle),
                f"{name}: instance {instance.index}, batch size {rows}: on CUDA, on the "
                f"instance's stream {handle} (session says {options.get('user_compute_stream')})",
            )
    check(len(set(handles)) == len(handles), f"{name}: one stream per instance")
    buffer = engine.pool.take(np.dtype(np.float32), (3, 8, 8), 1)
    check(gpu.is_pinned(buffer), f"{name}: staging buffers are page-locked")
    engine.pool.give(buffer)
    check(not gpu.is_pinned(np.empty(4096, np.uint8)), "a pageable array is seen as pageable")


def concurrent_and_equal(
    engine: Engine, model: Path, shape: tuple[int, ...], tolerance: float, check: Checks
) -> None:
    """Both instances at once on their own inputs, then the staged, padded batch path; each
    against ONNX Runtime on the CPU."""
    cpu = ort.InferenceSession(str(model), providers=[CPU])
    name = engine.inputs[0].name
    outputs = [s.name for s in engine.outputs]
    rng = np.random.default_rng(0)

    def close(got: np.ndarray, want: np.ndarray) -> bool:
        scale = float(np.abs(want).max()) or 1.0
        return bool(np.allclose(got, want, rtol=tolerance, atol=tolerance * scale))

    def timed(instance: Any, x: np.ndarray) -> tuple[float, float, dict[str, np.ndarray]]:
        started = time.perf_counter()
        results, pooled = instance.run_sync({name: x}, outputs, len(x))
        ended = time.perf_counter()
        owned = {k: v.copy() for k, v in results.items()}
        for buffer in pooled:
            engine.pool.give(buffer)
        return started, ended, owned

    overlapped = False
    for attempt in range(10):
        xs = [rng.uniform(0, 1, (8, *shape)).astype(np.float32) for _ in engine.instances]
        futures: list[Future[Any]] = [
            engine.executor.submit(timed, instance, x)
            for instance, x in zip(engine.instances, xs, strict=True)
        ]
        done = [f.result() for f in futures]
        overlapped = overlapped or max(d[0] for d in done) < min(d[1] for d in done)
        if attempt == 0:
            for i, (x, (_, _, got)) in enumerate(zip(xs, done, strict=True)):
                want = cpu.run(outputs, {name: x})
                ok = all(close(got[o], w) for o, w in zip(outputs, want, strict=True))
                check(ok, f"{model.name}: instance {i}, run at once with the other, equals CPU")
    check(overlapped, f"{model.name}: the {len(engine.instances)} instances' runs overlapped")

    async def batched() -> None:
        parts = [rng.uniform(0, 1, (n, *shape)).astype(np.float32) for n in (1, 3, 2)]
        batch = [Pending({name: p}, tuple(outputs), len(p), "g", 0.0) for p in parts]
        for instance in engine.instances:
            results = await instance.run(batch)  # 6 rows, padded to 8
            for part, result in zip(parts, results, strict=True):
                want = cpu.run(outputs, {name: part})
                ok = all(close(result[o], w) for o, w in zip(outputs, want, strict=True))
                check(ok, f"{model.name}: instance {instance.index} batch rows={len(part)}")

    asyncio.run(batched())


# -- measurements -----------------------------------------------------------------------------


def first_runs(engine: Engine, max_rows: int) -> dict[int, list[float]]:
    """Per padded batch size, instance 0's first run on that size's session (planning and
    cuDNN's algorithm search: what warming each size at load spares a request) and its next
    run, in ms."""
    instance = engine.instances[0]
    names = [s.name for s in engine.outputs]
    found = {}
    for rows in engine.warm_rows(max_rows):
        inputs = zeros(engine.inputs, rows)
        times = []
        for _ in range(2):
            started = time.perf_counter()
            _, pooled = instance.run_sync(inputs, names, rows)
            times.append((time.perf_counter() - started) * 1e3)
            for buffer in pooled:
                engine.pool.give(buffer)
        found[rows] = times
    return found


def timings(run: Callable[[], object], count: int) -> dict[str, float]:
    for _ in range(max(count // 10, 5)):
        run()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    times.sort()
    return {
        "p50_ms": times[len(times) // 2] * 1e3,
        "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
    }


def ort_alone(
    model: Path, x: np.ndarray, device: str, count: int, cuda_options: dict[str, str] | None = None
) -> dict[str, Any]:
    """ONNX Runtime by itself at batch 1, three ways (two without CUDA)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    providers: list[Any] = [(CUDA, cuda_options or {}), CPU] if device == "cuda" else [CPU]
    session = ort.InferenceSession(str(model), options, providers=providers)
    name, output = session.get_inputs()[0].name, session.get_outputs()[0].name
    out_shape = (len(x), *session.get_outputs()[0].shape[1:])
    found: dict[str, Any] = {
        "session_run": timings(lambda: session.run([output], {name: x}), count)
    }

    def bound(inp: np.ndarray, out: np.ndarray) -> Callable[[], object]:
        binding = session.io_binding()
        binding.bind_input(name, "cpu", 0, inp.dtype, inp.shape, inp.ctypes.data)
        binding.bind_output(output, "cpu", 0, out.dtype, out.shape, out.ctypes.data)
        return lambda: session.run_with_iobinding(binding)

    pageable_out = np.empty(out_shape, np.float32)
    found["iobinding_pageable"] = timings(bound(x, pageable_out), count)
    allocate = gpu.pinned_allocator() if device == "cuda" else None
    if allocate is not None:
        pinned_in = allocate(x.nbytes).view(np.float32).reshape(x.shape)
        pinned_in[...] = x
        pinned_out = allocate(pageable_out.nbytes).view(np.float32).reshape(out_shape)
        found["iobinding_pinned"] = timings(bound(pinned_in, pinned_out), count)
    found["best_p50_ms"] = min(v["p50_ms"] for v in found.values())
    return found


def engine_batch1(engine: Engine, x: np.ndarray, count: int) -> dict[str, float]:
    """One request at a time through instance 0 as the server runs it (staged, from the
    event loop to a runner thread), without gRPC: the engine's share of a call."""
    outputs = tuple(s.name for s in engine.outputs)
    name = engine.inputs[0].name
    loop = asyncio.new_event_loop()
    try:
        instance = engine.instances[0]
        return timings(
            lambda: loop.run_until_complete(
                instance.run([Pending({name: x}, outputs, 1, "g", 0.0)])
            ),
            count,
        )
    finally:
        loop.close()


def client_loop(address: str, body: bytes, count: int) -> dict[str, float]:
    """Concurrency 1 with the least client work: one channel, the body pre-serialized."""
    with grpc.insecure_channel(
        address,
        options=[("grpc.max_receive_message_length", 64 << 20)],
    ) as channel:
        call = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        return timings(lambda: call(body, timeout=30), count)


def server_argv(model: Path, node: str, *extra: str) -> list[str]:
    return module_argv(
        "sluice.server.main",
        *("--model", str(model), "--port", "0", "--node-id", node, "--cache-entries", "0"),
        *extra,
    )


def serve(
    model: Path,
    configs: dict[str, tuple[list[str], dict[str, str]]],
    npy: Path,
    body: bytes,
    count: int,
    duration: str,
    concurrency: int = 32,
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    with ExitStack() as stack:
        targets = {}
        for label, (extra, env) in configs.items():
            started = time.perf_counter()
            # A GPU server warms each padded batch size per instance before it listens.
            argv = server_argv(model, label, *extra)
            proc = stack.enter_context(running(argv, start_s=180, env=env))
            targets[label] = proc.address
            found[label] = {"start_s": time.perf_counter() - started}
        for label, address in targets.items():
            found[label]["c1"] = client_loop(address, body, count)
        runs = paired.rounds(
            targets,
            ["-c", str(concurrency), "-z", duration, "--warmup", "1s", "--procs", "4",
             "--data", str(npy)],
            1,
            "gpu-check",
        )  # fmt: skip
        for label, r in runs.items():
            level = r[0]["levels"][0]
            found[label][f"c{concurrency}"] = {
                "throughput": level["throughput"],
                "p50_ms": level["latency"]["p50"],
                "p99_ms": level["latency"]["p99"],
                "errors": level["calls"] - level["ok"],
            }
            found[label]["health"] = health(targets[label])
    return found


def health(address: str) -> dict[str, Any]:
    """What the server says of its batches and staging buffers after the runs."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            "/sluice.v1.Inference/Health", request_serializer=None, response_deserializer=None
        )
        reply = pb.HealthResponse.FromString(call(pb.HealthRequest().SerializeToString()))
    return {
        "provider": reply.provider,
        "fallback": reply.fallback,
        "mean_batch": reply.batcher.mean_batch_size,
        "batches": reply.batcher.batches,
        "pinned": reply.buffers.pinned,
        "buffers_allocated": reply.buffers.allocated,
        "buffers_reused": reply.buffers.reused,
        "buffers_dropped": reply.buffers.dropped,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.gpu_check", description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--image", type=int, default=0, help="ResNet input size (224; cpu 64)")
    parser.add_argument("--duration", default="5s", help="time per concurrency-32 level")
    parser.add_argument("--count", type=int, default=500, help="timed calls at concurrency 1")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    check = Checks()
    device = args.device
    image = args.image or (224 if device == "cuda" else 64)
    result: dict[str, Any] = {"environment": environment(), "device": device, "image": image}
    print(json.dumps(result["environment"]), flush=True)

    def section(name: str, step: Callable[[], object]) -> bool:
        """One part of the check: a failure is recorded and the rest still runs; what is
        known so far is saved after each, so a run cut short still leaves its figures."""
        started = time.perf_counter()
        try:
            step()
            ok = True
        except Exception as exc:
            check(False, f"{name}: {type(exc).__name__}: {exc}")
            ok = False
        result.setdefault("section_s", {})[name] = time.perf_counter() - started
        result["failures"] = check.failures
        if args.out:
            paired.save(result, args.out)
        return ok

    if device == "cuda" and not check(
        CUDA in ort.get_available_providers() and gpu.device_count() > 0,
        "a CUDA build of onnxruntime and a GPU",
    ):
        print(paired.save({**result, "failures": check.failures}, args.out))
        return 1
    resnet = make_resnet.cached(image)
    mlp = make_mlp.cached(width=4096 if device == "cuda" else 256, depth=2)
    folder = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))
    x = np.random.default_rng(1).uniform(0, 1, (1, 3, image, image)).astype(np.float32)
    npy = folder / "input.npy"
    np.save(npy, x)
    body = request_body(x, "input", "predict", "")

    def placement() -> None:
        for model in (resnet, mlp):
            all_nodes_on_cuda(model, check)

    def instances() -> None:
        started = time.perf_counter()
        engine = Engine(resnet, device=device, instances=2, stage=True, max_batch=32)
        result["resnet_load_s"] = time.perf_counter() - started
        try:
            if device == "cuda":
                streams_and_memory(engine, check)
            result["resnet_first_and_next_run_ms_by_rows"] = first_runs(engine, 32)
            result["engine_batch1"] = engine_batch1(engine, x, args.count)
            concurrent_and_equal(engine, resnet, (3, image, image), 2e-2, check)
        finally:
            engine.close()
        heavy = Engine(mlp, device=device, instances=2, stage=True)
        try:
            concurrent_and_equal(heavy, mlp, (64,), 2e-2, check)  # TF32 matmuls on recent GPUs
        finally:
            heavy.close()

    def alone() -> None:
        result["ort_alone_batch1"] = ort_alone(resnet, x, device, args.count)
        if device == "cuda":
            result["ort_alone_batch1_nhwc"] = ort_alone(resnet, x, device, args.count, NHWC)

    def overhead() -> None:
        pool = make_pool.cached(image)
        ort_p50 = ort_alone(pool, x, "cpu", args.count)["session_run"]["p50_ms"]
        cpu = ["--device", "cpu"]
        served = serve(
            pool, {"cpu": (cpu, {}), "cpu_keepheap": (cpu, KEEP_HEAP)}, npy, body, args.count,
            args.duration,
        )  # fmt: skip
        with running(module_argv("perf.echo_server", "--port", "0")) as echo:
            floor = client_loop(echo.address, body, args.count)
        result["cpu_overhead"] = {
            "echo_floor_c1": floor,
            "ort_p50_ms": ort_p50,
            "server": served["cpu"],
            "server_keepheap": served["cpu_keepheap"],
            "overhead_p50_ms": served["cpu"]["c1"]["p50_ms"] - ort_p50,
            "overhead_keepheap_p50_ms": served["cpu_keepheap"]["c1"]["p50_ms"] - ort_p50,
        }

    def servers() -> None:
        pageable = ["--pinned-staging", "false"]
        configs = {
            "i1_pinned": (["--instances", "1"], {}),
            "i2_pinned": (["--instances", "2"], {}),
            "i1_pageable": (["--instances", "1", *pageable], {}),
            "i2_pageable": (["--instances", "2", *pageable], {}),
            "i2_batched32": (["--instances", "2", "--max-batch", "32"], {}),
            "i1_pinned_keepheap": (["--instances", "1"], KEEP_HEAP),
            "i2_pinned_keepheap": (["--instances", "2"], KEEP_HEAP),
        }
        flag = ["--device", device]
        result["server"] = serve(
            resnet, {k: ([*flag, *v], env) for k, (v, env) in configs.items()}, npy, body,
            args.count, args.duration,
        )  # fmt: skip
        errors = sum(v["c32"]["errors"] for v in result["server"].values())
        check(errors == 0, f"server runs: {errors} failed calls")

    if device == "cuda":
        section("placement", placement)
    if not section("instances", instances):
        print(paired.save(result, args.out))
        return 1
    section("ort_alone", alone)
    section("cpu_overhead", overhead)
    section("servers", servers)
    if "server" in result and "cpu_overhead" in result and "ort_alone_batch1" in result:
        best = result["ort_alone_batch1"]["best_p50_ms"]
        result["goal"] = {}
        for heap, suffix in (("default", ""), ("keepheap", "_keepheap")):
            cost = result["cpu_overhead"][f"overhead{suffix}_p50_ms"]
            p50 = result["server"][f"i1_pinned{suffix}"]["c1"]["p50_ms"]
            result["goal"][heap] = {
                "server_c1_p50_ms": p50,
                "ort_best_p50_ms": best,
                "cpu_overhead_p50_ms": cost,
                "bound_ms": min(2.0, best + cost),
                "met": p50 <= 2.0 and p50 <= best + cost,
            }
    result["failures"] = check.failures
    print(paired.save(result, args.out))
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
