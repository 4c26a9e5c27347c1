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
from pdserve.grammar import requests
from pdserve.grammar.requests import Constraint
from pdserve.grammar.tools import Function
from pdserve.protocol.sampling_params import MAX_LOGPROBS, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (exactly one of the fields)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: Any = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON options (grammar/requests.py)
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None


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
    logit_bias: dict[str, float] | None = None
    # Output constraints (grammar/requests.py; at most one).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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
        fields = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.logit_bias:
            fields["logit_bias"] = _logit_bias(self.logit_bias)
        return fields

    def constraint(self) -> Constraint | None:
        """The output constraint the request's fields ask for (InvalidRequestError when
        two do, or one is malformed); None: unconstrained."""
        so = self.structured_outputs
        return requests.from_fields(
            {
                "response_format": self.response_format,
                "structured_outputs": (
                    None if so is None else so.model_dump(by_alias=True, exclude_none=True)
                ),
                "guided_json": self.guided_json,
                "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice,
                "guided_grammar": self.guided_grammar,
            }
        )


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys."""
    out = {}
    for key, value in bias.items():
        k = key.strip()
        if not (k.isascii() and k.isdigit()):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                "logit_bias",
            )
        out[int(k)] = value
    return out


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


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the reply gave it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Text, or content parts (only text parts are read: `text`).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self, path: str) -> str:
        """The content as text: its text parts joined; InvalidRequestError naming a part
        that is not text (`path`: the message's place in the body)."""
        c = self.content
        if c is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise InvalidRequestError(f"{path}.content: Field required", f"{path}.content")
        if isinstance(c, str):
            return c
        texts = []
        for i, part in enumerate(c):
            kind = part.get("type")
            where = f"{path}.content.{i}"
            if kind != "text":
                raise InvalidRequestError(
                    f"{where}: content parts of type {kind!r} are not supported "
                    "(this model reads text parts only)",
                    where,
                )
            text = part.get("text")
            if not isinstance(text, str) or set(part) != {"type", "text"}:
                raise InvalidRequestError(
                    f'{where}: a text part is {{"type": "text", "text": <string>}}', where
                )
            _check_text(text, f"{where}.text")
            texts.append(text)
        return "".join(texts)

    def template_dict(self, path: str) -> dict[str, Any]:
        """The message as a chat template reads it (developer = system)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(path),
        }
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        self._check_tools()
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

    def _check_tools(self) -> None:
        tools = self.tools or []
        if len(tools) > MAX_TOOLS:
            raise InvalidRequestError(
                f"tools may hold at most {MAX_TOOLS} functions, got {len(tools)}", "tools"
            )
        seen: set[str] = set()
        for i, t in enumerate(tools):
            if t.function.name in seen:
                raise InvalidRequestError(
                    f"tools names the function {t.function.name!r} twice", f"tools.{i}"
                )
            seen.add(t.function.name)
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            if choice == "required" and not tools:
                raise InvalidRequestError(
                    'tool_choice "required" needs at least one tool in tools', "tool_choice"
                )
            return
        if choice.function.name not in seen:
            known = ", ".join(sorted(seen)) or "none"
            raise InvalidRequestError(
                f"tool_choice names the function {choice.function.name!r}, which is not in "
                f"tools ({known})",
                "tool_choice",
            )

    def functions(self) -> list[Function]:
        """The request's functions, as the tool format renders them."""
        return [
            Function(
                t.function.name,
                t.function.description,
                t.function.parameters or {"type": "object", "properties": {}},
            )
            for t in self.tools or []
        ]

    @property
    def tool_mode(self) -> str:
        """ "none" (no tools rendered or parsed), "auto", "required", or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else "named"

    def demanded_functions(self) -> list[Function]:
        """The functions whose calls the output must be: all ("required"), one ("named")."""
        fns = self.functions()
        c = self.tool_choice
        if isinstance(c, NamedToolChoice):
            return [f for f in fns if f.name == c.function.name]
        return fns if c == "required" else []

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict(f"messages.{i}") for i, m in enumerate(self.messages)]

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
