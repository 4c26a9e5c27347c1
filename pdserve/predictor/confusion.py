"""`PredictionCounters`: the front end's record of length predictions against the truth.

Counted when a request finishes on its own (EOS or a stop token / string): its real
output length is then known. A request cut by max_tokens (or the context) only says its
length was at least that: it is counted as `truncated`, not in the matrix. Aborted and
failed requests are not counted.
"""

from __future__ import annotations

from pdserve.engine.head_spec import HeadSpec
from pdserve.protocol.prediction import LengthPrediction


class PredictionCounters:
    def __init__(self, spec: HeadSpec | None) -> None:
        self.spec = spec
        n = spec.num_buckets if spec is not None else 0
        self.confusion = [[0] * n for _ in range(n)]  # [predicted][actual]
        self.truncated = 0
        self.unpredicted = 0  # finished with no prediction (e.g. prefilled before a move)

    def observe(self, prediction: LengthPrediction | None, num_tokens: int, reason: str) -> None:
        """A finished request: its prediction, output tokens and finish reason."""
        if self.spec is None or reason == "abort":
            return
        if prediction is None:
            self.unpredicted += 1
        elif reason == "length":
            self.truncated += 1
        else:
            self.confusion[prediction.bucket][self.spec.bucket(num_tokens)] += 1

    @property
    def num_counted(self) -> int:
        return sum(map(sum, self.confusion))

    @property
    def accuracy(self) -> float | None:
        """The fraction predicted in the right bucket; None before any is counted."""
        n = self.num_counted
        return sum(self.confusion[i][i] for i in range(len(self.confusion))) / n if n else None

    def summary(self) -> dict[str, object]:
        """For /debug/cluster."""
        if self.spec is None:
            return {"predictor": None}
        return {
            "granularity": self.spec.granularity,
            "num_buckets": self.spec.num_buckets,
            "counted": self.num_counted,
            "accuracy": self.accuracy,
            "truncated": self.truncated,
            "unpredicted": self.unpredicted,
            "confusion": self.confusion,
        }
