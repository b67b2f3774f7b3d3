"""ONNX Runtime's thread spinning: off unless asked for, on every session a model makes (the
load-time probes too), and a server setting with its flag and variable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import pytest

from sluice import models
from sluice.runtime import config
from sluice.server.dataplane import engine as engine_module
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.modelsettings import ModelSettings
from sluice.server.dataplane.repository import load_model
from sluice.server.settings import ServerSettings

KEYS = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")
CONVNET = Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"


def spinning_of(session: ort.InferenceSession) -> list[str]:
    options = session.get_session_options()
    return [options.get_session_config_entry(key) for key in KEYS]


@pytest.mark.parametrize(("spinning", "entry"), [(False, "0"), (True, "1")])
def test_every_instance_takes_the_setting(spinning: bool, entry: str) -> None:
    engine = Engine(models.DIGITS, device="cpu", instances=2, spinning=spinning)
    try:
        assert [spinning_of(i.session) for i in engine.instances] == [[entry, entry]] * 2
    finally:
        engine.close()


def test_off_by_default() -> None:
    engine = Engine(models.DIGITS, device="cpu")
    try:
        assert spinning_of(engine.instances[0].session) == ["0", "0"]
    finally:
        engine.close()


@pytest.mark.parametrize(("spinning", "entry"), [(False, "0"), (True, "1")])
def test_the_thread_probes_run_as_the_model_will_serve(
    monkeypatch: pytest.MonkeyPatch, spinning: bool, entry: str
) -> None:
    """The probes that choose the intra-op threads time the model with the serving setting:
    spinning changes a multi-threaded run's time."""
    seen: list[list[str]] = []

    class Recording(ort.InferenceSession):
        def __init__(self, path: str, options: ort.SessionOptions, **kwargs: Any) -> None:
            seen.append([options.get_session_config_entry(key) for key in KEYS])
            super().__init__(path, options, **kwargs)

    monkeypatch.setattr(engine_module.ort, "InferenceSession", Recording)
    engine = Engine(CONVNET, device="cpu", intra_op_threads=None, spinning=spinning)
    engine.close()
    assert len(seen) >= 2  # at least one probe, and the session that serves
    assert seen == [[entry, entry]] * len(seen)


def parse(argv: list[str], env: dict[str, str] | None = None) -> ServerSettings:
    return config.parse(ServerSettings, argv, "sluice-server", "", environ=env or {})


def test_a_server_setting_with_its_flag_and_variable() -> None:
    assert parse([]).model_settings().spinning is False
    assert parse(["--ort-spinning", "on"]).model_settings().spinning is True
    assert parse(["--ort-spinning", "off"]).model_settings().spinning is False
    assert parse([], {"SLUICE_ORT_SPINNING": "on"}).model_settings().spinning is True
    help_text = config.build_parser(ServerSettings, "sluice-server", "").format_help()
    assert "--ort-spinning" in help_text


@pytest.mark.parametrize(("spinning", "entry"), [(False, "0"), (True, "1")])
async def test_a_loaded_model_takes_the_servers_setting(spinning: bool, entry: str) -> None:
    """--ort-spinning reaches the sessions a load builds (through ModelSettings)."""
    model = await load_model(
        "digits", 1, models.DIGITS, ModelSettings(device="cpu", spinning=spinning)
    )
    try:
        assert spinning_of(model.engine.instances[0].session) == [entry, entry]
    finally:
        model.engine.close()
