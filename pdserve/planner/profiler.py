"""`pdserve profile`: time real engine steps over a grid of batch shapes, fit the
latency model (`fit.py`), write a measured hardware profile.

Each shape is run on an `EngineCore` (prefix cache off, so every token is computed)
and every step is timed whole (`EngineCore.step`: scheduling, forward, sampling), as
a simulated step stands for. A step's composition is read from the scheduler's own
output before it runs: prompt tokens, attention units ((k+c)^2 - k^2 per chunk),
prompts finishing, decode tokens and the context they attend over (a decoding
request's computed tokens + 1) - exactly the counts the simulator prices.

Shapes marked held out are never used to fit; their error is the model's error on
steps it has not seen (the issue's acceptance: median <= 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.engine.step_trace import StepObserver
from pdserve.planner.fit import fit_step_model
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.model_spec import ModelSpec, PlanInputError


@dataclass(frozen=True)
class Shape:
    """prefill: `prompts` run together; decode: `batch` requests with `context`-token
    prompts decoding; mixed: those decodes plus one prompt of `prompts[0]` tokens."""

    kind: str
    prompts: tuple[int, ...] = ()
    batch: int = 0
    context: int = 0
    heldout: bool = False


def _prefill(*lens: int, held: bool = False) -> Shape:
    return Shape("prefill", tuple(lens), heldout=held)


def _decode(batch: int, context: int, held: bool = False) -> Shape:
    return Shape("decode", batch=batch, context=context, heldout=held)


def _mixed(batch: int, context: int, prompt: int, held: bool = False) -> Shape:
    return Shape("mixed", (prompt,), batch, context, held)


DEFAULT_GRID: tuple[Shape, ...] = (
    *(_prefill(n) for n in (16, 32, 64, 128, 256, 512, 1024)),
    _prefill(64, 64), _prefill(256, 256), _prefill(32, 32, 32, 32), _prefill(128, 128, 128, 128),
    _prefill(16, 16, 16, 16, 16, 16, 16, 16), _prefill(512, 512),
    *(_decode(b, c) for b, c in ((1, 32), (1, 256), (1, 1024), (4, 32), (4, 256), (4, 1024),
                                 (16, 32), (16, 256), (32, 32), (32, 128), (64, 32), (64, 64))),
    _mixed(4, 64, 64), _mixed(4, 64, 256), _mixed(16, 64, 128), _mixed(32, 32, 256),
    _mixed(32, 32, 64),
    # held out: shapes between the grid's, never fitted
    _prefill(200, held=True), _prefill(100, 100, 100, held=True), _prefill(700, held=True),
    _decode(8, 128, held=True), _decode(24, 64, held=True), _decode(2, 512, held=True),
    _mixed(8, 128, 128, held=True), _mixed(24, 48, 96, held=True),
)  # fmt: skip

QUICK_GRID: tuple[Shape, ...] = (
    _prefill(8), _prefill(32), _prefill(64), _prefill(16, 16), _prefill(8, 8, 8, 8),
    _decode(1, 16), _decode(4, 32), _decode(8, 8), _decode(2, 64),
    _mixed(2, 16, 16), _mixed(4, 8, 32),
    _prefill(24, held=True), _decode(3, 24, held=True), _mixed(3, 16, 24, held=True),
)  # fmt: skip

DECODE_STEPS = 4  # decode steps timed per decode shape


@dataclass(frozen=True)
class StepPoint:
    shape: int  # index into the grid
    heldout: bool
    counts: tuple[int, int, int, int, int]  # prompt tokens, units, prompt seqs, decodes, context
    seconds: float
    start: float | None = None  # perf_counter() when a traced step began (traces only)


class StepTimer:
    """Runs an `EngineCore` and records each step's composition and wall time."""

    def __init__(self, core: Any, vocab: int, seed: int = 0) -> None:
        self.core = core
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.ids = 0
        self.observer = StepObserver(core.scheduler)

    def add(self, prompt_len: int, max_tokens: int) -> str:
        from pdserve.protocol.sampling_params import SamplingParams

        self.ids += 1
        rid = f"p{self.ids}"
        prompt = self.rng.integers(10, self.vocab - 10, size=prompt_len).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add_request(rid, prompt, params)
        return rid

    def step(self) -> tuple[tuple[int, int, int, int, int], float]:
        t0 = time.perf_counter()
        self.core.step()
        dt = time.perf_counter() - t0
        return self.observer.last, dt

    def drain(self) -> None:
        while self.core.has_unfinished():
            self.core.step()


def run_shape(timer: StepTimer, shape: Shape) -> list[tuple[tuple[int, int, int, int, int], float]]:
    """The timed steps of one shape (what it is about, not its set-up steps)."""
    out = []
    if shape.kind == "prefill":
        for n in shape.prompts:
            timer.add(n, 1)
        out.append(timer.step())
    else:
        for _ in range(shape.batch):
            timer.add(shape.context, DECODE_STEPS + 3)
        timer.step()  # the prompts (set-up)
        if shape.kind == "decode":
            out += [timer.step() for _ in range(DECODE_STEPS)]
        else:
            timer.step()
            timer.add(shape.prompts[0], 1)
            out.append(timer.step())
    timer.drain()
    return out


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (reads + writes), the median of `repeats`."""
    import torch

    n = megabytes * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times)


@dataclass(frozen=True)
class ProfileConfig:
    model: str | None = None
    threads: int = 2
    dtype: str = "float32"
    repeats: int = 3
    quick: bool = False

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise PlanInputError(f"--threads must be >= 1, got {self.threads}")
        if self.repeats < 1:
            raise PlanInputError(f"--repeats must be >= 1, got {self.repeats}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise PlanInputError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype}")


def build_core(cfg: ProfileConfig) -> tuple[Any, ModelSpec]:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.engine import build_core as engine_core
    from pdserve.engine.engine import load_model
    from pdserve.errors import ModelLoadError
    from pdserve.planner.model_spec import from_model_config

    config = EngineConfig(
        model=cfg.model,
        dtype=cfg.dtype,
        num_threads=cfg.threads,
        # One step a call: the latency model's unit (a decode burst would time several).
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=128, decode_burst=1),
        cache=CacheConfig(kv_cache_memory_gib=1.0, swap_space_gib=0.01, enable_prefix_cache=False),
    )
    try:
        model = load_model(config)
    except ModelLoadError as e:
        raise PlanInputError(str(e)) from None
    core = engine_core(config, model, [])
    name = Path(cfg.model).stem if cfg.model else "SmolLM2-135M-Instruct"
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.dtype]
    return core, from_model_config(model.config, name, dtype_bytes=elem)


def collect(
    timer: StepTimer, grid: tuple[Shape, ...], repeats: int, tick: Callable[[], None]
) -> list[StepPoint]:
    run_shape(timer, _prefill(32))  # warm-up
    run_shape(timer, _decode(2, 16))
    points = []
    for _ in range(repeats):
        for i, shape in enumerate(grid):
            for counts, dt in run_shape(timer, shape):
                points.append(StepPoint(i, shape.heldout, counts, dt))
            tick()
    return points


def median_points(points: list[StepPoint]) -> list[StepPoint]:
    """One point per (shape, composition): the median time over the repeats."""
    groups: dict[tuple[int, tuple[int, ...]], list[StepPoint]] = {}
    for p in points:
        groups.setdefault((p.shape, p.counts), []).append(p)
    return [
        StepPoint(s, g[0].heldout, counts, statistics.median(x.seconds for x in g))  # type: ignore[arg-type]
        for (s, counts), g in groups.items()
    ]


def profile(cfg: ProfileConfig, progress: bool = True) -> HardwareProfile:
    from tqdm import tqdm

    grid = QUICK_GRID if cfg.quick else DEFAULT_GRID
    core, spec = build_core(cfg)
    bandwidth = measure_bandwidth(32 if cfg.quick else 256)
    timer = StepTimer(core, spec.vocab_size)
    bar = tqdm(total=len(grid) * cfg.repeats, desc="profiling", disable=not progress)
    points = median_points(collect(timer, grid, cfg.repeats, lambda: bar.update(1)))
    bar.close()
    return fitted_profile(cfg, spec, points, bandwidth, f"a grid of {len(grid)} shapes")


def fitted_profile(
    cfg: ProfileConfig, spec: ModelSpec, points: list[StepPoint], bandwidth: float, what: str
) -> HardwareProfile:
    """A measured profile fitted to `points` (those marked held out are only scored)."""
    times = np.array([p.seconds for p in points])
    held = np.array([p.heldout for p in points])
    result = fit_step_model(spec, [p.counts for p in points], times, bandwidth, held)
    fit = {
        "model": spec.name,
        "model_spec": spec.to_dict(),
        "dtype": cfg.dtype,
        "threads": cfg.threads,
        "repeats": cfg.repeats,
        "copy_bandwidth_gbps": bandwidth / 1e9,
        **result.stats(),
        "points": [
            {"counts": list(p.counts), "seconds": p.seconds, "heldout": p.heldout}
            for p in points
        ],
        "counts_order": ["prompt_tokens", "prompt_units", "prompt_seqs", "decode_tokens",
                         "context_tokens"],
    }  # fmt: skip
    return HardwareProfile(
        name=f"{socket.gethostname()}-cpu-{cfg.threads}t",
        kind="measured",
        coefficients=result.coefficients,
        device_memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        tp_bandwidth=0.0,
        source=(
            f"pdserve profile: {len(points)} engine steps of {spec.name} ({cfg.dtype}, "
            f"{cfg.threads} threads; {what}) timed on this machine, fitted by non-negative "
            "least squares on relative error"
        ),
        fit=fit,
    )


def read_trace(paths: list[Path]) -> list[StepPoint]:
    """Steps from `PDSERVE_STEP_TRACE` files; every 4th is held out of the fit."""
    points: list[StepPoint] = []
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise PlanInputError(f"{path}: cannot read trace ({e.strerror})") from None
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                counts = tuple(int(c) for c in row["counts"])
                seconds = float(row["seconds"])
                start = float(row["start"]) if "start" in row else None
            except (ValueError, KeyError, TypeError):
                raise PlanInputError(f"{path}:{n}: not a step-trace line") from None
            if len(counts) != 5 or not seconds > 0:
                raise PlanInputError(f"{path}:{n}: expected 5 counts and seconds > 0")
            i = len(points)
            points.append(StepPoint(i, i % 4 == 3, counts, seconds, start))
    if len(points) < 20:
        raise PlanInputError(f"{len(points)} traced steps are too few to fit (need >= 20)")
    return points


def profile_from_trace(cfg: ProfileConfig, paths: list[Path]) -> HardwareProfile:
    """Fit the latency model to the steps a serving engine traced."""
    from pdserve.planner.model_spec import resolve_model_spec

    spec = resolve_model_spec(cfg.model, {"float32": 4}.get(cfg.dtype, 2))
    points = read_trace(paths)
    bandwidth = measure_bandwidth(64)
    return fitted_profile(cfg, spec, points, bandwidth, f"serving trace {[str(p) for p in paths]}")


# ---- CLI ---------------------------------------------------------------------------------


def add_profile_parser(sub: Any) -> None:
    p = sub.add_parser(
        "profile",
        help="fit the latency model to this machine (engine steps over a grid of shapes)",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default SmolLM2)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a small grid (tests, smoke runs)")
    p.add_argument(
        "--from-trace",
        nargs="+",
        default=None,
        metavar="FILE",
        help="fit to steps a serving engine traced (PDSERVE_STEP_TRACE) instead of a grid",
    )
    p.add_argument("--output", default="profile.json")
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    try:
        cfg = ProfileConfig(args.model, args.threads, args.dtype, args.repeats, args.quick)
        if args.model is not None and not Path(args.model).exists():
            raise PlanInputError(f"{args.model}: no such model file or folder")
        if args.from_trace:
            hw = profile_from_trace(cfg, [Path(f) for f in args.from_trace])
        else:
            hw = profile(cfg, progress=sys.stderr.isatty())
    except PlanInputError as e:
        print(f"pdserve profile: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.output)
    hw.save(out)
    c, f = hw.coefficients, hw.fit
    print(f"{hw.name}: " + ", ".join(f"{k}={v:.4g}" for k, v in c.to_dict().items()))
    print(
        f"relative error: train median {f['train_median_rel_error']:.1%} "
        f"(p90 {f['train_p90_rel_error']:.1%}, {f['train_points']} steps); held-out median "
        f"{f['heldout_median_rel_error']:.1%} (p90 {f['heldout_p90_rel_error']:.1%}, "
        f"{f['heldout_points']} steps)"
    )
    print(f"wrote {out}")
    return 0
