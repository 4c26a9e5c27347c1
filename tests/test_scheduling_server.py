"""Length-aware scheduling through a real server (docs/scheduling.md).

`--prefill 1 --decode 2` with TetriInfer's choices (sjf prefill, length-aware decode
dispatch, reserve-dynamic admission) and the length head shipped for SmolLM2 (`--predictor
auto`, the default): 32 mixed completions and 8 chat questions, sent at once, must give
exactly the greedy texts of an in-process engine with today's defaults and no predictor.
The predictions show in every reply's `pdserve_timings`, and /debug/cluster and /metrics
count them against the real lengths. A missing or mismatched head file stops the start
with a message naming the file and the mismatch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.tiny_models import make_tiny_model
from test_disagg_server import PROMPTS, cluster, stop, wait_clean
from test_fault_tolerance import prometheus
from test_server import MODEL, Server

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine, load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.predictor.head import HeadSpec, LengthHead, set_probe

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


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(
        "--prefill", "1", "--decode", "2", "--prefill-policy", "sjf",
        "--decode-policy", "length-aware", "--decode-admission", "reserve-dynamic",
        "--enable-debug-endpoints", "--kv-cache-memory-gib", "0.5",
    )  # fmt: skip
    yield s
    stop(s)


@pytest.fixture(scope="module")
def reference() -> tuple[list[str], list[str]]:
    """Greedy texts of PROMPTS and QUESTIONS by an engine with the defaults, no head."""
    engine = Engine.from_config(EngineConfig(num_threads=2))
    tok = engine.tokenizer
    comp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    chat = SamplingParams(max_tokens=CHAT_MAX_TOKENS, temperature=0.0)
    ids = [tok.prompt_ids(p) for p in PROMPTS]
    chats = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), False)
        for q in QUESTIONS
    ]
    for i, p in enumerate(ids):
        engine.add_request(p, comp, f"c{i}")
    for i, p in enumerate(chats):
        engine.add_request(p, chat, f"q{i}")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.text
    return [done[f"c{i}"] for i in range(len(ids))], [done[f"q{i}"] for i in range(len(chats))]


def post(server: Server, path: str, body: dict) -> dict:
    status, reply = server.post(path, json.dumps(body).encode(), key=None)
    assert status == 200, reply
    return reply


def complete(server: Server, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return post(server, "/v1/completions", body)


def ask(server: Server, question: str) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": CHAT_MAX_TOKENS,
        "temperature": 0,
    }
    return post(server, "/v1/chat/completions", body)


def test_tetriinfer_policies_and_the_shipped_head_keep_greedy_outputs_exact(
    server: Server, reference: tuple[list[str], list[str]]
) -> None:
    with ThreadPoolExecutor(16) as pool:
        comps = list(pool.map(lambda p: complete(server, p), PROMPTS))
        chats = list(pool.map(lambda q: ask(server, q), QUESTIONS))
    assert [r["choices"][0]["text"] for r in comps] == reference[0]
    assert [r["choices"][0]["message"]["content"] for r in chats] == reference[1]
    for reply in comps + chats:
        timings = reply["pdserve_timings"]
        low, high = timings["predicted_output_low"], timings["predicted_output_high"]
        assert low % 32 == 0 and (high is None or high == low + 32), timings
    wait_clean(server)
    counts = cluster(server)["controller"]["length_prediction"]
    stopped = sum(r["choices"][0]["finish_reason"] == "stop" for r in comps + chats)
    truncated = len(comps) + len(chats) - stopped
    assert (counts["counted"], counts["truncated"], counts["unpredicted"]) == (
        stopped,
        truncated,
        0,
    )
    assert (counts["granularity"], counts["num_buckets"]) == (32, 9)
    assert sum(map(sum, counts["confusion"])) == stopped > 0
    samples = prometheus(server)
    matrix = {k: v for k, v in samples.items() if k.startswith("pdserve_length_predictions_total{")}
    assert sum(matrix.values()) == stopped
    assert samples["pdserve_length_predictions_truncated_total"] == truncated
    diagonal = sum(counts["confusion"][i][i] for i in range(9))
    assert samples["pdserve_length_prediction_accuracy"] == pytest.approx(diagonal / stopped)


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
