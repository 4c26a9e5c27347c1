"""Cluster-wide caching through real servers (docs/caching.md): MemServe's PD-Caching-3 and
the global prompt trees, as a client sees them.

`--prefill 2 --decode 2` (prefix routing, PD-Caching-3, the defaults) serves multi-turn
conversations through the `openai` client's chat API. Every answer must equal the one an
engine without any prefix cache gives (run here, in-process, on the same prompt ids),
and from the second turn on the prompt's `cached_tokens` must be exactly the full
blocks of the previous turn's prompt and answer (from the reference's token ids: the
answer's KV came back from the decode instance). A long shared document goes to the
prefill instance holding it, or is copied to the one that prefills. `--colocated 2
--routing session` keeps a session on one instance; its short TTL empties the tree.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from openai import OpenAI
from test_disagg_server import cluster, pdkv_segments, row_of, stop, wait_clean
from test_fault_tolerance import prometheus
from test_server import KEY, MODEL, Server, wait_for

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.loader import resolve_model
from pdserve.model.tokenizer import Tokenizer

BS = 16
MAX_TOKENS = 32
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
TWO_TURNS = ["What is the capital of France?", "And what river flows through it?"]
FIVE_TURNS = [
    "Name a planet in our solar system.",
    "How far is it from the Sun?",
    "What is its largest moon?",
    "Who discovered that moon?",
    "Summarize our conversation.",
]


DOCUMENT = " ".join(f"Clause {i}: the tenant keeps the garden tidy." for i in range(60))
FIRST_QUESTION = "\nQ: Who keeps the garden?"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(resolve_model(None))


def started(*args: str) -> Iterator[Server]:
    before = pdkv_segments()
    server = Server(*args, "--enable-debug-endpoints", "--kv-cache-memory-gib", "0.5")
    yield server
    stop(server)
    assert not pdkv_segments() - before, "shared-memory segments left behind"


@pytest.fixture(scope="module")
def pd_server() -> Iterator[Server]:
    # fp32 weights: the answers are compared with the in-process engine of conftest.py
    yield from started(
        "--prefill", "2", "--decode", "2", "--routing", "prefix", "--quantization", "none"
    )


def client_of(server: Server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def caching(server: Server) -> dict:
    return cluster(server)["controller"]["caching"]


def returns_done(server: Server) -> int:
    c = caching(server)
    return c["returns_fetched"] + c["returns_held"] + c["returns_failed"] + c["returns_dropped"]


@dataclass
class Turn:
    prompt_ids: list[int]
    answer: str
    finish_reason: str
    completion_tokens: int
    cached_tokens: int


def converse(server: Server, tok: Tokenizer, questions: list[str]) -> list[Turn]:
    """One conversation, turn by turn (greedy), each turn sent once the previous one's
    KV return ended."""
    client = client_of(server)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        done = returns_done(server)
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        answer = r.choices[0].message.content or ""
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        details = r.usage.prompt_tokens_details  # type: ignore[union-attr]
        assert details is not None and r.usage is not None
        assert r.usage.prompt_tokens == len(ids)
        turns.append(
            Turn(
                ids,
                answer,
                r.choices[0].finish_reason,
                r.usage.completion_tokens,
                details.cached_tokens or 0,
            )
        )
        messages.append({"role": "assistant", "content": answer})
        wait_for(lambda done=done: returns_done(server) > done, timeout=30)
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


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("questions", [TWO_TURNS, FIVE_TURNS], ids=["2-turns", "5-turns"])
def test_each_turn_hits_the_whole_history_and_answers_as_without_cache(
    pd_server: Server,
    tokenizer: Tokenizer,
    make_engine: Callable[..., Engine],
    questions: list[str],
) -> None:
    turns = converse(pd_server, tokenizer, questions)
    reference = make_engine(enable_prefix_cache=False)
    answers = [offline(reference, turn.prompt_ids) for turn in turns]
    assert [t.answer for t in turns] == [a.text for a in answers]
    assert [t.completion_tokens for t in turns] == [len(a.token_ids) for a in answers]
    for k in range(1, len(turns)):
        # what the decode instance computed of turn k-1 (the last token's KV never is)
        history = (turns[k - 1].prompt_ids + answers[k - 1].token_ids)[:-1]
        prompt = turns[k].prompt_ids
        assert common_prefix(prompt, history) == len(history)  # the template re-encodes it
        cap = (len(prompt) - 1) // BS * BS
        assert turns[k].cached_tokens == min(len(history) // BS * BS, cap), k
    c = caching(pd_server)
    assert c["returns_failed"] == c["returns_dropped"] == 0
    assert c["returned_tokens"] > 0
    wait_clean(pd_server)


def hits(server: Server, name: str) -> tuple[int, int]:
    stats = row_of(server, name)["stats"]
    return stats["prefix_cache_hits"], stats["prefix_cache_queries"]


def test_a_shared_document_goes_to_the_prefill_instance_holding_it(
    pd_server: Server, tokenizer: Tokenizer
) -> None:
    """The document lands on prefill-1 (prefill-0 is busy with a long prompt when it
    arrives). Least-load would then send the next question to prefill-0 (both idle; ties
    go to the first); prefix routing sends it to prefill-1, which serves the document
    from its cache."""
    document = DOCUMENT
    filler = " ".join(f"Line {i} of an unrelated long text." for i in range(300))
    client = client_of(pd_server)
    busy = threading.Thread(
        target=lambda: client.completions.create(model=MODEL, prompt=filler, max_tokens=2)
    )
    busy.start()
    wait_for(lambda: row_of(pd_server, "prefill-0")["assigned_prefill_tokens"] > 0, 30)
    first = client.completions.create(model=MODEL, prompt=document + FIRST_QUESTION, max_tokens=4)
    busy.join()
    assert first.usage is not None
    before0, before1 = hits(pd_server, "prefill-0"), hits(pd_server, "prefill-1")
    second = client.completions.create(
        model=MODEL, prompt=document + "\nQ: What is clause 7 about?", max_tokens=4
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    shared = common_prefix(
        tokenizer.encode(document + FIRST_QUESTION),
        tokenizer.encode(document + "\nQ: What is clause 7 about?"),
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == shared // BS * BS and cached > 500
    after1 = hits(pd_server, "prefill-1")
    assert hits(pd_server, "prefill-0") == before0  # prefill-0 saw nothing
    assert (after1[0] - before1[0], after1[1] - before1[1]) == (cached, second.usage.prompt_tokens)
    assert caching(pd_server)["cache_routed"] >= 1
    wait_clean(pd_server)


def test_a_busy_holder_lends_its_prefix_to_the_instance_that_prefills(
    pd_server: Server, tokenizer: Tokenizer
) -> None:
    """prefill-1 holds the document and is busy with a long prompt that starts with it;
    a question on the document goes to prefill-0 (its queue is shorter by more than the
    cache saves), which first copies the document's blocks from an instance holding them
    (a decode instance that ran the earlier question: ties go to the quietest) and then
    serves them from its own cache."""
    client = client_of(pd_server)
    before = caching(pd_server)
    long_prompt = DOCUMENT + " " + " ".join(f"Note {i}: nothing else." for i in range(300))
    busy = threading.Thread(
        target=lambda: client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    )
    busy.start()
    wait_for(lambda: row_of(pd_server, "prefill-1")["assigned_prefill_tokens"] > 1000, 30)
    before0 = hits(pd_server, "prefill-0")
    prompt = DOCUMENT + "\nQ: Which clause is the last one?"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    busy.join()
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    shared = common_prefix(tokenizer.encode(prompt), tokenizer.encode(DOCUMENT + FIRST_QUESTION))
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached == shared // BS * BS
    after0 = hits(pd_server, "prefill-0")
    assert (after0[0] - before0[0], after0[1] - before0[1]) == (cached, reply.usage.prompt_tokens)
    now = caching(pd_server)
    assert now["prefetches"] == before["prefetches"] + 1
    assert now["prefetched_tokens"] - before["prefetched_tokens"] == cached
    assert now["prefetches_failed"] == before["prefetches_failed"]
    wait_clean(pd_server)


def test_metrics_report_returns_routing_and_tree_sizes(pd_server: Server) -> None:
    samples = prometheus(pd_server)
    c = caching(pd_server)
    assert samples['pdserve_kv_returns_total{outcome="fetched"}'] == c["returns_fetched"] > 0
    assert samples["pdserve_kv_returned_tokens_total"] == c["returned_tokens"] > 0
    assert samples["pdserve_prefix_routed_total"] == c["cache_routed"] > 0
    assert samples["pdserve_prefix_tree_misses_total"] == c["misses"]
    entries = c["trees"]["prefill"]["entries"]
    assert samples['pdserve_prefix_tree_entries{role="prefill"}'] == entries > 0


@pytest.fixture(scope="module")
def session_server() -> Iterator[Server]:
    yield from started("--colocated", "2", "--routing", "session", "--prefix-ttl", "5")


def test_a_session_sticks_to_its_instance_and_the_ttl_empties_the_tree(
    session_server: Server,
) -> None:
    """alice's first request holds colocated-0 while bob's first arrives (so bob goes to
    colocated-1); afterwards both are idle, so least-load would send everything to
    colocated-0. Session routing keeps alice (X-Session-Id) on colocated-0 and bob (the
    `user` field) on colocated-1."""
    client = client_of(session_server)

    def ask(who: str, text: str, max_tokens: int = 4) -> int:
        extra = {"ignore_eos": True}
        if who == "alice":
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

    # 200 tokens: alice's first request still runs (and holds colocated-0's load) while
    # the controller is asked for stats and bob's first request is routed.
    first = threading.Thread(target=ask, args=("alice", "Tell me a long story.", 200))
    first.start()
    wait_for(lambda: row_of(session_server, "colocated-0")["assigned_prefill_tokens"] > 0, 30)
    queries0 = hits(session_server, "colocated-0")[1]
    bob = [ask("bob", "Hello, I am Bob.")]
    first.join()
    assert hits(session_server, "colocated-0")[1] == queries0  # bob went elsewhere
    q0, q1 = hits(session_server, "colocated-0")[1], hits(session_server, "colocated-1")[1]
    alice = [ask("alice", f"Question {i} from Alice.") for i in range(3)]
    bob += [ask("bob", f"Question {i} from Bob.") for i in range(3)]
    assert hits(session_server, "colocated-0")[1] - q0 == sum(alice)
    assert hits(session_server, "colocated-1")[1] - q1 == sum(bob[1:])
    assert caching(session_server)["sessions"] == 2
    tree = lambda: caching(session_server)["trees"]["colocated"]  # noqa: E731
    wait_for(lambda: tree()["entries"] > 0, timeout=3)
    wait_for(lambda: tree()["entries"] == 0, timeout=10)
    assert tree()["expired"] > 0
    wait_clean(session_server)
