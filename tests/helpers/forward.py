"""A model's forward over a real paged KV cache, step by step, as the engine feeds it
(tests of the model itself: tensor-parallel ranks, HF comparisons)."""

from __future__ import annotations

import torch

from pdserve.engine.model_runner import ModelRunner, StepInputs
from pdserve.engine.pipeline import Stage
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model.attention import SeqSpec
from pdserve.model.base import CausalLM
from pdserve.parallel.layout import Shard

BLOCK = 4

# A fixed workload: two prompts prefilled apart (one in two chunks), then three decode
# steps of both in one batch. Each step: (token ids, tokens already cached, sequence).
Step = list[tuple[list[int], int, int]]


def workload(vocab: int, seed: int = 0) -> list[Step]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, vocab, (23,), generator=g).tolist()
    b = torch.randint(0, vocab, (9,), generator=g).tolist()
    steps: list[Step] = [[(a[:12], 0, 0)], [(a[12:20], 12, 0), (b[:8], 0, 1)]]
    for k in range(3):
        steps.append([(a[20 + k : 21 + k], 20 + k, 0), (b[8:9] if k == 0 else [b[k]], 8 + k, 1)])
    return steps


@torch.inference_mode()
def run_steps(
    model: CausalLM, steps: list[Step], blocks: int = 32, shard: Shard | None = None
) -> list[torch.Tensor]:
    """Every step's logits ([new tokens, vocab]; a pipeline's other ranks: empty),
    sequences given blocks in order, through the engine's `ModelRunner` (the compiled
    per-row path where the model has it); `shard`: a pipeline stage's rank (its steps cut
    into micro-batches however few their rows)."""
    c = model.config
    layout = KVLayout(
        c.num_hidden_layers, blocks, BLOCK, c.num_key_value_heads, c.head_dim, "float32"
    )
    runner = ModelRunner(model, KVCache(layout, num_host_blocks=0), kv=None)
    if shard is not None and shard.pp > 1:
        runner.stage = Stage(shard, model)
        runner.stage.min_rows = 1  # cut these few rows into micro-batches too
    tables = {0: list(range(0, blocks // 2)), 1: list(range(blocks // 2, blocks))}
    out = []
    for step in steps:
        ids, pos, specs = [], [], []
        for toks, cached, seq in step:
            ids += toks
            pos += range(cached, cached + len(toks))
            specs.append(SeqSpec(cached, len(toks), tables[seq]))
        rows = list(range(len(ids)))
        final = runner.forward(StepInputs([], [], ids, pos, specs, rows, False))
        out.append(torch.empty(0) if final is None else final.logits)
    return out
