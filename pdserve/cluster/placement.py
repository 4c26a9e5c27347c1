"""Which instances run on which node: the placement `pdserve plan` writes and
`pdserve serve --ray --placement` starts (docs/deploy.md).

A placement is a list of `PlacedInstance`s: a role, a node index, the devices the
instance holds there (GPUs on a GPU engine: one per rank; on a CPU engine, CPU cores: its
threads, shared by its ranks), and its parallel layout (tensor x pipeline ranks, 1 x 1
when not given).
Node indices are positions in the Ray cluster's node order (cluster/ray_launch.py:
the head node first, then the others by node id), so a plan written for
"2 nodes x 4 devices" needs no host names. In JSON, either a whole plan (its
"placement" key) or the placement alone:

    {"instances": [{"role": "prefill", "node": 0, "devices": 2, "tp": 2, "pp": 1},
                   {"role": "decode", "node": 1, "devices": 1}]}

Without `--ray` (`serve --placement`) every instance runs on this machine: node 0.

This module is plain data and packing: it imports neither Ray nor the engine.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.config import Role

ROLE_ORDER = (Role.PREFILL, Role.DECODE, Role.COLOCATED)  # instance_configs' order


@dataclass(frozen=True)
class PlacedInstance:
    role: Role
    node: int  # index into the cluster's node order
    devices: int  # GPUs (cuda engine) or CPU cores / threads (cpu engine), all ranks'
    tp: int = 1  # tensor-parallel ranks per stage
    pp: int = 1  # pipeline stages

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role.value,
            "node": self.node,
            "devices": self.devices,
            "tp": self.tp,
            "pp": self.pp,
        }


def counts(placement: list[PlacedInstance]) -> Counter[Role]:
    return Counter(p.role for p in placement)


def in_launch_order(placement: list[PlacedInstance]) -> list[PlacedInstance]:
    """Prefill instances first, then decode, then colocated (stable within a role): the
    order `instance_configs` names them in (prefill-0, prefill-1, ..., decode-0, ...)."""
    return sorted(placement, key=lambda p: ROLE_ORDER.index(p.role))


def read_placement(path: str | Path) -> list[PlacedInstance]:
    """The placement in `path` (a plan JSON or a bare placement). ValueError naming the
    file and the entry for anything malformed."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--placement {path}: cannot read it: {e}") from None
    if isinstance(doc, dict) and "placement" in doc:
        doc = doc["placement"]
        if doc is None:
            raise ValueError(
                f"--placement {path}: the plan has no placement (plan with --rate to size "
                "the cluster, on nodes that each hold a whole instance)"
            )
    if not isinstance(doc, dict) or not isinstance(doc.get("instances"), list):
        raise ValueError(f"--placement {path}: expected an object with an 'instances' list")
    placement = [_entry(path, i, e) for i, e in enumerate(doc["instances"])]
    check_roles(placement, f"--placement {path}")
    return placement


def _entry(path: str | Path, index: int, e: Any) -> PlacedInstance:
    where = f"--placement {path}: instances[{index}]"
    if not isinstance(e, dict):
        raise ValueError(f"{where}: expected an object, got {e!r}")
    roles = [r.value for r in ROLE_ORDER]
    if e.get("role") not in roles:
        raise ValueError(f"{where}: role must be one of {', '.join(roles)}, got {e.get('role')!r}")
    for key, least in (("node", 0), ("devices", 1), ("tp", 1), ("pp", 1)):
        value = e.get(key, 1 if key in ("tp", "pp") else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{where}: {key} must be an integer >= {least}, got {value!r}")
    tp, pp = e.get("tp", 1), e.get("pp", 1)
    placed = PlacedInstance(Role(e["role"]), e["node"], e["devices"], tp, pp)
    if placed.devices < placed.world_size:
        raise ValueError(
            f"{where}: {placed.tp} x {placed.pp} ranks need at least {placed.world_size} "
            f"devices (one each), it names {placed.devices}"
        )
    return placed


def check_roles(placement: list[PlacedInstance], what: str) -> None:
    """Disaggregated (prefill and decode) or colocated, as `ClusterConfig` requires."""
    n = counts(placement)
    if not placement:
        raise ValueError(f"{what}: no instances")
    if n[Role.COLOCATED] and (n[Role.PREFILL] or n[Role.DECODE]):
        raise ValueError(f"{what}: colocated instances cannot be mixed with prefill/decode")
    if bool(n[Role.PREFILL]) != bool(n[Role.DECODE]):
        raise ValueError(
            f"{what}: disaggregated serving needs prefill and decode instances, got "
            f"{n[Role.PREFILL]} prefill and {n[Role.DECODE]} decode"
        )


def lay_out(
    groups: list[list[tuple[Role, int, int]]], nodes: int, devices_per_node: int
) -> list[PlacedInstance]:
    """Pack groups of (role, tp, pp) instances, one device per rank, onto `nodes` nodes of
    `devices_per_node` devices, first fit in the given order; a group's instances share a
    node (DistServe's low node-affinity unit: its KV moves inside the node). ValueError
    naming the group if one does not fit: an instance's ranks share memory (their KV pools
    and sums), so an instance cannot span nodes."""
    free = [devices_per_node] * nodes
    placed: list[PlacedInstance] = []
    for group in groups:
        need = sum(tp * pp for _, tp, pp in group)
        node = next((n for n in range(nodes) if free[n] >= need), None)
        if node is None:
            what = " + ".join(f"{r.value} (TP{tp}xPP{pp})" for r, tp, pp in group)
            raise ValueError(
                f"{what} does not fit on any node of {devices_per_node} devices "
                f"({sum(free)} devices left on {nodes} nodes)"
            )
        free[node] -= need
        placed += [PlacedInstance(role, node, tp * pp, tp, pp) for role, tp, pp in group]
    return in_launch_order(placed)
