"""The quantized product alone against oneDNN's fp32 one, same weights, one run.

    .venv/bin/python bench/bench_quant_kernels.py [--threads 2] [--repeats 40]

For the shipped model's two projection shapes (gate/up: N 3072 x K 576; down: 576 x
1536), Q4_1 and Q8_0 blocks, M = 1, 8, 64, 256 activation rows: the median time of
`QuantLinear` (pdserve/quant) and of `PackedLinear` (oneDNN's packed fp32 inner
product, what `--quantization none` runs) on the dequantized copy of the same weights,
alternating. Weights stay hot in cache here, so a GEMV reads as compute; in a model
step the weights stream from memory (bench/bench_engine.py measures that).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.model.linear import PackedLinear
from pdserve.quant.formats import QuantType, QuantWeight
from pdserve.quant.linear import QuantLinear

SHAPES = ((3072, 576), (576, 1536))
ROWS = (1, 8, 64, 256)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"threads={args.threads}; GMAC/s = M*N*K multiply-adds per second")
    print("| shape N x K | format | M | blocks GMAC/s | fp32 oneDNN GMAC/s | blocks / fp32 |")
    print("|---|---|---:|---:|---:|---:|")
    for n, k in SHAPES:
        for qtype in (QuantType.Q4_1, QuantType.Q8_0):
            qw = QuantWeight.quantize(torch.randn(n, k, generator=gen), qtype)
            quant, fp32 = QuantLinear(qw, None), PackedLinear(qw.dequantize(), None, pack=True)
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                reps = args.repeats if m < 64 else max(5, args.repeats // 4)
                tq = median_time(lambda: quant(x), reps)  # noqa: B023
                tf = median_time(lambda: fp32(x), reps)  # noqa: B023
                rate = m * n * k / 1e9
                print(
                    f"| {n} x {k} | {qtype.name} | {m} | {rate / tq:.1f} | {rate / tf:.1f} "
                    f"| {tf / tq:.2f}x |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
