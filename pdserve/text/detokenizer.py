"""Incremental detokenization with stop strings, for streaming.

One `IncrementalDetokenizer` per request. The engine feeds it every generated token with
`add_token` and sends the returned text to the client; it calls `finish` once when
generation ends for any reason other than a stop string (EOS, a stop token id, max_tokens,
abort) to release the text held back.

How text is produced (the offsets method of vLLM / TGI, using only `tokenizer.decode`):
the text of the new tokens is `decode(ids[prefix:]) - decode(ids[prefix:read])`, where
`ids[prefix:read]` are a few tokens already turned into text that give the decoder its
context (leading spaces of SentencePiece / byte-level BPE pieces come out right). If the
result ends in U+FFFD, the last token ends inside a multi-byte UTF-8 character: nothing is
emitted until a later token completes it.

Stop strings are searched in the output text, so they are found whatever tokens they span:
every output character goes once through one automaton over all stop strings
(`stop_strings.StopMatcher`), so the cost per token is linear in its text, whatever the
number and length of the stop strings. The first character at which a stop string is
complete ends the output (the longest such stop string is the match). The text emitted
never contains a matched stop string (unless include_stop_str_in_output) nor anything
after it. To guarantee that while streaming, the longest end of the text that could still
be the beginning of a stop string is held back until the next tokens decide. A stop string
counts only if it ends in text produced once `min_tokens` tokens were added.

Contract for the engine: when generation ends on EOS or a stop token id, do not add that
token (vLLM leaves its text out), call `finish()`. After a stop string matched (`stopped`),
the request is over: `add_token` raises, `finish()` returns ''.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.stop_strings import matcher_for

_CONTEXT_TOKENS = 5
"""Prompt tokens decoded with the first output tokens as context (vLLM uses 5 too)."""

_INCOMPLETE = "\ufffd"


class Tokenizer(Protocol):
    """What the detokenizer needs of a tokenizer: `decode(ids, skip_special_tokens=...)`.

    The return type is that of Hugging Face tokenizers, which return a list for a batch;
    a list of ints must give a str.
    """

    def decode(
        self, token_ids: list[int], /, skip_special_tokens: bool = ...
    ) -> str | list[str]: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into streamable text and detects stop strings."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._matcher = matcher_for(params.stop) if params.stop else None
        self._state = 0  # the matcher's state after every character decoded so far
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Only the last prompt tokens matter, as decoding context.
        self._ids = list(prompt_token_ids[max(0, len(prompt_token_ids) - _CONTEXT_TOKENS) :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_output_tokens = 0
        self._emitted: list[str] = []
        self._pending = ""  # decoded, not emitted yet: might be the start of a stop string
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far (after `finish`, the whole output)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended generation, once matched."""
        return self._stop_reason

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; the request must end."""
        return self._stop_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def add_token(self, token_id: int) -> str:
        """Add one generated token; return the new text that is safe to emit now ('' if none).

        Raises RuntimeError after a stop string matched or after `finish`.
        """
        if self.stopped or self._finished:
            state = f"stopped on {self._stop_reason!r}" if self.stopped else "finished"
            raise RuntimeError(f"add_token called on a detokenizer already {state}")
        self._ids.append(token_id)
        self._num_output_tokens += 1
        return self._release(self._decode_new_text(final=False), final=False)

    def finish(self) -> str:
        """End of generation (not by a stop string): return the text still held back.

        Text of an unfinished UTF-8 character is released as decode gives it (U+FFFD), and a
        stop string completed by that last text is still honoured. Later calls return ''.
        """
        if self.stopped or self._finished:
            return ""
        self._finished = True
        return self._release(self._decode_new_text(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.decode(list of ids) must return str, got {type(text)}")
        return text

    def _decode_new_text(self, final: bool) -> str:
        """Text of the tokens after read_offset, and advance the offsets ('' if not ready)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token
        if full_text.endswith(_INCOMPLETE) and not final:
            return ""  # the last token ends inside a UTF-8 character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _release(self, new_text: str, final: bool) -> str:
        """Run new_text through the stop matcher; emit what can no longer be a stop."""
        window = self._pending + new_text
        if self._matcher is None:
            self._pending = ""
            return self._emit(window)
        match = self._scan(new_text)
        if match is not None:
            end, stop = match
            self._stop_reason = stop
            cut = len(self._pending) + end  # where the stop ends in window
            self._pending = ""
            return self._emit(window[: cut if self._include_stop else cut - len(stop)])
        held = 0 if final else self._matcher.held(self._state)
        self._pending = window[len(window) - held :]
        return self._emit(window[: len(window) - held])

    def _scan(self, new_text: str) -> tuple[int, str] | None:
        """Advance the matcher over new_text; (end in new_text, stop) of the first match.

        Matches count only once min_tokens tokens were added (the state still advances).
        """
        assert self._matcher is not None
        matcher, state = self._matcher, self._state
        counting = self._num_output_tokens >= self._min_tokens
        for i, ch in enumerate(new_text):
            state = matcher.step(state, ch)
            stop = matcher.completed(state) if counting else None
            if stop is not None:
                self._state = state
                return i + 1, stop
        self._state = state
        return None

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text
