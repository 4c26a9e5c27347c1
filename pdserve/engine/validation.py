"""What a request must satisfy against the model serving it: token ids in the vocabulary,
prompt plus max_tokens within the context.

One function, called where each request enters: by the front end (`Cluster`)
before anything is encoded for another process — a 2**70 token id or
max_tokens would otherwise fail in the msgpack encoder — and by the engine core for
requests added in-process (`Engine`, `LLM`). It raises `InvalidRequestError` naming the
field and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError


def check_request(
    prompt: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    if not prompt:
        raise InvalidRequestError("prompt must contain at least one token", "prompt")
    bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})", "prompt"
        )
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"stop token id {bad} is outside the vocabulary [0, {vocab_size})", "stop_token_ids"
        )
    if len(prompt) + params.max_tokens > max_model_len:
        param = "prompt" if len(prompt) >= max_model_len else "max_tokens"
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but {len(prompt)} "
            f"prompt tokens plus max_tokens={params.max_tokens} would need "
            f"{len(prompt) + params.max_tokens}",
            param,
        )
