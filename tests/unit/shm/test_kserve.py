"""Triton's system shared memory extension on the KServe face, with real POSIX shared memory
objects in /dev/shm and the bundled model: inputs read as views of a region, outputs written
into one (ONNX Runtime's answers), kept out of the cache; the registration calls and every
refusal, each its status and words, through a grpc.aio server on this loop."""

from __future__ import annotations

import asyncio
import functools
import itertools
import mmap
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from sluice.core.errors import InvalidInput, SluiceError
from sluice.core.tenants import digest
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from sluice.runtime import door
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import Dataplane
from sluice.server.kserve import KServeService, KServeV2
from sluice.server.main import serve
from sluice.server.service import InferenceService
from sluice.server.settings import ServerSettings
from sluice.shm import registry as shm_core
from sluice.shm.calls import SYSTEM_SHARED_MEMORY
from sluice.shm.registry import SHM_ROOT, Regions
from sluice.shm.setup import ONE_PROCESS, regions_of
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec
from tests.conftest import SAMPLES
from tests.unit.test_dataplane import Gated

Infer = kpb.ModelInferRequest
InputTensor = Infer.InferInputTensor
Output = Infer.InferRequestedOutputTensor
X = np.concatenate([s.input for s in SAMPLES[:4]])  # FP32 [4, 64]: 1024 bytes
LABELS = 4 * 8  # INT64 [4]
PROBABILITIES = 4 * 10 * 4  # FP32 [4, 10]
NAMES = itertools.count()
OFF = "shared memory is off; start sluice-server with --shared-memory (for callers on its host)"
ALPHA, BETA = "sk-alpha-shm-key", "sk-beta-shm-key"


class Shm:
    """A POSIX shared memory object, as a caller makes one (shm_open's /dev/shm/NAME)."""

    def __init__(self, size: int) -> None:
        self.key = f"/sluice-test-{os.getpid()}-{next(NAMES)}"
        self.path = SHM_ROOT / self.key[1:]
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:  # not yet in the fixture's list: it would stay in /dev/shm
            self.path.unlink()
            raise
        finally:
            os.close(fd)

    def array(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        return np.ndarray(shape, dtype, buffer=self.map, offset=offset)

    def close(self) -> None:
        with suppress(BufferError):  # a test's view may still hold it: it goes with the view
            self.map.close()
        with suppress(FileNotFoundError):
            self.path.unlink()


@pytest.fixture
def shm() -> Iterator[Callable[[int], Shm]]:
    made: list[Shm] = []

    def make(size: int) -> Shm:
        made.append(Shm(size))
        return made[-1]

    yield make
    for obj in made:
        obj.close()


@pytest.fixture
def regions() -> Iterator[Regions]:
    regions = Regions(max_regions=4, max_bytes=1 << 20)
    yield regions
    regions.close()


def plane_of(engine: Engine, runners: Any = None) -> Dataplane:
    batcher = Batcher(engine.instances if runners is None else runners)
    return Dataplane(Models([Model(engine, batcher)]), LRUCache(100, 1 << 20))


@pytest.fixture
def plane(engine: Engine) -> Dataplane:
    return plane_of(engine)


def gated(engine: Engine) -> tuple[Dataplane, list[Gated]]:
    """A dataplane whose model runs wait for the test to open the gates."""
    gates = [Gated(i) for i in engine.instances]
    return plane_of(engine, gates), gates


def params(**values: str | int) -> dict[str, kpb.InferParameter]:
    return {
        k: kpb.InferParameter(string_param=v)
        if isinstance(v, str)
        else kpb.InferParameter(int64_param=v)
        for k, v in values.items()
    }


def placed(region: str, byte_size: int, offset: int = 0) -> dict[str, kpb.InferParameter]:
    """A tensor's parameters as tritonclient's set_shared_memory writes them."""
    values: dict[str, str | int] = {
        "shared_memory_region": region,
        "shared_memory_byte_size": byte_size,
    }
    if offset:
        values["shared_memory_offset"] = offset
    return params(**values)


def shared_input(region: str = "in", byte_size: int = X.nbytes, **kw: Any) -> InputTensor:
    return InputTensor(
        name="input", datatype="FP32", shape=X.shape, parameters=placed(region, byte_size), **kw
    )


def request(*inputs: InputTensor, outputs: tuple[Output, ...] = (), **kw: Any) -> bytes:
    return Infer(model_name="digits", inputs=inputs, outputs=outputs, **kw).SerializeToString()


def parameters_of(tensor: kpb.ModelInferResponse.InferOutputTensor) -> dict[str, Any]:
    return {
        k: getattr(v, v.WhichOneof("parameter_choice") or "") for k, v in tensor.parameters.items()
    }


def truth(reference: ort.InferenceSession, x: np.ndarray = X) -> tuple[np.ndarray, np.ndarray]:
    label, probabilities = reference.run(None, {"input": x})
    return label, probabilities


# The decode and encode, and the dataplane's handling of a body that names regions.


def test_route_marks_a_body_that_names_a_region_only_with_shared_memory_on() -> None:
    body = request(shared_input())
    plain = request(InputTensor(name="input", datatype="FP32", shape=X.shape))
    on = KServeV2(shared_memory=True)
    assert on.route(body).shared and not on.route(plain).shared
    assert not KServeV2().route(body).shared  # off: decode refuses it, with no lease to read by
    # Raw values that hold the key's bytes are stepped over: that body may be cached.
    lookalike = Infer(
        inputs=[InputTensor(name="input", datatype="UINT8", shape=[20])],
        raw_input_contents=[b"shared_memory_region"],
    ).SerializeToString()
    assert not on.route(lookalike).shared
    assert on.route(request(shared_input(), outputs=(Output(name="label"),))).shared
    only_output = request(outputs=(Output(name="label", parameters=placed("out", 8)),))
    assert on.route(only_output).shared


def test_an_input_is_a_read_only_view_of_the_region(
    regions: Regions, shm: Callable[[int], Shm]
) -> None:
    obj = shm(4096)
    obj.array(np.float32, X.shape, offset=512)[:] = X
    regions.register("", "in", obj.key, 512, X.nbytes)
    with regions.lease("") as lease:
        got = KServeV2(True).decode(request(shared_input()), lease)
        array = got.inputs["input"]
        np.testing.assert_array_equal(array, X)
        assert not array.flags.writeable and array.flags.aligned
        obj.array(np.float32, X.shape, offset=512)[0, 0] = 42.0  # the caller's write shows
        assert array[0, 0] == 42.0
        assert got.options is None  # no outputs placed


def test_an_unaligned_input_is_copied_aligned(regions: Regions, shm: Callable[[int], Shm]) -> None:
    obj = shm(4096)
    np.frombuffer(obj.map, np.uint8, X.nbytes, offset=3)[:] = X.view(np.uint8).reshape(-1)
    regions.register("", "in", obj.key, 0, 4096)
    body = request(
        InputTensor(name="input", datatype="FP32", shape=X.shape, parameters=placed("in", 1024, 3))
    )
    with regions.lease("") as lease:
        array = KServeV2(True).decode(body, lease).inputs["input"]
    assert array.flags.aligned
    np.testing.assert_array_equal(array, X)


def test_an_input_of_another_size_is_refused_before_it_is_copied(
    shm: Callable[[int], Shm], monkeypatch: pytest.MonkeyPatch
) -> None:
    regions = Regions(copy=True)
    obj = shm(1 << 16)
    regions.register("", "in", obj.key, 0, 1 << 16)
    read: list[int] = []
    monkeypatch.setattr(os, "preadv", lambda *args: read.append(1) or 0)
    try:
        with regions.lease("") as lease, pytest.raises(InvalidInput, match="byte size mismatch"):
            KServeV2(True).decode(request(shared_input(byte_size=1 << 16)), lease)
        assert read == [] and regions._copying == 0
    finally:
        regions.close()


async def test_a_cancelled_call_writes_nothing_into_its_region(
    engine: Engine, shm: Callable[[int], Shm]
) -> None:
    """Copied: the caller that gave up on a call may reuse its bytes at once; the call's
    end writes nothing over them."""
    regions = Regions(copy=True)
    plane, gates = gated(engine)
    inputs, outputs = shm(X.nbytes), shm(64)
    inputs.array(np.float32, X.shape)[:] = X
    regions.register("", "in", inputs.key, 0, X.nbytes)
    regions.register("", "out", outputs.key, 0, 64)
    body = request(shared_input(), outputs=(Output(name="label", parameters=placed("out", 64)),))
    lease = regions.lease("")
    try:
        call = asyncio.ensure_future(plane.infer(body, KServeV2(True), lease=lambda: lease))
        await held(plane)
        call.cancel()
        outputs.map[:] = b"NEWDATA!" * 8  # the caller's next use of its region
        for gate in gates:
            gate.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert lease._released
        assert outputs.map[:] == b"NEWDATA!" * 8
    finally:
        for gate in gates:
            gate.gate.set()
        regions.close()


class Digits:
    name, version = "digits", "1"


@pytest.mark.parametrize(
    ("outputs", "words"),
    [
        (  # the second placed output does not fit: the first is not written either
            {"label": np.arange(4), "probabilities": np.ones((4, 10), np.float32)},
            "output 'probabilities' (16 bytes) should be at least 160 bytes",
        ),
        (  # an output the API cannot carry, after the placed ones
            {
                "label": np.arange(4),
                "probabilities": np.ones((1, 4), np.float32),
                "z": np.zeros(2, np.complex64),
            },
            "numpy dtype complex64 has no API datatype",
        ),
    ],
)
def test_an_answer_refused_writes_none_of_its_outputs(
    regions: Regions, shm: Callable[[int], Shm], outputs: dict[str, np.ndarray], words: str
) -> None:
    obj = shm(4096)
    obj.map[:] = b"\xee" * 4096
    regions.register("", "out", obj.key, 0, 4096)
    placed_outputs = (
        Output(name="label", parameters=placed("out", LABELS)),
        Output(name="probabilities", parameters=placed("out", 16, 1024)),
    )
    body = request(
        InputTensor(name="input", datatype="FP32", shape=X.shape),
        outputs=placed_outputs,
        raw_input_contents=[X.tobytes()],
    )
    protocol = KServeV2(True)
    with regions.lease("") as lease:
        decoded = protocol.decode(body, lease)
        with pytest.raises((InvalidInput, codec.TensorError), match=re.escape(words)):
            protocol.encode(Digits(), decoded, outputs)
    assert obj.map[:] == b"\xee" * 4096


async def test_a_write_back_that_fails_fails_the_call_and_masks_no_error(
    plane: Dataplane, shm: Callable[[int], Shm], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(copy: shm_core.Copy) -> SluiceError:
        return SluiceError("shared memory region 'out': could not be written: No space")

    monkeypatch.setattr(shm_core, "write_back", failing)
    regions = Regions(copy=True)
    inputs, outputs = shm(X.nbytes), shm(4096)
    inputs.array(np.float32, X.shape)[:] = X
    regions.register("", "in", inputs.key, 0, X.nbytes)
    regions.register("", "out", outputs.key, 0, 4096)
    protocol = KServeV2(True)
    try:
        fits = Output(name="label", parameters=placed("out", LABELS))
        with pytest.raises(SluiceError, match="could not be written: No space"):
            await plane.infer(
                request(shared_input(), outputs=(fits,)), protocol, lease=lambda: regions.lease("")
            )
        small = Output(name="probabilities", parameters=placed("out", 16, 1024))
        with pytest.raises(InvalidInput, match="should be at least 160 bytes"):  # not masked
            await plane.infer(
                request(shared_input(), outputs=(fits, small)),
                protocol,
                lease=lambda: regions.lease(""),
            )
    finally:
        regions.close()


async def test_inputs_and_outputs_in_shared_memory_answer_as_onnxruntime(
    plane: Dataplane,
    regions: Regions,
    shm: Callable[[int], Shm],
    reference: ort.InferenceSession,
) -> None:
    inputs, outputs = shm(X.nbytes), shm(4096)
    inputs.array(np.float32, X.shape)[:] = X
    regions.register("", "in", inputs.key, 0, X.nbytes)
    regions.register("", "out", outputs.key, 0, 4096)
    both = (
        Output(name="label", parameters=placed("out", LABELS)),
        Output(name="probabilities", parameters=placed("out", PROBABILITIES, 1024)),
    )
    protocol = KServeV2(True)
    label, probabilities = truth(reference)
    for _ in range(2):  # never a cache hit: the regions, not the body, hold the answer
        lease = regions.lease("")
        entry, cached = await plane.infer(
            request(shared_input(), outputs=both, id="a"),
            protocol,
            lease=functools.partial(lambda held: held, lease),
        )
        assert cached is None and lease._released  # released once the outputs are written
        response = kpb.ModelInferResponse.FromString(entry.body)
        assert response.id == "a"
        assert [(t.name, t.datatype, list(t.shape)) for t in response.outputs] == [
            ("label", "INT64", [4]),
            ("probabilities", "FP32", [4, 10]),
        ]
        # As Triton: one raw entry per output, empty for one in shared memory, and the
        # output's parameters say where it went and how many bytes it took.
        assert list(response.raw_output_contents) == [b"", b""]
        assert [parameters_of(t) for t in response.outputs] == [
            {"shared_memory_region": "out", "shared_memory_byte_size": LABELS},
            {
                "shared_memory_region": "out",
                "shared_memory_byte_size": PROBABILITIES,
                "shared_memory_offset": 1024,
            },
        ]
        np.testing.assert_array_equal(outputs.array(np.int64, (4,)), label)
        np.testing.assert_array_equal(outputs.array(np.float32, (4, 10), 1024), probabilities)
        inputs.array(np.float32, X.shape)[:] = X[::-1]  # the next call reads the new values
        label, probabilities = truth(reference, X[::-1].copy())
    assert len(plane.cache) == 0 and plane.flight.joined == 0


async def test_shared_memory_beside_raw_values(
    plane: Dataplane,
    regions: Regions,
    shm: Callable[[int], Shm],
    reference: ort.InferenceSession,
) -> None:
    """As in Triton, raw_input_contents holds the inputs not in shared memory; an output not
    in a region comes back raw, in its place among the others."""
    outputs = shm(4096)
    regions.register("", "out", outputs.key, 0, 4096)
    raw = Infer(
        model_name="digits",
        inputs=[InputTensor(name="input", datatype="FP32", shape=X.shape)],
        outputs=[
            Output(name="label", parameters=placed("out", 64)),
            Output(name="probabilities"),
        ],
        raw_input_contents=[X.tobytes()],
    ).SerializeToString()
    entry, _ = await plane.infer(raw, KServeV2(True), lease=lambda: regions.lease(""))
    response = kpb.ModelInferResponse.FromString(entry.body)
    label, probabilities = truth(reference)
    assert response.raw_output_contents[0] == b""
    got = np.frombuffer(response.raw_output_contents[1], np.float32).reshape(4, 10)
    np.testing.assert_array_equal(got, probabilities)
    np.testing.assert_array_equal(outputs.array(np.int64, (4,)), label)


# The calls, through gRPC: each refusal's status and words.


@asynccontextmanager
async def both_faces(
    plane: Dataplane, regions: Regions | None, tenants: Path | None = None
) -> AsyncIterator[tuple[GRPCInferenceServiceStub, Any]]:
    """A server on this loop with both faces, as sluice-server serves them: their stubs."""
    service = InferenceService(
        plane,
        node_id="n",
        regions=regions,
        tenants=door.load(str(tenants)) if tenants else None,
    )
    kserve = KServeService(service)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([service.handler(), kserve.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield GRPCInferenceServiceStub(channel), pb_grpc.InferenceStub(channel)
    finally:
        await server.stop(None)


@asynccontextmanager
async def serving(
    plane: Dataplane, regions: Regions | None, tenants: Path | None = None
) -> AsyncIterator[GRPCInferenceServiceStub]:
    async with both_faces(plane, regions, tenants) as (stub, _):
        yield stub


async def refusal(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details() or ""


def register(name: str, key: str, byte_size: int, offset: int = 0) -> Any:
    return kpb.SystemSharedMemoryRegisterRequest(
        name=name, key=key, offset=offset, byte_size=byte_size
    )


async def status(stub: GRPCInferenceServiceStub, name: str = "", **kw: Any) -> dict[str, Any]:
    reply = await stub.SystemSharedMemoryStatus(
        kpb.SystemSharedMemoryStatusRequest(name=name), **kw
    )
    return {n: (r.name, r.key, r.offset, r.byte_size) for n, r in reply.regions.items()}


async def test_register_status_unregister(
    plane: Dataplane, regions: Regions, shm: Callable[[int], Shm]
) -> None:
    a, b = shm(4096), shm(8192)
    async with serving(plane, regions) as stub:
        meta = await stub.ServerMetadata(kpb.ServerMetadataRequest())
        assert list(meta.extensions) == [SYSTEM_SHARED_MEMORY]
        await stub.SystemSharedMemoryRegister(register("a", a.key, 4096))
        await stub.SystemSharedMemoryRegister(register("b", b.key, 100, offset=8000))
        assert await status(stub) == {
            "a": ("a", a.key, 0, 4096),
            "b": ("b", b.key, 8000, 100),
        }
        assert await status(stub, "b") == {"b": ("b", b.key, 8000, 100)}
        assert await refusal(stub.SystemSharedMemoryRegister(register("a", b.key, 8))) == (
            grpc.StatusCode.ALREADY_EXISTS,
            "shared memory region 'a' already in manager",
        )
        await stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(name="a"))
        assert list(await status(stub)) == ["b"]
        assert await refusal(
            stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest(name="a"))
        ) == (grpc.StatusCode.NOT_FOUND, "Unable to find system shared memory region: 'a'")
        # Unregistering a name nobody registered is no error, as in Triton; "" is all.
        await stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(name="a"))
        await stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest())
        assert await status(stub) == {}


BAD_KEYS = {
    "relative path": ("../x", "must be a POSIX shared memory name"),
    "absolute path": ("/etc/passwd", "must be a POSIX shared memory name"),
    "NUL": ("/a\x00b", "must be a POSIX shared memory name"),
    "overlong": ("/" + "k" * 300, "must be a POSIX shared memory name"),
    "dot dot": ("/..", "must be a POSIX shared memory name"),
    "missing": ("/sluice-test-no-such-object", "Unable to open shared memory region"),
}


@pytest.mark.parametrize("case", list(BAD_KEYS))
async def test_a_key_that_is_no_shared_memory_object_is_refused(
    plane: Dataplane, regions: Regions, case: str
) -> None:
    key, words = BAD_KEYS[case]
    async with serving(plane, regions) as stub:
        code, message = await refusal(stub.SystemSharedMemoryRegister(register("r", key, 8)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and words in message
    assert len(regions) == 0


async def test_a_file_that_is_not_shared_memory_is_refused(
    plane: Dataplane, regions: Regions, tmp_path: Path
) -> None:
    """A symbolic link in /dev/shm to another file, and a FIFO there, are not mapped."""
    target = tmp_path / "file"
    target.write_bytes(b"x" * 64)
    link = SHM_ROOT / f"sluice-test-{os.getpid()}-link"
    fifo = SHM_ROOT / f"sluice-test-{os.getpid()}-fifo"
    link.symlink_to(target)
    os.mkfifo(fifo)
    try:
        async with serving(plane, regions) as stub:
            linked = await refusal(
                stub.SystemSharedMemoryRegister(register("r", f"/{link.name}", 8))
            )
            piped = await refusal(
                stub.SystemSharedMemoryRegister(register("r", f"/{fifo.name}", 8))
            )
    finally:
        link.unlink()
        fifo.unlink()
    assert linked == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"shared memory key '/{link.name}' is not shared memory: a symbolic link",
    )
    assert piped == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"shared memory key '/{fifo.name}' is not shared memory: not a regular file",
    )


async def test_a_range_past_the_object_or_empty_is_refused(
    plane: Dataplane, regions: Regions, shm: Callable[[int], Shm]
) -> None:
    obj = shm(4096)
    cases = [
        (register("r", obj.key, 4097), "offset 0 + byte size 4097 is past the end"),
        (register("r", obj.key, 8, offset=4090), "offset 4090 + byte size 8 is past the end"),
        (register("r", obj.key, 1, offset=2**64 - 1), "is past the end"),  # no wrap-around
        (register("r", obj.key, 0), "byte size must be 1 or more, got 0"),
    ]
    async with serving(plane, regions) as stub:
        for message, words in cases:
            code, said = await refusal(stub.SystemSharedMemoryRegister(message))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and words in said, said


class Aborted(Exception):
    pass


class Caller:
    """A call's context as a handler sees it, from `peer` (grpc's name for the caller)."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None

    def peer(self) -> str:
        return self._peer

    def set_trailing_metadata(self, trailers: object) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def test_regions_are_registered_from_this_host_only(
    plane: Dataplane, regions: Regions, shm: Callable[[int], Shm]
) -> None:
    """Both faces: a registration from elsewhere would have this host's objects read and
    written for a caller that cannot see them."""
    obj = shm(64)
    service = InferenceService(plane, node_id="n", regions=regions)
    v1 = service.methods()["RegisterRegion"].unary_unary
    kserve = KServeService(service).methods()["SystemSharedMemoryRegister"].unary_unary
    v1_body = pb.RegisterRegionRequest(name="a", key=obj.key, byte_size=64).SerializeToString()
    kserve_body = register("b", obj.key, 64).SerializeToString()
    for held, (handler, body) in enumerate(((v1, v1_body), (kserve, kserve_body))):
        assert handler is not None
        with pytest.raises(Aborted) as caught:
            await handler(body, Caller("ipv4:192.0.2.7:5000"))
        assert caught.value.args == (
            grpc.StatusCode.PERMISSION_DENIED,
            "shared memory regions are registered by callers on this host only (this call "
            "came from ipv4:192.0.2.7:5000)",
        )
        assert len(regions) == held
        await handler(body, Caller("ipv6:%5B::1%5D:5000"))
    assert len(regions) == 2
    status = KServeService(service).methods()["SystemSharedMemoryStatus"].unary_unary
    assert status is not None  # a tenant's own regions, from anywhere
    await status(b"", Caller("ipv4:192.0.2.7:5000"))


async def test_a_tenants_regions_are_its_own(
    plane: Dataplane, regions: Regions, shm: Callable[[int], Shm], tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'[tenants.alpha]\nkeys = ["{digest(ALPHA)}"]\n\n'
        f'[tenants.beta]\nkeys = ["{digest(BETA)}"]\n'
    )
    alpha = {"metadata": (("authorization", f"Bearer {ALPHA}"),)}
    beta = {"metadata": (("authorization", f"Bearer {BETA}"),)}
    obj, own = shm(X.nbytes), shm(64)
    obj.array(np.float32, X.shape)[:] = X
    async with serving(plane, regions, tenants) as stub:
        await stub.SystemSharedMemoryRegister(register("in", obj.key, X.nbytes), **alpha)
        await stub.ModelInfer(Infer.FromString(request(shared_input())), **alpha)
        # To beta, alpha's region is one nobody registered.
        assert await status(stub, **beta) == {}
        assert await refusal(
            stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest(name="in"), **beta)
        ) == (grpc.StatusCode.NOT_FOUND, "Unable to find system shared memory region: 'in'")
        assert await refusal(
            stub.ModelInfer(Infer.FromString(request(shared_input())), **beta)
        ) == (grpc.StatusCode.INVALID_ARGUMENT, "Unable to find shared memory region: 'in'")
        await stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(), **beta)
        assert list(await status(stub, **alpha)) == ["in"]
        # Nor may beta map alpha's object by its key: to beta, it is not there.
        assert await refusal(
            stub.SystemSharedMemoryRegister(register("mine", obj.key, 8), **beta)
        ) == (grpc.StatusCode.INVALID_ARGUMENT, f"Unable to open shared memory region: '{obj.key}'")
        # The same name is beta's own to take, on its own object.
        await stub.SystemSharedMemoryRegister(register("in", own.key, 8), **beta)
        assert (await status(stub, **beta))["in"][3] == 8
        assert (await status(stub, **alpha))["in"][3] == X.nbytes
        code, _ = await refusal(
            stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest())
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED  # no key: no name space


async def test_too_many_regions_or_bytes(plane: Dataplane, shm: Callable[[int], Shm]) -> None:
    regions = Regions(max_regions=2, max_bytes=6000)
    obj = shm(8192)
    try:
        async with serving(plane, regions) as stub:
            await stub.SystemSharedMemoryRegister(register("a", obj.key, 4000))
            code, message = await refusal(
                stub.SystemSharedMemoryRegister(register("b", obj.key, 2001))
            )
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert message.startswith("quota: shared memory region 'b' would bring the bytes")
            assert "to 6001, over the most allowed (--shared-memory-bytes 6000)" in message
            await stub.SystemSharedMemoryRegister(register("b", obj.key, 2000))
            code, message = await refusal(
                stub.SystemSharedMemoryRegister(register("c", obj.key, 1))
            )
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert message.startswith("quota: ") and "2 shared memory regions" in message
            assert "(--shared-memory-regions 2)" in message
    finally:
        regions.close()


# Requests on regions "in" (X's bytes), "out" (4096 bytes) and "gone" (unregistered), and
# the words each refusal says (INVALID_ARGUMENT, all).
BAD_INFER = {
    "unknown region": (
        request(shared_input("nope")),
        "Unable to find shared memory region: 'nope'",
    ),
    "unknown output region": (
        request(shared_input(), outputs=(Output(name="label", parameters=placed("x", 8)),)),
        "Unable to find shared memory region: 'x'",
    ),
    "size not shape x dtype": (
        request(shared_input(byte_size=X.nbytes - 4)),
        "input byte size mismatch for input 'input' for model 'digits'. Expected 1024, got 1020",
    ),
    "past the region": (
        request(
            InputTensor(
                name="input", datatype="FP32", shape=X.shape, parameters=placed("in", 1024, 4)
            )
        ),
        "Invalid offset + byte size for shared memory region: 'in' (offset 4 + byte size "
        "1024, in a region of 1024 bytes)",
    ),
    "negative offset": (
        request(
            InputTensor(
                name="input",
                datatype="FP32",
                shape=X.shape,
                parameters=placed("in", 1024, -8),
            )
        ),
        "Invalid offset + byte size for shared memory region: 'in' (offset -8",
    ),
    "negative size": (  # the size checked before the region is read
        request(shared_input(byte_size=-1024)),
        "input byte size mismatch for input 'input'",
    ),
    "overflowing": (
        request(
            InputTensor(
                name="input",
                datatype="FP32",
                shape=X.shape,
                parameters=placed("in", X.nbytes, 2**63 - 1),
            )
        ),
        "Invalid offset + byte size for shared memory region: 'in'",
    ),
    "contents too": (
        request(shared_input(contents=kpb.InferTensorContents(fp32_contents=[1.0]))),
        "unexpected 'content' provided when using shared memory for input 'input' for "
        "model 'digits'",
    ),
    "a raw entry too": (
        request(shared_input(), raw_input_contents=[X.tobytes()]),
        "raw_input_contents has 1 entries but the request has 0 inputs not in shared memory",
    ),
    "region not a string": (
        request(
            InputTensor(
                name="input",
                datatype="FP32",
                shape=X.shape,
                parameters=params(shared_memory_region=3, shared_memory_byte_size=1024),
            )
        ),
        "invalid value type for 'shared_memory_region' parameter for input 'input', "
        "expected string_param",
    ),
    "size not an int64": (
        request(
            InputTensor(
                name="input",
                datatype="FP32",
                shape=X.shape,
                parameters=params(shared_memory_region="in", shared_memory_byte_size="1024"),
            )
        ),
        "invalid value type for 'shared_memory_byte_size' parameter for input 'input', "
        "expected int64_param",
    ),
    "no size": (
        request(
            InputTensor(
                name="input",
                datatype="FP32",
                shape=X.shape,
                parameters=params(shared_memory_region="in"),
            )
        ),
        "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
        "parameter for input 'input'",
    ),
    "offset without a region": (
        request(
            shared_input(),
            outputs=(Output(name="label", parameters=params(shared_memory_offset=8)),),
        ),
        "'shared_memory_offset' can not be specified without 'shared_memory_region' "
        "parameter for output 'label'",
    ),
    "output region too small": (
        request(shared_input(), outputs=(Output(name="label", parameters=placed("out", 16)),)),
        "shared memory size specified with the request for output 'label' (16 bytes) "
        "should be at least 32 bytes to hold the results",
    ),
    "outputs over each other": (
        request(
            shared_input(),
            outputs=(
                Output(name="label", parameters=placed("out", LABELS)),
                Output(name="probabilities", parameters=placed("out", PROBABILITIES, 16)),
            ),
        ),
        f"shared memory region 'out': bytes [16, {16 + PROBABILITIES}) overlap bytes [0, "
        f"{LABELS}) this call writes another output into; give each output its own bytes",
    ),
    "BYTES": (
        request(
            InputTensor(name="input", datatype="BYTES", shape=[4], parameters=placed("in", 16))
        ),
        "input 'input' is BYTES, which Sluice does not serve",
    ),
    "unregistered": (
        request(shared_input("gone")),
        "Unable to find shared memory region: 'gone'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INFER))
async def test_bad_requests_on_regions(
    plane: Dataplane, regions: Regions, shm: Callable[[int], Shm], case: str
) -> None:
    inputs, outputs, gone = shm(X.nbytes), shm(4096), shm(64)
    inputs.array(np.float32, X.shape)[:] = X
    regions.register("", "in", inputs.key, 0, X.nbytes)
    regions.register("", "out", outputs.key, 0, 4096)
    regions.register("", "gone", gone.key, 0, 64)
    regions.unregister("", "gone")  # unregistered, then named
    body, words = BAD_INFER[case]
    async with serving(plane, regions) as stub:
        code, message = await refusal(stub.ModelInfer(Infer.FromString(body)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in message, message


async def held(plane: Dataplane) -> None:
    """Until a call waits at the gated runner."""
    batcher = next(iter(plane.models)).batcher
    for _ in range(3000):
        if batcher.busy:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no call reached the model in 30 s")


async def test_a_call_keeps_its_regions_when_they_are_unregistered_under_it(
    engine: Engine,
    regions: Regions,
    shm: Callable[[int], Shm],
    reference: ort.InferenceSession,
) -> None:
    plane, gates = gated(engine)
    inputs, outputs = shm(X.nbytes), shm(4096)
    inputs.array(np.float32, X.shape)[:] = X
    body = request(shared_input(), outputs=(Output(name="label", parameters=placed("out", 64)),))
    async with serving(plane, regions) as stub:
        await stub.SystemSharedMemoryRegister(register("in", inputs.key, X.nbytes))
        await stub.SystemSharedMemoryRegister(register("out", outputs.key, 4096))
        call = asyncio.ensure_future(stub.ModelInfer(Infer.FromString(body), timeout=60))
        await held(plane)
        await stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest())
        assert await status(stub) == {}
        assert await refusal(stub.ModelInfer(Infer.FromString(body))) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "Unable to find shared memory region: 'in'",
        )
        for gate in gates:
            gate.gate.set()
        response = await call
    assert response.outputs[0].parameters["shared_memory_byte_size"].int64_param == LABELS
    np.testing.assert_array_equal(outputs.array(np.int64, (4,)), truth(reference)[0])


async def test_two_calls_never_write_the_same_bytes_at_once(
    engine: Engine,
    regions: Regions,
    shm: Callable[[int], Shm],
    reference: ort.InferenceSession,
) -> None:
    plane, gates = gated(engine)
    inputs, outputs = shm(X.nbytes), shm(4096)
    inputs.array(np.float32, X.shape)[:] = X
    regions.register("", "in", inputs.key, 0, X.nbytes)
    regions.register("", "out", outputs.key, 0, 4096)

    def writing(offset: int) -> Infer:
        label = Output(name="label", parameters=placed("out", LABELS, offset))
        return Infer.FromString(request(shared_input(), outputs=(label,)))

    async with serving(plane, regions) as stub:
        first = asyncio.ensure_future(stub.ModelInfer(writing(0), timeout=60))
        await held(plane)
        # Bytes [16, 48) overlap the first call's [0, 32): refused before any work.
        assert await refusal(stub.ModelInfer(writing(16))) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "shared memory region 'out': bytes [16, 48) overlap bytes [0, 32) another call is "
            "writing; retry when it ends, or give each call its own range",
        )
        beside = asyncio.ensure_future(stub.ModelInfer(writing(32), timeout=60))  # its own range
        for gate in gates:
            gate.gate.set()
        await first
        await beside
        label = truth(reference)[0]
        np.testing.assert_array_equal(outputs.array(np.int64, (8,)), np.concatenate([label] * 2))
        await stub.ModelInfer(writing(16), timeout=60)  # the first is done: its bytes are free
    np.testing.assert_array_equal(outputs.array(np.int64, (4,), 16), label)


async def test_shared_memory_off(plane: Dataplane, shm: Callable[[int], Shm]) -> None:
    obj = shm(64)
    async with serving(plane, None) as stub:
        meta = await stub.ServerMetadata(kpb.ServerMetadataRequest())
        assert list(meta.extensions) == []
        for call in (
            stub.SystemSharedMemoryRegister(register("r", obj.key, 64)),
            stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest()),
            stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest()),
        ):
            assert await refusal(call) == (grpc.StatusCode.UNIMPLEMENTED, OFF)
        for body in (
            request(shared_input()),
            request(
                InputTensor(name="input", datatype="FP32", shape=X.shape),
                outputs=(Output(name="label", parameters=placed("out", 64)),),
                raw_input_contents=[X.tobytes()],
            ),
        ):
            code, message = await refusal(stub.ModelInfer(Infer.FromString(body)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                "names a shared memory region; Sluice does not serve shared memory here: "
                "start sluice-server with --shared-memory" in message
            )


async def test_cuda_shared_memory_as_triton_without_gpus(
    plane: Dataplane, regions: Regions
) -> None:
    async with serving(plane, regions) as stub:
        empty = await stub.CudaSharedMemoryStatus(kpb.CudaSharedMemoryStatusRequest())
        assert not empty.regions
        assert await refusal(
            stub.CudaSharedMemoryStatus(kpb.CudaSharedMemoryStatusRequest(name="g"))
        ) == (grpc.StatusCode.NOT_FOUND, "Unable to find cuda shared memory region: 'g'")
        assert await refusal(
            stub.CudaSharedMemoryRegister(
                kpb.CudaSharedMemoryRegisterRequest(name="g", raw_handle=b"h", byte_size=8)
            )
        ) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "failed to register CUDA shared memory region: 'g', GPUs not supported: Sluice "
            "takes system shared memory only",
        )
        await stub.CudaSharedMemoryUnregister(kpb.CudaSharedMemoryUnregisterRequest(name="g"))


def test_a_decode_without_a_lease_refuses_a_region() -> None:
    with pytest.raises(InvalidInput, match="names a shared memory region; Sluice does not"):
        KServeV2(True).decode(request(shared_input()))


async def test_the_server_refuses_shared_memory_with_several_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = ServerSettings(shared_memory=True, workers="2", device="cpu")
    assert await serve(settings) == 1
    assert ONE_PROCESS in caplog.text


async def test_both_faces_share_the_callers_regions(
    plane: Dataplane,
    regions: Regions,
    shm: Callable[[int], Shm],
    reference: ort.InferenceSession,
) -> None:
    """A region registered through sluice.v1's RegisterRegion is the one Triton's calls list
    and a ModelInfer reads, and a Predict reads one registered through Triton's."""
    a, b = shm(X.nbytes), shm(X.nbytes)
    a.array(np.float32, X.shape)[:] = X
    b.array(np.float32, X.shape)[:] = X
    label = truth(reference)[0]
    async with both_faces(plane, regions) as (kserve, v1):
        await v1.RegisterRegion(
            pb.RegisterRegionRequest(name="in", key=a.key, offset=0, byte_size=X.nbytes)
        )
        await kserve.SystemSharedMemoryRegister(register("other", b.key, X.nbytes))
        assert await status(kserve) == {
            "in": ("in", a.key, 0, X.nbytes),
            "other": ("other", b.key, 0, X.nbytes),
        }
        listed = await v1.RegionStatus(pb.RegionStatusRequest())
        assert sorted(r.name for r in listed.regions) == ["in", "other"]
        infer = await kserve.ModelInfer(Infer.FromString(request(shared_input())))
        got = np.frombuffer(infer.raw_output_contents[0], np.int64)
        np.testing.assert_array_equal(got, label)
        tensor = pb.Tensor(name="input", datatype="FP32", shape=X.shape)
        tensor.shared_memory.CopyFrom(pb.SharedMemoryRef(region="other", byte_size=X.nbytes))
        predicted = await v1.Predict(pb.PredictRequest(inputs=[tensor], outputs=["label"]))
        np.testing.assert_array_equal(codec.decode_all(predicted.outputs)["label"], label)
        await v1.UnregisterRegion(pb.UnregisterRegionRequest())
        assert await status(kserve) == {}


def test_regions_are_copied_where_tenants_share_the_program() -> None:
    """Tenants on: no caller may crash the process for the others by truncating its object
    under a call, so the registry copies views instead of mapping objects; off: one party,
    mapped in place."""
    assert regions_of(ServerSettings(device="cpu")) is None
    alone = regions_of(ServerSettings(shared_memory=True, device="cpu"))
    shared = regions_of(ServerSettings(shared_memory=True, device="cpu", tenants="t.toml"))
    assert alone is not None and not alone.copy
    assert shared is not None and shared.copy
