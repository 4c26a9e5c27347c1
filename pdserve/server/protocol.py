"""OpenAI request bodies (the subset served so far), validated by pydantic.

Unknown fields are refused (400 naming the field), as the OpenAI API does.
Sampling fields map onto `SamplingParams`, whose own validation states limits.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    def sampling_fields(self) -> dict[str, Any]:
        names = (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


MAX_PROMPTS = 256


class CompletionRequest(_Body):
    # One prompt (text or token ids) or a batch of them (choice k of n for prompt p
    # is index p * n + k in the response, as in the OpenAI API).
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, each checked non-empty (InvalidRequestError naming `prompt`)."""
        p = self.prompt
        if not p:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        batch: list[str | list[int]]
        batch = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        if len(batch) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"a request may hold at most {MAX_PROMPTS} prompts, got {len(batch)}", "prompt"
            )
        empty = next((i for i, one in enumerate(batch) if not one), None)
        if empty is not None:
            raise InvalidRequestError(f"prompt {empty} of the batch is empty", "prompt")
        return batch

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        fields = self.sampling_fields()
        fields["max_tokens"] = self.max_tokens if self.max_tokens is not None else 16
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        return SamplingParams.from_dict(fields)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        fields = self.sampling_fields()
        limit = self.max_completion_tokens
        if limit is None:
            limit = self.max_tokens
        fields["max_tokens"] = limit if limit is not None else default_max_tokens
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return SamplingParams.from_dict(fields)
