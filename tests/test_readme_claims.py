"""README claims no other test covered (issue 51), each asserted exactly through real
servers: status codes and error bodies, the controller's and instances' counters, and
texts equal to the in-process reference (`served_engine`, helpers/reference.py).

One server per set of flags, shared by the claims it serves (each fixture's docstring
says which); a fixture that kills instances does it once, at setup, so its tests see the
same state in any order. In-process claims live beside their code's tests:
`RecoveryCost.choose` in test_replication_engine.py, the quantized paths' outputs in
test_quant_model.py.

Not here: `--ray --api-key` (tests/test_ray.py owns Ray).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from helpers.reference import Expected, run
from helpers.server import (
    KEY,
    Server,
    auth,
    cluster,
    pdkv_segments,
    row_of,
    segments_left,
    stop,
    wait_clean,
    wait_dead,
    wait_for,
)
from helpers.streams import Outcome, Streams
from helpers.tiny_models import make_tiny_model

from pdserve.cluster.status import render
from pdserve.engine.engine import Engine
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling_params import SamplingParams

BS = 16  # the block size: the prefix caches hold full blocks
UNAUTHORIZED = {
    "error": {
        "message": "invalid or missing API key (send 'Authorization: Bearer KEY')",
        "type": "authentication_error",
        "param": None,
        "code": 401,
    }
}
KILLED = "process exited (exit code -9)"


@contextlib.contextmanager
def serving(*flags: str) -> Iterator[Server]:
    """A server of the flags with the debug endpoints and 0.25 GiB of KV per instance,
    stopped at the end with no shared-memory segment left behind. Silence is never death
    here (--instance-timeout 600: a loaded machine can stall an instance for seconds);
    the tests kill the instances they lose."""
    before = pdkv_segments()
    defaults = ("--enable-debug-endpoints", "--kv-cache-memory-gib", "0.25")
    server = Server(*defaults, "--instance-timeout", "600", *flags)
    try:
        yield server
    except BaseException:  # a fixture that failed on it: what the server said, with the failure
        print(server.stderr(wait=False)[-4000:])
        raise
    finally:
        stop(server)
    assert not segments_left(before), "shared-memory segments left behind"


def instance_pid(server: Server, name: str) -> int:
    """The pid of instance `name`, which the test is about to stop or kill - checked to be a
    process of this server's: the port a test server is given is free when it is chosen,
    not when the server binds it a minute later, so another test's server may be the one
    answering there (and its instances are not ours to kill)."""
    pid = int(row_of(server, name)["pid"])
    ours = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
    assert server.proc.poll() is None and pid in ours, (
        f"{name} (pid {pid}) is not a process of this server: another one answers on its port"
    )
    return pid


def completion(server: Server, body: dict, key: str | None = None) -> tuple[int, dict]:
    """POST /v1/completions (greedy unless the body says otherwise); bounded at 300 s."""
    raw = json.dumps({"temperature": 0, **body}).encode()
    headers = {"Content-Type": "application/json", **auth(key)}
    return server.request("POST", "/v1/completions", raw, headers, timeout=300)


def controller(server: Server) -> dict:
    return cluster(server)["controller"]


def stats(server: Server, name: str) -> dict:
    return row_of(server, name)["stats"]


_REFERENCE: dict[tuple[int, ...], tuple[list[int], str]] = {}


def reference_tokens(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """The greedy continuation (EOS ignored) of token ids by the in-process reference
    (`served_engine`; each prompt run once a session)."""
    key = (max_tokens, *prompt)
    if key not in _REFERENCE:
        _REFERENCE[key] = _greedy(engine, prompt, max_tokens)
    return _REFERENCE[key]


def _greedy(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return list(final.token_ids), final.text


# ---- 1. the debug endpoints behind the key ------------------------------------------------


@pytest.mark.parametrize("path", ["/debug/engine", "/debug/cluster"])
def test_debug_endpoints_need_the_api_key(keyed_server: Server, path: str) -> None:
    """README: `--api-key KEY` guards the API; the debug endpoints
    (`--enable-debug-endpoints`) are behind it too (server/admission.py): no key or a
    wrong one is the 401 body, the key gets the counters."""
    for key in (None, "wrong", KEY[:-1]):
        assert keyed_server.get(path, key=key) == (401, UNAUTHORIZED), key
    status, body = keyed_server.get(path, key=KEY)
    assert status == 200
    if path == "/debug/engine":
        assert body["integrity_error"] is None and body["num_running"] == 0
    else:
        assert [r["name"] for r in body["instances"]] == ["engine"]


# ---- 2, 5 (PD-Caching-1), 7: a keyed 1P3D front end -----------------------------------


@pytest.fixture(scope="module")
def pd_keyed() -> Iterator[Server]:
    """`--prefill 1 --decode 3 --api-key KEY`: the key on a disaggregated front end (2);
    `--pd-caching 1` (5: caching at the prefill instance only); `--routing least-load
    --decode-policy power-of-two` (7: under prefix routing, the default, the routing rule
    picks decode instances, docs/scheduling.md). One prefill instance: every request is
    prefilled there whatever the routing."""
    with serving(
        "--prefill", "1", "--decode", "3", "--api-key", KEY, "--pd-caching", "1",
        "--routing", "least-load", "--decode-policy", "power-of-two",
    ) as server:  # fmt: skip
        yield server


def test_a_keyed_disaggregated_front_end_serves_v1_only_with_the_key(
    pd_keyed: Server, served_engine: Engine
) -> None:
    """README: `pdserve serve ... --api-key KEY` - with --prefill/--decode too: every /v1
    route without the key (or with a wrong one) is the 401 body; with it, the reference's
    text."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for key in (None, "wrong"):
        assert pd_keyed.get("/v1/models", key=key) == (401, UNAUTHORIZED)
        assert completion(pd_keyed, {"prompt": "hi", "max_tokens": 4}, key) == (401, UNAUTHORIZED)
        raw = json.dumps(chat).encode()
        assert pd_keyed.post("/v1/chat/completions", raw, key=key) == (401, UNAUTHORIZED)
    prompt = "The keyed cluster answers"
    (want,) = run(served_engine, [{"prompt": prompt, "max_tokens": 12, "temperature": 0}])
    status, body = completion(pd_keyed, {"prompt": prompt, "max_tokens": 12}, KEY)
    assert status == 200, body
    assert (body["choices"][0]["text"], body["usage"]["completion_tokens"]) == (want.text, 12)
    assert {"transfer", "decode_queue"} <= set(body["pdserve_timings"])  # disaggregated
    assert pd_keyed.get("/v1/models", key=KEY)[0] == 200


def cluster_status_cli(url: str, *key: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "cluster", "status", "--url", url, *key]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_cluster_status_cli_with_and_without_the_key(pd_keyed: Server) -> None:
    """README: `pdserve cluster status` prints the nodes, instances, roles and load of a
    running server. With `--api-key KEY` it prints the server's /cluster/status as
    `render` lays it out (read while the server is idle: nothing changes between the two
    reads); without the key, or with a wrong one, exit 1 with the server's 401 body."""
    wait_clean(pd_keyed)
    proc = cluster_status_cli(pd_keyed.url, "--api-key", KEY)
    assert proc.returncode == 0, proc.stderr
    status, source = pd_keyed.get("/cluster/status", key=KEY)
    assert status == 200
    assert proc.stdout == render(source) + "\n"
    assert [(i["name"], i["role"], i["alive"]) for i in source["instances"]] == [
        ("prefill-0", "prefill", True),
        ("decode-0", "decode", True),
        ("decode-1", "decode", True),
        ("decode-2", "decode", True),
    ]
    body = json.dumps(UNAUTHORIZED)
    for key in ((), ("--api-key", "wrong")):
        proc = cluster_status_cli(pd_keyed.url, *key)
        assert (proc.returncode, proc.stdout) == (1, ""), key
        assert proc.stderr == (
            f"pdserve: error: cannot read {pd_keyed.url}/cluster/status: HTTP 401: {body}\n"
        )


def test_power_of_two_spreads_one_at_a_time_requests_over_decode_instances(
    pd_keyed: Server, served_engine: Engine
) -> None:
    """README: decode instances by "least-loaded or power-of-two decode choice". Twelve
    requests one after another, each alone in the cluster: least-loaded sends every one
    to decode-0 (ties go to the first listed); power-of-two draws two instances at random
    and takes the less loaded, so the first drawn - any of the three. Each request is
    decoded on exactly one decode instance (its prompt counted once there: the decode
    instances' prefix-cache queries grow by the prompts' lengths in all), more than one
    instance takes part (all on one: probability 3 x 3^-12), and every text is the
    reference's."""
    decodes = ["decode-0", "decode-1", "decode-2"]
    wait_clean(pd_keyed)
    before = {name: stats(pd_keyed, name)["prefix_cache_queries"] for name in decodes}
    bodies = [
        {"prompt": f"Request {i} of twelve asks for a word:", "max_tokens": 4} for i in range(12)
    ]
    expected = run(served_engine, [{**b, "temperature": 0} for b in bodies])
    for body, want in zip(bodies, expected, strict=True):
        status, reply = completion(pd_keyed, body, KEY)
        assert status == 200, reply
        assert reply["choices"][0]["text"] == want.text
    wait_clean(pd_keyed)
    grown = {name: stats(pd_keyed, name)["prefix_cache_queries"] - before[name] for name in decodes}
    assert sum(grown.values()) == sum(w.prompt_tokens for w in expected), grown
    assert sum(1 for n in grown.values() if n) >= 2, grown


# ---- 5, 6: a two-turn conversation through PD-Caching-1 and -2 ---------------------------


@dataclass
class TwoTurns:
    """A conversation as token ids - turn 2's prompt is turn 1's prompt, its answer (the
    tokens generated) and the next question - and what each turn found cached."""

    p1: list[int]
    answer: list[int]
    p2: list[int]
    cached: tuple[int, int]  # each turn's usage.prompt_tokens_details.cached_tokens

    def full_blocks(self, tokens: int) -> int:
        return tokens // BS * BS

    @property
    def cap(self) -> int:
        """The most of turn 2's prompt a prefix cache serves (its last token is computed)."""
        return self.full_blocks(len(self.p2) - 1)

    @property
    def history(self) -> int:
        """What PD-Caching-3 serves turn 2 from: the decode instance computed the KV of
        turn 1's prompt and answer but its last token, and returned the full blocks."""
        return min(self.full_blocks(len(self.p1) + len(self.answer) - 1), self.cap)


def chat_prompt(tok: Tokenizer, tag: str, question: str) -> list[int]:
    """`tag` opens the system message, so each conversation's first block is its own."""
    system = {"role": "system", "content": f"{tag}: you are a concise assistant."}
    text = tok.apply_chat_template([system, {"role": "user", "content": question}])
    return tok.encode(text, add_special_tokens=False)


def converse(
    server: Server,
    engine: Engine,
    tag: str,
    answer_tokens: int,
    key: str | None = None,
    decode_caches: bool = True,
) -> TwoTurns:
    """Turn 1 (`answer_tokens` greedy tokens, EOS ignored), then turn 2 (8 tokens) once
    turn 1 left every instance and - `decode_caches` - the controller's decode prompt tree
    holds what decode-0 cached of it (its prompt and answer but the last token: the tree
    is what the router and the prefix fetch read). Both texts equal the reference's."""
    tok = engine.tokenizer
    p1 = chat_prompt(tok, tag, "Tell me about lighthouses.")
    answer, text = reference_tokens(engine, p1, answer_tokens)
    tail = "<|im_end|>\n<|im_start|>user\nAnd who keeps them?<|im_end|>\n<|im_start|>assistant\n"
    p2 = p1 + answer + tok.encode(tail, add_special_tokens=False)
    _, text2 = reference_tokens(engine, p2, 8)
    tree = decode_tree(server)
    cached = []
    for prompt, max_tokens, want in ((p1, answer_tokens, text), (p2, 8, text2)):
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        status, reply = completion(server, body, key)
        assert status == 200, reply
        assert reply["choices"][0]["text"] == want
        usage = reply["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), max_tokens)
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        if prompt is p1:
            wait_clean(server)
            held = (len(p1) + answer_tokens - 1) // BS if decode_caches else 0
            wait_for(lambda held=held: decode_tree(server) - tree == held, timeout=30)
    return TwoTurns(p1, answer, p2, (cached[0], cached[1]))


def decode_tree(server: Server) -> int:
    """Blocks the controller's decode prompt tree says decode-0 holds."""
    trees = controller(server)["caching"]["trees"]
    return int(trees["decode"]["by_instance"].get("decode-0", 0))


COPIES = ("returns_fetched", "returns_held", "returns_dropped", "returns_failed", "prefetches")


def test_pd_caching_1_caches_at_the_prefill_instance_only(
    pd_keyed: Server, served_engine: Engine
) -> None:
    """README / docs/caching.md, `--pd-caching 1`: the prefill instance caches prompts;
    the decode instances have no prefix cache and nothing returns. So turn 2 finds
    exactly turn 1's prompt, in full blocks - not the whole history level 3 would
    return - at the prefill instance; the decode instances cache nothing."""
    wait_clean(pd_keyed)
    names = ["decode-0", "decode-1", "decode-2"]
    hits = {n: stats(pd_keyed, n)["prefix_cache_hits"] for n in ["prefill-0", *names]}
    copies = {k: controller(pd_keyed)["caching"][k] for k in COPIES}
    chat = converse(pd_keyed, served_engine, "Keyed-level-1", 24, KEY, decode_caches=False)
    assert chat.cached == (0, chat.full_blocks(len(chat.p1)))
    assert chat.cached[1] < chat.history  # what PD-Caching-3 would have served
    wait_clean(pd_keyed)
    assert stats(pd_keyed, "prefill-0")["prefix_cache_hits"] - hits["prefill-0"] == chat.cached[1]
    for name in names:
        row = stats(pd_keyed, name)
        assert (row["prefix_cache_hits"], row["num_cached_blocks"]) == (hits[name], 0), name
    assert {k: controller(pd_keyed)["caching"][k] for k in COPIES} == copies


@pytest.fixture(scope="module")
def pd_level2() -> Iterator[Server]:
    """`--prefill 1 --decode 1 --pd-caching 2 --no-prefix-fetch`: PD-Caching-2 (5), and a
    decode instance that holds more of a prompt than the prefill instance, with the
    prefix fetch turned off (6)."""
    with serving("--prefill", "1", "--decode", "1", "--pd-caching", "2", "--no-prefix-fetch") as s:
        yield s


@pytest.fixture(scope="module")
def pd_fetching() -> Iterator[Server]:
    """`pd_level2` without --no-prefix-fetch: where the fetch happens (6's control)."""
    with serving("--prefill", "1", "--decode", "1", "--pd-caching", "2") as s:
        yield s


def test_pd_caching_2_also_caches_at_the_decode_instance_and_returns_nothing(
    pd_level2: Server, served_engine: Engine
) -> None:
    """README / docs/caching.md, `--pd-caching 2`: the decode instance also caches the
    prompt KV it received and the answer it generated, and takes from its cache the
    blocks it holds; nothing returns to the prefill instance. So turn 2 finds turn 1's
    prompt at the prefill instance (the cached_tokens a client sees) and the whole
    history, to the block, at the decode instance (its own hits)."""
    server = pd_level2
    wait_clean(server)
    hits = {n: stats(server, n)["prefix_cache_hits"] for n in ("prefill-0", "decode-0")}
    blocks, tree = stats(server, "decode-0")["num_cached_blocks"], decode_tree(server)
    copies = {k: controller(server)["caching"][k] for k in COPIES}
    chat = converse(server, served_engine, "Level-two", 24)
    assert chat.cached == (0, chat.full_blocks(len(chat.p1)))
    assert chat.cached[1] < chat.history
    wait_clean(server)
    grown = {n: stats(server, n)["prefix_cache_hits"] - hits[n] for n in hits}
    assert grown == {"prefill-0": chat.cached[1], "decode-0": chat.history}
    # Both turns' full blocks of prompt and answer (turn 2 extends turn 1's).
    computed = len(chat.p2) + 8 - 1
    assert stats(server, "decode-0")["num_cached_blocks"] - blocks == computed // BS
    wait_for(lambda: decode_tree(server) - tree == computed // BS, timeout=30)
    assert {k: controller(server)["caching"][k] for k in COPIES} == copies


LONG_ANSWER = 320  # tokens: copying them beats computing them (docs/caching.md)


def long_conversation(server: Server, engine: Engine) -> tuple[TwoTurns, tuple[int, ...]]:
    """A conversation whose 320-token answer the decode instance holds and the prefill
    instance does not (PD-Caching-2: no return): ~20 blocks of turn 2's prompt; and what
    the controller counted meanwhile: prefix fetches, the tokens they moved, fetches that
    failed, waits for a copy (on one already under way, or past the bound). The same
    conversation on either server (the reference runs once)."""
    wait_clean(server)
    before = controller(server)["caching"]
    chat = converse(server, engine, "Fetch-or-not", LONG_ANSWER)
    assert chat.history - chat.full_blocks(len(chat.p1)) >= 19 * BS
    wait_clean(server)
    after = controller(server)["caching"]

    def grew(*counters: str) -> int:
        return sum(after[c] - before[c] for c in counters)

    counted = (
        grew("prefetches"),
        grew("prefetched_tokens"),
        grew("prefetches_failed"),
        grew("kv_waits", "kv_wait_timeouts"),
    )
    return chat, counted


def test_a_prefill_instance_copies_the_prefix_another_instance_holds(
    pd_fetching: Server, served_engine: Engine
) -> None:
    """README: "When another instance holds more of a prompt than the one chosen to
    prefill it, the chosen one copies that KV first if copying is cheaper than computing"
    (`--no-prefix-fetch`'s situation, without the flag): turn 2 waits for one copy of
    the ~20 blocks it lacks from the decode instance and finds the whole history."""
    chat, counted = long_conversation(pd_fetching, served_engine)
    fetched = chat.history - chat.full_blocks(len(chat.p1))
    assert (chat.cached, counted) == ((0, chat.history), (1, fetched, 0, 0))


def test_no_prefix_fetch_keeps_the_prefill_instance_from_copying(
    pd_level2: Server, served_engine: Engine
) -> None:
    """README: "`--no-prefix-fetch` turns it off". The same conversation (the decode
    instance holds ~20 blocks more of turn 2's prompt, the controller's tree says so
    before turn 2 is sent): nothing is fetched or waited for, turn 2 finds turn 1's prompt
    only, and the texts are the reference's."""
    chat, counted = long_conversation(pd_level2, served_engine)
    assert (chat.cached, counted) == ((0, chat.full_blocks(len(chat.p1))), (0, 0, 0, 0))


# ---- 8 (bound 0), 9: the only prefill instance killed with a request on it --------------


@dataclass
class Lost:
    server: Server
    outcome: tuple[int, dict]  # the request that was being prefilled


@pytest.fixture(scope="module")
def prefill_lost() -> Iterator[Lost]:
    """`--prefill 1 --decode 1 --max-migrations 0`: prefill-0 is stopped, a request is
    routed to it, and it is killed. Then the request's fate (8) and the decode instance
    serving alone (9)."""
    with serving("--prefill", "1", "--decode", "1", "--max-migrations", "0") as server:
        pid = instance_pid(server, "prefill-0")
        os.kill(pid, signal.SIGSTOP)
        killed = False
        try:
            with ThreadPoolExecutor(1) as pool:
                body = {"prompt": "A request on the prefill instance", "max_tokens": 8}
                sent = pool.submit(completion, server, body)
                wait_for(lambda: row_of(server, "prefill-0", 0.1)["assigned_prefill_tokens"] > 0)
                os.kill(pid, signal.SIGKILL)
                killed = True
                outcome = sent.result(120)
        finally:
            if not killed:
                os.kill(pid, signal.SIGKILL)
        assert wait_dead(server, "prefill-0") == KILLED
        yield Lost(server, outcome)


def test_max_migrations_0_fails_a_killed_instances_request_without_moving_it(
    prefill_lost: Lost,
) -> None:
    """README: `--max-migrations` bounds the moves of one request. At 0 the request on
    the killed instance is not moved: it ends with the 503 body naming the failure."""
    message = f"the request failed: instance prefill-0 failed: {KILLED}"
    error = {"message": message, "type": "service_unavailable_error", "param": None, "code": 503}
    assert prefill_lost.outcome == (503, {"error": error})
    c = controller(prefill_lost.server)
    assert (c["migrations"], c["retries"], c["failed"]) == (0, 0, 1)
    assert c["instance_failures"] == {"prefill": 1}


def test_with_every_prefill_instance_gone_the_decode_instance_serves_requests_whole(
    prefill_lost: Lost, served_engine: Engine
) -> None:
    """README: "With every prefill (or decode) instance gone, the other role serves
    requests whole". prefill-0 is dead: new requests - streamed and not, concurrent - are
    prefilled and decoded by decode-0 (its prompt queries grow by their prompts) with the
    reference's texts, and nothing moves or fails."""
    server = prefill_lost.server
    bodies = [
        {"prompt": f"With no prefill instance, question {i}:", "max_tokens": 16, "temperature": 0,
         "stream": i % 2 == 0}
        for i in range(4)
    ]  # fmt: skip
    expected = run(served_engine, bodies)
    wait_clean(server, every_role=False)
    queries, before = stats(server, "decode-0")["prefix_cache_queries"], controller(server)
    assert_texts(Streams(server.url, bodies).results(), expected)
    wait_clean(server, every_role=False)
    grown = stats(server, "decode-0")["prefix_cache_queries"] - queries
    assert grown == sum(w.prompt_tokens for w in expected)
    after = controller(server)
    assert (after["migrations"], after["failed"]) == (before["migrations"], before["failed"])
    assert [r["alive"] for r in cluster(server)["instances"]] == [False, True]


def assert_texts(results: list[Outcome], expected: list[Expected]) -> None:
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert (got.status, got.error) == (200, None), (i, got)
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason), (i, got)


# ---- 4 (replication under write faults), 8 (bound 1) --------------------------------------


@dataclass
class Story:
    """What happened on a replication cluster (`replicated`, `colocated_replicated`)."""

    rings: list[dict[str, str | None]]  # replicating_to: at start, after decode-0's death
    held: int  # requests on decode-0 when it was killed, every one with a replica on decode-1
    moved: dict  # controller counters after decode-0's death
    results: list[Outcome]  # the workload, ended before decode-1 was killed
    expected: list[Expected]
    replicas_after: list[dict]  # live rows once the workload ended
    long: Outcome  # moved once, then its second instance killed
    long_expected: Expected
    final: dict  # controller counters at the end


def rings(server: Server) -> dict[str, str | None]:
    return {r["name"]: r["replicating_to"] for r in cluster(server)["instances"] if r["alive"]}


LONG = {"prompt": "Write a long story about two decode instances:", "max_tokens": 160,
        "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip


def workload() -> list[dict]:
    """Six requests of 40 tokens: half streamed, two seeded."""
    out = []
    for i in range(6):
        body = {"prompt": f"Replicated request {i}, tell me", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": i % 2 == 0}  # fmt: skip
        if i in (1, 4):
            body.update(temperature=0.8, top_p=0.95, seed=700 + i)
        out.append(body)
    return out


def stop_holding_replicated(
    server: Server, source: str = "decode-0", holder: str = "decode-1", timeout: float = 300.0
) -> int:
    """SIGSTOP `source` at a moment every request it runs (none waiting) has a replica on
    `holder` (one record per request there), once the front end's replicated-through
    figures are acknowledged (they sum to the holder's own); the number of those requests.
    The workload was sent at once, so the source takes no new request meanwhile. Reading
    the rows waits 5 s on the stopped instance's stats (absent from its row then)."""
    pid = instance_pid(server, source)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = instance_rows(server)
        ran = rows[source]["stats"]
        held = ran["num_running"]
        if not held or ran["num_waiting"] or replicas(rows[holder]) != held:
            time.sleep(0.05)
            continue
        os.kill(pid, signal.SIGSTOP)
        for _ in range(3):  # acknowledgements still on their way arrive
            row = instance_rows(server)[holder]
            if (
                replicas(row) == held
                and row["replicated_tokens"] == row["stats"]["num_replicated_tokens"]
            ):
                return held
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"{source}'s requests never all had a replica on {holder}")


def instance_rows(server: Server) -> dict[str, dict]:
    return {r["name"]: r for r in cluster(server)["instances"]}


def replicas(row: dict) -> int:
    return int(row["stats"]["num_replicas"])


@pytest.fixture(scope="module")
def replicated(served_engine: Engine) -> Iterator[Story]:
    """`--prefill 1 --decode 2 --kv-replication --kv-fault-rate 0.5 --max-migrations 1`,
    prefill-0 killed before any request: the decode instances run requests whole and
    replicate to each other, and half the replication writes fail (the only transfers
    left: no hand-off). A long request goes first (to decode-0), then a workload; once
    every request on decode-0 has a replica, decode-0 is killed; the long request
    resumes on decode-1 (its first move) and, after the workload ended, decode-1 is
    killed under it."""
    with serving(
        "--prefill", "1", "--decode", "2", "--kv-replication", "--kv-fault-rate", "0.5",
        "--kv-fault-seed", "5", "--max-migrations", "1",
        "--keep-running-on-engine-failure",  # its counters are read after the last death
    ) as server:  # fmt: skip
        os.kill(instance_pid(server, "prefill-0"), signal.SIGKILL)
        assert wait_dead(server, "prefill-0") == KILLED
        first_ring = rings(server)
        bodies = workload()
        long_expected, *expected = run(served_engine, [LONG, *bodies])
        long = Streams(server.url, [LONG])
        long.wait_tokens(1)
        streams = Streams(server.url, bodies)
        streams.wait_tokens(8)
        held = stop_holding_replicated(server)
        os.kill(instance_pid(server, "decode-0"), signal.SIGKILL)
        assert wait_dead(server, "decode-0") == KILLED
        moved, second_ring = controller(server), rings(server)
        results = streams.results()
        assert long.alive() == [True], "the long request ended before its second instance died"
        replicas_after = [r for r in cluster(server)["instances"] if r["alive"]]
        os.kill(instance_pid(server, "decode-1"), signal.SIGKILL)
        assert wait_dead(server, "decode-1") == KILLED
        (long_outcome,) = long.results()
        yield Story(
            [first_ring, second_ring], held, moved, results, expected, replicas_after,
            long_outcome, long_expected, controller(server),
        )  # fmt: skip


def test_replication_under_write_faults_resumes_with_unchanged_texts_and_leaves_nothing(
    replicated: Story,
) -> None:
    """README: `--kv-replication`: each decoding instance copies its requests' KV to a
    peer; a lost request resumes there from the replica. With half the replication
    writes failing (`--kv-fault-rate 0.5`: a failed write is written again with the next
    one), the two decode instances replicate to each other; every request decode-0 held
    at its death resumed on decode-1 from a replica, the texts are the reference's, and
    once the workload ended no replica is left anywhere."""
    story = replicated
    assert story.rings == [{"decode-0": "decode-1", "decode-1": "decode-0"}, {"decode-1": None}]
    assert (story.moved["migrations"], story.moved["resumed_from_replica"]) == (story.held,) * 2
    assert story.moved["failed"] == 0
    assert_texts(story.results, story.expected)
    (row,) = story.replicas_after
    assert row["replicated_tokens"] == 0
    for field in ("num_replicas", "num_replica_blocks", "num_replicating"):
        assert row["stats"][field] == 0, (field, row)


def test_max_migrations_1_fails_a_request_whose_second_instance_dies(replicated: Story) -> None:
    """README: `--max-migrations` (default 2) bounds the moves of one request. At 1, the
    long request moved once (decode-0's death) and its second instance died: it ends
    with the error naming the move, after the reference's first tokens."""
    long = replicated.long
    message = f"the request failed (after 1 migrations): instance decode-1 failed: {KILLED}"
    error = {"message": message, "type": "service_unavailable_error", "param": None, "code": 503}
    assert (long.status, long.error, long.finish_reason) == (200, {"error": error}, None)
    assert long.chunks > 1 and replicated.long_expected.text.startswith(long.text)
    assert long.text != replicated.long_expected.text
    final = replicated.final
    assert (final["migrations"], final["failed"]) == (replicated.moved["migrations"], 1)
    assert final["instance_failures"] == {"prefill": 1, "decode": 2}


@pytest.fixture(scope="module")
def colocated_replicated(served_engine: Engine) -> Iterator[Story]:
    """`--colocated 2 --kv-replication`: the two instances replicate to each other; the
    workload runs; once every request on colocated-0 has a replica on colocated-1,
    colocated-0 is killed."""
    with serving("--colocated", "2", "--kv-replication") as server:
        first_ring = rings(server)
        bodies = [*workload(), LONG]
        *expected, long_expected = run(served_engine, bodies)
        streams = Streams(server.url, bodies)
        streams.wait_tokens(8)
        held = stop_holding_replicated(server, "colocated-0", "colocated-1")
        os.kill(instance_pid(server, "colocated-0"), signal.SIGKILL)
        assert wait_dead(server, "colocated-0") == KILLED
        moved, second_ring = controller(server), rings(server)
        results = streams.results()
        wait_clean(server)
        replicas_after = [r for r in cluster(server)["instances"] if r["alive"]]
        yield Story(
            [first_ring, second_ring], held, moved, results[:-1], expected, replicas_after,
            results[-1], long_expected, controller(server),
        )  # fmt: skip


def test_colocated_instances_resume_from_each_others_replicas(
    colocated_replicated: Story,
) -> None:
    """README: `--kv-replication` on colocated instances: each replicates its requests'
    KV to the other; every request colocated-0 ran at its death resumed on colocated-1
    from its replica, with the reference's texts, and no replica is left afterwards."""
    story = colocated_replicated
    assert story.rings == [
        {"colocated-0": "colocated-1", "colocated-1": "colocated-0"},
        {"colocated-1": None},
    ]
    assert story.held > 0
    assert (story.moved["migrations"], story.moved["resumed_from_replica"]) == (story.held,) * 2
    assert story.final["failed"] == 0
    assert_texts([*story.results, story.long], [*story.expected, story.long_expected])
    (row,) = story.replicas_after
    assert row["replicated_tokens"] == 0
    for field in ("num_replicas", "num_replica_blocks", "num_replicating"):
        assert row["stats"][field] == 0, (field, row)


# ---- 10. the third signal ---------------------------------------------------------------


def test_a_third_signal_forces_the_exit(tmp_path: Path) -> None:
    """README: Ctrl-C drains; "a second signal stops at once (the requests still in
    flight are cancelled, each with an error saying so; a third forces the exit)". The
    engine (a tiny model's) is stopped mid-stream, with a 600 s shutdown timeout, and a
    /debug/engine request waits on it: the first SIGINT starts the drain, the second
    cancels the stream, and the server then waits for the debug request's connection
    (uvicorn's 5 s grace); the third ends that wait at once - no "timeout graceful
    shutdown exceeded" - and the server exits 0 once its stopped engine is killed (at
    once: a stopped process cannot exit by itself). (Forced, uvicorn skips the
    application's shutdown and logs its cancelled lifespan task's traceback, as launch.py
    says: not asserted.)"""
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", max_position_embeddings=8192)
    server = Server(str(folder), "--shutdown-timeout", "600", "--enable-debug-endpoints")
    children = psutil.Process(server.proc.pid).children(recursive=True)
    engine = instance_pid(server, "engine")
    stream = Streams(server.url, [{"prompt": "hello", "max_tokens": 8000, "ignore_eos": True,
                                   "stream": True}])  # fmt: skip
    try:
        stream.wait_tokens(1)
        os.kill(engine, signal.SIGSTOP)
        # A request on its own connection that waits for the stopped engine; /health
        # answered after it arrived, so the server is handling it.
        with socket.create_connection(("127.0.0.1", server.port)) as stuck:
            stuck.sendall(b"GET /debug/engine HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert server.get("/health") == (200, {"status": "ok"})
            server.proc.send_signal(signal.SIGINT)
            drain = "pdserve: shutting down: 1 requests in flight, waiting up to 600 s"
            wait_for(lambda: drain in server.stderr(wait=False))
            server.proc.send_signal(signal.SIGINT)
            (outcome,) = stream.results(60)
            server.proc.send_signal(signal.SIGINT)
            assert server.proc.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []  # the stopped engine was killed by the server
    finally:
        server.stop()
        for child in psutil.wait_procs(children, timeout=1)[1]:
            child.kill()
    cancelled = "the server is shutting down: stopped by a second signal"
    assert outcome.error is not None and outcome.error["error"]["message"] == cancelled
    err = server.stderr()
    said = [line for line in err.splitlines() if line.startswith("pdserve: shutting down")]
    assert said == [
        f"{drain} (signal again to stop now)",
        "pdserve: shutting down: cancelled 1 requests",
    ]
    assert "timeout graceful shutdown exceeded" not in err, err[-2000:]
