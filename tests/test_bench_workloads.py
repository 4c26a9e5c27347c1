"""Every `pdserve bench` workload: exact prompt lengths under the shipped model's
tokenizer, the stated length distributions (seeded), session structure, traces and
ShareGPT files, and clear errors (exit code 2) for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.cli import main
from pdserve.bench.config import BenchInputError
from pdserve.bench.tokens import PromptFactory, load_tokenizer
from pdserve.bench.workloads import Workload, WorkloadOptions, build_workload
from pdserve.bench.workloads.sessions import CONTEXT_BUDGET, STYLES
from pdserve.workload.profiles import PROFILES, TETRI_CLASSES, tetri_profile


@pytest.fixture(scope="module")
def factory() -> PromptFactory:
    return PromptFactory(load_tokenizer(None))


def build(factory: PromptFactory, name: str, n: int = 300, **kw: object) -> Workload:
    return build_workload(WorkloadOptions(name=name, num_prompts=n, **kw), factory)  # type: ignore[arg-type]


def lengths(w: Workload) -> tuple[list[int], list[int]]:
    turns = [w.turn(i) for i in range(w.num_requests)]
    return [t.num_tokens for t in turns], [t.output_len for t in turns]


def assert_exact(factory: PromptFactory, w: Workload) -> None:
    """The server's tokenizer (the same GGUF) counts exactly what the workload claims."""
    for i in range(w.num_requests):
        t = w.turn(i)
        assert len(factory.tokenizer.encode(t.text)) == t.num_tokens


def test_random_fixed_lengths_and_shared_prefix(factory: PromptFactory) -> None:
    w = build(
        factory, "random", 20, random_input_len=100, random_output_len=7, random_prefix_len=30
    )
    ins, outs = lengths(w)
    assert ins == [130] * 20 and outs == [7] * 20  # prefix + input, as vLLM's random
    assert_exact(factory, w)
    prefix = w.turn(0).text[
        : len(factory.tokenizer.decode(factory.tokenizer.encode(w.turn(0).text)[:30]))
    ]
    assert all(w.turn(i).text.startswith(prefix) for i in range(20))
    assert len({w.turn(i).text for i in range(20)}) == 20


def test_random_range_ratio_is_uniform_within_bounds(factory: PromptFactory) -> None:
    w = build(
        factory, "random", 400, random_input_len=100, random_output_len=40, random_range_ratio=0.5
    )
    ins, outs = lengths(w)
    assert min(ins) >= 50 and max(ins) <= 150 and min(outs) >= 20 and max(outs) <= 60
    assert abs(np.mean(ins) - 100) < 5 and abs(np.mean(outs) - 40) < 2
    assert_exact(factory, w)


def test_same_seed_same_workload_other_seed_other(factory: PromptFactory) -> None:
    a, b = build(factory, "chatbot", 30), build(factory, "chatbot", 30)
    c = build(factory, "chatbot", 30, seed=1)
    assert a.sessions == b.sessions and a.sessions != c.sessions


@pytest.mark.parametrize("name", list(PROFILES))
def test_dataset_profiles_follow_their_distribution(factory: PromptFactory, name: str) -> None:
    w = build(factory, name, 300)
    ins, outs = lengths(w)
    prof = PROFILES[name]
    for values, dist in ((ins, prof.input), (outs, prof.output)):
        assert dist.lo <= min(values) and max(values) <= dist.hi
        # median of 300 seeded draws within 15% of the (truncated) distribution's median
        assert abs(np.median(values) / dist.median() - 1) < 0.15
    assert_exact(factory, w)


def test_sharegpt_profile_is_shaped_like_the_papers_numbers() -> None:
    """Prompts' unfiltered mean ~161 (vLLM paper), answers' median 128 (TetriInfer)."""
    p = PROFILES["chatbot"]
    assert p.input.median_param is not None
    assert abs(p.input.median_param * np.exp(p.input.sigma**2 / 2) - 161) < 5
    assert round(p.output.median()) == 128


@pytest.mark.parametrize("name", list(TETRI_CLASSES))
def test_tetriinfer_mixes_respect_the_512_and_128_thresholds(
    factory: PromptFactory, name: str
) -> None:
    w = build(factory, name, 200)
    ins, outs = lengths(w)
    heavy_prefill, heavy_decode = name[:2] == "HP", name[2:] == "HD"
    if name != "mixed":
        assert all((n > 512) == heavy_prefill for n in ins)
        assert all((n > 128) == heavy_decode for n in outs)
    else:  # ShareGPT-shaped: all four classes occur
        classes = {(i > 512, o > 128) for i, o in zip(ins, outs, strict=True)}
        assert classes == {(False, False), (False, True), (True, False), (True, True)}
    prof = tetri_profile(name)
    assert abs(np.median(ins) / prof.input.median() - 1) < 0.15
    assert_exact(factory, w)


def test_lowercase_tetri_names_are_accepted(factory: PromptFactory) -> None:
    assert build(factory, "lphd", 5).name == "LPHD"


def session_turns(w: Workload) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = {}
    for s, t in w.order:
        seen.setdefault(s, []).append(t)
    return seen


@pytest.mark.parametrize("style", list(STYLES))
def test_sessions_structure(factory: PromptFactory, style: str) -> None:
    w = build(factory, "sessions", 60, session_style=style)
    st = STYLES[style]
    assert w.num_requests == 60
    # every session's turns arrive in order, sessions interleave
    assert all(ts == list(range(len(ts))) for ts in session_turns(w).values())
    assert [s for s, _ in w.order] != sorted(s for s, _ in w.order)
    for s in w.sessions:
        if s.context:
            assert factory.count(s.context) - factory.special == st.context_tokens
        total = st.context_tokens + sum(t.num_tokens + t.output_len for t in s.turns)
        assert total <= CONTEXT_BUDGET or len(s.turns) == 1
        full = s.context + "".join(t.text for t in s.turns)  # word segments join exactly
        assert factory.count(full) == factory.special + st.context_tokens + sum(
            t.num_tokens for t in s.turns
        )
    contexts = {s.context for s in w.sessions}
    if style == "react":
        assert len(contexts) == 1  # one few-shot prefix shared by every session
    elif style == "docqa":
        assert len(contexts) == len(w.sessions)  # one document per session
        assert all(len(s.turns) == 5 for s in w.sessions[:-1])  # LooGLE: five questions


@pytest.mark.parametrize("style", ["docqa", "chat"])
def test_share_ratio_sends_each_drawn_session_k_times(factory: PromptFactory, style: str) -> None:
    """MemServe Fig. 14: K sessions per document, copies of one drawn session (same
    context, same questions), each its own session; --num-prompts still counts requests."""
    w = build(factory, "sessions", 32, session_style=style, share_ratio=2)
    one = build(factory, "sessions", 32, session_style=style)
    assert w.num_requests == 32 and w.params["share_ratio"] == 2
    assert [s.id for s in w.sessions] == list(range(len(w.sessions)))
    pairs = [w.sessions[i : i + 2] for i in range(0, len(w.sessions), 2)]
    for a, *rest in pairs:
        for b in rest:
            assert (b.context, b.turns) == (a.context, a.turns)
    if style == "docqa":  # 3 x (5 + 5) + (1 + 1): the last document cut so both copies fit
        assert [len(s.turns) for s in w.sessions] == [5] * 6 + [1, 1]
        assert len({s.context for s in w.sessions}) == 4
    # the copies arrive interleaved with the other sessions, each in turn order
    assert all(ts == list(range(len(ts))) for ts in session_turns(w).values())
    # ratio 1 is the workload as before
    assert build(factory, "sessions", 32, session_style=style, share_ratio=1).sessions == (
        one.sessions
    )


def test_session_turns_fixes_the_number_of_turns(factory: PromptFactory) -> None:
    w = build(factory, "sessions", 60, session_style="chat", session_turns=5)
    assert [len(s.turns) for s in w.sessions] == [5] * 12  # none hit the context budget here
    assert w.params["turns"] == "5"


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_jsonl_trace_prompts_lengths_arrivals_sessions(
    factory: PromptFactory, tmp_path: Path
) -> None:
    rows = [
        {
            "prompt": "Tell me a story about a cat.",
            "output_len": 5,
            "arrival_time": 2.0,
            "session_id": "s",
        },
        {"input_len": 40, "output_len": 3, "arrival_time": 0.0},
        {"prompt": "And then?", "output_len": 4, "arrival_time": 4.0, "session_id": "s"},
    ]
    path = write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = build(factory, "file", 100, dataset_path=path)
    assert w.num_requests == 3
    # sorted by arrival; the two "s" lines form one session in that order
    assert w.turn(0).num_tokens == 40 and w.turn(0).output_len == 3
    assert w.turn(1).text == "Tell me a story about a cat." and w.turn(1).output_len == 5
    assert w.order[1][0] == w.order[2][0] and [t for _, t in w.order[1:]] == [0, 1]
    assert w.turn(1).num_tokens == len(factory.tokenizer.encode(w.turn(1).text))
    assert w.trace_rate == 0.5  # 2 gaps over 4 s
    assert w.unit_offsets == (0.0, 1.0, 2.0)  # rescaled to 1 request/s


def test_sharegpt_first_turns_and_multi_turn_sessions(
    factory: PromptFactory, tmp_path: Path
) -> None:
    long_answer = " ".join(["word"] * 50)
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "What is the capital of France, please?"},
                {"from": "gpt", "value": "The capital of France is Paris, a city on the Seine."},
                {"from": "human", "value": "And what is the capital of Italy then?"},
                {"from": "gpt", "value": long_answer},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "human", "value": "hi"},  # under 4 tokens: filtered as vLLM does
                {"from": "gpt", "value": "Hello! How can I help you today?"},
            ],
        },
        {
            "id": "c",
            "conversations": [
                {"from": "gpt", "value": "I start, which is not a user prompt."},
                {"from": "human", "value": "ok then"},
            ],
        },
    ]
    path = write(tmp_path, "sg.json", json.dumps(data))
    w = build(factory, "file", 100, dataset_path=path)
    assert w.num_requests == 1 and len(w.sessions) == 1
    t = w.turn(0)
    assert t.text == "What is the capital of France, please?"
    assert t.num_tokens == factory.count(t.text)
    assert t.output_len == factory.count(data[0]["conversations"][1]["value"])  # type: ignore[index]
    multi = build(factory, "file", 100, dataset_path=path, multi_turn=True)
    assert [len(s.turns) for s in multi.sessions] == [2]
    assert multi.sessions[0].turns[1].output_len == factory.count(long_answer)
    fixed = build(factory, "file", 100, dataset_path=path, sharegpt_output_len=9)
    assert fixed.turn(0).output_len == 9


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "x"}\n', "'output_len' is required"),
        ('{"prompt": "x", "input_len": 3, "output_len": 2}\n', "exactly one of"),
        ('{"input_len": 0, "output_len": 2}\n', "'input_len' must be an integer >= 1"),
        ('{"input_len": 5, "output_len": 2}\nnot json\n', "t.jsonl:2: not JSON"),
        (
            '{"input_len": 5, "output_len": 2, "arrival_time": 1}\n'
            '{"input_len": 5, "output_len": 2}',
            "on every line or on none",
        ),
        ("[1, 2]", "conversation 0: expected an object"),
        ("", "no requests"),
    ],
)
def test_malformed_traces_are_named(
    factory: PromptFactory, tmp_path: Path, content: str, message: str
) -> None:
    path = write(tmp_path, "t.jsonl", content)
    with pytest.raises(BenchInputError, match=message):
        build(factory, "file", 10, dataset_path=path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--random-input-len", "10", "--random-range-ratio", "1.5"], "range-ratio"),
        (["--random-input-len", "1", "--random-range-ratio", "0.5"], "below 1 token"),
        (["--workload", "file"], "needs --dataset-path"),
        (["--workload", "file", "--dataset-path", "/nonexistent.jsonl"], "cannot read"),
        (["--workload", "sessions", "--session-style", "poem"], "unknown --session-style"),
        (["--workload", "sessions", "--share-ratio", "0"], "--share-ratio must be >= 1"),
        (["--workload", "sessions", "--session-turns", "0"], "--session-turns must be >= 1"),
        (["--request-rate", "-2"], "rate must be positive"),
        (["--slo", "ttft"], "expected ttft:MS"),
        (["--search-goodput", "--request-rate", "inf", "--slo", "ttft:100"], "finite"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--slo-scales", "1,2"], "give them with --slo"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    code = main(["run", "--base-url", "http://127.0.0.1:9", "--result-file", str(out), *argv])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before anything ran
