"""The model repository on tiny ONNX models written per test (`y = x * k`, k telling the
versions apart): the layout scan, hot swaps, refusals, reloads, version policies and the
load/unload/index API. Real engines, no process, no sleeps: each test polls by hand."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from sluice.core.errors import LoadFailed, ModelNotFound
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.modelsettings import ModelSettings, VersionPolicy
from sluice.server.dataplane.repository import (
    LOADING,
    READY,
    UNAVAILABLE,
    IndexEntry,
    Repository,
    load_model,
)
from sluice.server.modelconfig import read_config
from tests.conftest import scale_model

DEFAULTS = ModelSettings(device="cpu")
LOG = "sluice.repository"


def scale(k: float) -> bytes:
    """An ONNX model: FP32 x [N, 2] -> y = x * k."""
    return scale_model(k, width=2)


def broken_at_run() -> bytes:
    """Loads, but fails on any run: reshapes 2 values into 3."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.array([3], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def put(root: Path, name: str, version: int | str, data: bytes, file: str = "model.onnx") -> Path:
    path = root / name / str(version) / file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def touch_later(path: Path) -> None:
    """Move the file's mtime on by a second: a rewrite within the clock's tick still counts."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


async def answer(model: Model) -> float:
    results, _ = await model.run({"x": np.ones((1, 2), np.float32)}, [], None)
    return float(results["y"][0, 0])


class Spy:
    """The real loader, counting loads and recording which models were closed."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, int]] = []
        self.closed: list[tuple[str, str]] = []

    async def __call__(self, name: str, version: int, path: Path, settings: ModelSettings) -> Model:
        self.loads.append((name, version))
        model = await load_model(name, version, path, settings)
        close = model.close

        async def closing() -> None:
            self.closed.append((model.name, model.version))
            await close()

        model.close = closing  # type: ignore[method-assign]
        return model


def repository(root: Path, spy: Spy | None = None) -> tuple[Repository, Models]:
    models = Models()
    repo = Repository(root, models, DEFAULTS, read_config=read_config, loader=spy, poll_s=0.01)
    return repo, models


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOG and r.levelno >= logging.WARNING and "refused" in r.getMessage()
    ]


async def test_scan_finds_the_layout_and_ignores_junk(tmp_path: Path) -> None:
    put(tmp_path, "m", 1, scale(1))
    put(tmp_path, "m", 0, scale(9))  # not a version: they are positive
    put(tmp_path, "m", "abc", scale(9))
    put(tmp_path, "m", 2, b"", file="other.onnx")  # no model.onnx: not a version
    put(tmp_path, "m", "²", scale(9))  # a digit to isdigit(), not to int()
    put(tmp_path, "m", "01", scale(9))  # would be a second version 1
    (tmp_path / "m" / "notes.txt").write_text("hi")
    (tmp_path / "README").write_text("not a model")
    put(tmp_path, ".hidden", 1, scale(9))
    (tmp_path / "empty").mkdir()
    repo, models = repository(tmp_path)
    await repo.poll()
    assert models.names() == ["m"]
    assert [m.version for m in models.versions("m")] == ["1"]
    assert repo.index() == [
        IndexEntry("empty", "", UNAVAILABLE, "no version to serve"),
        IndexEntry("m", "1", READY),
    ]
    await repo.close()
    await models.get("m").close()


async def test_a_new_version_takes_over_and_the_old_unloads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOG)
    spy = Spy()
    put(tmp_path, "m", 1, scale(1))
    repo, models = repository(tmp_path, spy)
    await repo.poll()
    assert await answer(models.get("m")) == 1
    put(tmp_path, "m", 2, scale(2))
    await repo.poll()
    assert [m.version for m in models.versions("m")] == ["2"]  # latest 1, Triton's default
    assert await answer(models.get("m")) == 2
    await repo.settle()
    assert spy.closed == [("m", "1")]
    text = caplog.text
    assert "model m version 2 loaded in" in text and "takes traffic" in text
    assert "model m version 1 unloaded" in text
    await repo.poll()  # nothing changed: nothing loads again
    assert spy.loads == [("m", 1), ("m", 2)]
    await repo.close()
    await models.get("m").close()


async def test_a_call_holding_the_old_version_finishes_on_it(tmp_path: Path) -> None:
    spy = Spy()
    put(tmp_path, "m", 1, scale(1))
    repo, models = repository(tmp_path, spy)
    await repo.poll()
    old = models.get("m")
    old.hold()  # a call took v1 before the swap
    put(tmp_path, "m", 2, scale(2))
    await repo.poll()
    assert models.get("m").version == "2"
    for _ in range(5):
        await asyncio.sleep(0)  # let the retirement run as far as it can
    assert spy.closed == []
    assert await answer(old) == 1  # its call still runs on v1
    old.release()
    await repo.settle()
    assert spy.closed == [("m", "1")]
    await repo.close()
    await models.get("m").close()


async def test_a_broken_version_is_refused_once_and_the_old_keeps_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spy = Spy()
    put(tmp_path, "m", 2, scale(2))
    repo, models = repository(tmp_path, spy)
    await repo.poll()
    bad = put(tmp_path, "m", 3, b"\x00garbage, not ONNX")
    await repo.poll()
    assert models.get("m").version == "2"
    [line] = refusals(caplog)
    assert "model m version 3 refused" in line
    assert str(bad) in line and "version 2 keeps serving" in line
    [entry] = [e for e in repo.index() if e.version == "3"]
    assert entry.state == UNAVAILABLE and str(bad) in entry.reason
    await repo.poll()  # unchanged: neither retried nor logged again
    assert spy.loads == [("m", 2), ("m", 3)]
    assert len(refusals(caplog)) == 1
    bad.write_bytes(scale(3))  # fixed: the next poll tries again
    touch_later(bad)
    await repo.poll()
    assert models.get("m").version == "3"
    assert await answer(models.get("m")) == 3
    await repo.close()
    assert spy.closed == [("m", "2")]
    await models.get("m").close()


async def test_a_model_that_fails_its_warm_up_run_is_refused(tmp_path: Path) -> None:
    path = put(tmp_path, "m", 1, broken_at_run())
    with pytest.raises(LoadFailed, match="warm-up run of zeros"):
        await load_model("m", 1, path, DEFAULTS)
    with pytest.raises(LoadFailed, match="does not exist"):
        await load_model("m", 2, tmp_path / "none.onnx", DEFAULTS)


async def test_first_load_falls_back_past_a_broken_newest(tmp_path: Path) -> None:
    put(tmp_path, "m", 1, scale(1))
    put(tmp_path, "m", 2, b"garbage")
    repo, models = repository(tmp_path)
    await repo.poll()
    assert models.get("m").version == "1"
    await repo.close()
    await models.get("m").close()


async def test_a_changed_file_is_reloaded_and_swapped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOG)
    spy = Spy()
    path = put(tmp_path, "m", 1, scale(1))
    repo, models = repository(tmp_path, spy)
    await repo.poll()
    old = models.get("m")
    path.write_bytes(scale(5))
    touch_later(path)
    await repo.poll()
    new = models.get("m")
    assert new is not old and new.version == "1"
    assert await answer(new) == 5
    assert "model m version 1 reloaded (its file changed)" in caplog.text
    # A changed file that is broken leaves the loaded one serving.
    path.write_bytes(b"garbage")
    await repo.poll()
    assert models.get("m") is new
    assert len(refusals(caplog)) == 1
    await repo.close()
    assert spy.closed == [("m", "1")]
    await new.close()


async def test_a_file_replaced_by_a_rename_within_one_tick_is_reloaded(tmp_path: Path) -> None:
    path = put(tmp_path, "m", 1, scale(1))
    repo, models = repository(tmp_path)
    await repo.poll()
    old = models.get("m")
    # Same size and mtime, another inode: how Kubernetes swaps a mounted volume's files.
    staged = tmp_path / "staged.onnx"
    staged.write_bytes(scale(5))
    st = path.stat()
    assert staged.stat().st_size == st.st_size
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(staged, path)
    await repo.poll()
    new = models.get("m")
    assert new is not old and await answer(new) == 5
    await repo.close()
    await new.close()


async def test_a_removed_model_directory_unloads(tmp_path: Path) -> None:
    spy = Spy()
    put(tmp_path, "a", 1, scale(1))
    put(tmp_path, "b", 1, scale(2))
    repo, models = repository(tmp_path, spy)
    await repo.poll()
    assert models.names() == ["a", "b"]
    shutil.rmtree(tmp_path / "a")
    await repo.poll()
    assert models.names() == ["b"]
    await repo.close()
    assert spy.closed == [("a", "1")]
    assert [e.name for e in repo.index()] == ["b"]
    await models.get("b").close()


async def test_version_policies_from_config(tmp_path: Path) -> None:
    for k in (1, 2, 3):
        put(tmp_path, "m", k, scale(k))
    config = tmp_path / "m" / "config.pbtxt"
    config.write_text("version_policy: { all: {} }\n")
    repo, models = repository(tmp_path)
    await repo.poll()
    assert [m.version for m in models.versions("m")] == ["3", "2", "1"]
    assert await answer(models.get("m", "2")) == 2
    config.write_text("version_policy: { specific: { versions: [1, 3] } }\n")
    touch_later(config)
    await repo.poll()
    assert [m.version for m in models.versions("m")] == ["3", "1"]
    config.write_text("version_policy: { latest: { num_versions: 2 } }\n")
    touch_later(config)
    await repo.poll()
    assert [m.version for m in models.versions("m")] == ["3", "2"]
    await repo.close()
    for model in models:
        await model.close()


def test_version_policy_choices() -> None:
    found = [1, 2, 5, 10]
    assert VersionPolicy().choose(found) == {10}  # numeric, not text, order
    assert VersionPolicy("latest", latest=3).choose(found) == {10, 5, 2}
    assert VersionPolicy("all").choose(found) == set(found)
    assert VersionPolicy("specific", versions=(2, 7)).choose(found) == {2}
    assert VersionPolicy().choose([]) == set()


async def test_a_bad_config_refuses_the_model_and_keeps_it_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    put(tmp_path, "m", 1, scale(1))
    repo, models = repository(tmp_path)
    await repo.poll()
    (tmp_path / "m" / "config.pbtxt").write_text("max_batch_size: {{ nonsense\n")
    await repo.poll()
    await repo.poll()
    [line] = refusals(caplog)
    assert "model m refused" in line and "config.pbtxt" in line
    assert "version 1 keeps serving" in line
    assert models.get("m").version == "1"
    await repo.close()
    await models.get("m").close()


async def test_config_settings_reach_the_batcher_and_engine(tmp_path: Path) -> None:
    put(tmp_path, "m", 1, scale(1))
    (tmp_path / "m" / "config.pbtxt").write_text(
        "max_batch_size: 16\n"
        "instance_group [ { count: 2, kind: KIND_CPU } ]\n"
        "dynamic_batching { max_queue_delay_microseconds: 2500 }\n"
    )
    repo, models = repository(tmp_path)
    await repo.poll()
    model = models.get("m")
    assert model.batcher.queue.max_rows == 16
    assert model.batcher.queue.budget_s == pytest.approx(0.0025)
    assert len(model.engine.instances) == 2
    await repo.close()
    await model.close()


async def test_the_servers_batch_size_serves_unless_a_config_turns_batching_off(
    tmp_path: Path,
) -> None:
    put(tmp_path, "plain", 1, scale(1))
    put(tmp_path, "unbatched", 1, scale(1))
    (tmp_path / "unbatched" / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    models = Models()
    defaults = ModelSettings(device="cpu", max_batch=8, batch_budget_s=0.25)
    repo = Repository(tmp_path, models, defaults, read_config=read_config)
    await repo.poll()
    plain, unbatched = models.get("plain"), models.get("unbatched")
    assert plain.engine.max_batch == plain.batcher.queue.max_rows == 8
    assert plain.batcher.admission.max_rows == 8
    # Triton's max_batch_size 0: one row a run, in the engine, queue and admission alike.
    assert unbatched.engine.max_batch == unbatched.batcher.queue.max_rows == 1
    assert unbatched.batcher.admission.max_rows == 1
    assert unbatched.batcher.queue.budget_s == 0.25  # what the config leaves unset
    await repo.close()
    await plain.close()
    await unbatched.close()


async def test_load_unload_and_index(tmp_path: Path) -> None:
    spy = Spy()
    put(tmp_path, "m", 1, scale(1))
    put(tmp_path, "bad", 1, b"garbage")
    repo, models = repository(tmp_path, spy)
    await repo.poll()
    assert repo.index() == [
        IndexEntry("bad", "1", UNAVAILABLE, repo.index()[0].reason),
        IndexEntry("m", "1", READY),
    ]
    assert "bad/1/model.onnx" in repo.index()[0].reason

    await repo.unload("m")
    assert models.names() == []
    await repo.poll()  # unloaded on request: the poll leaves it so
    assert models.names() == []
    assert IndexEntry("m", "", UNAVAILABLE, "unloaded") in repo.index()
    await repo.load("m")
    assert models.get("m").version == "1"

    with pytest.raises(LoadFailed, match=r"bad/1/model\.onnx"):
        await repo.load("bad")  # retried at once, though the file is unchanged
    assert spy.loads.count(("bad", 1)) == 2
    with pytest.raises(ModelNotFound):
        await repo.load("nope")
    with pytest.raises(ModelNotFound):
        await repo.load("../m")
    with pytest.raises(ModelNotFound):
        await repo.unload("nope")
    await repo.close()
    assert spy.closed == [("m", "1")]
    await models.get("m").close()


async def test_index_shows_a_version_loading(tmp_path: Path) -> None:
    put(tmp_path, "m", 1, scale(1))
    started, go = asyncio.Event(), asyncio.Event()

    async def slow(name: str, version: int, path: Path, d: ModelSettings) -> Model:
        started.set()
        await go.wait()
        return await load_model(name, version, path, d)

    models = Models()
    repo = Repository(tmp_path, models, DEFAULTS, read_config=read_config, loader=slow)
    polling = asyncio.create_task(repo.poll())
    await started.wait()
    assert repo.index() == [IndexEntry("m", "1", LOADING)]
    assert models.names() == []  # serving goes on without it meanwhile
    go.set()
    await polling
    assert repo.index() == [IndexEntry("m", "1", READY)]
    await repo.close()
    await models.get("m").close()


async def test_run_polls_until_closed(tmp_path: Path) -> None:
    put(tmp_path, "m", 1, scale(1))
    loaded = asyncio.Event()

    async def loader(name: str, version: int, path: Path, d: ModelSettings) -> Model:
        model = await load_model(name, version, path, d)
        loaded.set()
        return model

    models = Models()
    repo = Repository(tmp_path, models, DEFAULTS, loader=loader, poll_s=0.01)
    running = asyncio.create_task(repo.run())
    await loaded.wait()
    await repo.close()
    assert running.done()
    assert models.get("m").version == "1"
    await models.get("m").close()


async def test_without_a_config_reader_a_config_file_is_refused(tmp_path: Path) -> None:
    put(tmp_path, "m", 1, scale(1))
    (tmp_path / "m" / "config.pbtxt").write_text("max_batch_size: 4\n")
    models = Models()
    repo = Repository(tmp_path, models, DEFAULTS)
    await repo.poll()
    assert models.names() == []
    [entry] = repo.index()
    assert entry.state == UNAVAILABLE and "config reader" in entry.reason


async def test_the_load_time_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG)
    put(tmp_path, "m", 1, scale(1))
    ticks = iter([10.0, 10.12])
    models = Models()
    repo = Repository(tmp_path, models, DEFAULTS, clock=lambda: next(ticks))
    await repo.poll()
    assert "model m version 1 loaded in 0.12 s, takes traffic" in caplog.text
    await models.get("m").close()


async def test_a_missing_root_is_logged_once_and_watched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "repo"
    polled = 0
    models = Models()
    repo = Repository(root, models, DEFAULTS, poll_s=0)

    async def poll() -> None:
        nonlocal polled
        polled += 1
        if polled == 3:
            put(root, "m", 1, scale(1))
        if polled == 5:
            repo_task.cancel()
        await Repository.poll(repo)

    repo.poll = poll  # type: ignore[method-assign]
    repo_task = asyncio.create_task(repo.run())
    with pytest.raises(asyncio.CancelledError):
        await repo_task
    errors = [r for r in caplog.records if r.name == LOG and r.levelno == logging.ERROR]
    assert len(errors) == 1 and str(root) in errors[0].getMessage()
    assert models.get("m").version == "1"
    await models.get("m").close()
