"""KV memory: paged block pool, radix prefix index, host swap tier, and the `KVManager` facade.

The scheduler uses `KVManager` only (see kv/SPEC.md); the tensors live in `kv/cache.py`.
"""

from __future__ import annotations

from pdserve.kv.block_pool import BlockAccountingError, KVCacheError
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.manager import (
    Allocation,
    KVManager,
    OutOfBlocksError,
    PrefixMatch,
    RequestStateError,
    SwapPlan,
    UnknownRequestError,
)

__all__ = [
    "Allocation",
    "BlockAccountingError",
    "KVCacheConfig",
    "KVCacheError",
    "KVManager",
    "OutOfBlocksError",
    "PrefixMatch",
    "RequestStateError",
    "SwapPlan",
    "UnknownRequestError",
]
