"""Prompts -> token ids for the routes, without holding up the event loop.

One event loop serves every connection, `/health` included. The Rust tokenizer's
`encode` keeps the GIL for its whole call (~2 s for 3 MB of text), so a large prompt
encoded on the loop stalled every other request as long. Its `encode_batch_fast`
releases the GIL while it works: a text of more than `PromptConfig.inline_chars`
characters is encoded by it in a small thread pool of the front end's
(`PromptConfig.threads`) and the loop only awaits the result. A small text (about a
millisecond of work) is encoded on the loop, where a thread hop would cost more than it
saves, and so it never waits behind a large one. Chat templates (jinja: Python, which
hands the GIL over every switch interval) are rendered in the pool under the same rule.

An encoding gives its length at once and its id list on demand (`Encoded.ids`: a
Python list built under the GIL, ~20 ms for 700k tokens). The routes refuse a prompt
that fills the context from its length (`check_prompt_length`) before asking for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import tokenizers

from pdserve.model.tokenizer import Tokenizer

_T = TypeVar("_T")


@dataclass(frozen=True)
class PromptConfig:
    """How the HTTP front end tokenizes (`ServerConfig.prompts`)."""

    # Threads encoding large prompts: at most this many at once; more wait for a thread
    # (behind each other only: small prompts are encoded on the loop).
    threads: int = 2
    # A request's texts (its prompts, or its chat messages) of at most this many
    # characters in all are encoded on the event loop (~1 ms of work).
    inline_chars: int = 1024

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.inline_chars < 0:
            raise ValueError(f"inline_chars must be at least 0, got {self.inline_chars}")


class Encoded:
    """One prompt's token ids: the count at once, the list when asked for."""

    __slots__ = ("_source",)

    def __init__(self, source: list[int] | tokenizers.Encoding) -> None:
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def ids(self) -> list[int]:
        source = self._source
        return source if isinstance(source, list) else source.ids


class PromptEncoder:
    """Owns the thread pool; `close` it when the server stops. Safe to share between
    requests (the tokenizer is not mutated)."""

    def __init__(self, tokenizer: Tokenizer, config: PromptConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="pdserve-prompts")

    async def prompts(self, prompts: Sequence[str | list[int]]) -> list[Encoded]:
        """Each prompt's encoding: text as `Tokenizer.encode` gives it (special tokens
        added), token ids as given."""
        texts = [p for p in prompts if isinstance(p, str)]
        if sum(map(len, texts)) <= self.config.inline_chars:
            encode = self.tokenizer.encode
            return [Encoded(p if isinstance(p, list) else encode(p)) for p in prompts]
        encoded = iter(await self._run(self._encode, texts, True))
        return [Encoded(p) if isinstance(p, list) else next(encoded) for p in prompts]

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> Encoded:
        """The chat template's rendering of `messages` (and `tools`, for a template that
        renders them), encoded (no special tokens added: the template writes them).
        InvalidRequestError as `apply_chat_template`."""
        size = sum(len(m.get("content") or "") for m in messages)
        if size > self.config.inline_chars or tools:
            return await self._run(self._chat, messages, tools)
        text = self.tokenizer.apply_chat_template(messages)
        return Encoded(self.tokenizer.encode(text, add_special_tokens=False))

    def close(self) -> None:
        """Stop the pool; encodings still queued are dropped (their requests are gone)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Encoded:
        text = self.tokenizer.apply_chat_template(messages, tools=tools)
        return self._encode([text], False)[0]

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[Encoded]:
        # `encode_many` frees the GIL while it works (a fast tokenizer's batch call; its
        # `_fast` form skips the offsets, so freeing a 700k-token encoding takes 2 ms of
        # GIL, not 40-80).
        return [Encoded(e) for e in self.tokenizer.encode_many(texts, add_special_tokens)]

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
