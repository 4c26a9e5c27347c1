"""Dense projections: `projection` picks the compiled kernels' `DenseLinear` where they
take the weight (fp32 on CPU), else oneDNN's packed-weight kernel when torch has it.

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

from pdserve.memory import HugePageArena
from pdserve.quant.linear import DenseLinear, dense_blocker

# Batch-size hint for the reorder; the packed weight serves every batch size.
_PACK_HINT = 64


class Linear(Protocol):
    """What a model calls for a projection: this module's PackedLinear, or
    pdserve.quant.linear's compiled ops (QuantLinear for weights in GGUF blocks,
    DenseLinear for fp32 ones)."""

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


def projection(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pack: bool,
    arena: HugePageArena | None = None,
) -> Linear:
    """The op for a full-precision weight. With `pack` (a model being finalized):
    `DenseLinear` where the compiled kernels take the weight (fp32 on CPU: their products
    hand work between threads as they go, and the model's decode steps run in one
    compiled call), else `PackedLinear` (oneDNN; F.linear where torch lacks it). Without
    `pack`, an unpacked PackedLinear that reads the weight in place (weights still
    loading). `arena`: where DenseLinear keeps its panels (2 MB pages, pdserve/memory.py)."""
    if pack and not dense_blocker(weight):
        return DenseLinear(weight, bias, arena)
    return PackedLinear(weight, bias, pack)
