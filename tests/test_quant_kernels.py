"""The compiled quantized kernels (pdserve/quant/_kernels.c) against references.

The method (pdserve/quant/README.md): each weight block is dequantized to exactly the fp32
values of gguf-py's dequantization, then multiplied by the fp32 activations, each output
as 8 FMA lanes (lane l sums k = l, l+8, ...) and a 3-level horizontal sum. So against
the float64 product with the same weights the only error is fp32 rounding of those sums:
at most gamma(K/8 + 3) * sum_k |w_k x_k|, with gamma(n) = n u / (1 - n u), u = 2^-24
(the standard bound for recursive summation, Higham, Accuracy and Stability, 3.1). The
weights' own exactness is checked apart: the product with one-hot rows returns each
dequantized weight bit for bit.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pdserve.model.default import default_model_path
from pdserve.quant.formats import QuantType, QuantWeight
from pdserve.quant.linear import QuantLinear

SHAPES = [(1, 576, 576), (3, 130, 96), (7, 5, 64), (70, 33, 160), (1, 7, 32), (131, 64, 1536)]


def reference_weight(qw: QuantWeight) -> torch.Tensor:
    """gguf-py's dequantization of the same blocks (llama.cpp's reference code)."""
    n, k = qw.shape
    w = gguf.quants.dequantize(qw.to_blocks(), qw.qtype.ggml)
    return torch.from_numpy(np.ascontiguousarray(w).reshape(n, k))


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output element: gamma(K/8 + 3) * sum_k |w_k x_k| (the module docstring)."""
    n = x.shape[1] // 8 + 3
    u = 2.0**-24
    return n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().T)


def check(x: torch.Tensor, qw: QuantWeight) -> None:
    y = QuantLinear(qw, None)(x)
    w = reference_weight(qw)
    err = (y.double() - x.double() @ w.double().T).abs()
    bound = error_bound(x, w)
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("qtype", list(QuantType))
@pytest.mark.parametrize("shape", SHAPES)
def test_random_blocks_within_the_bound(qtype: QuantType, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    qw = QuantWeight.quantize(w, qtype)
    assert torch.equal(qw.dequantize(), reference_weight(qw))
    check(torch.randn(m, k, generator=gen) * 3, qw)


@pytest.mark.parametrize("qtype", list(QuantType))
def test_the_weights_are_read_as_their_exact_fp32_values(qtype: QuantType) -> None:
    """One-hot rows pick out single weights: the product returns gguf-py's dequantized
    values bit for bit, through the few-rows path (registers, 3 rows) and the many-rows
    path (a per-thread buffer, all 96 rows)."""
    gen = torch.Generator().manual_seed(11)
    qw = QuantWeight.quantize(torch.randn(37, 96, generator=gen) * 5, qtype)
    w = reference_weight(qw)
    op = QuantLinear(qw, None)
    eye = torch.eye(96)
    assert torch.equal(op(eye[:3]), w.T[:3])
    assert torch.equal(op(eye), w.T)


def shipped_tensors() -> dict[str, gguf.ReaderTensor]:
    reader = gguf.GGUFReader(str(default_model_path()))
    return {t.name: t for t in reader.tensors}


def from_gguf(t: gguf.ReaderTensor, rows: int | None = None) -> QuantWeight:
    qtype = QuantType.from_ggml(t.tensor_type)
    assert qtype is not None
    k = int(t.shape[0])
    raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)
    return QuantWeight.from_blocks(qtype, raw[:rows], k)


@pytest.mark.slow
def test_the_shipped_models_tensors_within_the_bound() -> None:
    """Q4_1 projections (K 576 and 1536), the Q8_0 embedding (first 4096 rows) and a
    real tensor requantized to Q4_0 and Q8_0; activations of a real hidden-state scale."""
    tensors = shipped_tensors()
    gen = torch.Generator().manual_seed(0)
    cases = [
        from_gguf(tensors["blk.0.attn_q.weight"]),
        from_gguf(tensors["blk.3.ffn_down.weight"]),
        from_gguf(tensors["token_embd.weight"], rows=4096),
    ]
    assert [c.qtype for c in cases] == [QuantType.Q4_1, QuantType.Q4_1, QuantType.Q8_0]
    real = reference_weight(from_gguf(tensors["blk.5.ffn_up.weight"]))
    cases += [QuantWeight.quantize(real, t) for t in (QuantType.Q4_0, QuantType.Q8_0)]
    for qw in cases:
        for m in (1, 5, 67):
            check(torch.randn(m, qw.shape[1], generator=gen), qw)


@pytest.mark.parametrize("qtype", list(QuantType))
def test_every_row_is_computed_the_same_whatever_the_batch_and_threads(qtype: QuantType) -> None:
    """Batch invariance (the kernel's contract): a row's output is bit-identical alone,
    in any batch, at any position, on 1 or 2 threads."""
    gen = torch.Generator().manual_seed(7)
    qw = QuantWeight.quantize(torch.randn(203, 320, generator=gen), qtype)
    op = QuantLinear(qw, None)
    x = torch.randn(150, 320, generator=gen)
    batch = op(x)
    assert torch.equal(torch.cat([op(x[i : i + 1]) for i in range(150)]), batch)
    assert torch.equal(torch.cat([op(x[i : i + 7]) for i in range(0, 150, 7)]), batch)
    assert torch.equal(op(x.flip(0)).flip(0), batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(x), batch)
    finally:
        torch.set_num_threads(threads)


def test_bias_strided_input_and_empty_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    qw = QuantWeight.quantize(torch.randn(40, 64, generator=gen), QuantType.Q4_1)
    bias = torch.randn(40, generator=gen)
    op = QuantLinear(qw, bias)
    wide = torch.randn(6, 128, generator=gen)
    x = wide[:, 32:96]  # rows 128 apart: the kernel reads the stride
    assert torch.equal(op(x), QuantLinear(qw, None)(x.contiguous()) + bias)
    assert op(torch.empty(0, 64)).shape == (0, 40)


def test_bad_shapes_and_blocks_are_refused_with_the_numbers() -> None:
    qw = QuantWeight.quantize(torch.randn(8, 64), QuantType.Q8_0)
    op = QuantLinear(qw, None)
    with pytest.raises(ValueError, match=r"expected \[T, 64\], got \[2, 32\]"):
        op(torch.randn(2, 32))
    with pytest.raises(TypeError, match=r"fp32 CPU activations, got torch\.float64"):
        op(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="row length 48 is not a multiple of 32"):
        QuantWeight.from_blocks(QuantType.Q4_0, np.zeros(36, np.uint8), 48)
    with pytest.raises(ValueError, match="35 bytes are not whole rows of 2 Q4_0 blocks"):
        QuantWeight.from_blocks(QuantType.Q4_0, np.zeros(35, np.uint8), 64)
    with pytest.raises(ValueError, match=r"cannot fuse Q8_0 \[\*, 64\] with Q4_1 \[\*, 64\]"):
        QuantWeight.cat([qw, QuantWeight.quantize(torch.randn(8, 64), QuantType.Q4_1)])
