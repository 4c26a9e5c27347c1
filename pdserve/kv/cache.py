"""The KV tensors of one instance: a device tier and a host tier.

Bookkeeping (which block belongs to whom) is `KVManager`'s job; this module only
holds memory and executes the copy plans the manager returns.

Layout: `KVLayout.shape` (`kv/layout.py`), `[num_layers, 2 (K, V), num_blocks, block_size,
num_kv_heads, head_dim]`.
Layer-major, so one layer's K and V for all blocks are one contiguous slice: the
unit of layer-by-layer streaming. Zero-initialised (see `model/attention.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from pdserve.kv.block_pool import KVCacheError
from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer.layout import torch_dtype


class KVCache:
    def __init__(
        self,
        layout: KVLayout,
        num_host_blocks: int,
        device: torch.device | str = "cpu",
        device_tensor: torch.Tensor | None = None,
    ) -> None:
        """`layout`: the device tier's geometry and dtype; the host tier is the same layout
        with `num_host_blocks` blocks (0: no host tier, `host_tensor` and `host_layout` are
        None). `device_tensor`: memory to use for the device tier (a KV transfer region that
        peers can reach); zero-filled, of the layout's shape and dtype."""
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.layout = layout
        self.block_size = layout.block_size
        dtype = torch_dtype(layout)
        if device_tensor is None:
            device_tensor = torch.zeros(layout.shape, dtype=dtype, device=device)
        elif tuple(device_tensor.shape) != layout.shape or device_tensor.dtype != dtype:
            raise ValueError(
                f"KV tensor has shape {tuple(device_tensor.shape)} {device_tensor.dtype}, "
                f"expected {layout.shape} {dtype}"
            )
        self.device_tensor = device_tensor
        self.host_layout: KVLayout | None = None
        self.host_tensor: torch.Tensor | None = None
        if num_host_blocks > 0:
            self.host_layout = msgspec.structs.replace(layout, num_blocks=num_host_blocks)
            pin = torch.cuda.is_available() and torch.device(device).type == "cuda"
            self.host_tensor = torch.zeros(self.host_layout.shape, dtype=dtype, pin_memory=pin)

    def swap_out(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy (device_block, host_block) pairs device -> host."""
        if copies:
            self._copy(self.device_tensor, self._host(), copies)

    def swap_in(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy (host_block, device_block) pairs host -> device."""
        if copies:
            self._copy(self._host(), self.device_tensor, copies)

    def _host(self) -> torch.Tensor:
        if self.host_tensor is None:
            raise KVCacheError("cannot swap: this cache has no host tier (num_host_blocks=0)")
        return self.host_tensor

    @staticmethod
    def _copy(src: torch.Tensor, dst: torch.Tensor, copies: Sequence[tuple[int, int]]) -> None:
        s = torch.tensor([c[0] for c in copies], dtype=torch.long, device=src.device)
        d = torch.tensor([c[1] for c in copies], dtype=torch.long, device=dst.device)
        # One gather + one scatter for all blocks and layers (block aggregation).
        dst[:, :, d] = src[:, :, s].to(dst.device)
