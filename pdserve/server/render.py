"""Engine outputs -> OpenAI response choices (text, deltas, logprobs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.model.tokenizer import Tokenizer
from pdserve.text.outputs import RequestOutput, TokenLogprob


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
        entries = _entries(out, delta)
        logprobs = None if entries is None else {"content": [self._chat_entry(e) for e in entries]}
        return {"index": 0, key: content, "finish_reason": out.finish_reason, "logprobs": logprobs}

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
