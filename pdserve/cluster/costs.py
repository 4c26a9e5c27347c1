"""The recovery cost rule (DéjàVu §4.3; docs/fault-tolerance.md).

At failure time, per request, resuming from a replica of `through` tokens
costs copying them (bytes over the measured copy bandwidth) plus recomputing the rest;
migrating by recompute costs prefilling every token (over the measured prefill rate).
Both rates are measured while serving (prefill: prompt tokens over prefill time of
finished prefills; copy: bytes over time of finished KV transfers), with defaults
measured on a 2-core CPU machine until the first measurements arrive.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rate:
    """An exponentially weighted mean of a rate (amount per second)."""

    value: float
    weight: float = 0.2

    def observe(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self.value += self.weight * (amount / seconds - self.value)


@dataclass
class CostChoice:
    """One request's recovery decision and the numbers behind it."""

    resume: bool
    through: int  # tokens the replica holds
    total: int  # tokens whose KV the request needs (prompt + streamed - 1)
    resume_s: float
    recompute_s: float

    def describe(self) -> str:
        way = "resume from replica" if self.resume else "recompute"
        return (
            f"{way}: replica {self.through}/{self.total} tokens -> copy + recompute "
            f"{self.resume_s * 1e3:.1f} ms vs recompute all {self.recompute_s * 1e3:.1f} ms"
        )


class RecoveryCost:
    """The latency model of the two ways back (module docstring)."""

    def __init__(self, prefill_tokens_per_s: float = 2500.0, copy_bytes_per_s: float = 2e9) -> None:
        self.prefill = Rate(prefill_tokens_per_s)
        self.copy = Rate(copy_bytes_per_s)

    def choose(self, through: int, total: int, token_bytes: int) -> CostChoice:
        """`token_bytes`: the KV of one token, every layer, K and V."""
        resume_s = through * token_bytes / self.copy.value + (total - through) / self.prefill.value
        recompute_s = total / self.prefill.value
        resume = through > 0 and resume_s < recompute_s
        return CostChoice(resume, through, total, resume_s, recompute_s)
