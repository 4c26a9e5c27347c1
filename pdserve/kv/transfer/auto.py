"""`NodeAwareTransport` ("auto"): shared memory to peers on the same node, TCP to the rest.

Instances placed on several hosts (cluster/ray_launch.py) need both: one copy through
/dev/shm between two pools on one host, a socket to any other host. This transport
creates each region as a shared-memory segment and serves the same tensor over TCP, and
its handle carries both addresses and the node it lives on (`RegionHandle.node`,
`tcp_address`). Every `fetch` / `flush` picks the route per pair: the segment when the
remote region's node is this transport's node, TCP otherwise. A node is whatever string
names a host in the deployment (a Ray node id); two transports given the same name must
share /dev/shm.

`routes()` counts the transfers sent each way (engine stats `kv_routes_shm` /
`kv_routes_tcp`): what the multi-node tests assert, and what an operator reads to see
KV crossing hosts.
"""

from __future__ import annotations

import threading

import msgspec
import torch

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer.plan import TransferPlan
from pdserve.kv.transfer.shm import SharedMemoryTransport
from pdserve.kv.transfer.tcp import TcpTransport
from pdserve.kv.transfer.transport import Region, Transport


class NodeAwareTransport(Transport):
    """Regions in shared memory, also served over TCP; each transfer routed by node."""

    kind = "auto"

    def __init__(self, node: str, tcp: TcpTransport, shm: SharedMemoryTransport | None = None):
        if not node:
            raise ValueError("the auto transport needs the name of its node")
        self.node = node
        self.tcp = tcp
        self.shm = shm if shm is not None else SharedMemoryTransport()
        self._lock = threading.Lock()
        self._routes = {"shm": 0, "tcp": 0}

    def create_region(self, name: str, layout: KVLayout) -> Region:
        region = self.shm.create_region(name, layout)
        self.tcp.serve_region(name, region.tensor, layout)
        handle = msgspec.structs.replace(
            region.handle, transport=self.kind, node=self.node, tcp_address=self.tcp.address
        )
        return Region(region.tensor, handle)

    def fetch(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        transport, handle = self._route(remote)
        transport.fetch(handle, plan, local)

    def flush(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        transport, handle = self._route(remote)
        transport.flush(handle, plan, local)

    def routes(self) -> dict[str, int]:
        with self._lock:
            return dict(self._routes)

    def close(self) -> None:
        self.tcp.close()
        self.shm.close()

    def _route(self, remote: RegionHandle) -> tuple[Transport, RegionHandle]:
        """The transport and the plain handle that reach `remote` from this node."""
        if remote.transport != self.kind:
            raise ValueError(f"cannot reach {remote.describe()} through the auto transport")
        same_node = remote.node == self.node
        with self._lock:
            self._routes["shm" if same_node else "tcp"] += 1
        if same_node:
            return self.shm, msgspec.structs.replace(remote, transport="shm")
        return self.tcp, msgspec.structs.replace(
            remote, transport="tcp", address=remote.tcp_address
        )
