"""Dense projections, with oneDNN's packed-weight kernel on CPU when torch has it.

On the CPUs we serve from, `F.linear` (MKL sgemm on a row-major weight) streams
weights at roughly half the speed of oneDNN's inner-product on a weight reordered
once into its blocked layout (bench/bench_engine.py, docs/benchmarks.md): 2x on
batch-1 decode, where reading the weights is the whole cost, and 2x on prefill.
`PackedLinear` reorders at load and falls back to `F.linear` where the op is missing
(other builds, CUDA tensors, non-fp32 dtypes).

Contract: packing copies the weight into an opaque oneDNN tensor; the caller may
then release the original (see `CausalLM.pack_weights`), after which only
`PackedLinear.__call__` can use it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

# Batch-size hint for the reorder; the packed weight serves every batch size.
_PACK_HINT = 64


class Linear(Protocol):
    """What a model calls for a projection: this module's PackedLinear, or
    pdserve.quant.linear.QuantLinear for weights in GGUF blocks."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def onednn_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear:
    """y = x @ weight.T + bias for x: [T, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias.detach().clone() if bias is not None else None
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight.detach()
        if pack and onednn_available(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().contiguous(), _PACK_HINT
            )
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
