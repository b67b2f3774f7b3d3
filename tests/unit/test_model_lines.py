"""The lines that tell a user what a node serves: the settings in force for each model (its
config's, not the server's defaults), and what a call hears once a model or version it names
was unloaded: that it is not loaded, why, and what is. Real engines from a repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.errors import ModelNotFound
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import GONE_MODELS, GONE_VERSIONS, Model, Models
from sluice.server.dataplane.modelsettings import ModelSettings
from sluice.server.dataplane.repository import Repository
from sluice.server.modelconfig import read_config
from tests.conftest import scale_model


def put(root: Path, version: int, config: str) -> None:
    (root / "scale" / str(version)).mkdir(parents=True, exist_ok=True)
    (root / "scale" / str(version) / "model.onnx").write_bytes(scale_model(float(version)))
    (root / "scale" / "config.pbtxt").write_text(config)


async def test_a_model_describes_the_settings_its_config_put_in_force(tmp_path: Path) -> None:
    put(tmp_path, 1, "max_batch_size: 8\ninstance_group [{ count: 2, kind: KIND_CPU }]\n")
    models = Models()
    repo = Repository(tmp_path, models, ModelSettings(device="cpu"), read_config=read_config)
    await repo.poll()
    model = models.get("scale")
    assert model.describe() == "max batch 8, 2 instances"
    await repo.close()
    await model.close()


async def test_calls_after_an_unload_hear_what_is_not_loaded_and_what_is(tmp_path: Path) -> None:
    put(tmp_path, 1, "version_policy: { all: {} }\n")
    put(tmp_path, 2, "version_policy: { all: {} }\n")
    models = Models()
    repo = Repository(tmp_path, models, ModelSettings(device="cpu"), read_config=read_config)
    await repo.poll()

    # One version goes (the policy no longer picks it): the other is named as ready.
    (tmp_path / "scale" / "config.pbtxt").write_text(
        "version_policy: { specific: { versions: [1] } }\n"
    )
    await repo.poll()
    with pytest.raises(ModelNotFound) as version:
        models.get("scale", "2")
    assert str(version.value) == (
        "model 'scale' version '2' is not loaded (not picked by its version policy); ready: 1"
    )

    await repo.unload("scale")
    with pytest.raises(ModelNotFound) as unnamed:
        models.get()
    assert str(unnamed.value) == (
        "this node serves no model: 'scale' is not loaded (unloaded on request)"
    )
    assert "yet" not in str(unnamed.value)
    with pytest.raises(ModelNotFound) as named:
        models.get("scale")
    assert str(named.value) == (
        "model 'scale' is not loaded (unloaded on request); this node serves none"
    )
    with pytest.raises(ModelNotFound) as versioned:
        models.get("scale", "1")
    assert str(versioned.value) == (
        "model 'scale' version '1' is not loaded (unloaded on request); this node serves none"
    )
    with pytest.raises(ModelNotFound, match="unknown model 'other'; this node serves none"):
        models.get("other")  # never served: unknown, as before

    await repo.load("scale")  # loaded again: served, and no longer spoken of as unloaded
    assert models.get().version == "1"
    await repo.close()
    for model in models:
        await model.close()


def test_a_node_that_never_served_a_model_says_so_without_promising_one() -> None:
    with pytest.raises(ModelNotFound) as caught:
        Models().get()
    assert str(caught.value) == "this node serves no model"
    with pytest.raises(ModelNotFound) as default:
        Models(default="digits").get()
    assert str(default.value) == "the default model 'digits' is not loaded; this node serves none"


def test_what_a_node_remembers_of_removed_versions_is_bounded_and_the_latest_are_kept(
    engine: Engine,
) -> None:
    """A long-running repository server removes versions without end: it remembers why for
    the latest few of each model, and the latest models, so memory stays bounded while a call
    that names a version just removed still hears why."""
    served = Models([Model(engine, Batcher(engine.instances), name="m", version="0")])
    removals = 40 * GONE_VERSIONS
    for version in range(1, removals + 1):
        served.install(Model(engine, Batcher(engine.instances), name="m", version=str(version)))
        served.remove("m", str(version), f"unloaded, round {version}")
    kept = range(removals - GONE_VERSIONS + 1, removals + 1)
    for version in kept:
        with pytest.raises(ModelNotFound) as recent:
            served.get("m", str(version))
        assert str(recent.value) == (
            f"model 'm' version '{version}' is not loaded (unloaded, round {version}); ready: 0"
        )
    with pytest.raises(ModelNotFound) as forgotten:
        served.get("m", str(kept[0] - 1))
    assert str(forgotten.value) == f"model 'm' has no ready version '{kept[0] - 1}'; ready: 0"

    # Whole models too: the latest ones removed are named, the oldest are forgotten.
    for index in range(40 * GONE_MODELS):
        served.install(Model(engine, Batcher(engine.instances), name=f"n{index}"))
        served.remove(f"n{index}", "1", f"unloaded, model {index}")
    last = 40 * GONE_MODELS - 1
    with pytest.raises(ModelNotFound) as recent:
        served.get(f"n{last}")
    assert str(recent.value) == (
        f"model 'n{last}' is not loaded (unloaded, model {last}); this node serves 'm'"
    )
    with pytest.raises(ModelNotFound, match=r"^unknown model 'n0'; this node serves 'm'$"):
        served.get("n0")
    remembered = [f"n{index}" for index in range(40 * GONE_MODELS) if _heard_of(served, index)]
    assert len(remembered) <= GONE_MODELS and f"n{last}" in remembered


def _heard_of(served: Models, index: int) -> bool:
    try:
        served.get(f"n{index}")
    except ModelNotFound as missing:
        return "is not loaded" in str(missing)
    return True
