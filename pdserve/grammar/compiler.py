"""llguidance's tokenizer, grammar checks and matchers, each built once and cached.

An `LLTokenizer` (the token -> bytes table llguidance walks) costs ~0.6 s to build from
the model's fast tokenizer, so each process builds it once, on first use, off the
thread that asked (`GrammarChecker.check` in the front end's prompt pool, the engine's
mask thread). A grammar is checked once per text (`GrammarChecker`: an LRU of verdicts)
and compiled once per engine (`Matchers`: an LRU of fresh matchers, deep-copied per
request: a copy is ~10 us, a compile ~1 ms for a typical schema, up to the limits for a
huge one).

`LIMITS` bounds what one grammar may cost: llguidance counts "fuel" while it builds a
grammar's lexer and at each token, and puts a matcher that runs out in its error state
(the checker reports that as a 400; see `GrammarChecker.check`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import llguidance

from pdserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000,  # ~20 ms of lexer building per grammar (llguidance's default)
    step_lexer_fuel=200_000,  # ~15 ms a token at worst (its default)
    max_grammar_size=500_000,
)


def ll_tokenizer(
    backend: PreTrainedTokenizerBase, vocab_size: int | None
) -> llguidance.LLTokenizer:
    """llguidance's view of a fast tokenizer, its masks `vocab_size` tokens wide (the
    model's logits; a vocabulary padded past the tokenizer's has its extra ids banned;
    None: the tokenizer's own size). EOS is the tokenizer's: what ends a grammar's output."""
    import llguidance.hf  # imports transformers: only where a tokenizer is built

    return llguidance.hf.from_tokenizer(backend, n_vocab=vocab_size)  # type: ignore[arg-type]


class _LazyTokenizer:
    """An LLTokenizer built on the first `get` (one builder; others wait for it)."""

    def __init__(self, build: Callable[[], llguidance.LLTokenizer]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._value: llguidance.LLTokenizer | None = None

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._value is None:
                self._value = self._build()
            return self._value


class GrammarChecker:
    """The front end's check that a grammar compiles for this model (a verdict per grammar
    text, the last `cache_size` kept). Thread-safe; `check` blocks (run it off the loop)."""

    def __init__(self, build: Callable[[], llguidance.LLTokenizer], cache_size: int = 256) -> None:
        self._tokenizer = _LazyTokenizer(build)
        self._verdicts: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size

    def warm(self) -> None:
        """Build the tokenizer now (a server at start, so no request waits for it)."""
        self._tokenizer.get()

    def check(self, grammar: str, param: str) -> None:
        """InvalidRequestError naming `param` unless `grammar` compiles within `LIMITS`."""
        with self._lock:
            error = self._verdicts.get(grammar)
            if error is not None:
                self._verdicts.move_to_end(grammar)
        if error is None:
            error = _compile_error(grammar, self._tokenizer.get())
            with self._lock:
                self._verdicts[grammar] = error
                while len(self._verdicts) > self._cache_size:
                    self._verdicts.popitem(last=False)
        if error:
            raise InvalidRequestError(f"{param} does not compile: {error}", param)


def _compile_error(grammar: str, tokenizer: llguidance.LLTokenizer) -> str:
    """'' when `grammar` compiles (and its matcher starts) within the limits, else why not."""
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=LIMITS)
    if error:
        return _one_line(error)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    return _one_line(matcher.get_error()) if matcher.is_error() else ""


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpt (lines after the first blank one)."""
    lines = [ln.rstrip() for ln in message.strip().splitlines()]
    kept = []
    for ln in lines:
        if not ln or ln.lstrip().startswith(("|", "^")) or ln.lstrip()[:1].isdigit():
            break
        kept.append(ln.strip())
    return " ".join(kept) or lines[0]


class Matchers:
    """The engine's matchers: `new(grammar)` is a fresh matcher for one request. One
    compiled matcher is kept per grammar text (the last `cache_size`), and a request gets a
    deep copy. Used from one thread (the structured-output participant's)."""

    def __init__(self, build: Callable[[], llguidance.LLTokenizer], cache_size: int = 64) -> None:
        self._tokenizer = _LazyTokenizer(build)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self.num_compiled = 0

    def new(self, grammar: str) -> llguidance.LLMatcher:
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(
                self._tokenizer.get(), grammar, log_level=0, limits=LIMITS
            )
            self.num_compiled += 1
            self._compiled[grammar] = template
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return template.deep_copy()
