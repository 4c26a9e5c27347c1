"""`LengthPredictor`: the core's participant that predicts each fresh prompt's output
length (TetriInfer §3.3.2) from the final hidden state of its last token, as the step
that samples its first token computed it (engine/length_head.py: the head itself).

The prediction rides on the request (`Request.prediction`) and reaches the front end with
the first token; a request that arrives with one (migrated, or prefilled elsewhere)
keeps it. `state_sink` (the predictor's data tool, pdserve/predictor/data.py) sees each
fresh prompt's state, with or without a head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.engine.length_head import LengthHead
from pdserve.engine.participant import Participant
from pdserve.engine.scheduler import ScheduledSeq

StateSink = Callable[[str, torch.Tensor], None]  # (request id, its prompt's final state)


class LengthPredictor(Participant):
    def __init__(self, head: LengthHead | None) -> None:
        self.head = head  # None: no predictions
        self.state_sink: StateSink | None = None

    def sampled(self, seqs: Sequence[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Predict for each fresh prompt sampling its first token (one small matmul on
        rows the step computed anyway)."""
        if self.head is None and self.state_sink is None:
            return
        rows = [
            i
            for i, s in enumerate(seqs)
            if s.request.prediction is None and not s.request.output_token_ids
        ]
        if not rows:
            return
        reqs = [seqs[i].request for i in rows]
        states = hidden[rows]
        if self.state_sink is not None:
            for req, state in zip(reqs, states, strict=True):
                self.state_sink(req.request_id, state)
        if self.head is not None:
            lens = [len(r.prompt_token_ids) for r in reqs]
            for req, pred in zip(reqs, self.head.predict(states, lens), strict=True):
                req.prediction = pred
