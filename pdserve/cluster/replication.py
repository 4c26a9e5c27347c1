"""Who replicates to whom, and whether a lost request resumes from its replica
(DéjàVu §4.2.3 and §4.3; the messages: protocol/replica.py; docs/fault-tolerance.md).

The ring: every live instance that decodes (decode instances, or colocated ones) is a
source; source i streams its KV to the next live source in the ring, i + 1 mod N. With a
single source the holder is another live instance of any role (a prefill instance keeps
the replicas in its host memory). The ring is recomputed when an instance dies: a source
whose holder died opens a store on its new holder and replicates from token 0 again.

The front end's part (`Replication`): it keeps every source pointed at its holder, relays
each completed write's records to the holder (only of requests the source still runs for
it), and tracks per request how far the holder acknowledged its replica (`Record.replica_*`);
recovery (cluster/recovery.py) takes that replica when the source dies (`take_replica`).

The cost rule that decides between a replica and recompute: cluster/costs.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.cluster.hub import Feature, Handler, Hub
from pdserve.cluster.instance import Instance
from pdserve.cluster.table import Record
from pdserve.config import Role
from pdserve.protocol.replica import (
    DropReplicas,
    KVReplicated,
    OpenReplicaStore,
    ReplicasStored,
    ReplicaStoreOpened,
    ReplicateTo,
    StoreReplicas,
)


def ring(sources: list[Instance], others: list[Instance]) -> dict[str, Instance]:
    """Holder of each live source: the next live source; a lone source's holder is the
    first live instance of `others` (none: it is not replicated)."""
    live = [s for s in sources if s.alive]
    if len(live) > 1:
        return {s.name: live[(i + 1) % len(live)] for i, s in enumerate(live)}
    spare = [o for o in others if o.alive]
    if live and spare:
        return {live[0].name: spare[0]}
    return {}


@dataclass(frozen=True)
class Replica:
    """A lost request's replicated KV: on `holder`, under `source`'s name and the key the
    source knew the request by, through `tokens` tokens."""

    holder: Instance
    source: str
    key: str
    tokens: int


def take_replica(rec: Record) -> Replica | None:
    """The live replica of `rec`'s KV, detached from the record (its source died: the
    holder consumes it on resume or drops it with the rest of the source's)."""
    holder, source, through = rec.replica_holder, rec.replica_source, rec.replicated
    rec.forget_replica()
    if holder is None or source is None or not holder.alive or through <= 0:
        return None
    return Replica(holder, source.name, rec.key, through)


class Replication(Feature):
    """DéjàVu's KV replication, as the front end arranges it (module docstring)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.enabled = hub.config.replicate
        self.holders: dict[str, Instance] = {}  # source name -> holder

    def handlers(self) -> Mapping[type, Handler]:
        return {
            ReplicaStoreOpened: self._on_store_opened,
            KVReplicated: self._on_replicated,
            ReplicasStored: self._on_replicas_stored,
        }

    def describe(self, inst: Instance) -> dict[str, object]:
        """Where `inst` replicates to, and the tokens the front end knows are replicated
        on it, summed (equal to its own `num_replicated_tokens` once messages in flight
        arrive)."""
        holder = self.holders.get(inst.name)
        held = sum(r.replicated for r in self.hub.table if r.replica_holder is inst)
        return {
            "replicating_to": holder.name if holder is not None else None,
            "replicated_tokens": held,
        }

    # ---- hooks ---------------------------------------------------------------------------

    def released(self, rec: Record, abort: bool) -> None:
        """The attempt ended or moves: its holder forgets the replica."""
        holder, source = rec.replica_holder, rec.replica_source
        rec.forget_replica()
        if holder is not None and source is not None and holder.alive:
            holder.send(DropReplicas(source.name, [rec.key]))

    def instance_dead(self, inst: Instance) -> None:
        """Replicas held by `inst` died with it (those of its own requests are taken by
        recovery as they move)."""
        for rec in self.hub.table:
            if rec.replica_holder is inst:
                rec.forget_replica()

    def instances_changed(self) -> None:
        """A dead source's holder drops its replicas (after the resumes that consumed
        some: they were sent first); then every live source is pointed at its holder."""
        for name, holder in list(self.holders.items()):
            source = self.hub.instance(name)
            if source is None or not source.alive:
                del self.holders[name]
                if holder.alive:
                    holder.send(DropReplicas(name, []))
        self._arrange()

    # ---- internals -----------------------------------------------------------------------

    def _arrange(self) -> None:
        """Point every live source at its holder in the ring (`ring`): a source whose
        holder is new gets a store opened there and replicates from token 0 (its requests'
        old replicas are forgotten); a source without one stops."""
        if not self.enabled or self.hub.closed:
            return
        sources, others = self._roles()
        wanted = ring(sources, others)
        for source in sources:
            if not source.alive:
                continue
            holder = wanted.get(source.name)
            old = self.holders.get(source.name)
            if holder is old:
                continue
            for rec in self.hub.table:
                if rec.replica_source is source:
                    rec.forget_replica()
            if old is not None and old.alive:
                old.send(DropReplicas(source.name, []))
            if holder is None:
                self.holders.pop(source.name, None)
                source.send(ReplicateTo("", None))
                continue
            self.holders[source.name] = holder
            assert source.kv_layout is not None
            holder.send(OpenReplicaStore(source.name, source.kv_layout))

    def _roles(self) -> tuple[list[Instance], list[Instance]]:
        """(sources: the instances that decode - decode and colocated ones -, others:
        where a lone source may replicate: the prefill instances)."""
        hub = self.hub
        return hub.of_role(Role.DECODE) + hub.of_role(Role.COLOCATED), hub.of_role(Role.PREFILL)

    def _on_store_opened(self, inst: Instance, msg: ReplicaStoreOpened) -> None:
        source = self.hub.instance(msg.source)
        if source is not None and source.alive and self.holders.get(msg.source) is inst:
            source.send(ReplicateTo(inst.name, msg.region))

    def _on_replicated(self, inst: Instance, msg: KVReplicated) -> None:
        """A source's write completed: relay the records of requests it still runs for us
        to the holder (others ended: their records must not reach the holder). A
        colocated source runs its requests as their prefill instance."""
        holder = self.holders.get(inst.name)
        if holder is None or holder.name != msg.holder or not holder.alive:
            return
        keep = []
        for replica in msg.replicas:
            rec = self.hub.table.get(replica.request_id)
            if rec is not None and rec.holds(inst):
                rec.replica_source, rec.replica_holder = inst, holder
                keep.append(replica)
        if keep:
            holder.send(StoreReplicas(inst.name, keep))

    def _on_replicas_stored(self, inst: Instance, msg: ReplicasStored) -> None:
        """The holder's acknowledgement: how far each request is replicated."""
        for replica in msg.replicas:
            rec = self.hub.table.get(replica.request_id)
            if rec is not None and rec.replica_holder is inst:
                rec.replicated = max(rec.replicated, replica.num_tokens)
