"""What a workload is: sessions of turns, and the order in which requests arrive.

A plain request is a session of one turn. In a longer session, turn k's prompt is
the session's context, then every earlier turn's text and the server's actual
response to it, then turn k's text (MemServe §8.2: the recorded answers are
replaced by the generated ones); turn k is sent only after turn k-1's response has
returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Turn:
    text: str
    """The new user text of this turn (for a one-turn session: the whole prompt)."""
    num_tokens: int
    """Tokens of `text`: for a one-turn session the exact prompt length as the server
    counts it; inside a session the tokens this segment adds."""
    output_len: int
    """Tokens to generate (sent as max_tokens, with ignore_eos)."""


@dataclass(frozen=True)
class Session:
    id: int
    turns: tuple[Turn, ...]
    context: str = ""
    """Text before the first turn: a document, a shared few-shot prefix."""
    context_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    order: tuple[tuple[int, int], ...]
    """(session index, turn index) of every request, in arrival order; each session's
    turns appear in turn order."""
    unit_offsets: tuple[float, ...] | None = None
    """Arrival times at 1 request/s from a trace (None: drawn by the arrival process)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Where the workload's numbers come from; copied into the results file."""
    trace_rate: float | None = None
    """The trace's own mean rate (requests/s): what a run without a rate replays."""

    @property
    def num_requests(self) -> int:
        return len(self.order)

    def turn(self, index: int) -> Turn:
        s, t = self.order[index]
        return self.sessions[s].turns[t]


def single_turn_order(n: int) -> tuple[tuple[int, int], ...]:
    return tuple((i, 0) for i in range(n))


def interleave(
    sessions: tuple[Session, ...], rng: np.random.Generator
) -> tuple[tuple[int, int], ...]:
    """A uniformly random merge of the sessions' turn sequences (each kept in order):
    sessions overlap in time as in a real multi-user trace."""
    slots = np.repeat(np.arange(len(sessions)), [len(s.turns) for s in sessions])
    rng.shuffle(slots)
    next_turn = [0] * len(sessions)
    order = []
    for s in slots:
        order.append((int(s), next_turn[s]))
        next_turn[s] += 1
    return tuple(order)
