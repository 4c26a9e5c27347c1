"""y = x @ W.T + bias with W in a GGUF block format, by the compiled kernel.

The weights are dequantized in registers to their exact fp32 values and multiplied by
the fp32 activations (pdserve/quant/README.md); each output element is computed the same
way whatever the batch (see `_kernels.c`).
"""

from __future__ import annotations

import torch

from pdserve.quant.formats import QuantWeight
from pdserve.quant.kernels import kernels, unavailable_reason

# What the product reads in place of x (the kernel's prologues, _kernels.c).
PRE_NONE, PRE_RMSNORM, PRE_SWIGLU = 0, 1, 2


class QuantLinear:
    """Same call as model.linear.PackedLinear: x [T, K] fp32 -> [T, N] fp32.

    Contract: holds the weight's tensors (and so their memory) for its whole life; the
    kernel reads them by address, so they are never resized or moved in place."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        mod = kernels()
        if mod is None:
            raise RuntimeError(f"quantized linear layers need the kernels: {unavailable_reason()}")
        self._qlinear = mod.qlinear
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().to(torch.float32).clone() if bias is not None else None
        self._type = int(weight.qtype)
        self._qs = weight.qs.data_ptr()
        # The kernel reads the scales (and Q4_1's minimums) as fp32: converted here once
        # instead of once per block per call (+4 bytes per block to hold, and to read).
        self._scales = weight.d.to(torch.float32)
        self._mins = weight.m.to(torch.float32) if weight.m is not None else None
        self._d = self._scales.data_ptr()
        self._m = self._mins.data_ptr() if self._mins is not None else 0

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
        self._qlinear(
            self._type, x.data_ptr(), x.stride(0), t, self.in_features,
            self._qs, self._d, self._m, self.out_features,
            y.data_ptr(), self.out_features, torch.get_num_threads(),
            pre, pre_w, float(eps), into is not None,
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
