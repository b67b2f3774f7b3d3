"""The shared memory benchmark scenario's arithmetic (perf/shm_figures.py, for perf/shm.py):
its plan, the figures of one measured loop, the medians over rounds, the goals' bounds and
verdicts, and the table; and its shared memory floor (perf/echo_server.py --model
--shared-memory), in this process on the digits model. No process is started and no timing is
judged: the figures below are made up."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from perf import echo_server
from perf import shm_figures as shm
from sluice import AsyncSluiceClient, models
from sluice.core.errors import InvalidInput
from sluice.shm import refs
from sluice.shm.client import signature
from sluice.shm.registry import Regions
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec

PROCESSES = {"server", "plain", "balancer", "arena", "floor", "echo"}


def test_the_plan_compares_each_shm_row_with_its_bytes_twin() -> None:
    for name, config in shm.PLAN.items():
        assert config.target in PROCESSES
        assert config.cpu_of[0] == config.target  # the target's CPU comes first
        if config.target == "balancer":  # and its backend's beside it
            assert config.cpu_of == ("balancer", "plain")
        if config.shared:
            twin = shm.PLAN[name.replace("-shm", "-bytes")]
            assert (twin.target, twin.model, twin.shared) == (config.target, config.model, False)
    # the hop's own cost: the same tiny body to the balancer's backend, direct and through it
    direct, hop = shm.PLAN["digits-direct"], shm.PLAN["digits-balancer"]
    assert (direct.target, direct.model) == ("plain", hop.model)
    assert shm.MODEL_RUNS_IN["balancer"] == "plain"
    # the floor reads the regions too, one process for both
    assert shm.PLAN["floor-shm"].target == shm.PLAN["floor-bytes"].target == "floor"
    assert shm.PLAN["echo-digits"].model == "digits"  # a digits-size body


def test_one_loops_figures_per_call_in_ms() -> None:
    times = [0.001 * i for i in range(1, 101)]  # 1 .. 100 ms
    before = {"server": shm.Usage(2.0, 1000), "balancer": shm.Usage(1.0, 50)}
    after = {"server": shm.Usage(2.5, 91000), "balancer": shm.Usage(1.1, 50)}
    figures = shm.per_call(times, before, after, 0.2, model=(0.3, 100.0))
    assert figures["calls"] == 100
    assert figures["p50"] == pytest.approx(50.5)
    assert figures["p99"] == pytest.approx(99.01)
    assert figures["cpu_ms"] == pytest.approx({"server": 5.0, "balancer": 1.0})
    assert figures["faults"] == {"server": 900.0, "balancer": 0.0}
    assert figures["client_cpu_ms"] == pytest.approx(2.0)
    assert figures["model_ms"] == pytest.approx(3.0)
    # no server counting the model (the echo, the floor), or no runs counted: no figure
    assert shm.per_call(times, {}, {}, 0.0, None)["model_ms"] is None
    assert shm.per_call(times, {}, {}, 0.0, (0.0, 0.0))["model_ms"] is None


def test_a_processes_usage_counts_its_cpu_and_faults() -> None:
    first = shm.usage([os.getpid()])
    with mmap.mmap(-1, 64 * mmap.PAGESIZE) as pages:  # fresh pages: a fault each when touched
        for page in range(64):
            pages[page * mmap.PAGESIZE] = 1
    end = time.process_time() + 0.1
    while time.process_time() < end:  # 0.1 s of this process's CPU
        pass
    second = shm.usage([os.getpid()])
    assert second.faults - first.faults >= 64
    assert second.cpu_s - first.cpu_s >= 0.05  # the kernel's ticks, with room for rounding


def loop(p50: float, cpu: dict[str, float], model: float | None, equal: bool = True) -> Any:
    return {
        "calls": 10,
        "p50": p50,
        "p99": 2 * p50,
        "cpu_ms": cpu,
        "faults": dict.fromkeys(cpu, 10.0),
        "client_cpu_ms": p50 / 10,
        "model_ms": model,
        "answers_equal": equal,
    }


def test_the_medians_over_rounds() -> None:
    runs = {
        "image-shm-balancer": [
            loop(3.0, {"balancer": 1.0, "plain": 4.0}, 2.0),
            loop(9.0, {"balancer": 3.0, "plain": 6.0}, None),
            loop(5.0, {"balancer": 2.0, "plain": 5.0}, 3.0),
        ],
        "echo-digits": [loop(0.5, {"echo": 0.2}, None), loop(0.7, {"echo": 0.4}, None, False)],
    }
    summary = shm.summarize(runs)
    cell = summary["image-shm-balancer"]
    assert (cell["p50"], cell["p99"], cell["client_cpu_ms"]) == (5.0, 10.0, 0.5)
    assert cell["cpu_ms"] == {"balancer": 2.0, "plain": 5.0}
    assert cell["model_ms"] == 2.5  # the rounds that counted it
    assert cell["calls"] == 30 and cell["rounds_p50"] == [3.0, 9.0, 5.0]
    assert cell["answers_equal"]
    echo = summary["echo-digits"]
    assert echo["p50"] == pytest.approx(0.6) and echo["model_ms"] is None
    assert not echo["answers_equal"]  # one round's answer differed: the row says so


def sweeps(**p50: float) -> dict[str, dict[str, Any]]:
    """Every configuration's summary, with the p50s given (by name, - as _) and 1 ms else."""
    found = {}
    for name, config in shm.PLAN.items():
        cell = shm.summarize({name: [loop(1.0, dict.fromkeys(config.cpu_of, 1.0), None)]})
        found[name] = cell[name]
        found[name]["p50"] = p50.get(name.replace("-", "_"), 1.0)
    return found


ORT = {"1t": {"p50": 2.6, "cpu_ms": 2.6}, "2t": {"p50": 2.0, "cpu_ms": 3.1}}


def test_the_goals_bounds_and_verdicts() -> None:
    figures = sweeps(
        echo_digits=0.7,
        digits_direct=1.1,
        digits_balancer=1.6,  # the hop: 0.5 ms
        image_shm=2.75,
        image_shm_balancer=3.3,
        floor_shm=2.6,
    )
    direct, balanced, served, floor = shm.goals(figures, ORT)
    # best threads (2t: 2.0) + the tiny body's echo (0.7) + 0.1
    assert direct["limit"] == pytest.approx(2.8) and direct["measured"] == 2.75
    assert direct["result"] == "PASS" and "2t" in direct["floor"]
    # the direct figure + the hop
    assert balanced["limit"] == pytest.approx(3.25) and balanced["result"] == "MISS"
    # the first goal's halves: served within the shm floor + 0.1 (2.75 > 2.7), the floor
    # within the first bound
    assert (served["measured"], served["limit"]) == (2.75, pytest.approx(2.7))
    assert served["result"] == "MISS" and "the shm floor 2.600" in served["floor"]
    assert (floor["measured"], floor["limit"]) == (2.6, pytest.approx(2.8))
    assert floor["result"] == "PASS" and floor["floor"] == direct["floor"]
    # the best of the threads wherever it is
    slower = {"1t": {"p50": 1.5, "cpu_ms": 1.5}, "2t": ORT["2t"]}
    assert shm.goals(figures, slower)[0]["limit"] == pytest.approx(2.3)
    assert shm.best_ort(slower) == "1t"


def test_the_differences_beside_the_goals() -> None:
    figures = sweeps(image_bytes=4.0, image_shm=3.0, arena_shm=2.5, floor_bytes=3.5, floor_shm=2.25)
    found = dict(shm.beside(figures))
    assert found["shm saves, direct (bytes - shm)"] == pytest.approx(1.0)
    assert found["the arena, shm (arena - server)"] == pytest.approx(-0.5)
    assert found["served shm over the floor's bytes"] == pytest.approx(-0.5)
    assert found["served shm over the shm floor"] == pytest.approx(0.75)
    assert found["shm saves at the floor (floor bytes - floor shm)"] == pytest.approx(1.25)


def test_the_table_shows_every_row_goal_and_check() -> None:
    figures = sweeps(image_shm=5.0)
    figures["arena-bytes"]["answers_equal"] = False
    result = {
        "command": "python -m perf.shm --rounds 1",
        "context": {
            "commit": "abc",
            "started": "now",
            "cpus": 2,
            "loadavg_before": [1.5, 1.0, 1.0],
            "loadavg_after": [2.25, 1.0, 1.0],
            "note": "",
        },
        "rounds": 1,
        "squeezenet_threads": 2,
        "threads_asked": "auto",
        "ort_alone": ORT,
        "sweeps": figures,
        "goals": shm.goals(figures, ORT),
        "beside": shm.beside(figures),
    }
    text = shm.markdown(result)
    for config in shm.PLAN.values():
        assert f"| {config.label} |" in text
    assert "load average 1.50 before and 2.25 after" in text
    assert "2 intra-op thread(s) (--threads auto)" in text
    assert "| balancer 1.000, plain 1.000 |" in text  # both processes of a balancer row
    assert "| image, bytes, --ort-arena on |" in text and "DIFFER" in text
    # 5.0 against 2.0 + 1.0 + 0.1: missed by 1.9 ms
    assert "| 5.000 | 3.100 |" in text and "| +1.900 | **MISS** |" in text


def test_the_answers_and_the_metrics_read() -> None:
    a = {"label": np.array([3]), "probabilities": np.ones((1, 10), np.float32)}
    assert shm.answers_equal(a, {k: v.copy() for k, v in a.items()})
    assert not shm.answers_equal(a, {"label": np.array([4]), "probabilities": a["probabilities"]})
    assert not shm.answers_equal(a, {"label": a["label"]})
    text = (
        "# HELP sluice_model_seconds model run wall time per batch\n"
        'sluice_model_seconds_bucket{le="0.001"} 3.0\n'
        "sluice_model_seconds_count 52.0\n"
        "sluice_model_seconds_sum 0.26\n"
        "sluice_queue_wait_seconds_sum 9.0\n"
    )
    assert shm.model_seconds_in(text) == (0.26, 52.0)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit, match="--rounds"):
        shm.check(0, "auto")
    for threads in ("0", "two"):
        with pytest.raises(SystemExit, match="--threads must be a number of threads or auto"):
            shm.check(3, threads)
    shm.check(1, "auto")
    shm.check(1, "2")


# The shared memory floor: perf/echo_server.py --model --shared-memory, on the digits model.

X = np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32)
PROBABILITIES = 10 * 4  # the digits model's (1, 10) FP32 output


def floor_answer(regions: Regions | None) -> Any:
    answer, _ = echo_server.model_floor(str(models.DIGITS), 1, regions)
    return answer


def bytes_answer(answer: Any) -> dict[str, np.ndarray]:
    reply = pb.PredictResponse.FromString(answer(codec.encode_predict({"input": X})))
    return codec.decode_all(reply.outputs)


def in_region(output_bytes: int, region: str = "r") -> bytes:
    """A Predict with X at the start of `region` and its probabilities after it."""
    placed = pb.SharedMemoryRef(region=region, offset=X.nbytes, byte_size=output_bytes)
    return pb.PredictRequest(
        inputs=[refs.shared_tensor("input", X, refs.Ref(region, 0, X.nbytes))],
        output_memory={"probabilities": placed},
    ).SerializeToString()


def test_the_shm_floor_reads_its_input_in_the_region_and_writes_its_output_there(
    tmp_path: Path,
) -> None:
    regions = Regions(root=tmp_path)
    try:
        answer = floor_answer(regions)
        expected = bytes_answer(answer)  # bytes still go the bytes way
        obj = tmp_path / "obj"
        obj.write_bytes(X.tobytes() + bytes(64))
        regions.register("", "r", "/obj", 0, X.nbytes + 64)
        reply = pb.PredictResponse.FromString(answer(in_region(64)))
        tensors = {t.name: t for t in reply.outputs}
        # the probabilities answered by where they are, the bytes written (40 of the 64)
        probabilities = tensors["probabilities"]
        assert not probabilities.raw_data
        assert probabilities.shared_memory == pb.SharedMemoryRef(
            region="r", offset=X.nbytes, byte_size=PROBABILITIES
        )
        found = obj.read_bytes()[X.nbytes : X.nbytes + PROBABILITIES]
        assert np.array_equal(
            np.frombuffer(found, np.float32).reshape(1, 10), expected["probabilities"]
        )
        assert np.array_equal(codec.decode(tensors["label"]), expected["label"])  # as bytes
        # an output region too small: refused as the server refuses it, for the client to
        # send that output's bytes instead
        with pytest.raises(InvalidInput, match=refs.TOO_SMALL):
            answer(in_region(8))
        with pytest.raises(InvalidInput, match="'elsewhere'"):
            answer(in_region(64, "elsewhere"))
    finally:
        regions.close()


@asynccontextmanager
async def floor(regions: Regions | None) -> AsyncIterator[str]:
    server = grpc.aio.server()
    methods = echo_server.handlers(str(models.DIGITS), 1, regions)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "sluice.v1.Inference",
                {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()},
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_a_shm_client_calls_the_shm_floor_with_its_tensors_in_its_regions() -> None:
    regions = Regions()  # the client's objects are in /dev/shm
    try:
        async with floor(regions) as address:
            async with AsyncSluiceClient(address, timeout=30.0) as plain:
                expected = await plain.predict({"input": X})
            async with AsyncSluiceClient(address, timeout=30.0, shared_memory=True) as client:
                for _ in range(3):  # the first sizes the outputs, the others place them
                    found = await client.predict({"input": X})
                    assert shm.answers_equal(found, expected)
                assert client._memory is not None
                assert client._memory.learned.get(signature({"input": X}, (), "", "")) == {
                    "label": 8,
                    "probabilities": PROBABILITIES,
                }
                assert len(regions) == 1  # its arena, registered through the floor
            assert len(regions) == 0  # and unregistered as the client closed
    finally:
        regions.close()


async def test_the_region_calls_answer_each_refusals_status() -> None:
    regions = Regions()
    try:
        async with floor(regions) as address, grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            missing = pb.RegisterRegionRequest(name="r", key="/sluice-no-such-object", byte_size=8)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegisterRegion(missing, timeout=30.0)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Unable to open shared memory region" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegionStatus(pb.RegionStatusRequest(name="r"), timeout=30.0)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        regions.close()
    async with floor(None) as address, grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.InferenceStub(channel).RegionStatus(
                pb.RegionStatusRequest(), timeout=30.0
            )
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "--shared-memory" in (refused.value.details() or "")


def test_the_shm_floor_needs_a_model() -> None:
    with pytest.raises(SystemExit):
        echo_server.main(["--shared-memory"])
