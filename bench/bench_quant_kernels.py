"""The quantized product alone against oneDNN's fp32 one, same weights, one run.

    .venv/bin/python bench/bench_quant_kernels.py [--threads 2] [--repeats 40]
        [--formats Q4_1,Q8_0] [--int8] [--stream]

For the shipped model's two projection shapes (gate/up: N 3072 x K 576; down: 576 x
1536; the K formats, whose rows are 256-value blocks, down only), each format asked
(default Q4_1 and Q8_0; any of pdserve.quant's: random blocks with small fp16 scales),
M = 1, 8, 64, 256 activation rows: the median time of
`QuantLinear` (pdserve/quant) and of `PackedLinear` (oneDNN's packed fp32 inner
product, what `--quantization none` runs) on the dequantized copy of the same weights,
alternating. Weights stay hot in cache here, so a GEMV reads as compute; in a model
step the weights stream from memory (bench/bench_engine.py measures that). With
`--int8`, a third column: the same weights with int8 activations (`--activations int8`,
pdserve/kernels/_int8.c), timed in the same alternation.

`--stream` measures what a batch-1 decode step's products are bound by instead: the
weights of 30 layers of the shipped model's shapes (q/k/v 960 x 576, o 576 x 576,
gate/up 3072 x 576, down 576 x 1536; Q4_1, 66 MB in int8 records - twice the L3), one
GEMV each in a step's order, so each comes from memory; the bytes per second of a pass
with each kernel, against a plain read of the same bytes (torch's sum over one tensor
of that size), alternating. The kernels are called through the binding directly (~1 us
of Python a call, ~0.1 ms of a pass).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pdserve.kernels import kernels
from pdserve.model.linear import PackedLinear
from pdserve.quant.formats import QuantType, QuantWeight
from pdserve.quant.linear import QuantLinear

SHAPES = ((3072, 576), (576, 1536))
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # q/k/v, o, gate/up, down
LAYERS = 30
ROWS = (1, 8, 64, 256)


# Where each format's fp16 scale fields sit in its block (the rest is values and 6-bit
# scales: any bytes are valid there).
SCALE_FIELDS = {"Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}


def random_blocks(qtype: QuantType, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    raw = rng.integers(0, 256, size=(n, k // qtype.block_values, qtype.block_bytes), dtype=np.uint8)
    for at in SCALE_FIELDS.get(qtype.name, (0,)):
        scales = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = scales[..., None].view(np.uint8)
    return QuantWeight.from_blocks(qtype, raw.reshape(n, -1), k)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def stream(threads: int, repeats: int) -> None:
    """See the module docstring (`--stream`)."""
    mod = kernels()
    assert mod is not None, "the compiled kernels are needed"
    rng = np.random.default_rng(0)
    weights = [
        random_blocks(QuantType.Q4_1, n, k, rng) for _ in range(LAYERS) for n, k in LAYER_SHAPES
    ]
    ops_of: dict[str, list[QuantLinear]] = {
        "int8 activations": [QuantLinear(w, None, "int8") for w in weights],
        "fp32 activations": [QuantLinear(w, None) for w in weights],
    }
    rows = torch.randn(1, 1536)
    y = torch.empty(1, 3072)

    def pass_of(ops: list[QuantLinear]) -> Callable[[], None]:
        calls = [(op.kernel_calls[0], op.in_features, op.out_features) for op in ops]
        xp, yp = rows.data_ptr(), y.data_ptr()

        def run() -> None:
            for (layout, qs, d, m, n, _), k, _n in calls:
                if layout < 0:
                    mod.qlinear_int8(qs, d, n, k, xp, k, 1, yp, n, threads, 0, 0, 0.0, False)
                else:
                    mod.qlinear(layout, xp, k, 1, k, qs, d, m, n, yp, n, threads, 0, 0, 0.0, False)

        return run

    nbytes = {name: sum(op.nbytes for op in ops) for name, ops in ops_of.items()}
    fns = {name: pass_of(ops) for name, ops in ops_of.items()}
    flat = torch.ones(max(nbytes.values()) // 4)
    times: dict[str, list[float]] = {name: [] for name in [*fns, "read"]}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(median_time(fn, 1))
        times["read"].append(median_time(flat.sum, 1))
    read = flat.numel() * 4 / statistics.median(times["read"]) / 1e9
    print(f"threads={threads}; 120 cold GEMVs (M = 1) of 30 layers' shapes, Q4_1; ", end="")
    print(f"medians of {repeats}")
    print("| kernel | MB per pass | ms per pass | GB/s | of a plain read |")
    print("|---|---:|---:|---:|---:|")
    for name in fns:
        t = statistics.median(times[name])
        rate = nbytes[name] / t / 1e9
        mb = nbytes[name] / 1e6
        print(f"| {name} | {mb:.0f} | {t * 1e3:.2f} | {rate:.1f} | {rate / read:.2f} |")
    print(f"| plain read (torch sum) | {flat.numel() * 4 / 1e6:.0f} | - | {read:.1f} | 1 |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--formats", default="Q4_1,Q8_0", help="comma-separated GGUF formats")
    ap.add_argument("--int8", action="store_true", help="also time int8 activations")
    ap.add_argument("--stream", action="store_true", help="cold GEMVs of a decode step instead")
    args = ap.parse_args()
    if args.stream:
        torch.set_num_threads(args.threads)
        stream(args.threads, args.repeats)
        return 0
    formats = [QuantType.parse(f) for f in args.formats.split(",")]
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    print(f"threads={args.threads}; GMAC/s = M*N*K multiply-adds per second")
    extra = " int8 GMAC/s | int8 / fp32 |" if args.int8 else ""
    print(
        f"| shape N x K | format | M | blocks GMAC/s | fp32 oneDNN GMAC/s | blocks / fp32 |{extra}"
    )
    print("|---|---|---:|---:|---:|---:|" + ("---:|---:|" if args.int8 else ""))
    for n, k in SHAPES:
        for qtype in formats:
            if k % qtype.block_values:
                continue
            qw = random_blocks(qtype, n, k, rng)
            quant, fp32 = QuantLinear(qw, None), PackedLinear(qw.dequantize(), None, pack=True)
            int8 = QuantLinear(qw, None, "int8") if args.int8 else None
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                reps = args.repeats if m < 64 else max(5, args.repeats // 4)
                tq = median_time(lambda: quant(x), reps)  # noqa: B023
                tf = median_time(lambda: fp32(x), reps)  # noqa: B023
                rate = m * n * k / 1e9
                row = (
                    f"| {n} x {k} | {qtype.name} | {m} | {rate / tq:.1f} | {rate / tf:.1f} "
                    f"| {tf / tq:.2f}x |"
                )
                if int8 is not None:
                    ti = median_time(lambda: int8(x), reps)  # noqa: B023
                    row += f" {rate / ti:.1f} | {tf / ti:.2f}x |"
                print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
