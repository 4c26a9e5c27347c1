"""OpenAI request bodies (the subset served so far), validated by pydantic.

Unknown fields are refused (400 naming the field), as the OpenAI API does.
Sampling fields map onto `SamplingParams`, whose own validation states limits.
`check` holds the rules that span fields or that pydantic does not know: text must be
valid Unicode (JSON may carry a lone surrogate, "\ud800", which no tokenizer or UTF-8
encoder takes), `stream_options` needs `stream`, `top_logprobs` needs `logprobs`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pdserve.config import Role
from pdserve.errors import InvalidRequestError
from pdserve.protocol.sampling_params import MAX_LOGPROBS, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


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
    stream_options: StreamOptions | None = None
    user: str | None = None

    def check(self) -> None:
        """The rules across fields; InvalidRequestError naming the field."""
        _check_unicode(self, "")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

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


def _prompt_shape(value: Any) -> str | None:
    """Which member of `Prompt` a value is meant as, from its first item. Without it
    pydantic tries the members in turn, and a member that fails collects an error for
    every item: a 4 MB list of token ids took ~2 s of the event loop as `list[str]`
    first. None: no member (an error naming the union, `errors._UNIONS`)."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    if isinstance(first, str):
        return "list[str]"
    return "list[list[int]]" if isinstance(first, list) else "list[int]"


# One prompt (text or token ids) or a batch of them.
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[int], Tag("list[int]")]
    | Annotated[list[list[int]], Tag("list[list[int]]")],
    Discriminator(_prompt_shape),
]


class CompletionRequest(_Body):
    # One prompt (text or token ids) or a batch of them (choice k of n for prompt p
    # is index p * n + k in the response, as in the OpenAI API).
    prompt: Prompt
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

    def check(self) -> None:
        super().check()
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidRequestError(
                f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                "max_completion_tokens",
            )
        if self.top_logprobs is None:
            return
        if not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}",
                "top_logprobs",
            )

    @property
    def max_tokens_field(self) -> str:
        """The field the client used for the output length (errors name it)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        fields = self.sampling_fields()
        limit = self.max_completion_tokens
        if limit is None:
            limit = self.max_tokens
        fields["max_tokens"] = limit if limit is not None else default_max_tokens
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return SamplingParams.from_dict(fields)


def _check_unicode(value: object, path: str) -> None:
    """Every string of a parsed body must encode as UTF-8. Walks the model itself (no
    dump, no copy); lists are homogeneous after validation, so a list of token ids is
    skipped by its first item."""
    if isinstance(value, BaseModel):
        for name in value.model_fields_set:
            _check_unicode(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        for i, v in enumerate(value):
            _check_unicode(v, f"{path}.{i}")


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = f"U+{ord(text[e.start]):04X}"
        raise InvalidRequestError(
            f"{path} is not valid Unicode: a lone surrogate ({code}) at character {e.start}",
            path,
        ) from None


class RoleChange(BaseModel):
    """`POST /admin/instances/{name}/role`: the role the instance takes (instance flip);
    `POST /admin/instances`: the role a new instance starts in (scaling)."""

    model_config = ConfigDict(extra="forbid")

    role: Role
