"""Scaling: instances added to and removed from a running cluster (docs/elastic.md).

`add(role)` starts one more instance of `role`: named `{role}-{k}` with the first `k` no
instance of this server has had, the start's even share of the threads
(`even_threads`) and the role's settings (`instance_config`). The launcher is asked
first whether it fits (`Launcher.room`: free cores here; a node with the actor's request
free on a Ray cluster, where Ray then places it). It starts like any instance - its
process, the model, the handshake - and joins the hub (`Hub.admit`) once ready: the next
dispatch may send it work. A start that fails leaves the cluster as it was.

`remove(name)` takes one out through the flip's drain (cluster/flip.py `Flip.leave`):
no new work goes to it, a decode instance's requests move to other decode instances
with their KV, a prefill instance finishes the prompts it holds, and once it holds
nothing the hub forgets it (`Hub.retire`; the router drops its prompt tree) and its
process is shut down. No request is aborted or recomputed from its prompt.

Any role may be added to any cluster (dispatch mixes colocated instances with prefill
and decode ones: cluster/dispatch.py). Refused (`ConflictError`, HTTP 409; nothing
changes): a server of one engine (its failure semantics are a lone engine's: nothing to
fail over to); no room for the instance; for a removal, one after which the cluster could
not run a request the usual way (cluster/flip.py), one that flips or is dead. An unknown
name is `NotFoundError` (404); a start that fails, `InstanceFailedError` (503) with the
instance's own message.

Single-threaded: the controller's event loop runs every method.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

from pdserve.cluster.config import even_threads, instance_config
from pdserve.cluster.flip import Flip
from pdserve.cluster.hub import Feature, Hub
from pdserve.cluster.instance import layout_conflict
from pdserve.cluster.routing import Router
from pdserve.config import Role
from pdserve.errors import ConflictError, EngineDeadError, InstanceFailedError

log = logging.getLogger("pdserve.scaling")

_START_TIMEOUT_S = 600.0  # an instance's start (a Ray actor may wait for a node first)


@dataclass(frozen=True)
class ScaleReport:
    """One instance added or removed, as `POST /admin/instances` and `DELETE
    /admin/instances/{name}` answer it."""

    action: str  # "add" | "remove"
    instance: str
    role: Role
    node: str  # where its process ran
    seconds: float  # from the call until it served (add) or its process was gone (remove)
    moved: int = 0  # remove: requests moved off it with their KV (a decode instance)
    drain_s: float = 0.0  # remove: until the front end held nothing there

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class Scaling(Feature):
    """Adds and removes instances (module docstring); `reports`: every one done."""

    def __init__(self, hub: Hub, router: Router, flip: Flip) -> None:
        self.hub = hub
        self.router = router  # a removed instance's prompt tree goes
        self.flip = flip  # a removal drains through it
        self.reports: list[ScaleReport] = []
        self._names = {i.name for i in hub.instances}  # every name given, starting ones too

    def instances_changed(self) -> None:
        self._names |= {i.name for i in self.hub.instances}

    async def add(self, role: Role) -> ScaleReport:
        """Start one more `role` instance; return once it serves (module docstring)."""
        hub, t0 = self.hub, time.monotonic()
        self._check_role(role)
        name = self._new_name(role)
        base = hub.instances[0].config
        config = instance_config(
            hub.config, hub.engine, role, name, even_threads(hub.config, hub.engine)
        )
        config = dataclasses.replace(config, stop_token_ids=base.stop_token_ids)
        running = [i.config for i in hub.instances if i.alive]
        why = await asyncio.to_thread(hub.launcher.room, config, running)
        if why is not None:
            self._names.discard(name)
            raise ConflictError(f"no room for another {role} instance: {why}")
        inst = hub.new_instance(config)
        log.info("starting %s (%s)", name, role)
        try:
            await inst.start(_START_TIMEOUT_S)
        except EngineDeadError as e:
            raise InstanceFailedError(f"{name} did not start: {e}") from None
        if hub.closed:
            await inst.shutdown()
            raise InstanceFailedError("the server is shutting down")
        if why := layout_conflict(inst, hub.instances):
            await inst.shutdown()
            raise InstanceFailedError(f"{name} refused: {why}")
        hub.admit(inst)
        report = ScaleReport("add", name, role, inst.node, time.monotonic() - t0)
        return self._done(report)

    async def remove(self, name: str) -> ScaleReport:
        """Drain instance `name` and stop it; return once its process is gone."""
        t0 = time.monotonic()
        if self.hub.config.num_instances == 1:
            raise ConflictError(self._one_engine())
        drained = await self.flip.leave(name)
        inst = self.hub.instance(name)
        assert inst is not None
        self.router.forget(inst)
        self.hub.retire(inst)
        await inst.shutdown()
        report = ScaleReport(
            "remove",
            name,
            drained.previous_role,
            inst.node,
            time.monotonic() - t0,
            drained.moved,
            drained.drain_s,
        )
        return self._done(report)

    def _done(self, report: ScaleReport) -> ScaleReport:
        self.reports.append(report)
        log.info("%s", report)
        return report

    def _check_role(self, role: Role) -> None:
        if self.hub.config.num_instances == 1:
            raise ConflictError(self._one_engine())

    @staticmethod
    def _one_engine() -> str:
        return (
            "a server of one engine does not scale (nothing serves while its instance "
            "changes): start two instances or more (--colocated K, --prefill/--decode)"
        )

    def _new_name(self, role: Role) -> str:
        k = 0
        while f"{role.value}-{k}" in self._names:
            k += 1
        name = f"{role.value}-{k}"
        self._names.add(name)
        return name
