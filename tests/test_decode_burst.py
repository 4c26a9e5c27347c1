"""Decode bursts (engine/core.py): several greedy decode steps in one compiled call.

Every check compares two engines over the shipped SmolLM2 GGUF, one step a call
(`decode_burst=1`) and bursts of up to 8 (no time cap, so every burst the rules allow
runs whole): the same token ids, text, finish reason and stop reason for every request,
nothing left in the pool, and the prefix cache holding what one step a call commits.
The bursts need the compiled one-call path, so these are `kernels` tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.step_trace import StepTrace
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.outputs import RequestOutput

pytestmark = pytest.mark.kernels

MAX_MODEL_LEN = 320
QUESTIONS = [
    "Tell me a story about a dragon and a lighthouse.",
    "What is 2 + 2? Answer in one word.",
    "Name three colours.",
]


@pytest.fixture(scope="module")
def engines(smollm2_path: Path) -> dict[int, Engine]:
    def make(burst: int) -> Engine:
        scheduler = SchedulerConfig(decode_burst=burst, decode_burst_ms=1e6)
        config = EngineConfig(
            model=str(smollm2_path), max_model_len=MAX_MODEL_LEN, scheduler=scheduler
        )
        return Engine.from_config(config)

    return {1: make(1), 8: make(8)}


def chat(engine: Engine, question: str) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}])
    return tok.encode(text, add_special_tokens=False)


def run(
    engine: Engine, requests: list[tuple[list[int], SamplingParams]]
) -> tuple[list[RequestOutput], list[int]]:
    """The requests together: each one's final output, in order, and the steps of each
    call (core.bursts.last_steps)."""
    rids = [engine.add_request(ids, params) for ids, params in requests]
    final: dict[str, RequestOutput] = {}
    calls: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        calls.append(engine.core.bursts.last_steps)
    engine.core.check_integrity()
    assert engine.core.kv.num_used_blocks == 0
    return [final[r] for r in rids], calls


def summary(out: RequestOutput) -> tuple[object, ...]:
    return out.token_ids, out.text, out.finish_reason, out.stop_reason


def test_a_burst_gives_every_request_the_tokens_of_one_step_a_call(
    engines: dict[int, Engine],
) -> None:
    """Three requests with their own limits, together and each alone: one ends on EOS,
    one at max_tokens (not a multiple of the burst), one filling max_model_len."""
    one = engines[1]
    long_prompt = chat(one, "Repeat after me: " + "the quick brown fox " * 63)
    assert MAX_MODEL_LEN - 40 < len(long_prompt) < MAX_MODEL_LEN - 10
    requests = [
        (chat(one, QUESTIONS[1]), SamplingParams(max_tokens=100, temperature=0)),
        (chat(one, QUESTIONS[0]), SamplingParams(max_tokens=37, temperature=0)),
        (
            long_prompt,
            SamplingParams(
                max_tokens=MAX_MODEL_LEN - len(long_prompt), temperature=0, ignore_eos=True
            ),
        ),
    ]
    alone = {b: [run(e, [r])[0][0] for r in requests] for b, e in engines.items()}
    together = {b: run(e, requests) for b, e in engines.items()}
    want = [summary(o) for o in alone[1]]
    assert [o.finish_reason for o in alone[1]] == ["stop", "length", "length"]
    assert len(alone[1][1].token_ids) == 37
    assert len(long_prompt) + len(alone[1][2].token_ids) == MAX_MODEL_LEN
    assert [summary(o) for o in alone[8]] == want
    assert [summary(o) for o in together[1][0]] == want
    assert [summary(o) for o in together[8][0]] == want
    assert set(together[1][1]) == {1}
    assert max(together[8][1]) == 8  # whole bursts ran


def test_the_core_counts_its_steps_and_those_run_in_bursts(engines: dict[int, Engine]) -> None:
    """37 tokens: the prefill's first, then 36 decode steps - bursts of 8, 8, 8, 8 and the
    4 left (the batch size's step time is known by now: no single timing step)."""
    params = SamplingParams(max_tokens=37, temperature=0, ignore_eos=True)
    prompt = chat(engines[1], QUESTIONS[0])
    run(engines[8], [(prompt, params)])  # the step time of a batch of one, measured
    for burst, engine in engines.items():
        core = engine.core
        before = core.bursts.num_steps, core.bursts.num_burst_steps
        outs, calls = run(engine, [(prompt, params)])
        assert len(outs[0].token_ids) == 37
        assert calls == ([1] * 37 if burst == 1 else [1, 8, 8, 8, 8, 4])
        assert core.bursts.num_steps - before[0] == 37
        assert core.bursts.num_burst_steps - before[1] == (0 if burst == 1 else 36)


def test_a_stop_token_or_stop_string_inside_a_burst_ends_where_one_step_a_call_does(
    engines: dict[int, Engine],
) -> None:
    one = engines[1]
    prompt = chat(one, QUESTIONS[0])
    free = run(one, [(prompt, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))])
    tokens, text = free[0][0].token_ids, free[0][0].text
    # a token first seen mid-way: the stop lands inside a burst, not at its end
    at = next(i for i in range(11, 40) if tokens[i] not in tokens[:i] and i % 8 not in (0, 7))
    words = text.split()
    stop = " ".join(words[len(words) // 2 : len(words) // 2 + 2])
    cases = [
        SamplingParams(max_tokens=48, temperature=0, stop_token_ids=[tokens[at]]),
        SamplingParams(max_tokens=48, temperature=0, stop=[stop]),
    ]
    for params in cases:
        got = {b: run(e, [(prompt, params)]) for b, e in engines.items()}
        assert summary(got[8][0][0]) == summary(got[1][0][0])
        assert got[8][0][0].finish_reason == "stop" and max(got[8][1]) > 1
    by_token = run(engines[8], [(prompt, cases[0])])[0][0]
    assert by_token.token_ids == tokens[: at + 1] and by_token.stop_reason == tokens[at]
    by_string = run(engines[8], [(prompt, cases[1])])[0][0]
    assert by_string.stop_reason == stop and stop not in by_string.text
    assert len(by_string.token_ids) < 48


def test_what_a_burst_commits_is_found_by_the_prefix_cache(engines: dict[int, Engine]) -> None:
    """A follow-up whose prompt is a finished request's prompt and answer reuses the
    blocks its decode filled, as many under bursts as one step a call."""
    cached = {}
    for b, engine in engines.items():
        prompt = chat(engine, QUESTIONS[2])
        first = run(engine, [(prompt, SamplingParams(max_tokens=40, temperature=0))])[0][0]
        follow = prompt + first.token_ids[:-1] + chat(engine, "And three more?")
        again = run(engine, [(follow, SamplingParams(max_tokens=4, temperature=0))])[0][0]
        cached[b] = again.num_cached_tokens
    bs = engines[1].core.kv.cfg.block_size
    assert cached[8] == cached[1] > (len(chat(engines[1], QUESTIONS[2])) // bs) * bs


def test_sampled_rows_logprobs_and_waiting_prompts_take_one_step_a_call(
    engines: dict[int, Engine],
) -> None:
    burst = engines[8]
    prompt = chat(burst, QUESTIONS[0])
    for params in (
        SamplingParams(max_tokens=12, temperature=0.8, seed=7),
        SamplingParams(max_tokens=12, temperature=0, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=12),
    ):
        outs = {b: run(e, [(prompt, params)]) for b, e in engines.items()}
        assert set(outs[8][1]) == {1}
        assert summary(outs[8][0][0]) == summary(outs[1][0][0])
    # a prompt waiting for the pool: no burst while it waits
    core = burst.core
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    seqs = core.scheduler.config.max_num_seqs
    core.scheduler.config = SchedulerConfig(max_num_seqs=1, decode_burst=8, decode_burst_ms=1e6)
    try:
        outs, calls = run(burst, [(prompt, greedy), (prompt, greedy)])
    finally:
        core.scheduler.config = SchedulerConfig(
            max_num_seqs=seqs, decode_burst=8, decode_burst_ms=1e6
        )
    assert calls[:30] == [1] * 30 and max(calls) == 8
    assert outs[0].token_ids == outs[1].token_ids


def test_a_burst_asks_for_all_its_blocks_or_runs_one_step(engines: dict[int, Engine]) -> None:
    """Scheduler.extend: blocks for every row's burst, all or none. With the pool held
    empty the step runs alone and takes no block; once it is free the bursts go on, and
    the request ends as one step a call ends it."""
    engine = engines[8]
    core, bs = engine.core, engine.core.kv.cfg.block_size
    prompt = chat(engine, QUESTIONS[2])
    prompt += prompt[-1:] * ((bs - 1 - len(prompt)) % bs)  # the burst's 8 cross a block
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    engine.step()  # the prefill and the first token
    held = core.kv.block_table(rid)
    assert core.kv.num_new_blocks(rid, 8) == 1 and core.kv.num_new_blocks(rid, 1) == 0
    assert core.kv.hold("filler", [], num_tokens=core.kv.num_obtainable_blocks * bs) == 0
    assert core.kv.num_obtainable_blocks == 0
    engine.step()
    assert core.bursts.last_steps == 1 and core.kv.block_table(rid) == held
    core.kv.free("filler")
    final = None
    calls = []
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
        calls.append(core.bursts.last_steps)
    assert max(calls) == 8
    core.check_integrity()
    assert core.kv.num_used_blocks == 0
    want = run(engines[1], [(prompt, params)])[0][0]
    assert final is not None and summary(final) == summary(want)


def test_a_trace_writes_a_line_for_every_step_of_a_burst(tmp_path: Path) -> None:
    class Sched:
        def schedule(self) -> None:
            return None

    trace = StepTrace(Sched(), str(tmp_path / "t.jsonl"))
    trace.observer.last = (0, 0, 0, 2, 300)
    trace.record(10.0, 0.03, steps=3)
    trace.close()
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["counts"] for r in rows] == [[0, 0, 0, 2, 300], [0, 0, 0, 2, 302], [0, 0, 0, 2, 304]]
    assert [r["start"] for r in rows] == pytest.approx([10.0, 10.01, 10.02])
    assert [r["seconds"] for r in rows] == pytest.approx([0.01] * 3)
