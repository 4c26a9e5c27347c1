"""The front end's text: token ids in, text deltas out, for each request.

- `detokenizer`: `IncrementalDetokenizer`, a request's ids to text while streaming (never
  broken UTF-8), stop strings found in that text.
- `stop_strings`: `StopMatcher`, one automaton over a request's stop strings.
- `output_processor`: `OutputProcessor`, a core's `EngineOutput`s to `RequestOutput`s;
  `LoopBudget`.
- `outputs`: `RequestOutput` and `TokenLogprob`, what a request's caller receives.

It reads a tokenizer only through `decode` (`detokenizer.Tokenizer`), so it needs no
model code: the engine (`Engine`, `LLM`) and the serving front end (`Cluster`) both use it.
"""
