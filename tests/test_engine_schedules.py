"""The same greedy outputs whatever the schedule, on the shipped SmolLM2.

The reference is each prompt run alone. Every other schedule - all at once, a tiny
token budget forcing chunked prefill, a tiny pool forcing preemption (swap and
recompute), prefix-cache hits on a shared system prompt - must produce the same
tokens. The `make_engine` fixture asserts pool integrity and zero used blocks after
each engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pdserve.config import PreemptionMode
from pdserve.engine.engine import Engine
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.outputs import RequestOutput

TOPICS = [
    "the moon",
    "volcanoes",
    "bread",
    "the ocean",
    "chess",
    "bicycles",
    "rain",
    "music",
    "trees",
    "computers",
    "coffee",
    "winter",
    "dogs",
    "the alphabet",
    "bridges",
    "stars",
    "rivers",
    "paper",
    "honey bees",
    "clocks",
    "mountains",
    "salt",
    "trains",
    "glass",
    "cats",
    "light",
    "gardens",
    "maps",
    "wind",
    "books",
    "snow",
    "numbers",
]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(tok, n: int = 32) -> list[list[int]]:
    out = []
    for i, topic in enumerate(TOPICS[:n]):
        detail = " Answer in one short paragraph." * (i % 4)  # lengths vary by ~24 tokens
        msgs = [{"role": "user", "content": f"Tell me one fact about {topic}.{detail}"}]
        out.append(tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False))
    return out


def run_all(engine: Engine, prompts: list[list[int]]) -> list[RequestOutput]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def prompts(smollm2):
    return _prompts(smollm2[1])


@pytest.fixture(scope="module")
def reference(smollm2, prompts):
    """Each prompt alone, prefix cache off: the schedule-free ground truth."""
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig

    model, tok = smollm2
    engine = Engine(
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048),
            cache=CacheConfig(num_blocks=64, num_host_blocks=0, enable_prefix_cache=False),
        ),
        model,
        tok,
    )
    refs = [run_all(engine, [p])[0].token_ids for p in prompts]
    engine.core.kv.check_integrity()
    assert engine.core.kv.num_used_blocks == 0
    return refs


@pytest.mark.slow
def test_all_at_once(make_engine, prompts, reference) -> None:
    engine = make_engine(enable_prefix_cache=False)
    assert [o.token_ids for o in run_all(engine, prompts)] == reference


@pytest.mark.slow
def test_tiny_token_budget_forces_chunked_prefill(make_engine, prompts, reference) -> None:
    engine = make_engine(max_num_batched_tokens=7, enable_prefix_cache=False)
    outs = run_all(engine, prompts[:8])
    assert [o.token_ids for o in outs] == reference[:8]


def count_swaps(engine: Engine) -> dict[str, int]:
    """Spy on the KV cache's block copies: swap-out/swap-in calls and blocks copied, as
    the runner executes them (what actually moved, not what was planned)."""
    cache = engine.core.runner.cache
    seen = {"swap_out": 0, "swap_in": 0, "blocks_out": 0, "blocks_in": 0}
    out, into = cache.swap_out, cache.swap_in

    def swap_out(copies: Sequence[tuple[int, int]]) -> None:
        seen["swap_out"] += 1
        seen["blocks_out"] += len(copies)
        out(copies)

    def swap_in(copies: Sequence[tuple[int, int]]) -> None:
        seen["swap_in"] += 1
        seen["blocks_in"] += len(copies)
        into(copies)

    cache.swap_out, cache.swap_in = swap_out, swap_in  # type: ignore[method-assign]
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_tiny_pool_forces_preemption(make_engine, prompts, reference, mode) -> None:
    # 24 blocks x 16 tokens hold ~5 of these requests; 16 are submitted.
    host = 256 if mode is PreemptionMode.SWAP else 0
    engine = make_engine(
        num_blocks=24, num_host_blocks=host, preemption_mode=mode, enable_prefix_cache=False
    )
    swaps = count_swaps(engine)
    outs = run_all(engine, prompts[:16])
    preemptions = sum(o.metrics.num_preemptions for o in outs)
    assert preemptions > 0
    assert [o.token_ids for o in outs] == reference[:16]
    if mode is PreemptionMode.SWAP:
        # The host tier (256 blocks) holds all 16 requests at once: every preemption must
        # have been a swap (the scheduler falls back to recompute only when it is full),
        # and every swapped request came back by swap-in, its KV copied both ways.
        assert swaps["swap_out"] == preemptions
        assert swaps["swap_in"] == swaps["swap_out"]
        assert swaps["blocks_in"] == swaps["blocks_out"] > 0
        assert engine.core.kv.num_free_host_blocks == host
    else:
        assert swaps == {"swap_out": 0, "swap_in": 0, "blocks_out": 0, "blocks_in": 0}


@pytest.mark.slow
def test_prefix_cache_hits_on_shared_system_prompt(make_engine, prompts, reference) -> None:
    engine = make_engine(max_num_seqs=4)
    outs = run_all(engine, prompts)
    assert [o.token_ids for o in outs] == reference
    # All prompts share their first 29 tokens (system prompt + "Tell me one fact about"):
    # one full 16-token block. The first four are admitted in the same step, before any
    # KV is committed to the index; every later one reuses that block.
    assert [o.num_cached_tokens for o in outs] == [0] * 4 + [16] * 28
    kv = engine.core.kv
    assert kv.prefix_cache_hits == 16 * 28
