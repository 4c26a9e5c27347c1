"""Turns a scheduled step into tensors, runs the model, returns logits to sample.

The runner owns the model and the KV tensors. It executes the scheduler's swap
plans (all swap-outs, then swap-ins) before the forward pass, because the device
blocks a swap-out released may already be reassigned in the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.kv.cache import KVCache
from pdserve.kv.manager import KVManager
from pdserve.model.attention import CPU_GROUP_BYTES, AttentionMetadata, GatherWorkspace, SeqSpec
from pdserve.model.base import CausalLM, ForwardHooks


def max_group_tokens(cache: KVCache) -> int:
    """Context tokens whose gathered K + V (one layer) fill `CPU_GROUP_BYTES`."""
    t = cache.device_tensor
    per_token = 2 * t.shape[-2] * t.shape[-1] * t.element_size()
    return max(cache.block_size, CPU_GROUP_BYTES // per_token)


@dataclass(frozen=True)
class StepResult:
    sampled: list[ScheduledSeq]  # sequences that sample this step, in row order
    logits: torch.Tensor | None  # [len(sampled), vocab]
    hidden: torch.Tensor | None  # [len(sampled), hidden]: final-norm states (length head)
    argmax: torch.Tensor | None = None  # [len(sampled)] int64: each logits row's argmax


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, kv: KVManager) -> None:
        self.model = model
        self.cache = cache
        self.kv = kv
        self.hooks: ForwardHooks | None = None
        self.workspace = GatherWorkspace()
        self.device = cache.device_tensor.device
        # The gather cap is a CPU cache size; a GPU's batched kernels prefer size.
        self.max_group_tokens = max_group_tokens(cache) if self.device.type == "cpu" else None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run one step: the sequences that sample (in row order), their logits and their
        final hidden states (None when nothing samples)."""
        for plan in sched.swap_out:
            self.cache.swap_out(plan.copies)
        for plan in sched.swap_in:
            self.cache.swap_in(plan.copies)
        if sched.empty:
            return StepResult([], None, None)
        # Single-token rows first: attention batches them in one call (see attention.py).
        seqs = sorted(sched.seqs, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, specs, logit_rows = self._flatten(seqs)
        meta = AttentionMetadata.build(
            specs,
            self.cache.block_size,
            self.model.sliding_window,
            self.workspace,
            max_group_tokens=self.max_group_tokens,
            per_row=self.model.fused,
        ).to(self.device)
        sampled = [s for s in seqs if s.samples]
        # Every row greedy: the compiled step takes the argmax too (FinalStates.argmax); a
        # greedy row with penalties or logprobs leaves it unused (the sampler decides).
        greedy = all(s.request.params.temperature == 0.0 for s in sampled)
        args = (
            self._ids(input_ids),
            self._ids(positions),
            self.cache.device_tensor,
            meta,
            self._ids(logit_rows),
            self.hooks,
            greedy,
        )
        out = self.model.hidden_and_logits(*args)
        if not sampled:  # only partial prompt chunks: no rows, so no LM head ran
            return StepResult([], None, None)
        return StepResult(sampled, out.logits, out.hidden, out.argmax)

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
            specs.append(SeqSpec(start, s.num_new_tokens, self.kv.block_table(req.request_id)))
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
