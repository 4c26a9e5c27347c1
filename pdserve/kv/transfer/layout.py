"""`KVLayout`: the geometry of one KV pool, as the transfer library sees it.

A pool is one contiguous tensor `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]` (see `kv/cache.py`). Viewed "token-flat" as `[num_layers, 2, num_blocks *
block_size, num_kv_heads * head_dim]` (`token_view`), token slot `block * block_size + slot`
of one (layer, K/V) is one contiguous row of `token_bytes` bytes, and consecutive slots are
consecutive rows: a run of slots is one contiguous piece of memory per (layer, K/V).
"""

from __future__ import annotations

import msgspec
import torch

from pdserve.kv.transfer.errors import LayoutMismatchError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class KVLayout(msgspec.Struct, frozen=True):
    """Geometry of one KV pool; travels inside `RegionHandle`s (msgspec-encodable).

    `first_layer` is the global index of the pool's layer 0: a pipeline stage holding global
    layers [3, 6) has `num_layers=3, first_layer=3`. Plans match layers by global index.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    first_layer: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if value <= 0:
                raise ValueError(f"KVLayout.{field} must be > 0, got {value}")
        if self.first_layer < 0:
            raise ValueError(f"KVLayout.first_layer must be >= 0, got {self.first_layer}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"KVLayout.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """Shape of the pool tensor."""
        return (
            self.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def row_elems(self) -> int:
        """Elements of one token row (one token, one layer, one of K/V)."""
        return self.num_kv_heads * self.head_dim

    @property
    def token_bytes(self) -> int:
        """Bytes of one token row (one token, one layer, one of K/V)."""
        return self.row_elems * self.elem_size

    @property
    def num_slots(self) -> int:
        """Token slots per (layer, K/V): num_blocks * block_size."""
        return self.num_blocks * self.block_size

    @property
    def layers(self) -> range:
        """Global indices of the layers this pool holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return 2 * self.num_layers * self.num_slots * self.token_bytes

    @classmethod
    def of(cls, tensor: torch.Tensor, first_layer: int = 0) -> KVLayout:
        """Layout of an existing pool tensor (6-D, dim 1 of size 2, a supported dtype)."""
        if tensor.dim() != 6 or tensor.shape[1] != 2:
            raise LayoutMismatchError(
                "a KV pool tensor has shape [num_layers, 2, num_blocks, block_size, "
                f"num_kv_heads, head_dim], got {tuple(tensor.shape)}"
            )
        if tensor.dtype not in _DTYPE_NAMES:
            raise LayoutMismatchError(
                f"KV pool dtype must be one of {', '.join(DTYPES)}, got {tensor.dtype}"
            )
        layers, _, blocks, block_size, heads, head_dim = tensor.shape
        return cls(
            layers, blocks, block_size, heads, head_dim, _DTYPE_NAMES[tensor.dtype], first_layer
        )


def dtype_name(dtype: torch.dtype) -> str:
    """The layout name of a torch dtype ("float32", ...); LayoutMismatchError if unsupported."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise LayoutMismatchError(
            f"KV pool dtype must be one of {', '.join(DTYPES)}, got {dtype}"
        ) from None


def token_view(pool: torch.Tensor) -> torch.Tensor:
    """The pool viewed token-flat: `[num_layers, 2, num_blocks * block_size, heads * head_dim]`.

    A view (no copy); the pool must be contiguous.
    """
    if pool.dim() != 6 or not pool.is_contiguous():
        raise LayoutMismatchError(
            f"a KV pool must be a contiguous 6-D tensor, got shape {tuple(pool.shape)}"
            f"{'' if pool.is_contiguous() else ' (not contiguous)'}"
        )
    layers, kv, blocks, block_size, heads, head_dim = pool.shape
    return pool.view(layers, kv, blocks * block_size, heads * head_dim)
