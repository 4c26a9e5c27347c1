"""Two builds of the compiled kernels, A/B in one process, on the same weights.

    git show REV:pdserve/quant/_kernels.c > /tmp/a/_kernels.c   # and _attention.c, _kernels.h
    .venv/bin/python bench/bench_kernel_ab.py --build /tmp/a --build pdserve/quant \\
        [--formats Q4_1,Q8_0] [--rows 8,64,256]

Each `--build` folder's C files are compiled (the flags of setup.py) into a private
`_kernels.so` and loaded under its own name; the same `QuantLinear` then calls each
build's `qlinear` in turn (alternating, so the machine's drift hits both) and the
outputs are asserted bit-identical - a kernel change that keeps the contract
(pdserve/quant/README.md) gives the same bits. Prints each build's GMAC/s (medians) and
B's time over A's as a speed-up, for the shipped model's projection shapes.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_quant_kernels import random_blocks

from pdserve.quant.formats import QuantType
from pdserve.quant.linear import QuantLinear

SHAPES = ((3072, 576), (1728, 576), (576, 1536))  # gate/up, q/k/v, down


def build(folder: Path, out: Path) -> Path:
    """Compile folder's _kernels.c + _attention.c into out/_kernels.so (setup.py's flags)."""
    out.mkdir(parents=True, exist_ok=True)
    so = out / "_kernels.so"
    include = sysconfig.get_paths()["include"]
    cmd = ["gcc", "-shared", "-fPIC", "-O3", "-fopenmp", "-ffp-contract=off", "-std=gnu11"]
    cmd += [f"-I{include}", f"-I{folder}", str(folder / "_kernels.c")]
    cmd += [str(folder / "_attention.c"), "-o", str(so)]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--build", action="append", type=Path, required=True, help="A, then B")
    ap.add_argument("--formats", default="Q4_1,Q8_0")
    ap.add_argument("--rows", default="8,64,256")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if len(args.build) != 2:
        ap.error("give --build twice: A, then B")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        pairs = zip("ab", args.build, strict=True)
        mods = [load(f"{lab}._kernels", build(f, Path(tmp) / lab)) for lab, f in pairs]
        rng = np.random.default_rng(0)
        print("| shape N x K | format | M | A GMAC/s | B GMAC/s | B vs A |")
        print("|---|---|---:|---:|---:|---:|")
        for n, k in SHAPES:
            for name in args.formats.split(","):
                qtype = QuantType.parse(name)
                if k % qtype.block_values:
                    continue
                op = QuantLinear(random_blocks(qtype, n, k, rng), None)
                for m in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(m, k)
                    times: list[list[float]] = [[], []]
                    outs: list[torch.Tensor] = []
                    for _ in range(30 if m < 64 else 12):
                        outs = []
                        for i, mod in enumerate(mods):
                            op._qlinear = mod.qlinear
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
