"""An optional per-step trace of an engine: what each step ran and how long it took.

Set `PDSERVE_STEP_TRACE=<prefix>` and every engine process appends one JSON line per
step to `<prefix>.<instance name>.jsonl`:

    {"counts": [prompt tokens, attention units, prompts finishing, decode tokens,
                context tokens], "seconds": wall time of EngineCore.step,
     "start": time.perf_counter() when the step began}

`start` lets a reader see the engine loop's own time between two busy steps
(applying inputs, sending outputs), which `seconds` leaves out.

The counts are the latency model's (`planner/latency.py`): a prompt chunk of c tokens
after k computed adds (k + c)^2 - k^2 units; a decoding request attends over its
computed tokens + 1. `pdserve profile --from-trace` fits the model to these steps:
the times a serving engine really sees, with its HTTP front end and clients
sharing the machine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import IO, Any

ENV = "PDSERVE_STEP_TRACE"
Counts = tuple[int, int, int, int, int]


def step_composition(seqs: Sequence[Any]) -> Counts:
    """The latency model's counts of one scheduled step (before it runs)."""
    pt = units = finishing = dec = ctx = 0
    for s in seqs:
        req = s.request
        k, c = req.num_computed_tokens, s.num_new_tokens
        if k >= len(req.prompt_token_ids):
            dec += c
            ctx += k + 1
        else:
            pt += c
            units += (k + c) * (k + c) - k * k
            finishing += int(s.samples)
    return pt, units, finishing, dec, ctx


class StepObserver:
    """Wraps a scheduler's `schedule` so the last step's counts can be read."""

    def __init__(self, scheduler: Any) -> None:
        self.last: Counts = (0, 0, 0, 0, 0)
        inner: Callable[[], Any] = scheduler.schedule

        def observed() -> Any:
            out = inner()
            self.last = step_composition(out.seqs)
            return out

        scheduler.schedule = observed


class StepTrace:
    def __init__(self, scheduler: Any, path: str) -> None:
        self.observer = StepObserver(scheduler)
        self.file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)

    @classmethod
    def from_env(cls, scheduler: Any, instance: str) -> StepTrace | None:
        prefix = os.environ.get(ENV)
        return cls(scheduler, f"{prefix}.{instance}.jsonl") if prefix else None

    def record(self, start: float, seconds: float, steps: int = 1) -> None:
        """The step that began at `start`; `steps` > 1: a decode burst (engine/core.py)
        of that many steps, written as as many lines of equal shares, each step's
        decodes attending one token more than the last's."""
        pt, units, finishing, dec, ctx = self.observer.last
        if not any(self.observer.last):
            return
        share = seconds / steps
        for k in range(steps):
            counts = (pt, units, finishing, dec, ctx + k * dec)
            row = {"counts": counts, "seconds": share, "start": start + k * share}
            self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()
