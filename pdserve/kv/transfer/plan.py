"""Transfer plans: which contiguous pieces of the source pool go where in the destination.

DéjàVu's stream_out / stream_in: given the sender's and the receiver's layouts and block
tables, a `TransferPlan` lists the layers to move and the coalesced token runs. A run is a
range of tokens whose slots are consecutive in both pools, so per (layer, K/V) it is ONE
contiguous piece on each side: a plan moves `num_chunks` = 2 * num_layers * len(runs) pieces,
whatever the block sizes (16 -> 32, 16 -> 5, ...). Plans are plain data (msgspec), so the TCP
transport sends them to the peer as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer.errors import LayoutMismatchError


class TokenRun(NamedTuple):
    src_slot: int  # flat token slot in the source pool
    dst_slot: int  # flat token slot in the destination pool
    num_tokens: int


class TransferPlan(msgspec.Struct, frozen=True):
    """Layers and token runs to move from a source pool to a destination pool.

    Layer ranges are LOCAL indices into each pool (a pool holding global layers [3, 6) calls
    global layer 4 its layer 1). `token_bytes` is one token row (one layer, one of K/V) in
    the source dtype. A plan is only valid for the layouts it was made for.
    """

    src_layers: tuple[int, int]  # [start, stop) local layer indices into the source pool
    dst_layers: tuple[int, int]  # same count, local indices into the destination pool
    runs: tuple[tuple[int, int, int], ...]  # TokenRun tuples, coalesced
    token_bytes: int

    @property
    def num_layers(self) -> int:
        return self.src_layers[1] - self.src_layers[0]

    @property
    def num_tokens(self) -> int:
        return sum(r[2] for r in self.runs)

    @property
    def nbytes(self) -> int:
        """Payload bytes (source dtype): K and V of every layer and token."""
        return 2 * self.num_layers * self.num_tokens * self.token_bytes

    @property
    def num_chunks(self) -> int:
        """Contiguous pieces the plan moves: one per (layer, K/V, run)."""
        return 2 * self.num_layers * len(self.runs)


def check_range(start: int, end: int) -> None:
    """LayoutMismatchError unless 0 <= start <= end."""
    if not 0 <= start <= end:
        raise LayoutMismatchError(
            f"token range out of order: start {start}, end {end} (need 0 <= start <= end)"
        )


def check_table(side: str, blocks: Sequence[int], block_size: int, end: int) -> None:
    """LayoutMismatchError unless `blocks` covers tokens [0, end)."""
    need = -(-end // block_size)
    if len(blocks) < need:
        raise LayoutMismatchError(
            f"{side} block table is too short: {end} tokens with block_size {block_size} "
            f"need {need} blocks, got {len(blocks)}"
        )


def token_slots(blocks: Sequence[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Flat slot of every token in [start, end): `blocks[i // bs] * bs + i % bs` (int64)."""
    idx = np.arange(start, end, dtype=np.int64)
    used = np.asarray(blocks[start // block_size : -(-end // block_size)], dtype=np.int64)
    return used[idx // block_size - start // block_size] * block_size + idx % block_size


def runs_between(src: np.ndarray, dst: np.ndarray) -> list[TokenRun]:
    """Maximal runs over which both slot arrays advance by exactly 1."""
    n = len(src)
    if n == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return [
        TokenRun(s, d, k)
        for s, d, k in zip(
            src[starts].tolist(), dst[starts].tolist(), lengths.tolist(), strict=True
        )
    ]


def plan_runs(
    src_blocks: Sequence[int],
    src_block_size: int,
    dst_blocks: Sequence[int],
    dst_block_size: int,
    start: int,
    end: int,
) -> list[TokenRun]:
    """Coalesced runs moving tokens [start, end) of a request between two block tables.

    A run breaks only where the source or the destination slots stop being consecutive, so
    adjacent blocks (ids b, b + 1) on both sides merge into one run. Raises
    LayoutMismatchError for an out-of-order range or a table too short for `end`.
    """
    check_range(start, end)
    check_table("source", src_blocks, src_block_size, end)
    check_table("destination", dst_blocks, dst_block_size, end)
    return runs_between(
        token_slots(src_blocks, src_block_size, start, end),
        token_slots(dst_blocks, dst_block_size, start, end),
    )


def stream_out(
    src: KVLayout,
    src_blocks: Sequence[int],
    dst: KVLayout,
    dst_blocks: Sequence[int],
    start: int,
    end: int,
    layers: range | None = None,
) -> TransferPlan:
    """Plan moving tokens [start, end) of the layers both pools hold (sender's view).

    `layers` (global indices, step 1) narrows the layers further, e.g. one layer for
    layer-by-layer streaming. Block sizes may differ. Dtypes may differ too, but only
    transports that can cast (inproc, shm) execute such a plan; TCP refuses it. The sender
    executes the plan with `Transport.flush(receiver_handle, plan, its_pool)`.

    Raises LayoutMismatchError (a ValueError) naming the field and both values when
    num_kv_heads or head_dim differ, when a block table is too short for `end` or names a
    block outside its pool, when start/end are out of order, or when no layer is common.
    """
    for field in ("num_kv_heads", "head_dim"):
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise LayoutMismatchError(f"{field} differs: source has {a}, destination has {b}")
    check_range(start, end)
    check_table("source", src_blocks, src.block_size, end)
    check_table("destination", dst_blocks, dst.block_size, end)
    common = _common_layers(src, dst, layers)
    _check_block_ids("source", src, src_blocks, start, end)
    _check_block_ids("destination", dst, dst_blocks, start, end)
    runs = plan_runs(src_blocks, src.block_size, dst_blocks, dst.block_size, start, end)
    return TransferPlan(
        src_layers=(common.start - src.first_layer, common.stop - src.first_layer),
        dst_layers=(common.start - dst.first_layer, common.stop - dst.first_layer),
        runs=tuple(tuple(r) for r in runs),  # type: ignore[misc]
        token_bytes=src.token_bytes,
    )


def stream_in(
    src: KVLayout,
    src_blocks: Sequence[int],
    dst: KVLayout,
    dst_blocks: Sequence[int],
    start: int,
    end: int,
    layers: range | None = None,
) -> TransferPlan:
    """The receiver's name for `stream_out`: the same plan (source first, as always).

    The receiver executes it with `Transport.fetch(sender_handle, plan, its_pool)`.
    """
    return stream_out(src, src_blocks, dst, dst_blocks, start, end, layers)


def _common_layers(src: KVLayout, dst: KVLayout, layers: range | None) -> range:
    if layers is not None and layers.step != 1:
        raise ValueError(f"layers must be a range with step 1, got {layers}")
    lo = max(src.first_layer, dst.first_layer)
    hi = min(src.layers.stop, dst.layers.stop)
    if layers is not None:
        lo, hi = max(lo, layers.start), min(hi, layers.stop)
    if lo >= hi:
        wanted = "" if layers is None else f", requested [{layers.start}, {layers.stop})"
        raise LayoutMismatchError(
            f"no common layers: source holds [{src.layers.start}, {src.layers.stop}), "
            f"destination holds [{dst.layers.start}, {dst.layers.stop}){wanted}"
        )
    return range(lo, hi)


def _check_block_ids(
    side: str, layout: KVLayout, blocks: Sequence[int], start: int, end: int
) -> None:
    bs = layout.block_size
    used = blocks[start // bs : -(-end // bs)]
    for block in (min(used, default=0), max(used, default=0)):
        if not 0 <= block < layout.num_blocks:
            raise LayoutMismatchError(
                f"{side} block id {block} is out of range for a pool of {layout.num_blocks} blocks"
            )


def split_plan(plan: TransferPlan, parts: int) -> list[TransferPlan]:
    """Split a plan into at most `parts` plans of about equal bytes that together move
    exactly what it moves: by layers when it has at least `parts` layers, else by tokens
    (cutting runs where needed). Used to spread one transfer over parallel streams."""
    if parts <= 1 or plan.nbytes == 0:
        return [plan]
    n_layers = plan.num_layers
    if n_layers >= parts:
        cuts = [n_layers * i // parts for i in range(parts + 1)]
        return [
            msgspec.structs.replace(
                plan,
                src_layers=(plan.src_layers[0] + a, plan.src_layers[0] + b),
                dst_layers=(plan.dst_layers[0] + a, plan.dst_layers[0] + b),
            )
            for a, b in itertools.pairwise(cuts)
        ]
    return [msgspec.structs.replace(plan, runs=runs) for runs in _split_runs(plan, parts)]


def _split_runs(plan: TransferPlan, parts: int) -> list[tuple[tuple[int, int, int], ...]]:
    total = plan.num_tokens
    cuts = [total * i // parts for i in range(1, parts)] + [total]
    out: list[tuple[tuple[int, int, int], ...]] = []
    current: list[tuple[int, int, int]] = []
    done = 0  # tokens assigned to `out` and `current`
    for s, d, n in plan.runs:
        while n:
            take = min(n, cuts[len(out)] - done)
            if take:
                current.append((s, d, take))
                s, d, n, done = s + take, d + take, n - take, done + take
            if done == cuts[len(out)] and len(out) < parts - 1:
                out.append(tuple(current))
                current = []
    out.append(tuple(current))
    return [runs for runs in out if runs]


def merge_plans(plans: Sequence[TransferPlan]) -> TransferPlan:
    """One plan moving exactly what `plans` move, in order: their runs concatenated (a run
    that continues the previous one on both sides is joined to it). Used to flush several
    requests' KV, gathered into one buffer, with one transport call.

    Raises ValueError for no plans, or plans whose layers or token_bytes differ (they would
    not be one set of pieces between the same two pools)."""
    if not plans:
        raise ValueError("merge_plans needs at least one plan")
    first = plans[0]
    runs: list[tuple[int, int, int]] = []
    for plan in plans:
        same = (plan.src_layers, plan.dst_layers, plan.token_bytes)
        if same != (first.src_layers, first.dst_layers, first.token_bytes):
            raise ValueError(
                f"cannot merge plans of different layers or token rows: {same} vs "
                f"{(first.src_layers, first.dst_layers, first.token_bytes)}"
            )
        for s, d, n in plan.runs:
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                ps, pd, pn = runs[-1]
                runs[-1] = (ps, pd, pn + n)
            else:
                runs.append((s, d, n))
    return msgspec.structs.replace(first, runs=tuple(runs))
