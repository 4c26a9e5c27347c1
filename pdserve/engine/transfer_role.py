"""What the prefill and decode roles share: the instance's KV and the means to move it."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.config import TransferConfig
from pdserve.kv.layout import KVLayout
from pdserve.kv.manager import KVManager
from pdserve.kv.transfer import Region, TransferWorker, Transport
from pdserve.protocol.wire import EngineMessage


class TransferRole:
    """Base of `PrefillRole` and `DecodeRole`. Single-threaded like the step loop that
    calls it; only the `worker`'s tasks run elsewhere, and they touch pool memory only."""

    def __init__(
        self,
        kv: KVManager,
        region: Region,
        transport: Transport,
        worker: TransferWorker,
        config: TransferConfig,
        send: Callable[[EngineMessage], None],
    ) -> None:
        self.kv = kv
        self.region = region  # this instance's pool, reachable by peers
        self.layout: KVLayout = region.handle.layout
        self.transport = transport
        self.worker = worker
        self.config = config
        self.send = send  # queues a message for the controller
        self._init_state()

    def _init_state(self) -> None:
        """The role's own bookkeeping (subclasses)."""
