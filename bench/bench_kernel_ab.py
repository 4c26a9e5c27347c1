"""Two builds of the compiled kernels, A/B in one process, on the same weights.

    git show REV:pdserve/kernels/_kernels.c > /tmp/a/_kernels.c   # and the other .c and .h
    .venv/bin/python bench/bench_kernel_ab.py --build /tmp/a --build pdserve/kernels \\
        [--formats Q4_1,Q8_0] [--rows 8,64,256] [--activations int8] [--attention]

Each `--build` folder's C files are compiled (the flags of setup.py) into a private
`_kernels.so` and loaded under its own name; the same `QuantLinear` then calls each
build's `qlinear` in turn (alternating, so the machine's drift hits both) and the
outputs are asserted bit-identical - a kernel change that keeps the contract
(pdserve/kernels/README.md) gives the same bits. Prints each build's GMAC/s (medians) and
B's time over A's as a speed-up, for the shipped model's projection shapes (hot in
cache: the kernels' own rate). `--activations int8` times `_int8.c`'s kernels instead.

`--step` times a whole decode step's layers instead (`fused_layers`, pdserve/model/fused.py,
with the final norm and LM head it runs after them; both builds must take the binding's
current arguments):
the shipped model served as `--quantization gguf --activations int8` (or the
`--activations` given), `--batch`
sequences of 256 random prompt tokens decoding; each step's layers run twice from the
same input, once per build (which goes first alternates), the outputs asserted
bit-identical - the real weights on their 2 MB pages and the real KV cache. Prints the
layers' time per build (the LM head with them) and what the rest of a step took
(metadata, sampling, Python). With `--whole`, each step runs one build's layers
instead, the builds taking turns, and whole steps are timed: what a change costs or
saves around the layers too (a cache it leaves colder, say). No bit check then. With
`--block N` the builds take turns every N steps instead, and each block's first 2 steps
are left out: what a change leaves in the caches for the next step (the KV, Python's
objects) is then its own, where alternating every step hands it to the other build.
With `--layers N` each call runs only the first N layers and the final norm (the LM head
is left to the step's Python, untimed): with N = 2 their weights (~4.4 MB) stay in cache
from step to step, so the layers' own cost shows apart from the memory's (the tokens
are then not the model's).

`AB_CFLAGS_B=-DPHASES` builds B with a timer per phase of the team's step (_kernels.h,
PHASES; printed at exit).

`AB_CFLAGS_A` / `AB_CFLAGS_B` add compiler flags to one build (`-DNAME=value` to try a
variant of a constant without a second folder).

`--attention` times `paged_attention` instead (the compiled attention, `_attention.c`)
in SmolLM2's shape (9 query heads, 3 KV heads, head dim 64, 16-token blocks): decode
steps of 1, 8 and 32 sequences at 256 tokens of context over 30 layers' caches (on 2 MB
pages, as the served pool is), their blocks scattered over the pool as in a server that
has run a while, and one 512-token prefill chunk; which build goes first alternates, the
outputs are asserted bit-identical, and the KV bytes read per second printed. The 30
layers' KV (12 MB at batch 1) fits the 32 MB L3, so the "weights read between" cases read
~2.2 MB of other memory before each call, as a step's weights stream between its
attention calls, and time the calls alone: the KV then comes from memory, as it does in
a real step. First it prints what plain reads of the same 12 KB blocks reach
(bench/reads.py's `block_read`: in address order, shuffled, shuffled with the next block
asked for): the ceilings of the KV GB/s columns. `--kv16 B` makes B read an fp16 cache
of the same values (A reads them in fp32: the bits must still be the same; what the fp16
cache saves), `--kv16 AB` both builds (a change to the fp16 path).

Every mode ends with where the machine had the two cores at the run's start and at its
end (bench/reads.py's `placement`: one CCD or two). It can move them within a minute; a
run that began on two CCDs and ended on one says so, and is a mix of the two, not a
two-CCD result. `--threads N` runs every mode on N threads (`--step` too: the engine's
own thread count is set back after it is made).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import reads
from bench_quant_kernels import random_blocks

from pdserve.memory import huge_page_zeros
from pdserve.quant.formats import QuantType
from pdserve.quant.linear import QuantLinear

SHAPES = ((3072, 576), (1728, 576), (576, 1536))  # gate/up, q/k/v, down


def build(folder: Path, out: Path) -> Path:
    """Compile folder's C files (_kernels.c, _attention.c, _int8.c) into out/_kernels.so
    (setup.py's flags)."""
    out.mkdir(parents=True, exist_ok=True)
    so = out / "_kernels.so"
    include = sysconfig.get_paths()["include"]
    cmd = [
        "gcc",
        *os.environ.get("AB_CFLAGS_" + out.name.upper(), "").split(),
        "-shared",
        "-fPIC",
        "-O3",
        "-fopenmp",
        "-ffp-contract=off",
        "-std=gnu11",
    ]
    cmd += [f"-I{include}", f"-I{folder}", *sorted(str(c) for c in folder.glob("*.c"))]
    cmd += ["-o", str(so)]
    subprocess.run(cmd, check=True)
    return so


def load(name: str, so: Path) -> ModuleType:
    """The module in `so` under `name` (its last part must be `_kernels`: the init name)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    spec = importlib.util.spec_from_file_location(name, so, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t copied onto 2 MB pages, as the served KV pool is (pdserve/memory.py)."""
    out = huge_page_zeros(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def attention_case(
    batch: int, context: int, chunk: int, rng: torch.Generator, f16: bool = False
) -> dict:
    """Caches of LAYERS layers and the per-row ranges of a step: `batch` sequences of
    `context` tokens decoding one row each, or (chunk > 0) one sequence's last `chunk`
    prompt rows. With `f16`, the values are fp16's and "caches16" holds them as fp16."""
    blocks_per_seq = -(-context // BLOCK)
    n_blocks = batch * blocks_per_seq
    order = torch.randperm(n_blocks, generator=rng).to(torch.int32)
    tables = order.view(batch, blocks_per_seq).contiguous()
    q_rows = chunk if chunk else batch
    rows = torch.zeros(q_rows, 3, dtype=torch.int32)
    if chunk:
        rows[:, 2] = torch.arange(context - chunk + 1, context + 1, dtype=torch.int32)
    else:
        rows[:, 0] = torch.arange(batch, dtype=torch.int32)
        rows[:, 2] = context
    shape = (n_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    values = [[torch.randn(shape, generator=rng) for _ in range(2)] for _ in range(LAYERS)]
    if f16:
        values = [[t.half().float() for t in layer] for layer in values]
    caches = [tuple(on_huge_pages(t) for t in layer) for layer in values]
    q = torch.randn(q_rows, HEADS * HEAD_DIM, generator=rng)
    kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * 4
    case = {"caches": caches, "q": q, "rows": rows, "tables": tables, "bytes": kv_bytes}
    if f16:
        case["caches16"] = [tuple(on_huge_pages(t.half()) for t in layer) for layer in values]
    return case


# What a decode step of the shipped model reads between two attention calls: one layer's
# weights (int8 records: ~2.2 MB), a different slice each layer, so that over a step ~66 MB
# stream through the 32 MB L3 and each layer's KV comes from memory, as in a real step.
LAYER_WEIGHT_BYTES = 2_200_000


def attention_step(
    mod: ModuleType, case: dict, threads: int, weights: torch.Tensor | None, f16: bool = False
) -> tuple[list[torch.Tensor], float]:
    """One call per layer, as a model step makes them (with `weights`, a layer's slice of
    them read before each call), over the fp32 caches or (f16) the fp16 ones; the outputs
    and the calls' summed time."""
    q, rows, tables = case["q"], case["rows"], case["tables"]
    outs, spent = [], 0.0
    for layer, (kc, vc) in enumerate(case["caches16" if f16 else "caches"]):
        out = torch.empty_like(q)
        if weights is not None:
            weights[layer].sum()
        t = time.perf_counter()
        mod.paged_attention(
            q.data_ptr(), q.stride(0), q.shape[0], HEADS, KV_HEADS, HEAD_DIM, kc.data_ptr(),
            vc.data_ptr(), int(f16), BLOCK, rows.data_ptr(), tables.data_ptr(), tables.stride(0),
            out.data_ptr(), out.stride(0), HEAD_DIM**-0.5, threads,
        )  # fmt: skip
        spent += time.perf_counter() - t
        outs.append(out)
    return outs, spent


def attention_ab(mods: list[ModuleType], threads: int, kv16: str = "") -> None:
    """See the module docstring (`--attention`, `--kv16`: which builds read fp16)."""
    rng = torch.Generator().manual_seed(0)
    # What a read of the same bytes can reach, for the KV GB/s columns: 12 KB blocks (16
    # tokens of one layer's K or V) in 377 MB (batch 32's KV), scattered as in the cases.
    lib = reads.build()
    block = BLOCK * KV_HEADS * HEAD_DIM * 4
    kv_bytes = 32 * 2 * LAYERS * 256 * block // BLOCK
    ceilings = reads.block_read_bandwidth(lib, block, kv_bytes, threads)
    rates = ", ".join(f"{name} {rate / 1e9:.1f} GB/s" for name, rate in ceilings.items())
    where = reads.placement(lib.round_trip(20000))
    print(f"{where}; plain reads of {block // 1024} KB blocks: {rates}")
    print("| case | A ms | B ms | A KV GB/s | B KV GB/s | B vs A |")
    print("|---|---:|---:|---:|---:|---:|")
    cases = [(f"decode b={b}, ctx 256", b, 256, 0, None) for b in (1, 8, 32)]
    weights = torch.ones(LAYERS, LAYER_WEIGHT_BYTES // 4)
    cases += [(f"decode b={b}, ctx 256, weights read between", b, 256, 0, weights) for b in (1, 8)]
    cases.append(("prefill chunk 512, ctx 512", 1, 512, 512, None))
    for name, batch, context, chunk, between in cases:
        case = attention_case(batch, context, chunk, rng, kv16 != "")
        times: list[list[float]] = [[], []]
        outs: list[list[torch.Tensor]] = []
        for rep in range(16):
            outs = [[], []]
            for i in (0, 1) if rep % 2 == 0 else (1, 0):  # which goes first alternates
                f16 = "AB"[i] in kv16
                outs[i], spent = attention_step(mods[i], case, threads, between, f16)
                times[i].append(spent)
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b), f"{name}: bits differ"
        ta, tb = (statistics.median(t) for t in times)
        gb = case["bytes"] / 1e9  # fp32's: a build reading fp16 reads half of them
        gb_a, gb_b = (gb / 2 if x in kv16 else gb for x in "AB")
        print(f"| {name} | {ta * 1e3:.2f} | {tb * 1e3:.2f} | {gb_a / ta:.1f} | {gb_b / tb:.1f} "
              f"| {ta / tb:.2f}x |")  # fmt: skip


def step_ab(
    mods: list[ModuleType],
    batch: int,
    steps: int,
    whole: bool,
    activations: str,
    block: int = 1,
    layers: int = 0,
) -> None:
    """See the module docstring (`--step`, `--whole`, `--layers`)."""
    from bench_decode_step import served_engine

    from pdserve.model.fused import FusedLayers
    from pdserve.protocol.sampling_params import SamplingParams

    threads = torch.get_num_threads()  # --threads: the engine sets its config's
    engine = served_engine(activations, decode_burst=1)  # each step's layers swapped
    torch.set_num_threads(threads)
    times: list[list[float]] = [[], []]
    call = FusedLayers.__call__
    turn = [0]

    Out = tuple[torch.Tensor, torch.Tensor | None]

    def both(self: FusedLayers, h: torch.Tensor, *rest: Any) -> Out:
        h0 = h.clone()
        outs: list[list[torch.Tensor | None]] = [[], []]
        order = (0, 1) if turn[0] % 2 == 0 else (1, 0)
        turn[0] += 1
        for i in order:
            h.copy_(h0)
            self._call = mods[i].fused_layers
            if layers:
                self._layers, self._head = layers, None
            t = time.perf_counter()
            out = call(self, h, *rest)
            times[i].append(time.perf_counter() - t)
            outs[i] = [h.clone(), *out]
        same = [(a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(*outs, strict=True)]  # fmt: skip
        assert all(same), "step outputs differ (h, hidden, logits)"
        return out

    def build_now() -> int:
        return turn[0] // block % 2

    def one(self: FusedLayers, h: torch.Tensor, *rest: Any) -> Out:
        self._call = mods[build_now()].fused_layers
        if layers:
            self._layers, self._head = layers, None
        return call(self, h, *rest)

    FusedLayers.__call__ = one if whole else both  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(100, 40000, (256,)).tolist(), params)
    rest = []  # each step's time outside its two layer calls
    started: set[str] = set()  # requests past their prompt
    while engine.has_unfinished():
        decoding = len(started) == batch  # every prompt done: a decode step
        t = time.perf_counter()
        outputs = engine.step()
        started.update(o.request_id for o in outputs)
        if whole:  # the whole step, each build's in turn
            if decoding and turn[0] % block >= min(2, block - 1):  # past a block's first steps
                times[build_now()].append(time.perf_counter() - t)
            turn[0] += 1
            continue
        rest.append(time.perf_counter() - t - times[0][-1] - times[1][-1])
    if whole:
        ta, tb = (statistics.median(t[:-1]) for t in times)  # the last samples nothing
        print(f"decode b={batch}, whole steps alternating every {block}: A {ta * 1e3:.2f} ms, "
              f"B {tb * 1e3:.2f} ms, B vs A {ta / tb:.2f}x")  # fmt: skip
        return
    ta, tb = (statistics.median(t[batch:]) for t in times)  # past the prefill steps
    tr = statistics.median(rest[batch:-1])  # the last step samples nothing
    print(f"decode b={batch}, {len(times[0]) - batch} steps: layers A {ta * 1e3:.2f} ms, "
          f"B {tb * 1e3:.2f} ms, B vs A {ta / tb:.2f}x; the rest of a step "
          f"(metadata, sampling, Python) {tr * 1e3:.2f} ms")  # fmt: skip


def print_placement(before: float, after: float) -> None:
    """Where the machine had the two cores at the run's start and end (reads.placement):
    it can move them within a minute, and a run that began on two CCDs and ended on one
    is a mix of both, not a two-CCD result."""
    print(f"{reads.placement(before)} at the start, {reads.placement(after)} at the end")
    if reads.placement_kind(before) != reads.placement_kind(after):
        print("the placement changed during the run: its result mixes the two")


def products_ab(mods: list[ModuleType], args: argparse.Namespace) -> None:
    """The products of SHAPES in each format of --formats, M of --rows (the default mode)."""
    rng = np.random.default_rng(0)
    print("| shape N x K | format | M | A GMAC/s | B GMAC/s | B vs A |")
    print("|---|---|---:|---:|---:|---:|")
    for n, k in SHAPES:
        for name in args.formats.split(","):
            qtype = QuantType.parse(name)
            if k % qtype.block_values:
                continue
            op = QuantLinear(random_blocks(qtype, n, k, rng), None, args.activations or "fp32")
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                times: list[list[float]] = [[], []]
                outs: list[torch.Tensor] = []
                for _ in range(30 if m < 64 else 12):
                    outs = []
                    for i, mod in enumerate(mods):
                        op._qlinear, op._qlinear_int8 = mod.qlinear, mod.qlinear_int8
                        t = time.perf_counter()
                        outs.append(op(x))
                        times[i].append(time.perf_counter() - t)
                assert torch.equal(outs[0], outs[1]), f"{n}x{k} {name} M={m}: bits differ"
                ta, tb = (statistics.median(t) for t in times)
                rate = m * n * k / 1e9
                print(
                    f"| {n} x {k} | {name} | {m} | {rate / ta:.1f} | {rate / tb:.1f} "
                    f"| {ta / tb:.2f}x |"
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--build", action="append", type=Path, required=True, help="A, then B")
    ap.add_argument("--formats", default="Q4_1,Q8_0")
    ap.add_argument("--rows", default="8,64,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--activations", choices=("fp32", "int8"), help="default: fp32, int8 with --step"
    )
    ap.add_argument("--attention", action="store_true", help="time paged_attention instead")
    ap.add_argument(
        "--kv16",
        choices=("B", "AB"),
        default="",
        help="--attention: these builds read an fp16 cache (the others an fp32 one of the "
        "same values)",
    )
    ap.add_argument("--step", action="store_true", help="time a decode step's layers instead")
    ap.add_argument("--whole", action="store_true", help="--step: whole steps, builds alternating")
    ap.add_argument("--batch", type=int, default=1, help="--step's sequences")
    ap.add_argument("--steps", type=int, default=40, help="--step's decode steps")
    ap.add_argument("--block", type=int, default=1, help="--whole: steps per build's turn")
    ap.add_argument("--layers", type=int, default=0, help="--step: run only the first N layers")
    args = ap.parse_args()
    if len(args.build) != 2:
        ap.error("give --build twice: A, then B")
    torch.set_num_threads(args.threads)
    lib = reads.build()
    before = lib.round_trip(20000)
    with tempfile.TemporaryDirectory() as tmp:
        pairs = zip("ab", args.build, strict=True)
        mods = [load(f"{lab}._kernels", build(f, Path(tmp) / lab)) for lab, f in pairs]
        if args.attention:
            attention_ab(mods, args.threads, args.kv16)
        elif args.step:
            activations = args.activations or "int8"
            step_ab(mods, args.batch, args.steps, args.whole, activations, args.block, args.layers)
        else:
            products_ab(mods, args)
    print_placement(before, lib.round_trip(20000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
