"""Cluster-wide caching through real servers (docs/caching.md): MemServe's PD-Caching-3 and
the global prompt trees, as a client sees them.

`--prefill 2 --decode 2` (prefix routing, PD-Caching-3, the defaults) serves multi-turn
conversations through the `openai` client's chat API. Every answer must equal the one an
engine without any prefix cache gives (run here, in-process, on the same prompt ids),
and from the second turn on the prompt's `cached_tokens` must be exactly the full
blocks of the previous turn's prompt and answer (from the reference's token ids: the
answer's KV came back from the decode instance) - whether the client waits for that KV
to come back or sends the next turn the moment the answer arrives, as agents and tool
loops do (the request then waits for the copy, cluster/cache_copies.py; on a server
whose copies are all 0.5 s slow, every next turn waits). With every such copy failing
(injected transfer faults) the prefill instance computes the answer's tokens instead,
and the answers do not change. A long shared document goes to the
prefill instance holding it, or is copied to the one that prefills. `--colocated 2
--routing session` keeps a session on one instance; its short TTL empties the tree.

Every test builds the state it asserts on (its own conversation, document and session
names: no two tests share a prompt's first block), so any test passes alone or in any
order on the module's servers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from helpers.server import (
    KEY,
    MODEL,
    Server,
    cluster,
    holds,
    pdkv_segments,
    post_and_leave,
    prometheus,
    row_of,
    segments_left,
    stop,
    wait_clean,
    wait_for,
)
from openai import OpenAI
from openai.types import Completion

from pdserve.engine.engine import Engine
from pdserve.model.source import resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.outputs import RequestOutput

BS = 16
MAX_TOKENS = 32
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
# One conversation per test: no two share a first question, so none finds another's KV.
TWO_TURNS = ["What is the capital of France?", "And what river flows through it?"]
FIVE_TURNS = [
    "Name a planet in our solar system.",
    "How far is it from the Sun?",
    "What is its largest moon?",
    "Who discovered that moon?",
    "Summarize our conversation.",
]
# (Turns whose greedy answers re-encode to the tokens generated: the next prompt's chat
# template then starts with the previous prompt and answer, token for token.)
AGENT_TURNS = [
    "List three uses of a rubber band.",
    "Which of them is the most unusual?",
    "Explain how to do it step by step.",
    "Give it a short name.",
]
METRICS_TURNS = ["What colour is the sky on Mars?", "Why is that?"]
FIRST_QUESTION = "\nQ: Who keeps the garden?"


def document(who: str) -> str:
    """A long document (~700 tokens) whose first block names `who`: one per test."""
    return " ".join(f"Clause {i}: the {who} keeps the garden tidy." for i in range(60))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(resolve_model(None))


def started(*args: str) -> Iterator[Server]:
    """A server for the tests; stopped, none of its processes leaves a KV segment."""
    before = pdkv_segments()
    server = Server(*args, "--enable-debug-endpoints")
    yield server
    stop(server)
    assert not segments_left(before), "shared-memory segments left behind"


# The shipped model's defaults (Q4_1 blocks): the answers are compared with an in-process
# engine over `served_engine`'s weights without a prefix cache (`no_cache_engine`).
PD = ("--prefill", "2", "--decode", "2", "--routing", "prefix")


@pytest.fixture(scope="module")
def pd_server() -> Iterator[Server]:
    yield from started(*PD)


# One test's server each (stopped after it): injected faults that hit only the copies
# into prefix caches (returns, prefix fetches), never the hand-offs. Each such copy takes
# 0.5 s more: the next turn of a conversation always arrives while the previous answer's
# KV is on its way back ...
SLOW_COPIES = ("--kv-fault-scope", "cache", "--kv-fault-delay", "0.5")


@pytest.fixture
def slow_server() -> Iterator[Server]:
    yield from started(*PD, *SLOW_COPIES)


@pytest.fixture
def faulty_server() -> Iterator[Server]:
    """... and then fails."""
    yield from started(*PD, *SLOW_COPIES, "--kv-fault-rate", "1")


def client_of(server: Server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def caching(server: Server) -> dict:
    return cluster(server)["controller"]["caching"]


def returns_done_of(c: dict) -> int:
    """Returns that ended, by the `caching` counters `c`."""
    return c["returns_fetched"] + c["returns_held"] + c["returns_failed"] + c["returns_dropped"]


def returns_done(server: Server) -> int:
    return returns_done_of(caching(server))


@dataclass
class Turn:
    prompt_ids: list[int]
    answer: str
    finish_reason: str
    completion_tokens: int
    cached_tokens: int


def converse(server: Server, tok: Tokenizer, questions: list[str], pause: bool) -> list[Turn]:
    """One conversation, turn by turn (greedy). `pause`: each turn is sent once the
    previous one's KV return ended; else the moment its answer arrives (the prompts'
    token ids are worked out afterwards)."""
    client = client_of(server)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    replies = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        done = returns_done(server) if pause else 0
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        replies.append((list(messages), r))
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        if pause:
            wait_for(lambda done=done: returns_done(server) > done, timeout=30)
    turns = []
    for sent, r in replies:
        ids = tok.encode(tok.apply_chat_template(sent), add_special_tokens=False)
        details = r.usage.prompt_tokens_details  # type: ignore[union-attr]
        assert details is not None and r.usage is not None
        assert r.usage.prompt_tokens == len(ids)
        turns.append(
            Turn(
                ids,
                r.choices[0].message.content or "",
                r.choices[0].finish_reason,
                r.usage.completion_tokens,
                details.cached_tokens or 0,
            )
        )
    return turns


def offline(engine: Engine, prompt_ids: list[int]) -> RequestOutput:
    """The greedy answer of an in-process engine (the reference)."""
    engine.add_request(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final is not None and final.finished
    return final


@pytest.fixture(scope="module")
def no_cache_engine(served_engine: Engine) -> Engine:
    """`pdserve serve`'s engine (conftest.py's `served_engine`: its weights) without a
    prefix cache: every prompt computed whole."""
    config = served_engine.config
    cache = dataclasses.replace(config.cache, enable_prefix_cache=False, num_blocks=512)
    return Engine(
        dataclasses.replace(config, cache=cache),
        served_engine.core.model,
        served_engine.tokenizer,
    )


def reference_answers(reference: Engine, turns: list[Turn]) -> list[RequestOutput]:
    """Each turn's answer by an engine without any prefix cache (`no_cache_engine`), on
    the server's prompt ids; the server's texts and lengths must be these."""
    answers = [offline(reference, turn.prompt_ids) for turn in turns]
    assert [t.answer for t in turns] == [a.text for a in answers]
    assert [t.completion_tokens for t in turns] == [len(a.token_ids) for a in answers]
    return answers


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def cap(prompt: list[int]) -> int:
    """The most an instance serves from its cache: full blocks, the last token computed."""
    return (len(prompt) - 1) // BS * BS


def assert_history_cached(turns: list[Turn], answers: list[RequestOutput]) -> None:
    """Turn k+1 found turn k's prompt and answer, to the block: the decode instance
    computed the KV of all of it but the last token (sampled, never fed back), committed
    its full blocks and returned them to the prefill instance."""
    for k in range(1, len(turns)):
        history = (turns[k - 1].prompt_ids + answers[k - 1].token_ids)[:-1]
        prompt = turns[k].prompt_ids
        assert common_prefix(prompt, history) == len(history)  # the template re-encodes it
        assert turns[k].cached_tokens == min(len(history) // BS * BS, cap(prompt)), k


@pytest.mark.parametrize("questions", [TWO_TURNS, FIVE_TURNS], ids=["2-turns", "5-turns"])
def test_each_turn_hits_the_whole_history_and_answers_as_without_cache(
    pd_server: Server,
    tokenizer: Tokenizer,
    no_cache_engine: Engine,
    questions: list[str],
) -> None:
    before = caching(pd_server)
    turns = converse(pd_server, tokenizer, questions, pause=True)
    answers = reference_answers(no_cache_engine, turns)
    assert_history_cached(turns, answers)
    c = caching(pd_server)
    assert c["returns_failed"] == before["returns_failed"]
    assert c["returns_dropped"] == before["returns_dropped"]
    assert c["returned_tokens"] > before["returned_tokens"]
    wait_clean(pd_server)


def test_the_next_turn_sent_at_once_finds_the_previous_answer(
    pd_server: Server, tokenizer: Tokenizer, no_cache_engine: Engine
) -> None:
    """An agent's loop: each turn the moment the previous answer arrives, perhaps while
    that answer's KV is still on its way back to the prefill instance: the turn waits
    for it (or finds it there already) instead of computing it again."""
    before = caching(pd_server)
    turns = converse(pd_server, tokenizer, AGENT_TURNS, pause=False)
    answers = reference_answers(no_cache_engine, turns)
    assert_history_cached(turns, answers)
    wait_for(lambda: returns_done(pd_server) - returns_done_of(before) == len(turns), 30)
    c = caching(pd_server)
    assert c["returns_failed"] == before["returns_failed"]
    assert c["returns_dropped"] == before["returns_dropped"]
    assert c["kv_wait_timeouts"] == before["kv_wait_timeouts"]
    wait_clean(pd_server)


def test_the_next_turn_waits_for_the_previous_answer_on_its_way(
    slow_server: Server, tokenizer: Tokenizer, no_cache_engine: Engine
) -> None:
    """The same loop while every return takes 0.5 s: each next turn arrives while the
    previous answer's KV is still being copied back, waits for it, and finds all of it."""
    turns = converse(slow_server, tokenizer, AGENT_TURNS, pause=False)
    answers = reference_answers(no_cache_engine, turns)
    assert_history_cached(turns, answers)
    wait_for(lambda: returns_done(slow_server) == len(turns), 30)
    c = caching(slow_server)
    assert c["returns_fetched"] == len(turns)
    assert c["kv_waits"] == len(turns) - 1  # every next turn waited
    assert c["kv_wait_timeouts"] == 0  # for the copy, never to the bound
    assert c["fetch_overhead_samples"] == len(turns)
    assert c["fetch_overhead_s"] > 0.45  # the injected 0.5 s, beyond the bytes
    wait_clean(slow_server)


def test_failing_copies_cost_only_the_cache_never_the_answer(
    faulty_server: Server, tokenizer: Tokenizer, no_cache_engine: Engine
) -> None:
    """The same loop while every return fails after 0.5 s: each next turn waits for the
    previous answer's KV, the copy fails, and the prefill instance computes those tokens;
    it served only the previous prompt from its cache (it prefilled that), and the answers
    are those of an engine without cache or faults. Nothing stays held or pinned."""
    turns = converse(faulty_server, tokenizer, AGENT_TURNS, pause=False)
    reference_answers(no_cache_engine, turns)
    for k in range(1, len(turns)):
        previous, prompt = turns[k - 1].prompt_ids, turns[k].prompt_ids
        assert common_prefix(prompt, previous) == len(previous)
        assert turns[k].cached_tokens == min(len(previous) // BS * BS, cap(prompt)), k
    wait_for(lambda: returns_done(faulty_server) == len(turns), 30)
    c = caching(faulty_server)
    assert c["returns_failed"] == len(turns)
    assert c["kv_waits"] == len(turns) - 1  # each waited, then computed
    assert c["kv_wait_timeouts"] == 0  # the failure ended the wait, not the bound
    assert c["fetch_overhead_samples"] == 0  # failed copies measure nothing
    wait_clean(faulty_server)


def hits(server: Server, name: str) -> tuple[int, int]:
    stats = row_of(server, name)["stats"]
    return stats["prefix_cache_hits"], stats["prefix_cache_queries"]


@contextlib.contextmanager
def busy(server: Server, name: str, prompt: str, queued: int = 0) -> Iterator[None]:
    """While instance `name` prefills `prompt` (entered once more than `queued` of its
    tokens are assigned to `name`). Its client leaves at the end (the request is aborted:
    the rest of its prefill would only cost the suite time), and the context exits once
    the controller has taken the request off `name`."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    conn = post_and_leave(server, body)
    try:
        wait_for(lambda: row_of(server, name)["assigned_prefill_tokens"] > queued, 30)
        yield
    finally:
        conn.close()
    wait_for(lambda: holds(row_of(server, name)) == 0, 60)


def prefill_beside_a_busy_prefill_0(server: Server, prompt: str, tag: str) -> Completion:
    """Complete `prompt` while prefill-0 prefills a long text of its own (`tag` names it):
    the router sends `prompt` to prefill-1 (both hold none of it; prefill-0's queue is
    longer)."""
    filler = " ".join(f"Line {i} of an unrelated {tag} text." for i in range(300))
    with busy(server, "prefill-0", filler):
        before = hits(server, "prefill-1")
        reply = client_of(server).completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert hits(server, "prefill-1")[1] > before[1]  # prefill-1 prefilled it
    return reply


def test_a_shared_document_goes_to_the_prefill_instance_holding_it(
    pd_server: Server, tokenizer: Tokenizer
) -> None:
    """The document lands on prefill-1 (prefill-0 is busy with a long prompt when it
    arrives). Least-load would then send the next question to prefill-0 (both idle; ties
    go to the first); prefix routing sends it to prefill-1, which serves the document
    from its cache."""
    doc = document("tenant")
    prefill_beside_a_busy_prefill_0(pd_server, doc + FIRST_QUESTION, "tenant")
    client = client_of(pd_server)
    routed = caching(pd_server)["cache_routed"]
    before0, before1 = hits(pd_server, "prefill-0"), hits(pd_server, "prefill-1")
    second = client.completions.create(
        model=MODEL, prompt=doc + "\nQ: What is clause 7 about?", max_tokens=4
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    shared = common_prefix(
        tokenizer.encode(doc + FIRST_QUESTION),
        tokenizer.encode(doc + "\nQ: What is clause 7 about?"),
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == shared // BS * BS and cached > 500
    after1 = hits(pd_server, "prefill-1")
    assert hits(pd_server, "prefill-0") == before0  # prefill-0 saw nothing
    assert (after1[0] - before1[0], after1[1] - before1[1]) == (cached, second.usage.prompt_tokens)
    assert caching(pd_server)["cache_routed"] == routed + 1
    wait_clean(pd_server)


def test_a_busy_holder_lends_its_prefix_to_the_instance_that_prefills(
    pd_server: Server, tokenizer: Tokenizer
) -> None:
    """prefill-1 holds the document and is busy with a long prompt that starts with it;
    a question on the document goes to prefill-0 (its queue is shorter by more than the
    cache saves), which first copies the document's blocks from an instance holding them
    (a decode instance that ran the earlier question: ties go to the quietest) and then
    serves them from its own cache."""
    doc = document("gardener")
    prefill_beside_a_busy_prefill_0(pd_server, doc + FIRST_QUESTION, "gardener")
    long_prompt = doc + " " + " ".join(f"Note {i}: nothing else." for i in range(300))
    prompt = doc + "\nQ: Which clause is the last one?"
    with busy(pd_server, "prefill-1", long_prompt, queued=1000):
        before0 = hits(pd_server, "prefill-0")
        before = caching(pd_server)
        reply = client_of(pd_server).completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    shared = common_prefix(tokenizer.encode(prompt), tokenizer.encode(doc + FIRST_QUESTION))
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached == shared // BS * BS
    after0 = hits(pd_server, "prefill-0")
    assert (after0[0] - before0[0], after0[1] - before0[1]) == (cached, reply.usage.prompt_tokens)
    now = caching(pd_server)
    assert now["prefetches"] == before["prefetches"] + 1
    assert now["prefetched_tokens"] - before["prefetched_tokens"] == cached
    assert now["prefetches_failed"] == before["prefetches_failed"]
    wait_clean(pd_server)


def test_metrics_report_returns_routing_and_tree_sizes(
    pd_server: Server, tokenizer: Tokenizer
) -> None:
    """A conversation of its own first (a return, a routed turn, tree entries); then
    /metrics says what /debug/cluster says (nothing else runs meanwhile)."""
    converse(pd_server, tokenizer, METRICS_TURNS, pause=True)
    wait_clean(pd_server)

    def pairs() -> list[tuple[float, int]]:
        """(the metric, the counter) - read while a load report may still land."""
        samples, c = prometheus(pd_server), caching(pd_server)
        return [
            (samples['pdserve_kv_returns_total{outcome="fetched"}'], c["returns_fetched"]),
            (samples["pdserve_kv_returned_tokens_total"], c["returned_tokens"]),
            (samples["pdserve_prefix_routed_total"], c["cache_routed"]),
            (samples["pdserve_prefix_tree_misses_total"], c["misses"]),
            (
                samples['pdserve_prefix_tree_entries{role="prefill"}'],
                c["trees"]["prefill"]["entries"],
            ),
        ]

    wait_for(lambda: all(metric == counter for metric, counter in pairs()), 10)
    fetched, tokens, routed, _, entries = (counter for _, counter in pairs())
    assert fetched > 0 and tokens > 0 and routed > 0 and entries > 0


@pytest.fixture(scope="module")
def session_server() -> Iterator[Server]:
    # A 1 s TTL: the tree empties soon after the last request (session routing does not
    # read the tree, so the TTL changes no routing here).
    yield from started("--colocated", "2", "--routing", "session", "--prefix-ttl", "1")


def test_a_session_sticks_to_its_instance(session_server: Server) -> None:
    """alice's first request holds colocated-0 while bob's first arrives (so bob goes to
    colocated-1); afterwards both are idle, so least-load would send everything to
    colocated-0. Session routing keeps alice (X-Session-Id) on colocated-0 and bob (the
    `user` field) on colocated-1. (Session ids of this test only.)"""
    client = client_of(session_server)
    alice, bob = f"alice-{uuid.uuid4()}", f"bob-{uuid.uuid4()}"

    def ask(who: str, text: str, max_tokens: int = 4) -> int:
        extra = {"ignore_eos": True}
        if who == alice:
            r = client.completions.create(
                model=MODEL,
                prompt=text,
                max_tokens=max_tokens,
                extra_headers={"X-Session-Id": who},
                extra_body=extra,
            )
        else:
            r = client.completions.create(
                model=MODEL, prompt=text, max_tokens=max_tokens, user=who, extra_body=extra
            )
        assert r.usage is not None
        return r.usage.prompt_tokens

    sessions = caching(session_server)["sessions"]
    # 200 tokens: alice's first request still runs (and holds colocated-0's load) while
    # the controller is asked for stats and bob's first request is routed.
    first = threading.Thread(target=ask, args=(alice, "Tell me a long story.", 200))
    first.start()
    try:
        wait_for(lambda: row_of(session_server, "colocated-0")["assigned_prefill_tokens"] > 0, 30)
        queries0 = hits(session_server, "colocated-0")[1]
        bob_asked = [ask(bob, "Hello, I am Bob.")]
    finally:
        first.join()
    assert hits(session_server, "colocated-0")[1] == queries0  # bob went elsewhere
    q0, q1 = hits(session_server, "colocated-0")[1], hits(session_server, "colocated-1")[1]
    alice_asked = [ask(alice, f"Question {i} from Alice.") for i in range(3)]
    bob_asked += [ask(bob, f"Question {i} from Bob.") for i in range(3)]
    assert hits(session_server, "colocated-0")[1] - q0 == sum(alice_asked)
    assert hits(session_server, "colocated-1")[1] - q1 == sum(bob_asked[1:])
    assert caching(session_server)["sessions"] == sessions + 2
    wait_clean(session_server)


def test_the_ttl_empties_the_tree(session_server: Server, tokenizer: Tokenizer) -> None:
    """A request's blocks enter the tree (its instance's events) and leave it by the TTL:
    the tree counts at least that many entries expired, and ends empty. No wait races
    the TTL: `expired` is read before the request, and only grows."""
    tree = lambda: caching(session_server)["trees"]["colocated"]  # noqa: E731
    expired = tree()["expired"]
    prompt = f"Tell me about the {uuid.uuid4()} in a few words."
    r = client_of(session_server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None
    stored = (r.usage.prompt_tokens + r.usage.completion_tokens - 1) // BS  # committed blocks
    assert stored >= 3
    wait_for(lambda: tree()["expired"] - expired >= stored and tree()["entries"] == 0, 30)
    wait_clean(session_server)
