"""Stub instances (pdserve/engine/stub.py): `serve stub:RATE --allow-stub` runs the real
front end over instance processes that compute nothing - each request gets its prompt's
token ids again, cycling, one a tick. Checked: the exact tokens of concurrent streamed
and whole replies (against the shipped tokenizer's decoding of the ids they were told),
the spacing of a stream's tokens, an abort freeing the stream, the counters they report,
and that `serve` refuses a stub without --allow-stub, or in a cluster it cannot answer,
with the exact usage error."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from helpers.server import Server, row_of, stop, wait_for
from helpers.streams import Streams

from pdserve.model.source import resolve_model
from pdserve.model.tokenizer import Tokenizer

RATE = 100.0  # tokens/s per request


@pytest.fixture(scope="module")
def stub_server() -> Iterator[Server]:
    server = Server("stub:100", "--allow-stub", "--colocated", "2", "--enable-debug-endpoints")
    yield server
    stop(server)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(resolve_model(None))


def told(prompt: list[int], n: int) -> list[int]:
    """What a stub answers to `prompt` with max_tokens `n`: its ids again, cycling."""
    return [prompt[i % len(prompt)] for i in range(n)]


def words(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of plain words (each decodes to itself: no byte pieces, no specials)."""
    return tokenizer.encode(text, add_special_tokens=False)


def test_concurrent_streams_get_exactly_their_prompts_tokens_again(
    stub_server: Server, tokenizer: Tokenizer
) -> None:
    """12 requests at once over 2 stub instances, streamed and whole, of different
    prompts and lengths: each text is the decoding of exactly the ids it was told, with
    `max_tokens` completion tokens, finish "length"."""
    texts = ["red green blue", " one two three four", " the quick brown fox jumps"]
    prompts = [words(tokenizer, texts[i % 3] + " again" * (i // 3)) for i in range(12)]
    bodies = [
        {"prompt": p, "max_tokens": 5 + 3 * i, "stream": i % 3 != 0, "temperature": 0.7}
        for i, p in enumerate(prompts)
    ]
    outcomes = Streams(stub_server.url, bodies).results(timeout=60)
    for body, out in zip(bodies, outcomes, strict=True):
        n = body["max_tokens"]
        assert out.status == 200, out
        assert out.text == tokenizer.decode(told(body["prompt"], n)), (body, out)
        assert out.finish_reason == "length", out
        assert out.usage is not None and out.usage["completion_tokens"] == n, out


def test_a_streams_tokens_come_one_a_tick(stub_server: Server, tokenizer: Tokenizer) -> None:
    """40 tokens at 100 tokens/s, spread over 39 ticks of 10 ms: the instance's own
    times (`pdserve_timings`: first token to last) say so, whatever the client's share
    of a busy machine (when it is starved, the tokens reach it in a bunch). The ticks
    keep their schedule, never early: a late first tick may shorten the span by its
    lateness (50 ms allowed). How many events carry them depends on whether the front
    end kept up (next test)."""
    prompt = words(tokenizer, " tick tock")
    body = {"prompt": prompt, "max_tokens": 40, "stream": True}
    [out] = Streams(stub_server.url, [body]).results(timeout=30)
    assert out.text == tokenizer.decode(told(prompt, 40)), out
    assert out.timings is not None, out
    assert out.timings["decode"] >= 39 / RATE - 0.05, out.timings


def test_a_stream_that_falls_behind_gets_several_tokens_an_event(tokenizer: Tokenizer) -> None:
    """A stub ticking as fast as it can (1,000,000 tokens/s asked) outpaces what the front
    end turns into events: the outputs waiting for the stream go out as one event
    (cluster/table.py `take_queued`), the text still exactly the ids told and every
    token counted."""
    server = Server("stub:1000000", "--allow-stub")
    try:
        prompt = words(tokenizer, " fast and faster")
        body = {"prompt": prompt, "max_tokens": 3000, "stream": True}
        [out] = Streams(server.url, [body]).results(timeout=60)
        assert out.text == tokenizer.decode(told(prompt, 3000)), out
        assert out.usage is not None and out.usage["completion_tokens"] == 3000, out
        assert out.chunks < 3000, out.chunks
    finally:
        stop(server)


def test_a_disconnected_stream_is_aborted_and_leaves_nothing_running(
    stub_server: Server, tokenizer: Tokenizer
) -> None:
    """A client that leaves a long stream: the front end aborts it at its instance, and
    both instances then report nothing running; the next request is answered in full."""
    long = {"prompt": words(tokenizer, " and so on"), "max_tokens": 5000, "stream": True}
    streams = Streams(stub_server.url, [long])
    streams.wait_tokens(5, timeout=30)
    streams.disconnect()
    streams.results(timeout=30)

    def idle() -> bool:
        return all(
            row_of(stub_server, name)["stats"]["num_running"] == 0
            for name in ("colocated-0", "colocated-1")
        )

    wait_for(idle, timeout=20)
    prompt = words(tokenizer, " last words")
    reply = httpx.post(
        stub_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 7}, timeout=30
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == tokenizer.decode(told(prompt, 7))


def test_the_stub_reports_its_rate_and_ticks(stub_server: Server) -> None:
    """The model card names the stub, the weights line says what runs, and the
    instances count their ticks (one OutputBatch each) as steps."""
    status, card = stub_server.get("/v1/models")
    assert status == 200 and card["data"][0]["id"] == "stub", card
    assert "weights: none (a stub instance: no model, 100 tokens/s per request)" in (
        stub_server.stderr(wait=False)
    )
    names = ("colocated-0", "colocated-1")
    before = sum(row_of(stub_server, n)["stats"]["num_steps"] for n in names)
    reply = httpx.post(
        stub_server.url + "/v1/completions", json={"prompt": [9], "max_tokens": 3}, timeout=30
    )
    assert reply.status_code == 200, reply.text
    after = sum(row_of(stub_server, n)["stats"]["num_steps"] for n in names)
    assert after >= before + 3, (before, after)  # a tick a token: at least 3 more


SERVE = [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["stub:100"],
            "stub:100 names stub instances (a token source for benchmarking the front end, "
            "no model: docs/bench.md), never served by default; add --allow-stub",
        ),
        (
            ["stub:0", "--allow-stub"],
            "stub:0: a stub instance's rate must be a number of tokens/s per request > 0 "
            "(e.g. stub:100), got '0'",
        ),
        (
            ["stub:fast", "--allow-stub"],
            "stub:fast: a stub instance's rate must be a number of tokens/s per request > 0 "
            "(e.g. stub:100), got 'fast'",
        ),
        (["--allow-stub"], "--allow-stub serves stub instances: name the model stub:RATE"),
        (
            ["stub:100", "--allow-stub", "--prefill", "1", "--decode", "1"],
            "stub instances are colocated: use --colocated N, not --prefill/--decode",
        ),
        (
            ["stub:100", "--allow-stub", "--tensor-parallel-size", "2"],
            "a stub instance has one rank: no tensor or pipeline parallelism",
        ),
    ],
)
def test_serve_refuses_a_stub_it_was_not_told_to_serve(argv: list[str], message: str) -> None:
    done = subprocess.run([*SERVE, *argv], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr.strip()) == (2, f"pdserve: error: {message}")
