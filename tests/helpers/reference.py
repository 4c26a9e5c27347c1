"""The independent reference for the server tests' texts: an undisturbed colocated run in
this process (the `served_engine` fixture, tests/conftest.py: an engine with `pdserve
serve`'s defaults over the shipped model), no HTTP, no cluster, no second server.

Greedy and seeded outputs do not depend on the deployment (the kernels are batch
invariant and a seeded request draws from its own generator), so a disaggregated,
migrated or replica-resumed request must give exactly these texts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.engine import Engine
from pdserve.protocol.sampling_params import SamplingParams

# The sampling fields of a completion body the tests send (the rest, such as "model" or
# "stream", do not change what is generated).
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop")


@dataclass(frozen=True)
class Expected:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def run(engine: Engine, bodies: list[dict]) -> list[Expected]:
    """What each completion body (a string prompt and its sampling fields) gets, all of
    them in one batch."""
    tok = engine.tokenizer
    ids = []
    for i, body in enumerate(bodies):
        params = SamplingParams.from_dict({k: body[k] for k in _SAMPLING if k in body})
        prompt = tok.prompt_ids(body["prompt"])
        ids.append((engine.add_request(prompt, params, f"ref-{i}"), len(prompt)))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [
        Expected(done[r].text, str(done[r].finish_reason), n, len(done[r].token_ids))
        for r, n in ids
    ]


def greedy(engine: Engine, prompts: list[str], max_tokens: int) -> list[str]:
    """The greedy completion of each prompt."""
    bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0} for p in prompts]
    return [e.text for e in run(engine, bodies)]
