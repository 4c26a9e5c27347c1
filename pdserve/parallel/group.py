"""The ranks of a tensor-parallel instance as one process group.

Rendezvous and large sums go through torch.distributed (gloo on CPU, NCCL on CUDA, over
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join(rank: int, world: int, port: int, device: str = "cpu", timeout_s: float = 60.0) -> None:
    """Join the group as `rank` of `world`; returns once every rank has joined (or raises
    after `timeout_s`). One group per process."""
    from datetime import timedelta

    global _local
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
    if device == "cpu":
        _local = LocalAllReduce(rank, world, port)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed over the ranks, in place; every rank gets the same bits (each adds the
    ranks' parts in rank order, or gloo's ring for a large CPU sum)."""
    if _local is not None and t.numel() <= LOCAL_CAPACITY and t.is_contiguous():
        return _local.sum(t)
    dist.all_reduce(t)
    return t


def leave() -> None:
    global _local
    _local = None
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

    def __init__(self, rank: int, world: int, port: int) -> None:
        self.rank, self.world, self.seq = rank, world, 0
        size = world * _LINE + 2 * world * LOCAL_CAPACITY * 4
        names: list[object] = [f"/dev/shm/pdtp-{os.getpid()}-{port}" if rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        path = str(names[0])
        if rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        dist.barrier()
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        dist.barrier()
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
