"""Per-request sampling parameters (OpenAI / vLLM conventions).

`SamplingParams` is immutable and validated on construction: a value that is
out of range or of the wrong type raises `InvalidRequestError` whose `param` is
the field name and whose message states the limit, so nothing invalid ever
reaches the scheduler or the sampler. `from_dict` is the entry point for request
bodies: it also refuses unknown fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from pdserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
"""Largest number of top alternatives a request may ask for per generated token."""

PENALTY_LIMIT = 2.0
"""presence_penalty and frequency_penalty must lie in [-PENALTY_LIMIT, PENALTY_LIMIT]."""

MAX_STOP_STRINGS = 64
"""Most stop strings a request may give (OpenAI allows 4; vLLM sets no limit)."""

MAX_STOP_CHARS = 4096
"""Most characters all of a request's stop strings may hold together: their matcher is
built per request on the front end's event loop (~1 ms per 1,000 characters)."""

MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids a request may give."""

LOGIT_BIAS_LIMIT = 100.0
"""A logit_bias value lies in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (OpenAI's range); the
bounds themselves ban (-100) or force (+100) the token (sampler.py)."""

MAX_LOGIT_BIAS = 1024
"""Most tokens a request may bias (OpenAI allows 300; vLLM sets no limit)."""

MAX_GRAMMAR_CHARS = 1 << 20
"""Longest grammar (llguidance's JSON form) a request may carry: it crosses to every
instance the request meets, and a hand-off or a migration carries it again."""

INT64_MAX = 2**63 - 1
"""Integer fields cross process boundaries as 64-bit integers."""

# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each generated token and when to stop.

    Fields (all validated in `__post_init__`):

    - max_tokens: most tokens to generate, >= 1 (the context length bounds it where the
      model is known: `protocol/validation.py`).
    - min_tokens: EOS, `stop_token_ids` and `stop` strings are not honoured before this many
      tokens were generated; 0 <= min_tokens <= max_tokens.
    - temperature: >= 0; 0 means greedy (argmax), and then top_p/top_k/min_p are ignored.
    - top_p: nucleus sampling mass, in (0, 1]; 1 disables it.
    - top_k: keep the k most likely tokens; -1 or 0 disables it; at most INT64_MAX.
    - min_p: drop tokens whose probability is below min_p * (probability of the best token);
      in [0, 1], 0 disables it.
    - seed: per-request RNG seed (the engine builds the request's generator from it); None =
      engine-chosen randomness.
    - stop: strings that end generation when they appear in the output text (never included in
      the output unless include_stop_str_in_output). A single str or a list is accepted and
      stored as a tuple; empty strings are refused; at most MAX_STOP_STRINGS strings of
      MAX_STOP_CHARS characters in all.
    - stop_token_ids: token ids that end generation (the token itself is not part of the text);
      at most MAX_STOP_TOKEN_IDS. Whether they lie in the vocabulary is checked where the
      vocabulary is known (`protocol/validation.py`).
    - ignore_eos: keep generating after the model's EOS token (until max_tokens or a stop);
      not past the end of a grammar (its EOS ends the request).
    - logprobs: None = no log-probabilities; n in [0, 20] = return the chosen token's logprob
      plus the n most likely alternatives.
    - repetition_penalty: > 0; 1 disables it. Logits of tokens seen in prompt or output are
      divided by it when positive and multiplied by it when negative.
    - presence_penalty / frequency_penalty: in [-2, 2]; subtracted from the logits of tokens
      generated so far (once, resp. once per occurrence).
    - skip_special_tokens: leave special tokens out of the output text.
    - include_stop_str_in_output: keep the matched stop string at the end of the output text.
    - logit_bias: (token id, bias) pairs, ids distinct and ascending, biases in [-100, 100],
      added to the logits after the penalties; -100 bans the token, +100 forces it (among
      the tokens the grammar allows). At most MAX_LOGIT_BIAS pairs; whether the ids lie in
      the vocabulary is checked where it is known (`protocol/validation.py`).
    - grammar: the request's output constraint, an llguidance grammar in its JSON form
      (`pdserve/grammar/`: the front end builds it from response_format, the guided_*
      fields or tool_choice, and checks it compiles); None = unconstrained. Each engine
      that samples for the request follows it from the request's output so far.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None

    def __post_init__(self) -> None:
        self._validate_types()
        self._validate_lengths()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_stops()
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            _check_range("seed", self.seed, _SEED_MIN, _SEED_MAX)
        self._validate_constraints()

    def _validate_types(self) -> None:
        for name in ("max_tokens", "min_tokens", "top_k"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _type_error(name, "a boolean", getattr(self, name))
        for name in _FLOAT_FIELDS:
            # Ints are accepted for float fields (JSON `0` for temperature) and stored as float.
            object.__setattr__(self, name, _as_float(name, getattr(self, name)))
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_int_tuple(self.stop_token_ids))

    def _validate_lengths(self) -> None:
        if self.max_tokens < 1:
            _raise("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens, hi_name="max_tokens")

    def _validate_sampling(self) -> None:
        if self.temperature < 0:
            _raise("temperature", f"temperature must be at least 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _raise("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            _raise(
                "top_k", f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}"
            )
        if self.top_k > INT64_MAX:
            _raise("top_k", f"top_k must be at most {INT64_MAX}, got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)

    def _validate_penalties(self) -> None:
        if self.repetition_penalty <= 0:
            _raise(
                "repetition_penalty",
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, getattr(self, name), -PENALTY_LIMIT, PENALTY_LIMIT)

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            _raise(
                "stop",
                f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
            )
        chars = sum(len(s) for s in self.stop)
        if chars > MAX_STOP_CHARS:
            _raise(
                "stop",
                f"stop strings may hold at most {MAX_STOP_CHARS} characters in all, got {chars}",
            )
        for s in self.stop:
            if not s:
                _raise("stop", "stop strings must not be empty")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _raise(
                "stop_token_ids",
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}",
            )
        for t in self.stop_token_ids:
            if t < 0:
                _raise("stop_token_ids", f"stop_token_ids must be non-negative, got {t}")

    def _validate_constraints(self) -> None:
        bias = _as_logit_bias(self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)
        if len(bias) > MAX_LOGIT_BIAS:
            _raise(
                "logit_bias",
                f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
            )
        for token, value in bias:
            if token < 0:
                _raise("logit_bias", f"logit_bias token ids must be non-negative, got {token}")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                _raise(
                    "logit_bias",
                    f"logit_bias values must be between -100 and 100, got {value:g} for "
                    f"token {token}",
                )
        g = self.grammar
        if g is not None:
            if not isinstance(g, str):
                _type_error("grammar", "a string", g)
            if len(g) > MAX_GRAMMAR_CHARS:
                _raise(
                    "grammar",
                    f"a grammar may hold at most {MAX_GRAMMAR_CHARS} characters, got {len(g)}",
                )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a request body's sampling fields.

        Unknown keys are refused (`InvalidRequestError`, param = the key). A key whose value is
        None means "not given" and takes the default, as OpenAI clients send explicit nulls.
        """
        if not isinstance(d, Mapping):
            raise InvalidRequestError(
                f"sampling parameters must be an object, got {type(d).__name__}"
            )
        for key in d:
            if key not in _FIELD_NAMES:
                raise InvalidRequestError(f"unknown sampling parameter {key!r}", param=str(key))
        return cls(**{k: v for k, v in d.items() if v is not None})

    @property
    def greedy(self) -> bool:
        """True when the token is always the argmax (temperature == 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition / presence / frequency penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def constrained(self) -> bool:
        """True when a grammar or a logit bias shapes the distribution."""
        return self.grammar is not None or bool(self.logit_bias)

    def with_max_tokens(self, n: int) -> SamplingParams:
        """A copy with max_tokens = n (validated); min_tokens is lowered to n if above it.

        The engine uses this to cap a request to the space left in the context window.
        """
        return dataclasses.replace(self, max_tokens=n, min_tokens=min(self.min_tokens, n))


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _raise(param: str, message: str) -> NoReturn:
    raise InvalidRequestError(message, param=param)


def _type_error(param: str, expected: str, value: object) -> NoReturn:
    _raise(param, f"{param} must be {expected}, got {type(value).__name__}")


def _check_int(name: str, value: object) -> None:
    # bool is a subclass of int; `max_tokens=True` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        _type_error(name, "an integer", value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _type_error(name, "a number", value)
    f = float(value)
    if not math.isfinite(f):
        _raise(name, f"{name} must be a finite number, got {f}")
    return f


def _check_range(name: str, value: float, lo: float, hi: float, hi_name: str | None = None) -> None:
    if not lo <= value <= hi:
        upper = f"{hi_name} ({hi})" if hi_name else f"{hi}"
        _raise(name, f"{name} must be between {lo} and {upper}, got {value}")


def _as_str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return _as_tuple("stop", value, str, "a string or a list of strings")


def _as_int_tuple(value: object) -> tuple[int, ...]:
    return _as_tuple("stop_token_ids", value, int, "a list of integers")


def _as_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs from a mapping or pairs, ascending by id (one entry per id)."""
    if isinstance(value, Mapping):
        items: Any = list(value.items())
    elif isinstance(value, list | tuple):
        items = value
    else:
        _type_error("logit_bias", "a map of token ids to numbers", value)
    out: dict[int, float] = {}
    for pair in items:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            _raise("logit_bias", "logit_bias must map token ids to numbers")
        token, bias = pair
        _check_int("logit_bias", token)
        out[token] = _as_float("logit_bias", bias)
    return tuple(sorted(out.items()))


def _as_tuple(name: str, value: object, item_type: type, expected: str) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        _type_error(name, expected, value)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, item_type):
            _raise(name, f"{name} must be {expected}, got an item of type {type(item).__name__}")
    return tuple(value)
