"""`KVCacheConfig`: size and policy of the paged KV cache (both tiers).

Fields are keyword-only (`KVCacheConfig(num_blocks=1024)`), so that `block_size` can keep
its default while `num_blocks` stays required. Every field is validated in `__post_init__`;
a bad value raises `ValueError` naming the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """Paged KV-cache geometry and prefix-cache switch.

    block_size:          tokens per KV block (>= 1); the prefix cache shares whole blocks only.
    num_blocks:          device (GPU) blocks, ids 0..num_blocks-1 (>= 1).
    num_host_blocks:     host (CPU) blocks for swapped-out requests (>= 0; 0 = no swapping).
    enable_prefix_cache: keep finished blocks in a radix index so later prompts reuse them.
    """

    block_size: int = 16
    num_blocks: int
    num_host_blocks: int = 0
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("num_blocks", self.num_blocks, minimum=1)
        _check_int("num_host_blocks", self.num_host_blocks, minimum=0)
        if not isinstance(self.enable_prefix_cache, bool):
            raise ValueError(
                "KVCacheConfig.enable_prefix_cache must be a bool "
                f"(got {self.enable_prefix_cache!r})"
            )

    @property
    def num_device_tokens(self) -> int:
        """Token capacity of the device tier."""
        return self.num_blocks * self.block_size

    @property
    def num_host_tokens(self) -> int:
        """Token capacity of the host tier."""
        return self.num_host_blocks * self.block_size


def _check_int(name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass; `block_size=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"KVCacheConfig.{name} must be an int >= {minimum} (got {value!r})")
    if value < minimum:
        raise ValueError(f"KVCacheConfig.{name} must be >= {minimum} (got {value})")
