"""Prompts that are real token sequences of the served model's tokenizer, exact in length.

A prompt of n tokens is n words drawn from the tokenizer's own vocabulary: entries
that are a space plus lowercase letters and that encode back to exactly themselves.
The byte-level pre-tokenizer splits text at those spaces, so the concatenation
encodes to exactly the drawn ids; every prompt is still checked by encoding it
(the server counts what its tokenizer makes of the text, not what we meant).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.bench.config import BenchInputError

if TYPE_CHECKING:  # transformers takes ~1.5 s to import: not for `pdserve --help`
    from pdserve.model.tokenizer import Tokenizer

_WORD = re.compile(r"[ Ġ▁][a-z]{2,}")
_MIN_POOL = 1000


def load_tokenizer(spec: str | None) -> Tokenizer:
    from pdserve.model.tokenizer import Tokenizer

    """None: the shipped SmolLM2 GGUF; a path: HF folder or .gguf; else a HF hub name."""
    from pdserve.errors import ModelLoadError

    try:
        if spec is None or Path(spec).exists():
            return Tokenizer.from_model_path(spec)
        from transformers import AutoTokenizer

        return Tokenizer(AutoTokenizer.from_pretrained(spec))
    except (ModelLoadError, OSError, ValueError) as e:
        raise BenchInputError(f"--tokenizer {spec}: cannot load ({e})") from None


@dataclass(frozen=True)
class Prompt:
    text: str
    num_tokens: int


class PromptFactory:
    """Makes exact-length prompts; also counts tokens the way the server does."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = tokenizer.backend
        candidates = [i for s, i in backend.get_vocab().items() if _WORD.fullmatch(s)]
        pieces = backend.batch_decode([[i] for i in candidates])
        encoded = backend(pieces, add_special_tokens=False)["input_ids"]
        pool = [(i, p) for i, p, e in zip(candidates, pieces, encoded, strict=True) if e == [i]]
        if len(pool) < _MIN_POOL:
            raise BenchInputError(
                f"the tokenizer has only {len(pool)} single-token words; cannot build prompts"
            )
        pool.sort()
        self._ids = np.array([i for i, _ in pool])
        self._pieces = [p for _, p in pool]
        self._piece_of = dict(pool)
        self.special = len(backend.encode("", add_special_tokens=True))
        """Tokens the server adds to any text prompt (a BOS for some models)."""

    def count(self, text: str) -> int:
        """Prompt tokens as the server counts a completions prompt."""
        return len(self.tokenizer.encode(text))

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        """Prompt tokens of a chat request: the chat template applied, as the server does."""
        if not self.tokenizer.has_chat_template:
            return sum(self.count(str(m["content"])) for m in messages)
        text = self.tokenizer.apply_chat_template(messages)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def words(self, rng: np.random.Generator, n: int) -> str:
        """n random vocabulary words: n tokens inside a longer text (no special tokens)."""
        idx = rng.integers(0, len(self._ids), size=n)
        return "".join(self._pieces[int(k)] for k in idx)

    def prompt(self, rng: np.random.Generator, n: int, prefix: str = "") -> Prompt:
        """A prompt of exactly n tokens as the server counts it, starting with `prefix`
        (itself made by `words`)."""
        body = n - self.special - (self._count_plain(prefix) if prefix else 0)
        if body < 1:
            raise BenchInputError(f"a prompt of {n} tokens leaves no room after the prefix")
        for _ in range(5):
            text = prefix + self.words(rng, body)
            if self.count(text) == n:
                return Prompt(text, n)
        raise BenchInputError(
            f"this tokenizer does not keep {n}-token word prompts exact; use another --tokenizer"
        )

    def _count_plain(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))
