"""One run: a workload sent to one server at one rate, open loop.

Every session is a task that sleeps until each of its requests' arrival time, waits
for its previous turn (the causal rule of MemServe §8.2) and for a free slot under
--max-concurrency, then sends. Bodies of one-turn requests are built before the
clock starts; a later turn's body needs the previous answer and is built at its
send time (that cost is in the record's `lag`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from pdserve.bench import client
from pdserve.bench.config import RequestOptions, Target
from pdserve.bench.records import RequestRecord
from pdserve.bench.tokens import PromptFactory
from pdserve.bench.workloads.spec import Session, Workload


@dataclass(frozen=True)
class RunSettings:
    target: Target
    model: str | None
    options: RequestOptions
    max_concurrency: int | None
    seed: int = 0
    """Names the sessions: every request carries `X-Session-Id: bench-SEED-SESSION`."""


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    t0: float
    """time.perf_counter() at the start: records' times are relative to it."""
    duration_s: float
    """From the start to the end of the last request."""


class _Prompts:
    """Prompt text or chat messages of a session's turn, and its length in tokens."""

    def __init__(self, factory: PromptFactory | None, chat: bool) -> None:
        self.factory, self.chat = factory, chat

    def build(self, s: Session, k: int, answers: list[str]) -> tuple[Any, int]:
        if len(s.turns) == 1 and not s.context and not self.chat:
            return s.turns[0].text, s.turns[0].num_tokens
        if self.factory is None:
            raise ValueError("sessions and chat prompts need a tokenizer to count tokens")
        if self.chat:
            messages = self._messages(s, k, answers)
            return messages, self.factory.count_chat(messages)
        history = "".join(t.text + a for t, a in zip(s.turns[:k], answers, strict=True))
        text = s.context + history + s.turns[k].text
        return text, self.factory.count(text)

    @staticmethod
    def _messages(s: Session, k: int, answers: list[str]) -> list[dict[str, str]]:
        out = []
        for i in range(k + 1):
            user = (s.context if i == 0 else "") + s.turns[i].text
            out.append({"role": "user", "content": user})
            if i < k:
                out.append({"role": "assistant", "content": answers[i]})
        return out


async def run_workload(
    workload: Workload,
    offsets: np.ndarray,
    settings: RunSettings,
    factory: PromptFactory | None,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
) -> RunOutcome:
    prompts = _Prompts(factory, settings.target.endpoint == "/v1/chat/completions")
    records = [_record(workload, i, float(offsets[i])) for i in range(workload.num_requests)]
    ready = {i: _prebuilt(workload, i, prompts, settings) for i in _one_turn(workload)}
    for i, (_, n) in ready.items():
        records[i].prompt_len = n
    by_session: dict[int, list[int]] = {}
    for i, (s, _) in enumerate(workload.order):
        by_session.setdefault(s, []).append(i)
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    async with client.new_session(settings.max_concurrency) as http:
        t0 = time.perf_counter()
        run = _SessionRunner(workload, records, settings, prompts, ready, http, t0, slots, on_done)
        await asyncio.gather(*(run.session(s, idx) for s, idx in by_session.items()))
    end = max(
        (r.sent_at + (r.e2e or 0.0) for r in records if not math.isnan(r.sent_at)), default=0.0
    )
    return RunOutcome(records, t0, end)


def _record(w: Workload, i: int, scheduled: float) -> RequestRecord:
    s, t = w.order[i]
    turn = w.sessions[s].turns[t]
    return RequestRecord(i, s, t, turn.num_tokens, turn.output_len, scheduled)


def _one_turn(w: Workload) -> list[int]:
    return [i for i, (s, _) in enumerate(w.order) if len(w.sessions[s].turns) == 1]


def _prebuilt(w: Workload, i: int, prompts: _Prompts, st: RunSettings) -> tuple[bytes, int]:
    s, t = w.order[i]
    prompt, n = prompts.build(w.sessions[s], t, [])
    return client.request_body(st.target, st.model, prompt, w.turn(i).output_len, st.options), n


class _SessionRunner:
    def __init__(
        self,
        workload: Workload,
        records: list[RequestRecord],
        settings: RunSettings,
        prompts: _Prompts,
        ready: dict[int, tuple[bytes, int]],
        http: aiohttp.ClientSession,
        t0: float,
        slots: asyncio.Semaphore | None,
        on_done: Callable[[RequestRecord], None],
    ) -> None:
        self.w, self.records, self.st, self.prompts = workload, records, settings, prompts
        self.ready, self.http, self.t0, self.slots, self.on_done = ready, http, t0, slots, on_done

    async def session(self, sid: int, indices: list[int]) -> None:
        answers: list[str] = []
        previous_done = 0.0
        for k, i in enumerate(indices):
            rec = self.records[i]
            due = self.t0 + rec.scheduled_at
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            answers.append(await self._send(sid, k, i, rec, answers, max(due, previous_done)))
            previous_done = time.perf_counter()
            self.on_done(rec)

    async def _send(
        self, sid: int, k: int, i: int, rec: RequestRecord, answers: list[str], eligible: float
    ) -> str:
        if self.slots is not None:
            if self.slots.locked():
                await self.slots.acquire()
                eligible = time.perf_counter()
            else:
                await self.slots.acquire()
        try:
            body = self._body(sid, k, i, rec, answers)
            rec.lag = max(0.0, time.perf_counter() - eligible)
            timeout, session_id = self.st.options.timeout_s, f"bench-{self.st.seed}-{sid}"
            return await client.send(
                self.http, self.st.target, body, rec, self.t0, timeout, session_id
            )
        finally:
            if self.slots is not None:
                self.slots.release()

    def _body(self, sid: int, k: int, i: int, rec: RequestRecord, answers: list[str]) -> bytes:
        if i in self.ready:
            return self.ready[i][0]
        prompt, n = self.prompts.build(self.w.sessions[sid], k, answers)
        rec.prompt_len = n
        opts = self.st.options
        return client.request_body(self.st.target, self.st.model, prompt, rec.output_len, opts)
