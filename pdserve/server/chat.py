"""A chat request's plan: what the template renders, what constrains the output, what is
parsed out of the reply. Pure (no I/O): the route checks the grammars and encodes.

Tools (`grammar/tools.py`): with `tool_choice` other than "none", a template that renders
`tools` itself gets them; any other gets them written into its messages in the tool-call
format, with the history's calls and results. "required" and a named function add the
call grammar as the output constraint (which cannot be combined with another: 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidRequestError
from pdserve.grammar.requests import Constraint
from pdserve.grammar.tools import arguments_grammar, call_grammar, render_messages
from pdserve.server.protocol import ChatCompletionRequest


@dataclass(frozen=True)
class ChatPlan:
    messages: list[dict[str, Any]]  # for the chat template
    tools: list[dict[str, Any]] | None  # for a template that renders them itself
    constraint: Constraint | None  # the output's grammar, with the field it came from
    tool_names: frozenset[str] | None  # the functions parsed out of replies; None: no tools
    # (grammar, field) of every tool's parameters schema: each must compile, called or not
    tool_schemas: list[tuple[str, str]]


def plan_chat(body: ChatCompletionRequest, template_knows_tools: bool) -> ChatPlan:
    """InvalidRequestError for a constraint that is malformed or clashes with tool_choice."""
    messages = body.template_messages()
    mode, functions = body.tool_mode, body.functions()
    constraint = body.constraint()
    demanded = body.demanded_functions()
    if demanded:
        if constraint is not None:
            raise InvalidRequestError(
                f"tool_choice {mode!r} constrains the output to tool calls; it cannot be "
                f"combined with {constraint.param}",
                constraint.param,
            )
        parallel = body.parallel_tool_calls is not False and mode == "required"
        constraint = Constraint(call_grammar(demanded, parallel), "tool_choice")
    tools = None
    if mode != "none" and template_knows_tools:
        tools = [f.spec() for f in functions]
    elif mode != "none":
        messages = render_messages(messages, functions)
    elif any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = render_messages(messages, [])  # the history's calls, no tools offered
    return ChatPlan(
        messages,
        tools,
        constraint,
        None if mode == "none" else frozenset(f.name for f in functions),
        [(arguments_grammar(f), f"tools.{i}.function.parameters") for i, f in enumerate(functions)],
    )
