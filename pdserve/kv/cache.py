"""The KV tensors of one instance: a device tier and a host tier.

Bookkeeping (which block belongs to whom) is `KVManager`'s job; this module only
holds memory and executes the copy plans the manager returns.

Layout: `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`.
Layer-major, so one layer's K and V for all blocks are one contiguous slice: the
unit of layer-by-layer streaming. Zero-initialised (see `model/attention.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.model.config import ModelConfig


def kv_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (
        config.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
    )


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        num_host_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        device_tensor: torch.Tensor | None = None,
    ) -> None:
        """`device_tensor`: memory to use for the device tier (a KV transfer region that
        peers can reach); zero-filled, of the layout's shape and dtype."""
        self.block_size = block_size
        shape = kv_shape(config, num_blocks, block_size)
        if device_tensor is None:
            device_tensor = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(device_tensor.shape) != shape or device_tensor.dtype != dtype:
            raise ValueError(
                f"KV tensor has shape {tuple(device_tensor.shape)} {device_tensor.dtype}, "
                f"expected {shape} {dtype}"
            )
        self.device_tensor = device_tensor
        pin = torch.cuda.is_available() and torch.device(device).type == "cuda"
        self.host_tensor = torch.zeros(
            kv_shape(config, num_host_blocks, block_size), dtype=dtype, pin_memory=pin
        )

    def swap_out(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy (device_block, host_block) pairs device -> host."""
        self._copy(self.device_tensor, self.host_tensor, copies)

    def swap_in(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy (host_block, device_block) pairs host -> device."""
        self._copy(self.host_tensor, self.device_tensor, copies)

    @staticmethod
    def _copy(src: torch.Tensor, dst: torch.Tensor, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        s = torch.tensor([c[0] for c in copies], dtype=torch.long, device=src.device)
        d = torch.tensor([c[1] for c in copies], dtype=torch.long, device=dst.device)
        # One gather + one scatter for all blocks and layers (block aggregation).
        dst[:, :, d] = src[:, :, s].to(dst.device)
