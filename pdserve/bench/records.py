"""One request as the client saw it: the load generator fills it, the metrics read it.

Times are seconds; `scheduled_at` and `sent_at` count from the start of the run,
the latencies from `sent_at` (the moment the request left the client).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    index: int
    """Position in the workload's arrival order."""
    session: int
    turn: int
    prompt_len: int
    """Prompt tokens as the server's tokenizer counts them (our tokenizer's count)."""
    output_len: int
    """Tokens asked for (max_tokens)."""
    scheduled_at: float
    """When the arrival process released it."""
    sent_at: float = math.nan
    lag: float = 0.0
    """sent_at less the moment it could go (arrival, previous turn done, free slot):
    the load generator's own delay."""
    success: bool = False
    error: str | None = None
    ttft: float | None = None
    """Until the first chunk carrying generated text."""
    e2e: float | None = None
    """Until the end of the stream ([DONE]); for a failure, until it failed."""
    itl: list[float] = field(default_factory=list)
    """Gaps between successive chunks carrying text."""
    output_tokens: int = 0
    """The server's usage.completion_tokens; else the number of text chunks."""
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """The server's usage.prompt_tokens_details.cached_tokens (prompt tokens served from
    its prefix cache); None when it does not report them."""
    server_timings: dict[str, float] | None = None
    """The server's own per-phase seconds (`pdserve_timings`) where it reports them."""

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1): None unless it succeeded with >= 2 tokens."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def fail(self, reason: str, elapsed: float) -> None:
        self.success = False
        self.error = reason
        self.e2e = elapsed

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "session": self.session,
            "turn": self.turn,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "scheduled_at_s": self.scheduled_at,
            "sent_at_s": None if math.isnan(self.sent_at) else self.sent_at,
            "lag_s": self.lag,
            "success": self.success,
            "error": self.error,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
            "itl_s": self.itl,
            "output_tokens": self.output_tokens,
            "server_prompt_tokens": self.server_prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "server_timings": self.server_timings,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        sent = d.get("sent_at_s")
        return cls(
            index=d["index"],
            session=d["session"],
            turn=d["turn"],
            prompt_len=d["prompt_len"],
            output_len=d["output_len"],
            scheduled_at=d["scheduled_at_s"],
            sent_at=math.nan if sent is None else sent,
            lag=d.get("lag_s", 0.0),
            success=d["success"],
            error=d.get("error"),
            ttft=d.get("ttft_s"),
            e2e=d.get("e2e_s"),
            itl=list(d.get("itl_s") or []),
            output_tokens=d.get("output_tokens", 0),
            server_prompt_tokens=d.get("server_prompt_tokens"),
            cached_tokens=d.get("cached_tokens"),
            server_timings=d.get("server_timings"),
        )
