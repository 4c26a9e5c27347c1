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
    global layer 4 its layer 1), and so are head ranges. `token_bytes` is the part of one
    token row (one layer, one of K/V) the plan moves, in the source dtype. Heads `None`
    move whole rows; a head range moves that part of each row (between pools of different
    tensor-parallel splits), so a piece is then one strided copy rather than one
    contiguous one. A plan is only valid for the layouts it was made for.
    """

    src_layers: tuple[int, int]  # [start, stop) local layer indices into the source pool
    dst_layers: tuple[int, int]  # same count, local indices into the destination pool
    runs: tuple[tuple[int, int, int], ...]  # TokenRun tuples, coalesced
    token_bytes: int
    src_heads: tuple[int, int] | None = None  # [start, stop) local KV heads; None: all
    dst_heads: tuple[int, int] | None = None  # same count; None: all

    def heads(self, side: str, layout: KVLayout) -> tuple[int, int]:
        """The local KV heads of `side` ("source" | "destination") the plan moves, in a pool
        of `layout`."""
        heads = self.src_heads if side == "source" else self.dst_heads
        return (0, layout.num_kv_heads) if heads is None else heads

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

    The plan moves the KV heads both pools hold (by global index: `KVLayout.first_kv_head`),
    so between two ranks of different tensor-parallel splits it moves the heads they
    share; `plans_between` plans every pair of two instances' ranks.

    Raises LayoutMismatchError (a ValueError) naming the field and both values when
    head_dim differs, when a block table is too short for `end` or names a block outside
    its pool, when start/end are out of order, or when no layer or no KV head is common.
    """
    if src.head_dim != dst.head_dim:
        raise LayoutMismatchError(
            f"head_dim differs: source has {src.head_dim}, destination has {dst.head_dim}"
        )
    check_range(start, end)
    check_table("source", src_blocks, src.block_size, end)
    check_table("destination", dst_blocks, dst.block_size, end)
    common = _common_layers(src, dst, layers)
    _check_block_ids("source", src, src_blocks, start, end)
    _check_block_ids("destination", dst, dst_blocks, start, end)
    heads = _common_heads(src, dst)
    runs = plan_runs(src_blocks, src.block_size, dst_blocks, dst.block_size, start, end)
    return _plan(
        src, dst, common, heads, tuple((r.src_slot, r.dst_slot, r.num_tokens) for r in runs)
    )


def _plan(
    src: KVLayout,
    dst: KVLayout,
    layers: range,
    heads: range,
    runs: tuple[tuple[int, int, int], ...],
) -> TransferPlan:
    def local_heads(layout: KVLayout) -> tuple[int, int] | None:
        if heads == layout.kv_heads:
            return None
        return heads.start - layout.first_kv_head, heads.stop - layout.first_kv_head

    return TransferPlan(
        src_layers=(layers.start - src.first_layer, layers.stop - src.first_layer),
        dst_layers=(layers.start - dst.first_layer, layers.stop - dst.first_layer),
        runs=runs,
        token_bytes=len(heads) * src.head_bytes,
        src_heads=local_heads(src),
        dst_heads=local_heads(dst),
    )


def shared_plan(src: KVLayout, dst: KVLayout, runs: Sequence[tuple[int, int, int]]) -> TransferPlan:
    """Move the slots of `runs` ((src_slot, dst_slot, num_tokens) each) in the layers and
    KV heads both pools hold, by global index (a rank's shard into a whole-model pool,
    or the reverse). LayoutMismatchError when no layer or no KV head is common."""
    layers = _common_layers(src, dst, None)
    return _plan(src, dst, layers, _common_heads(src, dst), tuple(runs))


# A move between two instances' ranks: (source rank, destination rank, plan). Their
# regions and tensors are indexed by rank (`transport.flush_moves` / `fetch_moves`).
Move = tuple[int, int, TransferPlan]


def plans_between(
    srcs: Sequence[KVLayout],
    src_blocks: Sequence[int],
    dsts: Sequence[KVLayout],
    dst_blocks: Sequence[int],
    start: int,
    end: int,
    layers: range | None = None,
) -> list[Move]:
    """Plans moving tokens [start, end) from one instance's rank pools to another's.

    `srcs` and `dsts` are the layouts of each instance's ranks (one pool a rank; every rank
    of an instance indexes its pool by the instance's one block table). Returns `(source
    rank, destination rank, plan)` for every pair that shares layers and KV heads: each
    sending rank sends only its own shard and each receiving rank takes exactly the heads
    and layers it holds, from whichever ranks hold them - nothing is gathered in one place.
    Token runs are computed once (they depend on the block tables only).

    Raises LayoutMismatchError when head_dim differs, a block table does not fit, or the
    sources' pools (which never overlap) do not hold every layer (within `layers`) and KV
    head of a destination rank, naming the layouts.
    """
    if not srcs or not dsts:
        raise ValueError("plans_between needs at least one source and one destination pool")
    a, b = srcs[0].head_dim, dsts[0].head_dim
    if any(x.head_dim != a for x in srcs) or any(x.head_dim != b for x in dsts) or a != b:
        raise LayoutMismatchError(
            f"head_dim differs: source has {sorted({x.head_dim for x in srcs})}, "
            f"destination has {sorted({x.head_dim for x in dsts})}"
        )
    check_range(start, end)
    for side, pools, blocks in (("source", srcs, src_blocks), ("destination", dsts, dst_blocks)):
        check_table(side, blocks, pools[0].block_size, end)
        for pool in pools:
            _check_block_ids(side, pool, blocks, start, end)
    runs = plan_runs(src_blocks, srcs[0].block_size, dst_blocks, dsts[0].block_size, start, end)
    coalesced = tuple((r.src_slot, r.dst_slot, r.num_tokens) for r in runs)
    out: list[Move] = []
    for d, dst in enumerate(dsts):
        want = _clip(dst.layers, layers)
        covered = 0
        for s, src in enumerate(srcs):
            common = _clip(_intersect(src.layers, dst.layers), layers)
            heads = _intersect(src.kv_heads, dst.kv_heads)
            if common and heads:
                out.append((s, d, _plan(src, dst, common, heads, coalesced)))
                covered += len(common) * len(heads)
        if covered != len(want) * dst.num_kv_heads:
            held = "; ".join(f"rank {i}: {p.describe()}" for i, p in enumerate(srcs))
            raise LayoutMismatchError(
                f"destination rank {d} ({dst.describe()}) is not covered by the source's "
                f"ranks ({held})"
            )
    return out


def _intersect(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def _clip(have: range, layers: range | None) -> range:
    return have if layers is None else _intersect(have, layers)


def _common_heads(src: KVLayout, dst: KVLayout) -> range:
    heads = _intersect(src.kv_heads, dst.kv_heads)
    if not heads:
        raise LayoutMismatchError(
            f"no common KV heads: source holds [{src.kv_heads.start}, {src.kv_heads.stop}), "
            f"destination holds [{dst.kv_heads.start}, {dst.kv_heads.stop})"
        )
    return heads


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

    Raises ValueError for no plans, or plans whose layers, heads or token_bytes differ (they
    would not be one set of pieces between the same two pools)."""
    if not plans:
        raise ValueError("merge_plans needs at least one plan")
    first = plans[0]
    runs: list[tuple[int, int, int]] = []
    for plan in plans:
        if _pieces(plan) != _pieces(first):
            raise ValueError(
                "cannot merge plans of different layers, heads or token rows: "
                f"{_pieces(plan)} vs {_pieces(first)}"
            )
        for s, d, n in plan.runs:
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                ps, pd, pn = runs[-1]
                runs[-1] = (ps, pd, pn + n)
            else:
                runs.append((s, d, n))
    return msgspec.structs.replace(first, runs=tuple(runs))


def _pieces(plan: TransferPlan) -> tuple[object, ...]:
    """What the plan's pieces are a part of: its layers, heads and token row."""
    return (plan.src_layers, plan.dst_layers, plan.src_heads, plan.dst_heads, plan.token_bytes)
