"""One-turn workloads: `random`, the papers' datasets by shape, and TetriInfer's mixes.

No dataset can be downloaded here, so `chatbot`, `code` and `summarization` draw
lengths from distributions shaped like ShareGPT, HumanEval and LongBench (DistServe
§6.1 Table 1 / Fig. 7) and fill them with exact-length word prompts. Where each
number comes from is in `source` and in docs/bench.md. Every profile fits a
2,048-token context, the limit DistServe's OPT models and vLLM's ShareGPT filter use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.bench.config import BenchInputError
from pdserve.bench.lengths import LengthDist
from pdserve.bench.tokens import PromptFactory
from pdserve.bench.workloads.options import WorkloadOptions
from pdserve.bench.workloads.spec import Session, Turn, Workload, single_turn_order


@dataclass(frozen=True)
class LengthProfile:
    input: LengthDist
    output: LengthDist
    source: str


# ShareGPT. Bounds: vLLM's / DistServe's ShareGPT filter (at least 4 tokens each,
# at most 1024). Prompts: mean 161 tokens unfiltered (vLLM paper, SOSP'23, Fig. 11):
# median 70, sigma 1.3 has an untruncated mean of 162. Answers: median 128 tokens
# (TetriInfer §5, the light/heavy decode threshold): median 137, sigma 1.2 truncated
# to the bounds draws a median of 128 (the unfiltered mean of 338 in the vLLM paper
# cannot survive a 1024-token cap together with that median).
SHAREGPT_INPUT = LengthDist.lognormal(70, 1.3, 4, 1024)
SHAREGPT_OUTPUT = LengthDist.lognormal(137, 1.2, 4, 1024)

PROFILES: dict[str, LengthProfile] = {
    "chatbot": LengthProfile(
        SHAREGPT_INPUT,
        SHAREGPT_OUTPUT,
        "ShareGPT (DistServe Table 1): median answer 128 tokens (TetriInfer §5), "
        "mean prompt 161 tokens (vLLM paper Fig. 11); vLLM's filter bounds [4, 1024]",
    ),
    "code": LengthProfile(
        LengthDist.lognormal(130, 0.45, 40, 512),
        LengthDist.lognormal(60, 0.6, 8, 384),
        "HumanEval (DistServe Table 1): 164 prompts of a signature plus docstring, "
        "~450 characters (~130 tokens) on average, 274-1519 characters with an "
        "instruction line; short canonical bodies (estimate: median 60 tokens)",
    ),
    "summarization": LengthProfile(
        LengthDist.lognormal(1024, 0.35, 256, 1536),
        LengthDist.lognormal(180, 0.5, 16, 512),
        "LongBench summarization (DistServe Table 1, Fig. 7: far longer inputs than the "
        "other two; GovReport/QMSum/MultiNews average 2-11k words): inputs fill most of "
        "a 2,048-token context as DistServe's truncated prompts do; summaries of a few "
        "hundred tokens (estimate: median 180)",
    ),
}

# TetriInfer §5: prefill heavy above 512 prompt tokens, decode heavy above 128
# generated tokens (ShareGPT's median answer); requests are ShareGPT-shaped within
# their class. 1024 + 1024 keeps every request inside a 2,048-token context.
LIGHT_PREFILL, HEAVY_PREFILL = (4, 512), (513, 1024)
LIGHT_DECODE, HEAVY_DECODE = (4, 128), (129, 1024)
TETRI_CLASSES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "LPLD": (LIGHT_PREFILL, LIGHT_DECODE),
    "LPHD": (LIGHT_PREFILL, HEAVY_DECODE),
    "HPLD": (HEAVY_PREFILL, LIGHT_DECODE),
    "HPHD": (HEAVY_PREFILL, HEAVY_DECODE),
    "mixed": ((4, 1024), (4, 1024)),
}


def tetri_profile(name: str) -> LengthProfile:
    (ilo, ihi), (olo, ohi) = TETRI_CLASSES[name]
    src, out = SHAREGPT_INPUT, SHAREGPT_OUTPUT
    assert src.median_param is not None and out.median_param is not None
    return LengthProfile(
        LengthDist.lognormal(src.median_param, src.sigma, ilo, ihi),
        LengthDist.lognormal(out.median_param, out.sigma, olo, ohi),
        f"TetriInfer §5 {name}: ShareGPT-shaped lengths, prompt in [{ilo}, {ihi}], "
        f"output in [{olo}, {ohi}] (heavy prefill > 512, heavy decode > 128 tokens)",
    )


def profile_workload(
    name: str, profile: LengthProfile, opts: WorkloadOptions, factory: PromptFactory
) -> Workload:
    rng = np.random.default_rng(opts.seed)
    inputs = profile.input.sample(rng, opts.num_prompts)
    outputs = profile.output.sample(rng, opts.num_prompts)
    params = {
        "input": profile.input.describe(),
        "output": profile.output.describe(),
        "source": profile.source,
    }
    return _one_turn_workload(name, inputs, outputs, factory, rng, "", params)


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
