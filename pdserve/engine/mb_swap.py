"""DéjàVu's microbatch swapping (§4.2.2, App. G) for one pipeline stage.

Without it a stage holds the KV of every micro-batch of a step in its device pool. With
it, every block lives in the *home* pool (host memory on a GPU; the scheduler's block ids
are home ids) and the stage computes from a *staging* area on the device of two halves:
before micro-batch k runs, its blocks are copied home -> staging half k % 2 (`stage_in`,
submitted while micro-batch k - 1 computes: the copy overlaps the compute), the part runs
over the staging blocks, and afterwards only the rows this step wrote - its new tokens'
K and V - go back to the home pool (`write_back`). So a stage holds about two
micro-batches' KV instead of all of them, and the batch is bounded by the home pool.

The copies run in order on one thread (a CUDA side stream's work where the staging
tensor is on CUDA): a half's write-back is done before the stage-in that reuses the
half, and `drain` waits for all of them before the step ends (the scheduler's own swap
copies, the next step's, touch the home pool).

Contract: a part's sequences write only blocks no other part of the step reads (parts
are cut at sequence boundaries under swapping, `microbatches(capacity=...)`: a written
block is a sequence's own; shared prefix blocks are read only), and one part's blocks
fit in a half (`half_blocks`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.config import EngineConfig
from pdserve.model.attention import SeqSpec


def blocks_needed(spec: SeqSpec, block_size: int) -> list[int]:
    """The blocks of a sequence's table that hold its context after this step."""
    return list(spec.block_table[: -(-spec.context_len // block_size)])


@dataclass(frozen=True)
class Staged:
    """A part in its staging half: its specs over staging block ids, and its new tokens'
    rows, token-flat, in the home pool and in staging."""

    specs: list[SeqSpec]
    home_rows: torch.Tensor
    staging_rows: torch.Tensor


class HomePool(Protocol):
    """Where a stage's blocks live (a `KVCache`): `device_tensor` is [layers, 2, blocks,
    block_size, kv heads, head dim], contiguous. In a cluster it moves into a shared region
    once the instance first moves KV (`EngineCore.transfer_link`, a worker's "link"), its
    contents copied and its shape kept: the swap reads it at every copy, never keeps it."""

    device_tensor: torch.Tensor


class MicrobatchSwap:
    def __init__(self, pool: HomePool, num_blocks: int, device: torch.device) -> None:
        """`pool`: the stage's home pool; `num_blocks`: the staging area's blocks (two
        halves), on `device`."""
        if num_blocks < 2 or num_blocks % 2:
            raise ValueError(
                f"microbatch swapping needs an even staging area of >= 2 blocks, got {num_blocks}"
            )
        home = pool.device_tensor
        layers, _, _, self.block_size, heads, dim = home.shape
        self.pool = pool
        self.staging = torch.zeros(
            layers, 2, num_blocks, self.block_size, heads, dim, dtype=home.dtype, device=device
        )
        self.half_blocks = num_blocks // 2
        self._staging_rows = self.staging.view(layers, 2, -1, heads * dim)
        self._held = [0, 0]  # blocks staged in each half this step
        self.peak_blocks = 0  # the most blocks staged at once, over the stage's life
        self.copy_s = 0.0  # seconds spent copying (the bench reads it)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="mb-swap")
        self._pending: list[Future[object]] = []
        cuda = self.staging.is_cuda
        self._stream = torch.cuda.Stream(device) if cuda else None

    def begin(self) -> None:
        """A new step: nothing of it is staged yet."""
        self._held = [0, 0]

    def stage_in(self, specs: list[SeqSpec], half: int) -> Future[Staged]:
        """Copy the blocks of `specs` into staging half `half` (on the copy thread)."""
        future = self._copier.submit(self._stage_in, specs, half)
        self._pending.append(future)  # type: ignore[arg-type]
        return future

    def write_back(self, staged: Staged) -> None:
        """Copy the part's new tokens' rows back home (on the copy thread), once the work
        the caller queued on the device has written them."""
        done = None
        if self._stream is not None:
            done = torch.cuda.Event()
            done.record()
        self._pending.append(self._copier.submit(self._write_back, staged, done))

    def drain(self) -> None:
        """Wait for every copy submitted (raising the first one's error)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _stage_in(self, specs: list[SeqSpec], half: int) -> Staged:
        bs = self.block_size
        tables = [blocks_needed(spec, bs) for spec in specs]
        ids: dict[int, int] = {}  # home block -> staging block
        for table in tables:
            for b in table:
                ids.setdefault(b, half * self.half_blocks + len(ids))
        if len(ids) > self.half_blocks:
            raise ValueError(
                f"a micro-batch of {len(ids)} blocks does not fit a staging half of "
                f"{self.half_blocks}"
            )
        home_rows: list[int] = []
        staging_rows: list[int] = []
        staged: list[SeqSpec] = []
        for spec, table in zip(specs, tables, strict=True):
            staged.append(SeqSpec(spec.num_cached, spec.query_len, [ids[b] for b in table]))
            for t in range(spec.num_cached, spec.context_len):
                home_rows.append(table[t // bs] * bs + t % bs)
                staging_rows.append(ids[table[t // bs]] * bs + t % bs)
        src = torch.tensor(list(ids), dtype=torch.long)
        dst = torch.tensor(list(ids.values()), dtype=torch.long)
        with self._copying():
            home = self.pool.device_tensor
            blocks = home[:, :, src].to(self.staging.device, non_blocking=True)
            self.staging.index_copy_(2, dst.to(self.staging.device), blocks)
        self._held[half] = len(ids)
        self.peak_blocks = max(self.peak_blocks, sum(self._held))
        as_long = torch.tensor(home_rows, dtype=torch.long)
        return Staged(staged, as_long, torch.tensor(staging_rows, dtype=torch.long))

    def _write_back(self, staged: Staged, done: torch.cuda.Event | None) -> None:
        if done is not None and self._stream is not None:
            self._stream.wait_event(done)
        with self._copying():
            home = self.pool.device_tensor
            home_rows = home.view(*self._staging_rows.shape[:2], -1, self._staging_rows.shape[3])
            rows = self._staging_rows[:, :, staged.staging_rows.to(self.staging.device)]
            home_rows[:, :, staged.home_rows] = rows.to(home.device, non_blocking=True)

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        start = time.perf_counter()
        if self._stream is None:
            yield
        else:
            with torch.cuda.stream(self._stream):
                yield
            self._stream.synchronize()
        self.copy_s += time.perf_counter() - start


def check_staging(config: EngineConfig, block_size: int, max_model_len: int) -> None:
    """A staging half must hold one sequence of `max_model_len` tokens in blocks of
    `block_size`: ValueError naming both numbers where it cannot."""
    half = config.microbatch_swap_blocks // 2
    longest = -(-max_model_len // block_size)
    if half < longest:
        raise ValueError(
            f"--microbatch-swap-blocks {config.microbatch_swap_blocks}: a half of {half} "
            f"blocks cannot hold one {max_model_len}-token sequence ({longest} blocks of "
            f"{block_size}); give at least {2 * longest} or lower --max-model-len"
        )


def stage_swap(config: EngineConfig, pool: HomePool, max_model_len: int) -> MicrobatchSwap | None:
    """A pipeline stage's microbatch swapping over its pool, where configured
    (`check_staging` first)."""
    if not config.microbatch_swap_blocks:
        return None
    check_staging(config, pool.device_tensor.shape[3], max_model_len)
    return MicrobatchSwap(pool, config.microbatch_swap_blocks, torch.device(config.device))
