"""The ranks of a parallel instance as one process group.

An instance of T x P ranks sums within each stage's T tensor ranks (`all_reduce_sum`) and
hands hidden states from stage to stage (`send`, `recv`: point to point). Rendezvous,
hand-offs and large sums go through torch.distributed (gloo on CPU, NCCL on CUDA, over
TCP on 127.0.0.1: the ranks of an instance run on one machine). The sums a decode step
makes - two per layer, of a few rows - go through shared memory instead on CPU
(`LocalAllReduce`): gloo's TCP round trip took ~600 us per sum of a [1, 576] tensor on 2
cores (60 a step of SmolLM2: 36 ms), a sum through /dev/shm ~20 us
(bench/bench_tensor_parallel.py).
"""

from __future__ import annotations

import mmap
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

# Floats a rank's shared-memory slot holds: larger sums (a long prefill's rows) use gloo.
LOCAL_CAPACITY = 256 * 1024
# Seconds a rank waits for the others at one sum before it gives up (a rank died).
WAIT_LIMIT_S = 60.0
_LINE = 64  # bytes between two ranks' counters

_local: LocalAllReduce | None = None
_stage: dist.ProcessGroup | None = None  # this rank's stage's tensor ranks


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
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
    dist.all_reduce(t, group=_stage)
    return t


def send(t: torch.Tensor, dst: int) -> dist.Work:
    """Start sending `t` (contiguous) to rank `dst`; the caller keeps `t` alive until the
    returned work's `wait()` (a send does not wait for its receive: stages overlap)."""
    work = dist.isend(t, dst)
    assert work is not None
    return work


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    """Fill `t` (its shape and dtype the sender's) from rank `src`; returns it."""
    dist.recv(t, src)
    return t


def leave() -> None:
    global _local, _stage
    _local, _stage = None, None
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
        deadline = 0.0
        while int(counters.min()) < seq:
            spins += 1
            if spins < 200:
                continue
            os.sched_yield()  # a rank on a shared core: let it run
            if spins % 1000 == 0:
                now = time.monotonic()
                if deadline == 0.0:
                    deadline = now + WAIT_LIMIT_S
                elif now > deadline:
                    late = [r for r in range(self.world) if counters[r] < seq]
                    raise RuntimeError(f"ranks {late} did not reach sum {seq} in {WAIT_LIMIT_S} s")
