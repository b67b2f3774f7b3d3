"""Shared memory in the sluice.v1 API against a real sluice-server with --shared-memory:
SluiceClient(shared_memory=True) answers as the plain client on the digits model and on a
1x3x224x224 image model, from Python (blocking and asyncio) and `sluice predict
--shared-memory`; every bad reference is refused with its status; a server without the flag
says which flag; the client's objects in /dev/shm are gone once it is closed."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from perf import make_pool
from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.shm import client as client_shm
from sluice.shm import refs
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, Process, running, server_argv

pytestmark = pytest.mark.e2e

X = np.concatenate([s.input for s in SAMPLES[:5]])  # FP32 [5, 64]


def objects(pid: int | None = None) -> set[str]:
    """The client objects in /dev/shm of process `pid` (None: this one; 0: any)."""
    # The pid's own objects: PREFIX + pid + '-' (pid 12's name would also match pid 123's).
    mine = (
        f"{client_shm.PREFIX}{os.getpid() if pid is None else pid}-"
        if pid != 0
        else client_shm.PREFIX
    )
    return {n for n in os.listdir(client_shm.ROOT) if n.startswith(mine)}


@contextmanager
def stub_of(server: Process) -> Iterator[pb_grpc.InferenceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def shared() -> Iterator[Process]:
    with running(server_argv("--shared-memory", "--workers", "1")) as proc:
        yield proc


@pytest.fixture(scope="module")
def pool() -> Iterator[Process]:
    model = make_pool.cached(224)
    with running(server_argv("--shared-memory", "--workers", "1", model=model)) as proc:
        yield proc


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array)


def test_the_digits_model_answers_as_without_shared_memory(
    shared: Process, reference: ort.InferenceSession
) -> None:
    before = objects()
    with (
        SluiceClient(shared.address) as plain,
        SluiceClient(shared.address, shared_memory=True) as client,
    ):
        for rows in (1, 1, 5, 5, 1):  # each shape's first answer sizes its outputs' room
            x = X[:rows]
            want = plain.predict({"input": x})
            assert_same(client.predict({"input": x}), want)
            (label,) = reference.run(["label"], {"input": x})
            np.testing.assert_array_equal(want["label"], label)
        assert_same(
            client.predict({"input": X[:2]}, outputs=["label"]),
            plain.predict({"input": X[:2]}, outputs=["label"]),
        )
        # Plain values, converted to the model's datatype, travel the same way.
        rows = X[:1].tolist()
        assert_same(client.predict({"input": rows}), plain.predict({"input": rows}))
        made = objects() - before
        assert len(made) == 1  # one call at a time: one region, reused
        with stub_of(shared) as stub:
            listed = stub.RegionStatus(pb.RegionStatusRequest())
        assert [r.key for r in listed.regions] == [f"/{n}" for n in made]
    assert objects() == before
    with stub_of(shared) as stub:
        assert not list(stub.RegionStatus(pb.RegionStatusRequest()).regions)


async def test_the_asyncio_client_answers_as_without_shared_memory(shared: Process) -> None:
    before = objects()
    async with (
        AsyncSluiceClient(shared.address) as plain,
        AsyncSluiceClient(shared.address, shared_memory=True) as client,
    ):
        for rows in (3, 3):
            want = await plain.predict({"input": X[:rows]})
            assert_same(await client.predict({"input": X[:rows]}), want)
    assert objects() == before


def test_a_224_image_answers_as_without_shared_memory(pool: Process) -> None:
    rng = np.random.default_rng(7)
    before = objects()
    with (
        SluiceClient(pool.address) as plain,
        SluiceClient(pool.address, shared_memory=True) as client,
    ):
        for _ in range(3):
            image = rng.standard_normal((1, 3, 224, 224), dtype=np.float32)
            assert_same(client.predict({"input": image}), plain.predict({"input": image}))
    assert objects() == before


def test_a_lost_region_is_registered_again_by_the_client(shared: Process) -> None:
    with SluiceClient(shared.address, shared_memory=True) as client:
        want = client.predict({"input": X[:1]})
        with stub_of(shared) as stub:  # every region of the caller's: as a restart would
            stub.UnregisterRegion(pb.UnregisterRegionRequest())
        assert_same(client.predict({"input": X[:1]}), want)


def sluice(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "sluice"), *argv], capture_output=True, text=True, timeout=60)


def test_sluice_predict_with_shared_memory(shared: Process, server: Process) -> None:
    before = objects(0)
    answers = []
    for extra in ((), ("--shared-memory",)):
        argv = ("predict", "--target", shared.address, "--sample", "3", "--json-output", *extra)
        done = sluice(*argv)
        assert done.returncode == 0, done.stderr
        answers.append(json.loads(done.stdout)["outputs"])
    assert answers[0] == answers[1] and answers[0]["label"]["data"] == [3]
    assert objects(0) <= before  # the command removed its own
    off = sluice("predict", "--target", server.address, "--sample", "3", "--shared-memory")
    assert off.returncode == 1
    assert "UNIMPLEMENTED" in off.stderr and "--shared-memory" in off.stderr
    assert "drop this command's --shared-memory" in off.stderr
    elsewhere = sluice("predict", "--target", "10.0.0.5:8000", "--sample", "3", "--shared-memory")
    assert elsewhere.returncode == 2
    assert "shared memory needs a target on this host" in elsewhere.stderr


def test_a_server_without_the_flag_names_it(server: Process) -> None:
    before = objects()
    with (
        SluiceClient(server.address, shared_memory=True) as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.predict({"input": X[:1]})
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "start sluice-server with --shared-memory" in (caught.value.details() or "")
    assert objects() == before
    # A Predict naming a region anyway: refused with the flag too.
    body = pb.PredictRequest(
        inputs=[refs.shared_tensor("input", X[:1], refs.Ref("r", 0, X[:1].nbytes))]
    )
    with stub_of(server) as stub, pytest.raises(grpc.RpcError) as caught:
        stub.Predict(body)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--shared-memory" in (caught.value.details() or "")


@pytest.fixture
def region(shared: Process) -> Iterator[tuple[pb_grpc.InferenceStub, client_shm.Segment]]:
    """A region 'test' of 64 KiB registered by hand, and the stub that did it."""
    segment = client_shm.Segment(1 << 16)
    try:
        with stub_of(shared) as stub:
            stub.RegisterRegion(
                pb.RegisterRegionRequest(name="test", key=segment.key, byte_size=segment.size)
            )
            yield stub, segment
            stub.UnregisterRegion(pb.UnregisterRegionRequest(name="test"))
    finally:
        segment.close()


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    raise AssertionError("the call was not refused")


def test_bad_references_are_refused_with_their_status(
    region: tuple[pb_grpc.InferenceStub, client_shm.Segment],
) -> None:
    stub, segment = region
    x = X[:1]
    codec.write(segment.view, x)
    ref = refs.Ref("test", 0, x.nbytes)

    def predict(tensor: pb.Tensor, **memory: refs.Ref) -> tuple[grpc.StatusCode, str]:
        output_memory = {
            n: pb.SharedMemoryRef(region=r.region, offset=r.offset, byte_size=r.byte_size)
            for n, r in memory.items()
        }
        request = pb.PredictRequest(inputs=[tensor], output_memory=output_memory)
        return code_of(lambda: stub.Predict(request))

    good = refs.shared_tensor("input", x, ref)
    both = refs.shared_tensor("input", x, ref)
    both.raw_data = x.tobytes()
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (predict(both), "tensor 'input' carries both raw_data and shared_memory"),
        (
            predict(refs.shared_tensor("input", x, ref._replace(byte_size=8))),
            "tensor 'input' has shared_memory byte_size 8 but FP32 shape [1, 64] needs 256",
        ),
        (
            predict(refs.shared_tensor("input", x, ref._replace(region="nobody"))),
            "tensor 'input': Unable to find shared memory region: 'nobody'",
        ),
        (
            predict(refs.shared_tensor("input", x, ref._replace(offset=segment.size - 64))),
            "tensor 'input': Invalid offset + byte size",
        ),
        (
            predict(good, nothing=refs.Ref("test", 1024, 64)),
            "output_memory names output 'nothing', which this call does not return",
        ),
        (
            predict(good, label=refs.Ref("test", 1024, 4)),
            "output_memory of output 'label' (4 bytes at offset 1024 of region 'test') is too "
            "small for its 8 bytes",
        ),
        (
            predict(good, label=refs.Ref("test", segment.size, 8)),
            "output_memory of output 'label': Invalid offset + byte size",
        ),
    ]
    for (code, details), words in cases:
        assert (code, words in details) == (invalid, True), details
    again = pb.RegisterRegionRequest(name="test", key=segment.key, byte_size=64)
    assert code_of(lambda: stub.RegisterRegion(again))[0] == grpc.StatusCode.ALREADY_EXISTS
    missing = pb.RegisterRegionRequest(name="m", key="/sluice-no-such-object", byte_size=64)
    assert code_of(lambda: stub.RegisterRegion(missing))[0] == invalid
    nobody = pb.RegionStatusRequest(name="nobody")
    assert code_of(lambda: stub.RegionStatus(nobody))[0] == grpc.StatusCode.NOT_FOUND


def test_an_answer_read_from_a_region_is_never_cached(
    region: tuple[pb_grpc.InferenceStub, client_shm.Segment],
) -> None:
    stub, segment = region
    request = pb.PredictRequest(
        inputs=[refs.shared_tensor("input", X[:1], refs.Ref("test", 0, X[:1].nbytes))],
        outputs=["label"],
        output_memory={"label": pb.SharedMemoryRef(region="test", offset=4096, byte_size=8)},
    )
    labels = []
    for sample in (SAMPLES[3], SAMPLES[7], SAMPLES[3]):
        codec.write(segment.view, sample.input)
        response, call = stub.Predict.with_call(request)
        assert "x-cache" not in dict(call.trailing_metadata())
        (tensor,) = response.outputs
        assert not tensor.raw_data and tensor.shared_memory.byte_size == 8
        labels.append(int(np.frombuffer(segment.view[4096:4104], "<i8")[0]))
    assert labels == [SAMPLES[3].label, SAMPLES[7].label, SAMPLES[3].label]
