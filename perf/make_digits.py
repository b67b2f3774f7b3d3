"""Regenerate the bundled digits classifier and its sample inputs.

Trains a small MLP on scikit-learn's bundled 8x8 digits dataset (no download) and
exports it to ONNX with plain tensor outputs: `label` (INT64 [N]) and
`probabilities` (FP32 [N, 10]), input `input` (FP32 [N, 64], pixel values 0-16).

Usage: python -m perf.make_digits   (needs the `model` extra: pip install -e '.[model]');
it writes sluice/models/digits.onnx and sluice/models/samples/.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from skl2onnx import to_onnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from sluice.models import FOLDER as HERE

SAMPLES = 10  # one per class, from the held-out split


def main() -> None:
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    model = make_pipeline(
        StandardScaler(),
        MLPClassifier(hidden_layer_sizes=(256,), max_iter=400, random_state=0),
    )
    model.fit(x_train, y_train)
    accuracy = float(model.score(x_test, y_test))

    onx = to_onnx(
        model,
        x_train[:1],
        options={id(model.steps[-1][1]): {"zipmap": False}},
        target_opset=17,
        final_types=None,
    )
    # Friendly, stable names for the graph's inputs and outputs.
    renames = {onx.graph.input[0].name: "input"}
    renames[onx.graph.output[0].name] = "label"
    renames[onx.graph.output[1].name] = "probabilities"
    for node in onx.graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    for value in [*onx.graph.input, *onx.graph.output]:
        value.name = renames.get(value.name, value.name)
    onx.graph.name = "digits"
    onx.doc_string = f"8x8 digits MLP classifier, held-out accuracy {accuracy:.4f}"
    onnx.checker.check_model(onx)
    (HERE / "digits.onnx").write_bytes(onx.SerializeToString())

    samples_dir = HERE / "samples"
    samples_dir.mkdir(exist_ok=True)
    records = []
    for label in range(SAMPLES):
        index = int(np.flatnonzero(y_test == label)[0])
        row = x_test[index : index + 1]
        path = samples_dir / f"digit-{label}.npy"
        np.save(path, row)
        records.append({"file": path.name, "label": label, "input": row[0].tolist()})
    (samples_dir / "samples.json").write_text(json.dumps(records, indent=1) + "\n")
    size = (HERE / "digits.onnx").stat().st_size
    print(f"digits.onnx: {size} bytes, held-out accuracy {accuracy:.4f}, {SAMPLES} samples")


if __name__ == "__main__":
    main()
