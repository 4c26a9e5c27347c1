"""The torch side of `KVLayout` (`pdserve.kv.layout`, which imports no torch).

Torch dtypes are looked up by the names of the one dtype table, `DTYPE_SIZES`.
`token_view` views a pool token-flat: `[num_layers, 2, num_blocks * block_size, num_kv_heads *
head_dim]`, where a run of token slots is one contiguous piece of memory per (layer, K/V).
"""

from __future__ import annotations

import torch

from pdserve.kv.layout import DTYPE_SIZES, KVLayout
from pdserve.kv.transfer.errors import LayoutMismatchError

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of a layout's elements."""
    return TORCH_DTYPES[layout.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The layout name of a torch dtype ("float32", ...); LayoutMismatchError if unsupported."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise LayoutMismatchError(
            f"KV pool dtype must be one of {', '.join(DTYPE_SIZES)}, got {dtype}"
        ) from None


def layout_of(tensor: torch.Tensor, first_layer: int = 0) -> KVLayout:
    """Layout of an existing pool tensor (6-D, dim 1 of size 2, a supported dtype)."""
    if tensor.dim() != 6 or tensor.shape[1] != 2:
        raise LayoutMismatchError(
            "a KV pool tensor has shape [num_layers, 2, num_blocks, block_size, "
            f"num_kv_heads, head_dim], got {tuple(tensor.shape)}"
        )
    layers, _, blocks, block_size, heads, head_dim = tensor.shape
    return KVLayout(
        layers, blocks, block_size, heads, head_dim, dtype_name(tensor.dtype), first_layer
    )


def token_view(pool: torch.Tensor, heads: tuple[int, int] | None = None) -> torch.Tensor:
    """The pool viewed token-flat: `[num_layers, 2, num_blocks * block_size, heads * head_dim]`.

    A view (no copy); the pool must be contiguous. `heads` ([start, stop), local) narrows
    each row to those KV heads: still a view, strided (a row's part is contiguous, rows
    are not).
    """
    if pool.dim() != 6 or not pool.is_contiguous():
        raise LayoutMismatchError(
            f"a KV pool must be a contiguous 6-D tensor, got shape {tuple(pool.shape)}"
            f"{'' if pool.is_contiguous() else ' (not contiguous)'}"
        )
    layers, kv, blocks, block_size, num_heads, head_dim = pool.shape
    if heads is None:
        return pool.view(layers, kv, blocks * block_size, num_heads * head_dim)
    h0, h1 = heads
    return pool[:, :, :, :, h0:h1].view(layers, kv, blocks * block_size, (h1 - h0) * head_dim)
