"""Compact wire types: an FP32 (or FP16) input that also takes UINT8, INT8, UINT16 or FP16 on
the wire, cast once by the server as x * scale + offset. The spec's syntax (config and flag),
the cast (in a pooled buffer where the batch is staged, else one new array), the check of a
request against what the input accepts, and the refusals at load."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sluice import models
from sluice.core.errors import InvalidInput, LoadFailed
from sluice.perf.sweep import request_body
from sluice.runtime import config
from sluice.server.dataplane import staging
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.buffers import BufferPool, numpy_allocator
from sluice.server.dataplane.engine import Engine, TensorSpec
from sluice.server.dataplane.models import Model, holds_nonfinite, wire_inputs
from sluice.server.dataplane.modelsettings import (
    Accepts,
    Config,
    ModelSettings,
    WireType,
    parse_wire_types,
)
from sluice.server.dataplane.repository import load_model
from sluice.server.modelconfig import convert, parse
from sluice.server.settings import ServerSettings
from tests.conftest import scale_model

WIDTH = 4
U8 = (WireType("UINT8"),)
BY_255 = 1 / 255
WIRES = {"UINT8": np.uint8, "INT8": np.int8, "UINT16": np.uint16, "FP16": np.float16}
U8DT = np.dtype(np.uint8)


# The syntax.


def test_wire_types_parse_with_their_scale_and_offset() -> None:
    assert parse_wire_types("UINT8*0.00392157+0") == (WireType("UINT8", 0.00392157, 0.0),)
    assert parse_wire_types(" uint8 * 1e-3 - 0.5 , FP16") == (
        WireType("UINT8", 0.001, -0.5),
        WireType("FP16"),
    )
    assert parse_wire_types("INT8*-2+3") == (WireType("INT8", -2.0, 3.0),)
    assert parse_wire_types("UINT16*1e+3+2") == (WireType("UINT16", 1000.0, 2.0),)
    assert WireType("UINT8", 0.5, -1.0).describe() == "UINT8*0.5-1"
    assert WireType("FP16").describe() == "FP16"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "is not UINT8|INT8|UINT16|FP16"),
        ("UINT8*x", "is not UINT8"),
        ("UINT8*1/255", "is not UINT8"),
        ("UINT32", "'UINT32' is not a wire type the server casts"),
        ("FP32", "'FP32' is not a wire type"),
        ("UINT8*0", "a scale of 0"),
        ("UINT8*1e999", "must be finite"),
        ("FP16,fp16", "names FP16 twice"),
    ],
)
def test_a_spec_that_does_not_parse_says_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_wire_types(text)


@given(
    st.sampled_from(list(WIRES)),
    st.floats(allow_nan=False, allow_infinity=False).filter(bool),
    st.floats(allow_nan=False, allow_infinity=False),
)
def test_describe_reads_back_as_the_same_wire_type(
    datatype: str, scale: float, offset: float
) -> None:
    wire = WireType(datatype, scale, offset)
    assert parse_wire_types(wire.describe()) == (wire,)


# The cast.


def wire_arrays() -> st.SearchStrategy[np.ndarray]:
    return st.sampled_from(list(WIRES.values())).flatmap(
        lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=1, max_dims=4, max_side=6))
    )


SCALES = st.floats(-1e3, 1e3, allow_nan=False, width=32).filter(bool)
OFFSETS = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def reference(x: np.ndarray, dtype: type, scale: float, offset: float) -> np.ndarray:
    """float32(x) * scale + offset, computed in float32, rounded to the model's dtype once."""
    with np.errstate(over="ignore", invalid="ignore"):
        y: np.ndarray = x.astype(np.float32) * np.float32(scale) + np.float32(offset)
        return y.astype(dtype)


@given(wire_arrays(), st.sampled_from([np.float32, np.float16]), SCALES, OFFSETS)
def test_the_cast_equals_the_float_of_x_times_scale_plus_offset(
    x: np.ndarray, dtype: type, scale: float, offset: float
) -> None:
    how = staging.Cast(np.dtype(dtype), np.float32(scale), np.float32(offset))
    with np.errstate(over="ignore", invalid="ignore"):
        got = staging.cast(x, how)
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, reference(x, dtype, scale, offset))


@given(
    st.lists(
        hnp.arrays(np.uint8, st.tuples(st.integers(1, 4), st.just(3))), min_size=1, max_size=4
    ),
    SCALES,
    OFFSETS,
    st.integers(0, 16),
)
def test_a_staged_batch_is_cast_into_its_pooled_buffer(
    parts: list[np.ndarray], scale: float, offset: float, padded: int
) -> None:
    pool = BufferPool(1 << 20, numpy_allocator)
    how = staging.Cast(np.dtype(np.float32), np.float32(scale), np.float32(offset))
    merged, taken = staging.merge([{"x": p} for p in parts], pool, padded, {("x", U8DT): how})
    rows = sum(len(p) for p in parts)
    assert merged["x"].dtype == np.float32
    assert any(np.shares_memory(merged["x"], buffer) for buffer in taken)
    expected = reference(np.concatenate(parts, dtype=np.uint8), np.float32, scale, offset)
    np.testing.assert_array_equal(merged["x"][:rows], expected)
    assert not merged["x"][rows:].any()  # padding rows are zeros


def test_staging_mixes_requests_sent_as_fp32_and_as_uint8() -> None:
    pool = BufferPool(1 << 20, numpy_allocator)
    how = staging.Cast(np.dtype(np.float32), np.float32(2), np.float32(1))
    plain = np.arange(6, dtype=np.float32).reshape(2, 3)
    small = np.arange(3, dtype=np.uint8).reshape(1, 3)
    orders: list[list[np.ndarray]] = [[plain, small], [small, plain]]
    for order in orders:
        merged, _ = staging.merge([{"x": p} for p in order], pool, 0, {("x", U8DT): how})
        expected = [p if p.dtype == np.float32 else p * 2 + 1 for p in order]
        np.testing.assert_array_equal(merged["x"], np.concatenate(expected).astype(np.float32))


def test_an_fp16_input_is_rounded_once_and_where_the_result_fits_never_overflows() -> None:
    """x * scale stored in FP16 before the offset was added rounded twice (54 of the 256
    uint8 values 1 ulp off at 1/255 + 0.5) and overflowed where the result fits (65535 - 60000
    came out infinite), so a valid config was refused at load."""
    pixels_u8 = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scaled = staging.Cast(np.dtype(np.float16), np.float32(BY_255), np.float32(0.5))
    np.testing.assert_array_equal(
        staging.cast(pixels_u8, scaled), reference(pixels_u8, np.float16, BY_255, 0.5)
    )
    shifted = staging.Cast(np.dtype(np.float16), np.float32(1), np.float32(-60000))
    wide = np.array([0, 65535], np.uint16)
    np.testing.assert_array_equal(staging.cast(wide, shifted), [-60000, 5536])  # 5535, rounded


def test_requests_sent_as_fp32_and_as_a_wire_type_share_a_batch() -> None:
    """The batch key takes the datatype an input is cast to: a uint8 request and an FP32 one
    of the same input batch together on every engine (merge casts each part)."""
    how = staging.Cast(np.dtype(np.float32), np.float32(1), np.float32(0))
    casts = {("x", U8DT): how}
    plain = {"x": np.zeros((2, 3), np.float32)}
    small = {"x": np.zeros((1, 3), np.uint8)}
    assert staging.group_key(plain, ["y"], casts) == staging.group_key(small, ["y"], casts)
    assert staging.group_key(plain, ["y"]) != staging.group_key(small, ["y"])


def test_the_cast_makes_nothing_the_size_of_the_input_beside_its_result() -> None:
    x = np.random.default_rng(0).integers(0, 256, (1, 3, 224, 224), dtype=np.uint8)
    how = staging.Cast(np.dtype(np.float32), np.float32(BY_255), np.float32(-0.5))
    out = np.empty(x.shape, np.float32)
    staging.cast_into(out, x, how)  # anything made once, made now
    tracemalloc.start()
    try:
        staging.cast_into(out, x, how)
        _, into_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        staging.cast(x, how)
        _, cast_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # numpy converts in blocks of 8192 elements: a float32 temporary would be 602 KB.
    assert into_peak < 64 << 10
    assert cast_peak < out.nbytes + (64 << 10)


@pytest.mark.parametrize("call", ["predict", "modelinfer"])
def test_a_uint8_image_is_a_quarter_of_the_fp32_request(call: str) -> None:
    image = np.zeros((1, 3, 224, 224), np.uint8)
    fp32, uint8 = (request_body(image.astype(t), "input", call, "m") for t in (np.float32, U8DT))
    assert image.size <= len(uint8) < image.size + 256  # the header: a few bytes
    assert 3.99 < len(fp32) / len(uint8) < 4


# What a model takes at load.


SPEC = TensorSpec("x", "FP32", (None, WIDTH))


def test_only_a_float_input_the_model_has_takes_a_wire_type() -> None:
    with pytest.raises(LoadFailed, match="input 'y', which the model does not have"):
        wire_inputs([SPEC], {"y": U8})
    ids = TensorSpec("ids", "INT64", (None,))
    with pytest.raises(LoadFailed, match="input 'ids' is INT64: only an FP32 or FP16 input"):
        wire_inputs([ids], {"ids": U8})
    half = TensorSpec("h", "FP16", (None,))
    with pytest.raises(LoadFailed, match="input 'h' is FP16 already"):
        wire_inputs([half], {"h": (WireType("FP16"),)})
    assert wire_inputs([SPEC, ids], {"x": U8})[0].accepts == U8


def test_a_wire_type_whose_values_would_not_fit_the_input_is_refused() -> None:
    half = TensorSpec("h", "FP16", (None,))
    # 65535 is beyond FP16's 65504: the cast would make infinity of a number.
    with pytest.raises(LoadFailed, match=r"input 'h': UINT16 would make .* beyond FP16"):
        wire_inputs([half], {"h": (WireType("UINT16"),)})
    with pytest.raises(LoadFailed, match="input 'x': FP16\\*1e\\+35"):
        wire_inputs([SPEC], {"x": (WireType("FP16", 1e35),)})
    found = wire_inputs([half], {"h": (WireType("UINT16", 1 / 65535), WireType("UINT8"))})
    assert len(found[0].accepts) == 2


@given(
    hnp.arrays(np.float16, hnp.array_shapes(max_dims=2, max_side=8)),
    st.floats(-1e3, 1e3, allow_nan=False).filter(bool),
    st.floats(-1e3, 1e3, allow_nan=False),
)
def test_a_cast_that_loads_keeps_nan_and_infinity_and_makes_none(
    x: np.ndarray, scale: float, offset: float
) -> None:
    """Why the check reads an FP16 input as sent: the same answer as after the cast."""
    (spec,) = wire_inputs([SPEC], {"x": (WireType("FP16", scale, offset),)})
    how = staging.Cast(spec.dtype, np.float32(scale), np.float32(offset))
    with np.errstate(invalid="ignore"):  # inf - inf is NaN: a NaN either way
        cast = staging.cast(x, how)
    assert holds_nonfinite(cast) == holds_nonfinite(x)


def test_the_fp16_check_reads_bits_and_agrees_with_isfinite_on_every_value() -> None:
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    rows = np.tile(np.array([0.5, -2.0, 65504, -65504, 0], np.float16), (len(every), 1))
    rows[:, -1] = every  # each FP16 value among the extreme finite ones
    told = [holds_nonfinite(row) for row in rows]
    assert told == [not bool(v) for v in np.isfinite(every)]
    assert holds_nonfinite(np.full((4, 6), np.inf, np.float16)[:, ::2])  # not contiguous
    assert holds_nonfinite(np.array(np.nan, np.float16))  # a scalar


def test_the_fp16_check_of_an_image_makes_no_temporary() -> None:
    image = np.ones((1, 3, 224, 224), np.float16)
    tracemalloc.start()
    try:
        assert not holds_nonfinite(image)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4096  # no temporary: a mask would be 150 KB


# The model: its check, and the cast on the way to ONNX Runtime.


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """y = x over FP32[N, 4]: the answer is what the model was given."""
    path = tmp_path_factory.mktemp("models") / "identity.onnx"
    path.write_bytes(scale_model(1.0, WIDTH))
    return path


def served(path: Path, accepts: Accepts, stage: bool | None = None) -> Model:
    built = Engine(path, device="cpu", stage=stage)
    batcher = Batcher(built.instances, max_rows=8, budget_s=0.0, max_queue=64)
    return Model(built, batcher, accepts=accepts)


@pytest.fixture(params=["cast at once", "cast as staged"])
def model(request: pytest.FixtureRequest, identity: Path) -> Iterator[Model]:
    """The identity model with x taking UINT8, FP16 and INT8 (scale 1/255, offset -0.5):
    on the CPU's path (cast when the call arrives) and on the staged one (into the pooled
    buffer every batch is copied into, as on CUDA)."""
    accepts = {
        "x": (
            WireType("UINT8"),
            WireType("FP16", 2.0),
            WireType("INT8", BY_255, -0.5),
        )
    }
    found = served(identity, accepts, stage=request.param == "cast as staged")
    yield found
    found.engine.close()


async def run(model: Model, x: np.ndarray) -> np.ndarray:
    outputs, _ = await model.run({"x": x}, ["y"], None)
    return outputs["y"]


def pixels(rows: int = 3) -> np.ndarray:
    return np.random.default_rng(rows).integers(0, 256, (rows, WIDTH), dtype=np.uint8)


async def test_uint8_on_the_wire_answers_as_the_same_values_sent_as_fp32(model: Model) -> None:
    x = pixels()
    got = await run(model, x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, await run(model, x.astype(np.float32)))


async def test_scale_and_offset_are_applied_once(model: Model) -> None:
    x = np.array([[-128, -1, 0, 127]], np.int8)
    np.testing.assert_array_equal(await run(model, x), reference(x, np.float32, BY_255, -0.5))
    half = np.array([[0.5, -2.0, 1e4, 0.0]], np.float16)
    np.testing.assert_array_equal(await run(model, half), half.astype(np.float32) * 2)


async def test_uint8_scaled_by_1_255_is_the_fp32_of_x_255_within_1e_6(identity: Path) -> None:
    scaled = served(identity, {"x": (WireType("UINT8", BY_255),)})
    try:
        x = np.arange(256, dtype=np.uint8).reshape(-1, WIDTH)
        got = await run(scaled, x)
        np.testing.assert_allclose(got, (x / 255).astype(np.float32), rtol=1e-6)
    finally:
        await scaled.close()


async def test_batches_of_requests_sent_in_a_wire_type_are_cast_together(model: Model) -> None:
    xs = [pixels(rows) for rows in (1, 2, 3, 1)]
    got = await asyncio.gather(*(run(model, x) for x in xs))
    for x, y in zip(xs, got, strict=True):
        np.testing.assert_array_equal(y, x.astype(np.float32))


def test_a_staged_model_casts_only_into_its_pooled_buffers(
    identity: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged = served(identity, {"x": U8}, stage=True)
    try:

        def refused(*args: object) -> None:
            raise AssertionError("a staged request was cast into an array of its own")

        monkeypatch.setattr(staging, "cast", refused)
        x = pixels()
        np.testing.assert_array_equal(asyncio.run(run(staged, x)), x.astype(np.float32))
    finally:
        staged.engine.close()


def test_a_wire_type_the_input_does_not_take_is_refused_naming_all_three(model: Model) -> None:
    with pytest.raises(InvalidInput) as caught:
        model.check({"x": pixels().astype(np.uint16)})
    assert str(caught.value) == (
        "input 'x' is UINT16 but the model takes FP32 "
        "(or, cast by the server, UINT8, FP16*2, INT8*0.00392156862745098-0.5)"
    )


def test_without_wire_types_the_message_is_as_before(identity: Path) -> None:
    plain = served(identity, {})
    try:
        with pytest.raises(InvalidInput, match=r"^input 'x' is UINT8 but the model takes FP32$"):
            plain.check({"x": pixels()})
    finally:
        plain.engine.close()


def test_nan_and_infinity_are_told_for_fp16_and_never_looked_for_in_integers(
    model: Model,
) -> None:
    half = np.array([[0.0, np.nan, 1.0, np.inf]], np.float16)
    assert model.check({"x": half}) == ["x"]
    assert model.check({"x": half[:, [0, 2]].repeat(2, axis=1)}) == []
    assert model.check({"x": pixels()}) == []


def test_a_model_says_what_its_inputs_also_take(model: Model) -> None:
    assert model.describe().endswith(
        "1 instance, x also takes UINT8, FP16*2, INT8*0.00392156862745098-0.5"
    )
    assert model.inputs[0].accepts[0] == WireType("UINT8")


async def test_a_load_naming_an_input_the_model_lacks_is_refused(identity: Path) -> None:
    settings = ModelSettings(device="cpu", accepts={"image": U8})
    with pytest.raises(LoadFailed) as caught:
        await load_model("identity", 1, identity, settings)
    assert str(identity) in str(caught.value)
    assert "input 'image', which the model does not have" in str(caught.value)


async def test_the_digits_model_takes_uint8_pixels_through_a_load() -> None:
    settings = ModelSettings(device="cpu", accepts={"input": U8})
    digits = await load_model("digits", 1, models.DIGITS, settings)
    try:
        x = models.samples()[0].input
        pixels = x.astype(np.uint8)
        assert (pixels == x).all()  # the samples are whole numbers 0..16
        outputs, _ = await digits.run({"input": pixels}, [], None)
        expected, _ = await digits.run({"input": x}, [], None)
        for name in expected:
            np.testing.assert_array_equal(outputs[name], expected[name])
    finally:
        await digits.close()


# The config file and the flag.

CONFIG = """
name: "m"
parameters { key: "sluice.accept.image" value: { string_value: "UINT8*0.00392157+0, FP16" } }
parameters { key: "note" value: { string_value: "kept as it was" } }
"""


def test_a_config_names_its_inputs_wire_types(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sluice.modelconfig")
    found = convert(parse(CONFIG), "m/config.pbtxt", "m")
    assert found.accepts == {"image": (WireType("UINT8", 0.00392157), WireType("FP16"))}
    assert "ignores parameters note" in caplog.text  # other parameters: as before
    assert "sluice.accept" not in caplog.text
    assert convert(parse('name: "m"')).accepts is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            'parameters { key: "sluice.accept.image" value: { string_value: "UINT32" } }',
            "parameter 'sluice.accept.image' \\(input 'image'\\): 'UINT32' is not a wire type",
        ),
        (
            'parameters { key: "sluice.accept." value: { string_value: "UINT8" } }',
            "parameter 'sluice.accept.' names no input",
        ),
    ],
)
def test_a_config_whose_wire_types_do_not_parse_is_refused(text: str, why: str) -> None:
    with pytest.raises(LoadFailed, match=why):
        convert(parse(text), "m/config.pbtxt")


def test_a_configs_wire_types_replace_the_servers() -> None:
    defaults = ModelSettings(accepts={"x": U8})
    assert defaults.overlay(Config()).accepts == {"x": U8}
    assert defaults.overlay(Config(accepts={"y": U8})).accepts == {"y": U8}


def settings(*argv: str) -> ServerSettings:
    return config.parse(ServerSettings, list(argv), "sluice-server", "", environ={})


def test_the_flag_gives_one_model_or_a_named_one_its_wire_types() -> None:
    one = settings("--model", "/m/a.onnx", "--accept", "x:0=UINT8*0.5+1", "--accept", "x:0=FP16")
    assert one.accepts() == {"": {"x:0": (WireType("UINT8", 0.5, 1.0), WireType("FP16"))}}
    assert one.model_settings("").accepts == {"x:0": one.accepts()[""]["x:0"]}
    assert one.model_settings().accepts == {}  # a repository's models get none of them
    two = settings("--model", "a=/m/a.onnx", "--model", "b=/m/b.onnx", "--accept", "b:input=UINT8")
    assert two.accepts() == {"b": {"input": U8}}
    assert two.model_settings("a").accepts == {}
    assert two.model_settings("b").accepts == {"input": U8}
    env = config.parse(
        ServerSettings, [], "sluice-server", "", environ={"SLUICE_ACCEPT": "x=UINT8,y=FP16"}
    )
    assert env.accepts() == {"": {"x": U8, "y": (WireType("FP16"),)}}  # the bundled model's


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--accept", "x"], "--accept takes \\[MODEL:\\]INPUT="),
        (["--accept", "x=UINT32"], "'UINT32' is not a wire type the server casts"),
        (["--accept", "x=UINT8,FP16"], "one wire type each; repeat it for more"),
        (["--accept", "x=UINT8", "--accept", "x=UINT8*2"], "gives input 'x' UINT8 twice"),
        (
            ["--model", "a=/a.onnx", "--model", "/b.onnx", "--accept", "x=UINT8"],
            "names none of the 2 --model entries \\(named: 'a'\\)",
        ),
        (
            ["--model", "a=/a.onnx", "--model", "b=/b.onnx", "--accept", "c:x=UINT8"],
            "say which, as MODEL:INPUT",
        ),
        (["--model-repository", "/r", "--accept", "x=UINT8"], "--accept is for --model models"),
    ],
)
def test_a_bad_flag_is_refused_at_start(argv: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        settings(*argv)
