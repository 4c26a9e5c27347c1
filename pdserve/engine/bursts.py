"""Decode bursts: several greedy decode steps in one compiled call.

A step of greedy decodes alone can run up to `decode_burst` steps without returning to
Python (the model runner's `execute_burst`: the fused forward, argmax and the stop check
in C). `DecodeBursts` decides how many a step may run and keeps the figures that size
them; the core (engine/core.py) runs the burst and commits its tokens one step at a time,
as single steps would.

A step is not a burst (`plan` returns 0) when: bursts are off (`decode_burst` 1), the
step swaps or is empty, anything waits or is swapped out, the runner has no compiled
path, a participant wants every step (the prefill role's per-layer hooks, replication),
KV moves are in flight, a row is not a plain greedy decode (sampling, penalties,
logprobs, its first token). Otherwise it runs up to `decode_burst` steps, no more than
any row has left before its length limit and as many as fit `decode_burst_ms` at the
last decode step's time for this batch size (1 until one was timed; 1, the rows not
looked at, when two steps do not fit: at b=64 a row's checks cost ~0.1 ms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import msgspec

from pdserve.config import SchedulerConfig
from pdserve.engine.sampler import SamplingRow, is_plain_greedy
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.protocol.core import EngineOutput


class DecodeBursts:
    """How many steps a step may run, and the step counters (see the module doc)."""

    def __init__(self, config: SchedulerConfig, max_model_len: int, eos: frozenset[int]) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos = eos
        self.last_steps = 1  # forward steps the last `EngineCore.step` ran
        self.num_steps = 0  # since start: forward steps run (a burst's one by one)
        self.num_burst_steps = 0  # since start: those that ran inside bursts
        self._step_s: dict[int, float] = {}  # the last decode step's time per batch size

    def plan(
        self,
        sched: SchedulerOutput,
        quiet: bool,
        row: Callable[[ScheduledSeq], SamplingRow],
    ) -> int:
        """Steps `sched` may run as one burst: 0 when it cannot be one, else >= 1 (1: a
        single step that is timed for the next). `quiet`: nothing waits or is swapped
        out, the runner has a compiled path, no participant wants every step and no KV
        moves; `row(seq)` is a row's sampling state."""
        cfg = self.config
        if cfg.decode_burst == 1 or sched.empty or sched.swap_in or sched.swap_out or not quiet:
            return 0
        timed = self._step_s.get(len(sched.seqs))
        if timed is not None and cfg.decode_burst_ms / 1000 / timed < 2:
            return 1  # no burst fits this batch size (its rows go unchecked); still timed
        steps = cfg.decode_burst
        for s in sched.seqs:
            req = s.request
            if s.num_new_tokens != 1 or not s.samples or not req.output_token_ids:
                return 0
            if not is_plain_greedy(row(s)):
                return 0
            left = min(
                req.params.max_tokens - len(req.output_token_ids),
                self.max_model_len - req.num_tokens,
            )
            steps = min(steps, left)
        if timed is None:
            return 1
        return max(1, min(steps, int(cfg.decode_burst_ms / 1000 / timed)))

    def stepped(self, empty: bool) -> None:
        """A single step ran (`empty`: nothing was scheduled)."""
        self.last_steps = 1
        self.num_steps += not empty

    def burst_ran(self, steps: int) -> None:
        """A burst ran `steps` forward steps."""
        self.last_steps = steps
        self.num_steps += steps
        self.num_burst_steps += steps

    def timed(self, batch: int, seconds: float) -> None:
        """A decode step of `batch` rows a burst could have taken (`plan` >= 1) took
        `seconds` per forward step: what sizes the next burst of this batch size."""
        self._step_s[batch] = seconds

    def stop_ids(self, seqs: Iterable[ScheduledSeq]) -> set[int]:
        """Every token that ends one of `seqs` (EOS unless ignored, its stop ids)."""
        stop: set[int] = set()
        for s in seqs:
            p = s.request.params
            stop.update(p.stop_token_ids)
            if not p.ignore_eos:
                stop.update(self.eos)
        return stop


def merged(outputs: Sequence[EngineOutput]) -> EngineOutput:
    """One request's outputs of a burst's steps as one: all their tokens, the last's state
    (only the last can have finished; none is a first token, so none has a prediction)."""
    if len(outputs) == 1:
        return outputs[0]
    tokens = tuple(t for out in outputs for t in out.new_tokens)
    return msgspec.structs.replace(outputs[-1], new_tokens=tokens)
