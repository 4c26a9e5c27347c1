"""A request's output constraint, from the fields that ask for one, as one grammar.

The fields (server/protocol.py parses them; at most one may constrain a request):

- OpenAI's `response_format`: `{"type": "json_object"}` (any JSON object) or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}`;
  `{"type": "text"}` is no constraint.
- vLLM's `structured_outputs` (its current client): one of `json`, `regex`, `choice`,
  `grammar`, `json_object`, and for JSON its options `disable_any_whitespace` (compact
  JSON: no whitespace between tokens) and `whitespace_pattern` (a regex for it);
  `disable_fallback` is accepted and changes nothing (there is no second backend).
- vLLM's older fields: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
- tool calls the request demands (`tool_choice: "required"` or a named function):
  `grammar.tools` builds theirs.

`Constraint` is what the front end checks (it must compile for this model:
`GrammarChecker`) and then sends as `SamplingParams.grammar`. A grammar given as text
may be Lark (llguidance's dialect) or GBNF (llama.cpp's, as vLLM accepts it): GBNF is
converted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from pdserve.errors import InvalidRequestError


@dataclass(frozen=True)
class Constraint:
    """One grammar and the request field it came from (a 400 about it names the field)."""

    grammar: str  # llguidance's JSON form
    param: str


JsonOptions = dict[str, Any]  # llguidance's JSON compile options (`x-guidance` overrides)


def json_schema(schema: Any, param: str, options: JsonOptions | None = None) -> Constraint:
    """Output valid against a JSON schema (an object or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(
            f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param
        )
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)  # type: ignore[arg-type]
    return Constraint(grammar, param)


def json_object(param: str, options: JsonOptions | None = None) -> Constraint:
    """Output that is one JSON object (OpenAI's JSON mode)."""
    return json_schema({"type": "object"}, param, options)


def regex(pattern: Any, param: str) -> Constraint:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError(f"{param} must be a non-empty regular expression", param)
    return Constraint(LLMatcher.grammar_from_regex(pattern), param)


MAX_CHOICES = 4096


def choice(options: Any, param: str) -> Constraint:
    """Output that is exactly one of the strings."""
    if not isinstance(options, list) or not options:
        raise InvalidRequestError(f"{param} must be a non-empty list of strings", param)
    if len(options) > MAX_CHOICES:
        raise InvalidRequestError(
            f"{param} may hold at most {MAX_CHOICES} strings, got {len(options)}", param
        )
    for i, option in enumerate(options):
        if not isinstance(option, str) or not option:
            raise InvalidRequestError(f"{param}[{i}] must be a non-empty string", param)
    alternatives = " | ".join(lark_literal(o) for o in options)
    return Constraint(LLMatcher.grammar_from_lark(f"start: {alternatives}\n"), param)


def grammar(text: Any, param: str) -> Constraint:
    """Output in the language of a Lark or GBNF grammar."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError(f"{param} must be a non-empty Lark or GBNF grammar", param)
    try:
        lark = any_to_lark(text)
    except (GbnfToLarkError, ValueError) as e:
        raise InvalidRequestError(f"{param} is not a valid GBNF grammar: {e}", param) from None
    return Constraint(LLMatcher.grammar_from_lark(lark), param)


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def from_fields(fields: dict[str, Any]) -> Constraint | None:
    """The constraint of a request's constraint fields (name -> value; unset ones are
    absent or None). InvalidRequestError when two are set or a value is malformed."""
    given = [(k, v) for k, v in fields.items() if v is not None and not _is_plain_text(k, v)]
    if len(given) > 1:
        names = ", ".join(k for k, _ in given)
        raise InvalidRequestError(
            f"a request takes at most one output constraint, got {names}", given[1][0]
        )
    if not given:
        return None
    name, value = given[0]
    return _FIELDS[name](value, name)


def _is_plain_text(name: str, value: Any) -> bool:
    return name == "response_format" and getattr(value, "type", None) == "text"


def _response_format(value: Any, param: str) -> Constraint:
    if value.type == "json_object":
        return json_object(param)
    spec = value.json_schema
    if spec is None:
        raise InvalidRequestError(
            'response_format of type "json_schema" needs its json_schema field',
            "response_format.json_schema",
        )
    if spec.schema_ is None:
        raise InvalidRequestError(
            "response_format.json_schema needs its schema", "response_format.json_schema.schema"
        )
    return json_schema(spec.schema_, "response_format.json_schema.schema")


_JSON_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback")


def _structured_outputs(value: dict[str, Any], param: str) -> Constraint:
    """vLLM's `structured_outputs`: its fields that are set, by name."""
    options: JsonOptions = {}
    if value.get("disable_any_whitespace"):
        options["whitespace_flexible"] = False
    if value.get("whitespace_pattern") is not None:
        options["whitespace_pattern"] = value["whitespace_pattern"]
    kinds = {k: v for k, v in value.items() if k not in _JSON_OPTIONS}
    fields = {f"{param}.{name}": v for name, v in kinds.items() if v is not None and v is not False}
    if len(fields) != 1:
        got = ", ".join(fields) or "none"
        raise InvalidRequestError(
            f"{param} takes exactly one of json, regex, choice, grammar, json_object; got {got}",
            param,
        )
    ((name, v),) = fields.items()
    kind = name.rsplit(".", 1)[1]
    if kind == "json_object":
        return json_object(name, options or None)
    if kind == "json":
        return json_schema(v, name, options or None)
    if options:
        raise InvalidRequestError(
            f"{param}'s whitespace options apply to json and json_object, not {kind}", param
        )
    return _BY_KIND[kind](v, name)


_BY_KIND = {"regex": regex, "choice": choice, "grammar": grammar}
_FIELDS: dict[str, Any] = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": json_schema,
    "guided_regex": regex,
    "guided_choice": choice,
    "guided_grammar": grammar,
}
