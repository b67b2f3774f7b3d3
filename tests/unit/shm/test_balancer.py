"""Shared memory through the balancer (sluice.shm.balancer): regions registered with the
balancer on both faces, per tenant, never reaching a server; bodies naming them forwarded
with the region bytes in them (the content's affinity key), outputs written back into the
caller's regions once, from the answer returned; leases released however a call ends;
every bad input refused with its exact status. A real balancer servicer on 127.0.0.1, its
backends fakes that run y = 2x."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tracemalloc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice.balancer.kserve import SERVICE as KSERVE
from sluice.balancer.kserve import KServeFacade
from sluice.balancer.service import INFER, SERVICE, BalancerService
from sluice.balancer.settings import BalancerSettings
from sluice.core.errors import Code, SluiceError
from sluice.core.tenants import Tenants, authorization, digest, parse, tenant_name
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from sluice.routing.budget import RetryBudget
from sluice.routing.pool import Pool
from sluice.shm import balancer as balancer_regions
from sluice.shm import registry as shm
from sluice.shm.balancer import NO_SHARED_MEMORY
from sluice.shm.registry import Regions
from sluice.shm.setup import sweep
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec, facts
from sluice.wire.mux import Reply

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
TENANTS = f"""
[tenants.a]
keys = ["{digest(KEY_A)}"]

[tenants.b]
keys = ["{digest(KEY_B)}"]
"""
X = np.arange(12, dtype=np.float32).reshape(3, 4)
OFF = "shared memory is off; start sluice-balancer with --shared-memory (for callers on its host)"
Input = kpb.ModelInferRequest.InferInputTensor
Output = kpb.ModelInferRequest.InferRequestedOutputTensor
Parameter = kpb.InferParameter


def outputs_of(x: np.ndarray) -> dict[str, np.ndarray]:
    """The fake model: y = 2x, and n, its input's size."""
    return {"y": x * 2, "n": np.array([x.size], np.int64)}


@dataclass
class Server:
    """A fake backend: answers either face with `outputs_of` its input `x`, recording each
    body it is sent (and each control call, which region calls must never be)."""

    address: str
    bodies: list[tuple[str, bytes]] = field(default_factory=list)
    unary_calls: list[str] = field(default_factory=list)
    fail: Reply | None = None
    hold: asyncio.Event | None = None

    async def predict(
        self, body: bytes, metadata: Mapping[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        self.bodies.append((method, body))
        if self.hold is not None:
            await self.hold.wait()
        if self.fail is not None:
            return self.fail
        if method == INFER:
            return Reply(0, body=infer_answer(body))
        request = pb.PredictRequest.FromString(body)
        assert not request.output_memory
        x = codec.decode_all(request.inputs)["x"]  # no region named: it would refuse
        outputs = outputs_of(x)
        asked = {n: outputs[n] for n in request.outputs or outputs}
        answer = codec.encode_predict_response("m", "1", asked, request.typed_outputs)
        return Reply(0, body=answer, trailers={"x-node-id": self.address})

    async def unary(
        self, method: str, body: bytes, metadata: Mapping[str, str], timeout: float | None
    ) -> Reply:
        self.unary_calls.append(method)
        return Reply(Code.UNIMPLEMENTED, "not here")


def infer_answer(body: bytes) -> bytes:
    request = kpb.ModelInferRequest.FromString(body)
    named = [t.parameters for t in request.inputs] + [t.parameters for t in request.outputs]
    assert not any(named), "a region's parameters reached the server"
    arrays = {
        t.name: np.frombuffer(raw, np.float32).reshape(tuple(t.shape))
        for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)
    }
    outputs = outputs_of(arrays["x"])
    asked = [o.name for o in request.outputs] or list(outputs)
    return kpb.ModelInferResponse(
        model_name="m",
        model_version="1",
        id=request.id,
        outputs=[
            kpb.ModelInferResponse.InferOutputTensor(
                name=n,
                datatype="FP32" if outputs[n].dtype == np.float32 else "INT64",
                shape=outputs[n].shape,
            )
            for n in asked
        ],
        raw_output_contents=[outputs[n].tobytes() for n in asked],
    ).SerializeToString()


@dataclass
class Rig:
    root: Path
    service: BalancerService
    servers: list[Server]
    channel: grpc.aio.Channel
    v1: pb_grpc.InferenceStub
    kserve: kpb_grpc.GRPCInferenceServiceStub

    def object(self, name: str, data: bytes) -> str:
        """A shared memory object (a file under the regions' root) holding `data`; its key."""
        (self.root / name).write_bytes(data)
        return f"/{name}"

    def read(self, name: str, size: int, offset: int = 0) -> bytes:
        return (self.root / name).read_bytes()[offset : offset + size]

    def bodies(self) -> list[tuple[str, bytes]]:
        return [b for s in self.servers for b in s.bodies]


@contextlib.asynccontextmanager
async def rig(
    root: Path,
    *,
    on: bool = True,
    servers: int = 1,
    tenants: bool = False,
    max_regions: int = 64,
    max_bytes: int = 1 << 20,
    fanout_rows: int = 0,
    copy: bool = False,
) -> AsyncIterator[Rig]:
    pool = Pool()
    pool.set_addresses(f"s{i}:1" for i in range(servers))
    fakes = []
    for address, backend in pool.backends.items():
        backend.transport = Server(address)
        fakes.append(backend.transport)
    regions = (
        Regions(root=root, max_regions=max_regions, max_bytes=max_bytes, copy=copy) if on else None
    )
    service = BalancerService(
        pool,
        RetryBudget(),
        node_id="b",
        tenants=Tenants(parse(TENANTS)) if tenants else None,
        regions=regions,
        fanout_rows=fanout_rows,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(SERVICE, service.methods()),
            grpc.method_handlers_generic_handler(KSERVE, KServeFacade(service).methods()),
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Rig(
            root,
            service,
            fakes,
            channel,
            pb_grpc.InferenceStub(channel),
            kpb_grpc.GRPCInferenceServiceStub(channel),
        )
    finally:
        await channel.close(None)
        await server.stop(None)
        if regions is not None:
            regions.close()


class Aborted(Exception):
    pass


class Caller:
    """A call's context as a handler sees it, from `peer` (grpc's name for the caller)."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def test_regions_are_registered_from_this_host_only(tmp_path: Path) -> None:
    """Through the balancer, a remote caller would have this host's objects' bytes
    forwarded to servers, and its outputs written over them."""
    async with rig(tmp_path) as r:
        key = r.object("in", X.tobytes())
        memory = r.service.memory
        v1 = memory.v1_methods()["RegisterRegion"].unary_unary
        kserve = memory.kserve_methods()["SystemSharedMemoryRegister"].unary_unary
        bodies = (
            pb.RegisterRegionRequest(name="a", key=key, byte_size=X.nbytes),
            kpb.SystemSharedMemoryRegisterRequest(name="b", key=key, byte_size=X.nbytes),
        )
        for handler, body in zip((v1, kserve), bodies, strict=True):
            assert handler is not None
            with pytest.raises(Aborted) as caught:
                await handler(body.SerializeToString(), Caller("ipv4:203.0.113.9:41000"))
            assert caught.value.args == (
                grpc.StatusCode.PERMISSION_DENIED,
                "shared memory regions are registered by callers on this host only (this call "
                "came from ipv4:203.0.113.9:41000)",
            )
            await handler(body.SerializeToString(), Caller("unix:"))
        assert [i.name for i in r.service.memory.regions.status("")] == ["a", "b"]


def test_a_callers_regions_are_its_tenants_in_both_programs() -> None:
    """One rule names a caller's regions' name space (sluice.core.tenants.tenant_name),
    the server's and the balancer's."""
    tenants = Tenants(parse(TENANTS))
    assert tenant_name(tenants.identify(authorization(KEY_A)[1])) == "a"
    assert tenant_name(None) == ""


def ref(region: str, offset: int = 0, byte_size: int = X.nbytes) -> pb.SharedMemoryRef:
    return pb.SharedMemoryRef(region=region, offset=offset, byte_size=byte_size)


def shared(name: str, region: str, x: np.ndarray = X, **kw: int) -> pb.Tensor:
    """A Tensor whose bytes lie in `region`."""
    size = kw.pop("byte_size", x.nbytes)
    return pb.Tensor(
        name=name,
        datatype="FP32",
        shape=x.shape,
        shared_memory=ref(region, kw.pop("offset", 0), size),
    )


def triton(region: str, byte_size: int, offset: int = 0) -> dict[str, Parameter]:
    """Triton's parameters of a tensor in shared memory."""
    return {
        "shared_memory_region": Parameter(string_param=region),
        "shared_memory_offset": Parameter(int64_param=offset),
        "shared_memory_byte_size": Parameter(int64_param=byte_size),
    }


async def register(
    stub: pb_grpc.InferenceStub, name: str, key: str, size: int, **kw: object
) -> None:
    await stub.RegisterRegion(
        pb.RegisterRegionRequest(name=name, key=key, offset=0, byte_size=size), **kw
    )


async def status_of(call: object) -> tuple[grpc.StatusCode, str]:
    """The status a call (an awaitable) fails with."""
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call  # type: ignore[misc]
    return failed.value.code(), failed.value.details() or ""


# Both faces, in and out of regions.


async def test_a_predict_in_regions_is_forwarded_as_bytes_and_answered_in_them(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", bytes(64)), 64)
        request = pb.PredictRequest(
            inputs=[shared("x", "in")], output_memory={"y": ref("out", 8, 56)}, model="m"
        )
        response = await r.v1.Predict(request)
        y, n = response.outputs
        # y went into the caller's region: a reference, its bytes there.
        assert y.shared_memory == ref("out", 8, X.nbytes)
        assert (y.name, y.datatype, list(y.shape), y.raw_data) == ("y", "FP32", [3, 4], b"")
        np.testing.assert_array_equal(
            np.frombuffer(r.read("out", X.nbytes, 8), np.float32).reshape(3, 4), X * 2
        )
        np.testing.assert_array_equal(codec.decode(n), [12])
        # The server got the bytes, as a plain call of the same input would send them: one
        # body, so one affinity key and one cache entry for both.
        [(method, body)] = r.bodies()
        assert (method, body) == ("", codec.encode_predict({"x": X}, [], "m"))


async def test_a_model_infer_in_regions_is_forwarded_as_bytes_and_answered_in_them(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path) as r:
        register_kserve = r.kserve.SystemSharedMemoryRegister
        key = r.object("in", bytes(16) + X.tobytes())
        await register_kserve(
            kpb.SystemSharedMemoryRegisterRequest(name="in", key=key, offset=16, byte_size=X.nbytes)
        )
        key = r.object("out", bytes(X.nbytes))
        await register_kserve(
            kpb.SystemSharedMemoryRegisterRequest(name="out", key=key, byte_size=X.nbytes)
        )
        request = kpb.ModelInferRequest(
            model_name="m",
            id="call-1",
            inputs=[Input(name="x", datatype="FP32", shape=X.shape, parameters=triton("in", 48))],
            outputs=[Output(name="y", parameters=triton("out", X.nbytes)), Output(name="n")],
        )
        response = await r.kserve.ModelInfer(request)
        # Triton's shape: every output's tensor, an empty entry for the one in the region
        # (the server's: where it went, and its bytes, in its parameters).
        assert [(o.name, list(o.shape)) for o in response.outputs] == [("y", [3, 4]), ("n", [1])]
        assert response.raw_output_contents[0] == b""
        y = response.outputs[0].parameters
        assert (
            y["shared_memory_region"].string_param,
            y["shared_memory_byte_size"].int64_param,
        ) == (
            "out",
            X.nbytes,
        )
        assert "shared_memory_offset" not in y
        assert np.frombuffer(response.raw_output_contents[1], np.int64).tolist() == [12]
        assert response.id == "call-1"
        np.testing.assert_array_equal(
            np.frombuffer(r.read("out", X.nbytes), np.float32).reshape(3, 4), X * 2
        )
        [(method, body)] = r.bodies()
        plain = kpb.ModelInferRequest(
            model_name="m",
            id="call-1",
            inputs=[Input(name="x", datatype="FP32", shape=X.shape)],
            outputs=[Output(name="y"), Output(name="n")],
            raw_input_contents=[X.tobytes()],
        )
        assert (method, body) == (INFER, plain.SerializeToString())


async def test_inputs_in_regions_and_in_the_body_go_together(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        w = np.ones((2,), np.int64)
        request = pb.PredictRequest(inputs=[shared("x", "in"), codec.encode("w", w, typed=True)])
        response = await r.v1.Predict(request)
        np.testing.assert_array_equal(codec.decode_all(response.outputs)["y"], X * 2)
        [(_, body)] = r.bodies()
        sent = codec.decode_all(pb.PredictRequest.FromString(body).inputs)
        np.testing.assert_array_equal(sent["w"], w)
        # KServe: the other inputs' raw entries keep their order around the region's.
        request_k = kpb.ModelInferRequest(
            inputs=[
                Input(name="w", datatype="FP32", shape=[2]),
                Input(name="x", datatype="FP32", shape=X.shape, parameters=triton("in", 48)),
                Input(name="v", datatype="FP32", shape=[1]),
            ],
            raw_input_contents=[np.ones(2, np.float32).tobytes(), np.float32(5).tobytes()],
        )
        answer = await r.kserve.ModelInfer(request_k)
        assert answer.outputs[0].name == "y"
        sent_k = kpb.ModelInferRequest.FromString(r.bodies()[-1][1])
        assert list(sent_k.raw_input_contents) == [
            np.ones(2, np.float32).tobytes(),
            X.tobytes(),
            np.float32(5).tobytes(),
        ]


async def test_identical_inputs_in_regions_meet_on_one_server(tmp_path: Path) -> None:
    async with rig(tmp_path, servers=5) as r:
        for i in range(4):
            await register(r.v1, f"r{i}", r.object(f"r{i}", X.tobytes()), X.nbytes)
        for i in range(4):
            await r.v1.Predict(pb.PredictRequest(inputs=[shared("x", f"r{i}")]))
        # A plain call of the same input, as the client writes its body.
        plain = r.channel.unary_unary(
            f"/{SERVICE}/Predict", request_serializer=None, response_deserializer=None
        )
        await plain(codec.encode_predict({"x": X}))
        assert [len(s.bodies) for s in r.servers if s.bodies] == [5]


async def test_typed_outputs_stay_typed_beside_an_output_in_a_region(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", bytes(X.nbytes)), X.nbytes)
        request = pb.PredictRequest(
            inputs=[shared("x", "in")], output_memory={"y": ref("out")}, typed_outputs=True
        )
        y, n = (await r.v1.Predict(request)).outputs
        assert y.HasField("shared_memory") and not y.fp32_data
        assert list(n.int64_data) == [12] and not n.raw_data


async def test_a_predict_stream_message_takes_regions_too(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", bytes(X.nbytes)), X.nbytes)
        body = pb.PredictRequest(inputs=[shared("x", "in")], output_memory={"y": ref("out")})
        message = pb.StreamRequest(id=7, request=body.SerializeToString())
        call = r.v1.PredictStream(iter([message]))
        [answer] = [m async for m in call]
        assert (answer.id, answer.code) == (7, 0), answer.message
        y = pb.PredictResponse.FromString(answer.response).outputs[0]
        assert y.shared_memory == ref("out")
        np.testing.assert_array_equal(
            np.frombuffer(r.read("out", X.nbytes), np.float32), X.ravel() * 2
        )


async def test_an_output_that_cannot_be_written_back_is_the_calls_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied (tenants), an output whose write-back fails answers INTERNAL with why, on a
    unary call and on a stream, and the call is counted so."""

    def failing(copy: shm.Copy) -> SluiceError:
        return SluiceError("shared memory region 'out': could not be written: No space")

    monkeypatch.setattr(shm, "write_back", failing)
    async with rig(tmp_path, copy=True) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", b"\xee" * X.nbytes), X.nbytes)
        body = pb.PredictRequest(inputs=[shared("x", "in")], output_memory={"y": ref("out")})
        assert await status_of(r.v1.Predict(body)) == (
            grpc.StatusCode.INTERNAL,
            "shared memory region 'out': could not be written: No space",
        )
        message = pb.StreamRequest(id=7, request=body.SerializeToString())
        [answer] = [m async for m in r.v1.PredictStream(iter([message]), timeout=60)]
        assert (answer.id, answer.code) == (7, Code.INTERNAL)
        assert answer.message == "shared memory region 'out': could not be written: No space"
        assert r.service.stats.errors["INTERNAL"] == 2
        assert r.read("out", X.nbytes) == b"\xee" * X.nbytes


async def test_a_call_split_over_servers_is_answered_in_regions_whole(tmp_path: Path) -> None:
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    async with rig(tmp_path, servers=3, fanout_rows=4) as r:
        await register(r.v1, "in", r.object("in", x.tobytes()), x.nbytes)
        await register(r.v1, "out", r.object("out", bytes(x.nbytes)), x.nbytes)
        request = pb.PredictRequest(
            inputs=[shared("x", "in", x)],
            outputs=["y"],  # a row-wise output: the answers to the chunks merge
            output_memory={"y": ref("out", 0, x.nbytes)},
        )
        (y,) = (await r.v1.Predict(request)).outputs
        assert y.shared_memory == ref("out", 0, x.nbytes)
        got = np.frombuffer(r.read("out", x.nbytes), np.float32).reshape(10, 4)
        np.testing.assert_array_equal(got, x * 2)
        assert sorted(len(s.bodies) for s in r.servers) == [1, 1, 1]  # three chunks


def test_a_regions_bytes_are_copied_once_straight_into_the_body(tmp_path: Path) -> None:
    image = np.random.default_rng(3).random((1, 3, 224, 224), np.float32)
    (tmp_path / "obj").write_bytes(image.tobytes())
    regions = Regions(root=tmp_path)
    regions.register("", "in", "/obj", 0, image.nbytes)
    memory = balancer_regions.SharedMemory(regions, gate=None)  # type: ignore[arg-type]
    placed = {"shared_memory_region": Parameter(string_param="in")}
    placed["shared_memory_byte_size"] = Parameter(int64_param=image.nbytes)
    bodies = [
        (facts.PREDICT, pb.PredictRequest(inputs=[shared("x", "in", image)])),
        (
            facts.MODEL_INFER,
            kpb.ModelInferRequest(
                inputs=[Input(name="x", datatype="FP32", shape=image.shape, parameters=placed)]
            ),
        ),
    ]
    try:
        for kind, request in bodies:
            body = request.SerializeToString()
            tracemalloc.start()
            try:
                placing = memory.prepare(body, kind, "")
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert placing is not None
            assert image.tobytes() in placing.body
            placing.release()
            # The body is the one block of its size this made: no copy on the way.
            assert image.nbytes < peak < 1.05 * image.nbytes, kind.message
    finally:
        regions.close()


# The region calls.


async def test_regions_are_registered_listed_and_let_go_on_both_faces(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        key = r.object("obj", bytes(100))
        await register(r.v1, "a", key, 10)
        await r.kserve.SystemSharedMemoryRegister(
            kpb.SystemSharedMemoryRegisterRequest(name="b", key=key, offset=50, byte_size=50)
        )
        listed = await r.v1.RegionStatus(pb.RegionStatusRequest())
        assert [(i.name, i.key, i.offset, i.byte_size) for i in listed.regions] == [
            ("a", key, 0, 10),
            ("b", key, 50, 50),
        ]
        one = await r.kserve.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest(name="b"))
        assert {n: (s.key, s.offset, s.byte_size) for n, s in one.regions.items()} == {
            "b": (key, 50, 50)
        }
        assert await status_of(r.v1.RegionStatus(pb.RegionStatusRequest(name="c"))) == (
            grpc.StatusCode.NOT_FOUND,
            "Unable to find system shared memory region: 'c'",
        )
        assert await status_of(register(r.v1, "a", key, 10)) == (
            grpc.StatusCode.ALREADY_EXISTS,
            "shared memory region 'a' already in manager",
        )
        await r.kserve.SystemSharedMemoryUnregister(
            kpb.SystemSharedMemoryUnregisterRequest(name="a")
        )
        await r.v1.UnregisterRegion(pb.UnregisterRegionRequest(name="gone"))  # no error: Triton's
        listed = await r.kserve.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest())
        assert list(listed.regions) == ["b"]
        await r.v1.UnregisterRegion(pb.UnregisterRegionRequest())  # all of them
        assert not (await r.v1.RegionStatus(pb.RegionStatusRequest())).regions
        # CUDA shared memory, as the server answers it (Triton's without GPUs).
        assert not (
            await r.kserve.CudaSharedMemoryStatus(kpb.CudaSharedMemoryStatusRequest())
        ).regions
        assert await status_of(
            r.kserve.CudaSharedMemoryStatus(kpb.CudaSharedMemoryStatusRequest(name="g"))
        ) == (grpc.StatusCode.NOT_FOUND, "Unable to find cuda shared memory region: 'g'")
        assert await status_of(
            r.kserve.CudaSharedMemoryRegister(kpb.CudaSharedMemoryRegisterRequest(name="g"))
        ) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "failed to register CUDA shared memory region: 'g', GPUs not supported: Sluice "
            "takes system shared memory only",
        )
        await r.kserve.CudaSharedMemoryUnregister(kpb.CudaSharedMemoryUnregisterRequest(name="g"))
        metadata = await r.kserve.ServerMetadata(kpb.ServerMetadataRequest())
        assert list(metadata.extensions) == ["system_shared_memory"]  # what Triton's clients ask
        # Registering with the balancer never reaches a server.
        assert [s.unary_calls for s in r.servers] == [[]] and r.bodies() == []


async def test_each_tenant_has_its_own_regions(tmp_path: Path) -> None:
    a, b = (authorization(KEY_A),), (authorization(KEY_B),)
    async with rig(tmp_path, tenants=True) as r:
        await register(r.v1, "in", r.object("a", X.tobytes()), X.nbytes, metadata=a)
        assert await status_of(register(r.v1, "in", "/a", X.nbytes)) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "unauthenticated: the call carries no API key (send 'authorization: Bearer KEY')",
        )
        # Another tenant's region is, to b, one nobody registered.
        assert await status_of(
            r.kserve.SystemSharedMemoryStatus(
                kpb.SystemSharedMemoryStatusRequest(name="in"), metadata=b
            )
        ) == (grpc.StatusCode.NOT_FOUND, "Unable to find system shared memory region: 'in'")
        request = pb.PredictRequest(inputs=[shared("x", "in")])
        assert await status_of(r.v1.Predict(request, metadata=b)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "tensor 'x': Unable to find shared memory region: 'in'",
        )
        # b's own "in", beside a's.
        await register(r.v1, "in", r.object("b", (X + 1).tobytes()), X.nbytes, metadata=b)
        for who, x in ((a, X), (b, X + 1)):
            response = await r.v1.Predict(request, metadata=who)
            np.testing.assert_array_equal(codec.decode_all(response.outputs)["y"], x * 2)


@pytest.mark.parametrize(
    ("bounds", "sizes", "message"),
    [
        ({"max_regions": 1}, (10, 10), "(--shared-memory-regions 1); unregister one first"),
        ({"max_bytes": 100}, (60, 60), "to 120, over the most allowed (--shared-memory-bytes 100)"),
    ],
)
async def test_too_many_regions_or_bytes_are_refused(
    tmp_path: Path, bounds: dict[str, int], sizes: tuple[int, int], message: str
) -> None:
    async with rig(tmp_path, **bounds) as r:  # type: ignore[arg-type]
        key = r.object("obj", bytes(200))
        await register(r.v1, "r0", key, sizes[0])
        code, details = await status_of(register(r.v1, "r1", key, sizes[1]))
        assert (code, details.startswith("quota: "), message in details) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            True,
            True,
        )


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("/dir/obj", "must be a POSIX shared memory name"),  # a path
        ("/o\0bj", "must be a POSIX shared memory name"),
        ("/" + "o" * 300, "must be a POSIX shared memory name"),  # overlong
        ("/..", "must be a POSIX shared memory name"),
        ("/link", "shared memory key '/link' is not shared memory: a symbolic link"),
        ("/dir", "shared memory key '/dir' is not shared memory: a directory"),
        ("/fifo", "shared memory key '/fifo' is not shared memory: not a regular file"),
        ("/absent", "Unable to open shared memory region: '/absent'"),
    ],
)
async def test_a_key_that_is_no_shared_memory_object_is_refused(
    tmp_path: Path, key: str, message: str
) -> None:
    async with rig(tmp_path) as r:
        r.object("obj", bytes(8))
        (tmp_path / "dir").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "obj")
        os.mkfifo(tmp_path / "fifo")
        code, details = await status_of(register(r.v1, "r", key, 8))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in details


async def test_a_range_past_the_objects_end_is_refused_at_registration(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        key = r.object("obj", bytes(8))
        request = kpb.SystemSharedMemoryRegisterRequest(name="r", key=key, offset=4, byte_size=8)
        assert await status_of(r.kserve.SystemSharedMemoryRegister(request)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "shared memory region 'r': offset 4 + byte size 8 is past the end of '/obj' (8 bytes)",
        )
        huge = kpb.SystemSharedMemoryRegisterRequest(
            name="r", key=key, offset=2**64 - 1, byte_size=8
        )
        assert await status_of(r.kserve.SystemSharedMemoryRegister(huge)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"shared memory region 'r': offset {2**64 - 1} + byte size 8 is past the end of "
            "'/obj' (8 bytes)",
        )


# Bodies that name regions badly: each refused with its status, none reaching a server.

RANGE = "Invalid offset + byte size for shared memory region: 'in'"


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (
            pb.PredictRequest(inputs=[shared("x", "nope")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tensor 'x': Unable to find shared memory region: 'nope'",
        ),
        (
            pb.PredictRequest(inputs=[shared("x", "in", offset=8)]),  # past the region's end
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor 'x': {RANGE} (offset 8 + byte size 48, in a region of 48 bytes)",
        ),
        (
            pb.PredictRequest(inputs=[shared("x", "in", offset=2**64 - 1)]),  # overflow
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor 'x': {RANGE} (offset {2**64 - 1} + byte size 48",
        ),
        (
            pb.PredictRequest(inputs=[shared("x", "in", byte_size=40)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tensor 'x' has shared_memory byte_size 40 but FP32 shape [3, 4] needs 48 "
            "(12 x 4 bytes)",
        ),
        (
            pb.PredictRequest(
                inputs=[
                    pb.Tensor(
                        name="x",
                        datatype="FP32",
                        shape=[3, 4],
                        raw_data=X.tobytes(),
                        shared_memory=ref("in"),
                    )
                ]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tensor 'x' carries both raw_data and shared_memory; send its bytes one way",
        ),
        (
            pb.PredictRequest(
                inputs=[codec.encode("x", X)], output_memory={"y": ref("out", 0, 40)}
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "output_memory of output 'y' (40 bytes at offset 0 of region 'out') is too small "
            "for its 48 bytes (FP32 shape [3, 4])",
        ),
        (
            pb.PredictRequest(inputs=[codec.encode("x", X)], output_memory={"z": ref("out")}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "output_memory names output 'z', which this call does not return (it returns 'y', 'n')",
        ),
        (
            pb.PredictRequest(
                inputs=[codec.encode("x", X)],
                output_memory={"y": ref("out", 0, 40), "n": ref("out", 32, 8)},
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "output_memory of output 'n': shared memory region 'out': bytes [32, 40) overlap "
            "bytes [0, 40) this call writes another output into; give each output its own bytes",
        ),
        (
            pb.PredictRequest(inputs=[codec.encode("x", X)], output_memory={"y": ref("nope")}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "output_memory of output 'y': Unable to find shared memory region: 'nope'",
        ),
    ],
)
async def test_a_predict_naming_regions_badly_is_refused(
    tmp_path: Path, request_: pb.PredictRequest, code: grpc.StatusCode, message: str
) -> None:
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", b"\xee" * X.nbytes), X.nbytes)
        got, details = await status_of(r.v1.Predict(request_))
        assert (got, details[: len(message)]) == (code, message)
        assert r.read("out", X.nbytes) == b"\xee" * X.nbytes  # a refused call writes nothing


def kserve_input(params: dict[str, Parameter], **kw: object) -> kpb.ModelInferRequest:
    return kpb.ModelInferRequest(
        model_name="m",
        inputs=[Input(name="x", datatype="FP32", shape=X.shape, parameters=params, **kw)],  # type: ignore[arg-type]
    )


async def test_typed_values_beside_an_input_in_a_region_go_as_raw_entries(
    tmp_path: Path,
) -> None:
    """As a server with the regions takes them: the other inputs' values typed in contents
    (no raw entries) are forwarded as raw entries beside the region's bytes."""
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        request = kpb.ModelInferRequest(
            model_name="m",
            inputs=[
                Input(name="x", datatype="FP32", shape=X.shape, parameters=triton("in", 48)),
                Input(
                    name="w",
                    datatype="FP32",
                    shape=[2],
                    contents=kpb.InferTensorContents(fp32_contents=[7.0, -1.0]),
                ),
            ],
            outputs=[Output(name="n")],
        )
        response = await r.kserve.ModelInfer(request)
        assert np.frombuffer(response.raw_output_contents[0], np.int64).tolist() == [12]
        [(method, body)] = r.bodies()
        sent = kpb.ModelInferRequest.FromString(body)
        assert method == INFER and not any(t.HasField("contents") for t in sent.inputs)
        assert list(sent.raw_input_contents) == [
            X.tobytes(),
            np.array([7, -1], np.float32).tobytes(),
        ]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (kserve_input(triton("nope", 48)), "Unable to find shared memory region: 'nope'"),
        (kserve_input(triton("in", 48, offset=-4)), f"{RANGE} (offset -4 + byte size 48"),
        (kserve_input(triton("in", 48, offset=8)), f"{RANGE} (offset 8 + byte size 48"),
        (  # the size checked before the region is read
            kserve_input(triton("in", -1)),
            "input byte size mismatch for input 'x' for model 'm'. Expected 48, got -1",
        ),
        (
            kserve_input(triton("in", 44)),
            "input byte size mismatch for input 'x' for model 'm'. Expected 48, got 44 "
            "('shared_memory_byte_size'; FP32 shape [3, 4] is 12 x 4 bytes)",
        ),
        (
            kserve_input({"shared_memory_region": Parameter(int64_param=1)}),
            "invalid value type for 'shared_memory_region' parameter for input 'x', expected "
            "string_param",
        ),
        (
            kserve_input({"shared_memory_region": Parameter(string_param="in")}),
            "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
            "parameter for input 'x'",
        ),
        (
            kserve_input(
                {
                    "shared_memory_region": Parameter(string_param="in"),
                    "shared_memory_byte_size": Parameter(string_param="48"),
                }
            ),
            "invalid value type for 'shared_memory_byte_size' parameter for input 'x', "
            "expected int64_param",
        ),
        (
            kserve_input(
                triton("in", 48), contents=kpb.InferTensorContents(fp32_contents=[1.0] * 12)
            ),
            "unexpected 'content' provided when using shared memory for input 'x' for model 'm'",
        ),
        # The server's checks of a datatype and a shape, in its words, before any is asked.
        (
            kpb.ModelInferRequest(
                inputs=[Input(name="x", datatype="BYTES", shape=[1], parameters=triton("in", 8))]
            ),
            "input 'x' is BYTES, which Sluice does not serve: its models take numeric tensors",
        ),
        (
            kpb.ModelInferRequest(
                inputs=[
                    Input(name="x", datatype="FP32", shape=[1] * 65, parameters=triton("in", 4))
                ]
            ),
            "input 'x' has 65 dimensions; at most 64 are allowed",
        ),
        (
            kpb.ModelInferRequest(
                inputs=[
                    Input(name="x", datatype="FP32", shape=X.shape, parameters=triton("in", 48)),
                    Input(name="w", datatype="FP32", shape=[1]),
                ],
                raw_input_contents=[b"\0" * 4, b"\0" * 4],
            ),
            "raw_input_contents has 2 entries but the request has 1 inputs not in shared memory; "
            "send one entry per such input, in order, or none",
        ),
        (  # typed values, checked as the server checks them
            kpb.ModelInferRequest(
                inputs=[
                    Input(name="x", datatype="FP32", shape=X.shape, parameters=triton("in", 48)),
                    Input(
                        name="w",
                        datatype="FP32",
                        shape=[2],
                        contents=kpb.InferTensorContents(fp32_contents=[1.0]),
                    ),
                ]
            ),
            "input 'w' has 1 values in contents.fp32_contents but shape [2] needs 2",
        ),
        (
            kpb.ModelInferRequest(
                inputs=[Input(name="x", datatype="FP32", shape=X.shape)],
                outputs=[Output(name="y", parameters=triton("out", 40))],
                raw_input_contents=[X.tobytes()],
            ),
            "shared memory size specified with the request for output 'y' (40 bytes) should be "
            "at least 48 bytes to hold the results",
        ),
        (
            kpb.ModelInferRequest(
                inputs=[Input(name="x", datatype="FP32", shape=X.shape)],
                outputs=[Output(name="y", parameters=triton("out", 48, offset=8))],
                raw_input_contents=[X.tobytes()],
            ),
            "Invalid offset + byte size for shared memory region: 'out' (offset 8 + byte size 48",
        ),
        (
            kpb.ModelInferRequest(
                inputs=[Input(name="x", datatype="FP32", shape=X.shape)],
                outputs=[
                    Output(name="y", parameters=triton("out", 40)),
                    Output(name="n", parameters=triton("out", 8, offset=32)),
                ],
                raw_input_contents=[X.tobytes()],
            ),
            "shared memory region 'out': bytes [32, 40) overlap bytes [0, 40) this call writes "
            "another output into; give each output its own bytes",
        ),
    ],
)
async def test_a_model_infer_naming_regions_badly_is_refused(
    tmp_path: Path, request_: kpb.ModelInferRequest, message: str
) -> None:
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", b"\xee" * X.nbytes), X.nbytes)
        got, details = await status_of(r.kserve.ModelInfer(request_))
        assert (got, details[: len(message)]) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert r.read("out", X.nbytes) == b"\xee" * X.nbytes


async def test_with_shared_memory_off_its_calls_and_bodies_are_refused(tmp_path: Path) -> None:
    async with rig(tmp_path, on=False) as r:
        r.object("in", X.tobytes())
        calls = [
            register(r.v1, "in", "/in", X.nbytes),
            r.v1.RegionStatus(pb.RegionStatusRequest()),
            r.v1.UnregisterRegion(pb.UnregisterRegionRequest()),
            r.kserve.SystemSharedMemoryRegister(
                kpb.SystemSharedMemoryRegisterRequest(name="in", key="/in", byte_size=8)
            ),
            r.kserve.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest()),
            r.kserve.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest()),
        ]
        for call in calls:
            assert await status_of(call) == (grpc.StatusCode.UNIMPLEMENTED, OFF)
        # A body naming a region is refused naming what names it, as a server refuses it.
        bodies = [
            (
                r.v1.Predict(pb.PredictRequest(inputs=[shared("x", "in")])),
                "tensor 'x' names shared memory region 'in'",
            ),
            (
                r.v1.Predict(
                    pb.PredictRequest(inputs=[codec.encode("x", X)], output_memory={"y": ref("in")})
                ),
                "output_memory names shared memory for output 'y'",
            ),
            (
                r.kserve.ModelInfer(kserve_input(triton("in", 48))),
                "input 'x' names a shared memory region",
            ),
        ]
        for call, what in bodies:
            assert await status_of(call) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}; {NO_SHARED_MEMORY}",
            )
        assert NO_SHARED_MEMORY == (
            "Sluice does not serve shared memory here: start sluice-balancer with "
            "--shared-memory (for callers on its host), or send the values in the request"
        )
        assert not (await r.kserve.ServerMetadata(kpb.ServerMetadataRequest())).extensions
        assert r.bodies() == []
        # What names no region goes on as before.
        response = await r.v1.Predict(pb.PredictRequest(inputs=[codec.encode("x", X)]))
        np.testing.assert_array_equal(codec.decode_all(response.outputs)["y"], X * 2)
        # A value that holds the parameter's name is no region.
        request = kpb.ModelInferRequest(
            id="shared_memory_region",
            inputs=[Input(name="x", datatype="FP32", shape=X.shape)],
            raw_input_contents=[X.tobytes()],
        )
        assert (await r.kserve.ModelInfer(request)).outputs[0].name == "y"


# Retries, and the call's end.


async def test_the_answer_returned_is_the_one_written_after_a_retry(tmp_path: Path) -> None:
    async with rig(tmp_path, servers=2) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", bytes(X.nbytes)), X.nbytes)
        request = pb.PredictRequest(inputs=[shared("x", "in")], output_memory={"y": ref("out")})
        first = next(s for s in r.servers if not s.bodies)
        for server in r.servers:
            server.fail = Reply(Code.UNAVAILABLE, "gone", retryable=True)
        await status_of(r.v1.Predict(request))  # every attempt failed: nothing written
        assert r.read("out", X.nbytes) == bytes(X.nbytes)
        first.fail = None
        await r.v1.Predict(request)
        np.testing.assert_array_equal(
            np.frombuffer(r.read("out", X.nbytes), np.float32), X.ravel() * 2
        )
        # Every attempt carried the same bytes.
        assert len({body for _, body in r.bodies()}) == 1


async def test_a_leases_writes_end_with_its_call_however_it_ends(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", bytes(X.nbytes)), X.nbytes)
        request = pb.PredictRequest(inputs=[shared("x", "in")], output_memory={"y": ref("out")})
        [server] = r.servers
        server.hold = asyncio.Event()
        held = r.v1.Predict(request)
        await wait_until(lambda: len(server.bodies) == 1)
        # Another call writing the same bytes meanwhile is refused.
        code, details = await status_of(r.v1.Predict(request))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "overlap bytes [0, 48) another call is writing" in details
        held.cancel()  # the caller gives up: its lease goes with it
        with pytest.raises(asyncio.CancelledError):
            await held
        server.hold = None
        await wait_until(lambda: not r.service.stats.in_flight)
        await r.v1.Predict(request)
        server.fail = Reply(Code.INVALID_ARGUMENT, "no")  # failed: released too
        await status_of(r.v1.Predict(request))
        server.fail = None
        await r.v1.Predict(request)


async def test_a_region_let_go_under_a_call_is_read_and_written_to_its_end(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        await register(r.v1, "in", r.object("in", X.tobytes()), X.nbytes)
        await register(r.v1, "out", r.object("out", bytes(X.nbytes)), X.nbytes)
        [server] = r.servers
        server.hold = asyncio.Event()
        request = pb.PredictRequest(inputs=[shared("x", "in")], output_memory={"y": ref("out")})
        held = asyncio.ensure_future(r.v1.Predict(request))
        await wait_until(lambda: len(server.bodies) == 1)
        await r.v1.UnregisterRegion(pb.UnregisterRegionRequest())
        server.hold.set()
        await held
        np.testing.assert_array_equal(
            np.frombuffer(r.read("out", X.nbytes), np.float32), X.ravel() * 2
        )


async def test_a_region_whose_object_is_unlinked_is_swept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    regions = Regions(root=tmp_path)
    (tmp_path / "obj").write_bytes(bytes(8))
    regions.register("", "r", "/obj", 0, 8)
    log = logging.getLogger("sluice.balancer")
    sweeping = asyncio.create_task(sweep(regions, log, every_s=0.01))
    try:
        with caplog.at_level(logging.INFO, log.name):
            (tmp_path / "obj").unlink()
            await wait_until(lambda: not len(regions))
        assert "shared memory region 'r' let go: its object was unlinked" in caplog.text
    finally:
        sweeping.cancel()
        regions.close()


def test_shared_memory_takes_one_balancer_process() -> None:
    with pytest.raises(ValueError, match="--shared-memory needs --workers 1"):
        BalancerSettings(backend=["h:1"], shared_memory=True, workers=2)


async def wait_until(condition: object, timeout: float = 30.0) -> None:
    """Poll `condition` (a callable) until true (bounded: a hang fails the test)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)
