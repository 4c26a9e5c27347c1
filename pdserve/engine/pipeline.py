"""A step through the stages of a pipeline-parallel instance, in micro-batches.

Each stage's ranks hold a contiguous run of the layers (pdserve/parallel/layout.py); the
first stage - the driver's - also holds the embedding, the final norm and the LM head.
Every rank gets the whole step's `StepInputs` (engine/ranks.py) and cuts it the same way
into micro-batches (`microbatches`: contiguous runs of rows, as even as they go, a
sequence cut between two of them where a run ends inside it). A stage runs its layers
on micro-batch k, hands the hidden rows on to the next stage and takes micro-batch k + 1
while the next stage runs k: the stages overlap. The last stage hands back the rows that
sample, and the driver turns them into logits; a micro-batch with none (a prompt's chunk
that samples nothing) is handed back as one row, so every micro-batch comes back: a step
ends on the driver once every stage has run it, with its KV in every rank's pool (what a
KV hand-off to another instance reads right after the step).

Why the ends live on the driver: the hand back carries [rows, hidden] instead of [rows,
vocab] (576 floats a row instead of 49,152 on SmolLM2), and a model with tied
embeddings keeps one copy of that matrix, not one per end.

Exactness: a sequence cut between micro-batches runs its second part after its first on
every stage (a stage takes micro-batches in order), so its attention reads the first
part's KV from the pool, as a chunked prefill does. The compiled per-row path gives a
row the same bits in any batch, so a pipeline's logits are one process's.

Contract: every rank of the instance runs `forward` on the same inputs in the same order;
the sends are asynchronous and waited for at the end of the step (a stage never blocks
handing on a micro-batch its successor has not asked for yet).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.mb_swap import MicrobatchSwap, Staged, blocks_needed
from pdserve.model.attention import SeqSpec
from pdserve.model.base import CausalLM, FinalStates
from pdserve.parallel import group
from pdserve.parallel.layout import Shard

# The fewest rows a micro-batch has. A part's layers stream the stage's weights whatever
# its rows: on 2 CPU cores a stage ran 4 decode rows in 15 ms and 8 in 19 (SmolLM2 Q4_1,
# 15 layers, one thread), so cutting 8 rows in two cost more than the stages' overlap gave
# (a step 58 ms against 50 uncut), while a 512-row prefill gained (1.45 s uncut, 1.15 in
# two). Cutting pays once the rows' own work passes the weights' stream: tens of rows here.
MIN_PART_ROWS = 32

# The runner's: this stage's layers over one part's rows (it builds the part's metadata),
# reading and writing the KV pool given (the stage's own, or microbatch swapping's staging).
# run(h, positions, specs, pool, last): the stage's layers over one micro-batch; `last`:
# the step's last micro-batch, after which each layer has run on every row of the step
# (the layer hooks fire then: once a step, as without a pipeline).
RunLayers = Callable[[torch.Tensor, torch.Tensor, list[SeqSpec], torch.Tensor, bool], torch.Tensor]


@dataclass(frozen=True)
class Part:
    """One micro-batch: rows [start, stop) of the step, its sequences' specs (a cut
    sequence's part of them) and its rows that sample (numbered within the part)."""

    start: int
    stop: int
    specs: list[SeqSpec]
    logit_rows: list[int]


def microbatches(
    specs: list[SeqSpec],
    logit_rows: list[int],
    parts: int,
    min_rows: int = 1,
    capacity: int = 0,
    block_size: int = 1,
) -> list[Part]:
    """The step's rows (the specs' query rows, in order) cut into at most `parts`
    contiguous runs of as even a size as they go, none under `min_rows` (one run if the
    step has fewer). With a `capacity` (blocks: microbatch swapping's staging half), cut
    at sequence boundaries only, as many runs as keep each one's blocks within it."""
    total = sum(s.query_len for s in specs)
    parts = max(1, min(parts, total // min_rows))
    if capacity:
        return _packed(specs, logit_rows, -(-total // parts), capacity, block_size)
    bounds = [total * k // parts for k in range(parts + 1)]
    out: list[Part] = []
    row = 0  # first row of the spec `spec`
    i, spec = 0, specs[0] if specs else None
    for start, stop in itertools.pairwise(bounds):
        cut: list[SeqSpec] = []
        while spec is not None and row < stop:
            lo, hi = max(start, row), min(stop, row + spec.query_len)
            cut.append(SeqSpec(spec.num_cached + lo - row, hi - lo, spec.block_table))
            if hi < row + spec.query_len:
                break  # the rest of this sequence opens the next part
            row += spec.query_len
            i += 1
            spec = specs[i] if i < len(specs) else None
        rows = [r - start for r in logit_rows if start <= r < stop]
        out.append(Part(start, stop, cut, rows))
    return out


def _packed(
    specs: list[SeqSpec], logit_rows: list[int], rows: int, capacity: int, block_size: int
) -> list[Part]:
    """Whole sequences into parts of up to `rows` rows (a longer sequence alone) and of
    at most `capacity` distinct blocks each."""
    out: list[Part] = []
    cut: list[SeqSpec] = []
    held: set[int] = set()
    start = row = 0
    for spec in specs:
        mine = set(blocks_needed(spec, block_size))
        if len(mine) > capacity:
            raise ValueError(
                f"a sequence of {len(mine)} blocks does not fit a staging half of {capacity}"
            )
        if cut and (row - start + spec.query_len > rows or len(held | mine) > capacity):
            out.append(_part(cut, start, row, logit_rows))
            cut, held, start = [], set(), row
        cut.append(spec)
        held |= mine
        row += spec.query_len
    if cut:
        out.append(_part(cut, start, row, logit_rows))
    return out


def _part(specs: list[SeqSpec], start: int, stop: int, logit_rows: list[int]) -> Part:
    return Part(start, stop, specs, [r - start for r in logit_rows if start <= r < stop])


class Stage:
    """One rank's place in the pipeline: what it runs and whom it hands rows to."""

    def __init__(self, shard: Shard, model: CausalLM, swap: MicrobatchSwap | None = None) -> None:
        """`swap`: DéjàVu's microbatch swapping of this stage's KV (engine/mb_swap.py)."""
        self.shard, self.model, self.swap = shard, model, swap
        tp = shard.tp
        self.prev = shard.rank - tp if not shard.first else None
        self.next = shard.rank + tp if not shard.last else None
        self.last_lead = (shard.pp - 1) * tp  # the last stage's tensor rank 0
        self.parts = shard.pp  # micro-batches a step: one in each stage at best
        self.min_rows = MIN_PART_ROWS  # (tests cut tiny steps with 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        specs: list[SeqSpec],
        logit_rows: list[int],
        pool: torch.Tensor,
        run: RunLayers,
        per_row: bool,
    ) -> FinalStates | None:
        """This rank's share of one step (see the module docstring); the driver returns
        the sampling rows' final states (None if none sample), the other ranks None.
        `pool`: the stage's KV pool; `run(h, positions, specs, pool, last)` runs its layers
        over a part (`RunLayers`); `per_row`: on the compiled per-row path (the final norm too)."""
        s, hidden, swap = self.shard, self.model.config.hidden_size, self.swap
        if swap is None:
            parts = microbatches(specs, logit_rows, self.parts, self.min_rows)
        else:
            bs = swap.block_size
            parts = microbatches(specs, logit_rows, self.parts, self.min_rows, swap.half_blocks, bs)
            swap.begin()
            staging = [swap.stage_in(parts[0].specs, 0)]
        pending: list[group.Sending] = []
        sampled: list[int] = []  # rows each part hands back
        for k, part in enumerate(parts):
            ids, pos = input_ids[part.start : part.stop], positions[part.start : part.stop]
            staged: Staged | None = None
            if swap is not None:
                staged = staging[k].result()
                if k + 1 < len(parts):  # the next part's blocks come in while this one runs
                    staging.append(swap.stage_in(parts[k + 1].specs, (k + 1) % 2))
            if self.prev is None:
                h = self.model.embed(ids)
            else:
                h = group.recv(torch.empty(part.stop - part.start, hidden), self.prev)
            if staged is None:
                h = run(h, pos, part.specs, pool, k == len(parts) - 1)
            else:
                assert swap is not None
                h = run(h, pos, staged.specs, swap.staging, k == len(parts) - 1)
                swap.write_back(staged)
            if self.next is not None:
                pending.append(group.send(h, self.next))
            elif s.tp_rank == 0:  # its sampling rows, or one row saying the part is done
                out = h[torch.tensor(part.logit_rows)] if part.logit_rows else h[:1]
                pending.append(group.send(out.contiguous(), 0))
            sampled.append(len(part.logit_rows))
        final = None
        if s.rank == 0:  # every part comes back: the step has run on every stage
            back = [group.recv(torch.empty(max(n, 1), hidden), self.last_lead) for n in sampled]
            rows = [h for h, n in zip(back, sampled, strict=True) if n]
            if rows:
                h = torch.cat(rows) if len(rows) > 1 else rows[0]
                final = self.model.finish(h, torch.arange(h.shape[0]), per_row)
        for sending in pending:
            sending.wait()
        if swap is not None:
            swap.drain()
        return final
