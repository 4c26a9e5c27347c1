"""What the front end reports about its instances: counters summed over them (/metrics),
per-instance rows (/debug/cluster), and the cluster as it sees it now (`pdserve cluster
status`). Read-only: nothing here changes an instance or a request."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdserve.cluster.hub import Feature
from pdserve.cluster.instance import Instance, Launcher
from pdserve.errors import EngineDeadError
from pdserve.protocol.core import EngineStats


async def summed_stats(
    instances: Sequence[Instance], check_integrity: bool, timeout: float
) -> EngineStats:
    """Counters summed over the live instances; integrity errors name the instance."""
    live = [i for i in instances if i.alive]
    if not live:
        raise EngineDeadError("no live instance")
    replies = await asyncio.gather(
        *(i.stats(check_integrity, timeout) for i in live), return_exceptions=True
    )
    totals: dict[str, int] = {}
    errors: list[str] = []
    for inst, reply in zip(live, replies, strict=True):
        if isinstance(reply, BaseException):
            errors.append(f"{inst.name}: no stats ({reply})")
            continue
        for name in reply.__struct_fields__:
            value = getattr(reply, name)
            if name not in ("request_id", "integrity_error") and isinstance(value, int):
                totals[name] = totals.get(name, 0) + value
        if reply.integrity_error:
            errors.append(f"{inst.name}: {reply.integrity_error}")
    if not totals:
        raise EngineDeadError("no instance answered: " + "; ".join(errors))
    return EngineStats(request_id=0, integrity_error="; ".join(errors) or None, **totals)


def status(instances: Sequence[Instance], launcher: Launcher) -> dict[str, object]:
    """The cluster as the controller sees it now, without asking any instance: the nodes
    and which instances run on each, every instance's role, liveness and load (its last
    load report and what the front end assigned it)."""
    nodes = launcher.nodes()
    for row in nodes:
        row["instances"] = [i.name for i in instances if i.node == row["node"]]
    rows = []
    for inst in instances:
        report = inst.report
        rows.append(
            {
                **_identity(inst),
                "running": report.num_running if report else None,
                "waiting": report.num_waiting if report else None,
                "free_blocks": report.num_obtainable_blocks if report else None,
                "blocks": report.num_blocks if report else None,
            }
        )
    return {"launcher": launcher.kind, "nodes": nodes, "instances": rows}


async def instance_rows(
    instances: Sequence[Instance], features: Sequence[Feature], timeout: float
) -> list[dict[str, object]]:
    """Per instance: role, liveness, assigned load, what each feature knows of it
    (`Feature.describe`), its counters. Every live instance is asked for its counters at
    once and the rows are answered within `timeout` whatever an instance does: one that
    has not answered by then (inside a long step, stopped, dying) gets `stats_error`
    instead of `stats`."""
    rows: list[dict[str, object]] = []
    for inst in instances:
        row: dict[str, object] = _identity(inst)
        for feature in features:
            row.update(feature.describe(inst))
        rows.append(row)
    live = [(row, inst) for row, inst in zip(rows, instances, strict=True) if inst.alive]
    asks = [asyncio.ensure_future(inst.stats(True, timeout)) for _, inst in live]
    if asks:
        await asyncio.wait(asks, timeout=timeout)
    for (row, _), ask in zip(live, asks, strict=True):
        if not ask.done():
            ask.cancel()
            row["stats_error"] = f"no answer within {timeout:g} s"
        elif ask.exception() is not None:
            row["stats_error"] = str(ask.exception())
        else:
            stats = ask.result()
            fields = [f for f in stats.__struct_fields__ if f != "request_id"]
            row["stats"] = {f: getattr(stats, f) for f in fields}
    return rows


def _identity(inst: Instance) -> dict[str, object]:
    """What every per-instance row starts with: who and where it is, whether it lives,
    and the load the front end assigned it."""
    return {
        "name": inst.name,
        "role": inst.role.value,
        # instance flip (cluster/flip.py): the role it drains toward, else None
        "flipping_to": None if inst.flipping_to is None else inst.flipping_to.value,
        "node": inst.node,
        # its ranks: tensor x pipeline parallel (docs/parallelism.md)
        "tensor_parallel_size": inst.config.tensor_parallel_size,
        "pipeline_parallel_size": inst.config.pipeline_parallel_size,
        "pid": inst.process.pid,
        "alive": inst.alive,
        "dead_reason": inst.dead,
        "assigned_requests": inst.assigned_requests,
        "assigned_prefill_tokens": inst.assigned_prefill_tokens,
    }
