"""y = x @ W.T + bias with W in GGUF block formats, by the compiled kernel.

The weights are dequantized in registers to their exact fp32 values and multiplied by
the fp32 activations (pdserve/quant/README.md); each output element is computed the same
way whatever the batch (see `_kernels.c`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.quant.formats import QuantWeight
from pdserve.quant.kernels import kernels, unavailable_reason

# What the product reads in place of x (the kernel's prologues, _kernels.c).
PRE_NONE, PRE_RMSNORM, PRE_SWIGLU = 0, 1, 2


@dataclass(frozen=True)
class _Part:
    """One kernel call: output columns n0 .. n0 + (the weight's rows) - 1 from a weight
    in one format, its scales and minimums as fp32 (what the kernel reads: converted
    once here, not once per block per call)."""

    weight: QuantWeight
    n0: int
    scales: torch.Tensor
    mins: torch.Tensor | None


class QuantLinear:
    """Same call as model.linear.PackedLinear: x [T, K] fp32 -> [T, N] fp32.

    The weight is one or more `QuantWeight`s stacked by rows (a fused q/k/v whose v is
    in another format, as llama.cpp's Q4_K_M files have it); runs of one format are
    concatenated, and each run is one kernel call writing its own output columns.

    Contract: holds the weights' tensors (and so their memory) for its whole life; the
    kernel reads them by address, so they are never resized or moved in place."""

    def __init__(
        self, weight: QuantWeight | Sequence[QuantWeight], bias: torch.Tensor | None
    ) -> None:
        mod = kernels()
        if mod is None:
            raise RuntimeError(f"quantized linear layers need the kernels: {unavailable_reason()}")
        self._qlinear = mod.qlinear
        weights = [weight] if isinstance(weight, QuantWeight) else list(weight)
        runs = [QuantWeight.cat(list(g)) for _, g in itertools.groupby(weights, lambda w: w.qtype)]
        self.in_features = runs[0].shape[1]
        if any(r.shape[1] != self.in_features for r in runs):
            raise ValueError(f"row lengths differ: {[r.shape[1] for r in runs]}")
        self._parts: list[_Part] = []
        n0 = 0
        for r in runs:
            mins = r.m.to(torch.float32) if r.m is not None else None
            self._parts.append(_Part(r, n0, r.d.to(torch.float32), mins))
            n0 += r.shape[0]
        self.out_features = n0
        self.bias = bias.detach().to(torch.float32).clone() if bias is not None else None
        # Each part's kernel arguments that never change (layout, addresses of values,
        # scales and minimums, rows, byte offset of its first output column): a decode
        # step makes ~120 of these calls, so the per-call Python is kept to the minimum.
        self._calls = [
            (
                int(p.weight.qtype.layout), p.weight.qs.data_ptr(), p.scales.data_ptr(),
                0 if p.mins is None else p.mins.data_ptr(), p.weight.shape[0], 4 * p.n0,
            )
            for p in self._parts
        ]  # fmt: skip

    @property
    def weights(self) -> list[QuantWeight]:
        """The runs of one format, in output order."""
        return [p.weight for p in self._parts]

    @property
    def formats(self) -> list[str]:
        return sorted({p.weight.qtype.name for p in self._parts})

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read per product: values, fp32 scales and minimums."""
        total = 0
        for p in self._parts:
            extra = 0 if p.mins is None else p.mins.numel() * 4
            total += p.weight.qs.numel() + p.scales.numel() * 4 + extra
        return total

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] weight this op multiplies by."""
        return torch.cat([p.weight.dequantize() for p in self._parts])

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

        Each row is computed the same way whatever else is in the batch (the kernel's
        contract), prologue included."""
        width = 2 * self.in_features if swiglu else self.in_features
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"QuantLinear takes fp32 CPU activations, got {x.dtype} {x.device}")
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
            self._qlinear(
                layout, xp, ldx, t, k, qs, scales, mins, rows, yp + offset, n, threads,
                pre, pre_w, eps, acc,
            )  # fmt: skip
        if self.bias is not None:
            y += self.bias
        return y


class QuantEmbedding:
    """Token embeddings in GGUF blocks: a lookup dequantizes only the rows it reads.
    Indexes like the [vocab, hidden] tensor it stands for."""

    def __init__(self, weight: QuantWeight) -> None:
        self.weight = weight

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.weight.shape)

    def __getitem__(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        index = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
        return self.weight.rows(index).dequantize()
