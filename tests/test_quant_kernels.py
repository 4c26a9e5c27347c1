"""The compiled quantized kernels (pdserve/kernels/_kernels.c) against references.

The method (pdserve/kernels/README.md): each weight block is dequantized to exactly the fp32
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
from helpers.tiny_models import quantize_blocks

from pdserve.model.default import default_model_path
from pdserve.quant.formats import QuantType, QuantWeight
from pdserve.quant.linear import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.kernels

SHAPES = [(1, 576, 576), (3, 130, 96), (7, 5, 64), (70, 33, 160), (1, 7, 32), (131, 64, 1536)]
K_SHAPES = [(1, 576, 512), (3, 130, 256), (70, 33, 768), (131, 64, 1536)]  # K: 256 per block
ALL_SHAPES = [(t, s) for t in QuantType for s in (K_SHAPES if t.block_values == 256 else SHAPES)]


def reference(raw: np.ndarray, qtype: QuantType, k: int) -> torch.Tensor:
    """gguf-py's dequantization of GGUF bytes (llama.cpp's reference code)."""
    w = gguf.quants.dequantize(raw, qtype.ggml)
    return torch.from_numpy(np.ascontiguousarray(w).reshape(-1, k))


def quantized(w: torch.Tensor, qtype: QuantType) -> tuple[QuantWeight, torch.Tensor]:
    """w in `qtype` (the file's bytes as llama.cpp's converter, or tests/helpers/kquants.py
    for the K formats, would write them), and gguf-py's dequantization of those bytes."""
    raw = quantize_blocks(w.numpy(), qtype.name)
    return QuantWeight.from_blocks(qtype, raw, w.shape[1]), reference(raw, qtype, w.shape[1])


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output element: gamma(K/8 + 3) * sum_k |w_k x_k| (the module docstring)."""
    n = x.shape[1] // 8 + 3
    u = 2.0**-24
    return n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().T)


def check(x: torch.Tensor, qw: QuantWeight, w: torch.Tensor) -> None:
    y = QuantLinear(qw, None)(x)
    err = (y.double() - x.double() @ w.double().T).abs()
    bound = error_bound(x, w)
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize(("qtype", "shape"), ALL_SHAPES)
def test_random_blocks_within_the_bound(qtype: QuantType, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    qw, ref = quantized(w, qtype)
    assert torch.equal(qw.dequantize(), ref)
    check(torch.randn(m, k, generator=gen) * 3, qw, ref)


@pytest.mark.parametrize("qtype", list(QuantType))
def test_the_weights_are_read_as_their_exact_fp32_values(qtype: QuantType) -> None:
    """One-hot rows pick out single weights: the product returns gguf-py's dequantized
    values bit for bit, through the few-rows path (registers, 3 rows) and the many-rows
    path (a per-thread buffer, all 96 rows)."""
    gen = torch.Generator().manual_seed(11)
    k = qtype.block_values * 3
    qw, w = quantized(torch.randn(37, k, generator=gen) * 5, qtype)
    op = QuantLinear(qw, None)
    eye = torch.eye(k)
    assert torch.equal(op(eye[:3]), w.T[:3])
    assert torch.equal(op(eye), w.T)


@pytest.mark.parametrize("qtype", list(QuantType))
def test_an_embedding_lookup_gives_the_rows_dequantized_values(qtype: QuantType) -> None:
    """The compiled lookup (embed_rows) returns gguf-py's values of the rows asked, in
    their order, repeats included, bit for bit; the torch path agrees; an id outside the
    vocabulary is refused with the limit and nothing is returned."""
    gen = torch.Generator().manual_seed(12)
    k = qtype.block_values * 2
    qw, w = quantized(torch.randn(37, k, generator=gen) * 5, qtype)
    emb = QuantEmbedding(qw)
    ids = torch.tensor([36, 0, 5, 5, 17])
    assert torch.equal(emb[ids], w[ids]) and torch.equal(emb[[2]], w[[2]])
    assert emb[torch.tensor([], dtype=torch.long)].shape == (0, k)
    assert torch.equal(qw.rows(ids).dequantize(), w[ids])
    with pytest.raises(IndexError, match=r"token id 37 is outside \[0, 37\)"):
        emb[torch.tensor([3, 37])]
    with pytest.raises(IndexError, match=r"token id -1 is outside \[0, 37\)"):
        emb[torch.tensor([-1])]


def shipped_tensors() -> dict[str, gguf.ReaderTensor]:
    reader = gguf.GGUFReader(str(default_model_path()))
    return {t.name: t for t in reader.tensors}


def from_gguf(t: gguf.ReaderTensor, rows: int | None = None) -> tuple[QuantWeight, torch.Tensor]:
    qtype = QuantType.from_ggml(t.tensor_type)
    assert qtype is not None
    k = int(t.shape[0])
    raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:rows]
    return QuantWeight.from_blocks(qtype, raw, k), reference(raw, qtype, k)


@pytest.mark.slow
def test_the_shipped_models_tensors_within_the_bound() -> None:
    """Q4_1 projections (K 576 and 1536), the Q8_0 embedding (first 4096 rows) and a
    real tensor (K 1536) requantized to every other format; activations of a real
    hidden-state scale."""
    tensors = shipped_tensors()
    gen = torch.Generator().manual_seed(0)
    cases = [
        from_gguf(tensors["blk.0.attn_q.weight"]),
        from_gguf(tensors["blk.3.ffn_down.weight"]),
        from_gguf(tensors["token_embd.weight"], rows=4096),
    ]
    assert [c[0].qtype for c in cases] == [QuantType.Q4_1, QuantType.Q4_1, QuantType.Q8_0]
    real = from_gguf(tensors["blk.5.ffn_down.weight"])[1]
    cases += [quantized(real, t) for t in QuantType if t not in (QuantType.Q4_1,)]
    for qw, w in cases:
        for m in (1, 5, 67):
            check(torch.randn(m, qw.shape[1], generator=gen), qw, w)


@pytest.mark.parametrize("activations", ["fp32", pytest.param("int8", marks=pytest.mark.int8)])
@pytest.mark.parametrize("k", [512, 1536])
@pytest.mark.parametrize("qtype", list(QuantType))
def test_every_row_is_computed_the_same_whatever_the_batch_and_threads(
    qtype: QuantType, k: int, activations: str
) -> None:
    """Batch invariance (the kernels' contract): a row's output is bit-identical alone,
    in any batch, at any position, on 1, 2, 3 or 7 threads (more threads than cores:
    their runs of columns are taken over by the threads that run, `Runs` in _kernels.h;
    K = 1536: the down projection's row length, longer than a pass keeps in L1). With
    int8 activations too: each row is rounded alone (tests/test_quant_int8.py)."""
    gen = torch.Generator().manual_seed(7)
    qw, _ = quantized(torch.randn(203, k, generator=gen), qtype)
    op = QuantLinear(qw, None, activations)
    x = torch.randn(150, k, generator=gen)
    batch = op(x)
    assert torch.equal(torch.cat([op(x[i : i + 1]) for i in range(150)]), batch)
    assert torch.equal(torch.cat([op(x[i : i + 7]) for i in range(0, 150, 7)]), batch)
    assert torch.equal(op(x.flip(0)).flip(0), batch)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3, 7):
            torch.set_num_threads(n)
            assert torch.equal(op(x), batch)
            assert torch.equal(
                torch.cat([op(x[i : i + 1]) for i in range(0, 150, 10)]), batch[::10]
            )
    finally:
        torch.set_num_threads(threads)


def test_one_op_over_weights_of_several_formats() -> None:
    """A fused q/k/v whose v is Q6_K and q/k Q4_K (llama.cpp's Q4_K_M mixes): one kernel
    call per run of a format, each writing its columns - the same bits as each part
    alone, residual add and RMSNorm prologue included."""
    gen = torch.Generator().manual_seed(5)
    parts = [quantized(torch.randn(n, 256, generator=gen), t) for n, t in
             ((64, QuantType.Q4_K), (32, QuantType.Q4_K), (32, QuantType.Q6_K))]  # fmt: skip
    op = QuantLinear([p[0] for p in parts], None)
    assert op.formats == ["Q4_K", "Q6_K"] and [w.shape for w in op.weights] == [
        (96, 256),
        (32, 256),
    ]
    assert torch.equal(op.dequantize(), torch.cat([p[1] for p in parts]))
    x, norm = torch.randn(9, 256, generator=gen), torch.randn(256, generator=gen)
    h = torch.randn(9, 128, generator=gen)
    alone = [QuantLinear(p[0], None) for p in parts]
    assert torch.equal(op(x), torch.cat([a(x) for a in alone], dim=1))
    want = h + torch.cat([a.run(x, norm=norm, eps=1e-5) for a in alone], dim=1)
    assert torch.equal(op.run(x, norm=norm, eps=1e-5, into=h.clone()), want)


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
    with pytest.raises(ValueError, match=r"row length 288 is not a multiple of 256 \(Q6_K\)"):
        QuantWeight.from_blocks(QuantType.Q6_K, np.zeros(210, np.uint8), 288)
    with pytest.raises(ValueError, match="gguf-py cannot quantize to Q4_K"):
        QuantWeight.quantize(torch.randn(8, 256), QuantType.Q4_K)
    with pytest.raises(ValueError, match="Q5_0 blocks are repacked at load; no file bytes kept"):
        QuantWeight.quantize(torch.randn(8, 64), QuantType.Q5_0).to_blocks()


def test_argmax_rows_picks_numpys_index_on_ties_nans_and_tails() -> None:
    """The compiled step's greedy token (_kernels.c's argmax_rows, taken in the call that
    ran the LM head): numpy's argmax on each row - the first of equal maxima (+0 and -0
    equal), the first NaN where there is one, all -inf, and lengths that leave a tail
    after the 8-wide loop."""
    from pdserve.kernels import kernels

    mod = kernels()
    assert mod is not None
    gen = torch.Generator().manual_seed(5)
    n = 1003  # 125 vectors and a 3-float tail
    x = torch.randn(8, n + 5, generator=gen)  # ld > n: the last 5 floats are not read
    x[:, n:] = 1e9
    x[1, [7, 300, 1001]] = 50.0  # three equal maxima: the first
    x[2, [100, 900]] = float("nan")  # NaNs beat every number: the first NaN
    x[2, 5] = 1e30
    x[3, :] = float("-inf")  # no number above -inf: index 0
    x[4, :] = -1.0
    x[4, 2] = -0.0
    x[4, 1001] = 0.0  # -0 and +0 are equal: the first
    x[5, 1002] = 99.0  # the maximum in the tail
    x[6, 1002] = float("nan")  # a NaN in the tail only
    x[7, :8] = 7.0  # a tie inside one vector
    out = torch.full((8,), -1, dtype=torch.long)
    mod.argmax_rows(x.data_ptr(), x.stride(0), 8, n, out.data_ptr())
    assert out.tolist() == x[:, :n].numpy().argmax(axis=-1).tolist()
    assert out.tolist() == [int(x[0, :n].argmax()), 7, 100, 0, 2, 1002, 1002, 0]
    with pytest.raises(ValueError, match=r"^argmax_rows: need 0 < n <= ld and rows >= 0$"):
        mod.argmax_rows(x.data_ptr(), 4, 8, n, out.data_ptr())
