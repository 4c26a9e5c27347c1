"""What the prefill and decode roles share: the instance's KV and the means to move it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.config import EngineConfig, TransferConfig
from pdserve.engine.roles.base import EngineRole
from pdserve.kv.layout import KVLayout
from pdserve.kv.manager import KVManager
from pdserve.kv.transfer import FaultConfig, Region, TransferWorker, Transport, make_transport
from pdserve.protocol.wire import EngineMessage


@dataclass(frozen=True, eq=False)
class TransferLink:
    """An instance's way to move KV: its pool as a region peers reach, the transport that
    made the region, and the thread transfers run on. Owned by the core (`close`)."""

    region: Region  # this instance's pool; its tensor is the device KV tensor
    transport: Transport
    worker: TransferWorker

    def close(self) -> None:
        """Stop the transfer thread and release the region (shared memory)."""
        self.worker.close()
        self.transport.close()


def open_link(config: EngineConfig, layout: KVLayout) -> TransferLink:
    """The transport of `config.transfer`, a zeroed region of `layout`, a transfer thread."""
    t = config.transfer
    transport = make_transport(
        t.transport,
        host=t.host,
        timeout_s=t.timeout_s,
        verify_checksum=t.verify_checksum,
        faults=fault_config(t, "all"),
        node=t.node,
    )
    worker = TransferWorker(num_threads=1, name=f"{config.instance_name}-kv")
    region = transport.create_region(config.instance_name, layout)
    return TransferLink(region, transport, worker)


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
        self.region = link.region  # this instance's pool, reachable by peers
        self.layout: KVLayout = link.region.handle.layout
        self.transport = link.transport
        self.worker = link.worker
        self.config = config
        self._init_state()

    def _init_state(self) -> None:
        """The role's own bookkeeping (subclasses)."""
