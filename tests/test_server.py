"""`pdserve serve` as a user runs it: a real server process on loopback, the
official `openai` client unchanged, raw HTTP for bad input, a real SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from helpers.reference import FRANCE_ANSWERS
from helpers.server import (
    KEY,
    MODEL,
    Server,
    auth,
    pdkv_segments,
    post_and_leave,
    segments_left,
    stop,
    wait_for,
)
from openai import BadRequestError, NotFoundError, OpenAI

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
_auth = auth


@pytest.fixture
def server(keyed_server: Server) -> Server:
    """The session's shared keyed server (tests/conftest.py)."""
    return keyed_server


@pytest.fixture
def client(keyed_server: Server) -> OpenAI:
    return OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_with_the_openai_client(client: OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (37, 8)


def test_the_readme_request_gets_the_readme_answer(server: Server) -> None:
    """The README's first lines: its curl body, sent as is to the shared server (fp32
    activations), gets the answer the README shows for `--activations fp32`; the README
    shows the default's (int8, llama.cpp's answer) too (test_cli checks it is served)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    curl = readme[readme.index("curl -s http://127.0.0.1:8000/v1/chat/completions") :]
    body = curl[curl.index("-d '") + 4 : curl.index("}'") + 1]
    status, reply = server.post("/v1/chat/completions", body.encode())
    assert status == 200, reply
    assert reply["model"] == MODEL == json.loads(body)["model"]
    assert reply["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert "with `--activations fp32`: The capital of France is Paris." in readme
    int8 = FRANCE_ANSWERS["int8"]
    assert f"# {int8[: int8.index(', la femme')]}, ..." in readme


def test_chat_streaming_role_first_then_deltas_and_usage(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        max_completion_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_completions_text_tokens_stop_and_length(client: OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert r.choices[0].text == " Paris.\n\nThe answer is:"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=["\n"]
    )
    assert r.choices[0].text == " Paris." and r.choices[0].finish_reason == "stop"
    ids = [504, 3575, 282, 4649, 314]  # the same prompt as token ids
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert r.choices[0].text == " Paris." and r.usage.prompt_tokens == 5


def test_streamed_completion_equals_the_whole_one(client: OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream)
    whole = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0
    )
    assert streamed == whole.choices[0].text and len(streamed) > 20


def test_seed_reproducible(client: OpenAI) -> None:
    kw = {
        "model": MODEL,
        "prompt": "My favourite animal is",
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 7,
    }
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    c = client.completions.create(**{**kw, "seed": 8}).choices[0].text
    assert a == b and a != c


def test_models_and_errors_through_the_client(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(BadRequestError, match=r"temperature must be at least 0, got -1\.0"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)


PROMPT_TYPES = (
    "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
)
INTEGER = "max_tokens: Input should be a valid integer"
BAD = [
    (b"{bad", "request body is not valid JSON", None),
    (b"[1, 2]", "request body must be a JSON object", None),
    (b'"text"', "request body must be a JSON object", None),
    (b"{}", "prompt: Field required", "prompt"),
    (b'{"prompt": ""}', "prompt must not be empty", "prompt"),
    (b'{"prompt": []}', "prompt must not be empty", "prompt"),
    (b'{"prompt": 5}', PROMPT_TYPES, "prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens must be at least 1, got 0", "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "3"}', INTEGER, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": true}', INTEGER, "max_tokens"),
    (
        b'{"prompt": "hi", "temperature": -0.5}',
        "temperature must be at least 0, got -0.5",
        "temperature",
    ),
    (b'{"prompt": "hi", "top_p": 0}', "top_p must be in (0, 1], got 0.0", "top_p"),
    (b'{"prompt": "hi", "top_p": 1.5}', "top_p must be in (0, 1], got 1.5", "top_p"),
    (
        b'{"prompt": "hi", "top_k": -2}',
        "top_k must be -1 (disabled), 0 (disabled) or positive, got -2",
        "top_k",
    ),
    (b'{"prompt": "hi", "min_p": 2}', "min_p must be between 0.0 and 1.0, got 2.0", "min_p"),
    (
        b'{"prompt": "hi", "presence_penalty": 3}',
        "presence_penalty must be between -2.0 and 2.0, got 3.0",
        "presence_penalty",
    ),
    (b'{"prompt": "hi", "logprobs": 21}', "logprobs must be between 0 and 20, got 21", "logprobs"),
    (b'{"prompt": "hi", "stop": [""]}', "stop strings must not be empty", "stop"),
    (b'{"prompt": "hi", "n": 0}', "n must be between 1 and 16, got 0", "n"),
    (b'{"prompt": "hi", "n": 17}', "n must be between 1 and 16, got 17", "n"),
    (b'{"prompt": "hi", "bogus": 1}', "unknown field 'bogus'", "bogus"),
    (
        b'{"prompt": [1, 49152]}',
        "prompt token id 49152 is outside the vocabulary [0, 49152)",
        "prompt",
    ),
    (b'{"prompt": [1, -1]}', "prompt token id -1 is outside the vocabulary [0, 49152)", "prompt"),
    (
        b'{"prompt": "hi", "stop_token_ids": [99999]}',
        "stop token id 99999 is outside the vocabulary [0, 49152)",
        "stop_token_ids",
    ),
    (
        b'{"prompt": "hi", "max_tokens": 8192}',
        "this model's maximum context length is 8192 tokens, but 1 prompt tokens plus "
        "max_tokens=8192 would need 8193",
        "max_tokens",
    ),
]


def bad_request(message: str, param: str | None) -> dict:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": 400}
    return {"error": error}


@pytest.mark.parametrize(("raw", "message", "param"), BAD, ids=[b[0].decode() for b in BAD])
def test_bad_completion_bodies(server: Server, raw: bytes, message: str, param: str | None) -> None:
    assert server.post("/v1/completions", raw) == (400, bad_request(message, param))


BAD_CHAT = [
    (
        b'{"messages": []}',
        "messages: List should have at least 1 item after validation, not 0",
        "messages",
    ),
    (
        b'{"messages": [{"role": "wizard", "content": "hi"}]}',
        "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
        "messages.0.role",
    ),
    (
        b'{"messages": [{"role": "user"}]}',
        "messages.0.content: Field required",
        "messages.0.content",
    ),
    (b'{"messages": "hi"}', "messages: Input should be a valid list", "messages"),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
        "max_completion_tokens must be at least 1, got 0",
        "max_completion_tokens",
    ),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": true}',
        "top_logprobs must be between 0 and 20, got 50",
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(
    ("raw", "message", "param"), BAD_CHAT, ids=[b[0].decode() for b in BAD_CHAT]
)
def test_bad_chat_bodies(server: Server, raw: bytes, message: str, param: str) -> None:
    assert server.post("/v1/chat/completions", raw) == (400, bad_request(message, param))


def test_unknown_model_is_404(server: Server) -> None:
    status, body = server.post("/v1/completions", b'{"model": "nope", "prompt": "hi"}')
    assert status == 404
    assert body == {
        "error": {
            "message": "the model 'nope' does not exist",
            "type": "not_found_error",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/cluster/status"),
    ],
)
@pytest.mark.parametrize("key", [None, "wrong", KEY[:-1]])
def test_api_key_guards_every_v1_route(server: Server, method: str, path: str, key) -> None:
    body = b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}'
    status, resp = server.request(
        method,
        path,
        body if method == "POST" else None,
        {"Content-Type": "application/json", **_auth(key)},
    )
    message = "invalid or missing API key (send 'Authorization: Bearer KEY')"
    error = {"message": message, "type": "authentication_error", "param": None, "code": 401}
    assert (status, resp) == (401, {"error": error})


def test_cluster_status_of_a_single_engine(server: Server) -> None:
    """`pdserve cluster status`'s source without --ray: one local node, one engine."""
    status, body = server.get("/cluster/status", key=KEY)
    assert status == 200, body
    assert body["launcher"] == "local"
    (node,) = body["nodes"]
    assert node == {
        "node": "local",
        "address": "127.0.0.1",
        "alive": True,
        "cpus": len(os.sched_getaffinity(0)),
        "gpus": 0,
        "instances": ["engine"],
    }
    (engine,) = body["instances"]
    assert {k: engine[k] for k in ("name", "role", "node", "alive", "dead_reason")} == {
        "name": "engine",
        "role": "colocated",
        "node": "local",
        "alive": True,
        "dead_reason": None,
    }
    assert engine["pid"] > 0 and engine["pid"] != os.getpid()


def test_open_routes_without_a_key(server: Server) -> None:
    assert server.get("/health") == (200, {"status": "ok"})
    status, body = server.get("/version")
    assert status == 200 and body["version"]
    assert server.get("/v1/models", key=KEY)[0] == 200


def weights_card(
    s: Server, key: str | None = None
) -> tuple[tuple[str, list[str], list[str], str], str]:
    """(quantization, weight_formats, activations, kv_cache_dtype) of the model card, and
    the /metrics text."""
    status, body = s.get("/v1/models", key=key)
    assert status == 200
    (card,) = body["data"]
    metrics = httpx.get(s.url + "/metrics", timeout=30).text
    held = card["quantization"], card["weight_formats"], card["activations"], card["kv_cache_dtype"]
    return held, metrics


@pytest.mark.kernels
def test_the_model_card_and_metrics_say_how_the_weights_are_held(server: Server) -> None:
    """The default load (--quantization auto) of the shipped Q4_1 GGUF: its blocks as they
    are, Q4_1 projections and the Q8_0 tied embedding / LM head, read by the kernels
    with fp32 activations (the shared server's `--activations fp32`; the default's int8:
    test_quant_model), over an fp16 KV cache (auto's, under quantized weights)."""
    card, metrics = weights_card(server, KEY)
    assert card == ("gguf", ["Q4_1", "Q8_0"], ["fp32"], "float16")
    assert (
        'pdserve_model_weights_info{activations="fp32",formats="Q4_1,Q8_0",'
        'kv_cache_dtype="float16",quantization="gguf"} 1.0' in metrics
    )


def engine_process(s: Server) -> psutil.Process:
    # The engine core, forked from the server's fork server (cluster/forkserver.py): a
    # child of the server beside multiprocessing's resource tracker.
    children = psutil.Process(s.proc.pid).children()
    (fork_server,) = [p for p in children if "forkserver" in " ".join(p.cmdline())]
    (engine,) = fork_server.children()
    return engine


def test_server_exits_nonzero_when_the_engine_dies() -> None:
    """(Started with --quantization auto and the kernels turned off, so auto's fallback is
    checked here too: fp32 weights dequantized from the GGUF, and the card says so.)"""
    s = Server("--max-model-len", "512", "--quantization", "auto", env={"PDSERVE_NO_KERNELS": "1"})
    try:
        card, metrics = weights_card(s)
        assert card == ("none", ["float32"], ["float32"], "float32")
        assert (
            'pdserve_model_weights_info{activations="float32",formats="float32",'
            'kv_cache_dtype="float32",quantization="none"} 1.0' in metrics
        )
        engine_process(s).kill()
        assert s.proc.wait(10) == 1
        err = s.stderr()
        assert "the engine process died" in err
        assert (
            "pdserve: weights: float32 (--quantization auto: PDSERVE_NO_KERNELS is set); "
            "KV cache: float32" in err
        )
    finally:
        s.stop()


def test_the_servers_openmp_threads_sleep_soon_when_they_wait(server: Server) -> None:
    """libgomp's own report (OMP_DISPLAY_ENV) from every process of the server that loads
    it: the fork server the instances are forked from (their libgomp is its), once - the
    front end loads no torch and so no libgomp (test_imports). A thread spinning at a
    barrier holds a core another process needs, so none spins longer than ~1 ms
    (runtime.quiet_openmp_waits, docs/engine.md)."""
    found = re.findall(
        r"^\s*(OMP_WAIT_POLICY|GOMP_SPINCOUNT) = '(\w+)'", server.stderr(False), re.M
    )
    assert sorted(found) == [("GOMP_SPINCOUNT", "10000"), ("OMP_WAIT_POLICY", "PASSIVE")]


def sse(url: str, body: dict, key: str | None = None) -> Iterator[dict | str]:
    """A streamed response's events as they arrive: dicts, then the final '[DONE]'."""
    with httpx.stream("POST", url, json=body, headers=_auth(key), timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                yield data if data == "[DONE]" else json.loads(data)


def test_killed_engine_mid_stream_ends_the_stream_with_an_error_event() -> None:
    s = Server("--max-model-len", "512", "--keep-running-on-engine-failure")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = sse(s.url + "/v1/completions", body)
        assert next(events)["choices"][0]["text"]  # streaming has started
        os.kill(engine_process(s).pid, signal.SIGKILL)
        rest = list(events)  # it ends (else the client's timeout fails the test)
        assert rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "internal_server_error",
            500,
            None,
        )
        assert error["message"].startswith("the engine is not available: the engine process")
        assert all("error" not in e for e in rest[:-2])  # ordinary chunks before it
        status, body = s.get("/health")
        assert status == 500 and body["error"]["type"] == "internal_server_error"
        status, body = s.post("/v1/completions", b'{"prompt": "hi"}', key=None)
        assert status == 500 and body["error"]["message"].startswith("the engine is not available")
    finally:
        s.stop()


@pytest.mark.kernels
def test_64_concurrent_streams_and_16_disconnects_leave_the_pool_clean() -> None:
    import asyncio

    from openai import AsyncOpenAI

    # Served quantized (the shipped file's own Q4_1 / Q8_0 blocks) with int8 activations:
    # the int8 kernels' batch invariance (each row rounded alone) is what makes the 64
    # batched streams equal the 8 requests sent alone.
    s = Server(
        "--api-key", KEY, "--enable-debug-endpoints", "--quantization", "gguf",
        "--activations", "int8",
    )  # fmt: skip
    topics = ["rain", "chess", "bread", "stars", "rivers", "glass", "maps", "salt"]

    def messages(i: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"One fact about {topics[i % 8]}."}]

    async def scenario() -> None:
        client = AsyncOpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        kw = {"model": MODEL, "max_tokens": 10, "temperature": 0}
        refs = [
            (await client.chat.completions.create(messages=messages(i), **kw))
            .choices[0]
            .message.content
            for i in range(8)
        ]

        async def stream(i: int) -> str:
            chunks = await client.chat.completions.create(messages=messages(i), stream=True, **kw)
            return "".join([c.choices[0].delta.content or "" async for c in chunks])

        texts = await asyncio.gather(*(stream(i) for i in range(64)))
        assert texts == [refs[i % 8] for i in range(64)]

        async def leave_stream(i: int) -> None:
            long = {**kw, "max_tokens": 4000, "extra_body": {"ignore_eos": True}}
            chunks = await client.chat.completions.create(messages=messages(i), stream=True, **long)
            n = 0
            async for _ in chunks:
                n += 1
                if n == 3:
                    break
            await chunks.close()

        async def leave_plain(i: int) -> None:
            """A non-streaming request whose client hangs up after 0.5 s (raw socket)."""
            body = json.dumps(
                {"model": MODEL, "prompt": topics[i % 8], "max_tokens": 4000, "ignore_eos": True}
            ).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            _, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(head + body)
            await writer.drain()
            await asyncio.sleep(0.5)
            writer.close()
            await writer.wait_closed()

        await asyncio.gather(
            *(leave_stream(i) for i in range(8)), *(leave_plain(i) for i in range(8))
        )
        await client.close()

    try:
        card, metrics = weights_card(s, KEY)
        assert card == ("gguf", ["Q4_1", "Q8_0"], ["int8"], "float16")
        assert (
            'pdserve_model_weights_info{activations="int8",formats="Q4_1,Q8_0",'
            'kv_cache_dtype="float16",quantization="gguf"} 1.0' in metrics
        )
        asyncio.run(scenario())
        deadline = time.monotonic() + 10  # far less than 4000 tokens would take
        while True:
            status, stats = s.get("/debug/engine", key=KEY)
            assert status == 200
            if stats["num_running"] + stats["num_waiting"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (stats["num_running"], stats["num_waiting"], stats["num_swapped"]) == (0, 0, 0)
        assert stats["num_used_blocks"] == 0 and stats["integrity_error"] is None
    finally:
        s.stop()


def test_logprobs_and_timings(client: OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens) == r.choices[0].text == " Paris.\n"
    assert len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset == [0, 6, 7]
    for tok, top, best in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert max(top, key=top.get) == tok and top[tok] == best  # greedy = top-1
    timings = r.model_extra["pdserve_timings"]
    assert set(timings) == {"queue", "prefill", "decode", "ttft", "e2e"} | {
        "predicted_output_low",  # the shipped length head (docs/scheduling.md)
        "predicted_output_high",
    }
    assert 0 <= timings["ttft"] <= timings["e2e"]

    c = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=32, temperature=0, logprobs=True, top_logprobs=3
    )
    content = c.choices[0].logprobs.content
    assert "".join(e.token for e in content) == "The capital of France is Paris.<|im_end|>"
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)
    assert all(bytes(e.bytes).decode() == e.token for e in content)


def test_n_choices_streamed_and_whole(client: OpenAI) -> None:
    kw = {
        "model": MODEL,
        "prompt": "My favourite animal is",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 11,
        "n": 3,
    }
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) == 3  # seeds 11, 12, 13
    assert whole.usage.completion_tokens == 36 and whole.usage.prompt_tokens == 4
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == texts
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    chat = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=32, temperature=0, n=2
    )
    assert [c.message.content for c in chat.choices] == ["The capital of France is Paris."] * 2


def test_prometheus_metrics_are_open_and_count_requests(server: Server, client: OpenAI) -> None:
    # The same 40-word prompt twice: the second reuses the first's cached blocks.
    prompt = " ".join(["prometheus"] * 40)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['pdserve_requests_total{outcome="length"}'] >= 1
    assert samples["pdserve_generation_tokens_total"] >= 4
    assert samples["pdserve_time_to_first_token_seconds_count"] >= 1
    assert samples["pdserve_num_requests_running"] == 0
    assert samples["pdserve_kv_cache_usage_ratio"] == 0
    assert 0 < samples["pdserve_prefix_cache_hit_rate"] < 1
    # each request: a prefill step and 3 decode steps, some perhaps in a decode burst
    steps, in_bursts = (
        samples["pdserve_engine_steps_total"],
        samples["pdserve_decode_burst_steps_total"],
    )
    assert steps >= 8 and 0 <= in_bursts <= steps - 2


def test_batched_prompts_with_n_choices_in_prompt_major_order(client: OpenAI) -> None:
    prompts = ["The capital of France is", "Once upon a time"]
    single = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [one.choices[0].text for one in single for _ in range(2)]
    assert [c.text for c in r.choices] == want
    prompt_tokens = sum(one.usage.prompt_tokens for one in single)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 24)
    ids = [[504, 3575, 282, 4649, 314], [504, 3575, 282, 4649, 314]]  # token-id batch
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert [c.text for c in r.choices] == [" Paris."] * 2 and r.usage.prompt_tokens == 10
    streamed = ["", ""]
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [one.choices[0].text for one in single]


def test_echo_returns_the_prompt_before_the_completion(client: OpenAI) -> None:
    kw = {"model": MODEL, "max_tokens": 2, "temperature": 0, "echo": True}
    r = client.completions.create(prompt="The capital of France is", **kw)
    assert r.choices[0].text == "The capital of France is Paris."
    r = client.completions.create(prompt=[1, 504, 3575, 282, 4649, 314], **kw)
    assert r.choices[0].text == "<|im_start|>The capital of France is Paris."
    chunks = list(client.completions.create(prompt="The capital of France is", stream=True, **kw))
    assert chunks[0].choices[0].text == "The capital of France is"
    assert "".join(c.choices[0].text for c in chunks) == "The capital of France is Paris."


MORE_BAD = [
    (b'{"prompt": ["hi", ""]}', 400, "prompt 1 of the batch is empty", "prompt"),
    (b'{"prompt": [[1, 2], []]}', 400, "prompt 1 of the batch is empty", "prompt"),
    (
        json.dumps({"prompt": ["hi"] * 257}).encode(),
        400,
        "a request may hold at most 256 prompts, got 257",
        "prompt",
    ),
    (
        b'{"prompt": "hi", "echo": true, "logprobs": 1}',
        400,
        "echo with logprobs is not supported (no prompt logprobs)",
        "echo",
    ),
    (b'{"prompt": "hi", "echo": 1}', 400, "echo: Input should be a valid boolean", "echo"),
    (b'{"prompt": ["hi", 3]}', 400, PROMPT_TYPES, "prompt"),
]


@pytest.mark.parametrize(
    ("raw", "status", "message", "param"), MORE_BAD, ids=[b[0][:40].decode() for b in MORE_BAD]
)
def test_more_bad_completion_bodies(
    server: Server, raw: bytes, status: int, message: str, param: str | None
) -> None:
    assert server.post("/v1/completions", raw) == (status, bad_request(message, param))


def test_unknown_routes_and_methods_use_the_error_shape(server: Server) -> None:
    status, body = server.get("/v1/nothing", key=KEY)
    assert (status, body["error"]["type"], body["error"]["code"]) == (404, "not_found_error", 404)
    status, body = server.request("GET", "/v1/completions", headers=_auth(KEY))
    assert (status, body["error"]["message"], body["error"]["code"]) == (
        405,
        "Method Not Allowed",
        405,
    )


def test_oversized_bodies_are_413_whether_declared_or_streamed(server: Server) -> None:
    limit = 4 * 1024 * 1024
    big = json.dumps({"prompt": "x" * limit}).encode()
    status, body = server.post("/v1/completions", big)
    assert status == 413
    assert body["error"] == {
        "message": f"request body is larger than the limit of {limit} bytes "
        f"(Content-Length: {len(big)})",
        "type": "invalid_request_error",
        "param": None,
        "code": 413,
    }

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=_auth(KEY), timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["message"] == f"request body is larger than the limit of {limit} bytes"
    assert server.get("/health")[0] == 200  # and the server is fine


def test_full_waiting_queue_answers_503_and_keeps_the_rest() -> None:
    """A full queue refuses the next request with a 503; a queued request whose client
    leaves is dropped from the queue at once (not when it would have had its first
    token); the one left runs in full once the running one leaves."""
    s = Server("--max-num-seqs", "1", "--max-queued-requests", "2", "--enable-debug-endpoints")
    url = s.url + "/v1/completions"
    long = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    short = json.dumps({"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True})

    def waiting() -> int:
        return int(s.get("/debug/engine")[1]["num_waiting"])

    try:
        running = sse(url, long)
        assert next(running)["choices"][0]["text"]  # it holds the only sequence slot
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(s.post, "/v1/completions", short.encode(), None)
            leaving = post_and_leave(s, short.encode())
            wait_for(lambda: waiting() == 2, 30)
            status, body = s.post("/v1/completions", b'{"prompt": "hi"}', key=None)
            assert status == 503
            assert body["error"] == {
                "message": "the server is overloaded: its queue of 2 waiting requests is full; "
                "retry later",
                "type": "service_unavailable_error",
                "param": None,
                "code": 503,
            }
            leaving.close()
            wait_for(lambda: waiting() == 1, 30)
            assert s.get("/debug/engine")[1]["num_running"] == 1  # still the long one
            running.close()  # the running request leaves: the queued one runs, in full
            status, body = queued.result(60)
            assert status == 200 and body["usage"]["completion_tokens"] == 4
        stats = s.get("/debug/engine")[1]
        assert (stats["num_running"], stats["num_waiting"], stats["num_used_blocks"]) == (0, 0, 0)
        assert stats["integrity_error"] is None
    finally:
        s.stop()


def test_a_second_signal_cancels_what_is_in_flight_and_exits_without_a_traceback() -> None:
    """Ctrl-C twice: the first drains; the second cancels the requests still in flight,
    each answered with why, and the server exits 0 once its application has shut down.
    Its log has no traceback: a forced exit used to skip the lifespan shutdown, and the
    cancelled lifespan task printed one."""
    s = Server("--shutdown-timeout", "60", "--enable-debug-endpoints")
    children = psutil.Process(s.proc.pid).children(recursive=True)
    status, _ = s.post("/v1/completions", b'{"prompt": "hi", "max_tokens": 4}', key=None)
    assert status == 200  # a request served before (the traceback needed one)
    long = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    stream = sse(s.url + "/v1/completions", long)
    assert next(stream)["choices"]
    wait_for(lambda: s.get("/debug/engine")[1]["num_running"] == 1)
    s.proc.send_signal(signal.SIGINT)
    wait_for(lambda: s.get("/health")[0] == 503)
    s.proc.send_signal(signal.SIGINT)
    cut = list(stream)
    assert cut[-1] == "[DONE]" and cut[-2]["error"]["code"] == 503
    assert cut[-2]["error"]["message"] == "the server is shutting down: stopped by a second signal"
    assert s.proc.wait(30) == 0
    err = s.stderr()
    assert "Traceback" not in err and "cancelled 1 requests" in err, err[-2000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []


def test_a_killed_server_leaves_no_process_and_no_segment_behind() -> None:
    """SIGKILL of the front end (nothing of its own shutdown runs): its instances, forked
    from the fork server (their parent, which lives while they do), see the front end
    gone and exit, freeing their KV segments; then the fork server and the resource
    tracker end."""
    before = pdkv_segments()
    s = Server("--prefill", "1", "--decode", "1")
    children = psutil.Process(s.proc.pid).children(recursive=True)
    names = sorted(c.name() for c in children)
    assert len(children) == 4, names  # the resource tracker, the fork server, 2 instances
    s.proc.kill()
    s.proc.wait(10)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
    assert not segments_left(before)


def test_sigterm_drains_in_flight_requests_then_exits_with_no_child_left() -> None:
    """Three requests inside the engine when SIGTERM comes: the one that can finish within
    the shutdown timeout does, to its last token; the two that cannot end with a 503
    naming the timeout; new requests and /health get 503 meanwhile; the server exits 0,
    leaving no child. The engine is stopped (SIGSTOP) from the moment all three are
    inside until the server has turned to draining, so the short one is mid-stream when
    the drain starts however busy the machine; then it has the 15 s for its <= 100
    tokens (~1 s alone), and the long ones cannot make 8,000 in them."""
    s = Server("--shutdown-timeout", "15", "--instance-timeout", "600", "--enable-debug-endpoints")
    try:
        url = s.url + "/v1/completions"
        long = {
            "prompt": "Once upon a time",
            "max_tokens": 8000,
            "ignore_eos": True,
            "stream": True,
        }
        short = {**long, "max_tokens": 100, "stream_options": {"include_usage": True}}
        children = psutil.Process(s.proc.pid).children(recursive=True)
        assert children  # the engine core (and multiprocessing's resource tracker)
        engine = engine_process(s)
        with ThreadPoolExecutor(3) as pool:
            finishing, cancelled = sse(url, short), sse(url, long)
            assert next(finishing)["choices"] and next(cancelled)["choices"]
            plain = pool.submit(
                s.post, "/v1/completions", json.dumps(long | {"stream": False}).encode(), None
            )
            wait_for(lambda: s.get("/debug/engine")[1]["num_running"] == 3)  # all three inside
            engine.suspend()
            try:
                s.proc.send_signal(signal.SIGTERM)
                wait_for(lambda: s.get("/health")[0] == 503)
                status, body = s.post("/v1/completions", b'{"prompt": "hi"}', key=None)
                assert status == 503
                assert (
                    body["error"]["message"]
                    == "the server is shutting down; no new requests are accepted"
                )
                assert s.get("/health")[0] == 503
            finally:
                engine.resume()
            rest = pool.submit(list, finishing).result(60)
            assert rest[-1] == "[DONE]" and rest[-2]["usage"]["completion_tokens"] == 100
            assert rest[-3]["choices"][0]["finish_reason"] == "length"  # it ran to its end
            cut = list(cancelled)
            assert cut[-1] == "[DONE]"
            assert cut[-2]["error"]["code"] == 503
            assert cut[-2]["error"]["message"] == (
                "the server is shutting down and the request did not finish within the "
                "shutdown timeout of 15 s"
            )
            status, body = plain.result(60)
            assert status == 503 and body["error"]["message"] == cut[-2]["error"]["message"]
        assert s.proc.wait(30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        stop(s)  # a failed assertion leaves no server behind
