"""Structured outputs: grammars that constrain what a request may generate.

The library is llguidance (microsoft/llguidance, on PyPI: a Rust core, no dependencies):
its grammars need no ahead-of-time compilation (a JSON schema or a Lark grammar is
ready in about a millisecond, lexer states are built lazily), it bounds its own work
(`LLParserLimits`: fuel per step and per grammar, so a hostile schema cannot stall a
step), one token mask costs ~0.1 ms on the shipped model's 49k vocabulary with the GIL
released, and it reads JSON schemas, regular expressions and Lark grammars (GBNF by
conversion) - every form the OpenAI and vLLM request fields take.

- `requests`: a request's fields (response_format, structured_outputs, guided_*,
  tool_choice) -> one grammar, llguidance's JSON form (`SamplingParams.grammar`).
- `compiler`: the tokenizer llguidance needs, grammar checks with a time limit (the
  front end) and matchers by grammar (the engine), both cached.
- `tools`: the tool-call format: tools in the prompt, calls out of the text.

The engine side is `engine/features/structured_output.py`.
"""
