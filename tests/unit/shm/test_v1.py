"""Shared memory in the sluice.v1 API, in one process on real /dev/shm objects: the codec
reads inputs as views of a region and writes outputs into one, the v1 protocol refuses each
bad reference by name, the route sees which bodies name regions, the region calls, and the
client's own regions (placing, reading back, learning output sizes, cleaning up)."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.client import SluiceClient
from sluice.client.diagnose import Audience
from sluice.core.errors import (
    AlreadyExists,
    InvalidInput,
    PermissionDenied,
    QuotaExceeded,
    RegionNotFound,
    SluiceError,
    Unimplemented,
)
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.server.dataplane.engine import TensorSpec
from sluice.server.dataplane.modelsettings import WireType
from sluice.server.v1 import NO_SHARED_MEMORY, WIRE_READ_FROM, SluiceV1, _specs
from sluice.shm import client as client_shm
from sluice.shm import refs, scan
from sluice.shm.calls import RegionCalls, on_this_host
from sluice.shm.registry import Regions
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

SHARED = SluiceV1(shared_memory=True)
V1 = SluiceV1()
X = np.arange(12, dtype=np.float32).reshape(3, 4)


def objects() -> set[str]:
    """This process's client objects in /dev/shm."""
    mine = f"{client_shm.PREFIX}{os.getpid()}-"
    return {n for n in os.listdir(client_shm.ROOT) if n.startswith(mine)}


@pytest.fixture
def regions() -> Iterator[Regions]:
    held = Regions()
    yield held
    held.close()


@dataclass
class Region:
    """A client segment registered as region `name` (the tenant "")."""

    name: str
    segment: client_shm.Segment

    def put(self, offset: int, array: np.ndarray) -> refs.Ref:
        n = codec.write(self.segment.view[offset:], array)
        return refs.Ref(self.name, offset, n)

    def read(self, ref: refs.Ref, dtype: str) -> np.ndarray:
        end = ref.offset + ref.byte_size
        return np.frombuffer(self.segment.view[ref.offset : end], dtype).copy()


@pytest.fixture
def region(regions: Regions) -> Iterator[Region]:
    segment = client_shm.Segment(1 << 16)
    regions.register("", "r", segment.key, 0, segment.size)
    yield Region("r", segment)
    regions.unregister("", "r")
    segment.close()


def memory_ref(ref: refs.Ref) -> pb.SharedMemoryRef:
    return pb.SharedMemoryRef(region=ref.region, offset=ref.offset, byte_size=ref.byte_size)


def request(
    inputs: list[pb.Tensor], output_memory: dict[str, refs.Ref] | None = None, **fields: object
) -> bytes:
    memory = {n: memory_ref(r) for n, r in (output_memory or {}).items()}
    message = pb.PredictRequest(inputs=inputs, output_memory=memory, **fields)
    return message.SerializeToString()


class Model:
    name = "m"
    version = "1"


# The codec and the v1 protocol.


def test_an_input_in_shared_memory_is_a_view_of_the_region(
    regions: Regions, region: Region
) -> None:
    ref = region.put(64, X)
    body = request([refs.shared_tensor("x", X, ref)])
    with regions.lease("") as lease:
        got = SHARED.decode(body, lease).inputs["x"]
        np.testing.assert_array_equal(got, X)
        assert not got.flags.writeable
        region.segment.view[64:68] = np.float32(-1).tobytes()  # the caller writes: seen
        assert got[0, 0] == -1


def test_outputs_are_written_into_their_regions_and_the_answer_says_where(
    regions: Regions, region: Region
) -> None:
    y, z = X * 2, np.array([7, 8], np.int64)
    out = refs.Ref("r", 1024, 4096)
    body = request([codec.encode("x", X)], {"y": out})
    with regions.lease("") as lease:
        decoded = SHARED.decode(body, lease)
        answer = SHARED.encode(Model(), decoded, {"y": y, "z": z})
    response = pb.PredictResponse.FromString(answer)
    tensor = response.outputs[0]
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("y", "FP32", [3, 4])
    assert not tensor.raw_data
    assert refs.ref_of(tensor.shared_memory) == refs.Ref("r", 1024, y.nbytes)
    np.testing.assert_array_equal(region.read(refs.ref_of(tensor.shared_memory), "<f4"), y.ravel())
    assert codec.decode(response.outputs[1]).tolist() == [7, 8]  # not placed: its bytes
    # Written by hand as protobuf writes it; typed outputs alike, through protobuf.
    assert answer == response.SerializeToString()
    typed = request([codec.encode("x", X)], {"y": out}, typed_outputs=True)
    with regions.lease("") as lease:
        answer = SHARED.encode(Model(), SHARED.decode(typed, lease), {"y": y, "z": z})
    response = pb.PredictResponse.FromString(answer)
    assert response.outputs[0].HasField("shared_memory")
    assert list(response.outputs[1].int64_data) == [7, 8]


def test_a_large_body_with_a_tensor_in_shared_memory_is_read_by_the_parser(
    regions: Regions, region: Region
) -> None:
    big = np.ones((1, WIRE_READ_FROM), np.uint8)
    ref = region.put(0, X)
    body = request([codec.encode("big", big), refs.shared_tensor("x", X, ref)])
    assert len(body) >= WIRE_READ_FROM
    assert codec.decode_predict(body) is None  # the wire read leaves it to the parser
    with regions.lease("") as lease:
        inputs = SHARED.decode(body, lease).inputs
        np.testing.assert_array_equal(inputs["x"], X)
        np.testing.assert_array_equal(inputs["big"], big)


def refused(body: bytes, regions: Regions) -> SluiceError:
    with regions.lease("") as lease, pytest.raises(SluiceError) as caught:
        SHARED.decode(body, lease)
    return caught.value


def test_bad_references_are_refused_naming_the_tensor(regions: Regions, region: Region) -> None:
    ref = region.put(0, X)
    both = refs.shared_tensor("x", X, ref)
    both.raw_data = X.tobytes()
    error = refused(request([both]), regions)
    assert isinstance(error, InvalidInput)
    assert "tensor 'x' carries both raw_data and shared_memory" in str(error)
    typed = refs.shared_tensor("x", X, ref)
    typed.fp32_data.extend(X.ravel().tolist())
    assert "carries both fp32_data and shared_memory" in str(refused(request([typed]), regions))
    short = refs.shared_tensor("x", X, ref._replace(byte_size=40))
    error = refused(request([short]), regions)
    assert isinstance(error, InvalidInput)
    assert "tensor 'x' has shared_memory byte_size 40 but FP32 shape [3, 4] needs 48" in str(error)
    unknown = refs.shared_tensor("x", X, ref._replace(region="nobody"))
    error = refused(request([unknown]), regions)
    assert type(error) is InvalidInput
    assert str(error).startswith("tensor 'x': Unable to find shared memory region: 'nobody'")
    past = refs.shared_tensor("x", X, ref._replace(offset=region.segment.size - 8))
    error = refused(request([past]), regions)
    assert type(error) is InvalidInput
    assert str(error).startswith("tensor 'x': Invalid offset + byte size")


def test_bad_output_memory_is_refused_naming_the_output(regions: Regions, region: Region) -> None:
    body = request([codec.encode("x", X)], {"y": refs.Ref("nobody", 0, 48)})
    error = refused(body, regions)  # before the model runs
    assert type(error) is InvalidInput
    assert str(error).startswith("output_memory of output 'y': Unable to find")
    body = request([codec.encode("x", X)], {"y": refs.Ref("r", 1 << 16, 48)})
    assert "output_memory of output 'y': Invalid offset" in str(refused(body, regions))
    overlap = {"a": refs.Ref("r", 0, 48), "b": refs.Ref("r", 40, 8), "c": refs.Ref("r", 48, 8)}
    error = refused(request([codec.encode("x", X)], overlap), regions)
    assert type(error) is InvalidInput
    assert str(error) == (
        "output_memory of output 'b': shared memory region 'r': bytes [40, 48) overlap bytes "
        "[0, 48) this call writes another output into; give each output its own bytes"
    )
    apart = {"a": refs.Ref("r", 0, 48), "b": refs.Ref("r", 48, 8)}
    with regions.lease("") as lease:
        assert list(SHARED.decode(request([codec.encode("x", X)], apart), lease).options.memory)
    # An output the call does not return, and one too small: refused, nothing written.
    for memory, words in (
        ({"w": refs.Ref("r", 0, 48), "y": refs.Ref("r", 64, 48)}, "names output 'w', which"),
        (
            {"y": refs.Ref("r", 64, 47)},
            "(47 bytes at offset 64 of region 'r') is too small for its 48",
        ),
    ):
        region.segment.view[:512] = bytes(512)
        with regions.lease("") as lease:
            decoded = SHARED.decode(request([codec.encode("x", X)], memory), lease)
            with pytest.raises(InvalidInput, match=re.escape(words)):
                SHARED.encode(Model(), decoded, {"y": X})
        assert bytes(region.segment.view[:512]) == bytes(512)
    assert refs.TOO_SMALL in words


@pytest.mark.parametrize("typed", [False, True])
def test_an_answer_refused_after_its_placed_outputs_writes_nothing(
    regions: Regions, region: Region, typed: bool
) -> None:
    """An output the API cannot carry refuses the answer: the output placed before it in
    the answer is not written either."""
    region.segment.view[:512] = bytes(512)
    body = request([codec.encode("x", X)], {"y": refs.Ref("r", 64, 48)}, typed_outputs=typed)
    with regions.lease("") as lease:
        decoded = SHARED.decode(body, lease)
        outputs = {"y": X, "z": np.zeros(2, np.complex64)}
        with pytest.raises(InvalidInput, match="numpy dtype complex64 has no API datatype"):
            SHARED.encode(Model(), decoded, outputs)
    assert bytes(region.segment.view[:512]) == bytes(512)


def test_with_shared_memory_off_a_region_is_refused_with_the_flag_to_start() -> None:
    segmentless = refs.shared_tensor("x", X, refs.Ref("r", 0, 48))
    with pytest.raises(InvalidInput) as caught:
        V1.decode(request([segmentless]))
    assert str(caught.value) == f"tensor 'x' names shared memory region 'r'; {NO_SHARED_MEMORY}"
    assert NO_SHARED_MEMORY == (
        "Sluice does not serve shared memory here: start sluice-server with --shared-memory "
        "(for callers on its host), or send the values in the request"
    )
    with pytest.raises(InvalidInput, match="output_memory names shared memory for output 'y'"):
        V1.decode(request([codec.encode("x", X)], {"y": refs.Ref("r", 0, 48)}))


def test_the_route_says_which_bodies_name_regions() -> None:
    plain = request([codec.encode("x", X)])
    inputs = request([codec.encode("x", X), refs.shared_tensor("z", X, refs.Ref("r", 0, 48))])
    outputs = request([codec.encode("x", X)], {"y": refs.Ref("r", 0, 48)})
    assert [scan.uses_regions(b) for b in (plain, inputs, outputs)] == [False, True, True]
    assert not SHARED.route(plain).shared
    assert SHARED.route(inputs).shared and SHARED.route(outputs).shared
    assert not V1.route(inputs).shared  # off: decode refuses it
    assert scan.uses_regions(b"\x0a\x05\x62")  # a tensor the walk cannot read: the decode's
    # Field 12 of another wire type is an unknown field to the parser, not a region.
    odd = plain + b"\x0a\x02\x60\x01"
    assert not pb.PredictRequest.FromString(odd).inputs[1].HasField("shared_memory")
    assert not scan.uses_regions(odd)


@given(
    raw=st.binary(max_size=3 * scan._SCAN_MOST),
    shared=st.booleans(),
    memory=st.booleans(),
)
def test_whether_a_body_names_regions_is_the_parsers_answer(
    raw: bytes, shared: bool, memory: bool
) -> None:
    tensor = pb.Tensor(name="x", datatype="UINT8", shape=[len(raw)], raw_data=raw)
    if shared:
        tensor.shared_memory.region = "r"
    body = request([tensor], {"y": refs.Ref("r", 0, 8)} if memory else None)
    parsed = pb.PredictRequest.FromString(body)
    want = bool(parsed.output_memory) or parsed.inputs[0].HasField("shared_memory")
    assert scan.uses_regions(body) is want


# The region calls.


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.8.9.10:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:%5B::1%5D:5000", True),  # as grpc names it
        ("ipv6:%5B::ffff:127.0.0.1%5D:5000", True),
        ("unix:", True),
        ("unix:/run/sluice.sock", True),
        ("unix-abstract:sluice", True),
        ("ipv4:10.0.0.5:5000", False),
        ("ipv4:192.0.2.1:5000", False),
        ("ipv6:%5B2001:db8::1%5D:5000", False),
        ("ipv6:%5B::ffff:10.0.0.5%5D:5000", False),
        ("ipv4:localhost:5000", False),  # grpc names an address, never a host name
        ("", False),
        ("junk", False),
    ],
)
def test_a_registration_is_taken_from_this_host_only(
    regions: Regions, peer: str, local: bool
) -> None:
    assert on_this_host(peer) is local
    segment = client_shm.Segment(4096)
    try:
        calls = RegionCalls(regions, "sluice-server")
        body = pb.RegisterRegionRequest(name="a", key=segment.key, byte_size=4096)
        kserve = kpb.SystemSharedMemoryRegisterRequest(name="b", key=segment.key, byte_size=4096)
        for fn, request_ in ((RegionCalls.register, body), (RegionCalls.system_register, kserve)):
            if local:
                calls.call(fn, "", peer, request_.SerializeToString())
            else:
                with pytest.raises(PermissionDenied) as caught:
                    calls.call(fn, "", peer, request_.SerializeToString())
                assert str(caught.value) == (
                    "shared memory regions are registered by callers on this host only (this "
                    f"call came from {peer})"
                )
        # Status and unregistering are the tenant's own, from wherever it calls.
        calls.call(RegionCalls.status, "", "ipv4:10.0.0.5:1", b"")
        calls.call(RegionCalls.unregister, "", "ipv4:10.0.0.5:1", b"")
        assert len(regions) == 0
    finally:
        regions.close()
        segment.close()
    off = RegionCalls(None, "sluice-server")  # off: that is said first
    with pytest.raises(Unimplemented):
        off.call(RegionCalls.register, "", "ipv4:10.0.0.5:1", b"")


def test_the_region_calls_register_report_and_unregister(regions: Regions) -> None:
    segment = client_shm.Segment(8192)
    try:
        calls = RegionCalls(regions, "sluice-server")
        register = pb.RegisterRegionRequest(name="a", key=segment.key, offset=0, byte_size=4096)
        assert calls.register("", register.SerializeToString()) == b""
        with pytest.raises(AlreadyExists):
            calls.register("", register.SerializeToString())
        status = pb.RegionStatusResponse.FromString(calls.status("", b""))
        assert list(status.regions) == [register]
        named = pb.RegionStatusRequest(name="a").SerializeToString()
        assert pb.RegionStatusResponse.FromString(calls.status("", named)).regions[0] == register
        assert calls.status("other", b"") == b""  # another tenant's: none
        with pytest.raises(RegionNotFound):
            calls.status("other", named)
        unregister = pb.UnregisterRegionRequest(name="a").SerializeToString()
        assert calls.unregister("", unregister) == b""
        assert calls.unregister("", unregister) == b""  # one never registered: no error
        assert len(regions) == 0
        with pytest.raises(InvalidInput, match=r"not a valid sluice\.v1\.RegisterRegionRequest"):
            calls.register("", b"\xff")
        small = Regions(max_regions=1)
        RegionCalls(small, "sluice-server").register("", register.SerializeToString())
        with pytest.raises(QuotaExceeded):
            RegionCalls(small, "sluice-server").register(
                "", register.SerializeToString().replace(b"a", b"b", 1)
            )
        small.close()
    finally:
        segment.close()


def test_the_region_calls_with_shared_memory_off_name_the_flag() -> None:
    calls = RegionCalls(None, "sluice-server")
    for call in (calls.register, calls.status, calls.unregister):
        with pytest.raises(Unimplemented) as caught:
            call("", b"")
        assert str(caught.value) == (
            "shared memory is off; start sluice-server with --shared-memory (for callers on its "
            "host)"
        )
    # Off, the call is refused before its body is read.
    with pytest.raises(Unimplemented):
        calls.register("", b"\xff")


def test_metadata_shows_the_wire_types_an_input_accepts() -> None:
    spec = TensorSpec("image", "FP32", (None, 3), (WireType("UINT8", 1 / 255, 0.5),))
    (shown,) = _specs([spec])
    assert list(shown.shape) == [-1, 3]
    assert [(w.datatype, w.scale, w.offset) for w in shown.accepts] == [("UINT8", 1 / 255, 0.5)]


# The client's regions.


@pytest.mark.parametrize(
    ("target", "local"),
    [
        ("127.0.0.1:8000", True),
        ("127.3.0.1:8000", True),
        ("localhost:8000", True),
        ("[::1]:8000", True),
        ("unix:/tmp/s.sock", True),
        ("unix:///tmp/s.sock", True),
        ("ipv4:127.0.0.1:1,127.0.0.2:2", True),
        ("ipv6:[::1]:8000", True),
        ("dns:///localhost:8000", True),
        ("10.0.0.5:8000", False),
        ("example.com:8000", False),
        ("ipv4:127.0.0.1:1,10.0.0.1:2", False),
        ("dns://8.8.8.8/localhost:8000", True),
        ("[::2]:8000", False),
    ],
)
def test_shared_memory_needs_a_target_on_this_host(target: str, local: bool) -> None:
    assert client_shm.on_this_host(target) is local


def test_a_client_with_shared_memory_refuses_a_target_elsewhere_or_several() -> None:
    with pytest.raises(ValueError, match=r"needs a target on this host .* 10\.0\.0\.5:8000 is not"):
        SluiceClient("10.0.0.5:8000", shared_memory=True)
    with pytest.raises(
        ValueError, match="needs one target, a server or balancer on this host: 2 were"
    ):
        SluiceClient(["127.0.0.1:1", "127.0.0.1:2"], shared_memory=True)


def serve(memory: client_shm.SharedMemory, plan: client_shm.Layout, regions: Regions) -> bytes:
    """What a server with shared memory on answers to `plan`'s body: y = 2x, and a label."""
    if plan.fresh:
        registration = plan.arena.registration()
        regions.unregister("", registration.name)
        regions.register(
            "", registration.name, registration.key, registration.offset, registration.byte_size
        )
        plan.arena.registered_now()
    with regions.lease("") as lease:
        decoded = SHARED.decode(plan.body, lease)
        x = decoded.inputs["x"]
        outputs = {"y": x * 2, "label": np.arange(len(x), dtype=np.int64)}
        return SHARED.encode(Model(), decoded, outputs)


def test_the_clients_regions_carry_inputs_then_outputs_sized_from_an_answer(
    regions: Regions,
) -> None:
    before = objects()
    memory = client_shm.SharedMemory()
    try:
        placed = []
        for rows in (3, 3, 5):
            x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
            with memory.planned({"x": x}, [], "", "") as plan:
                response, outputs = memory.answer(plan, serve(memory, plan, regions))
            np.testing.assert_array_equal(outputs["y"], x * 2)
            assert outputs["label"].tolist() == list(range(rows))
            placed.append(sorted(t.name for t in response.outputs if t.HasField("shared_memory")))
        # The first answer of each shape sized the outputs; the next call placed them.
        assert placed == [[], ["label", "y"], []]
        with memory.planned({"x": x}, [], "", "") as plan:
            assert not plan.fresh  # the arena grew for 5 rows already: registered as it is
            assert sorted(plan.outputs) == ["label", "y"]
            _, outputs = memory.answer(plan, serve(memory, plan, regions))
        plan.arena.segment.view[: x.nbytes] = bytes(x.nbytes)  # the next call's bytes ...
        np.testing.assert_array_equal(outputs["y"], x * 2)  # ... never the answer's
        assert len(objects() - before) == 1
        assert [i.name for i in regions.status("")] == [plan.arena.name]
    finally:
        memory.close()
    assert objects() == before


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A failed call as grpc raises it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def refusal(details: str) -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.INVALID_ARGUMENT, details)


def test_the_client_writes_no_input_into_an_object_before_the_server_holds_it() -> None:
    """Another tenant on this host that registers the client's object first (by its name in
    /dev/shm) finds none of the client's bytes in it, and the client takes a fresh one."""
    regions = Regions(copy=True)
    memory = client_shm.SharedMemory()
    try:
        with memory.planned({"x": X}, [], "", "") as plan:
            assert plan.fresh and plan.arena.segment is not None
            taken = plan.arena.segment
            assert bytes(taken.view) == bytes(taken.size)  # nothing written yet
            regions.register("mallory", "stolen", taken.key, 0, taken.size)
            registration = plan.arena.registration()
            with pytest.raises(InvalidInput) as caught:
                regions.register("alpha", registration.name, taken.key, 0, taken.size)
            error = refusal(
                f"could not register shared memory region {registration.name!r} on "
                f"127.0.0.1:1: {caught.value}"
            )
            assert memory.failed(plan, error)  # sent again, on a fresh object
        with regions.lease("mallory") as lease:
            assert bytes(lease.input("stolen", 0, taken.size)) == bytes(taken.size)
        with memory.planned({"x": X}, [], "", "") as plan:
            assert plan.fresh and plan.arena.segment is not None
            assert plan.arena.segment.key != taken.key
            registration = plan.arena.registration()
            regions.register(
                "alpha", registration.name, registration.key, 0, registration.byte_size
            )
            plan.arena.registered_now()
            with regions.lease("alpha") as lease:
                decoded = SHARED.decode(plan.body, lease)
                np.testing.assert_array_equal(decoded.inputs["x"], X)
                del decoded
        with memory.planned({"x": X * 2}, [], "", "") as plan:  # registered: written at once
            assert not plan.fresh and plan.arena.segment is not None
            np.testing.assert_array_equal(
                np.frombuffer(plan.arena.segment.view[: X.nbytes], np.float32), (X * 2).ravel()
            )
    finally:
        memory.close()
        regions.close()


@pytest.mark.parametrize(
    "error",
    [
        rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "late"),
        rpc_error(grpc.StatusCode.CANCELLED, "cancelled"),
        rpc_error(grpc.StatusCode.UNAVAILABLE, "gone"),
        asyncio.CancelledError(),
    ],
)
def test_an_arena_a_call_gave_up_on_is_not_the_next_calls(error: BaseException) -> None:
    """The server may still hold that call: its late outputs, or its claim on the bytes,
    must not meet the next call's. The arena is retired, its object unlinked."""
    before = objects()
    memory = client_shm.SharedMemory()
    try:
        with pytest.raises(type(error)), memory.planned({"x": X}, [], "", "") as plan:
            given_up = plan.arena
            given_up.registered_now()  # as the client's registration leaves it
            raise error
        assert given_up.segment is None and len(objects() - before) == 0
        assert memory.registered() == [given_up.name]  # close() unregisters it
        with memory.planned({"x": X}, [], "", "") as plan:
            assert plan.arena is not given_up and plan.arena.name != given_up.name
            assert plan.fresh
        with pytest.raises(grpc.aio.AioRpcError), memory.planned({"x": X}, [], "", "") as plan:
            kept = plan.arena
            raise refusal("a refusal: the server is done with the call")
        with memory.planned({"x": X}, [], "", "") as plan:
            assert plan.arena is kept  # pooled as any
    finally:
        memory.close()
    assert objects() == before


def test_two_calls_at_once_have_regions_of_their_own() -> None:
    memory = client_shm.SharedMemory()
    try:
        with (
            memory.planned({"x": X}, [], "", "") as one,
            memory.planned({"x": X * 3}, [], "", "") as two,
        ):
            assert one.arena is not two.arena and one.arena.name != two.arena.name
        with memory.planned({"x": X}, [], "", "") as again:
            assert again.arena in (one.arena, two.arena)  # handed back: reused
    finally:
        memory.close()


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_outputs_that_outgrow_their_room_are_sent_again_as_bytes(regions: Regions) -> None:
    memory = client_shm.SharedMemory()
    try:
        with memory.planned({"x": X}, [], "", "") as plan:
            memory.answer(plan, serve(memory, plan, regions))
        key = client_shm.signature({"x": X}, [], "", "")
        memory.learned.put(key, {"y": 8, "label": 24})  # as if the last answer were smaller
        with memory.planned({"x": X}, [], "", "") as plan:
            with pytest.raises(InvalidInput) as caught:
                serve(memory, plan, regions)
            error = Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(caught.value))
            assert memory.failed(plan, error)
            assert plan.arena.registered  # the region is fine: only the sizes were not
        with memory.planned({"x": X}, [], "", "") as plan:
            assert plan.outputs == {}
            _, outputs = memory.answer(plan, serve(memory, plan, regions))
        np.testing.assert_array_equal(outputs["y"], X * 2)
        # A server that lost the region (restarted): registered afresh by the next try.
        lost = Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor 'x': Unable to find shared memory region: '{plan.arena.name}'",
        )
        assert memory.failed(plan, lost) and not plan.arena.registered
        other = Refusal(grpc.StatusCode.INVALID_ARGUMENT, "tensor 'x' has shape [3, 5]")
        assert not memory.failed(plan, other)
    finally:
        memory.close()


def test_a_grown_arena_is_registered_afresh_and_its_old_object_removed(
    regions: Regions,
) -> None:
    before = objects()
    memory = client_shm.SharedMemory()
    try:
        small = np.zeros(16, np.float32)
        with memory.planned({"x": small}, [], "", "") as plan:
            first = plan.arena.segment
            assert plan.fresh
            plan.arena.registered_now()
        big = np.zeros(1 << 20, np.float32)
        with memory.planned({"x": big}, [], "", "") as plan:
            assert plan.fresh and plan.arena.segment is not first
            assert first is not None and first.path.exists()  # the server may map it still
            plan.arena.registered_now()
            assert not first.path.exists()
        assert len(objects() - before) == 1
    finally:
        memory.close()
    assert objects() == before


def test_a_segment_is_unlinked_when_collected_without_close() -> None:
    segment = client_shm.Segment(4096)
    path = segment.path
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
    del segment
    assert not path.exists()


def test_a_target_without_region_calls_is_explained_in_the_readers_words() -> None:
    unimplemented = Refusal(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    python = client_shm.registration_error(unimplemented, "a", "127.0.0.1:1", Audience.PYTHON)
    assert python.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (python.details() or "").startswith(
        "could not register shared memory region 'a' on 127.0.0.1:1: 127.0.0.1:1 takes no "
        "shared memory regions: start it (sluice-server or sluice-balancer) with "
        "--shared-memory, or drop shared_memory=True"
    )
    commands = client_shm.registration_error(unimplemented, "a", "x:1", Audience.COMMANDS)
    assert "drop this command's --shared-memory" in (commands.details() or "")
    off = Refusal(grpc.StatusCode.FAILED_PRECONDITION, "busy")
    kept = client_shm.registration_error(off, "a", "127.0.0.1:1", Audience.PYTHON)
    assert kept.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert kept.details() == "could not register shared memory region 'a' on 127.0.0.1:1: busy"
