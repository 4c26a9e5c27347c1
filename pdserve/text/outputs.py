"""What a request's caller receives (from `Engine`, `LLM` or the front end), each step and
at the end."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.timing import RequestMetrics


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """Cumulative state of a request plus what is new since its previous output."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    extra: dict[str, float] = field(default_factory=dict)
    # The output length predicted at its prefill (protocol/prediction.py); None: none.
    prediction: LengthPrediction | None = None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and `later`, the next of the same request, as one: `later`'s
        state (text, token ids, logprobs, finish) with both deltas. Renderers slice a
        delta's logprobs off the end by its length, so the merged one renders both."""
        return replace(
            later,
            delta_text=self.delta_text + later.delta_text,
            delta_token_ids=self.delta_token_ids + later.delta_token_ids,
        )
