"""KV transfer between instances: the three layers of moving a request's KV.

- stream_out / stream_in (`plan`): given the sender's and the receiver's layouts and block
  tables, which token runs of which layers go where (`TransferPlan`);
- scatter / gather (`aggregate`): a request's scattered KV as one contiguous buffer;
- flush / fetch (`transport`): move a plan's contiguous chunks through a `Transport`
  (`inproc`, `shm`, `tcp`; `FaultyTransport` injects faults), off the step loop on a
  `TransferWorker` whose `TransferTask`s the engines poll.

See docs/transfer.md.
"""

from __future__ import annotations

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer.aggregate import apply_plan, copy_runs, gather, gather_many, scatter
from pdserve.kv.transfer.errors import (
    ChecksumError,
    LayoutMismatchError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.kv.transfer.factory import make_transport
from pdserve.kv.transfer.faults import FaultConfig, FaultyTransport
from pdserve.kv.transfer.inproc import InProcessTransport
from pdserve.kv.transfer.layout import dtype_name, layout_of, token_view, torch_dtype
from pdserve.kv.transfer.plan import (
    Move,
    TokenRun,
    TransferPlan,
    merge_plans,
    plan_runs,
    plans_between,
    shared_plan,
    split_plan,
    stream_in,
    stream_out,
)
from pdserve.kv.transfer.shm import SharedMemoryTransport
from pdserve.kv.transfer.tcp import TcpTransport
from pdserve.kv.transfer.transport import (
    Region,
    Transport,
    check_plan,
    fetch_moves,
    flush_moves,
    moves_nbytes,
)
from pdserve.kv.transfer.worker import TransferState, TransferTask, TransferWorker

__all__ = [
    "ChecksumError",
    "FaultConfig",
    "FaultyTransport",
    "InProcessTransport",
    "KVLayout",
    "LayoutMismatchError",
    "Move",
    "PeerUnavailableError",
    "Region",
    "RegionHandle",
    "SharedMemoryTransport",
    "TcpTransport",
    "TokenRun",
    "TransferError",
    "TransferPlan",
    "TransferState",
    "TransferTask",
    "TransferTimeoutError",
    "TransferWorker",
    "Transport",
    "apply_plan",
    "check_plan",
    "copy_runs",
    "dtype_name",
    "fetch_moves",
    "flush_moves",
    "gather",
    "gather_many",
    "layout_of",
    "make_transport",
    "merge_plans",
    "moves_nbytes",
    "plan_runs",
    "plans_between",
    "scatter",
    "shared_plan",
    "split_plan",
    "stream_in",
    "stream_out",
    "token_view",
    "torch_dtype",
]
