"""Scheduler decisions, exactly, without a model: token budgets, chunking, FCFS
admission, preemption victims, swap plans. Tokens are appended by hand after each
step the way the engine core does after sampling."""

from __future__ import annotations

import pytest

from pdserve.config import PreemptionMode, SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.kv import KVCacheConfig, KVManager
from pdserve.protocol.sampling_params import SamplingParams


def make(
    budget: int,
    num_blocks: int,
    host: int = 0,
    seqs: int = 8,
    mode: PreemptionMode = PreemptionMode.SWAP,
    prefix: bool = False,
    prompt_cap: int = 0,
) -> Scheduler:
    kv = KVManager(
        KVCacheConfig(
            block_size=4, num_blocks=num_blocks, num_host_blocks=host, enable_prefix_cache=prefix
        )
    )
    config = SchedulerConfig(budget, seqs, mode, max_prefill_tokens_with_decodes=prompt_cap)
    return Scheduler(config, kv)


def req(rid: str, n: int, max_tokens: int = 8, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), None)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    for seq in out.seqs:
        sampled = seq.samples
        s.advance(seq)
        if sampled:
            seq.request.output_token_ids.append(1000 + len(seq.request.output_token_ids))
    s.kv.check_integrity()
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in out.seqs]


def test_chunked_prefill_with_decodes_riding_along() -> None:
    s = make(budget=6, num_blocks=32)
    a, b = req("a", 3), req("b", 14)
    s.add(a)
    s.add(b)
    assert plan(step(s)) == [("a", 3), ("b", 3)]  # a's whole prompt, b's first chunk
    assert plan(step(s)) == [("a", 1), ("b", 5)]  # a decodes, b continues
    assert plan(step(s)) == [("a", 1), ("b", 5)]
    assert plan(step(s)) == [("a", 1), ("b", 1)]  # b's last prompt token: it samples
    assert (len(a.output_token_ids), len(b.output_token_ids)) == (4, 1)
    assert s.kv.block_table("b") and s.kv.num_computed_tokens("b") == 14


def test_prompt_tokens_are_capped_while_anything_decodes() -> None:
    """With a decode running, prompts share `max_prefill_tokens_with_decodes` (8) of the
    step's 64 tokens; with nothing decoding, a prompt takes the whole budget."""
    s = make(budget=64, num_blocks=64, prompt_cap=8)
    a = req("a", 40, max_tokens=30)
    s.add(a)
    assert plan(step(s)) == [("a", 40)]  # nothing decodes: the whole prompt at once
    s.add(req("b", 12, first=100))
    s.add(req("c", 12, first=200))
    assert plan(step(s)) == [("a", 1), ("b", 8)]  # c waits: no prompt tokens left
    assert [r.request_id for r in s.waiting] == ["c"]
    assert plan(step(s)) == [("a", 1), ("b", 4), ("c", 4)]  # b's last 4, c's first 4
    assert plan(step(s)) == [("a", 1), ("b", 1), ("c", 8)]  # b decodes; c finishes
    assert plan(step(s)) == [("a", 1), ("b", 1), ("c", 1)]


def test_without_the_cap_prompts_take_the_whole_budget_beside_decodes() -> None:
    s = make(budget=64, num_blocks=64, prompt_cap=0)
    s.add(req("a", 4, max_tokens=30))
    assert plan(step(s)) == [("a", 4)]
    s.add(req("b", 40, first=100))
    assert plan(step(s)) == [("a", 1), ("b", 40)]


def test_the_cap_never_exceeds_the_step_budget() -> None:
    s = make(budget=6, num_blocks=32, prompt_cap=100)
    s.add(req("a", 3, max_tokens=30))
    assert plan(step(s)) == [("a", 3)]
    s.add(req("b", 14, first=100))
    assert plan(step(s)) == [("a", 1), ("b", 5)]


def test_fcfs_admission_does_not_overtake() -> None:
    s = make(budget=64, num_blocks=6, seqs=8)  # 24 token slots
    s.add(req("big", 20))
    s.add(req("huge", 16))  # does not fit beside "big"
    s.add(req("small", 2))  # would fit, but must not overtake "huge"
    assert plan(step(s)) == [("big", 20)]
    assert [r.request_id for r in s.waiting] == ["huge", "small"]


def test_sequence_cap() -> None:
    s = make(budget=64, num_blocks=32, seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 2))
    assert plan(step(s)) == [("r0", 2), ("r1", 2)]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_swaps_out_the_newest_and_brings_it_back() -> None:
    s = make(budget=64, num_blocks=4, host=8)  # 16 device slots
    a, b = req("a", 8, max_tokens=6), req("b", 8, max_tokens=6, first=100)
    s.add(a)
    s.add(b)
    assert plan(step(s)) == [("a", 8), ("b", 8)]  # 2 full blocks each, pool full
    out = step(s)  # a's 9th token needs a 3rd block: b (newest) is swapped out
    assert plan(out) == [("a", 1)]
    assert [p.copies for p in out.swap_out] == [((2, 0), (3, 1))]
    assert b.status is RequestStatus.SWAPPED and b.num_preemptions == 1
    assert (s.kv.num_free_blocks, s.kv.num_used_blocks) == (1, 3)
    while a.status is RequestStatus.RUNNING:
        step(s)
        if len(a.output_token_ids) == 6:
            s.finish(a, RequestStatus.FINISHED_LENGTH)
    out = step(s)  # room again: b returns with its KV intact and decodes
    assert [len(p.copies) for p in out.swap_in] == [2] and plan(out) == [("b", 1)]
    assert b.status is RequestStatus.RUNNING and s.kv.num_computed_tokens("b") == 9


def test_preemption_by_recompute_requeues_at_the_front() -> None:
    s = make(budget=64, num_blocks=4, host=0, mode=PreemptionMode.RECOMPUTE)
    a, b, c = req("a", 8), req("b", 8, first=100), req("c", 2, first=200)
    for r in (a, b, c):
        s.add(r)
    step(s)
    out = step(s)
    assert plan(out) == [("a", 1)] and not out.swap_out
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.kv.num_used_blocks == 3


def test_finish_and_abort_release_everything() -> None:
    s = make(budget=5, num_blocks=16, host=4)
    a, b = req("a", 9), req("b", 3)
    s.add(a)
    s.add(b)
    step(s)  # a half-prefilled
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)  # still waiting: nothing to free
    assert not s.has_unfinished()
    assert s.kv.num_used_blocks == 0 and s.kv.num_free_blocks == 16


def test_the_prompt_cap_by_default_is_128_on_cpu_and_none_elsewhere() -> None:
    assert SchedulerConfig().prompt_cap("cpu") == 128
    assert SchedulerConfig().prompt_cap("cuda:0") is None
    assert SchedulerConfig(max_prefill_tokens_with_decodes=0).prompt_cap("cpu") is None
    assert SchedulerConfig(max_prefill_tokens_with_decodes=64).prompt_cap("cuda") == 64


def test_a_negative_prompt_cap_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"max_prefill_tokens_with_decodes must be an integer >= 0, got -1"
    ):
        SchedulerConfig(max_prefill_tokens_with_decodes=-1)
