"""`sessions`: multi-turn workloads whose prompts carry the earlier turns (MemServe §8.2).

- chat: ShareGPT-style conversations; each user message and answer ShareGPT-shaped.
- docqa: LooGLE-style document QA: one 1,000-token document per session and five
  questions about it (MemServe keeps "the first 1k tokens of the document and the
  first five associated questions"); short answers.
- react: ReAct-style agent traces: one two-shot example prefix shared by every
  session, a question, then thought/action steps (long generations) each followed
  by an observation.

A session ends early rather than outgrow a 2,048-token context (with a margin for
the chat template and for re-tokenized answers). `share_ratio` K sends every drawn
session K times as distinct sessions (same context and questions; MemServe Fig. 14
"duplicating this set of sessions"); `session_turns` fixes the number of turns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pdserve.bench.config import BenchInputError
from pdserve.bench.tokens import PromptFactory
from pdserve.bench.workloads.options import WorkloadOptions
from pdserve.bench.workloads.spec import Session, Turn, Workload, interleave
from pdserve.workload.lengths import LengthDist

CONTEXT_BUDGET = 1800
"""Tokens a session's last prompt plus its output may reach (2,048 less a margin)."""


@dataclass(frozen=True)
class SessionStyle:
    turns: LengthDist
    first_user: LengthDist
    """Tokens of the first turn's text (the question/message after the context)."""
    user: LengthDist
    """Tokens of each later turn's text (a message, a question, an observation)."""
    output: LengthDist
    context_tokens: int
    shared_context: bool
    """One context for every session (a few-shot prefix) or one per session (a document)."""
    source: str


STYLES: dict[str, SessionStyle] = {
    "chat": SessionStyle(
        turns=LengthDist(2, 6),
        first_user=LengthDist.lognormal(70, 1.0, 4, 512),
        user=LengthDist.lognormal(40, 1.0, 4, 256),
        output=LengthDist.lognormal(128, 0.8, 4, 512),
        context_tokens=0,
        shared_context=False,
        source="ShareGPT conversations (MemServe §8.2); ShareGPT-shaped messages and "
        "answers (median answer 128, TetriInfer §5); 2-6 turns (our choice)",
    ),
    "docqa": SessionStyle(
        turns=LengthDist.fixed(5),
        first_user=LengthDist.lognormal(20, 0.5, 5, 80),
        user=LengthDist.lognormal(20, 0.5, 5, 80),
        output=LengthDist.lognormal(16, 0.8, 2, 128),
        context_tokens=1000,
        shared_context=False,
        source="LooGLE (MemServe §8.2): first 1k tokens of a document, its first five "
        "questions; long prompts, short answers (question/answer lengths our estimate)",
    ),
    "react": SessionStyle(
        turns=LengthDist(3, 6),
        first_user=LengthDist.lognormal(30, 0.4, 8, 80),
        user=LengthDist.lognormal(60, 0.6, 10, 200),
        output=LengthDist.lognormal(80, 0.5, 16, 256),
        context_tokens=800,
        shared_context=True,
        source="ReAct on HotpotQA (MemServe §8.2): a long two-shot example in every "
        "prompt, relatively long generations; 800-token prefix, 3-6 steps (our estimate)",
    ),
}


def sessions_workload(opts: WorkloadOptions, factory: PromptFactory) -> Workload:
    style = STYLES.get(opts.session_style)
    if style is None:
        raise BenchInputError(
            f"unknown --session-style {opts.session_style!r}; choose from {', '.join(STYLES)}"
        )
    if opts.share_ratio < 1:
        raise BenchInputError(f"--share-ratio must be >= 1, got {opts.share_ratio}")
    if opts.session_turns is not None:
        if opts.session_turns < 1:
            raise BenchInputError(f"--session-turns must be >= 1, got {opts.session_turns}")
        style = replace(style, turns=LengthDist.fixed(opts.session_turns))
    rng = np.random.default_rng(opts.seed)
    shared = factory.words(rng, style.context_tokens) if style.shared_context else ""
    sessions: list[Session] = []
    remaining = opts.num_prompts
    while remaining > 0:
        context = shared if style.shared_context else factory.words(rng, style.context_tokens)
        k = opts.share_ratio  # copies: same context and turns, each its own session
        drawn = _session(len(sessions), style, context, factory, rng, -(-remaining // k))
        for _ in range(k):
            turns = drawn.turns[:remaining]
            if not turns:
                break
            sessions.append(Session(len(sessions), turns, drawn.context, drawn.context_tokens))
            remaining -= len(turns)
    params = {
        "style": opts.session_style,
        "share_ratio": opts.share_ratio,
        "turns": style.turns.describe(),
        "context_tokens": style.context_tokens,
        "shared_context": style.shared_context,
        "user": style.user.describe(),
        "output": style.output.describe(),
        "source": style.source,
    }
    frozen = tuple(sessions)
    return Workload("sessions", frozen, interleave(frozen, rng), None, params)


def _session(
    sid: int,
    style: SessionStyle,
    context: str,
    factory: PromptFactory,
    rng: np.random.Generator,
    limit: int,
) -> Session:
    wanted = min(style.turns.sample(rng, 1)[0], limit)
    total = style.context_tokens
    turns: list[Turn] = []
    for k in range(wanted):
        n = (style.first_user if k == 0 else style.user).sample(rng, 1)[0]
        out = style.output.sample(rng, 1)[0]
        if turns and total + n + out > CONTEXT_BUDGET:
            break
        turns.append(Turn(factory.words(rng, n), n, out))
        total += n + out
    return Session(sid, tuple(turns), context, style.context_tokens)
