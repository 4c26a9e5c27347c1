"""`make_transport`: a transport by name. The one module that knows every implementation
(the interface, `transport.py`, knows none of them)."""

from __future__ import annotations

from pdserve.kv.transfer.auto import NodeAwareTransport
from pdserve.kv.transfer.faults import FaultConfig, FaultyTransport
from pdserve.kv.transfer.inproc import InProcessTransport
from pdserve.kv.transfer.shm import SharedMemoryTransport
from pdserve.kv.transfer.tcp import TcpTransport
from pdserve.kv.transfer.transport import Transport

TRANSPORTS = ("inproc", "shm", "tcp", "auto")


def make_transport(
    kind: str,
    *,
    host: str = "127.0.0.1",
    timeout_s: float = 30.0,
    verify_checksum: bool = False,
    faults: FaultConfig | None = None,
    node: str = "",
) -> Transport:
    """A transport of `kind` ("inproc" | "shm" | "tcp" | "auto"), wrapped in a
    `FaultyTransport` when `faults` injects anything.

    `host` (tcp: the address to listen on and to advertise), `timeout_s` (tcp: every
    socket operation) and `verify_checksum` (tcp: crc32 of every payload) are ignored by
    the in-memory transports: their copies cannot stall or corrupt in transit. `node`
    (auto: the name of this host in the deployment, required) decides shm or tcp per peer.
    """
    inner: Transport
    if kind == "inproc":
        inner = InProcessTransport()
    elif kind == "shm":
        inner = SharedMemoryTransport()
    elif kind == "tcp":
        inner = TcpTransport(host=host, timeout_s=timeout_s, verify_checksum=verify_checksum)
    elif kind == "auto":
        tcp = TcpTransport(host=host, timeout_s=timeout_s, verify_checksum=verify_checksum)
        inner = NodeAwareTransport(node, tcp)
    else:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    if faults is not None and faults.active:
        return FaultyTransport(inner, faults)
    return inner
