"""The KV hand-off between instances of different layouts: bytes moved and time a request,
against the same layout.

    .venv/bin/python bench/bench_layout_handoff.py [--tokens 512] [--rounds 5] [--json out.json]

The shipped SmolLM2's KV geometry as served (30 layers, 3 KV heads of 64, float16; the
engine's split: at TP 2 one rank holds KV heads 0-1, the other 2; at PP 2 each stage 15
layers). A request of `--tokens` tokens lies in a prefill instance's rank pools (shared-
memory regions, as a parallel instance's are) under a shuffled block table of blocks of
16; each round moves it, for every pair of layouts below, into a decode instance's rank
pools the way a push hand-off does (`plans_between`, then `flush_moves` through the shm
transport: each source rank's shard straight into the destination ranks that hold it).
Layouts alternate within a round; prints the medians of the time a request (planning
included), the bytes moved, the moves (rank pairs) and the contiguous pieces copied, and
each layout's time over the same-layout hand-off's (TP 1, blocks 16 -> 16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer import flush_moves, make_transport, moves_nbytes, plans_between
from pdserve.model.source import load_config, resolve_model
from pdserve.parallel.layout import rank_kv_layout, split_model

# (prefill tp, pp, block), (decode tp, pp, block)
PAIRS = [
    ((1, 1, 16), (1, 1, 16)),
    ((1, 1, 16), (1, 1, 32)),
    ((2, 1, 16), (1, 1, 16)),
    ((1, 1, 16), (2, 1, 16)),
    ((2, 1, 16), (1, 2, 16)),
    ((1, 2, 16), (2, 1, 16)),
    ((2, 1, 16), (2, 1, 16)),
    ((2, 2, 16), (1, 1, 32)),
]


def layouts(tp: int, pp: int, block: int, blocks: int) -> list[KVLayout]:
    config = load_config(resolve_model(None))
    whole = KVLayout(
        config.num_hidden_layers, blocks, block, config.num_key_value_heads, config.head_dim,
        "float16",
    )  # fmt: skip
    return [rank_kv_layout(s, whole) for s in split_model(config, tp, pp)]


def label(side: tuple[int, int, int]) -> str:
    tp, pp, block = side
    return f"TP {tp} x PP {pp}, blocks of {block}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    n = args.tokens
    sender, receiver = make_transport("shm"), make_transport("shm")
    gen = torch.Generator().manual_seed(0)
    cases = []
    for i, (src, dst) in enumerate(PAIRS):
        src_blocks = 2 * -(-n // src[2])
        dst_blocks = 2 * -(-n // dst[2])
        src_table = torch.randperm(src_blocks, generator=gen)[: -(-n // src[2])].tolist()
        dst_table = torch.randperm(dst_blocks, generator=gen)[: -(-n // dst[2])].tolist()
        src_regions = [
            sender.create_region(f"p{i}-{r}", lay)
            for r, lay in enumerate(layouts(*src[:2], src[2], src_blocks))
        ]
        for region in src_regions:
            region.tensor.copy_(torch.randn(region.tensor.shape, generator=gen))
        dst_regions = [
            receiver.create_region(f"d{i}-{r}", lay)
            for r, lay in enumerate(layouts(*dst[:2], dst[2], dst_blocks))
        ]
        cases.append((src, dst, src_regions, src_table, dst_regions, dst_table))
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    shape: dict[int, tuple[int, int, int]] = {}
    for _ in range(args.rounds + 1):  # the first round faults the pools in: not counted
        for i, (_, _, src_regions, src_table, dst_regions, dst_table) in enumerate(cases):
            t0 = time.perf_counter()
            moves = plans_between(
                [r.handle.layout for r in src_regions], src_table,
                [r.handle.layout for r in dst_regions], dst_table, 0, n,
            )  # fmt: skip
            flush_moves(
                sender, moves, [r.tensor for r in src_regions], [r.handle for r in dst_regions]
            )
            times[i].append(time.perf_counter() - t0)
            pieces = sum(p.num_chunks for _, _, p in moves)
            shape[i] = (moves_nbytes(moves), len(moves), pieces)
    rows = []
    base = statistics.median(times[0][1:])
    print(f"{n}-token request, SmolLM2's KV (float16), shm, median of {args.rounds} rounds")
    print("| prefill | decode | bytes | moves | pieces | time | vs same layout |")
    print("|---|---|---|---|---|---|---|")
    for i, (src, dst, *_) in enumerate(cases):
        t = statistics.median(times[i][1:])
        nbytes, pairs, pieces = shape[i]
        rows.append(
            {"prefill": src, "decode": dst, "bytes": nbytes, "moves": pairs, "pieces": pieces,
             "time_s": t, "ratio": t / base}
        )  # fmt: skip
        print(
            f"| {label(src)} | {label(dst)} | {nbytes / 2**20:.2f} MiB | {pairs} | {pieces} | "
            f"{t * 1e3:.2f} ms | {t / base:.2f}x |"
        )
    sender.close()
    receiver.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
