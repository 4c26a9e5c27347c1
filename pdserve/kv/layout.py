"""`KVLayout` and `RegionHandle`: the plain-data descriptors of a KV pool.

They travel inside engine messages between processes (msgspec-encodable), so this module
imports neither torch nor any transfer transport: `import pdserve.kv.layout` stays cheap.
The torch side (the layout of a tensor, the torch dtype of a layout, the token-flat view)
is `pdserve.kv.transfer.layout`, built on the same dtype table (`DTYPE_SIZES`).

A pool is one contiguous tensor `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]` (`KVLayout.shape`; see `kv/cache.py`). Viewed "token-flat" as `[num_layers, 2,
num_blocks * block_size, num_kv_heads * head_dim]`, token slot `block * block_size + slot` of
one (layer, K/V) is one contiguous row of `token_bytes` bytes, and consecutive slots are
consecutive rows: a run of slots is one contiguous piece of memory per (layer, K/V).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

# The supported KV dtypes, by name, and their element size in bytes. The one dtype table:
# torch dtypes are looked up by these names (`pdserve.kv.transfer.layout.torch_dtype`).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
}


class KVLayout(msgspec.Struct, frozen=True):
    """Geometry of one KV pool; travels inside `RegionHandle`s (msgspec-encodable).

    Which part of the model's KV the pool holds, in the style of Mooncake's KV placement:
    `first_layer` is the global index of the pool's layer 0 (a pipeline stage holding
    global layers [3, 6) has `num_layers=3, first_layer=3`) and `first_kv_head` the global
    index of its KV head 0 (a tensor-parallel rank holding KV heads [2, 3) of 3 has
    `num_kv_heads=1, first_kv_head=2`): a contiguous range of layers by a contiguous range
    of KV heads. Nothing is replicated: pdserve's tensor-parallel split deals out whole GQA
    groups (`pdserve.parallel.layout`), so every KV head lives in exactly one rank's pool.
    Plans match layers and heads by global index.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPE_SIZES: "float32" | "bfloat16" | "float16"
    first_layer: int = 0
    first_kv_head: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if value <= 0:
                raise ValueError(f"KVLayout.{field} must be > 0, got {value}")
        for field in ("first_layer", "first_kv_head"):
            if getattr(self, field) < 0:
                raise ValueError(f"KVLayout.{field} must be >= 0, got {getattr(self, field)}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KVLayout.dtype must be one of {', '.join(DTYPE_SIZES)}, got {self.dtype!r}"
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
    def elem_size(self) -> int:
        """Bytes of one element."""
        return DTYPE_SIZES[self.dtype]

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
    def kv_heads(self) -> range:
        """Global indices of the KV heads this pool holds."""
        return range(self.first_kv_head, self.first_kv_head + self.num_kv_heads)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's part of a token row."""
        return self.head_dim * self.elem_size

    def describe(self) -> str:
        """ "layers [a, b), KV heads [c, d) of <head_dim> <dtype>, blocks of <n>", for
        error messages."""
        layers, heads = self.layers, self.kv_heads
        return (
            f"layers [{layers.start}, {layers.stop}), KV heads [{heads.start}, {heads.stop}) "
            f"of {self.head_dim} {self.dtype}, blocks of {self.block_size}"
        )

    def handoff_mismatch(self, other: KVLayout) -> str | None:
        """Why two instances whose whole pools have these layouts cannot hand KV to each
        other (a different model: its layers, KV heads or head size; a different KV
        dtype), None when they can. Block sizes may differ, and how each instance splits
        its pool over its ranks is the plans' business (`plans_between`)."""
        differs = [
            f"{what} {mine} vs {theirs}"
            for what, mine, theirs in (
                ("layers", self.num_layers, other.num_layers),
                ("KV heads", self.num_kv_heads, other.num_kv_heads),
                ("head size", self.head_dim, other.head_dim),
                ("KV dtype", self.dtype, other.dtype),
            )
            if mine != theirs
        ]
        return "; ".join(differs) or None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return 2 * self.num_layers * self.num_slots * self.token_bytes


def whole_layout(ranks: Sequence[KVLayout]) -> KVLayout:
    """The geometry of the KV an instance's rank pools hold together (one pool a rank,
    the driver's first): every layer and KV head any of them holds, from 0."""
    return msgspec.structs.replace(
        ranks[0],
        num_layers=max(r.layers.stop for r in ranks),
        num_kv_heads=max(r.kv_heads.stop for r in ranks),
        first_layer=0,
        first_kv_head=0,
    )


class RegionHandle(msgspec.Struct, frozen=True):
    """How a peer reaches a region: plain data, safe to send to other processes."""

    transport: str  # "inproc" | "shm" | "tcp" | "auto"
    address: str  # inproc: registry key; shm and auto: segment name; tcp: "host:port"
    name: str  # region name within that address
    layout: KVLayout
    # auto (kv/transfer/auto.py): the node the region lives on, and where its TCP server
    # listens; a peer on the same node maps the segment, any other connects.
    node: str = ""
    tcp_address: str = ""

    def describe(self) -> str:
        """ "<transport> region '<name>' at <address>", for error messages."""
        return f"{self.transport} region {self.name!r} at {self.address}"
