"""Engine outputs -> OpenAI response choices (text, deltas, logprobs, tool calls)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdserve.grammar.tools import ToolStream, parse
from pdserve.model.tokenizer import Tokenizer
from pdserve.text.outputs import RequestOutput, TokenLogprob

# One choice's renderer: (output, as a stream delta?) -> the choice's JSON. A choice
# whose renderer keeps state (tool calls) gets its own for the whole response.
ChoiceRender = Callable[[RequestOutput, bool], dict[str, Any]]


class Renderer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text(self, token_ids: Sequence[int]) -> str:
        """A prompt given as token ids, as text (echo): special tokens kept."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def completion_choice(self, out: RequestOutput, delta: bool) -> dict[str, Any]:
        return {
            "index": 0,
            "text": out.delta_text if delta else out.text,
            "finish_reason": out.finish_reason,
            "logprobs": self._completion_logprobs(_entries(out, delta)),
        }

    def chat_choice(self, out: RequestOutput, delta: bool) -> dict[str, Any]:
        key, content = (
            ("delta", {"content": out.delta_text})
            if delta
            else ("message", {"role": "assistant", "content": out.text})
        )
        logprobs = self._chat_logprobs(out, delta)
        return {"index": 0, key: content, "finish_reason": out.finish_reason, "logprobs": logprobs}

    def chat_choices(self, tool_names: frozenset[str] | None) -> Callable[[], ChoiceRender]:
        """New renderers of chat choices; `tool_names`: the functions whose calls are
        taken out of the text (None: no tools, the text is the content)."""
        if tool_names is None:
            return lambda: self.chat_choice
        return lambda: _ToolChoice(self, tool_names)

    def _chat_logprobs(self, out: RequestOutput, delta: bool) -> dict[str, Any] | None:
        entries = _entries(out, delta)
        return None if entries is None else {"content": [self._chat_entry(e) for e in entries]}

    def _completion_logprobs(self, entries: Sequence[TokenLogprob] | None) -> Any:
        if entries is None:
            return None
        tokens = [self.token(e.token_id) for e in entries]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token(t): lp for t, lp in e.top_logprobs} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        top = [one(t, lp) for t, lp in e.top_logprobs]
        return {**one(e.token_id, e.logprob), "top_logprobs": top}


def _entries(out: RequestOutput, delta: bool) -> Sequence[TokenLogprob] | None:
    if out.logprobs is None:
        return None
    if not delta:
        return out.logprobs
    n = len(out.delta_token_ids)
    return out.logprobs[len(out.logprobs) - n :] if n else []


class _ToolChoice:
    """A chat choice whose text may hold tool calls (grammar/tools.py's format): the reply
    carries them as `tool_calls` (a stream: one delta a call, once its block closed) and
    finishes with "tool_calls" when it made any and stopped by itself."""

    def __init__(self, renderer: Renderer, names: frozenset[str]) -> None:
        self.renderer = renderer
        self.names = names
        self.stream = ToolStream(names)

    def __call__(self, out: RequestOutput, delta: bool) -> dict[str, Any]:
        logprobs = self.renderer._chat_logprobs(out, delta)
        if not delta:
            content, calls = parse(out.text, self.names)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            finish = _finish(out.finish_reason, bool(calls))
            return {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
        text, deltas = self.stream.feed(out.delta_text)
        if out.finished:
            text += self.stream.finish()
        piece: dict[str, Any] = {}
        if text:
            piece["content"] = text
        if deltas:
            piece["tool_calls"] = deltas
        finish = _finish(out.finish_reason, bool(self.stream.calls))
        return {"index": 0, "delta": piece, "finish_reason": finish, "logprobs": logprobs}


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason
