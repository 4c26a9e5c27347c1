"""`LengthPrediction`: how many tokens a request is predicted to generate (TetriInfer §3.3.2).

Made by the instance that prefills the request (the length head reads the prompt's last
hidden state, pdserve/predictor/), it rides on that request's first `EngineOutput`, the
controller keeps it for decode dispatch and its confusion counts, and `AddPrefilled` /
`AddRequest` carry it to the instance that decodes (admission). A prediction is a bucket
of output lengths, never a promise: a request runs past `high` like any other.
"""

from __future__ import annotations

import msgspec


class LengthPrediction(msgspec.Struct, frozen=True):
    bucket: int  # index: outputs of [bucket * width, (bucket + 1) * width) tokens
    low: int  # tokens, inclusive
    high: int | None  # tokens, exclusive; None for the last bucket (open-ended)

    @property
    def width(self) -> int | None:
        return None if self.high is None else self.high - self.low


def remaining_tokens(prediction: LengthPrediction | None, generated: int, max_left: int) -> int:
    """Tokens a request is predicted to generate still: up to its bucket's upper end,
    capped by what max_tokens leaves (`max_left`, the one bound that is certain). With no
    prediction, or an open last bucket, `max_left`. A request already past its bucket is
    given the next bucket of the same width. Always >= 1 while `max_left` >= 1."""
    if prediction is None or prediction.high is None:
        return max(max_left, 1)
    high = prediction.high
    if generated >= high:
        width = max(high - prediction.low, 1)
        high = (generated // width + 1) * width
    return max(1, min(max_left, high - generated))
