"""The compiled fp32 products (pdserve/kernels/_dense.c, `DenseLinear`) against references.

Each output is one FMA chain over k in order, so against the float64 product the error is
at most gamma(K) * sum_k |w_k x_k|, gamma(n) = n u / (1 - n u), u = 2^-24 (recursive
summation, Higham 3.1). And it is the same chain whatever else is computed beside it: a
row alone or in any batch, on 1 or 2 threads, in the AVX-512 or the AVX2 build - bit for
bit, which recovery's recompute and the disaggregated hand-off rely on.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.quant.linear import DenseLinear, dense_blocker, pack_dense

pytestmark = pytest.mark.kernels

# (rows, N, K): a decode row, a few rows, a prefill; N off the panel size; K from 32 up.
SHAPES = [(1, 576, 576), (3, 130, 96), (7, 5, 64), (70, 33, 160), (1, 7, 32), (131, 64, 1536)]


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) / k**0.5


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, u = x.shape[1], 2.0**-24
    return n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("shape", SHAPES)
def test_within_the_bound_and_row_invariant(shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    w, x = weights(n, k), torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    op = DenseLinear(w, None)
    y = op(x)
    err = (y.double() - x.double() @ w.double().T).abs()
    assert bool((err <= bound(x, w)).all()), float((err - bound(x, w)).max())
    for i in range(m):  # each row alone: the same bits as in the batch
        assert torch.equal(op(x[i : i + 1]), y[i : i + 1])


def test_same_bits_on_one_thread_and_every_batch_size() -> None:
    """The GEMV's panel runs (fewer than 4 rows) and the GEMM's dynamic tiles (more),
    on 1 and 2 threads, give each row the same bits."""
    w, x = weights(200, 256), torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    op = DenseLinear(w, None)
    threads = torch.get_num_threads()
    want = op(x)
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(x), want)
    finally:
        torch.set_num_threads(threads)
    for m in (1, 2, 3, 4, 5, 6, 7, 13):
        assert torch.equal(op(x[:m]), want[:m])


def test_prologues_bias_and_residual_add() -> None:
    """`run`'s fused RMSNorm and SwiGLU prologues, the bias and the residual add equal
    the same operations done in torch (within the product's bound)."""
    k, n = 96, 50
    gen = torch.Generator().manual_seed(3)
    w, b = weights(n, k), torch.randn(n, generator=gen)
    x, g = torch.randn(5, k, generator=gen), torch.rand(k, generator=gen) + 0.5
    op = DenseLinear(w, b)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    want = normed.double() @ w.double().T + b.double()
    assert (op.run(x, norm=g, eps=1e-5).double() - want).abs().max().item() < 1e-5
    gate_up = torch.randn(5, 2 * k, generator=gen)
    act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    residual = torch.randn(5, n, generator=gen)
    out = op.run(gate_up, swiglu=True, into=residual.clone())
    want = residual.double() + act.double() @ w.double().T + b.double()
    assert (out.double() - want).abs().max().item() < 1e-5


def test_panels_and_their_inverse() -> None:
    """pack_dense's layout (panel[p][k][c] = W[16p + c][k], zero columns after N), and
    `dequantize` returns the weight bit for bit."""
    w = weights(21, 32)
    panels = pack_dense(w)
    assert panels.shape == (2, 32, 16)
    assert torch.equal(panels[1, 7, 4], w[20, 7])
    assert torch.equal(panels[1, :, 5:], torch.zeros(32, 11))
    assert torch.equal(DenseLinear(w, None).dequantize(), w)


def test_weights_the_kernels_do_not_take() -> None:
    assert dense_blocker(weights(4, 32)) == ""
    assert dense_blocker(weights(4, 40)) == (
        "a weight of shape [4, 40] (rows of a multiple of 32 values)"
    )
    assert dense_blocker(weights(4, 32).to(torch.bfloat16)) == (
        "a torch.bfloat16 weight on cpu (the kernels take fp32 on CPU)"
    )
    with pytest.raises(ValueError, match=r"DenseLinear cannot take a weight of shape \[4, 40\]"):
        DenseLinear(weights(4, 40), None)


_BUILD_SCRIPT = """
import sys, torch
from pdserve.kernels import kernels
from pdserve.quant.linear import DenseLinear
gen = torch.Generator().manual_seed(4)
w, x = torch.randn(70, 160, generator=gen), torch.randn(9, 160, generator=gen)
op = DenseLinear(w, torch.randn(70, generator=gen))
torch.save((kernels().dense_build(), op(x), op(x[:2]), op.run(x, swiglu=False)), sys.argv[1])
"""


# Deselected with the int8 builds' comparison where this CPU has one build (conftest.py):
# every CPU with AVX-512 VNNI has AVX-512F.
@pytest.mark.vnni
def test_both_builds_give_the_same_bits(tmp_path) -> None:
    """Each output lane runs the same FMA chain in the AVX-512 build (a panel in one zmm)
    as in the AVX2 one (two ymm): the same bits."""
    results = []
    for build in ("", "avx2"):
        out = tmp_path / f"{build or 'native'}.pt"
        env = {**os.environ, "PDSERVE_DENSE_KERNEL": build}
        subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, str(out)], env=env, check=True)
        results.append(torch.load(out))
    (native, *a), (avx2, *b) = results
    assert (native, avx2) == ("avx512", "avx2")
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
