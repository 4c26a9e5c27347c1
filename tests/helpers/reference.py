"""The independent reference for the server tests' texts: an undisturbed colocated run in
this process (the `served_engine` fixture, tests/conftest.py: an engine with `pdserve
serve`'s defaults over the shipped model), no HTTP, no cluster, no second server.

Greedy and seeded outputs do not depend on the deployment (the kernels are batch
invariant and a seeded request draws from its own generator), so a disaggregated,
migrated or replica-resumed request must give exactly these texts.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from pdserve.engine.engine import Engine
from pdserve.protocol.sampling_params import SamplingParams

# The sampling fields of a completion body the tests send (the rest, such as "model" or
# "stream", do not change what is generated). "grammar" is SamplingParams' own: a test
# gives the reference the grammar its server body asks for by response_format.
_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "stop",
    "logit_bias",
    "grammar",
)


# The README's question (chat template, greedy, max_tokens 32) answered by the shipped
# model, per how the activations are taken, each from a reference outside pdserve: fp32 -
# HF transformers on the dequantized weights (test_engine_vs_hf); int8 - llama.cpp on the
# same GGUF (llama-cpp-python 0.3.36, create_chat_completion, temperature 0, 32 tokens;
# docs/benchmarks-history.md, stop 71), whose rounding the int8 kernels share.
FRANCE_ANSWERS = {
    "fp32": "The capital of France is Paris.",
    "int8": "L'Étoile, la Marseillaise, la femme, la femme au martyre, la femme au martyre, la fem",
}


def resolved_activations(activations: str) -> str:
    """What `--activations` comes to for the shipped model here (`auto`: int8, or fp32
    where the kernels are off or the CPU lacks AVX2)."""
    from pdserve.model.quantization import resolve_quantization
    from pdserve.model.source import resolve_model

    return resolve_quantization("auto", resolve_model(None), activations=activations).activations


@dataclass(frozen=True)
class Expected:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


# Each engine's answers so far, by body: a body's answer does not depend on the batch it
# ran in (above), so a workload several tests compare with is computed once a session.
_answers: weakref.WeakKeyDictionary[Engine, dict[tuple, Expected]] = weakref.WeakKeyDictionary()


def run(engine: Engine, bodies: list[dict]) -> list[Expected]:
    """What each completion body (a string prompt and its sampling fields) gets: those not
    answered by this engine before, all in one batch."""
    known = _answers.setdefault(engine, {})
    keys = [_key(body) for body in bodies]
    tok = engine.tokenizer
    ids = []
    for i, (body, key) in enumerate(zip(bodies, keys, strict=True)):
        if key in known:
            continue
        params = SamplingParams.from_dict({k: body[k] for k in _SAMPLING if k in body})
        prompt = tok.prompt_ids(body["prompt"])
        ids.append((engine.add_request(prompt, params, f"ref-{i}"), len(prompt), key))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for r, n, key in ids:
        known[key] = Expected(done[r].text, str(done[r].finish_reason), n, len(done[r].token_ids))
    return [known[key] for key in keys]


def _key(body: dict) -> tuple:
    prompt = body["prompt"]
    return (
        prompt if isinstance(prompt, str) else tuple(prompt),
        tuple((k, repr(body[k])) for k in _SAMPLING if k in body),
    )


def greedy(engine: Engine, prompts: list[str], max_tokens: int) -> list[str]:
    """The greedy completion of each prompt."""
    bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0} for p in prompts]
    return [e.text for e in run(engine, bodies)]
