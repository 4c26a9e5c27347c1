"""y = x @ W.T + bias by the compiled kernels: `QuantLinear` for W in GGUF block formats,
`DenseLinear` for full-precision fp32 W (`--quantization none`, HF-folder models).

Two ways to take the activations (`OP_ACTIVATIONS`; `--activations auto`, the default,
picks "int8" where `int8_blocker` finds nothing in its way): "fp32" - the weights
dequantized in registers to their exact fp32 values and multiplied by the fp32
activations (`_kernels.c`); "int8" - llama.cpp's method, each row rounded to int8 per 32
values and multiplied by the weights' integer values with AVX-512 VNNI or AVX2
(`_int8.c`, weights repacked at load by `pack_int8`): faster where a step is
compute-bound, at a stated cost in accuracy (pdserve/kernels/README.md; the gate that
made it the default: docs/benchmarks.md, "The quality gate for int8 activations"). Full-precision
weights are repacked at load into panels of 16 columns (`pack_dense`, `_dense.c`).
Either way each output element is computed the same way whatever the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import OP_ACTIVATIONS
from pdserve.kernels import kernels, unavailable_reason
from pdserve.memory import HugePageArena
from pdserve.quant.formats import BLOCK, Layout, QuantWeight

# What the product reads in place of x (the kernel's prologues, _kernels.c).
PRE_NONE, PRE_RMSNORM, PRE_SWIGLU = 0, 1, 2

# _int8.c's column group: one zmm lane per output column (two ymm halves in the AVX2 build).
_GROUP = 16
# The offset that makes the values of a layout without minimums unsigned bytes: u = q +
# offset, w = u*d + m with m = -offset*d (Q4M and U8M are unsigned, with their own m).
_INT8_OFFSET = {Layout.I8: 128, Layout.Q4: 8, Layout.I8_16: 128}


def int8_kind(layout: Layout) -> int:
    """`_int8.c`'s record kind for a layout: 0 bytes, 1 nibbles, 2 bytes with a scale
    per 16 values."""
    return 1 if layout.nibbles else 2 if layout == Layout.I8_16 else 0


def int8_blocker() -> str:
    """Why `--activations int8` cannot run here ("" when it can)."""
    mod = kernels()
    if mod is None:
        return f"the compiled kernels are not available ({unavailable_reason()})"
    if not mod.int8_supported():
        return "this CPU lacks AVX2 (with FMA and F16C), which the int8 kernels need"
    return ""


def int8_build() -> str:
    """Which build of the int8 kernels runs here: "avx512-vnni", "avx2" (also where
    PDSERVE_INT8_KERNEL=avx2 asks for it), or "" where none can (see `int8_blocker`)."""
    mod = kernels()
    return "" if mod is None else str(mod.int8_build())


def pack_int8(weight: QuantWeight) -> torch.Tensor | None:
    """`weight` as `_int8.c` reads it (see its header): per group of 16 columns and block
    of 32 values a record of unsigned byte values (nibbles two to a byte for the nibble
    layouts), then the 16 scales and 16 minimums as fp16 (I8_16, Q6_K's scale per 16
    values: those of each half block). None where a scale or minimum does not fit fp16;
    that weight is then taken with fp32 activations.

    The K formats' scales are fp32 products (d*sc); fp16 rounds them (relative 2^-11),
    far below the activations' int8 rounding (up to 2^-8 of a block's largest value)."""
    layout = weight.qtype.layout
    n, k = weight.shape
    b = k // BLOCK
    sub = layout.scales_per_block
    if layout.nibbles:
        packed = weight.qs.reshape(n, b, BLOCK // 2)
        u = torch.cat((packed & 0x0F, packed >> 4), dim=-1)
    elif layout in (Layout.I8, Layout.I8_16):
        u = (weight.qs.view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(n, b, BLOCK)
    else:
        u = weight.qs.reshape(n, b, BLOCK)
    d = weight.d.to(torch.float32)
    m = weight.m.to(torch.float32) if weight.m is not None else -_INT8_OFFSET[layout] * d
    d16, m16 = d.to(torch.float16), m.to(torch.float16)
    if not (torch.isfinite(d16).all() and torch.isfinite(m16).all()):
        return None
    groups = -(-n // _GROUP)
    pad = groups * _GROUP - n
    if pad:
        u = torch.cat((u, u.new_zeros(pad, b, BLOCK)))
        d16 = torch.cat((d16, d16.new_zeros(pad, b * sub)))
        m16 = torch.cat((m16, m16.new_zeros(pad, b * sub)))
    # [G, 16 columns, B, 8 quads, 4] -> [G, B, 8 quads, 16 columns x 4 values]
    u = u.reshape(groups, _GROUP, b, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, b, 8, 64)
    if layout.nibbles:
        u = u[:, :, :4] | (u[:, :, 4:] << 4)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [G, B, sub, 16 columns] as bytes
        t = t.reshape(groups, _GROUP, b, sub).permute(0, 2, 3, 1).contiguous()
        return t.view(torch.uint8).reshape(groups, b, sub, 2 * _GROUP)

    scales = torch.cat((per_group(d16), per_group(m16)), dim=3).reshape(groups, b, -1)
    records = torch.cat((u.reshape(groups, b, -1), scales), dim=2)
    return records.contiguous().reshape(-1)


@dataclass(frozen=True)
class _Part:
    """One kernel call: output columns n0 .. n0 + (the weight's rows) - 1 from a weight
    in one format, its scales and minimums as fp32 (what the kernel reads: converted
    once here, not once per block per call)."""

    weight: QuantWeight
    n0: int
    scales: torch.Tensor
    mins: torch.Tensor | None
    int8: torch.Tensor | None = None  # pack_int8's records, when taken with int8 activations


# A kernel call's layout code for the int8 kernel and the fp32 panels (_kernels.h's Part).
PART_INT8, PART_DENSE = -1, -2


class CompiledLinear:
    """A projection the compiled kernels run: the same call as model.linear.PackedLinear,
    x [T, K] fp32 -> [T, N] fp32, plus `run` with a fused prologue and residual add, and
    `kernel_calls` for the compiled layer loop (pdserve/model/fused.py). Subclasses set
    `in_features`, `out_features`, `bias` and `_calls` (one tuple per kernel call; see
    `kernel_calls`)."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None
    _calls: list[tuple[int, int, int, int, int, int]]

    def __init__(self) -> None:
        mod = kernels()
        if mod is None:
            raise RuntimeError(f"compiled linear layers need the kernels: {unavailable_reason()}")
        self._qlinear, self._qlinear_int8 = mod.qlinear, mod.qlinear_int8
        self._dense = mod.dense_linear

    @property
    def kernel_calls(self) -> list[tuple[int, int, int, int, int, int]]:
        """The kernel call of each part, (layout, values, scales, minimums, rows, byte
        offset of its first output column); an int8 part's is (PART_INT8, records, kind,
        0, rows, offset), an fp32 panel part's (PART_DENSE, panels, 0, 0, rows, offset).
        Addresses are valid while this op lives (pdserve/model/fused.py packs them for
        the compiled layer loop)."""
        return list(self._calls)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)

    def run(
        self,
        x: torch.Tensor,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        swiglu: bool = False,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """P(x) @ W.T + bias, with the prologue P applied to each row inside the kernel:
        `norm` (a [K] weight): RMSNorm(x) * norm with `eps`; `swiglu`: x is [T, 2K] (gate,
        then up) and P(x) = silu(gate) * up; else x itself. With `into` ([T, N], contiguous)
        the product is added to it in place and it is returned (a residual add).

        Each row is computed the same way whatever else is in the batch (the kernels'
        contract), prologue included."""
        width = 2 * self.in_features if swiglu else self.in_features
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(
                f"{type(self).__name__} takes fp32 CPU activations, got {x.dtype} {x.device}"
            )
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"expected [T, {width}], got {list(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        t = x.shape[0]
        pre, pre_w = PRE_NONE, 0
        if norm is not None:
            ok = norm.shape == (self.in_features,) and norm.dtype == torch.float32
            if not ok or not norm.is_contiguous() or swiglu:
                raise ValueError(f"norm: expected one contiguous fp32 [{self.in_features}] weight")
            pre, pre_w = PRE_RMSNORM, norm.data_ptr()
        elif swiglu:
            pre = PRE_SWIGLU
        if into is None:
            y = torch.empty(t, self.out_features, dtype=torch.float32)
        else:
            if (
                into.shape != (t, self.out_features)
                or into.dtype != torch.float32
                or not into.is_contiguous()
            ):
                raise ValueError(f"into: expected a contiguous fp32 [{t}, {self.out_features}]")
            y = into
        threads, xp, ldx, yp = torch.get_num_threads(), x.data_ptr(), x.stride(0), y.data_ptr()
        k, n, eps, acc = self.in_features, self.out_features, float(eps), into is not None
        for layout, qs, scales, mins, rows, offset in self._calls:
            if layout == PART_DENSE:
                self._dense(qs, rows, k, xp, ldx, t, yp + offset, n, threads, pre, pre_w, eps, acc)
            elif layout == PART_INT8:  # qs is the records' address, scales their kind
                self._qlinear_int8(
                    qs, scales, rows, k, xp, ldx, t, yp + offset, n, threads, pre, pre_w, eps, acc
                )
            else:
                self._qlinear(
                    layout, xp, ldx, t, k, qs, scales, mins, rows, yp + offset, n, threads,
                    pre, pre_w, eps, acc,
                )  # fmt: skip
        if self.bias is not None:
            y += self.bias
        return y


def dense_blocker(weight: torch.Tensor) -> str:
    """Why `DenseLinear` cannot take `weight` ("" when it can)."""
    if kernels() is None:
        return f"the compiled kernels are not available ({unavailable_reason()})"
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"a {weight.dtype} weight on {weight.device.type} (the kernels take fp32 on CPU)"
    if weight.dim() != 2 or weight.shape[1] % BLOCK != 0 or weight.shape[0] == 0:
        return f"a weight of shape {list(weight.shape)} (rows of a multiple of {BLOCK} values)"
    return ""


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 [N, K] weight as `_dense.c` reads it: panels of 16 columns, k-major -
    panel[p][k][c] = weight[16p + c][k], the last panel padded with zero columns."""
    n, k = weight.shape
    panels = -(-n // _GROUP)
    w = weight.detach().to(torch.float32)
    if panels * _GROUP != n:
        w = torch.cat((w, w.new_zeros(panels * _GROUP - n, k)))
    return w.reshape(panels, _GROUP, k).transpose(1, 2).contiguous()


class DenseLinear(CompiledLinear):
    """A full-precision fp32 projection on the compiled kernels (`_dense.c`), in place of
    oneDNN's (model.linear.PackedLinear): a decode step's products share their panels
    between threads as they go, so a core another process takes for a while delays the
    step by about that while (oneDNN splits each product statically: the whole step
    waits for the slowest thread), and a model of these ops runs its decode steps in
    one compiled call (pdserve/model/fused.py), as quantized models do.

    Contract: the weight is copied into panels at construction (`pack_dense`); the
    caller may then release it. The panels live as long as this op (the kernel reads
    them by address)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, arena: HugePageArena | None = None
    ) -> None:
        super().__init__()
        if blocker := dense_blocker(weight):
            raise ValueError(f"DenseLinear cannot take {blocker}")
        self.out_features, self.in_features = weight.shape
        panels = pack_dense(weight)
        self._panels = arena.place(panels) if arena is not None else panels
        self.bias = bias.detach().to(torch.float32).clone() if bias is not None else None
        self._calls = [(PART_DENSE, self._panels.data_ptr(), 0, 0, self.out_features, 0)]

    @property
    def activations(self) -> list[str]:
        return ["float32"]

    @property
    def formats(self) -> list[str]:
        return ["float32"]

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per product (the padding columns' too)."""
        return self._panels.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] weight this op multiplies by."""
        w = self._panels.transpose(1, 2).reshape(-1, self.in_features)
        return w[: self.out_features].clone()


class QuantLinear(CompiledLinear):
    """Same call as model.linear.PackedLinear: x [T, K] fp32 -> [T, N] fp32.

    The weight is one or more `QuantWeight`s stacked by rows (a fused q/k/v whose v is
    in another format, as llama.cpp's Q4_K_M files have it); runs of one format are
    concatenated, and each run is one kernel call writing its own output columns.

    Contract: holds the weights' tensors (and so their memory) for its whole life; the
    kernel reads them by address, so they are never resized or moved in place."""

    def __init__(
        self,
        weight: QuantWeight | Sequence[QuantWeight],
        bias: torch.Tensor | None,
        activations: str = "fp32",
        arena: HugePageArena | None = None,
    ) -> None:
        """`arena`: where to keep what the kernels stream (the int8 records, or the
        values, fp32 scales and minimums): on 2 MB pages (pdserve/memory.py); None keeps
        the values where they are."""
        super().__init__()
        if activations not in OP_ACTIVATIONS:
            raise ValueError(
                f"activations must be one of {', '.join(OP_ACTIVATIONS)}, got {activations!r}"
            )
        if activations == "int8" and (blocker := int8_blocker()):
            raise RuntimeError(f"int8 activations: {blocker}")
        weights = [weight] if isinstance(weight, QuantWeight) else list(weight)
        runs = [QuantWeight.cat(list(g)) for _, g in itertools.groupby(weights, lambda w: w.qtype)]
        self.in_features = runs[0].shape[1]
        if any(r.shape[1] != self.in_features for r in runs):
            raise ValueError(f"row lengths differ: {[r.shape[1] for r in runs]}")
        self._parts: list[_Part] = []
        n0 = 0
        place = arena.place if arena is not None else _as_is
        for r in runs:
            packed = pack_int8(r) if activations == "int8" else None
            if packed is not None:  # the fp32 kernel's scales are not needed then
                self._parts.append(_Part(r, n0, torch.empty(0), None, place(packed)))
            else:
                r = QuantWeight(r.qtype, place(r.qs), r.d, r.m)
                mins = place(r.m.to(torch.float32)) if r.m is not None else None
                self._parts.append(_Part(r, n0, place(r.d.to(torch.float32)), mins))
            n0 += r.shape[0]
        self.out_features = n0
        self.bias = bias.detach().to(torch.float32).clone() if bias is not None else None
        # Each part's kernel arguments that never change (layout, addresses of values,
        # scales and minimums, rows, byte offset of its first output column): a decode
        # step makes ~120 of these calls, so the per-call Python is kept to the minimum.
        # An int8 part's call is (PART_INT8, records, kind, 0, rows, offset).
        self._calls = [
            (
                int(p.weight.qtype.layout), p.weight.qs.data_ptr(), p.scales.data_ptr(),
                0 if p.mins is None else p.mins.data_ptr(), p.weight.shape[0], 4 * p.n0,
            )
            if p.int8 is None
            else (
                PART_INT8, p.int8.data_ptr(), int8_kind(p.weight.qtype.layout), 0,
                p.weight.shape[0], 4 * p.n0,
            )
            for p in self._parts
        ]  # fmt: skip

    @property
    def activations(self) -> list[str]:
        """How the parts take their activations ("fp32", "int8"), sorted, each once: an
        int8 op keeps fp32 for a part whose scales do not fit fp16 (see `pack_int8`)."""
        return sorted({"fp32" if p.int8 is None else "int8" for p in self._parts})

    @property
    def weights(self) -> list[QuantWeight]:
        """The runs of one format, in output order."""
        return [p.weight for p in self._parts]

    @property
    def formats(self) -> list[str]:
        return sorted({p.weight.qtype.name for p in self._parts})

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read per product: values, fp32 scales and minimums (int8
        parts: their records)."""
        total = 0
        for p in self._parts:
            if p.int8 is not None:
                total += p.int8.numel()
                continue
            extra = 0 if p.mins is None else p.mins.numel() * 4
            total += p.weight.qs.numel() + p.scales.numel() * 4 + extra
        return total

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] weight this op multiplies by."""
        return torch.cat([p.weight.dequantize() for p in self._parts])


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


class QuantEmbedding:
    """Token embeddings in GGUF blocks: a lookup dequantizes only the rows it reads (in
    one compiled call when the kernels are here: the values `dequantize` gives, bit for
    bit). Indexes like the [vocab, hidden] tensor it stands for."""

    def __init__(self, weight: QuantWeight) -> None:
        self.weight = weight
        mod = kernels()
        # The compiled lookup and what it reads: the rows as laid out, fp32 scales and
        # minimums (as the kernels do). None where the kernels are not built.
        self._compiled: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        if mod is not None:
            d, m = weight.d.to(torch.float32), weight.m
            mins = None if m is None else m.to(torch.float32).contiguous()
            self._compiled = (mod.embed_rows, weight.qs.contiguous(), d.contiguous(), mins)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.weight.shape)

    def compiled_rows(self) -> tuple[int, int, int, int] | None:
        """(layout, qs, d, m) addresses as `embed_rows` takes them (m 0 without minimums),
        for a compiled call that looks rows up itself; None where the kernels are not
        built. Valid while this embedding lives."""
        if self._compiled is None:
            return None
        _, qs, d, m = self._compiled
        layout = int(self.weight.qtype.layout)
        return layout, qs.data_ptr(), d.data_ptr(), 0 if m is None else m.data_ptr()

    def __getitem__(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        index = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
        if self._compiled is None or index.dim() != 1:
            return self.weight.rows(index).dequantize()
        embed_rows, qs, d, m = self._compiled
        index = index.to(torch.long).contiguous()
        n, k = self.weight.shape
        out = torch.empty(index.shape[0], k)
        embed_rows(
            int(self.weight.qtype.layout), qs.data_ptr(), d.data_ptr(),
            0 if m is None else m.data_ptr(), n, k, index.data_ptr(), index.shape[0],
            out.data_ptr(),
        )  # fmt: skip
        return out
