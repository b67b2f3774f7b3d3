"""A model's settings: the server's flags overlaid by what its config sets, clamped once."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.server.dataplane.modelsettings import Config, ModelSettings, VersionPolicy
from sluice.server.modelconfig import read_config
from sluice.server.settings import ServerSettings


def test_the_flags_convert_once_to_seconds_and_bytes() -> None:
    settings = ServerSettings(
        model=["m.onnx"],
        device="cpu",
        intra_op_threads="3",
        instances=2,
        max_batch=16,
        batch_budget_ms=2.5,
        max_queue=7,
        buffer_pool_bytes=1 << 20,
        pinned_staging=False,
        cuda_options="prefer_nhwc=1",
        inline_max_us=50.0,
    )
    assert settings.model_settings() == ModelSettings(
        device="cpu",
        intra_op_threads=3,
        instances=2,
        max_batch=16,
        batch_budget_s=0.0025,
        max_queue=7,
        pool_bytes=1 << 20,
        pinned=False,
        cuda_options={"prefer_nhwc": "1"},
        inline_max_s=50e-6,
    )


def test_auto_threads_are_chosen_at_load() -> None:
    assert ServerSettings(model=["m.onnx"]).model_settings().intra_op_threads is None


def test_an_empty_config_leaves_the_servers_settings() -> None:
    defaults = ModelSettings(device="cuda", instances=3, max_batch=8, batch_budget_s=0.5)
    assert defaults.overlay(Config()) == defaults


def test_a_config_overrides_only_what_it_sets() -> None:
    defaults = ModelSettings(
        device="auto", instances=3, max_batch=8, batch_budget_s=0.5, max_queue=9
    )
    settings = defaults.overlay(Config(max_batch=32, device="cpu"))
    assert settings == ModelSettings(
        device="cpu", instances=3, max_batch=32, batch_budget_s=0.5, max_queue=9
    )
    settings = defaults.overlay(Config(instances=1, batch_budget_s=0.001))
    assert (settings.instances, settings.batch_budget_s) == (1, 0.001)
    assert (settings.device, settings.max_batch) == ("auto", 8)


@pytest.mark.parametrize("count", [0, -4])
def test_counts_below_one_are_read_as_one(count: int) -> None:
    settings = ModelSettings(instances=count, max_batch=count)
    assert (settings.instances, settings.max_batch) == (1, 1)
    overlaid = ModelSettings(max_batch=8).overlay(Config(max_batch=count, instances=count))
    assert (overlaid.instances, overlaid.max_batch) == (1, 1)


def test_a_triton_config_without_batching_turns_the_servers_batching_off(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m" / "config.pbtxt"
    path.parent.mkdir()
    path.write_text('backend: "onnxruntime"\n')
    settings = ModelSettings(max_batch=8, batch_budget_s=0.5).overlay(read_config(path))
    assert settings.max_batch == 1 and settings.batch_budget_s == 0.5


def test_a_latest_policy_keeps_at_least_one_version(tmp_path: Path) -> None:
    path = tmp_path / "m" / "config.pbtxt"
    path.parent.mkdir()
    path.write_text("version_policy { latest { num_versions: 0 } }\n")
    policy = read_config(path).policy
    assert policy == VersionPolicy() and policy.choose([1, 3, 2]) == {3}
    assert VersionPolicy("latest", latest=0).choose([4, 5]) == {5}
