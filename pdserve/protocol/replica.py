"""The replication protocol: DéjàVu's KV streaming to a peer, and resuming from it.

Every instance that decodes (the source) streams its running requests' KV, as it is
computed, into a replica store that another instance (the holder) keeps in host memory
for it. The front end relays every message; the KV itself moves over the transport.

    OpenReplicaStore(source, layout)   front end -> holder: make a region for `source`
    ReplicaStoreOpened(source, region) holder -> front end
    ReplicateTo(holder, region)        front end -> source: stream into that region
                                       (region None: stop; the old holder is gone)
    KVReplicated(holder, replicas)     source -> front end, after each aggregated write
                                       completed: these requests' KV is in the region
                                       through `num_tokens` tokens
    StoreReplicas(source, replicas)    front end -> holder: record them (accounting)
    ReplicasStored(source, replicas)   holder -> front end: the acknowledgement; the
                                       front end's replicated-through figure per request
    DropReplicas(source, request_ids)  front end -> holder: the request ended or moved
    ResumeFromReplica(request, source, replica_id, num_tokens)
                                       front end -> holder: the source died; the replica
                                       becomes the request's KV, the tokens after
                                       `num_tokens` are recomputed, decoding continues

Ownership: the source is the only writer of its region and allocates the region's blocks
itself (no round trip per token); the holder only records what the source reported and
never reads a replica except to resume it, after the source is dead and fenced.
Ordering: the source reports a block reused by a new request only after the request that
held it ended, and the front end sends that request's DropReplicas before it relays the
new StoreReplicas (one socket each way, in order), so the holder never sees one block in
two live replicas.
"""

from __future__ import annotations

import msgspec

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.protocol.core import AddRequest


class ReplicaBlocks(msgspec.Struct, frozen=True, array_like=True):
    """One request's replica: its block table in the holder's region, covering the KV of
    tokens [0, num_tokens) of prompt + output."""

    request_id: str  # the id the source knows the request by
    blocks: list[int]
    num_tokens: int


# ---- front end -> holder ------------------------------------------------------------


class OpenReplicaStore(msgspec.Struct, frozen=True, tag=True):
    """Create (or keep) a host-memory region of `layout` for `source`'s replicas."""

    source: str  # instance name
    layout: KVLayout  # the source's pool geometry (`num_blocks`: the region's size)


class StoreReplicas(msgspec.Struct, frozen=True, tag=True):
    source: str
    replicas: list[ReplicaBlocks]


class DropReplicas(msgspec.Struct, frozen=True, tag=True):
    """Forget these requests' replicas; with no ids, every replica of `source` (the
    source is gone and nothing will resume from them, or it replicates elsewhere now)."""

    source: str
    request_ids: list[str]


class ResumeFromReplica(msgspec.Struct, frozen=True, tag=True):
    """`request` (a new id; its prompt and the tokens already streamed) continues here:
    the holder copies the replica's KV of the first `num_tokens` tokens into its pool,
    computes the rest and decodes on. The replica is consumed. Answered like an
    AddRequest (outputs, or RequestRejected)."""

    request: AddRequest
    source: str
    replica_id: str  # the request id the source used
    num_tokens: int


# ---- front end -> source -------------------------------------------------------------


class ReplicateTo(msgspec.Struct, frozen=True, tag=True):
    """Stream every running request's KV into `region` (held by `holder`), from token 0;
    None: stop replicating (forget every allocation in the old region)."""

    holder: str
    region: RegionHandle | None


# ---- instance -> front end -------------------------------------------------------------


class ReplicaStoreOpened(msgspec.Struct, frozen=True, tag=True):
    source: str
    region: RegionHandle


class KVReplicated(msgspec.Struct, frozen=True, tag=True):
    """Source: these writes into `holder`'s region completed."""

    holder: str
    replicas: list[ReplicaBlocks]


class ReplicasStored(msgspec.Struct, frozen=True, tag=True):
    """Holder: these replicas are recorded (the acknowledgement)."""

    source: str
    replicas: list[ReplicaBlocks]
