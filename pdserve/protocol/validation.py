"""What a request must satisfy against the model serving it: token ids in the vocabulary,
prompt plus max_tokens within the context.

`check_request` is called where each request enters: by the front end (`Cluster`)
before anything is encoded for another process — a 2**70 token id or
max_tokens would otherwise fail in the msgpack encoder — and by the engine core for
requests added in-process (`Engine`, `LLM`). It raises `InvalidRequestError` naming the
field and the limit.

A prompt that fills the context by itself is refused first, from its length alone: the
checks after it walk the prompt, and a client can send a prompt of a million tokens.
So the work a request costs here is bounded by the context, not by the body. The HTTP
server calls `check_prompt_length` with a prompt's token count before it builds the
prompt's id list (a Python list of a million ints costs ~40 ms under the GIL): the same
refusal, in the same order, as `check_request` gives.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.errors import InvalidRequestError
from pdserve.protocol.sampling_params import SamplingParams


def check_request(
    prompt: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    if not prompt:
        raise InvalidRequestError("prompt must contain at least one token", "prompt")
    check_prompt_length(len(prompt), params, max_model_len)
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
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})", "logit_bias"
        )
    if len(prompt) + params.max_tokens > max_model_len:
        raise _over_context(len(prompt), params, max_model_len, "max_tokens")


def check_prompt_length(num_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """Refuse a prompt of `num_tokens` that leaves no room for an output token."""
    if num_tokens >= max_model_len:
        raise _over_context(num_tokens, params, max_model_len, "prompt")


def _over_context(
    num_tokens: int, params: SamplingParams, max_model_len: int, param: str
) -> InvalidRequestError:
    return InvalidRequestError(
        f"this model's maximum context length is {max_model_len} tokens, but {num_tokens} "
        f"prompt tokens plus max_tokens={params.max_tokens} would need "
        f"{num_tokens + params.max_tokens}",
        param,
    )
