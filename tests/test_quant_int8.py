"""`--activations int8`: the int8 kernels (pdserve/kernels/_int8.c) against references.

The method (llama.cpp's): each row of activations is rounded per block of 32 values to
q = round(x * 127 / max|x|) with the scale dx = max|x| / 127; every weight block is u*d + m
(u an unsigned byte, pdserve/quant/linear.py `pack_int8`), and a block adds
float(sum u*q) * (d*dx) + m * (dx * sum q) to the output, in block order. The integer
sums are exact, so two things are checked apart:
* the kernel computes exactly that: against a float64 evaluation of the same formula on
  activations rounded by torch in the same fp32 operations, within fp32 rounding of the
  2B epilogue terms: gamma(2B + 2) * sum of their magnitudes;
* what the method costs against the exact product with fp32 activations: each activation
  moves by at most dx/2, so an output by at most sum_blocks dx/2 * sum |w| (plus that
  rounding) - the bound the format implies.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import quantize_blocks

from pdserve.model.default import default_model_path
from pdserve.model.quantization import resolve_quantization
from pdserve.quant.formats import QuantType, QuantWeight
from pdserve.quant.linear import QuantLinear, int8_blocker, pack_int8

pytestmark = [pytest.mark.kernels, pytest.mark.int8]

# _int8.c reads this once: "avx2" takes the AVX2 build on a CPU with VNNI too.
INT8_ENV = "PDSERVE_INT8_KERNEL"

INT8_TYPES = list(QuantType)
SHAPES = [(1, 576, 576), (3, 130, 96), (7, 5, 64), (70, 33, 160), (1, 17, 32), (131, 64, 1536)]
K_SHAPES = [(1, 576, 512), (3, 130, 256), (70, 33, 768)]
CASES = [(t, s) for t in INT8_TYPES for s in (K_SHAPES if t.block_values == 256 else SHAPES)]
U = 2.0**-24


def quantized(w: torch.Tensor, qtype: QuantType) -> QuantWeight:
    return QuantWeight.from_blocks(qtype, quantize_blocks(w.numpy(), qtype.name), w.shape[1])


def int8_weights(qw: QuantWeight) -> torch.Tensor:
    """The weights the int8 kernel multiplies by: the exact fp32 ones, except that the K
    formats' fp32 scales and minimums are rounded to fp16 (pack_int8's records)."""
    if qw.qtype.block_values != 256:
        return qw.dequantize()
    half = QuantWeight(
        qw.qtype,
        qw.qs,
        qw.d.to(torch.float16).to(torch.float32),
        None if qw.m is None else qw.m.to(torch.float16).to(torch.float32),
    )
    return half.dequantize()


def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded as the kernel does, in the same fp32 operations: (q [M, B, 32], dx [M, B, 1])."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    return torch.round(blocks * inv), amax / 127.0


def method(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The method in float64 on x rounded as the kernel rounds it: (the product, and the
    bound on the kernel's fp32 rounding of it: gamma(2B + 2) times twice the sum of the
    blocks' magnitudes - each block is two FMA terms, d*dx one more rounding)."""
    (m, k), n = x.shape, w.shape[0]
    q, dx = rounded(x)
    wb = w.double().reshape(n, k // 32, 32)
    scale = dx.double().reshape(m, 1, -1)
    product = (torch.einsum("mbk,nbk->mnb", q.double(), wb) * scale).sum(-1)
    size = (torch.einsum("mbk,nbk->mnb", q.double().abs(), wb.abs()) * scale).sum(-1)
    g = 2 * (k // 32) + 2
    return product, g * U / (1 - g * U) * 2 * size


@pytest.mark.parametrize(("qtype", "shape"), CASES)
def test_the_kernel_computes_the_method_within_fp32_rounding(
    qtype: QuantType, shape: tuple[int, int, int]
) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    qw = quantized(torch.randn(n, k, generator=gen), qtype)
    x = torch.randn(m, k, generator=gen)
    y = QuantLinear(qw, None, "int8")(x)
    want, bound = method(x, int8_weights(qw))
    err = (y.double() - want).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize(("qtype", "shape"), CASES)
def test_against_fp32_activations_within_the_rounding_of_the_activations(
    qtype: QuantType, shape: tuple[int, int, int]
) -> None:
    """Each activation moves by at most dx/2 of its block: an output by at most
    sum_b dx_b / 2 * sum_{k in b} |w_k| from the exact product, plus fp32 rounding."""
    m, n, k = shape
    gen = torch.Generator().manual_seed(m + n * 7 + k)
    qw = quantized(torch.randn(n, k, generator=gen), qtype)
    x = torch.randn(m, k, generator=gen)
    y = QuantLinear(qw, None, "int8")(x)
    w = int8_weights(qw).double()
    _, dx = rounded(x)
    per_block = w.abs().reshape(n, k // 32, 32).sum(-1)  # [N, B]
    half_step = (dx.double().reshape(m, 1, -1) / 2 * per_block).sum(-1)
    _, rounding = method(x, w)
    err = (y.double() - x.double() @ w.T).abs()
    assert bool((err <= half_step + rounding).all()), float((err - half_step - rounding).max())
    # The rounding is real: int8 activations do not give the fp32 product.
    assert not torch.equal(y, QuantLinear(qw, None)(x))


def test_the_shipped_models_tensors_within_the_bound() -> None:
    """The shipped GGUF's Q4_1 and Q8_0 tensors, as they are in the file."""
    import gguf

    reader = gguf.GGUFReader(str(default_model_path()))
    tensors = {t.name: t for t in reader.tensors}
    gen = torch.Generator().manual_seed(11)
    for name, rows in (("blk.0.ffn_down.weight", None), ("token_embd.weight", 4096)):
        t = tensors[name]
        qtype = QuantType[t.tensor_type.name]
        k = int(t.shape[0])
        raw = t.data.reshape(-1, t.data.shape[-1])[:rows]
        qw = QuantWeight.from_blocks(qtype, raw, k)
        x = torch.randn(5, k, generator=gen)
        want, bound = method(x, qw.dequantize())
        err = (QuantLinear(qw, None, "int8")(x).double() - want).abs()
        assert bool((err <= bound).all()), (name, float((err - bound).max()))


def test_prologues_and_residual_add_round_what_the_fp32_path_computes() -> None:
    """RMSNorm and SwiGLU run in fp32 before the rounding: the fp32 kernel's product
    with an identity weight gives the prologue's output, and the int8 op over that is
    bit-identical to the int8 op with the prologue fused."""
    gen = torch.Generator().manual_seed(4)
    k = 96
    # Q4_0 holds an identity exactly ((0 - 8) * -1/8 = 1), so the fp32 kernel's product
    # with it is its input: the prologue's output, bit for bit.
    ident = QuantLinear(QuantWeight.quantize(torch.eye(k), QuantType.Q4_0), None)
    assert torch.equal(ident.dequantize(), torch.eye(k))
    op = QuantLinear(quantized(torch.randn(40, k, generator=gen), QuantType.Q4_1), None, "int8")
    x, norm = torch.randn(6, k, generator=gen), torch.randn(k, generator=gen)
    assert torch.equal(op.run(x, norm=norm, eps=1e-5), op(ident.run(x, norm=norm, eps=1e-5)))
    gate_up = torch.randn(6, 2 * k, generator=gen)
    assert torch.equal(op.run(gate_up, swiglu=True), op(ident.run(gate_up, swiglu=True)))
    h = torch.randn(6, 40, generator=gen)
    assert torch.equal(op.run(x, into=h.clone()), h + op(x))


def test_a_q4_k_m_mix_is_one_op_with_each_part_in_its_own_records() -> None:
    """A fused q/k/v of Q4_K q/k and Q6_K v (Q4_K_M): one int8 call per format, each
    part's columns the bits of that part alone."""
    gen = torch.Generator().manual_seed(5)
    parts = [quantized(torch.randn(n, 256, generator=gen), t) for n, t in
             ((64, QuantType.Q4_K), (32, QuantType.Q4_K), (32, QuantType.Q6_K))]  # fmt: skip
    op = QuantLinear(parts, None, "int8")
    assert op.activations == ["int8"]
    x = torch.randn(9, 256, generator=gen)
    y = op(x)
    assert torch.equal(y[:, :96], QuantLinear(parts[:2], None, "int8")(x))
    assert torch.equal(y[:, 96:], QuantLinear(parts[2], None, "int8")(x))


def test_a_scale_that_fp16_cannot_hold_keeps_fp32_activations_for_its_part() -> None:
    """Q8_0's minimum is -128 d: a block scale over 511.75 has none in fp16, so that
    weight keeps the exact kernel (its bits), beside a Q4_0 part on the int8 one, and the
    op says it mixes both."""
    gen = torch.Generator().manual_seed(8)
    big = quantized(torch.randn(16, 64, generator=gen) * 1e5, QuantType.Q8_0)
    assert float(big.d.float().abs().max()) > 512 and pack_int8(big) is None
    small = quantized(torch.randn(16, 64, generator=gen), QuantType.Q4_0)
    op = QuantLinear([big, small], None, "int8")
    assert op.activations == ["fp32", "int8"]
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(op(x)[:, :16], QuantLinear(big, None)(x))
    assert torch.equal(op(x)[:, 16:], QuantLinear(small, None, "int8")(x))


def test_records_hold_the_values_scales_and_minimums() -> None:
    """pack_int8's layout, read back in Python: for every column and block, the unsigned
    values, the fp16 scale and the minimum (-offset * d where the format has none)."""
    gen = torch.Generator().manual_seed(6)
    cases = ((QuantType.Q4_0, 8), (QuantType.Q8_0, 128), (QuantType.Q4_1, 0), (QuantType.Q6_K, 128))
    for qtype, offset in cases:
        k = qtype.block_values * 2 if qtype.block_values == 256 else 64
        qw = quantized(torch.randn(20, k, generator=gen), qtype)  # 16 + 4 (+ 12 padding)
        rec = pack_int8(qw)
        assert rec is not None
        nib, sub = qtype.layout.nibbles, qtype.layout.scales_per_block
        vbytes = 256 if nib else 512
        size, blocks = vbytes + 64 * sub, k // 32
        assert rec.numel() == 2 * blocks * size  # 2 groups of 16 columns x the blocks
        rec = rec.reshape(2, blocks, size)
        w = int8_weights(qw)
        for col in (0, 7, 19):
            g, c = divmod(col, 16)
            for b in range(blocks):
                vals = rec[g, b, :vbytes].reshape(-1, 16, 4)[:, c]  # [lines, 4]
                u = (torch.cat((vals & 15, vals >> 4)) if nib else vals).reshape(32).float()
                for s in range(sub):  # each scale's values: 32 / sub of them
                    at = vbytes + 64 * s
                    d = rec[g, b, at : at + 32].view(torch.float16)[c].float()
                    m = rec[g, b, at + 32 : at + 64].view(torch.float16)[c].float()
                    part = slice(s * 32 // sub, (s + 1) * 32 // sub)
                    got = d * u[part] + m
                    want = w[col, 32 * b : 32 * b + 32][part]
                    assert torch.equal(got, want), (qtype, col, b, s)
                    if offset:
                        assert m == -offset * d
        pad = rec[1, :, :vbytes].reshape(blocks, -1, 16, 4)[:, :, 4:]  # columns 20..31
        assert int(pad.abs().sum()) == 0


def test_a_cpu_without_avx2_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine runs an int8 build; a CPU without AVX2 (the extension's answer stubbed
    here) is refused by the op and by --activations, naming what is missing."""
    qw = QuantWeight.quantize(torch.randn(16, 32), QuantType.Q8_0)
    assert int8_blocker() == ""
    with pytest.raises(ValueError, match="activations must be one of fp32, int8, got 'int4'"):
        QuantLinear(qw, None, "int4")
    from pdserve.kernels import _kernels  # type: ignore[attr-defined]

    monkeypatch.setattr(_kernels, "int8_supported", lambda: False)
    lacks = "this CPU lacks AVX2 (with FMA and F16C), which the int8 kernels need"
    assert int8_blocker() == lacks
    with pytest.raises(RuntimeError) as info:
        QuantLinear(qw, None, "int8")
    assert str(info.value) == f"int8 activations: {lacks}"
    with pytest.raises(ValueError) as refused:
        resolve_quantization("auto", default_model_path(), activations="int8")
    assert str(refused.value) == f"--activations int8: {lacks}"


def _products_of_every_case(out: Path) -> None:
    """Each CASE's int8 product (seeded inputs), and the same with two more rows added
    into it (accumulate), saved to `out`: what a build computes, for another to match."""
    got = {}
    for qtype, (m, n, k) in CASES:
        gen = torch.Generator().manual_seed(m * 31 + n + k)
        qw = quantized(torch.randn(n, k, generator=gen), qtype)
        x = torch.randn(m + 17, k, generator=gen)  # the streamed and the tiled row counts
        op = QuantLinear(qw, None, "int8")
        got[f"{qtype.name}-{m}x{n}x{k}"] = op(x[:m])
        got[f"{qtype.name}-{m + 17}x{n}x{k}"] = op(x)
    torch.save(got, out)


def _products_in_a_process(tmp_path: Path, env: dict[str, str]) -> tuple[str, dict]:
    """_products_of_every_case run in a fresh interpreter with `env` added (the build is
    chosen once per process): (the build it ran, its products)."""
    out = tmp_path / "products.pt"
    code = (
        "import sys; sys.path[:0] = sys.argv[2:]\n"
        "from pathlib import Path\n"
        "import test_quant_int8 as t\n"
        "from pdserve.kernels import _kernels\n"
        "t._products_of_every_case(Path(sys.argv[1]))\n"
        "print(_kernels.int8_build())\n"
    )
    here = str(Path(__file__).parent)
    run = subprocess.run(
        [sys.executable, "-c", code, str(out), here, str(Path(here) / "helpers")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return run.stdout.split()[-1], torch.load(out)


def test_the_environment_variable_takes_the_avx2_build(tmp_path: Path) -> None:
    """PDSERVE_INT8_KERNEL=avx2 runs the AVX2 build, on a VNNI CPU too, over every case.
    (Its products against the VNNI build's: the next test, where the CPU has VNNI; against
    the method's bounds: the tests above, on a CPU whose own choice is AVX2.)"""
    from pdserve.kernels import _kernels  # type: ignore[attr-defined]

    build, products = _products_in_a_process(tmp_path, {INT8_ENV: "avx2"})
    assert build == "avx2"
    assert _kernels.int8_build() in ("avx2", "avx512-vnni")
    assert len(products) == 2 * len(CASES)


@pytest.mark.vnni
def test_the_avx2_build_gives_the_vnni_builds_bits(tmp_path: Path) -> None:
    """On a CPU with VNNI: the AVX2 build (vpmaddubsw, the byte kinds through |w| and w's
    sign, their +128 offset as each sum's start) gives this process's VNNI build's
    products bit for bit, for every format, the partial last group, the streamed and the
    tiled paths."""
    build, avx2 = _products_in_a_process(tmp_path, {INT8_ENV: "avx2"})
    here, vnni = _products_in_a_process(tmp_path, {INT8_ENV: ""})
    assert (build, here) == ("avx2", "avx512-vnni")
    assert avx2.keys() == vnni.keys()
    differ = [key for key in vnni if not torch.equal(avx2[key], vnni[key])]
    assert differ == []
