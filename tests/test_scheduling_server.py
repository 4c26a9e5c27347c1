"""Length-aware scheduling through a real server (docs/scheduling.md).

One `--prefill 1 --decode 2` server with TetriInfer's choices (sjf prefill, length-aware
decode dispatch, reserve-dynamic admission), the length head shipped for SmolLM2
(`--predictor auto`, the default), and a KV pool of 0.01 GiB per instance (29 blocks with
the kernels' fp16 KV, 14 with the fallback's fp32), small enough for the admission rule
to have something to decide:

- 32 mixed completions and 8 chat questions, sent at once, give exactly the greedy texts
  of an in-process engine with today's defaults and no head; every reply's predicted
  range is the shipped head's prediction for that prompt, computed here from the prompt
  state the in-process engine computes; /debug/cluster and /metrics count the
  predictions against the real lengths.
- Each policy acts, on a workload whose outcome it fixes exactly. The instances a
  workload is aimed at are paused (SIGSTOP) while its requests are sent one by one, each
  once the controller has passed it on, so what they are sent queues in their sockets in
  a known order and they take all of it in one go when they resume:
  - sjf: five prompts reach the prefill instance longest first; they form one scheduling
    batch, admitted shortest first, so every one of the 10 pairs is overtaken (fcfs or
    ljf: none);
  - length-aware: heavy, light, heavy and light requests (by the head) are dispatched to
    the paused decode instances in that order: each takes one heavy and one light
    (least-loaded alternation would give the first both heavy ones);
  - reserve-dynamic: three heavy requests whose prompts fit together (greedy admission
    takes both of a pair at once) but whose predicted growth does not: the decode
    instance given two holds its second back until the first has made room.
  Each is read from the instances' counters in /debug/cluster (num_prefill_batches,
  num_prefill_overtakes, num_predicted_decodes and predicted_decode_tokens,
  num_admission_held), as differences, so the tests pass alone and in any order.
- A missing or mismatched head file stops the start with a message naming the file and
  the mismatch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers.server import MODEL, Server, cluster, prometheus, stop, wait_clean, wait_for
from helpers.tiny_models import make_tiny_model
from test_disagg_server import PROMPTS

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine, load_model
from pdserve.engine.features.length_prediction import LengthPredictor
from pdserve.engine.head_spec import HeadSpec
from pdserve.engine.length_head import LengthHead, read_head, set_probe
from pdserve.predictor.shipped import SHIPPED_DIR, SHIPPED_HEADS
from pdserve.protocol.sampling_params import SamplingParams

MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of Italy? Answer with one word.",
    "Write a short poem about the sea.",
    "List five fruits.",
    "Is a whale a mammal? Answer yes or no.",
    "Explain gravity to a child.",
    "What is 7 plus 5?",
    "Write a Python function that reverses a string.",
    "Name three colors.",
]
CHAT_MAX_TOKENS = 96
HEAVY = 128  # --heavy-decode-tokens' default: a prediction from 128 tokens up is heavy

# sjf: completions of 5 distinct lengths (no two share a first block), sent longest first.
BY_LENGTH = [
    "Seven swans swam slowly across the cold grey lake while the old ferryman watched "
    "from the pier and counted them twice",
    "Tomorrow the market opens early and the baker will sell warm bread to everyone",
    "Under the bridge a small cat sleeps in the sun",
    "Quiet rivers run deep",
    "Hello",
]
# length-aware: the head's class of each, in the order they are dispatched (the test
# checks the head agrees).
HEAVY_LIGHT = [
    ("Write a long story about a dragon who learns to bake bread in a small mountain "
     "village.", True),
    ("Hi! What is the capital of Italy? Answer with one word.", False),
    ("Write a detailed essay about the history of the printing press and its effects on "
     "Europe.", True),
    ("Name the capital of France in one word.", False),
]  # fmt: skip
# reserve-dynamic: three requests the head predicts to reach its open last bucket
# ([256, inf)): each is predicted to need all of ADMISSION_MAX_TOKENS.
LONG_ONES = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Write a long letter to a friend describing your summer holiday by the sea, with many details.",
    "Write a long story about a trip to Sweden. Be detailed.",
]
ADMISSION_MAX_TOKENS = 200


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(
        "--prefill", "1", "--decode", "2", "--prefill-policy", "sjf",
        "--decode-policy", "length-aware", "--decode-admission", "reserve-dynamic",
        "--enable-debug-endpoints", "--kv-cache-memory-gib", "0.01",
        # The paused instances miss heartbeats for a few seconds; a slow machine must not
        # count them dead, nor let prompt KV waiting for a held request expire.
        "--instance-timeout", "120", "--kv-lease", "600",
    )  # fmt: skip
    yield s
    stop(s)


@pytest.fixture(scope="module")
def head() -> LengthHead:
    (name,) = SHIPPED_HEADS.values()
    return read_head(SHIPPED_DIR / name)


def chat_ids(engine: Engine, question: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), False)


def run_recording_states(
    engine: Engine, jobs: list[tuple[list[int], SamplingParams]]
) -> tuple[list[str], list[torch.Tensor]]:
    """Each job's text and the prompt state the length head reads (the final hidden
    state of its last prompt token, as the core hands it to `prompt_state_sink`)."""
    states: dict[str, torch.Tensor] = {}

    def keep(rid: str, state: torch.Tensor) -> None:
        states[rid] = state.clone()

    engine.core.participant(LengthPredictor).state_sink = keep
    try:
        for i, (ids, params) in enumerate(jobs):
            engine.add_request(ids, params, f"sched-{i}")
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.text
    finally:
        engine.core.participant(LengthPredictor).state_sink = None
    rids = [f"sched-{i}" for i in range(len(jobs))]
    return [done[r] for r in rids], [states[r] for r in rids]


def predict(head: LengthHead, jobs: list[list[int]], states: list[torch.Tensor]) -> list[dict]:
    """The shipped head's prediction for each prompt, as `pdserve_timings` shows it."""
    preds = head.predict(torch.stack(states), [len(ids) for ids in jobs])
    return [{"predicted_output_low": p.low, "predicted_output_high": p.high} for p in preds]


def predictions_of(engine: Engine, head: LengthHead, questions: list[str]) -> list[dict]:
    ids = [chat_ids(engine, q) for q in questions]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    _, states = run_recording_states(engine, [(p, params) for p in ids])
    return predict(head, ids, states)


@pytest.fixture(scope="module")
def reference(served_engine: Engine, head: LengthHead) -> tuple[list[str], list[str], list[dict]]:
    """Greedy texts of PROMPTS and QUESTIONS by an engine with the defaults, no head; and
    the head's prediction for each (PROMPTS first), from the states that engine computed."""
    tok = served_engine.tokenizer
    comp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    chat = SamplingParams(max_tokens=CHAT_MAX_TOKENS, temperature=0.0)
    jobs = [(tok.prompt_ids(p), comp) for p in PROMPTS]
    jobs += [(chat_ids(served_engine, q), chat) for q in QUESTIONS]
    texts, states = run_recording_states(served_engine, jobs)
    predicted = predict(head, [ids for ids, _ in jobs], states)
    return texts[: len(PROMPTS)], texts[len(PROMPTS) :], predicted


def post(server: Server, path: str, body: dict) -> dict:
    """POST and the reply; a request may wait minutes (the small pool takes few at a time,
    and a broken build may slow it further) and still fail on an assertion, not a
    socket timeout."""
    headers = {"Content-Type": "application/json"}
    status, reply = server.request("POST", path, json.dumps(body).encode(), headers, 600)
    assert status == 200, reply
    return reply


def complete(server: Server, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return post(server, "/v1/completions", body)


def ask(server: Server, question: str, max_tokens: int = CHAT_MAX_TOKENS) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return post(server, "/v1/chat/completions", body)


def predicted(reply: dict) -> dict:
    timings = reply["pdserve_timings"]
    return {k: timings[k] for k in ("predicted_output_low", "predicted_output_high")}


# ---- the controller's view and the instances' counters ---------------------------------


def status_rows(server: Server) -> list[dict]:
    """/cluster/status's instance rows: the controller's own records (no instance is
    asked, so it answers while instances are paused)."""
    status, reply = server.get("/cluster/status")
    assert status == 200, reply
    return list(reply["instances"])


def names(server: Server, role: str) -> list[str]:
    """The instances of `role`, in the order the controller lists (and breaks ties) them."""
    return [r["name"] for r in status_rows(server) if r["role"] == role]


def assigned(server: Server, role: str) -> int:
    """What the controller has passed to the instances of `role` and not yet seen leave
    them: prompt tokens (prefill), requests (decode)."""
    key = "assigned_prefill_tokens" if role == "prefill" else "assigned_requests"
    return sum(r[key] for r in status_rows(server) if r["role"] == role)


def counters(server: Server) -> dict[str, dict]:
    return {r["name"]: r["stats"] for r in cluster(server)["instances"]}


@contextlib.contextmanager
def paused(server: Server, role: str) -> Iterator[None]:
    """The instances of `role` stopped (SIGSTOP) for the block, resumed after it."""
    pids = [r["pid"] for r in status_rows(server) if r["role"] == role]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def grew(server: Server, role: str, before: int) -> bool:
    return assigned(server, role) > before


def send_one_by_one(
    server: Server, pool: ThreadPoolExecutor, calls: Sequence[Callable[[], dict]], role: str
) -> list[Future[dict]]:
    """Start each call once the previous one has reached the (paused) instances of
    `role`: the controller sends them on in this order."""
    futures = []
    for call in calls:
        before = assigned(server, role)
        futures.append(pool.submit(call))
        wait_for(partial(grew, server, role, before), timeout=300)
    return futures


def taken(after: dict[str, dict], before: dict[str, dict], names: list[str]) -> list[tuple]:
    """Per instance in `names`, since `before`: the prefilled requests it took with a
    prediction, and the low ends of their predicted buckets summed."""
    fields = ("num_predicted_decodes", "predicted_decode_tokens")
    return [tuple(after[n][f] - before[n][f] for f in fields) for n in names]


# ---- tests -------------------------------------------------------------------------------


def test_tetriinfer_policies_and_the_shipped_head_keep_greedy_outputs_exact(
    server: Server, reference: tuple[list[str], list[str], list[dict]]
) -> None:
    wait_clean(server)
    before = cluster(server)["controller"]["length_prediction"]
    samples_before = prometheus(server)
    with ThreadPoolExecutor(16) as pool:
        comps = list(pool.map(lambda p: complete(server, p), PROMPTS))
        chats = list(pool.map(lambda q: ask(server, q), QUESTIONS))
    assert [r["choices"][0]["text"] for r in comps] == reference[0]
    assert [r["choices"][0]["message"]["content"] for r in chats] == reference[1]
    assert [predicted(r) for r in comps + chats] == reference[2]
    wait_clean(server)
    counts = cluster(server)["controller"]["length_prediction"]
    stopped = sum(r["choices"][0]["finish_reason"] == "stop" for r in comps + chats)
    truncated = len(comps) + len(chats) - stopped
    delta = {k: counts[k] - before[k] for k in ("counted", "truncated", "unpredicted")}
    assert delta == {"counted": stopped, "truncated": truncated, "unpredicted": 0}
    assert (counts["granularity"], counts["num_buckets"]) == (32, 9)
    # This workload's confusion matrix, from its replies: [predicted][actual].
    mine = [[0] * 9 for _ in range(9)]
    for reply in comps + chats:
        if reply["choices"][0]["finish_reason"] == "stop":
            low = reply["pdserve_timings"]["predicted_output_low"]
            mine[low // 32][min(reply["usage"]["completion_tokens"] // 32, 8)] += 1
    added = [[a - b for a, b in zip(*rows, strict=True)] for rows in zip(
        counts["confusion"], before["confusion"], strict=True)]  # fmt: skip
    assert added == mine and stopped > 0
    samples = prometheus(server)

    def matrix(s: dict[str, float]) -> float:
        return sum(v for k, v in s.items() if k.startswith("pdserve_length_predictions_total{"))

    assert matrix(samples) - matrix(samples_before) == stopped
    key = "pdserve_length_predictions_truncated_total"
    assert samples[key] - samples_before.get(key, 0.0) == truncated
    diagonal = sum(counts["confusion"][i][i] for i in range(9))
    assert samples["pdserve_length_prediction_accuracy"] == pytest.approx(
        diagonal / counts["counted"]
    )


def test_sjf_admits_a_scheduling_batch_shortest_first(
    server: Server, served_engine: Engine
) -> None:
    sizes = [len(served_engine.tokenizer.prompt_ids(p)) for p in BY_LENGTH]
    assert sizes == sorted(set(sizes), reverse=True)  # distinct, longest first
    wait_clean(server)
    (prefill,) = names(server, "prefill")
    before = counters(server)[prefill]
    with ThreadPoolExecutor(len(BY_LENGTH)) as pool:
        with paused(server, "prefill"):
            calls = [partial(complete, server, p, 2) for p in BY_LENGTH]
            futures = send_one_by_one(server, pool, calls, "prefill")
        replies = [f.result() for f in futures]
    assert all(r["choices"][0]["finish_reason"] for r in replies)
    after = counters(server)[prefill]
    # One batch of five, and admitted in the reverse of its arrival order: each of its 10
    # pairs was overtaken (only the ascending order does that). fcfs forms no batch.
    assert after["num_prefill_batches"] - before["num_prefill_batches"] == 1
    assert after["num_prefill_overtakes"] - before["num_prefill_overtakes"] == 10


def test_length_aware_dispatch_gives_each_decode_instance_one_of_each_class(
    server: Server, served_engine: Engine, head: LengthHead
) -> None:
    questions = [q for q, _ in HEAVY_LIGHT]
    expected = predictions_of(served_engine, head, questions)
    lows = [p["predicted_output_low"] for p in expected]
    assert [low >= HEAVY for low in lows] == [h for _, h in HEAVY_LIGHT]
    wait_clean(server)
    decode = names(server, "decode")
    before = counters(server)
    with ThreadPoolExecutor(len(questions)) as pool:
        with paused(server, "decode"):
            calls = [partial(ask, server, q, 8) for q in questions]
            futures = send_one_by_one(server, pool, calls, "decode")
        replies = [f.result() for f in futures]
    assert [predicted(r) for r in replies] == expected
    # Heavy to the first (a tie), light to the second (fewer requests), heavy to the
    # second (fewer heavy), light to the first (fewer light): one of each class on each.
    # Least-loaded or round robin: both heavy ones to the first, both light to the second.
    assert taken(counters(server), before, decode) == [
        (2, lows[0] + lows[3]),
        (2, lows[1] + lows[2]),
    ]


def test_reserve_dynamic_holds_back_what_would_outgrow_the_pool(
    server: Server, served_engine: Engine, head: LengthHead
) -> None:
    expected = predictions_of(served_engine, head, LONG_ONES)
    assert all(p == {"predicted_output_low": 256, "predicted_output_high": None} for p in expected)
    wait_clean(server)
    decode = names(server, "decode")
    before = counters(server)
    s = before[decode[0]]
    blocks = s["num_free_blocks"] + s["num_used_blocks"] + s["num_cached_blocks"]
    bs = 16
    # On the instance given two: the first is admitted (an empty batch admits anything);
    # for the second, the shortest predicted remainder is s = max_tokens - 1 (both
    # unbounded but for max_tokens), and both growing by s tokens outgrows the pool,
    # though both prompts fit in it at once (what greedy admission checks).
    ids = [chat_ids(served_engine, q) for q in LONG_ONES]
    s_steps = ADMISSION_MAX_TOKENS - 1
    grown = [-(-(len(p) + 1 + s_steps) // bs) for p in ids]
    held = [-(-(len(p) + 1) // bs) for p in ids]
    assert grown[0] + grown[2] > blocks >= held[0] + held[2] + 2, (grown, held, blocks)
    assert sum(held) <= blocks  # the paused decode side leaves all three on the prefill
    with ThreadPoolExecutor(len(LONG_ONES)) as pool:
        with paused(server, "decode"):
            calls = [partial(ask, server, q, ADMISSION_MAX_TOKENS) for q in LONG_ONES]
            futures = send_one_by_one(server, pool, calls, "decode")
        replies = [f.result() for f in futures]
    assert [predicted(r) for r in replies] == expected
    after = counters(server)
    # Length-aware: the first and the third to the first instance, the second to the other.
    assert taken(after, before, decode) == [(2, 512), (1, 256)]
    held_back = [after[n]["num_admission_held"] - before[n]["num_admission_held"] for n in decode]
    assert held_back == [1, 0]  # greedy admission: [0, 0]


def serve_fails(*args: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr


def test_a_missing_head_file_stops_the_start_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.safetensors"
    code, err = serve_fails("--predictor", str(missing))
    assert code == 2, err
    assert f"pdserve: error: length predictor file {missing} does not exist" in err


def test_a_head_trained_for_another_model_stops_the_start_naming_the_mismatch(
    tmp_path: Path,
) -> None:
    tiny_dir = make_tiny_model(tmp_path, "LlamaForCausalLM")
    tiny = load_model(EngineConfig(model=str(tiny_dir), num_threads=1))
    c = tiny.config
    head = LengthHead(HeadSpec(64, 9, c.hidden_size, c.vocab_size, c.architecture))
    set_probe(head, tiny.embed_tokens)
    path = tmp_path / "tiny-head.safetensors"
    head.save(path)
    code, err = serve_fails("--predictor", str(path))
    assert code == 1, err
    c = "the served model has 49152 and 576"
    assert (
        f"pdserve: error: engine failed to start: length predictor file {path} was trained "
        f"for a model with vocabulary {tiny.config.vocab_size} and hidden size "
        f"{tiny.config.hidden_size}; {c}"
    ) in err
    assert "Traceback" not in err
