"""perf/textbatch.py's options that are settled before any process starts: --device cuda
refused where ONNX Runtime has no CUDA provider or no GPU, and --variant's parsing."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from perf import textbatch
from sluice.server.dataplane import gpu


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers() and gpu.device_count() > 0,
    reason="CUDA is at hand: the refusal is for a machine without it",
)
def test_cuda_is_refused_at_once_without_cuda() -> None:
    with pytest.raises(SystemExit, match="--device cuda, but"):
        textbatch.main(["--device", "cuda", "--rounds", "1"])


def test_an_unknown_device_is_refused() -> None:
    with pytest.raises(SystemExit):
        textbatch.build_parser().parse_args(["--device", "tpu"])


def test_variants_split_their_flags_at_commas() -> None:
    got = textbatch.parse_variants(["two=--instances=2", "wide=--max-batch,8"])
    assert got == {"two": ("--instances=2",), "wide": ("--max-batch", "8")}


@pytest.mark.parametrize("item", ["two", "two=", "=--instances=2", "batched=--instances=2"])
def test_a_variant_without_name_or_flags_or_with_a_taken_name_is_refused(item: str) -> None:
    with pytest.raises(ValueError, match="--variant"):
        textbatch.parse_variants([item])


def test_variants_sit_after_the_padding_server_in_the_table() -> None:
    order = list(textbatch.labels({"two": ("--instances=2",)}))
    assert order.index("two") == order.index("batched") + 1
    assert textbatch.labels({"two": ("--instances=2",)})["two"].endswith("--instances=2")
