"""Named length profiles: the papers' datasets by shape and TetriInfer's mixes, and
`draw_lengths`, the one way a (profile, seed) becomes request lengths.

No dataset can be downloaded here, so `chatbot`, `code` and `summarization` draw
lengths from distributions shaped like ShareGPT, HumanEval and LongBench (DistServe
§6.1 Table 1 / Fig. 7). Where each number comes from is in `source` and in
docs/bench.md. Every profile fits a 2,048-token context, the limit DistServe's OPT
models and vLLM's ShareGPT filter use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pdserve.workload.lengths import LengthDist


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


PROFILE_NAMES: tuple[str, ...] = (*PROFILES, *TETRI_CLASSES)


def find_profile(name: str) -> LengthProfile | None:
    """A dataset profile, or a TetriInfer mix in any case ("lphd"); None if neither."""
    if name in PROFILES:
        return PROFILES[name]
    mix = {k.lower(): k for k in TETRI_CLASSES}.get(name.lower())
    return None if mix is None else tetri_profile(mix)


class DrawnLengths(NamedTuple):
    inputs: list[int]
    """Prompt tokens of each request."""
    outputs: list[int]
    """Tokens to generate for each request."""
    rng: np.random.Generator
    """The seed's generator after the draw: the bench fills its prompts from it."""


def draw_lengths(profile: LengthProfile, n: int, seed: int) -> DrawnLengths:
    """The lengths of `n` requests of `profile` for `seed`: what `pdserve bench
    --workload NAME --seed S --num-prompts N` sends and what the planner simulates."""
    rng = np.random.default_rng(seed)
    inputs = profile.input.sample(rng, n)
    outputs = profile.output.sample(rng, n)
    return DrawnLengths(inputs, outputs, rng)
