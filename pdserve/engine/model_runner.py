"""Turns a scheduled step into tensors, runs the model, returns logits to sample.

The runner owns the model and the KV tensors. It executes the scheduler's swap
plans (all swap-outs, then swap-ins) before the forward pass, because the device
blocks a swap-out released may already be reassigned in the same step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from pdserve.engine.pipeline import Stage
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.kv.cache import KVCache
from pdserve.kv.manager import KVManager
from pdserve.model.attention import (
    CPU_GROUP_BYTES,
    AttentionMetadata,
    GatherWorkspace,
    RowRanges,
    SeqSpec,
    slots_of,
)
from pdserve.model.base import CausalLM, FinalStates, ForwardHooks


def max_group_tokens(cache: KVCache) -> int:
    """Context tokens whose gathered K + V (one layer) fill `CPU_GROUP_BYTES`."""
    t = cache.device_tensor
    per_token = 2 * t.shape[-2] * t.shape[-1] * t.element_size()
    return max(cache.block_size, CPU_GROUP_BYTES // per_token)


@dataclass(frozen=True)
class StepInputs:
    """One step as every rank of an instance runs it (a tensor-parallel instance's driver
    sends it to the other ranks, engine/ranks.py): the swap plans' block
    copies, then the forward's flattened tokens, positions and per-sequence block
    tables, the rows that sample, and whether they all sample greedily."""

    swap_out: list[list[tuple[int, int]]]  # each swap plan's (src, dst) block copies
    swap_in: list[list[tuple[int, int]]]
    input_ids: list[int]
    positions: list[int]
    specs: list[SeqSpec]
    logit_rows: list[int]
    greedy: bool


class StepPeers(Protocol):
    """The other ranks of the instance (engine/ranks.py): sent each step's
    inputs before the driver runs them; they run the same forward on their shards."""

    def send(self, inputs: StepInputs) -> None: ...

    def check(self) -> None:
        """Raise (parallel.group.RankFailed) if another rank has exited."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class StepResult:
    sampled: list[ScheduledSeq]  # sequences that sample this step, in row order
    logits: torch.Tensor | None  # [len(sampled), vocab]
    hidden: torch.Tensor | None  # [len(sampled), hidden]: final-norm states (length head)
    argmax: torch.Tensor | None = None  # [len(sampled)] int64: each logits row's argmax


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, kv: KVManager | None) -> None:
        """`kv`: the block tables of the sequences a step runs (None on a tensor-parallel
        worker rank, which only runs the driver's `StepInputs`)."""
        self.model = model
        self.cache = cache
        self.kv = kv
        self.hooks: ForwardHooks | None = None
        self.peers: StepPeers | None = None  # a parallel instance's other ranks
        self.stage: Stage | None = None  # a pipeline stage's place (engine/pipeline.py)
        self.workspace = GatherWorkspace()
        self.device = cache.device_tensor.device
        # The compiled per-row path where the model has one and its attention reads this
        # pool (fp32 or fp16: a bfloat16 pool beside fp32 weights takes the torch path).
        self.per_row = model.fused and cache.device_tensor.dtype in (torch.float32, torch.float16)
        # The gather cap is a CPU cache size; a GPU's batched kernels prefer size.
        self.max_group_tokens = max_group_tokens(cache) if self.device.type == "cpu" else None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run one step: the sequences that sample (in row order), their logits and their
        final hidden states (None when nothing samples)."""
        # Single-token rows first: attention batches them in one call (see attention.py).
        seqs = sorted(sched.seqs, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, specs, logit_rows = self._flatten(seqs)
        sampled = [s for s in seqs if s.samples]
        inputs = StepInputs(
            [list(plan.copies) for plan in sched.swap_out],
            [list(plan.copies) for plan in sched.swap_in],
            input_ids,
            positions,
            specs,
            logit_rows,
            # Every row greedy: the compiled step takes the argmax too (FinalStates.argmax);
            # a greedy row with penalties or logprobs leaves it unused (the sampler decides).
            all(s.request.params.temperature == 0.0 for s in sampled),
        )
        if self.peers is not None:
            self.peers.send(inputs)
        out = self.forward(inputs)
        if out is None or not sampled:  # no rows, or only partial prompt chunks: no head ran
            return StepResult([], None, None)
        return StepResult(sampled, out.logits, out.hidden, out.argmax)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> FinalStates | None:
        """The step's swaps (all swap-outs, then swap-ins), then its forward; None for a
        step with no rows."""
        for copies in inputs.swap_out:
            self.cache.swap_out(copies)
        for copies in inputs.swap_in:
            self.cache.swap_in(copies)
        if not inputs.input_ids:
            return None
        ids, positions = self._ids(inputs.input_ids), self._ids(inputs.positions)
        if self.stage is not None:
            return self.stage.forward(
                ids,
                positions,
                inputs.specs,
                inputs.logit_rows,
                self.cache.device_tensor,
                self._run_layers,
                self.per_row,
            )
        return self.model.hidden_and_logits(
            ids,
            positions,
            self.cache.device_tensor,
            self._metadata(inputs.specs),
            self._ids(inputs.logit_rows),
            self.hooks,
            inputs.greedy,
        )

    def _metadata(self, specs: list[SeqSpec]) -> AttentionMetadata:
        return AttentionMetadata.build(
            specs,
            self.cache.block_size,
            self.model.sliding_window,
            self.workspace,
            max_group_tokens=self.max_group_tokens,
            per_row=self.per_row,
        ).to(self.device)

    def _run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        specs: list[SeqSpec],
        pool: torch.Tensor,
        last: bool,
    ) -> torch.Tensor:
        """A pipeline stage's layers over one micro-batch, on `pool` (engine/pipeline.py);
        the hooks fire on the step's last micro-batch only (`RunLayers`)."""
        hooks = self.hooks if last else None
        return self.model.run_layers(h, positions, pool, self._metadata(specs), hooks)

    @property
    def bursts(self) -> bool:
        """Whether `execute_burst` runs here (the model's compiled one-call path)."""
        return (
            self.device.type == "cpu"
            and self.per_row
            and self.peers is None
            and self.model.burst_call() is not None
        )

    @torch.inference_mode()
    def execute_burst(
        self, seqs: Sequence[ScheduledSeq], steps: int, stop: Collection[int]
    ) -> list[list[int]]:
        """Up to `steps` greedy decode steps of `seqs` (each a decode row: one new token
        that samples) in one call, each sequence's blocks already covering them
        (`Scheduler.extend`). Returns each step's tokens, a list per step in `seqs` order:
        the argmax a step of its own would sample. Ends after a step that samples a token
        of `stop`. The caller commits the steps (`Scheduler.advance`) and checks each
        token's stop conditions. Requires `bursts`."""
        bs, t = self.cache.block_size, len(seqs)
        specs: list[SeqSpec] = []
        last: list[int] = []
        for s in seqs:
            req = s.request
            assert s.num_new_tokens == 1 and s.samples
            k = req.num_computed_tokens
            specs.append(SeqSpec(k, steps, self._table(req.request_id)))
            last.extend(_token_slice(req.prompt_token_ids, req.output_token_ids, k, k + 1))
        ranges = RowRanges.build(specs, bs, self.model.sliding_window)
        rows = ranges.rows.view(t, steps, 3).transpose(0, 1).contiguous().view(-1, 3)
        positions = torch.tensor(
            [[spec.num_cached + k for spec in specs] for k in range(steps)], dtype=torch.long
        )
        slots = torch.tensor([slots_of(spec, bs) for spec in specs], dtype=torch.long)
        tokens = torch.empty(steps + 1, t, dtype=torch.long)
        tokens[0] = torch.tensor(last, dtype=torch.long)
        call = self.model.burst_call()
        assert call is not None
        done = call.decode_burst(
            tokens,
            positions,
            slots.t().contiguous(),
            RowRanges(rows, ranges.tables),
            self.cache.device_tensor,
            torch.tensor(sorted(stop), dtype=torch.long),
        )
        return cast(list[list[int]], tokens[1 : done + 1].tolist())

    def _table(self, request_id: str) -> list[int]:
        assert self.kv is not None, "a worker rank runs the driver's StepInputs only"
        return self.kv.block_table(request_id)

    def _ids(self, values: list[int]) -> torch.Tensor:
        ids = torch.tensor(values, dtype=torch.long)
        return ids if self.device.type == "cpu" else ids.to(self.device, non_blocking=True)

    def _flatten(
        self, seqs: Sequence[ScheduledSeq]
    ) -> tuple[list[int], list[int], list[SeqSpec], list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        specs: list[SeqSpec] = []
        logit_rows: list[int] = []
        for s in seqs:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            input_ids.extend(_token_slice(req.prompt_token_ids, req.output_token_ids, start, end))
            positions.extend(range(start, end))
            specs.append(SeqSpec(start, s.num_new_tokens, self._table(req.request_id)))
            if s.samples:
                logit_rows.append(len(input_ids) - 1)
        return input_ids, positions, specs, logit_rows


def _token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n : end - n]
    return prompt[start:] + output[: end - n]
