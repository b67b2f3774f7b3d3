"""Shared memory through a real sluice-balancer with --shared-memory, a sidecar on the
caller's host, in front of a real sluice-server that takes none: a grpc.aio client with the
generated stubs registers POSIX shared memory objects in /dev/shm with the balancer, and
Predict (sluice.v1) and ModelInfer (KServe) with their input and outputs in them answer as
ONNX Runtime does, on the digits model and on a 1x3x224x224 image (a 602 KB input); Triton's
own client finds what it finds at a server with --shared-memory. A balancer without the
flag refuses the region calls naming it. Every object is unlinked, whatever happens."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from perf import make_pool
from sluice import models
from sluice.client import SluiceClient
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from sluice.shm import client as client_shm
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import SAMPLES
from tests.e2e import test_tritonclient_shm_e2e as at_a_server
from tests.e2e.harness import BIN, Process, running, server_argv
from tests.e2e.test_tritonclient_e2e import tritonclient_python

pytestmark = pytest.mark.e2e

SHM = "/dev/shm"
TIMEOUT_S = 30  # a call on this machine takes milliseconds: the bound only guards a hang
DIGITS = np.concatenate([s.input for s in SAMPLES[:5]])  # FP32 [5, 64]
Parameter = kpb.InferParameter


@dataclass
class Region:
    """A POSIX shared memory object of the caller's, mapped: its key and its bytes."""

    key: str
    map: mmap.mmap

    def write(self, array: np.ndarray) -> None:
        self.map[: array.nbytes] = array.tobytes()

    def read(self, dtype: type[np.generic], shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        count = int(np.prod(shape))
        return np.frombuffer(self.map, dtype, count, offset).reshape(shape).copy()


def region(stack: ExitStack, name: str, size: int) -> Region:
    """A new object of `size` bytes, unmapped and unlinked when `stack` closes."""
    key = f"/sluice-test-{os.getpid()}-{name}"
    path = SHM + key
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    stack.callback(os.unlink, path)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    stack.callback(mapped.close)
    return Region(key, mapped)


@pytest.fixture(scope="module")
def balancer() -> Iterator[Process]:
    """A balancer with --shared-memory before a server of both models without it."""
    pool = make_pool.cached(224)
    argv = server_argv("--model", f"digits={models.DIGITS}", "--model", f"pool={pool}")
    with running(argv) as server:
        argv = [str(BIN / "sluice-balancer"), "--port", "0", "--backend", server.address]
        with running([*argv, "--node-id", "test-balancer", "--shared-memory"]) as proc:
            yield proc


@pytest.fixture(scope="module")
def pool_reference() -> ort.InferenceSession:
    return ort.InferenceSession(str(make_pool.cached(224)), providers=["CPUExecutionProvider"])


def ref(key_region: str, nbytes: int) -> pb.SharedMemoryRef:
    return pb.SharedMemoryRef(region=key_region, byte_size=nbytes)


async def predict_in_regions(
    address: str, model: str, x: np.ndarray, outputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Predict through the balancer with `x` and `outputs` (shaped as ONNX Runtime answers)
    in regions of their own; the outputs as the regions hold them."""
    with ExitStack() as stack:
        places = {"input": x, **outputs}
        held = {name: region(stack, name, a.nbytes) for name, a in places.items()}
        held["input"].write(x)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for name, r in held.items():
                registered = pb.RegisterRegionRequest(
                    name=name, key=r.key, byte_size=places[name].nbytes
                )
                await stub.RegisterRegion(registered, timeout=TIMEOUT_S)
            try:
                request = pb.PredictRequest(
                    model=model,
                    inputs=[
                        pb.Tensor(
                            name="input",
                            datatype="FP32",
                            shape=x.shape,
                            shared_memory=ref("input", x.nbytes),
                        )
                    ],
                    output_memory={n: ref(n, a.nbytes) for n, a in outputs.items()},
                )
                response = await stub.Predict(request, timeout=TIMEOUT_S)
            finally:
                await stub.UnregisterRegion(pb.UnregisterRegionRequest(), timeout=TIMEOUT_S)
        got = {}
        for tensor in response.outputs:
            want = outputs[tensor.name]
            assert tensor.shared_memory == ref(tensor.name, want.nbytes)
            assert not tensor.raw_data
            assert tuple(tensor.shape) == want.shape
            got[tensor.name] = held[tensor.name].read(want.dtype.type, want.shape)
        return got


async def infer_in_regions(
    address: str, model: str, x: np.ndarray, outputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """ModelInfer through the balancer, its input and outputs in one region at offsets,
    Triton's way (the system shared memory calls, the tensors' parameters)."""
    with ExitStack() as stack:
        arrays = {"input": x, **outputs}
        offsets, at = {}, 0
        for name, array in arrays.items():
            offsets[name] = at
            at += -(-array.nbytes // 64) * 64
        held = region(stack, "infer", at)
        held.map[: x.nbytes] = x.tobytes()

        def placed(name: str) -> dict[str, Parameter]:
            return {
                "shared_memory_region": Parameter(string_param="infer"),
                "shared_memory_offset": Parameter(int64_param=offsets[name]),
                "shared_memory_byte_size": Parameter(int64_param=arrays[name].nbytes),
            }

        async with grpc.aio.insecure_channel(address) as channel:
            stub = kpb_grpc.GRPCInferenceServiceStub(channel)
            await stub.SystemSharedMemoryRegister(
                kpb.SystemSharedMemoryRegisterRequest(name="infer", key=held.key, byte_size=at),
                timeout=TIMEOUT_S,
            )
            try:
                listed = await stub.SystemSharedMemoryStatus(
                    kpb.SystemSharedMemoryStatusRequest(), timeout=TIMEOUT_S
                )
                assert {n: s.key for n, s in listed.regions.items()} == {"infer": held.key}
                request = kpb.ModelInferRequest(
                    model_name=model,
                    inputs=[
                        kpb.ModelInferRequest.InferInputTensor(
                            name="input", datatype="FP32", shape=x.shape, parameters=placed("input")
                        )
                    ],
                    outputs=[
                        kpb.ModelInferRequest.InferRequestedOutputTensor(
                            name=n, parameters=placed(n)
                        )
                        for n in outputs
                    ],
                )
                response = await stub.ModelInfer(request, timeout=TIMEOUT_S)
            finally:
                await stub.SystemSharedMemoryUnregister(
                    kpb.SystemSharedMemoryUnregisterRequest(), timeout=TIMEOUT_S
                )
        assert [o.name for o in response.outputs] == list(outputs)
        assert list(response.raw_output_contents) == [b""] * len(outputs)  # Triton's shape
        got = {}
        for tensor in response.outputs:
            want = outputs[tensor.name]
            assert tuple(tensor.shape) == want.shape
            got[tensor.name] = held.read(want.dtype.type, want.shape, offsets[tensor.name])
        return got


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array)


async def test_the_digits_model_answers_in_regions_as_onnxruntime(
    balancer: Process, reference: ort.InferenceSession
) -> None:
    label, probabilities = reference.run(None, {"input": DIGITS})
    want = {"label": label, "probabilities": probabilities}
    assert_same(await predict_in_regions(balancer.address, "digits", DIGITS, want), want)
    assert_same(await infer_in_regions(balancer.address, "digits", DIGITS, want), want)


async def test_a_602_kb_image_answers_in_regions_as_onnxruntime(
    balancer: Process, pool_reference: ort.InferenceSession
) -> None:
    rng = np.random.default_rng(7)
    for _ in range(2):
        image = rng.standard_normal((1, 3, 224, 224), dtype=np.float32)
        assert image.nbytes == 602112
        (output,) = pool_reference.run(None, {"input": image})
        want = {"output": output}
        assert_same(await predict_in_regions(balancer.address, "pool", image, want), want)
        assert_same(await infer_in_regions(balancer.address, "pool", image, want), want)


def test_the_sluice_client_with_shared_memory_answers_through_the_balancer(
    balancer: Process,
) -> None:
    mine = f"{client_shm.PREFIX}{os.getpid()}-"  # not another pid that begins with ours
    with (
        SluiceClient(balancer.address) as plain,
        SluiceClient(balancer.address, shared_memory=True) as client,
    ):
        for rows in (1, 1, 5):  # the first answer of a shape sizes its outputs' room
            want = plain.predict({"input": DIGITS[:rows]}, model="digits")
            got = client.predict({"input": DIGITS[:rows]}, model="digits")
            assert_same(got, want)
    assert not [n for n in os.listdir(SHM) if n.startswith(mine)]  # its objects are gone


def test_tritons_own_client_finds_what_it_finds_at_a_server(
    balancer: Process, reference: ort.InferenceSession, tmp_path: Path
) -> None:
    """tritonclient and its shared memory utilities, unmodified, through the balancer: the
    same checks as at a server with --shared-memory (regions, an inference in them, Triton's
    refusals, unregistering, the sweep of an object its caller unlinked)."""
    at_a_server.test_tritonclient_shared_memory(
        balancer, tritonclient_python(), reference, tmp_path
    )


async def test_a_region_the_caller_never_registered_is_refused(balancer: Process) -> None:
    async with grpc.aio.insecure_channel(balancer.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.PredictRequest(
            model="digits",
            inputs=[
                pb.Tensor(
                    name="input", datatype="FP32", shape=[1, 64], shared_memory=ref("nope", 256)
                )
            ],
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Predict(request, timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "tensor 'input': Unable to find shared memory region: 'nope'"


async def test_a_balancer_without_the_flag_says_which_flag() -> None:
    argv = [str(BIN / "sluice-balancer"), "--port", "0", "--backend", "127.0.0.1:1"]
    tensor = pb.Tensor(
        name="input", datatype="FP32", shape=[1, 64], shared_memory=ref("input", 256)
    )
    with running(argv, serving=False) as off:
        async with grpc.aio.insecure_channel(off.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegionStatus(pb.RegionStatusRequest(), timeout=TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as named:
                await stub.Predict(pb.PredictRequest(inputs=[tensor]), timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert named.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for failed in (refused, named):
        assert "start sluice-balancer with --shared-memory" in (failed.value.details() or "")
