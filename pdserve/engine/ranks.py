"""A parallel instance's ranks as processes: the driver (rank 0, the engine process: it
schedules, samples and holds the KV manager) and T x P - 1 workers that only execute.

The driver starts the workers (`RankGroup.start`: fresh processes over socket pairs, or
under `serve --ray` actors in the instance's placement group, each joining the group and
loading its shard while the driver loads its own), tells them the KV
pool's geometry once the core has sized it (`open`: the device tier's layout and the host
tier's block count), then sends each step's inputs (`send`, `StepInputs`: swaps, tokens,
block tables) before running the same step itself; every rank's forward meets the
others' in the sums after each layer's attention and MLP, and a pipeline's stages hand
each micro-batch's rows on (engine/pipeline.py). A worker's pool has the driver's
blocks, device and host (same ids, same counts), with its own KV heads and its stage's
layers, so the driver's block accounting and its swap plans are every rank's.

Contract: steps go to the workers in the order the driver runs them, one at a time. A
worker that exits fails the driver's step with `group.RankFailed` naming it - before the
step is sent (`check`), or during it (a sum looks at the ranks' processes every 50 ms; a
stage's receive fails when its sender's connection closes) - which ends the instance as
any engine failure does (an engine process reports `EngineFailed` and exits; its
`EngineCore.close` ends the other workers). Workers exit when the driver closes the group
or its process ends (its socket closes, or `runtime.ended` while they wait).
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from pdserve.config import EngineConfig
from pdserve.engine.mb_swap import MicrobatchSwap
from pdserve.engine.model_runner import ModelRunner, StepInputs
from pdserve.engine.pipeline import Stage
from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer.shm import map_region
from pdserve.parallel import group
from pdserve.parallel.layout import Shard, rank_kv_layout

# Seconds a worker waits for the next message before it checks that the driver lives.
_POLL_S = 1.0
# Seconds the driver waits to reap a worker it has seen exit.
_REAP_S = 5.0


class RankGroup:
    """The driver's side: the workers' processes and pipes."""

    def __init__(
        self,
        procs: Sequence[RankProcess],
        pipes: Sequence[mpc.Connection],
        shards: Sequence[Shard],
    ) -> None:
        self._procs, self._pipes = procs, pipes
        self.shards = tuple(shards)  # every rank's, in rank order
        self.shard = shards[0]  # the driver's own

    @classmethod
    def start(
        cls, config: EngineConfig, port: int, shards: Sequence[Shard], spawn: Spawn | None = None
    ) -> RankGroup:
        """Start ranks 1 .. T x P - 1 of `config` (their rendezvous on `port`) with `spawn`
        (default `spawn_local`: subprocesses of this one) and send each its config."""
        procs, pipes = (spawn or spawn_local)(range(1, config.world_size), port)
        for pipe in pipes:
            pipe.send(config)
        return cls(procs, pipes, shards)

    def kv_layouts(self, driver: KVLayout) -> list[KVLayout]:
        """Every rank's KV pool layout, in rank order, given the driver's: the same blocks
        and geometry, each rank's own layers and KV heads."""
        return [rank_kv_layout(shard, driver) for shard in self.shards]

    def attach(
        self,
        runner: ModelRunner,
        regions: Sequence[RegionHandle] | None,
        swap: MicrobatchSwap | None,
    ) -> None:
        """The driver's `runner` sends its steps to the workers, over pools of its own
        geometry (`regions`: the workers' pools in shared memory, ranks 1.., where the
        instance moves KV to and from peers; None: each worker allocates its own); a
        pipeline's driver runs its steps as stage 0 (with `swap`, microbatch swapping)."""
        host = runner.cache.host_layout
        num_host = 0 if host is None else host.num_blocks
        for r, pipe in enumerate(self._pipes, start=1):
            region = None if regions is None else regions[r - 1]
            _send(pipe, ("open", (runner.cache.layout, num_host, region)))
        runner.peers = self
        if self.shard.pp > 1:
            runner.stage = Stage(self.shard, runner.model, swap)

    def link(self, regions: Sequence[RegionHandle]) -> None:
        """Move the workers' pools into `regions` (ranks 1..: shared memory the driver
        created), their contents copied, and wait until every worker computes in its
        region: from then on peers reach every rank's KV (`EngineCore.transfer_link`)."""
        for pipe, region in zip(self._pipes, regions, strict=True):
            _send(pipe, ("link", region))
        for rank, pipe in enumerate(self._pipes, start=1):
            if not pipe.poll(group.WAIT_LIMIT_S):
                self.check()
                raise group.RankFailed(
                    f"rank {rank} of this instance did not move its KV pool into shared "
                    f"memory within {group.WAIT_LIMIT_S:.0f} s"
                )
            pipe.recv_bytes()

    def send(self, inputs: StepInputs) -> None:
        """RankFailed, naming it, if a worker has exited (its pipe broke, or before)."""
        self.check()
        try:
            self._broadcast(("step", inputs))
        except OSError:
            self.check()
            raise

    def check(self) -> None:
        """RankFailed if a worker process has exited (a waitpid each, and a look at its
        /proc entry: a few us)."""
        for rank, proc in enumerate(self._procs, start=1):
            how = proc.ended(_REAP_S)
            if how is not None:
                raise group.RankFailed(f"rank {rank} (pid {proc.pid}) of this instance {how}")

    def close(self) -> None:
        """Tell the workers to leave and wait for them (then kill what is left); leave
        the group."""
        with contextlib.suppress(OSError):
            self._broadcast(("close", None))
        for proc in self._procs:
            proc.stop(10.0)
        for pipe in self._pipes:
            pipe.close()
        group.leave()  # the driver's own membership: another engine may join a new group

    def _broadcast(self, msg: tuple[str, Any]) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self._pipes:
            pipe.send_bytes(data)


class RankProcess(Protocol):
    """A worker rank's process, as its driver watches it."""

    @property
    def pid(self) -> int: ...

    def ended(self, wait_s: float) -> str | None:
        """None while it runs; once it has exited, how ("exited with signal SIGKILL").
        A process seen gone but not yet reaped is waited for up to `wait_s`."""
        ...

    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for it to exit (it was told to), then kill it."""
        ...


# Starts the worker ranks named (on the rendezvous port): their processes and pipes, in
# rank order, each worker waiting for its `EngineConfig` on its pipe (`worker_main`).
# `spawn_local` here; Ray's actors in the instance's placement group under
# `serve --ray` (cluster/ray_ranks.py).
Spawn = Callable[[range, int], tuple[list[RankProcess], list[mpc.Connection]]]


class LocalRank:
    """A worker started by `spawn_local`: a child of the driver's process."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    def ended(self, wait_s: float) -> str | None:
        code = self._proc.poll()
        if code is None and group.gone(self._proc.pid):
            # A killed process of many threads shows as a zombie a moment before its
            # last thread is gone and waitpid reports it.
            code = self._proc.wait(wait_s)
        if code is None:
            return None
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        return f"exited with {how}"

    def stop(self, grace_s: float) -> None:
        try:
            self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def spawn_local(ranks: range, port: int) -> tuple[list[RankProcess], list[mpc.Connection]]:
    """Fresh Python processes (not multiprocessing's spawn, which re-runs the caller's
    main module: a script that builds an `LLM` without a `__main__` guard would start
    itself), each given one end of a socket pair."""
    procs: list[RankProcess] = []
    pipes = []
    for rank in ranks:
        mine, theirs = socket.socketpair()
        code = "from pdserve.engine.ranks import worker_entry; worker_entry()"
        args = [str(theirs.fileno()), str(rank), str(port), str(os.getpid())]
        proc = subprocess.Popen([sys.executable, "-c", code, *args], pass_fds=[theirs.fileno()])
        theirs.close()
        procs.append(LocalRank(proc))
        pipes.append(mpc.Connection(mine.detach()))
    return procs, pipes


def _send(pipe: mpc.Connection, msg: tuple[str, Any]) -> None:
    pipe.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def worker_entry() -> None:
    """A worker process's start (`RankGroup.start`'s command line: the socket's fd, the
    rank, the rendezvous port, the driver's pid)."""
    fd, rank, port, driver = (int(a) for a in sys.argv[1:5])
    conn = mpc.Connection(fd)
    worker_main(conn, conn.recv(), rank, port, driver)


def worker_main(
    conn: mpc.Connection, config: EngineConfig, rank: int, port: int, driver: int
) -> None:
    """Rank `rank`: join the group, load the shard, then run what the driver sends."""
    from pdserve.kv.cache import KVCache
    from pdserve.model.quantization import instance_quantization
    from pdserve.model.source import load_config, resolve_model
    from pdserve.parallel.layout import split_model
    from pdserve.parallel.shard import load_shard
    from pdserve.runtime import ended

    config = replace(config, device=group.rank_device(config.device, rank))
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    torch.set_num_threads(rank_threads(config))
    group.join(rank, tp * pp, port, config.device, tp=tp)
    try:
        path = resolve_model(config.model)
        shard = split_model(load_config(path), tp, pp)[rank]
        quant = instance_quantization(config, path)
        model = load_shard(path, shard, config.torch_dtype, quant)
        model.to(config.device)
        if tp > 1:
            model.set_reduce(group.all_reduce_sum)
        runner: ModelRunner | None = None
        gone = ended(driver)
        while True:
            if not conn.poll(_POLL_S):
                if gone():
                    return
                continue
            try:
                kind, body = pickle.loads(conn.recv_bytes())
            except EOFError:  # the driver's end closed: it exited
                return
            if kind == "close":
                return
            if kind == "open":
                driver_layout, host_blocks, region = body
                layout = rank_kv_layout(shard, driver_layout)
                pool = None if region is None else _mapped(region, layout)
                cache = KVCache(layout, host_blocks, config.device, device_tensor=pool)
                runner = ModelRunner(model, cache, kv=None)
                if pp > 1:  # the driver checked the staging against the longest sequence
                    swap = None
                    if config.microbatch_swap_blocks:
                        device = torch.device(config.device)
                        swap = MicrobatchSwap(cache, config.microbatch_swap_blocks, device)
                    runner.stage = Stage(shard, model, swap)
            elif kind == "link":
                assert runner is not None
                pool = _mapped(body, runner.cache.layout)
                pool.copy_(runner.cache.device_tensor)
                runner.cache.device_tensor = pool
                conn.send_bytes(b"linked")
            else:
                assert runner is not None
                # The driver samples; a pipeline's last stage hands its sampling rows back.
                runner.forward(body if runner.stage else replace(body, logit_rows=[]))
    except group.RankFailed:  # another rank exited: the driver ends the instance
        return
    finally:
        group.leave()


def _mapped(region: RegionHandle, layout: KVLayout) -> torch.Tensor:
    """A worker's pool in the shared-memory region its driver created for it."""
    if region.layout != layout:
        raise ValueError(f"{region.describe()} has layout {region.layout}, this rank's is {layout}")
    return map_region(region)


def rank_threads(config: EngineConfig) -> int:
    """Each rank's share of the instance's threads (at least one)."""
    return max(1, config.threads // config.world_size)
