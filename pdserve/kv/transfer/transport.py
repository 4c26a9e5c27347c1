"""Flush/fetch: the transport interface that moves a plan's contiguous chunks between pools.

A `Transport` owns the regions it creates (`create_region`): KV pools that peers can read
(`fetch`: remote is the plan's source) and write (`flush`: remote is the plan's
destination). Peers name a region by its `RegionHandle`, plain data that travels in engine
messages. Implementations: `inproc` (same process, tests), `shm` (same host, one copy
between the two pools), `tcp` (any host, one stream per request); `FaultyTransport` wraps
any of them to inject failures, delays and corruption. This module imports none of them;
`factory.make_transport` builds one by name.

Concurrency: `fetch` and `flush` block the calling thread and may be called from several
threads at once. Nothing orders transfers against the pool's other users: the engines make
sure no one writes blocks a transfer reads, or reads blocks it writes, until it is done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import torch

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer.errors import LayoutMismatchError
from pdserve.kv.transfer.layout import layout_of
from pdserve.kv.transfer.plan import Move, TransferPlan


@dataclass(frozen=True, eq=False)
class Region:
    """A local KV pool that peers can read and write.

    Owned by the transport that created it: `Transport.close` withdraws it from peers (and
    unlinks its shared memory), but `tensor` stays valid for as long as it is referenced.
    """

    tensor: torch.Tensor  # the pool, shape handle.layout.shape
    handle: RegionHandle


class Transport(ABC):
    """Moves `TransferPlan`s between a local tensor and a peer's region (see module doc)."""

    kind: str

    @abstractmethod
    def create_region(self, name: str, layout: KVLayout) -> Region:
        """Allocate a zeroed pool that peers can reach; `name` is unique per transport."""

    @abstractmethod
    def fetch(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        """Pull: copy the plan's chunks from `remote` (plan source) into `local` (plan
        destination, a pool-shaped tensor). Blocks until done; thread-safe."""

    @abstractmethod
    def flush(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        """Push: copy the plan's chunks from `local` (plan source) into `remote` (plan
        destination). Blocks until the data is in the remote pool; thread-safe."""

    @abstractmethod
    def close(self) -> None:
        """Release the regions this transport created, stop its threads, close its
        connections. Idempotent; fetch/flush afterwards raise TransferError."""

    def routes(self) -> dict[str, int]:
        """Transfers sent per route so far: a transport that picks one per peer (auto)
        counts them; one with a single route returns {}."""
        return {}

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def flush_moves(
    transport: Transport,
    moves: Sequence[Move],
    local: Sequence[torch.Tensor],
    remote: Sequence[RegionHandle],
) -> None:
    """Push: each move's plan from this instance's rank pool `local[s]` into the peer's
    rank region `remote[d]`, one after the other."""
    for s, d, plan in moves:
        transport.flush(remote[d], plan, local[s])


def fetch_moves(
    transport: Transport,
    moves: Sequence[Move],
    remote: Sequence[RegionHandle],
    local: Sequence[torch.Tensor],
) -> None:
    """Pull: each move's plan from the peer's rank region `remote[s]` into this instance's
    rank pool `local[d]`, one after the other."""
    for s, d, plan in moves:
        transport.fetch(remote[s], plan, local[d])


def moves_nbytes(moves: Sequence[Move]) -> int:
    return sum(plan.nbytes for _, _, plan in moves)


def check_plan(plan: TransferPlan, src: KVLayout, dst: KVLayout, *, can_cast: bool = True) -> None:
    """LayoutMismatchError unless the plan's layers, heads and slots lie within both pools and
    the moved parts of a row match (and, without `can_cast`, the dtypes)."""
    if src.head_dim != dst.head_dim:
        raise LayoutMismatchError(
            f"head_dim differs: source has {src.head_dim}, destination has {dst.head_dim}"
        )
    if not can_cast and src.dtype != dst.dtype:
        raise LayoutMismatchError(
            f"dtype differs: source has {src.dtype}, destination has {dst.dtype} "
            "(this transport moves bytes and cannot cast)"
        )
    check_side(plan, "source", src)
    check_side(plan, "destination", dst)
    (s0, s1), (d0, d1) = plan.heads("source", src), plan.heads("destination", dst)
    if s1 - s0 != d1 - d0:
        raise LayoutMismatchError(
            f"the plan moves {s1 - s0} KV heads from the source and {d1 - d0} into the destination"
        )


def check_side(plan: TransferPlan, side: str, layout: KVLayout) -> None:
    """LayoutMismatchError unless the plan's `side` ("source" | "destination") layers, heads
    and slots lie within a pool of `layout`."""
    lo, hi = plan.src_layers if side == "source" else plan.dst_layers
    col = 0 if side == "source" else 1
    if not (0 <= lo <= hi <= layout.num_layers and hi - lo == plan.num_layers):
        raise LayoutMismatchError(
            f"plan layers [{lo}, {hi}) do not fit the {side} pool of {layout.num_layers} layers"
        )
    h0, h1 = plan.heads(side, layout)
    if not 0 <= h0 < h1 <= layout.num_kv_heads:
        raise LayoutMismatchError(
            f"plan KV heads [{h0}, {h1}) do not fit the {side} pool of "
            f"{layout.num_kv_heads} KV heads"
        )
    slot_lo = min((r[col] for r in plan.runs), default=0)
    slot_hi = max((r[col] + r[2] for r in plan.runs), default=0)
    if slot_lo < 0 or slot_hi > layout.num_slots:
        raise LayoutMismatchError(
            f"plan slots [{slot_lo}, {slot_hi}) do not fit the {side} pool of "
            f"{layout.num_slots} slots"
        )


def local_layout(tensor: torch.Tensor) -> KVLayout:
    """Layout of a local pool tensor (validates shape, dtype and contiguity)."""
    layout = layout_of(tensor)
    if not tensor.is_contiguous():
        raise LayoutMismatchError(f"a KV pool must be contiguous, got {tuple(tensor.shape)}")
    return layout
