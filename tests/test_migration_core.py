"""A migrated request continues exactly: `EngineCore.add_request(output_token_ids=...)`.

The front end moves a request whose instance failed by sending its prompt and every token
already streamed; the new core computes their KV and samples the token after the last one.
Asserted token for token against an undisturbed run of the same request, on the shipped
SmolLM2: greedy, seeded sampling (the generator skips the draws already taken), penalties
(they count the carried tokens), and max_tokens / min_tokens (the carried tokens count).
"""

from __future__ import annotations

import pytest

from pdserve.engine.core import EngineCore
from pdserve.errors import InvalidRequestError
from pdserve.protocol.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _run(core: EngineCore, rid: str) -> list[int]:
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            if out.request_id == rid:
                tokens.extend(t.token_id for t in out.new_tokens)
    return tokens


def _prompt(engine) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    return engine.tokenizer.prompt_ids(text)


CASES = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0),
    "seeded": SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=1234),
    "penalties": SamplingParams(
        max_tokens=40, temperature=0.7, seed=7, frequency_penalty=0.5, repetition_penalty=1.2
    ),
    "min_tokens": SamplingParams(max_tokens=40, temperature=0.0, min_tokens=30),
}


# Every case cut after 17 tokens; the first-token cut (the decode side's first step)
# for greedy and seeded.
CUTS = [(name, 17) for name in CASES] + [("greedy", 1), ("seeded", 1)]


@pytest.mark.parametrize("name,cut", CUTS)
def test_a_migrated_request_continues_token_for_token(make_engine, name: str, cut: int) -> None:
    params = CASES[name]
    engine = make_engine()
    prompt = _prompt(engine)
    engine.core.add_request("whole", prompt, params)
    whole = _run(engine.core, "whole")
    assert len(whole) > cut
    # A second core, as a live instance would be: an empty pool, other requests running.
    other = make_engine()
    other.core.add_request("bystander", prompt[:20], SamplingParams(max_tokens=12))
    other.core.add_request("moved", prompt, params, output_token_ids=whole[:cut])
    rest = _run(other.core, "moved")
    assert whole[:cut] + rest == whole


def test_migration_hits_the_prefix_cache_and_jumps_the_queue(make_engine) -> None:
    engine = make_engine(max_num_seqs=1)
    prompt = _prompt(engine)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    engine.core.add_request("first", prompt, params)
    whole = _run(engine.core, "first")
    engine.core.add_request("waiting", prompt[:10], SamplingParams(max_tokens=4))
    moved = engine.core.add_request("moved", prompt, params, output_token_ids=whole[:8])
    assert [r.request_id for r in engine.core.scheduler.waiting] == ["moved", "waiting"]
    out = engine.core.step()
    assert [o.request_id for o in out] == ["moved"]
    assert out[0].new_tokens[0].token_id == whole[8]
    # The prompt (and the first generated tokens) came from the prefix cache.
    assert moved.num_cached_prompt_tokens >= (len(prompt) // 16) * 16
    assert whole[:9] + _run(engine.core, "moved") == whole


def test_a_migrated_request_with_nothing_left_is_refused(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as err:
        engine.core.add_request(
            "done", [1, 2, 3], SamplingParams(max_tokens=2), output_token_ids=[5, 6]
        )
    assert err.value.param == "output_token_ids"
    assert engine.core.kv.num_used_blocks == 0 and not engine.core.has_unfinished()
