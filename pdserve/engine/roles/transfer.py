"""What the prefill and decode roles share: the instance's KV and the means to move it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.config import SHARED_TRANSPORTS, EngineConfig, TransferConfig
from pdserve.engine.roles.base import EngineRole
from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.manager import KVManager
from pdserve.kv.transfer import FaultConfig, Region, TransferWorker, Transport, make_transport
from pdserve.protocol.wire import EngineMessage


@dataclass(frozen=True, eq=False)
class TransferLink:
    """An instance's way to move KV: its pools as regions peers reach (one a rank: the
    driver's first, then its workers', which the driver maps too), the transport that made
    them, and the thread transfers run on. Owned by the core (`close`)."""

    regions: tuple[Region, ...]  # rank order; the driver's tensor is its device KV tensor
    transport: Transport
    worker: TransferWorker

    @property
    def region(self) -> Region:
        """The driver's (rank 0's) pool."""
        return self.regions[0]

    @property
    def handles(self) -> tuple[RegionHandle, ...]:
        """How peers reach every rank's pool, in rank order."""
        return tuple(r.handle for r in self.regions)

    @property
    def layouts(self) -> list[KVLayout]:
        return [r.handle.layout for r in self.regions]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every rank's pool, mapped in this (the driver's) process."""
        return [r.tensor for r in self.regions]

    def close(self) -> None:
        """Stop the transfer thread and release the region (shared memory)."""
        self.worker.close()
        self.transport.close()


def open_link(config: EngineConfig, layouts: Sequence[KVLayout]) -> TransferLink:
    """The transport of `config.transfer`, a zeroed region of each of `layouts` (one a
    rank, in rank order), a transfer thread. A parallel instance's regions must be in
    shared memory (its workers map theirs): another transport is a ValueError."""
    t = config.transfer
    if len(layouts) > 1 and t.transport not in SHARED_TRANSPORTS:
        raise ValueError(
            f"a parallel instance moves KV through shared memory (--kv-transport "
            f"{' or '.join(SHARED_TRANSPORTS)}), got {t.transport!r}"
        )
    transport = make_transport(
        t.transport,
        host=t.host,
        timeout_s=t.timeout_s,
        verify_checksum=t.verify_checksum,
        faults=fault_config(t, "all"),
        node=t.node,
    )
    worker = TransferWorker(num_threads=1, name=f"{config.instance_name}-kv")
    name = config.instance_name
    regions = tuple(
        transport.create_region(name if r == 0 else f"{name}-rank{r}", layout)
        for r, layout in enumerate(layouts)
    )
    return TransferLink(regions, transport, worker)


def fault_config(t: TransferConfig, scope: str) -> FaultConfig | None:
    """The faults `t` injects into the transfers of `scope` (`TransferConfig.fault_scope`:
    "all", the link's transport; "cache", only the cache exchange's copies)."""
    if not t.injects_faults or t.fault_scope != scope:
        return None
    return FaultConfig(
        failure_rate=t.fault_failure_rate,
        delay_s=t.fault_delay_s,
        bandwidth_bytes_per_s=t.fault_bandwidth,
        seed=t.fault_seed,
    )


class TransferRole(EngineRole):
    """Base of `PrefillRole` and `DecodeRole`. Single-threaded like the step loop that
    calls it; only the `worker`'s tasks run elsewhere, and they touch pool memory only."""

    def __init__(
        self,
        kv: KVManager,
        link: TransferLink,
        config: TransferConfig,
        send: Callable[[EngineMessage], None],
    ) -> None:
        super().__init__(send)
        self.kv = kv
        self.link = link  # this instance's pools (one a rank), reachable by peers
        self.layout: KVLayout = link.region.handle.layout  # the driver's
        self.transport = link.transport
        self.worker = link.worker
        self.config = config
        self._init_state()

    def _init_state(self) -> None:
        """The role's own bookkeeping (subclasses)."""
