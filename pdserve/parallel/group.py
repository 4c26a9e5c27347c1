"""The ranks of a parallel instance as one process group.

An instance of T x P ranks sums within each stage's T tensor ranks (`all_reduce_sum`) and
hands hidden states from stage to stage (`send`, `recv`: point to point). Rendezvous,
hand-offs and large sums go through torch.distributed (gloo on CPU, NCCL on CUDA, over
TCP on 127.0.0.1: the ranks of an instance run on one machine). The sums a decode step
makes - two per layer, of a few rows - go through shared memory instead on CPU
(`LocalAllReduce`): gloo's TCP round trip took ~600 us per sum of a [1, 576] tensor on 2
cores (60 a step of SmolLM2: 36 ms), a sum through /dev/shm ~20 us
(bench/bench_parallel.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

# Floats a rank's shared-memory slot holds: larger sums (a long prefill's rows) use gloo.
LOCAL_CAPACITY = 256 * 1024
# Seconds a rank waits for the others at one sum before it gives up (a rank that lives
# but does not come: stopped, or stuck; one that exited is seen within _CHECK_S).
WAIT_LIMIT_S = 60.0
_LINE = 64  # bytes between two ranks' counters

_local: LocalAllReduce | None = None
_stage: dist.ProcessGroup | None = None  # this rank's stage's tensor ranks
_pids: list[int] = []  # every rank's process id, by rank (set by join)
_watch: Callable[[], None] | None = None  # the driver's look at its workers (`watch`)
_CHECK_S = 0.05  # seconds between two looks at the other ranks' processes while waiting
_SETTLE_S = 1.0  # seconds a closed connection waits for its peer to show as exited


class RankFailed(RuntimeError):
    """Another rank of this instance is gone: the instance cannot step any more."""


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")


def dead_ranks() -> list[int]:
    """The other ranks whose processes have exited."""
    me = os.getpid()
    return [r for r, pid in enumerate(_pids) if pid != me and gone(pid)]


def watch(check: Callable[[], None]) -> None:
    """Make `check` the first look at the other ranks (`check_ranks`): the driver's, which
    started the workers and reaps them, names how each ended."""
    global _watch
    _watch = check


def check_ranks() -> None:
    """RankFailed naming the ranks of this instance that have exited, if any has."""
    if _watch is not None:
        _watch()
    dead = dead_ranks()
    if dead:
        names = ", ".join(f"{r} (pid {_pids[r]})" for r in dead)
        raise RankFailed(f"rank {names} of this instance has exited")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: str, rank: int) -> str:
    """The device rank `rank` computes on: a bare "cuda" is its own GPU among those this
    process sees (rank r on cuda:r; under Ray each rank's process sees only the GPU of
    its bundle: cuda:0); "cpu" and "cuda:N" as given."""
    if device != "cuda":
        return device
    count = torch.cuda.device_count()
    return f"cuda:{rank % count}" if count else device


def join(
    rank: int,
    world: int,
    port: int,
    device: str = "cpu",
    timeout_s: float = 60.0,
    tp: int | None = None,
) -> None:
    """Join the group as `rank` of `world` (stages of `tp` tensor ranks each, stage-major;
    None: one stage of all); returns once every rank has joined (or raises after
    `timeout_s`). One group per process."""
    from datetime import timedelta

    global _local, _stage
    if dist.is_initialized():
        raise RuntimeError(
            "this process is already a rank of a tensor-parallel engine: close that engine "
            "(EngineCore.close) before starting another"
        )
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        # NCCL's communicators bind to the current device: this rank's own
        torch.cuda.set_device(torch.device(rank_device(device, rank)))
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    pids: list[object] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    _pids[:] = [int(p) for p in pids]  # type: ignore[call-overload]
    tp = world if tp is None else tp
    if world % tp:
        raise ValueError(f"{world} ranks do not make stages of {tp}")
    for s in range(world // tp):  # every rank creates every stage's group, in order
        members = list(range(s * tp, (s + 1) * tp))
        g = dist.new_group(members) if tp < world else dist.group.WORLD
        if rank in members:
            assert isinstance(g, dist.ProcessGroup)
            _stage = g
            if device == "cpu" and tp > 1:
                _local = LocalAllReduce(members, rank, port, g)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed over the ranks, in place; every rank gets the same bits (each adds the
    ranks' parts in rank order, or gloo's ring for a large CPU sum)."""
    if _local is not None and t.numel() <= LOCAL_CAPACITY and t.is_contiguous():
        return _local.sum(t)
    with _peer(None):
        dist.all_reduce(t, group=_stage)
    return t


class Sending:
    """A send under way (`send`); `wait` until it is done."""

    def __init__(self, t: torch.Tensor, dst: int) -> None:
        self.tensor, self.dst = t, dst  # kept alive until done
        with _peer(dst):
            work = dist.isend(t, dst)
        assert work is not None
        self._work = work

    def wait(self) -> None:
        with _peer(self.dst):
            self._work.wait()


def send(t: torch.Tensor, dst: int) -> Sending:
    """Start sending `t` (contiguous) to rank `dst` (a send does not wait for its receive:
    stages overlap). A peer that exited: RankFailed, here or at `wait`."""
    return Sending(t, dst)


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    """Fill `t` (its shape and dtype the sender's) from rank `src`; returns it. A sender
    that exits closes the connection: RankFailed at once."""
    with _peer(src):
        dist.recv(t, src)
    return t


@contextlib.contextmanager
def _peer(rank: int | None) -> Iterator[None]:
    """gloo's error for a connection a peer's exit closed (`rank`, or one of the stage's
    when None), as RankFailed naming the ranks that exited."""
    try:
        yield
    except RuntimeError as e:
        # A process's connections close as it exits, a moment before it shows as exited.
        deadline = time.monotonic() + _SETTLE_S
        while time.monotonic() < deadline:
            check_ranks()
            time.sleep(0.01)
        who = "a rank" if rank is None else f"rank {rank}"
        raise RankFailed(f"{who} of this instance stopped answering: {e}") from e


def leave() -> None:
    global _local, _stage, _watch
    _local, _stage, _watch = None, None, None
    _pids.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalAllReduce:
    """Sums over the ranks through one /dev/shm segment: per rank a counter (a cache line
    each) and two slots of LOCAL_CAPACITY floats, used by alternate sums. A sum writes the
    rank's part into its slot, then its counter (x86 stores are seen in order), waits
    until every counter has reached this sum, then adds the slots in rank order. Two
    slots per rank make it safe: a rank can be at most one sum ahead of the slowest (the
    next sum waits for everyone's part of it), so the slot it writes is never one a slower
    rank still reads.

    The segment is created by rank 0 and unlinked as soon as every rank has mapped it: no
    name is left behind whatever happens to the processes later."""

    def __init__(
        self, members: list[int], global_rank: int, port: int, group: dist.ProcessGroup
    ) -> None:
        """`members`: the global ranks summed over (a stage's), `group` their group."""
        rank, world = members.index(global_rank), len(members)
        self.rank, self.world, self.seq = rank, world, 0
        size = world * _LINE + 2 * world * LOCAL_CAPACITY * 4
        lead = f"/dev/shm/pdtp-{os.getpid()}-{port}-{members[0]}"
        names: list[object] = [lead if rank == 0 else None]
        dist.broadcast_object_list(names, src=members[0], group=group)
        path = str(names[0])
        if rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        dist.barrier(group=group)
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path)
        self._counters = np.frombuffer(self._map, np.int64, world * _LINE // 8)[:: _LINE // 8]
        data = torch.frombuffer(self._map, dtype=torch.float32, offset=world * _LINE)
        self._slots = data.view(2, world, LOCAL_CAPACITY)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        self.seq += 1
        n, slots = t.numel(), self._slots[self.seq & 1]
        flat = t.view(-1)
        slots[self.rank, :n].copy_(flat)
        self._counters[self.rank] = self.seq
        self._wait()
        flat.copy_(slots[0, :n])
        for r in range(1, self.world):
            flat.add_(slots[r, :n])
        return t

    def _wait(self) -> None:
        counters, seq = self._counters, self.seq
        spins = 0
        deadline = checked = 0.0
        while int(counters.min()) < seq:
            spins += 1
            if spins < 200:
                continue
            os.sched_yield()  # a rank on a shared core: let it run
            if spins % 1000 == 0:
                now = time.monotonic()
                if now - checked > _CHECK_S:  # a rank that exited never comes
                    check_ranks()
                    checked = now
                if deadline == 0.0:
                    deadline = now + WAIT_LIMIT_S
                elif now > deadline:  # a rank that lives but does not come (stopped)
                    late = [r for r in range(self.world) if counters[r] < seq]
                    raise RankFailed(f"ranks {late} did not reach sum {seq} in {WAIT_LIMIT_S} s")
