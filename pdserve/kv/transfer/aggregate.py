"""Scatter/gather: one contiguous buffer per request instead of one piece per block and layer.

MemServe's block aggregation: `gather` packs tokens [start, end) of a request (scattered
over its blocks) into one contiguous `[L, 2, n, heads, head_dim]` tensor; `scatter` writes
such a buffer back into a pool. Both copy with one strided copy per coalesced run (all
layers and K/V at once, never a loop per token), so they run near memcpy speed;
`copy_runs` is the same primitive the in-process and shared-memory transports use.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer.errors import LayoutMismatchError
from pdserve.kv.transfer.layout import token_view, torch_dtype
from pdserve.kv.transfer.plan import (
    TransferPlan,
    check_range,
    check_table,
    runs_between,
    token_slots,
)

PARALLEL_MIN_BYTES = 8 << 20  # smaller copies run on the calling thread (measured faster)
ITEM_BYTES = 1 << 20  # bytes per work item the copy threads take from a parallel copy
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()

_Run = tuple[int, int, int]
_Item = tuple[int, int, Sequence[_Run]]  # rows [lo, hi) of these runs


def copy_runs(
    src_flat: torch.Tensor, dst_flat: torch.Tensor, runs: Iterable[Sequence[int]]
) -> None:
    """For each (src_slot, dst_slot, n): `dst_flat[:, :, dst:dst+n] = src_flat[:, :, src:src+n]`.

    Both tensors are token-flat `[L, 2, slots, row]` with the same L and row. One strided
    copy per run covers every layer and K/V. Between CPU tensors of one dtype the copies
    are numpy byte copies (about 2 us per call against torch's 10+; they release the GIL)
    spread over `torch.get_num_threads()` threads once the copy reaches
    PARALLEL_MIN_BYTES: scattered 12 KB pieces are latency-bound on one core. The threads
    take ~ITEM_BYTES items from one shared list until it is empty, so a thread slowed down
    by a neighbour's process copies less instead of holding the others up, and a helper
    that has not started by then (the pool busy with another transfer) is cancelled.
    Otherwise (a cast, a GPU tensor) they are torch `copy_`s, which cast.

    The destination pieces must not overlap (any valid plan's do not).
    """
    pieces = [(int(s), int(d), int(n)) for s, d, n in runs]
    if not pieces:
        return
    cpu = src_flat.device.type == "cpu" and dst_flat.device.type == "cpu"
    if src_flat.dtype != dst_flat.dtype or not cpu:
        for s, d, n in pieces:
            dst_flat[:, :, d : d + n].copy_(src_flat[:, :, s : s + n])
        return
    src, dst = _np_rows(src_flat), _np_rows(dst_flat)
    nbytes = sum(r[2] for r in pieces) * src.shape[0] * src.shape[2]
    threads = torch.get_num_threads() if nbytes >= PARALLEL_MIN_BYTES else 1
    items = _work_items(pieces, src.shape[0], src.shape[2], ITEM_BYTES) if threads > 1 else []
    if len(items) < 2:
        _np_copy(src, dst, pieces)
        return
    take = _Counter()

    def drain() -> None:
        while (i := take()) < len(items):
            lo, hi, group = items[i]
            _np_copy(src[lo:hi], dst[lo:hi], group)

    helpers = min(threads, len(items)) - 1
    futures = [_executor(helpers).submit(drain) for _ in range(helpers)]
    try:
        drain()
    finally:
        for f in futures:
            f.cancel()  # not started yet: nothing left for it, and no need to wait for it
        wait(futures)  # no helper may still be copying once this returns
    for f in futures:
        if not f.cancelled():
            f.result()


def _np_rows(flat: torch.Tensor) -> np.ndarray:
    """A CPU tensor `[L, 2, slots, row]` as a uint8 ndarray `[2 L, slots, row_bytes]` (a view:
    one row per layer and K/V; strided where `flat` narrows rows to some heads)."""
    layers, kv, slots, _ = flat.shape
    return flat.view(torch.uint8).view(layers * kv, slots, -1).numpy()  # torch: never a copy


def _np_copy(src: np.ndarray, dst: np.ndarray, runs: Iterable[_Run]) -> None:
    for s, d, n in runs:
        np.copyto(dst[:, d : d + n], src[:, s : s + n])


def _work_items(runs: list[_Run], rows: int, row_bytes: int, item_bytes: int) -> list[_Item]:
    """Disjoint items of about `item_bytes` that together copy every run in every row:
    consecutive small runs grouped (all rows), a run larger than that split by rows."""
    items: list[_Item] = []
    group: list[_Run] = []
    acc = 0
    for run in runs:
        size = run[2] * rows * row_bytes
        if size > item_bytes:
            step = max(1, item_bytes // (run[2] * row_bytes))
            items.extend((lo, min(lo + step, rows), (run,)) for lo in range(0, rows, step))
            continue
        group.append(run)
        acc += size
        if acc >= item_bytes:
            items.append((0, rows, group))
            group, acc = [], 0
    if group:
        items.append((0, rows, group))
    return items


class _Counter:
    """0, 1, 2, ... across threads (each value handed out once)."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            i = self._next
            self._next += 1
        return i


def _executor(workers: int) -> ThreadPoolExecutor:
    """The shared copy thread pool (grown to `workers` threads when needed)."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            old, _pool = _pool, ThreadPoolExecutor(workers, thread_name_prefix="kv-copy")
            _pool_workers = workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def gather(
    pool: torch.Tensor,
    layout: KVLayout,
    blocks: Sequence[int],
    start: int,
    end: int,
    layers: range | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens [start, end) of a request as a contiguous `[L, 2, end - start, H, D]` tensor.

    `layers` (global indices, within the pool's) defaults to all the pool holds. The result
    is on the pool's device, in its dtype, and shares no memory with it: a new tensor, or
    `out` (contiguous, that shape) when given; reusing a buffer saves the page faults of
    fresh memory, which cost about as much as the copy itself.
    """
    _check_pool(pool, layout)
    check_range(start, end)
    check_table("source", blocks, layout.block_size, end)
    lo, hi = local_layers(layout, layers)
    n = end - start
    shape = (hi - lo, 2, n, layout.num_kv_heads, layout.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    elif tuple(out.shape) != shape or out.dtype != pool.dtype or not out.is_contiguous():
        raise LayoutMismatchError(
            f"gather output has shape {tuple(out.shape)} {out.dtype}, expected a contiguous "
            f"{shape} {pool.dtype}"
        )
    buf = out.view(hi - lo, 2, n, layout.row_elems)
    runs = runs_between(token_slots(blocks, layout.block_size, start, end), np.arange(n))
    copy_runs(token_view(pool)[lo:hi], buf, runs)
    return out


def gather_many(
    pool: torch.Tensor, layout: KVLayout, pieces: Sequence[tuple[Sequence[int], int, int]]
) -> torch.Tensor:
    """Several requests' tokens, one after another, as ONE contiguous `[L, 2, n, H, D]`
    tensor of every layer the pool holds: piece `(blocks, start, end)` is tokens
    [start, end) of the request whose block table is `blocks`, and fills the next
    `end - start` rows. One `copy_runs` call for all pieces (the replicator's per-step
    aggregation: a few tokens of many requests, flushed with one transport call)."""
    _check_pool(pool, layout)
    slots: list[np.ndarray] = []
    for blocks, start, end in pieces:
        check_range(start, end)
        check_table("source", blocks, layout.block_size, end)
        slots.append(token_slots(blocks, layout.block_size, start, end))
    src = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
    n = len(src)
    out = torch.empty(
        (layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim),
        dtype=pool.dtype,
        device=pool.device,
    )
    runs = runs_between(src, np.arange(n))
    copy_runs(token_view(pool), out.view(layout.num_layers, 2, n, layout.row_elems), runs)
    return out


def scatter(
    buf: torch.Tensor,
    pool: torch.Tensor,
    layout: KVLayout,
    blocks: Sequence[int],
    start: int,
    layers: range | None = None,
) -> None:
    """Write `buf` (`[L, 2, n, H, D]`, as `gather` returns) into tokens [start, start + n).

    `layers` must have L layers (default: all the pool holds); casts when dtypes differ.
    """
    _check_pool(pool, layout)
    lo, hi = local_layers(layout, layers)
    heads_dim = (layout.num_kv_heads, layout.head_dim)
    if buf.dim() != 5 or tuple(buf.shape[:2]) != (hi - lo, 2) or tuple(buf.shape[3:]) != heads_dim:
        raise LayoutMismatchError(
            f"scatter buffer has shape {tuple(buf.shape)}, expected "
            f"[{hi - lo}, 2, n, {layout.num_kv_heads}, {layout.head_dim}]"
        )
    n = buf.shape[2]
    check_table("destination", blocks, layout.block_size, start + n)
    runs = runs_between(np.arange(n), token_slots(blocks, layout.block_size, start, start + n))
    flat_buf = buf.reshape(hi - lo, 2, n, layout.row_elems)
    copy_runs(flat_buf, token_view(pool)[lo:hi], runs)


def apply_plan(plan: TransferPlan, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> None:
    """Execute a plan between two pools this process can address (one copy per run, of the
    plan's heads of each row).

    Casts when the dtypes differ. The caller guarantees the plan fits both pools
    (see `transport.check_plan`).
    """
    s0, s1 = plan.src_layers
    d0, d1 = plan.dst_layers
    src = token_view(src_pool, plan.src_heads)[s0:s1]
    copy_runs(src, token_view(dst_pool, plan.dst_heads)[d0:d1], plan.runs)


def local_layers(layout: KVLayout, layers: range | None) -> tuple[int, int]:
    """[start, stop) local indices of global `layers` (all when None); must lie in the pool."""
    if layers is None:
        return 0, layout.num_layers
    have = layout.layers
    if layers.step != 1 or layers.start < have.start or layers.stop > have.stop or not layers:
        raise LayoutMismatchError(
            f"layers [{layers.start}, {layers.stop}) are not within the pool's "
            f"[{have.start}, {have.stop})"
        )
    return layers.start - layout.first_layer, layers.stop - layout.first_layer


def _check_pool(pool: torch.Tensor, layout: KVLayout) -> None:
    if tuple(pool.shape) != layout.shape or pool.dtype != torch_dtype(layout):
        raise LayoutMismatchError(
            f"pool tensor has shape {tuple(pool.shape)} {pool.dtype}, layout says "
            f"{layout.shape} {torch_dtype(layout)}"
        )
