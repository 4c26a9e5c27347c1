"""Instance flip: an instance changes role in place (TetriInfer §3.5; docs/elastic.md).

A prefill instance becomes a decode instance, or the reverse, without a new process or a
weight reload. The steps, each with what it costs:

1. **Leave the role.** The instance stops taking new work (`Instance.flipping_to`: the
   hub's `of_role` and `live` leave it out, so dispatch, recovery and the replication ring
   pass it by); the features hear `instances_changed`.
2. **Drain.** A prefill instance finishes the prompts it holds and hands their KV off as
   usual (a request parked on a copy into it is sent there when the copy ends). A decode
   instance does not wait for its requests to end: each one in the DECODE phase moves at
   once to another instance that decodes, *with its KV*: the flipping instance aborts it
   (its blocks stay in its prefix cache: a decode step indexes every full block), offers
   the full blocks of prompt + streamed tokens to the new instance (`OfferKind.MOVE`,
   cluster/cache_copies.py), and the continuation (recovery's: after its last streamed
   token, a seeded generator skipping the draws already taken) is parked until the copy
   commits - it then recomputes only the last partial block (a request with no whole
   block yet is sent on at once: it recomputes under a block). A request whose KV is still on
   its way in (HANDOFF) moves the moment it arrives (`KVReceived`). The move is a new
   attempt (`Record.drains`; neither a retry nor a migration); a failed copy only means
   the new instance computes more.
3. **Switch.** Once the front end's table holds nothing for the instance, `SwitchRole`;
   the instance replaces its role object as soon as it is idle (protocol/role.py) and
   answers `RoleSwitched`.
4. **Take the new role.** The `Instance`'s role and config change, the router moves what
   the instance caches into its new role's prompt tree (a prefix it cached is a hit in the
   new role), the features hear `instances_changed`, and the flip's caller gets its
   report (`FlipReport`: drain time, the instance's wait, the switch itself).

An instance that leaves the cluster (a scale-in, cluster/scaling.py: `leave`) goes
through steps 1-3 the same way - so no request is lost or aborted - except that its
`SwitchRole` asks it only to answer once idle (`leave`: nothing it offered is still being
copied out of it); it then stays out of every role, and the caller shuts it down.

Colocated instances take part the same way: a disaggregated cluster's instance may become
colocated (dispatch then sends it requests to run whole when it holds no more than the
prefill and decode instances hold per instance: cluster/dispatch.py), and a colocated
cluster's instances
may become prefill or decode ones (once it has both, requests go through them too). A
colocated instance drains like a decode one: each request that has streamed its first
token moves with its KV; one still in its prompt moves once its first token came.

What a flip refuses (`ConflictError`, HTTP 409; nothing changes): an instance that is dead
or flipping already, a role it holds, and a flip after which the cluster could not run a
request the usual way - no live colocated instance, and no live prefill and decode pair
(the last prefill instance of a disaggregated cluster, say). An unknown name is
`NotFoundError` (404).

Faults: an instance that dies mid-flip fails the flip (`InstanceFailedError`) and is
handled like any death (recovery moves what it held). A flip that has not switched within
`ClusterConfig.flip_timeout_s` is given up: the instance is asked to keep its old role
(a `SwitchRole` to it cancels the waiting one) and serves in it again once it answers.

Single-threaded: the controller's event loop runs every method.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.cluster.cache_copies import CacheCopies
from pdserve.cluster.config import role_scheduler
from pdserve.cluster.hub import Feature, Handler, Hub
from pdserve.cluster.instance import Instance
from pdserve.cluster.recovery import Recovery
from pdserve.cluster.routing import Router
from pdserve.cluster.table import Phase, Record
from pdserve.config import Role
from pdserve.errors import ConflictError, InstanceFailedError, NotFoundError
from pdserve.protocol.cache import OfferKind
from pdserve.protocol.handoff import KVReceived
from pdserve.protocol.role import RoleSwitched, SwitchRole

log = logging.getLogger("pdserve.flip")


@dataclass(frozen=True)
class FlipReport:
    """One finished flip, as `POST /admin/instances/{name}/role` answers it."""

    instance: str
    previous_role: Role
    role: Role
    moved: int  # requests moved off the instance (a decode drain)
    copied: int  # of those, the ones whose KV was copied (the rest had no whole block)
    drain_s: float  # from the flip's start until the front end held nothing there
    waited_s: float  # then, until the instance itself was idle (copies, pins)
    switch_s: float  # replacing the role object: the flip itself (TetriInfer: 5-7 ms)
    total_s: float  # from the start until the front end read RoleSwitched

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass
class _Flip:
    inst: Instance
    previous: Role
    role: Role  # where it goes
    started: float  # monotonic
    done: asyncio.Future[FlipReport]
    switch_id: int | None = None  # the SwitchRole sent (None: still draining)
    drained: float = 0.0  # monotonic: when the table held nothing for it
    moved: int = 0
    copied: int = 0
    cancelled: bool = False
    leaving: bool = False  # the instance leaves the cluster once drained (`Flip.leave`)


class Flip(Feature):
    """Flips in flight, one per instance (the module docstring)."""

    def __init__(self, hub: Hub, router: Router, copies: CacheCopies, recovery: Recovery) -> None:
        self.hub = hub
        self.router = router  # its prompt trees follow an instance's role
        self.copies = copies  # the KV of a drained decode instance's requests moves here
        self.recovery = recovery  # where a moved request continues, and how
        self._flips: dict[str, _Flip] = {}  # by instance name
        self._ids = itertools.count(1)
        self.reports: list[FlipReport] = []  # every finished flip (not a leave), oldest
        self._soon = False  # an `_advance_all` is scheduled

    def handlers(self) -> Mapping[type, Handler]:
        return {RoleSwitched: self._on_switched, KVReceived: self._on_received}

    # ---- the operator's call ---------------------------------------------------------

    async def flip(self, name: str, role: Role) -> FlipReport:
        """Flip instance `name` to `role` and return when it serves in it (the module
        docstring: the steps, what is refused, faults). The flip goes on if the caller
        stops waiting."""
        inst = self._check(name, role)
        return await self._start(inst, role, leaving=False)

    async def leave(self, name: str) -> FlipReport:
        """Drain instance `name` for good (module docstring) and return once it holds
        nothing: it then takes no work in any role, and the caller shuts it down. Refused
        like a flip: unknown, dead, flipping, or its role's last live instance."""
        inst = self._leaving(name)
        return await self._start(inst, inst.role, leaving=True)

    async def _start(self, inst: Instance, role: Role, leaving: bool) -> FlipReport:
        done: asyncio.Future[FlipReport] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieve)  # a caller that left does not leave it unread
        flip = _Flip(inst, inst.role, role, time.monotonic(), done, leaving=leaving)
        self._flips[inst.name] = flip
        inst.flipping_to = role
        goal = "leaving the cluster" if leaving else f"{inst.role} -> {role}"
        log.info("flip of %s: %s, draining", inst.name, goal)
        self.hub.instances_changed()
        self._advance(flip)
        return await asyncio.shield(flip.done)

    def _leaving(self, name: str, role: Role | None = None) -> Instance:
        """Instance `name`, which may leave its role for `role` (None: the cluster)."""
        hub = self.hub
        inst = hub.instance(name)
        if inst is None:
            names = ", ".join(i.name for i in hub.instances)
            raise NotFoundError(f"no instance named {name!r} (the instances: {names})")
        if not inst.alive:
            raise ConflictError(f"{name} is dead: {inst.dead}")
        if name in self._flips:
            raise ConflictError(f"{name} is flipping already (to {self._flips[name].role})")
        if not self._serves_after(inst, role):
            needs = (
                "one" if inst.role is not Role.COLOCATED else "one, or a prefill and a decode one"
            )
            raise ConflictError(
                f"{name} is the last live {inst.role} instance: the cluster needs {needs}"
            )
        return inst

    def _serves_after(self, inst: Instance, role: Role | None) -> bool:
        """Once `inst` holds `role` (None: has left), the live instances can still run a
        request the usual way: a colocated one, or a prefill and a decode one."""
        roles = {
            i.role
            for i in self.hub.instances
            if i is not inst and i.alive and i.flipping_to is None
        }
        if role is not None:
            roles.add(role)
        return Role.COLOCATED in roles or {Role.PREFILL, Role.DECODE} <= roles

    def _check(self, name: str, role: Role) -> Instance:
        inst = self._leaving(name, role)
        if inst.role is role:
            raise ConflictError(f"{name} is a {role} instance already")
        return inst

    # ---- hooks ---------------------------------------------------------------------------

    def released(self, rec: Record, abort: bool) -> None:
        """An attempt let go of its instances: a drain may be complete (checked once this
        call's caller is done with the record)."""
        if self._flips and not self._soon:
            self._soon = True
            asyncio.get_running_loop().call_soon(self._advance_all)

    def _on_received(self, inst: Instance, msg: KVReceived) -> None:
        """A request's KV arrived at a decode instance that flips: it moves on now."""
        flip = self._flips.get(inst.name)
        if flip is not None and flip.inst is inst:
            self._advance(flip)

    def tick(self, now: float) -> None:
        for flip in list(self._flips.values()):
            if not flip.cancelled and now - flip.started > self.hub.config.flip_timeout_s:
                self._give_up(flip)
            else:
                self._advance(flip)

    def instance_dead(self, inst: Instance) -> None:
        """A flip in flight ends with the instance (recovery moves what it held)."""
        flip = self._flips.pop(inst.name, None)
        if flip is None or flip.inst is not inst:
            return
        inst.flipping_to = None
        if not flip.done.done():
            why = f"{inst.name} died while flipping to {flip.role}: {inst.dead}"
            flip.done.set_exception(InstanceFailedError(why))

    async def close(self) -> None:
        for flip in self._flips.values():
            if not flip.done.done():
                flip.done.set_exception(InstanceFailedError("the server is shutting down"))
        self._flips.clear()

    # ---- draining ------------------------------------------------------------------------

    def _advance_all(self) -> None:
        self._soon = False
        for flip in list(self._flips.values()):
            self._advance(flip)

    def _advance(self, flip: _Flip) -> None:
        """Move what can move; once nothing is held for the instance, ask it to switch."""
        if flip.switch_id is not None or flip.cancelled:
            return
        held = False  # something stays: a prompt, KV on its way in
        for rec in self.hub.table.holding(flip.inst):
            if _decoding_on(rec, flip.inst):
                self._move(rec, flip)
            held |= rec.holds(flip.inst)
        if held:
            return
        flip.drained = time.monotonic()
        self._send_switch(flip, flip.role, flip.leaving)

    def _move(self, rec: Record, flip: _Flip) -> None:
        """Continue `rec` on another instance that decodes, its KV copied there first."""
        source = flip.inst
        tokens = [*rec.prompt, *rec.streamed]
        self.hub.release(rec, abort=True)  # the source frees it; its blocks stay cached
        self.hub.table.next_attempt(rec, migration=False, drain=True)
        dest = self.recovery.continuation_instance(rec)
        if dest is None:
            self.hub.fail(rec, InstanceFailedError("no live instance to continue the request on"))
            return
        request = self.recovery.continue_on(rec, dest)
        rec.recompute = len(tokens) - 1  # counted against what the copy brings (recovery)
        flip.moved += 1
        if (len(tokens) - 1) // self.hub.engine.cache.block_size == 0:
            dest.send(request)  # no whole block computed yet: nothing to copy
            return
        rec.phase = Phase.WAITING_FOR_KV
        self.copies.prefetch(rec.key, source, dest, tokens, request, OfferKind.MOVE)
        flip.copied += 1

    # ---- switching -----------------------------------------------------------------------

    def _send_switch(self, flip: _Flip, role: Role, leave: bool = False) -> None:
        flip.switch_id = next(self._ids)
        scheduler = role_scheduler(self.hub.config, self.hub.engine, role)
        tokens = scheduler.max_num_batched_tokens
        flip.inst.send(SwitchRole(flip.switch_id, role, tokens, leave))

    def _give_up(self, flip: _Flip) -> None:
        """Past `flip_timeout_s`: the instance keeps its old role (module docstring)."""
        inst, held = flip.inst, len(self.hub.table.holding(flip.inst))
        why = (
            f"the flip of {inst.name} to {flip.role} did not finish within "
            f"{self.hub.config.flip_timeout_s:g} s ({held} requests still held there); "
            f"it serves as {flip.previous} again"
        )
        log.warning("%s", why)
        flip.cancelled = True
        flip.done.set_exception(InstanceFailedError(why))
        if flip.switch_id is None:
            self._end(flip, flip.previous)
        else:  # a switch was asked for: cancel it, and wait for the answer
            self._send_switch(flip, flip.previous)

    def _on_switched(self, inst: Instance, msg: RoleSwitched) -> None:
        flip = self._flips.get(inst.name)
        if flip is None or flip.inst is not inst or msg.flip_id != flip.switch_id:
            return  # a replaced switch: never answered, or answered for nobody
        if flip.leaving and not flip.cancelled and msg.error is None:
            del self._flips[inst.name]  # it stays out of every role: the caller shuts it down
        else:
            self._end(flip, msg.role)
        if flip.done.done():
            return  # given up; the instance is back in its old role
        if msg.error is not None:
            flip.done.set_exception(ConflictError(f"{inst.name} refused: {msg.error}"))
            return
        now = time.monotonic()
        report = FlipReport(
            inst.name,
            flip.previous,
            msg.role,
            flip.moved,
            flip.copied,
            flip.drained - flip.started,
            msg.waited_s,
            msg.switch_s,
            now - flip.started,
        )
        if not flip.leaving:
            self.reports.append(report)
        log.info("flip of %s done: %s", inst.name, report)
        flip.done.set_result(report)

    def _end(self, flip: _Flip, role: Role) -> None:
        """The instance holds `role` now and takes work in it."""
        inst = flip.inst
        del self._flips[inst.name]
        old, inst.role, inst.flipping_to = inst.role, role, None
        scheduler = role_scheduler(self.hub.config, self.hub.engine, role)
        inst.config = dataclasses.replace(inst.config, role=role, scheduler=scheduler)
        if old is not role:
            self.router.role_changed(inst, old)
        self.hub.instances_changed()


def _decoding_on(rec: Record, inst: Instance) -> bool:
    """`rec` is generating tokens on `inst`: it decodes there, or `inst` is colocated and
    has streamed its first token (a colocated instance runs a request as its prefill
    instance from the prompt to the end)."""
    if rec.decode is inst:
        return rec.phase is Phase.DECODE
    return (
        rec.prefill is inst
        and inst.role is Role.COLOCATED
        and rec.phase is Phase.PREFILL
        and bool(rec.streamed)
    )


def _retrieve(done: asyncio.Future[FlipReport]) -> None:
    if not done.cancelled():
        done.exception()
