"""Decode attention over the paged KV cache: one padded call vs length groups.

A batched decode call pads every row to the batch's longest context and gathers all
of it; `attention.group_by_length` splits the rows into groups of similar length,
each gathering at most `CPU_GROUP_BYTES`. This times `paged_attention` for one layer
of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks) on
batches of uniform and mixed contexts, all three ways in one run, and prints the
median time per call, per context token, and the speed-up over the padded call.

    .venv/bin/python bench/bench_decode_attention.py --threads 1 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pdserve.model.attention import (
    CPU_GROUP_BYTES,
    GROUP_COST_TOKENS,
    AttentionMetadata,
    SeqSpec,
    paged_attention,
)

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def time_call(lens: list[int], group_cost: int, cap: int | None, repeats: int) -> tuple[float, int]:
    """(median seconds of one paged_attention call, number of decode groups)."""
    blocks = sum(-(-n // BLOCK) for n in lens)
    kc = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    vc = torch.randn_like(kc)
    specs, nxt = [], 0
    for n in lens:
        b = -(-n // BLOCK)
        specs.append(SeqSpec(n - 1, 1, list(range(nxt, nxt + b))))
        nxt += b
    meta = AttentionMetadata.build(specs, BLOCK, None, None, group_cost, cap)
    q = torch.randn(len(lens), HEADS, HEAD_DIM)
    kv = q[:, :KV_HEADS]
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        paged_attention(q, kv, kv, kc, vc, meta, HEAD_DIM**-0.5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]), len(meta.decode_groups)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    cap = CPU_GROUP_BYTES // (2 * KV_HEADS * HEAD_DIM * 4)
    batches = {
        "8 x 1024": [1024] * 8,
        "48 x 330": [330] * 48,
        "48 x 1024": [1024] * 48,
        "48 mixed 20-620": [int(x) for x in rng.integers(20, 620, 48)],
        "64 mixed 4-1024": [int(x) for x in rng.integers(4, 1024, 64)],
    }
    ways = {
        "padded": (10**12, None),
        "groups": (GROUP_COST_TOKENS, None),
        "capped": (GROUP_COST_TOKENS, cap),
    }
    print(
        f"{'batch':>18} "
        + " ".join(f"{w + ' us (ns/tok, groups)':>30}" for w in ways)
        + "  speed-up"
    )
    for name, lens in batches.items():
        got = {w: time_call(lens, c, m, args.repeats) for w, (c, m) in ways.items()}
        cells = [f"{1e6 * t:>10.0f} ({1e9 * t / sum(lens):>4.0f}, {g:>3})" for t, g in got.values()]
        print(f"{name:>18} " + " ".join(f"{c:>30}" for c in cells)
              + f"  {got['padded'][0] / got['capped'][0]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
