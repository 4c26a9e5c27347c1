"""Structured outputs, tools and logit_bias (pdserve/grammar/, engine/features/
structured_output.py, docs/api.md): the sampler's constraints exact, the tool-call format
parsed the same whole and streamed, and the OpenAI surface over real servers - the
shared colocated one (`keyed_server`) and a `--prefill 1 --decode 1` cluster of this
module's - through the `openai` client: every constrained reply valid against its
schema or language, and the greedy texts of both deployments equal token for token
(the first token is sampled under the grammar on the prefill instance, the rest on the
decode instance from the state it rebuilds from that token).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import llguidance
import llguidance.numpy
import openai
import pytest
import torch
from helpers.reference import run
from helpers.server import (
    KEY,
    Server,
    cluster,
    freeze_holding,
    stop,
    wait_clean,
    wait_dead,
)
from helpers.streams import Streams
from pydantic import BaseModel, Field

from pdserve.config import PreemptionMode
from pdserve.engine.engine import Engine
from pdserve.engine.features.structured_output import StructuredOutput
from pdserve.engine.request import Request
from pdserve.engine.sampler import SamplingRow, apply_constraints, sample, unpack_bitmask
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.errors import InvalidRequestError, ModelLoadError
from pdserve.grammar import requests
from pdserve.grammar.compiler import ll_tokenizer
from pdserve.grammar.tools import CLOSE, OPEN, ToolStream, parse
from pdserve.model.base import CausalLM
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.server.grammars import GrammarConfig, Grammars
from pdserve.text.outputs import RequestOutput

# ---- the sampler's constraints --------------------------------------------------------


def _row(params: SamplingParams, allowed: torch.Tensor | None = None, seed: int = 0) -> SamplingRow:
    gen = None if params.greedy else torch.Generator().manual_seed(seed)
    return SamplingRow(params, gen, [1, 2, 3], [], (), allowed)


def test_logit_bias_bans_and_forces_exactly() -> None:
    """-100 bans a token (never drawn, even as the argmax at a high temperature), +100
    makes it the greedy choice, and a bias never leaves a row with no token its grammar
    allows (the grammar's mask alone then)."""
    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    best = int(logits.argmax())
    banned = SamplingParams(temperature=3.0, logit_bias={best: -100})
    drawn = {sample(logits, [_row(banned, seed=s)])[0].token_id for s in range(300)}
    assert best not in drawn and len(drawn) > 20
    assert sample(logits, [_row(SamplingParams(temperature=0, logit_bias={best: -100}))])[
        0
    ].token_id == int(logits[0].topk(2).indices[1])
    forced = SamplingParams(temperature=0, logit_bias={int(logits.argmin()): 100})
    assert sample(logits, [_row(forced)])[0].token_id == int(logits.argmin())
    # a grammar that allows only tokens 3 and 9: a ban on 3 leaves 9; a ban on both
    # leaves the grammar's two
    words = torch.zeros(2, dtype=torch.int32)
    words[0] = (1 << 3) | (1 << 9)
    one = SamplingParams(temperature=0, logit_bias={3: -100})
    assert sample(logits, [_row(one, words)])[0].token_id == 9
    x = logits.clone()
    apply_constraints(
        x, [_row(SamplingParams(temperature=0, logit_bias={3: -100, 9: -100}), words)]
    )
    assert torch.isfinite(x[0]).nonzero().flatten().tolist() == [3, 9]
    assert torch.equal(x[0, [3, 9]], logits[0, [3, 9]])


def test_the_grammar_mask_is_llguidance_s_own() -> None:
    """`unpack_bitmask` reads llguidance's packed layout exactly as its own numpy kernel
    applies it (a vocabulary that is not a multiple of 32 included). Not its torch one:
    llguidance.torch compiles with Inductor, at import and at first call."""
    torch.manual_seed(1)
    for vocab in (64, 1000, 49152):
        words = torch.randint(-(2**31), 2**31 - 1, (1, (vocab + 31) // 32), dtype=torch.int32)
        logits = torch.randn(1, vocab)
        theirs = logits.clone()
        llguidance.numpy.apply_token_bitmask_inplace(theirs.numpy(), words.numpy())
        ours = logits.clone()
        ours[0].masked_fill_(~unpack_bitmask(words[0], vocab), float("-inf"))
        assert torch.equal(ours, theirs), vocab


# ---- the tool-call format -----------------------------------------------------------------

NAMES = frozenset({"get_weather", "add"})
CALL_A = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL_B = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        (f"{OPEN}\n{CALL_A}\n{CLOSE}", None, [("get_weather", '{"city": "Paris"}')]),
        (
            f"Let me check.\n{OPEN}\n{CALL_A}\n{CLOSE}\n{OPEN}\n{CALL_B}\n{CLOSE}\n",
            "Let me check.",
            [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')],
        ),
        # a last block cut short (max_tokens): the complete ones stand
        (
            f"{OPEN}\n{CALL_A}\n{CLOSE}\n{OPEN}\n" + '{"name": "ad',
            None,
            [("get_weather", '{"city": "Paris"}')],
        ),
        # a block that does not parse stays text; the calls beside it stand, as streamed
        (
            f"{OPEN}\nnot json\n{CLOSE}\n{OPEN}\n{CALL_A}\n{CLOSE}",
            f"{OPEN}\nnot json\n{CLOSE}",
            [("get_weather", '{"city": "Paris"}')],
        ),
        (f"{OPEN}\n{CALL_B}\n{CLOSE}\nDone.", "Done.", [("add", '{"a": 1, "b": 2}')]),
        # a block that is not a call of a known function: the model did not call
        (f"{OPEN}\n" + '{"name": "nope", "arguments": {}}' + f"\n{CLOSE}", None, None),
        (f"{OPEN}\nnot json\n{CLOSE}", None, None),
        (f"{OPEN}\n" + '{"name": "ad', None, None),
    ],
)
def test_tool_calls_parse_the_same_whole_and_streamed(
    text: str, content: str | None, calls: list[tuple[str, str]] | None
) -> None:
    """`parse` of a whole reply, and `ToolStream` fed it in every split of two pieces and
    token-sized pieces, give the same content and calls (None: the whole text is content)."""
    got_content, got_calls = parse(text, NAMES)
    if calls is None:
        assert (got_content, got_calls) == (text, [])
        content, calls = text, []
    else:
        assert got_content == content
        assert [(c.name, c.arguments) for c in got_calls] == calls
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append([text[i : i + 3] for i in range(0, len(text), 3)])
    for pieces in splits:
        stream = ToolStream(NAMES)
        streamed_text, deltas = "", []
        for piece in pieces:
            t, d = stream.feed(piece)
            streamed_text += t
            deltas += d
        streamed_text += stream.finish()
        assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == calls
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        want = (content or "").strip() if calls else content
        assert streamed_text.strip() == (want or ""), pieces


# ---- constraints a request asks for -------------------------------------------------------


def test_two_constraints_and_malformed_fields_are_refused() -> None:
    with pytest.raises(InvalidRequestError) as e:
        requests.from_fields({"guided_regex": "a+", "guided_choice": ["a"]})
    assert (e.value.message, e.value.param) == (
        "a request takes at most one output constraint, got guided_regex, guided_choice",
        "guided_choice",
    )
    with pytest.raises(InvalidRequestError) as e:
        requests.from_fields({"guided_choice": ["yes", ""]})
    assert (e.value.message, e.value.param) == (
        "guided_choice[1] must be a non-empty string",
        "guided_choice",
    )
    with pytest.raises(InvalidRequestError) as e:
        requests.from_fields({"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert e.value.message == (
        "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
        "got structured_outputs.regex, structured_outputs.choice"
    )


def test_a_grammar_past_the_compile_limit_is_a_400(smollm2: tuple[CausalLM, Tokenizer]) -> None:
    """A schema that takes longer than the server's --grammar-timeout to compile is refused
    with the limit named; the compile runs in the pool, never on the event loop."""
    grammars = Grammars(smollm2[1], GrammarConfig(timeout_s=0.001))
    try:
        grammars.warm()
        big = {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},40}}[0-9]+"}
                for i in range(400)
            },
            "required": [f"field_{i}" for i in range(400)],
        }
        c = requests.json_schema(big, "response_format.json_schema.schema")
        with pytest.raises(InvalidRequestError) as e:
            asyncio.run(grammars.check(c.grammar, c.param))
        assert e.value.message == (
            "response_format.json_schema.schema took longer than 0.001 s to compile (the "
            "server's --grammar-timeout); send a smaller schema or grammar"
        )
    finally:
        grammars.close()


# ---- over the servers: colocated and one prefill + one decode instance --------------------


@pytest.fixture(scope="module")
def disaggregated() -> Iterator[Server]:
    """1P1D beside the shared colocated server (`keyed_server`), taking its activations
    (fp32): the tests below want the same text from both deployments."""
    server = Server("--prefill", "1", "--decode", "1", "--activations", "fp32")
    yield server
    stop(server)


@pytest.fixture(scope="module")
def clients(keyed_server: Server, disaggregated: Server) -> dict[str, openai.OpenAI]:
    """The `openai` client of each deployment: colocated, 1P1D."""
    return {
        "colocated": openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY),
        "1P1D": openai.OpenAI(base_url=disaggregated.url + "/v1", api_key="unused"),
    }


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int


class Forecast(BaseModel):
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]
    highs: list[int] = Field(max_length=3)


class Order(BaseModel):
    item: str = Field(max_length=24)
    quantity: int
    express: bool


SCHEMA_CASES = [
    (Person, "Invent a person and describe them as JSON."),
    (Forecast, "Give a three-day weather forecast for Rome as JSON."),
    (Order, "I want two pizzas delivered fast. Write the order as JSON."),
]


def _ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_json_schema_replies_validate_and_agree_across_deployments(
    clients: dict[str, openai.OpenAI],
) -> None:
    """`chat.completions.parse` with a pydantic model (the client sends its strict JSON
    schema): every greedy reply stops by itself, parses into the model and validates
    against the schema, and both deployments give the same text."""
    texts: dict[str, list[str]] = {}
    for name, client in clients.items():
        texts[name] = []
        for model, prompt in SCHEMA_CASES:
            reply = client.chat.completions.parse(
                model=_model(client),
                messages=_ask(prompt),
                response_format=model,
                temperature=0,
                max_tokens=120,
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "stop", (name, choice)
            assert isinstance(choice.message.parsed, model), (name, choice)
            jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
            texts[name].append(choice.message.content)
    assert texts["colocated"] == texts["1P1D"]


GRAMMAR_CASES = [
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in {"yes", "no", "maybe"}),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in {"red", "green"}),
    (
        {"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
        lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) is not None,
    ),
    (
        {"guided_regex": r"(cat|dog)s? [a-z]{2,8}"},
        lambda t: re.fullmatch(r"(cat|dog)s? [a-z]{2,8}", t),
    ),
    # GBNF (llama.cpp's, as vLLM takes it) and Lark
    (
        {"guided_grammar": 'root ::= "The answer is " [0-9]+ "."'},
        lambda t: re.fullmatch(r"The answer is [0-9]+\.", t),
    ),
    ({"structured_outputs": {"grammar": 'start: "A" | "B" "!"'}}, lambda t: t in {"A", "B!"}),
    (
        {
            "guided_json": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        },
        lambda t: isinstance(json.loads(t)["ok"], bool),
    ),
    # vLLM's JSON options: compact output (no whitespace between JSON tokens)
    (
        {
            "structured_outputs": {
                "json": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}, "why": {"enum": ["sky", "sea"]}},
                    "required": ["ok", "why"],
                    "additionalProperties": False,
                },
                "disable_any_whitespace": True,
                "disable_fallback": True,
            }
        },
        lambda t: re.fullmatch(r'\{"ok":(true|false),"why":"(sky|sea)"\}', t),
    ),
    (
        {"response_format": {"type": "json_object"}, "max_tokens": 200},
        lambda t: isinstance(json.loads(t), dict),
    ),
]


@pytest.mark.parametrize(("fields", "valid"), GRAMMAR_CASES)
def test_every_constraint_form_is_followed_alike_in_both_deployments(
    clients: dict[str, openai.OpenAI], fields: dict, valid
) -> None:
    """vLLM's fields (structured_outputs, the older guided_*) and OpenAI's JSON mode, by
    the `openai` client's extra_body: the text is in the language asked for, and the
    same in both deployments, streamed or not."""
    fields = {"max_tokens": 60, **fields}
    texts = []
    for client in clients.values():
        for stream in (False, True):
            text, finish = _chat(
                client, _ask("Answer the question: is the sky blue?"), stream, **fields
            )
            assert finish == "stop", (fields, text)
            assert valid(text), (fields, text)
            texts.append(text)
    assert len(set(texts)) == 1, texts


def test_a_constrained_reply_cut_by_max_tokens_ends_with_length(
    clients: dict[str, openai.OpenAI],
) -> None:
    for client in clients.values():
        for stream in (False, True):
            text, finish = _chat(
                client,
                _ask(SCHEMA_CASES[0][1]),
                stream,
                max_tokens=4,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": Person.model_json_schema()},
                },
            )
            assert finish == "length" and text.startswith("{"), text


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client: openai.OpenAI, messages: list[dict], stream: bool, **fields) -> tuple[str, str]:
    """(text, finish reason) of a greedy chat reply; extra fields go in the body as given."""
    max_tokens = fields.pop("max_tokens", 60)
    kwargs = {
        "model": _model(client),
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    if "response_format" in fields:
        kwargs["response_format"] = fields.pop("response_format")
    if not stream:
        r = client.chat.completions.create(**kwargs, extra_body=fields)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, extra_body=fields, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


# ---- tools ------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": ADD},
    },
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTION = _ask("What is the weather like in Paris right now?")


def _tool_reply(
    client: openai.OpenAI, messages: list[dict], stream: bool, **fields
) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish reason) of a greedy reply with TOOLS."""
    kwargs = {
        "model": _model(client),
        "messages": messages,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 100,
        **fields,
    }
    if not stream:
        r = client.chat.completions.create(**kwargs)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert all(c.id.startswith("call_") and c.type == "function" for c in m.tool_calls or [])
        return m.content, calls, r.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                name, args = calls.get(d.index, ("", ""))
                calls[d.index] = (
                    name + (d.function.name or ""),
                    args + (d.function.arguments or ""),
                )
            finish = c.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def _valid_calls(calls: list[tuple[str, str]]) -> None:
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def _tool_replies(
    jobs: list[tuple[openai.OpenAI, list[dict], bool, dict]],
) -> list[tuple[str | None, list[tuple[str, str]], str]]:
    """`_tool_reply` of each (client, messages, stream, fields), sent at once (a greedy
    reply is the same whatever it is batched with: batch-invariant kernels)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_tool_reply, c, m, stream, **f) for c, m, stream, f in jobs]
        return [f.result() for f in futures]


def test_required_and_named_tool_choices_always_call(clients: dict[str, openai.OpenAI]) -> None:
    """tool_choice "required" (one call, parallel_tool_calls false) and a named function:
    the reply is tool calls whose arguments are valid against the function's schema,
    finishing with "tool_calls", streamed as a whole reply gives them; "required" with
    parallel calls allowed gives at least one valid call."""
    one = {"tool_choice": "required", "parallel_tool_calls": False}
    named = {"tool_choice": {"type": "function", "function": {"name": "add"}}}
    cases = [(one, None), (named, "add"), ({"tool_choice": "required"}, "any")]
    jobs = [
        (name, want, (client, QUESTION, stream, fields))
        for name, client in clients.items()
        for stream in (False, True)
        for fields, want in cases
    ]
    replies = _tool_replies([job for _, _, job in jobs])
    for (name, want, _), (content, calls, finish) in zip(jobs, replies, strict=True):
        _valid_calls(calls)
        if want == "any":  # parallel calls allowed: at least one
            assert content is None and calls, (name, calls)
            continue
        assert (content, finish, len(calls)) == (None, "tool_calls", 1), (name, calls)
        assert want is None or calls[0][0] == want


def test_auto_tool_choice_and_a_multi_turn_conversation(clients: dict[str, openai.OpenAI]) -> None:
    """ "auto": whatever the model writes is content or valid calls. The conversation goes
    on with the call in the history and the tool's result as a `tool` message: the answer
    (greedy) is the same streamed or not, and in both deployments."""
    one = {"tool_choice": "required", "parallel_tool_calls": False}
    firsts = _tool_replies([(client, QUESTION, False, one) for client in clients.values()])
    sent = []
    for client, (_, calls, _) in zip(clients.values(), firsts, strict=True):
        history = [
            *QUESTION,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": calls[0][0], "arguments": calls[0][1]},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": '{"temperature": 21, "sky": "sunny"}',
            },
        ]
        sent += [(client, m, stream, {}) for m in (QUESTION, history) for stream in (False, True)]
    replies = []
    for (_, messages, _, _), reply in zip(sent, _tool_replies(sent), strict=True):
        content, calls, finish = reply
        assert (content is not None) or calls, (content, calls)
        _valid_calls(calls)
        assert finish == ("tool_calls" if calls else finish)
        replies.append((messages is not QUESTION, content, tuple(calls)))
    answers = {r for r in replies if r[0]}
    assert len(answers) == 1, answers
    first_turns = {r for r in replies if not r[0]}
    assert len(first_turns) == 1, first_turns
    ((_, answer, _),) = answers
    assert answer, "the model answered the tool's result with text"


# ---- logit_bias ---------------------------------------------------------------------------

BIAS_PROMPT = "The capital of France is"


def _greedy_ids(engine: Engine, prompt: str, max_tokens: int, **params) -> list[int]:
    """The greedy output ids of the undisturbed in-process engine."""
    rid = engine.add_request(
        engine.tokenizer.prompt_ids(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params),
        f"bias-{params}",
    )
    ids: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                ids = list(out.token_ids)
    return ids


def test_logit_bias_bans_and_forces_tokens_in_both_deployments(
    clients: dict[str, openai.OpenAI], served_engine: Engine
) -> None:
    """-100 on every token of the unbiased greedy reply: none of them is sampled (the
    in-process engine's ids), and each server's text is that engine's. +100 on one
    token: the reply is that token, every time."""
    plain = _greedy_ids(served_engine, BIAS_PROMPT, 12)
    banned = {t: -100 for t in plain}
    biased = _greedy_ids(served_engine, BIAS_PROMPT, 12, logit_bias=banned)
    assert biased and not set(biased) & set(plain), (plain, biased)
    forced = served_engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    decode = served_engine.tokenizer.decode
    for client in clients.values():
        for bias, want in (
            ({str(t): b for t, b in banned.items()}, biased),
            ({str(forced): 100}, [forced] * 12),
        ):
            r = client.completions.create(
                model=_model(client),
                prompt=BIAS_PROMPT,
                max_tokens=12,
                temperature=0,
                logit_bias=bias,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].text == decode(want)


# ---- bad input ------------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]


def _fn(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _schema(schema: dict) -> dict:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


HUGE_REGEX = "a" * 1_100_000  # its grammar is past MAX_GRAMMAR_CHARS (1 MiB)
HUGE_GRAMMAR = len(requests.regex(HUGE_REGEX, "guided_regex").grammar)

BAD = [
    (
        {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
        "structured_outputs's whitespace options apply to json and json_object, not regex",
        "structured_outputs",
    ),
    (
        {"guided_regex": HUGE_REGEX},
        f"a guided_regex may hold at most 1048576 characters, got {HUGE_GRAMMAR}",
        "guided_regex",
    ),
    (
        _schema({"type": "foo"}),
        "response_format.json_schema.schema does not compile: Invalid type: foo",
        "response_format.json_schema.schema",
    ),
    (
        _schema({"type": "object", "if": {"required": ["a"]}}),
        'response_format.json_schema.schema does not compile: Unimplemented keys: ["if"]',
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema"}},
        'response_format of type "json_schema" needs its json_schema field',
        "response_format.json_schema",
    ),
    (
        {"guided_regex": "a(b"},
        'guided_regex does not compile: at 1(8): invalid regex "a(b" (in regex): '
        "regex parse error: a(b",
        "guided_regex",
    ),
    (
        {"structured_outputs": {"grammar": "start: foo"}},
        'structured_outputs.grammar does not compile: at 1(8): unknown name: "foo"',
        "structured_outputs.grammar",
    ),
    (
        {"guided_grammar": 'root ::= "a'},
        "guided_grammar is not a valid GBNF grammar: Unexpected end of input at line 1, "
        "'root ::= \"a' ^ ''",
        "guided_grammar",
    ),
    (
        {"guided_json": "{not json"},
        "guided_json is not valid JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)",
        "guided_json",
    ),
    (
        {"guided_regex": "a+", "response_format": {"type": "json_object"}},
        "a request takes at most one output constraint, got response_format, guided_regex",
        "guided_regex",
    ),
    (
        {"tools": [_fn("f", {"type": "object", "properties": {"a": {"type": "nope"}}})]},
        "tools.0.function.parameters does not compile: Invalid type: nope",
        "tools.0.function.parameters",
    ),
    (
        {
            "tools": [_fn("f", {"type": "object"})],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice names the function 'g', which is not in tools (f)",
        "tool_choice",
    ),
    (
        {"tool_choice": "required"},
        'tool_choice "required" needs at least one tool in tools',
        "tool_choice",
    ),
    (
        {
            "tools": [_fn("f", {"type": "object"})],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice 'required' constrains the output to tool calls; it cannot be combined "
        "with response_format",
        "response_format",
    ),
    (
        {"logit_bias": {"abc": 1}},
        "logit_bias keys must be token ids (non-negative integers), got 'abc'",
        "logit_bias",
    ),
    (
        {"logit_bias": {"5": 101}},
        "logit_bias values must be between -100 and 100, got 101 for token 5",
        "logit_bias",
    ),
    (
        {"logit_bias": {"99999999": 5}},
        "logit_bias token id 99999999 is outside the vocabulary [0, 49152)",
        "logit_bias",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                }
            ]
        },
        "messages.0.content.0: content parts of type 'image_url' are not supported (this "
        "model reads text parts only)",
        "messages.0.content.0",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "txt": "a"}]}]},
        'messages.0.content.0: a text part is {"type": "text", "text": <string>}',
        "messages.0.content.0",
    ),
]


@pytest.mark.parametrize(("fields", "message", "param"), BAD)
def test_bad_constraints_tools_and_biases_are_exact_400s_and_queue_nothing(
    keyed_server: Server, fields: dict, message: str, param: str
) -> None:
    before = keyed_server.get("/debug/engine", KEY)[1]["prefix_cache_queries"]
    body = {"messages": HI, "max_tokens": 4, **fields}
    status, reply = keyed_server.post("/v1/chat/completions", json.dumps(body).encode())
    assert (status, reply) == (
        400,
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": 400,
            }
        },
    )
    assert keyed_server.get("/debug/engine", KEY)[1]["prefix_cache_queries"] == before


# ---- a decode instance killed under constrained streams -------------------------------------

KILL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def _kill_bodies() -> list[dict]:
    """16 streamed completions under one schema: 12 greedy, 4 seeded at temperature 0.8."""
    out = []
    for i in range(16):
        body: dict = {
            "prompt": f"Person {i} of the club, as a JSON record with name, age and city:\n",
            "max_tokens": 96,
            "temperature": 0,
            "stream": True,
        }
        if i % 4 == 3:
            body.update(temperature=0.8, seed=500 + i)
        out.append(body)
    return out


@pytest.mark.parametrize("recovery", ["recompute", "replicas"])
def test_a_killed_decode_instance_keeps_every_constrained_stream_exact(
    start: Callable[..., Server], served_engine: Engine, recovery: str
) -> None:
    """1P2D, 16 json_schema streams; decode-0 SIGKILLed once every stream has 8 tokens. Its
    requests move - recomputed elsewhere, or (`--kv-replication`) resumed from their
    replicas on decode-1 - and each one's grammar state is rebuilt there from the tokens it
    streamed: every stream ends by itself with the undisturbed engine's text, valid against
    the schema."""
    grammar = requests.json_schema(KILL_SCHEMA, "response_format").grammar
    bodies = _kill_bodies()
    reference = run(served_engine, [{**b, "grammar": grammar} for b in bodies])
    flags = ["--kv-replication"] if recovery == "replicas" else []
    server = start("--prefill", "1", "--decode", "2", "--instance-timeout", "30", *flags)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": KILL_SCHEMA}}
    streams = Streams(server.url, [{**b, "response_format": rf} for b in bodies])
    streams.wait_tokens(8)
    # Stopped first, at a moment it holds requests, so that what it holds cannot change
    # between the count and the kill (a stream of it finishing in between left one
    # migration fewer than counted; on a busy machine it could have finished all of them).
    victim = freeze_holding(server, "decode-0")
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_dead(server, "decode-0") == "process exited (exit code -9)"
    for i, (got, want) in enumerate(zip(streams.results(), reference, strict=True)):
        assert (got.status, got.error, got.finish_reason) == (200, None, "stop"), (i, got)
        assert got.text == want.text, (i, got.text, want.text)
        jsonschema.validate(json.loads(got.text), KILL_SCHEMA)
    after = cluster(server)["controller"]
    assert after["migrations"] == victim["assigned_requests"] > 0, (victim, after)
    assert after["failed"] == 0, after
    resumed = after["migrations"] if recovery == "replicas" else 0
    assert after["resumed_from_replica"] == resumed, after
    wait_clean(server)


# ---- the grammar state through preemption, the prefix cache, stop strings -----------------


PREAMBLE = (
    "The club keeps one record per member. A record names the member, gives their age in "
    "years and the city they live in, and nothing else."
)


def _finish(engine: Engine, jobs: list[tuple[str, SamplingParams]]) -> list[RequestOutput]:
    rids = [engine.add_request(p, params, f"g-{i}") for i, (p, params) in enumerate(jobs)]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in rids]


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_the_grammar_state_survives_preemption_and_cache_hits(
    make_engine: Callable[..., Engine], mode: PreemptionMode
) -> None:
    """Eight json_schema requests (greedy and seeded) on a pool too small for them all:
    preempted by `mode`, each resumes its grammar where it was and gives the tokens a
    roomy engine gives; the roomy engine's second run (every prompt a prefix-cache hit)
    too; a stop string cuts a constrained reply where the text reaches it. Every mask
    came from a live grammar (no matcher fell into its error state)."""
    grammar = requests.json_schema(KILL_SCHEMA, "response_format").grammar
    jobs = []
    for i in range(8):
        seeded = {"temperature": 0.8, "seed": 70 + i} if i % 2 else {"temperature": 0}
        params = SamplingParams(max_tokens=80, grammar=grammar, **seeded)
        prompt = f"{PREAMBLE} Member {i} of the team as JSON with name, age and city:\n"
        jobs.append((prompt, params))
    roomy = make_engine()
    want = _finish(roomy, jobs)
    assert all(o.finish_reason == "stop" for o in want)
    for o in want:
        jsonschema.validate(json.loads(o.text), KILL_SCHEMA)
    cached = _finish(roomy, jobs)
    assert roomy.core.kv.prefix_cache_hits > 0
    assert [o.token_ids for o in cached] == [o.token_ids for o in want]
    tight = make_engine(num_blocks=20, preemption_mode=mode)
    got = _finish(tight, jobs)
    assert tight.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = tight.core.stats()
    assert stats["grammar_masks"] == sum(len(o.token_ids) for o in got)
    assert stats["grammar_errors"] == 0
    prompt, params = jobs[0]
    cut = _finish(roomy, [(prompt, dataclasses.replace(params, stop=('"age"',)))])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == want[0].text[: want[0].text.index('"age"')]


def test_choices_of_one_request_each_follow_the_grammar_and_parts_are_text(
    clients: dict[str, openai.OpenAI],
) -> None:
    """n = 3 seeded choices under one schema: each its own grammar state, each valid, and
    the same three in both deployments; a message given as text parts reads as its text."""
    replies = []
    for client in clients.values():
        r = client.chat.completions.create(
            model=_model(client),
            messages=_ask(SCHEMA_CASES[0][1]),
            n=3,
            temperature=0.7,
            seed=11,
            max_tokens=120,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": KILL_SCHEMA},
            },
        )
        texts = [c.message.content for c in r.choices]
        for c, text in zip(r.choices, texts, strict=True):
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(text), KILL_SCHEMA)
        assert len(set(texts)) > 1, texts
        replies.append(texts)
        parts = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is the capital"},
                    {"type": "text", "text": " of France?"},
                ],
            }
        ]
        whole = _ask("What is the capital of France?")
        assert _chat(client, parts, False) == _chat(client, whole, False)
    assert replies[0] == replies[1]


# ---- a grammar that fails in the engine ---------------------------------------------------


def _sampling_seq(rid: str, params: SamplingParams, output: list[int]) -> ScheduledSeq:
    """A request about to sample its next token (its KV computed but for the last one)."""
    req = Request(rid, [1, 2, 3], params, None, list(output))
    req.num_computed_tokens = req.num_tokens - 1
    return ScheduledSeq(req, 1)


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    return unpack_bitmask(mask, vocab).nonzero().flatten().tolist()


def test_a_grammar_that_fails_in_the_engine_allows_only_eos(
    smollm2: tuple[CausalLM, Tokenizer],
) -> None:
    """A moved request whose carried tokens its grammar refuses, and any grammar when the
    tokenizer cannot be built: the row may take only the model's EOS ids (the request
    ends "stop"), each counted in `grammar_errors`; a good row beside them is masked as
    its grammar says."""
    model, tokenizer = smollm2
    vocab = model.config.vocab_size
    eos = model.config.eos_token_ids
    grammar = requests.choice(["yes", "no"], "guided_choice").grammar
    params = SamplingParams(temperature=0, grammar=grammar)

    def build() -> llguidance.LLTokenizer:
        return ll_tokenizer(tokenizer.backend, vocab)

    part = StructuredOutput(build, vocab, eos)
    try:
        bad = _sampling_seq("bad", params, tokenizer.encode("maybe", add_special_tokens=False))
        good = _sampling_seq("good", params, [])
        part.begin_step([bad, good])
        masks = part.token_masks([bad, good])
        assert _allowed(masks["bad"], vocab) == sorted(eos)
        firsts = {tokenizer.decode([t]) for t in _allowed(masks["good"], vocab)}
        assert firsts and all("yes".startswith(f) or "no".startswith(f) for f in firsts), firsts
        assert part.stats() == {"grammar_masks": 2, "grammar_errors": 1}
        part.check_integrity()
    finally:
        part.close()

    def broken() -> llguidance.LLTokenizer:
        raise ModelLoadError("no tokenizer here")

    part = StructuredOutput(broken, vocab, eos)
    try:
        seq = _sampling_seq("any", params, [])
        part.begin_step([seq])
        assert _allowed(part.token_masks([seq])["any"], vocab) == sorted(eos)
        assert part.stats()["grammar_errors"] == 1
    finally:
        part.close()
