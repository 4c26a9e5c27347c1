"""`Replicator`: the source side of DéjàVu's KV replication (§4.2.3; protocol/replica.py).

After `ReplicateTo(holder, region)` the core streams the KV of its running requests into
the holder's region as it is computed, off the step loop:

- Blocks: the replicator alone allocates the region's blocks (`layout.num_blocks` blocks
  of `layout.block_size` tokens; a free list, no round trip per token). Each replicated
  request has a block list, grown as its tokens are computed; when the region is full a
  request simply is not replicated further this step (it is retried every step).
- Writes: after every step (`step_ended`, once the scheduler committed it) the new KV of
  every RUNNING request, tokens [written, num_computed_tokens), is gathered synchronously
  into ONE contiguous buffer (a few tokens per request; one a rank for a parallel
  instance, each its layers and KV heads), and ONE background task on the core link's
  `TransferWorker` flushes that buffer into the region with ONE transport `flush` (the
  per-request plans merged; a flush a rank, each into its part of the region's whole
  geometry). Only one write is in flight: while it runs,
  later steps' tokens wait and are included in the next write (the buffer always covers
  [written, computed)). The step loop never waits for a write, except at `close`.
- Reports: `poll` (between steps) finds the write done and sends `KVReplicated` with the
  figures of that write, for requests still replicated; after a FAILED write (transport
  error, injected fault) nothing is sent and the same tokens are written again next time.
- Freeing and the reuse contract: a request that ends (finished, aborted, or leaving the
  batch) frees its region blocks at once (`request_ended`), during the step that ends it.
  A freed block may be handed to another request by that same step's `step_ended`, but
  the write into it is reported only by a LATER `poll` - after the step's outputs, among
  them the ended request's final output, were sent (the process loop sends a step's
  OutputBatch when `step` returns; an abort is answered at once). The front end therefore
  sends the ended request's DropReplicas before it relays the StoreReplicas naming the
  reused block, and the holder never sees a block in two live replicas. The one write in
  flight may still carry the ended request's tokens; `poll` reports only requests that
  are still replicated, so the ended request is never reported after its end.
- `ReplicateTo(None)` or to another region forgets every allocation; a write still in
  flight for the old region completes unreported.

It is a participant of the core (engine/participant.py): it owns ReplicateTo, writes at
`step_ended`, frees at `request_ended`, reports at `poll`, and wants every step while it
replicates (a decode burst would commit several steps' KV at once).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from pdserve.engine.participant import Admissible, Handler, Participant
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.roles.transfer import TransferLink
from pdserve.kv.layout import KVLayout, RegionHandle, whole_layout
from pdserve.kv.manager import KVManager
from pdserve.kv.transfer import (
    TransferPlan,
    TransferState,
    TransferTask,
    gather_many,
    merge_plans,
    shared_plan,
)
from pdserve.kv.transfer.plan import check_table, runs_between, token_slots
from pdserve.protocol.replica import KVReplicated, ReplicaBlocks, ReplicateTo
from pdserve.protocol.wire import EngineMessage

# Geometry the region must share with the pool (its block size and count may differ).
_SAME_GEOMETRY = ("num_layers", "first_layer", "num_kv_heads", "head_dim", "dtype")


@dataclass
class _Replica:
    """One request's replica in the holder's region."""

    blocks: list[int] = field(default_factory=list)  # region block ids, in token order
    written: int = 0  # tokens whose KV is in the region (acknowledged writes)


@dataclass(frozen=True)
class _Piece:
    """Tokens [start, end) of one request in one write."""

    request_id: str
    replica: _Replica
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class _Write:
    """The write in flight: its task, what it carries and which region it targets."""

    task: TransferTask
    pieces: list[_Piece]
    epoch: int


@dataclass(frozen=True)
class _Target:
    holder: str
    region: RegionHandle
    link: TransferLink


class Replicator(Participant):
    """Streams running requests' KV into a holder's region (see the module doc).
    Single-threaded like the step loop; only the flush runs on the link's worker."""

    def __init__(
        self,
        kv: KVManager,
        link: Callable[[], TransferLink],
        send: Callable[[EngineMessage], None],
        timeout_s: float,
    ) -> None:
        self.kv = kv
        self._link = link  # the core's transfer link, opened on first use
        self.send = send
        self.timeout_s = timeout_s
        self._target: _Target | None = None
        self._replicas: dict[str, _Replica] = {}
        self._free: list[int] = []  # region blocks; pop() takes the lowest id first
        self._write: _Write | None = None
        self._epoch = 0  # bumped whenever the target changes

    # ---- state ------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._target is not None

    @property
    def holder(self) -> str | None:
        return None if self._target is None else self._target.holder

    @property
    def num_replicating(self) -> int:
        """Requests holding blocks in the region."""
        return len(self._replicas)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def busy(self) -> bool:
        """A write is in flight (the loop should poll again soon)."""
        return self._write is not None

    @property
    def wants_every_step(self) -> bool:
        return self.active

    def stats(self) -> dict[str, int]:
        return {"num_replicating": self.num_replicating}

    def handlers(self) -> Mapping[type, Handler]:
        return {ReplicateTo: self.replicate_to}

    def replicate_to(self, msg: ReplicateTo) -> None:
        """Stream running requests' KV into `msg.region` (None: stop). A region this pool
        cannot fill is the front end's mistake, not the engine's failure: said on stderr,
        and this instance does not replicate (nothing changes)."""
        if msg.region is None:
            self.stop()
            return
        try:
            self.start(msg.holder, msg.region, self._link())
        except ValueError as e:
            print(f"pdserve: not replicating to {msg.holder}: {e}", file=sys.stderr)

    # ---- ReplicateTo ------------------------------------------------------------

    def start(self, holder: str, region: RegionHandle, link: TransferLink) -> None:
        """Replicate into `region` from token 0 of every running request. ValueError
        (and nothing changes) when the region's geometry is not the instance's pools'
        together (`whole_layout`: a parallel instance's ranks each hold a shard)."""
        self._check_geometry(region.layout, whole_layout(link.layouts))
        self.stop()
        self._target = _Target(holder, region, link)
        self._free = list(range(region.layout.num_blocks - 1, -1, -1))

    def stop(self) -> None:
        """Stop replicating; forget every allocation (a write in flight goes unreported)."""
        self._epoch += 1
        self._target = None
        self._replicas.clear()
        self._free = []

    @staticmethod
    def _check_geometry(region: KVLayout, pool: KVLayout) -> None:
        for name in _SAME_GEOMETRY:
            if getattr(region, name) != getattr(pool, name):
                raise ValueError(
                    f"replica region {name} is {getattr(region, name)}, "
                    f"the pool's is {getattr(pool, name)}"
                )

    # ---- requests ---------------------------------------------------------------

    def request_ended(self, req: Request, status: RequestStatus | None) -> None:
        """`req` finished, was aborted or left the batch: free its region blocks (see the
        module doc for why they may be reused at once)."""
        replica = self._replicas.pop(req.request_id, None)
        if replica is not None:
            self._free.extend(reversed(replica.blocks))

    # ---- the step loop ----------------------------------------------------------

    def step_ended(self, running: Sequence[Request]) -> None:
        """Start one write of every running request's new KV, unless one is in flight."""
        if self._target is None or self._write is not None:
            return
        pieces = [p for p in map(self._piece, running) if p is not None]
        if pieces:
            self._write = self._submit(self._target, pieces)

    def poll(self, free_seq_slots: int, admissible: Admissible) -> list[Request]:
        """Report the write in flight once it completed (nothing after a failure)."""
        self._report()
        return []

    def _report(self) -> None:
        write = self._write
        if write is None or write.task.poll() not in (TransferState.DONE, TransferState.FAILED):
            return
        self._write = None
        if write.epoch != self._epoch or write.task.state is TransferState.FAILED:
            return  # an old target's write, or tokens to write again next time
        reports = [self._acknowledge(p) for p in write.pieces if self._is_live(p)]
        if reports and self._target is not None:
            self.send(KVReplicated(self._target.holder, reports))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the write in flight (if any) completed, or `timeout_s` passed;
        True when none is in flight any more (`poll` then reports it). Shutdown and
        tests only: the step loop never waits."""
        write = self._write
        if write is None:
            return True
        return write.task.wait(timeout_s) in (TransferState.DONE, TransferState.FAILED)

    def close(self) -> None:
        """Shutdown: wait for the write in flight (it reads only its own buffer)."""
        self.wait(self.timeout_s)

    # ---- internals ----------------------------------------------------------------

    def _piece(self, req: Request) -> _Piece | None:
        """`req`'s tokens to write now, growing its block list; None if nothing to write."""
        if req.status is not RequestStatus.RUNNING:
            return None
        rid = req.request_id
        replica = self._replicas.get(rid)
        if replica is None:
            replica = self._replicas[rid] = _Replica()
        end = self._grow(replica, req.num_computed_tokens)
        if end <= replica.written:
            return None
        return _Piece(rid, replica, replica.written, end)

    def _grow(self, replica: _Replica, num_tokens: int) -> int:
        """Give `replica` blocks for `num_tokens` tokens, as far as the free list allows;
        returns the tokens its blocks cover (at most `num_tokens`)."""
        assert self._target is not None
        bs = self._target.region.layout.block_size
        need = -(-num_tokens // bs) - len(replica.blocks)
        while need > 0 and self._free:
            replica.blocks.append(self._free.pop())
            need -= 1
        return min(num_tokens, len(replica.blocks) * bs)

    def _is_live(self, piece: _Piece) -> bool:
        return self._replicas.get(piece.request_id) is piece.replica

    def _acknowledge(self, piece: _Piece) -> ReplicaBlocks:
        assert self._target is not None
        replica = piece.replica
        replica.written = max(replica.written, piece.end)
        bs = self._target.region.layout.block_size
        blocks = replica.blocks[: -(-replica.written // bs)]
        return ReplicaBlocks(piece.request_id, blocks, replica.written)

    def _submit(self, target: _Target, pieces: list[_Piece]) -> _Write:
        """Gather the pieces into one buffer a rank now (each rank's pool holds its layers
        and KV heads: the driver's alone for an instance of one rank); flush them in one
        background call, each into its layers and heads of the region."""
        link = target.link
        tables = [(self.kv.block_table(p.request_id), p.start, p.end) for p in pieces]
        flushes = []
        for layout, tensor in zip(link.layouts, link.tensors, strict=True):
            buf = gather_many(tensor, layout, tables).cpu()
            buf_layout = buffer_layout(layout, buf.shape[2])
            plan = self._plan(pieces, target.region.layout, buf_layout)
            flushes.append((plan, buf.view(buf_layout.shape)))
        transport, region = link.transport, target.region

        def flush() -> None:
            for plan, pool in flushes:
                transport.flush(region, plan, pool)

        nbytes = sum(plan.nbytes for plan, _ in flushes)
        task = link.worker.submit(flush, nbytes=nbytes, deadline_s=self.timeout_s)
        return _Write(task, pieces, self._epoch)

    @staticmethod
    def _plan(pieces: list[_Piece], region: KVLayout, buf: KVLayout) -> TransferPlan:
        """Buffer rows (the pieces one after another) -> the replicas' region slots."""
        plans = []
        offset = 0
        for p in pieces:
            plans.append(buffer_plan(buf, offset, region, p.replica.blocks, p.start, p.end))
            offset += p.num_tokens
        return merge_plans(plans)


def buffer_layout(pool: KVLayout, num_tokens: int) -> KVLayout:
    """The layout of a buffer of `num_tokens` tokens gathered from `pool`: its layers and
    KV heads, one token per block."""
    return msgspec.structs.replace(pool, num_blocks=max(num_tokens, 1), block_size=1)


def buffer_plan(
    buf: KVLayout, offset: int, dst: KVLayout, dst_blocks: Sequence[int], start: int, end: int
) -> TransferPlan:
    """Move buffer rows [offset, offset + end - start) into tokens [start, end) of the
    block table `dst_blocks` of a pool of layout `dst`: the buffer's layers and KV heads
    (all of them, or a rank's shard of a whole-model region)."""
    check_table("destination", dst_blocks, dst.block_size, end)
    src = np.arange(offset, offset + end - start, dtype=np.int64)
    runs = runs_between(src, token_slots(dst_blocks, dst.block_size, start, end))
    return shared_plan(buf, dst, [(r.src_slot, r.dst_slot, r.num_tokens) for r in runs])
