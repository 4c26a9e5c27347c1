"""The KV tensors of one instance: a device tier and a host tier.

Bookkeeping (which block belongs to whom) is `KVManager`'s job; this module only
holds memory and executes the copy plans the manager returns.

Layout: `KVLayout.shape` (`kv/layout.py`), `[num_layers, 2 (K, V), num_blocks, block_size,
num_kv_heads, head_dim]`.
Layer-major, so one layer's K and V for all blocks are one contiguous slice: the
unit of layer-by-layer streaming. Zero-initialised (see `model/attention.py`).

On the CPU nothing is written at start: both tiers are fresh mappings (`huge_page_zeros`,
or a transfer region's /dev/shm segment), zeros whose pages the kernel faults in where
first written. The device tier's pages are faulted in behind the start instead, by a
thread at the lowest priority (`pdserve/memory.py` `fault_in_behind`) in the order blocks
are handed out: the first requests' blocks first (a 2 MB page's first touch cost 4-50 ms
on this project's VM, and the first request writes one in each layer's K and V), and no
step later meets a burst of faults. The host tier, written only by swaps, stays lazy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from pdserve.kv.block_pool import KVCacheError
from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer.aggregate import copy_runs
from pdserve.kv.transfer.layout import token_view, torch_dtype
from pdserve.kv.transfer.plan import runs_between
from pdserve.memory import HUGE_PAGE, fault_in, fault_in_behind, huge_page_zeros


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
        self.host_layout: KVLayout | None = None
        if num_host_blocks > 0:
            self.host_layout = msgspec.structs.replace(layout, num_blocks=num_host_blocks)
        self.device_tensor = _device_tier(layout, device, device_tensor)
        self.faulting_in: threading.Thread | None = None  # faults the device tier in
        if self.device_tensor.device.type == "cpu":
            rows = _block_rows(layout, self.device_tensor.nbytes)
            first = 2 * layout.num_layers  # the first row of blocks in every slice
            fault_in(self.device_tensor, rows[:first])
            self.faulting_in = fault_in_behind(self.device_tensor, rows[first:])
        self.host_tensor: torch.Tensor | None = None
        if self.host_layout is not None:
            self.host_tensor = _host_tier(self.host_layout, device)

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
        """Blocks `copies[i][0]` of `src` to blocks `copies[i][1]` of `dst`, every layer and
        K/V. Between tensors on two devices (a GPU's pool and its host tier) the blocks
        are packed into one buffer on each side, so one contiguous transfer crosses the
        bus instead of one strided piece per block run (fancy indexing moved 0.9-1.4 GB/s
        where a plain copy moved 16 on a CPU and 55 on an H200: bench/bench_cuda.py)."""
        s = np.fromiter((c[0] for c in copies), np.int64, len(copies))
        d = np.fromiter((c[1] for c in copies), np.int64, len(copies))
        if src.device == dst.device:
            _copy_blocks(src, s, dst, d)
            return
        here = np.arange(len(copies), dtype=np.int64)
        src_packed, dst_packed = _packed(src, len(copies)), _packed(dst, len(copies))
        _copy_blocks(src, s, src_packed, here)
        dst_packed.copy_(src_packed)
        _copy_blocks(dst_packed, here, dst, d)


def _block_rows(layout: KVLayout, nbytes: int) -> list[tuple[int, int]]:
    """The pool's byte ranges in the order blocks are handed out (ids ascending,
    kv/block_pool.py): the blocks of ~one 2 MB page in each (layer, K/V) slice, slice
    after slice, then the next blocks."""
    slices = layout.num_layers * 2
    per_slice = nbytes // slices
    block = per_slice // layout.num_blocks
    row = max(1, HUGE_PAGE // block) * block
    return [
        (s * per_slice + first, s * per_slice + min(first + row, per_slice))
        for first in range(0, per_slice, row)
        for s in range(slices)
    ]


def _device_tier(
    layout: KVLayout, device: torch.device | str, given: torch.Tensor | None
) -> torch.Tensor:
    dtype = torch_dtype(layout)
    if given is None and torch.device(device).type == "cpu":
        return huge_page_zeros(layout.shape, dtype)  # see pdserve/memory.py
    if given is None:
        return torch.zeros(layout.shape, dtype=dtype, device=device)
    if tuple(given.shape) != layout.shape or given.dtype != dtype:
        raise ValueError(
            f"KV tensor has shape {tuple(given.shape)} {given.dtype}, "
            f"expected {layout.shape} {dtype}"
        )
    return given


def _host_tier(layout: KVLayout, device: torch.device | str) -> torch.Tensor:
    """Pinned beside CUDA (swaps cross the bus by DMA); on the CPU, untouched zeros."""
    dtype = torch_dtype(layout)
    if torch.device(device).type == "cpu":
        return huge_page_zeros(layout.shape, dtype)
    pin = torch.cuda.is_available() and torch.device(device).type == "cuda"
    return torch.zeros(layout.shape, dtype=dtype, pin_memory=pin)


def _packed(pool: torch.Tensor, n: int) -> torch.Tensor:
    """A buffer of n blocks beside `pool`, pinned when on the host (only reached beside an
    accelerator): the bus is crossed by DMA, and torch's pinned allocator keeps freed
    buffers for the next swap, so no page is faulted in per call."""
    shape = (*pool.shape[:2], n, *pool.shape[3:])
    pin = pool.device.type == "cpu"
    return torch.empty(shape, dtype=pool.dtype, device=pool.device, pin_memory=pin)


def _copy_blocks(src: torch.Tensor, s: np.ndarray, dst: torch.Tensor, d: np.ndarray) -> None:
    """Blocks s of `src` to blocks d of `dst`, one device. On the host: the transfer
    library's copy of coalesced runs (all layers and K/V per run; numpy byte copies over
    the copy threads). On an accelerator: one gather and one scatter kernel (a copy per
    run cost 6.5 ms for 512 blocks on an H200, the gather 0.5)."""
    if src.device.type != "cpu":
        rows = src.index_select(2, torch.as_tensor(s, device=src.device))
        dst.index_copy_(2, torch.as_tensor(d, device=dst.device), rows)
        return
    bs = src.shape[3]
    runs = [(a * bs, b * bs, n * bs) for a, b, n in runs_between(s, d)]
    copy_runs(token_view(src), token_view(dst), runs)
