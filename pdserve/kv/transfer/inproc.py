"""`InProcessTransport`: regions in a module-level registry of this process (tests).

fetch/flush are torch strided copies, one per coalesced run covering all the plan's layers
and K/V (`apply_plan`); they cast when the two pools' dtypes differ. Each transport gets
its own registry address, so two engines in one process may both name a region "prefill".
"""

from __future__ import annotations

import itertools
import os
import threading

import torch

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer.aggregate import apply_plan
from pdserve.kv.transfer.errors import PeerUnavailableError, TransferError
from pdserve.kv.transfer.layout import torch_dtype
from pdserve.kv.transfer.plan import TransferPlan
from pdserve.kv.transfer.transport import (
    Region,
    Transport,
    check_plan,
    local_layout,
)

_REGISTRY: dict[str, dict[str, torch.Tensor]] = {}  # address -> region name -> pool
_LOCK = threading.Lock()
_IDS = itertools.count()


class InProcessTransport(Transport):
    """Regions reachable by every transport of this process (see module doc). Thread-safe."""

    kind = "inproc"

    def __init__(self) -> None:
        self.address = f"inproc-{os.getpid()}-{next(_IDS)}"
        self._closed = False
        with _LOCK:
            _REGISTRY[self.address] = {}

    def create_region(self, name: str, layout: KVLayout) -> Region:
        tensor = torch.zeros(layout.shape, dtype=torch_dtype(layout))
        with _LOCK:
            regions = _REGISTRY.get(self.address)
            if regions is None:
                raise TransferError(f"inproc transport {self.address} is closed")
            if name in regions:
                raise ValueError(f"inproc transport {self.address} already has a region {name!r}")
            regions[name] = tensor
        return Region(tensor, RegionHandle(self.kind, self.address, name, layout))

    def fetch(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        pool = self._lookup(remote)
        check_plan(plan, remote.layout, local_layout(local))
        apply_plan(plan, pool, local)

    def flush(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        pool = self._lookup(remote)
        check_plan(plan, local_layout(local), remote.layout)
        apply_plan(plan, local, pool)

    def close(self) -> None:
        self._closed = True
        with _LOCK:
            _REGISTRY.pop(self.address, None)

    def _lookup(self, remote: RegionHandle) -> torch.Tensor:
        if self._closed:
            raise TransferError(f"inproc transport {self.address} is closed")
        if remote.transport != self.kind:
            raise ValueError(f"cannot reach {remote.describe()} through the inproc transport")
        with _LOCK:
            pool = _REGISTRY.get(remote.address, {}).get(remote.name)
        if pool is None:
            raise PeerUnavailableError(f"{remote.describe()} is unknown (closed or never created)")
        return pool
