"""One-turn workloads: `random`, and the length profiles of `pdserve.workload.profiles`
(the papers' datasets by shape, TetriInfer's mixes) filled with exact-length word
prompts. A profile's lengths are drawn by `draw_lengths`, the function the planner's
simulated workloads draw through, so both see the same lengths for a seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.bench.config import BenchInputError
from pdserve.bench.tokens import PromptFactory
from pdserve.bench.workloads.options import WorkloadOptions
from pdserve.bench.workloads.spec import Session, Turn, Workload, single_turn_order
from pdserve.workload.lengths import LengthDist
from pdserve.workload.profiles import LengthProfile, draw_lengths


def profile_workload(
    name: str, profile: LengthProfile, opts: WorkloadOptions, factory: PromptFactory
) -> Workload:
    drawn = draw_lengths(profile, opts.num_prompts, opts.seed)
    params = {
        "input": profile.input.describe(),
        "output": profile.output.describe(),
        "source": profile.source,
    }
    return _one_turn_workload(name, drawn.inputs, drawn.outputs, factory, drawn.rng, "", params)


def random_workload(opts: WorkloadOptions, factory: PromptFactory) -> Workload:
    """vLLM's `random`: lengths uniform within +-range_ratio, an optional shared prefix."""
    r = opts.random_range_ratio
    if not 0 <= r < 1:
        raise BenchInputError(f"--random-range-ratio must be in [0, 1), got {r}")
    if opts.random_prefix_len < 0:
        raise BenchInputError(f"--random-prefix-len must be >= 0, got {opts.random_prefix_len}")
    in_dist = _ratio_range("--random-input-len", opts.random_input_len, r)
    out_dist = _ratio_range("--random-output-len", opts.random_output_len, r)
    rng = np.random.default_rng(opts.seed)
    prefix = factory.words(rng, opts.random_prefix_len) if opts.random_prefix_len else ""
    inputs = [opts.random_prefix_len + n for n in in_dist.sample(rng, opts.num_prompts)]
    outputs = out_dist.sample(rng, opts.num_prompts)
    params = {
        "input": in_dist.describe(),
        "output": out_dist.describe(),
        "prefix_len": opts.random_prefix_len,
    }
    return _one_turn_workload("random", inputs, outputs, factory, rng, prefix, params)


def _ratio_range(flag: str, n: int, r: float) -> LengthDist:
    lo, hi = int(n * (1 - r)), int(n * (1 + r))
    if n < 1 or lo < 1:
        raise BenchInputError(f"{flag} {n} with range ratio {r} allows lengths below 1 token")
    return LengthDist(lo, hi)


def _one_turn_workload(
    name: str,
    inputs: list[int],
    outputs: list[int],
    factory: PromptFactory,
    rng: np.random.Generator,
    prefix: str,
    params: dict[str, Any],
) -> Workload:
    sessions = tuple(
        Session(i, (Turn(p.text, p.num_tokens, o),))
        for i, (p, o) in enumerate(
            zip((factory.prompt(rng, n, prefix) for n in inputs), outputs, strict=True)
        )
    )
    return Workload(name, sessions, single_turn_order(len(sessions)), None, params)
