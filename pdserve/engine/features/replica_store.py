"""`ReplicaStore`: the holder side of DéjàVu's KV replication (protocol/replica.py).

The holder keeps, per source instance, one host-memory region of the source's KV geometry
(`OpenReplicaStore`: a parallel source's ranks' layers and KV heads together), created
through this core's transfer link so the source can write into it with its transport. Contracts:

- Who writes: only the source writes its region, into blocks it allocates itself; the
  holder never writes a replica and reads one only to resume it (`take`), after the
  source is dead. The holder never allocates region blocks.
- What is recorded: `StoreReplicas` as relayed by the front end (request id -> blocks,
  num_tokens); a later record of a request replaces the earlier one. A record naming a
  block outside the region is refused (not acknowledged). A record sharing a block with
  another live replica of the same source means the source reused that block (the older
  request ended and its DropReplicas was lost or is late): the older replica's KV is
  overwritten, so it is forgotten.
- When records go: `DropReplicas` (no ids: all of that source's), a resume consuming one,
  a re-open with another layout (a new region; the old one stays mapped until `close`,
  the transport has no per-region release) and `close` (the link's transport releases
  the regions).

It is a participant of the core (engine/participant.py): it owns OpenReplicaStore,
StoreReplicas, DropReplicas and ResumeFromReplica, the last turning a replica into a
request's KV when its source died (`resume`).

Single-threaded: called from the step loop between steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdserve.engine.participant import CoreAccess, Handler, Participant
from pdserve.engine.request import Request
from pdserve.errors import EngineOverloadedError, InvalidRequestError
from pdserve.kv.block_pool import integrity_check
from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer import LayoutMismatchError, Region, apply_plan, plans_between
from pdserve.protocol.core import RequestRejected
from pdserve.protocol.replica import (
    DropReplicas,
    OpenReplicaStore,
    ReplicaBlocks,
    ReplicasStored,
    ReplicaStoreOpened,
    ResumeFromReplica,
    StoreReplicas,
)


@dataclass
class _SourceStore:
    """One source's region and the replicas recorded in it."""

    region: Region
    replicas: dict[str, ReplicaBlocks] = field(default_factory=dict)

    @property
    def layout(self) -> KVLayout:
        return self.region.handle.layout

    def fits(self, replica: ReplicaBlocks) -> bool:
        """The blocks lie within the region and cover `num_tokens`."""
        layout = self.layout
        in_range = all(0 <= b < layout.num_blocks for b in replica.blocks)
        covers = len(replica.blocks) * layout.block_size >= replica.num_tokens >= 0
        return in_range and covers

    def record(self, replica: ReplicaBlocks) -> None:
        """Record `replica`, forgetting older replicas that share a block with it."""
        blocks = set(replica.blocks)
        stale = [
            rid
            for rid, other in self.replicas.items()
            if rid != replica.request_id and not blocks.isdisjoint(other.blocks)
        ]
        for rid in stale:
            del self.replicas[rid]
        self.replicas[replica.request_id] = replica

    def block_ids(self) -> set[int]:
        return {b for r in self.replicas.values() for b in r.blocks}


class ReplicaStore(Participant):
    """Replica regions and records of every source this instance holds for."""

    def __init__(self, core: CoreAccess) -> None:
        self.core = core
        self.instance_name = core.config.instance_name
        self._stores: dict[str, _SourceStore] = {}
        self._opened = 0  # regions created (unique region names)

    # ---- counters ---------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return sum(len(s.replicas) for s in self._stores.values())

    @property
    def num_replica_blocks(self) -> int:
        """Distinct region blocks referenced by live replicas (all sources)."""
        return sum(len(s.block_ids()) for s in self._stores.values())

    @property
    def num_replicated_tokens(self) -> int:
        """Tokens the recorded replicas hold, summed (the front end keeps the same sum)."""
        return sum(r.num_tokens for s in self._stores.values() for r in s.replicas.values())

    def sources(self) -> list[str]:
        return list(self._stores)

    def stats(self) -> dict[str, int]:
        return {
            "num_replicas": self.num_replicas,
            "num_replica_blocks": self.num_replica_blocks,
            "num_replicated_tokens": self.num_replicated_tokens,
        }

    def handlers(self) -> Mapping[type, Handler]:
        return {
            OpenReplicaStore: self._on_open,
            StoreReplicas: self._on_store,
            DropReplicas: lambda msg: self.drop(msg.source, msg.request_ids),
            ResumeFromReplica: self._on_resume,
        }

    def _on_open(self, msg: OpenReplicaStore) -> None:
        self.core.post(ReplicaStoreOpened(msg.source, self.open(msg.source, msg.layout)))

    def _on_store(self, msg: StoreReplicas) -> None:
        """ReplicasStored: those recorded."""
        self.core.post(ReplicasStored(msg.source, self.store(msg.source, msg.replicas)))

    def _on_resume(self, msg: ResumeFromReplica) -> None:
        """Answered like an AddRequest: outputs, or RequestRejected."""
        rid = msg.request.request_id
        try:
            self.resume(msg)
        except InvalidRequestError as e:
            self.core.post(RequestRejected(rid, e.message, e.param))
        except EngineOverloadedError as e:
            self.core.post(RequestRejected(rid, str(e), None, overloaded=True))

    # ---- the messages -----------------------------------------------------------

    def open(self, source: str, layout: KVLayout) -> RegionHandle:
        """The region for `source`'s replicas: the existing one when its layout is
        `layout` (idempotent), else a new zeroed region (the old records are dropped)."""
        store = self._stores.get(source)
        if store is not None and store.layout == layout:
            return store.region.handle
        self._opened += 1
        suffix = "" if self._opened == 1 else f"-{self._opened}"
        name = f"{self.instance_name}-replica-{source}{suffix}"
        region = self.core.transfer_link().transport.create_region(name, layout)
        self._stores[source] = _SourceStore(region)
        return region.handle

    def store(self, source: str, replicas: Iterable[ReplicaBlocks]) -> list[ReplicaBlocks]:
        """Record `replicas` of `source`; returns those recorded (the acknowledgement).
        Nothing is recorded for a source without a region, or for a replica that does
        not fit the region."""
        store = self._stores.get(source)
        if store is None:
            return []
        recorded = [r for r in replicas if store.fits(r)]
        for replica in recorded:
            store.record(replica)
        return recorded

    def drop(self, source: str, request_ids: Iterable[str]) -> None:
        """Forget these replicas of `source`; an empty list forgets all of them."""
        store = self._stores.get(source)
        if store is None:
            return
        ids = list(request_ids)
        if not ids:
            store.replicas.clear()
        for rid in ids:
            store.replicas.pop(rid, None)

    def get(self, source: str, request_id: str) -> tuple[Region, ReplicaBlocks] | None:
        """The region and record of one replica, or None if unknown (it stays recorded)."""
        store = self._stores.get(source)
        if store is None:
            return None
        replica = store.replicas.get(request_id)
        return None if replica is None else (store.region, replica)

    # ---- resuming -----------------------------------------------------------------

    def resume(self, msg: ResumeFromReplica) -> Request:
        """Continue `msg.request` from its replica (DéjàVu §4.3). The replica's KV of the
        first `num_tokens` tokens (at most all tokens but the last) is copied into pool
        blocks (prefix-cache hits first), committed, and the request joins the batch:
        the next step computes the tokens after `num_tokens` and samples on. When the
        replica is unknown, shorter than `num_tokens` or unusable, or the pool or batch
        has no room, the request is recomputed instead, queued as `add_request` would.
        The replica is consumed either way. Raises like `add_request` (nothing changes)."""
        r = msg.request
        core = self.core
        args = (r.prompt_token_ids, r.params, r.arrival, r.output_token_ids)
        req = core.new_request(r.request_id, *args)
        req.prediction = r.prediction
        found = self.get(msg.source, msg.replica_id)
        if found is None or not self._place(req, *found, msg.num_tokens):
            core.queue(req)
        else:
            core.join_batch(req)
        self.drop(msg.source, [msg.replica_id])
        return req

    def _place(self, req: Request, region: Region, replica: ReplicaBlocks, num_tokens: int) -> bool:
        """Give `req` pool blocks holding its first `num_tokens` tokens' KV (from the
        prefix cache, then copied from the replica) and commit them. False, with nothing
        allocated, when that cannot be done."""
        kv = self.core.kv
        tokens = req.all_token_ids
        n = min(num_tokens, len(tokens) - 1)
        if n <= 0 or replica.num_tokens < n or not self.core.has_room():
            return False
        rid = req.request_id
        cached = kv.match_prefix(tokens).num_cached_tokens
        alloc = kv.allocate(rid, tokens, max(n - cached, 0))
        if alloc is None:
            return False
        cached = alloc.num_cached_tokens
        try:
            self._copy(rid, region, replica, cached, n)
        except LayoutMismatchError:
            kv.free(rid)
            return False
        done = max(n, cached)
        kv.commit(rid, tokens, done)
        req.num_computed_tokens = done
        req.num_cached_prompt_tokens = min(cached, len(req.prompt_token_ids))
        return True

    def _copy(
        self, request_id: str, region: Region, replica: ReplicaBlocks, start: int, end: int
    ) -> None:
        """Copy tokens [start, end) from the replica region into the request's blocks of
        every rank's pool, each taking its layers and KV heads (all are tensors of this
        process: a parallel instance's driver maps its workers' pools). LayoutMismatchError
        if the replica's table or geometry does not fit."""
        if end <= start:
            return
        link = self.core.transfer_link()  # open: the store's region came from it
        table = self.core.kv.block_table(request_id)
        moves = plans_between(
            [region.handle.layout], replica.blocks, link.layouts, table, start, end
        )
        for _, rank, plan in moves:
            apply_plan(plan, region.tensor, link.tensors[rank])

    # ---- integrity --------------------------------------------------------------

    def check_integrity(self) -> None:
        """AssertionError unless every recorded block lies within its region and no block
        belongs to two live replicas of one source."""
        for source, store in self._stores.items():
            seen: set[int] = set()
            for rid, replica in store.replicas.items():
                integrity_check(
                    store.fits(replica),
                    f"replica {rid!r} of {source!r} does not fit its region "
                    f"({store.layout.num_blocks} blocks): {replica.blocks}",
                )
                integrity_check(
                    seen.isdisjoint(replica.blocks),
                    f"replica {rid!r} of {source!r} shares blocks with another replica",
                )
                seen.update(replica.blocks)

    def close(self) -> None:
        """Forget every record; the link's transport releases the regions."""
        self._stores.clear()
