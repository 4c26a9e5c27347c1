"""`SharedMemoryTransport`: pools in POSIX shared memory, one copy between two processes.

`create_region` backs the pool by a new /dev/shm segment (zero-filled by the kernel) and
wraps the mapping with `torch.frombuffer`. Nothing is written or faulted in up front: a
page is allocated where a block is first written, by either side, so a region costs
nothing at start (populating 1 GiB took ~1.8 s an instance on a 2-core VM) and holds only
the memory in use; mapping it with MAP_POPULATE did not reserve it either (a full /dev/shm
failed on first touch then as now). A peer's region is mapped on first use and cached by
segment name; fetch/flush then copy directly between the two mapped pools with one strided
torch copy per coalesced run: the data crosses memory once, straight into the receiver's
pool, with no intermediate buffer. Dtypes may differ (the copy casts).

Ownership: the creating transport owns a segment and unlinks it in `close` (it is also
registered with multiprocessing's resource tracker, which unlinks it should the process die
first). Peers map segments without registering them, so a peer exiting never unlinks a
segment it does not own. When the owner and its tracker die together (a process group
killed at once, as Ray does with a lost node's workers) nobody is left to unlink it, so
a transport creating its first region removes every segment whose owner - the pid in
its name - no longer exists (`remove_stale_segments`; a whole KV pool of /dev/shm, which is
memory, per lost instance before). This assumes the processes sharing /dev/shm share a
pid namespace, as one host's pdserve processes (and Ray's) do. Mappings are never
unmapped explicitly: a mapping goes away when the last tensor over it is dropped, so a
`Region.tensor` still held after `close` (or a copy still running) stays valid.

Host memory only: a CUDA pool cannot be placed in a /dev/shm segment. The GPU analogue
would be CUDA IPC (`cudaIpcGetMemHandle` / `cudaIpcOpenMemHandle`, what
`torch.multiprocessing` uses to share CUDA tensors) behind this same interface; it does not
exist yet. Linux-only (/dev/shm).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import threading
from multiprocessing import resource_tracker

import torch

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer.aggregate import apply_plan
from pdserve.kv.transfer.errors import LayoutMismatchError, PeerUnavailableError, TransferError
from pdserve.kv.transfer.layout import torch_dtype
from pdserve.kv.transfer.plan import TransferPlan
from pdserve.kv.transfer.transport import (
    Region,
    Transport,
    check_plan,
    local_layout,
)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdkv-"
_MAP_FLAGS = mmap.MAP_SHARED


def segment_path(segment: str) -> str:
    return os.path.join(SHM_DIR, segment)


_OWNER = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)-")


def remove_stale_segments() -> list[str]:
    """Unlink the pdserve segments whose creating process is gone; returns their names.
    A segment of a live process (or of a pid reused since) is left alone."""
    removed = []
    for name in os.listdir(SHM_DIR):
        owner = _OWNER.match(name)
        if owner is None or os.path.exists(f"/proc/{owner.group(1)}"):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path(name))
            removed.append(name)
    return removed


def map_region(handle: RegionHandle) -> torch.Tensor:
    """The pool of a region another process created in /dev/shm ("shm" and "auto" handles:
    the address is the segment), mapped here without taking ownership: a parallel
    instance's worker rank computes in the segment its driver created (and unlinks).
    PeerUnavailableError if it is gone; LayoutMismatchError if its size is not the layout's."""
    if handle.transport not in ("shm", "auto"):
        raise ValueError(f"{handle.describe()} is not in shared memory")
    return SharedMemoryTransport.attach_segment(handle)


def _map(fd: int, layout: KVLayout) -> torch.Tensor:
    mapping = mmap.mmap(fd, layout.nbytes, flags=_MAP_FLAGS)
    # The tensor keeps `mapping` alive; it is unmapped when the last tensor over it goes.
    return torch.frombuffer(mapping, dtype=torch_dtype(layout)).view(layout.shape)


class SharedMemoryTransport(Transport):
    """Regions in /dev/shm segments, reachable by any process on this host (see module doc).

    Thread-safe: the caches are guarded by a lock; copies run without it.
    """

    kind = "shm"

    def __init__(self) -> None:
        self._owned: dict[str, torch.Tensor] = {}  # segment -> pool (created here)
        self._names: set[str] = set()  # region names created here
        self._attached: dict[str, torch.Tensor] = {}  # segment -> pool (a peer's)
        self._lock = threading.Lock()
        self._closed = False

    def create_region(self, name: str, layout: KVLayout) -> Region:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
        segment = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{safe}"
        with self._lock:
            if self._closed:
                raise TransferError("shm transport is closed")
            if name in self._names:
                raise ValueError(f"shm transport already has a region {name!r}")
            if not self._owned:
                remove_stale_segments()
            tensor = self._create_segment(segment, layout)
            self._owned[segment] = tensor
            self._names.add(name)
        return Region(tensor, RegionHandle(self.kind, segment, name, layout))

    def fetch(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        check_plan(plan, remote.layout, local_layout(local))
        apply_plan(plan, self._pool(remote), local)

    def flush(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        check_plan(plan, local_layout(local), remote.layout)
        apply_plan(plan, local, self._pool(remote))

    def close(self) -> None:
        """Unlink the segments created here and drop the mappings of peers' segments."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            owned, self._owned, self._attached = self._owned, {}, {}
        for segment in owned:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_path(segment))
            resource_tracker.unregister("/" + segment, "shared_memory")

    @property
    def segments(self) -> list[str]:
        """Names of the segments this transport created and has not unlinked."""
        with self._lock:
            return list(self._owned)

    # ---- internals ----------------------------------------------------------------

    @staticmethod
    def _create_segment(segment: str, layout: KVLayout) -> torch.Tensor:
        path = segment_path(segment)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, layout.nbytes)
            tensor = _map(fd, layout)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        # As SharedMemory(create=True) does: unlinked by the tracker if we die first.
        resource_tracker.register("/" + segment, "shared_memory")
        return tensor

    def _pool(self, remote: RegionHandle) -> torch.Tensor:
        """The mapped pool of `remote` (mapped on first use); PeerUnavailableError once its
        owner has unlinked it."""
        if remote.transport != self.kind:
            raise ValueError(f"cannot reach {remote.describe()} through the shm transport")
        segment = remote.address
        with self._lock:
            if self._closed:
                raise TransferError("shm transport is closed")
            pool = self._owned.get(segment)
            if pool is not None:
                return pool
            pool = self._attached.get(segment)
        if not os.path.exists(segment_path(segment)):
            with self._lock:
                self._attached.pop(segment, None)
            raise PeerUnavailableError(f"{remote.describe()} is gone (its segment was unlinked)")
        if pool is None:
            pool = self.attach_segment(remote)
            with self._lock:
                pool = self._attached.setdefault(remote.address, pool)
        return pool

    @staticmethod
    def attach_segment(remote: RegionHandle) -> torch.Tensor:
        """Map `remote`'s segment (not cached, not owned)."""
        path = segment_path(remote.address)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PeerUnavailableError(f"{remote.describe()} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            if size != remote.layout.nbytes:
                raise LayoutMismatchError(
                    f"{remote.describe()} has {size} bytes, its layout says {remote.layout.nbytes}"
                )
            return _map(fd, remote.layout)
        finally:
            os.close(fd)
