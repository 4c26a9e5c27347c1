"""Tool calling: the tools in the prompt, the calls out of the generated text.

Format: Hermes' (NousResearch's function-calling format, which Qwen 2.5, Hermes and
SmolLM3 are trained on and vLLM's `hermes` parser reads): the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block a call. A model whose chat template renders `tools` itself gets them through
its template; for a template that does not (the shipped SmolLM2's), `render_messages`
writes them into the system message in this format, an assistant turn's `tool_calls`
as such blocks and a `tool` message as a `<tool_response>` user turn.

`tool_choice` "required" or a named function constrains the output to such blocks
(`call_grammar`: every function's arguments under its `parameters` schema; one block
for a named function or `parallel_tool_calls: false`, one or more for "required"), so
those replies always parse (a last block cut short by max_tokens is dropped); "auto"
leaves the model free and `parse` takes out whatever complete, valid blocks it wrote;
"none" renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist "
    "with the user query. The functions are given in <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\nFor each function call, return a JSON object with the function "
    "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class Function:
    """One tool of a request: a function's name, description and parameters schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}

    def call_schema(self) -> dict[str, Any]:
        """The schema of one call of this function in the format's JSON."""
        return {
            "type": "object",
            "properties": {"name": {"const": self.name}, "arguments": self.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }


def arguments_grammar(fn: Function) -> str:
    """A grammar of `fn`'s arguments alone (the front end checks each tool's schema)."""
    return LLMatcher.grammar_from_json_schema(json.dumps(fn.parameters))


def call_grammar(functions: Sequence[Function], parallel: bool) -> str:
    """Output that is one call block of one of `functions` (`parallel`: one or more)."""
    schema = {"anyOf": [f.call_schema() for f in functions]}
    if len(functions) == 1:
        schema = functions[0].call_schema()
    start = "call+" if parallel else "call"
    lark = (
        f"start: {start}\n"
        f'call: "{OPEN}\\n" payload "\\n{CLOSE}" "\\n"?\n'
        f"payload: %json {json.dumps(schema)}\n"
    )
    return LLMatcher.grammar_from_lark(lark)


def render_messages(
    messages: list[dict[str, Any]], functions: Sequence[Function]
) -> list[dict[str, Any]]:
    """`messages` for a chat template that knows no tools: the tools in the system
    message, tool calls and tool results as text in the format."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                f"{OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{CLOSE}"
                for c in m["tool_calls"]
            ]
            content = "\n".join([content, *blocks] if content else blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if functions:
        specs = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in functions)
        system = _SYSTEM.format(tools=specs)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as the format writes it (its `arguments` string
    parsed back to the object the model would have written)."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"])
    except (json.JSONDecodeError, TypeError):
        args = fn["arguments"]
    return {"name": fn["name"], "arguments": args}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def parse_block(body: str, names: frozenset[str]) -> ToolCall | None:
    """One block's JSON as a call of a known function, else None."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse(text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply, exactly as `ToolStream` splits it streamed:
    complete blocks that parse as calls of `names` are calls; everything else is content
    (None when only whitespace is left), but a last block cut short after calls
    (max_tokens) is dropped."""
    stream = ToolStream(names)
    content, _ = stream.feed(text)
    content += stream.finish()
    return (content.strip() or None) if stream.calls else (content or None), stream.calls


class ToolStream:
    """One streamed choice's text split into content deltas and tool-call deltas.

    Text that cannot begin a block goes out as content at once; from a possible `<tool_call>`
    on it is held until the block closes (then one tool-call delta: id, name and the
    whole arguments) or turns out not to be one (then it is content). `finish` flushes
    what is held."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self._held = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call deltas) to send for the next piece of text."""
        self._held += text
        content, deltas = "", []
        while self._held:
            start = self._held.find(OPEN)
            if start < 0:
                keep = _partial_open(self._held)
                content += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                break
            if start > 0:
                content += self._held[:start]
                self._held = self._held[start:]
            end = self._held.find(CLOSE)
            if end < 0:
                break
            body = self._held[len(OPEN) : end]
            call = parse_block(body, self.names)
            if call is None:
                content += self._held[: end + len(CLOSE)]
            else:
                deltas.append(call.openai(len(self.calls)))
                self.calls.append(call)
            self._held = (
                self._held[end + len(CLOSE) :].lstrip("\n")
                if call
                else self._held[end + len(CLOSE) :]
            )
        if self.calls and not content.strip():
            content = ""
        return content, deltas

    def finish(self) -> str:
        """What is still held, as content; after calls, a block cut short is dropped (as
        `parse` drops it)."""
        held, self._held = self._held, ""
        return "" if self.calls and held.startswith(OPEN) else held


def _partial_open(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
