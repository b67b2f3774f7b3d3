"""Write a small text encoder as ONNX for benchmarks of variable-length inputs: a BERT-shaped
model with seeded random weights. Inputs input_ids, attention_mask and (by default)
token_type_ids, INT64 [batch, sequence]; outputs last_hidden_state FP32 [batch, sequence,
hidden] and pooled FP32 [batch, hidden], the mean of the real positions. A token embedding
(Gather over the vocabulary), learned positions and token types, layer norm, then `layers`
of masked self-attention (the mask adds -1e4 to the scores of padded keys) and an MLP, each
with a residual and layer norm. Padding a row with any ids under a mask of 0 leaves its real
positions' answers as they were, which build() checks in ONNX Runtime.

  python -m perf.make_text --out text.onnx
  python -m perf.make_text --no-token-types --max-length 512 --out text512.onnx
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from perf.make_mlp import cache_path, finish, require_onnx

VOCAB = 8192
HIDDEN = 256
HEADS = 4
LAYERS = 2
MLP = 4  # the MLP's width, in hiddens
MAX_LENGTH = 128  # positions learned: the longest sequence the model takes
STD = 0.02  # BERT's initializer range
MASKED = -1e4  # added to a padded key's scores: its softmax weight underflows to 0
EPSILON = 1e-12
RTOL = 1e-5  # a padded row's real positions against the row run alone
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUTS = ("last_hidden_state", "pooled")


def build(
    *,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    heads: int = HEADS,
    layers: int = LAYERS,
    max_length: int = MAX_LENGTH,
    token_types: bool = True,
    seed: int = 0,
) -> bytes:
    """The model's bytes, checked by onnx.checker and by self_check in ONNX Runtime."""
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    require_onnx("text encoder")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    initializers: list[Any] = []

    def constant(name: str, array: np.ndarray) -> str:
        initializers.append(numpy_helper.from_array(array, name))
        return name

    def weights(name: str, shape: tuple[int, ...]) -> str:
        array = rng.standard_normal(shape, dtype=np.float32)
        array *= np.float32(STD)
        return constant(name, array)

    def node(op: str, inputs: Sequence[str], output: str, **attrs: Any) -> str:
        nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attrs))
        return output

    def norm(name: str, x: str) -> str:
        gamma = constant(f"{name}.weight", np.ones(hidden, np.float32))
        beta = constant(f"{name}.bias", np.zeros(hidden, np.float32))
        return node("LayerNormalization", [x, gamma, beta], name, axis=-1, epsilon=EPSILON)

    def dense(name: str, x: str, width: int, out: int) -> str:
        w = weights(f"{name}.weight", (width, out))
        b = constant(f"{name}.bias", np.zeros(out, np.float32))
        return node("Add", [node("MatMul", [x, w], f"{name}.matmul"), b], name)

    def scalar(name: str, value: float) -> str:
        return constant(name, np.array(value, np.float32))

    size = hidden // heads
    split = constant("shape.heads", np.array([0, 0, heads, size], np.int64))
    joined = constant("shape.hidden", np.array([0, 0, hidden], np.int64))

    # Embeddings: tokens, then positions 0..sequence-1, then token types.
    x = node("Gather", [weights("embed.token_table", (vocab, hidden)), "input_ids"], "embed.token")
    shape = node("Shape", ["input_ids"], "embed.shape")
    length = node("Gather", [shape, constant("one.index", np.array(1, np.int64))], "embed.length")
    start = constant("zero.i64", np.array(0, np.int64))
    step = constant("one.i64", np.array(1, np.int64))
    positions = node("Range", [start, length, step], "embed.positions")
    position = node(
        "Gather",
        [weights("embed.position_table", (max_length, hidden)), positions],
        "embed.position",
    )
    x = node("Add", [x, position], "embed.with_positions")
    if token_types:
        kind = node(
            "Gather", [weights("embed.type_table", (2, hidden)), "token_type_ids"], "embed.type"
        )
        x = node("Add", [x, kind], "embed.with_types")
    x = norm("embed.norm", x)

    # The mask: 0 on a real key, MASKED on a padded one, [batch, 1, 1, sequence].
    mask = node("Cast", ["attention_mask"], "mask.float", to=TensorProto.FLOAT)
    off = node("Sub", [mask, scalar("one.f32", 1.0)], "mask.off")
    bias = node("Mul", [off, scalar("mask.scale", -MASKED)], "mask.scaled")
    bias = node("Unsqueeze", [bias, constant("axes.1_2", np.array([1, 2], np.int64))], "mask.bias")
    scale = scalar("attention.scale", 1.0 / float(np.sqrt(size)))

    for layer in range(layers):
        p = f"layer{layer}"

        def heads_of(name: str, perm: list[int], source: str) -> str:
            projected = dense(name, source, hidden, hidden)
            shaped = node("Reshape", [projected, split], f"{name}.heads")
            return node("Transpose", [shaped], f"{name}.t", perm=perm)

        q = heads_of(f"{p}.query", [0, 2, 1, 3], x)  # [batch, heads, sequence, size]
        k = heads_of(f"{p}.key", [0, 2, 3, 1], x)  # [batch, heads, size, sequence]
        v = heads_of(f"{p}.value", [0, 2, 1, 3], x)
        scores = node("Mul", [node("MatMul", [q, k], f"{p}.scores.raw"), scale], f"{p}.scores")
        attention = node(
            "Softmax",
            [node("Add", [scores, bias], f"{p}.scores.masked")],
            f"{p}.attention",
            axis=-1,
        )
        context = node("MatMul", [attention, v], f"{p}.context.heads")
        context = node("Transpose", [context], f"{p}.context.t", perm=[0, 2, 1, 3])
        context = node("Reshape", [context, joined], f"{p}.context")
        attended = dense(f"{p}.output", context, hidden, hidden)
        x = norm(f"{p}.attention.norm", node("Add", [x, attended], f"{p}.attention.residual"))

        # The MLP: GELU written with Erf (opset 17 has no Gelu; ONNX Runtime fuses this).
        h = dense(f"{p}.mlp.in", x, hidden, hidden * MLP)
        erf = node(
            "Erf",
            [node("Mul", [h, scalar(f"{p}.gelu.root", 1 / np.sqrt(2))], f"{p}.gelu.scaled")],
            f"{p}.gelu.erf",
        )
        gate = node("Add", [erf, "one.f32"], f"{p}.gelu.gate")
        h = node(
            "Mul",
            [node("Mul", [h, gate], f"{p}.gelu.product"), scalar(f"{p}.gelu.half", 0.5)],
            f"{p}.gelu",
        )
        out = dense(f"{p}.mlp.out", h, hidden * MLP, hidden)
        x = norm(f"{p}.mlp.norm", node("Add", [x, out], f"{p}.mlp.residual"))

    node("Identity", [x], "last_hidden_state")
    # The mean over the real positions (a row with none pools to 0, not NaN).
    weighted = node(
        "Mul",
        [x, node("Unsqueeze", [mask, constant("axes.2", np.array([2], np.int64))], "pool.mask")],
        "pool.weighted",
    )
    axis = constant("axes.1", np.array([1], np.int64))
    summed = node("ReduceSum", [weighted, axis], "pool.sum", keepdims=0)
    count = node("ReduceSum", [mask, axis], "pool.count.raw", keepdims=1)
    count = node("Max", [count, "one.f32"], "pool.count")
    node("Div", [summed, count], "pooled")

    dims = ["batch", "sequence"]
    names = INPUTS if token_types else INPUTS[:2]
    graph = helper.make_graph(
        nodes,
        f"text{hidden}x{layers}_{vocab}_{max_length}",
        [helper.make_tensor_value_info(n, TensorProto.INT64, dims) for n in names],
        [
            helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [*dims, hidden]),
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", hidden]),
        ],
        initializers,
    )
    model = finish(graph)
    self_check(model, vocab, max_length)
    return model


def example(rng: np.random.Generator, length: int, vocab: int = VOCAB) -> dict[str, np.ndarray]:
    """One request's inputs, [1, length]: random ids past the special ones, a mask of ones,
    token type 0 on the first half and 1 on the rest (a sentence pair)."""
    ids = rng.integers(4, vocab, size=(1, length), dtype=np.int64)
    types = (np.arange(length, dtype=np.int64) >= length // 2).astype(np.int64)[None]
    return {
        "input_ids": ids,
        "attention_mask": np.ones((1, length), np.int64),
        "token_type_ids": types,
    }


def stacked(rows: Sequence[Mapping[str, np.ndarray]], length: int) -> dict[str, np.ndarray]:
    """Rows of [1, own length] padded with 0 to `length` and stacked: [rows, length]."""
    out = {}
    for name in rows[0]:
        batch = np.zeros((len(rows), length), np.int64)
        for i, row in enumerate(rows):
            batch[i, : row[name].shape[1]] = row[name][0]
        out[name] = batch
    return out


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Within RTOL relative to the largest magnitude of `want` (a layer norm's outputs cross
    zero, where an element's own relative error means nothing)."""
    scale = float(np.max(np.abs(want))) or 1.0
    worst = float(np.max(np.abs(got - want))) / scale
    if got.shape != want.shape or not worst <= RTOL:
        raise AssertionError(f"{what}: {worst:.2e} relative (shapes {got.shape}, {want.shape})")


def self_check(model: bytes, vocab: int, max_length: int) -> None:
    """Run in ONNX Runtime: finite answers, and rows of different
    lengths padded together (with token ids that are not 0, as a caller's may be) equal to
    each row run alone at its real positions, pooled included."""
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    rng = np.random.default_rng(1)
    lengths = (3, max_length // 2 + 1, max_length)
    rows = [{k: v for k, v in example(rng, n, vocab).items() if k in names} for n in lengths]
    batch = stacked(rows, max_length)
    batch["input_ids"][batch["attention_mask"] == 0] = vocab - 1
    hidden, pooled = session.run(list(OUTPUTS), batch)
    if not (np.isfinite(hidden).all() and np.isfinite(pooled).all()):
        raise AssertionError("the text encoder's answers are not finite")
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        alone_hidden, alone_pooled = session.run(list(OUTPUTS), row)
        assert_close(hidden[i : i + 1, :n], alone_hidden, f"last_hidden_state, row of {n}")
        assert_close(pooled[i : i + 1], alone_pooled, f"pooled, row of {n}")


def name(max_length: int = MAX_LENGTH, token_types: bool = True) -> str:
    """The cached file's name: the defaults' sizes and seed, these options."""
    types = "" if token_types else "_notypes"
    return f"text{HIDDEN}x{LAYERS}_{VOCAB}_{max_length}{types}.onnx"


def cached(max_length: int = MAX_LENGTH, token_types: bool = True) -> Path:
    """The encoder's file in the user's cache folder, written (and checked) on first use
    (15 MB at the defaults)."""
    return cache_path(
        name(max_length, token_types),
        lambda: build(max_length=max_length, token_types=token_types),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m perf.make_text",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--max-length", type=int, default=MAX_LENGTH, help="positions learned")
    parser.add_argument(
        "--no-token-types", action="store_true", help="inputs input_ids and attention_mask only"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = build(
        vocab=args.vocab,
        hidden=args.hidden,
        heads=args.heads,
        layers=args.layers,
        max_length=args.max_length,
        token_types=not args.no_token_types,
        seed=args.seed,
    )
    out.write_bytes(model)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB); padded rows checked equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
