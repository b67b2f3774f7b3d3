"""The benchmark text encoder (perf/make_text.py): its inputs and outputs, seeded weights, and
the property the padding benchmark rests on: a row padded beside longer ones answers at its
real positions (and pooled) as it does alone. Run in CPU onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from perf import make_text


def small(token_types: bool = True, seed: int = 0) -> bytes:
    """A tiny encoder of the same graph: quick to build and check."""
    return make_text.build(
        vocab=64, hidden=16, heads=2, layers=1, max_length=16, token_types=token_types, seed=seed
    )


@pytest.fixture(scope="module")
def encoder() -> bytes:
    return make_text.build()


def dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_the_encoder_takes_ids_masks_and_types_of_any_batch_and_length(encoder: bytes) -> None:
    model = onnx.load_from_string(encoder)
    assert model.opset_import[0].version == 17
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == ["input_ids", "attention_mask", "token_type_ids"]
    for value in inputs.values():
        assert value.type.tensor_type.elem_type == onnx.TensorProto.INT64
        assert dims(value) == ["batch", "sequence"]
    hidden, pooled = model.graph.output
    assert (hidden.name, dims(hidden)) == ("last_hidden_state", ["batch", "sequence", 256])
    assert (pooled.name, dims(pooled)) == ("pooled", ["batch", 256])
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Softmax") == 2 and ops.count("LayerNormalization") == 5  # 1 + 2 a layer
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    assert shapes["embed.token_table"] == [8192, 256]
    assert shapes["embed.position_table"] == [128, 256]
    assert shapes["layer1.mlp.in.weight"] == [256, 1024]
    bare = onnx.load_from_string(small(token_types=False))
    assert [i.name for i in bare.graph.input] == ["input_ids", "attention_mask"]


def test_a_padded_row_answers_as_it_does_alone(encoder: bytes) -> None:
    run = ort.InferenceSession(encoder, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    rows = [make_text.example(rng, n) for n in (8, 40, 77)]
    batch = make_text.stacked(rows, 128)
    assert batch["input_ids"].shape == (3, 128) and batch["attention_mask"][0, 8:].sum() == 0
    hidden, pooled = run.run(None, batch)
    assert hidden.shape == (3, 128, 256) and pooled.shape == (3, 256)
    for i, row in enumerate(rows):
        n = row["input_ids"].shape[1]
        alone_hidden, alone_pooled = run.run(None, row)
        make_text.assert_close(hidden[i : i + 1, :n], alone_hidden, "hidden")
        make_text.assert_close(pooled[i : i + 1], alone_pooled, "pooled")
        # pooled is the mean of the real positions
        np.testing.assert_allclose(alone_pooled[0], alone_hidden[0].mean(0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(pooled[0], pooled[1])


def test_assert_close_is_relative_to_the_largest_magnitude() -> None:
    want = np.array([[100.0, 0.001]], np.float32)
    make_text.assert_close(want + np.float32(5e-4), want, "near")  # 5e-6 of 100
    with pytest.raises(AssertionError, match=r"far: 1\.00e-04 relative"):
        make_text.assert_close(want + np.float32(0.01), want, "far")
    with pytest.raises(AssertionError, match="shapes"):
        make_text.assert_close(want[:, :1], want, "cut")


def test_the_self_check_refuses_an_encoder_whose_padding_leaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small()  # the mask holds: checked
    monkeypatch.setattr(make_text, "MASKED", 0.0)  # padded keys no longer masked
    with pytest.raises(AssertionError, match="last_hidden_state, row of 3"):
        small()


def test_the_weights_are_seeded() -> None:
    one = small(seed=0)
    assert small(seed=0) == one
    assert small(seed=1) != one
    with pytest.raises(ValueError, match="multiple of heads"):
        make_text.build(hidden=10, heads=4)


def test_the_cached_encoder_is_written_once_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = make_text.cached(max_length=32, token_types=False)
    assert path.parent == tmp_path / "sluice" and path.name == make_text.name(32, False)
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert make_text.cached(max_length=32, token_types=False) == path


def test_main_writes_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m" / "text.onnx"
    args = ["--vocab", "64", "--layers", "1", "--max-length", "16", "--no-token-types"]
    assert make_text.main([*args, "--out", str(out)]) == 0
    assert "padded rows checked equal" in capsys.readouterr().out
    assert out.read_bytes() == make_text.build(vocab=64, layers=1, max_length=16, token_types=False)
