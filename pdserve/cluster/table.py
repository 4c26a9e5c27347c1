"""The request table: one `Record` per open request, keyed by the id its instances know
its current attempt by (docs/controller.md).

A record is what every part of the front end reads about a request: the hub
(`controller.Cluster`) creates it, dispatch fills in where it runs, and each feature keeps
its own fields on it (replication: the replica; caching: what the prompt trees predicted;
recovery: what a move recomputes). The load a request puts on its instances is credited
here and released exactly once (`unload`).

Single-threaded: the controller's event loop reads and writes every record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from pdserve.cluster.instance import Instance
from pdserve.cluster.routing import RouteKey
from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.timing import RequestTimes
from pdserve.text.outputs import RequestOutput

Item = RequestOutput | BaseException


def take_queued(
    first: RequestOutput, queue: asyncio.Queue[Item]
) -> tuple[RequestOutput, BaseException | None]:
    """`first` and the outputs already queued behind it, as one (`followed_by`): a
    consumer that fell behind - a slow client, a front end with more tokens than it
    turns into events - sends one event for them, as vLLM's API server does. An error
    found waiting is returned, to be raised after the output (the tokens that came
    before it reach the client first)."""
    out = first
    while not out.finished and not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, BaseException):
            return out, item
        out = out.followed_by(item)
    return out, None


class Phase(StrEnum):
    RESERVING = "reserving"  # push: waiting for the decode instance's blocks
    # Not sent yet: its prefill instance is receiving a copy of more of its prompt (its
    # own prefix fetch, or the return of the previous turn: cluster/cache_copies.py).
    WAITING_FOR_KV = "waiting-for-kv"
    PREFILL = "prefill"  # at the prefill (or colocated) instance
    HANDOFF = "handoff"  # first token out; KV on its way to the decode instance
    DECODE = "decode"  # KV in place; generating at the decode instance


@dataclass
class Record:
    """One row of the request table."""

    request_id: str  # the client's; instances see `key` (one per attempt)
    prompt: list[int]
    params: SamplingParams
    arrival: float
    queue: asyncio.Queue[Item]
    route: RouteKey  # what the router knows of it (cluster/routing.py)
    phase: Phase = Phase.PREFILL
    prefill: Instance | None = None  # holds (or will hold) something for this attempt
    decode: Instance | None = None
    # Instances whose assigned load counts this request (released exactly once).
    credit_prefill: Instance | None = None
    credit_decode: Instance | None = None
    credit_tokens: int = 0  # the prompt tokens `credit_prefill` has to compute
    heavy: bool = False  # `credit_decode` counts it as a heavy decode (cluster/policies.py)
    # What the prompt trees said the prefill instance (or a prefix fetch's donor) holds.
    predicted_cached: int = 0
    # PD-Caching-3: where its decode instance returns its KV when it finishes.
    return_to: Instance | None = None
    # Prompt tokens the instance that ran the prefill served from its cache (the
    # `cached_tokens` of the API), as its first output said; None before it.
    cached_tokens: int | None = None
    attempts: int = 0  # dispatches after the first (retries and migrations)
    migrations: int = 0
    drains: int = 0  # of the attempts: moves off an instance that flipped (cluster/flip.py)
    streamed: list[int] = field(default_factory=list)  # token ids forwarded to the client
    recompute: int = 0  # tokens a move sent to be computed again (counted on its output)
    # Replication (`config.replicate`): where this attempt's KV is replicated and how far
    # the holder acknowledged it (tokens of prompt + output).
    replica_source: Instance | None = None
    replica_holder: Instance | None = None
    replicated: int = 0
    # Its output length as predicted at the prefill (first output).
    prediction: LengthPrediction | None = None
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(self.arrival)

    @property
    def key(self) -> str:
        """The id instances know this attempt by: messages about an earlier attempt
        (stragglers) cannot be mistaken for the current one."""
        return self.request_id if self.attempts == 0 else f"{self.request_id}~move{self.attempts}"

    def holds(self, inst: Instance) -> bool:
        """`inst` holds (or will hold) something for this attempt."""
        return inst is self.prefill or inst is self.decode

    def forget_replica(self) -> None:
        self.replica_source = self.replica_holder = None
        self.replicated = 0

    def credit_prefill_to(self, inst: Instance, tokens: int) -> None:
        """`inst` prefills the attempt: `tokens` prompt tokens it has to compute."""
        self.prefill = self.credit_prefill = inst
        self.credit_tokens = tokens
        inst.assigned_prefill_tokens += tokens

    def credit_decode_to(self, inst: Instance, heavy: bool) -> None:
        """`inst` decodes the attempt (`heavy`: counted as a heavy decode there)."""
        self.decode = self.credit_decode = inst
        self.heavy = heavy
        inst.assigned_requests += 1
        inst.assigned_heavy += heavy

    def unload_prefill(self) -> None:
        if self.credit_prefill is not None:
            self.credit_prefill.assigned_prefill_tokens -= self.credit_tokens
            self.credit_prefill = None

    def unload(self) -> None:
        """Release every load credited for this attempt (each credit once)."""
        self.unload_prefill()
        if self.credit_decode is not None:
            self.credit_decode.assigned_requests -= 1
            self.credit_decode.assigned_heavy -= self.heavy
            self.credit_decode = None
            self.heavy = False


class RequestTable:
    """The open requests by their current attempt's key."""

    def __init__(self) -> None:
        self._records: dict[str, Record] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Record]:
        """A snapshot: the loop may add, re-key or remove records."""
        return iter(list(self._records.values()))

    def get(self, key: str) -> Record | None:
        return self._records.get(key)

    def add(self, rec: Record) -> None:
        self._records[rec.key] = rec

    def remove(self, rec: Record) -> None:
        self._records.pop(rec.key, None)

    def next_attempt(self, rec: Record, migration: bool, drain: bool = False) -> None:
        """Re-key `rec` for its next attempt (`migration`: its instance died; `drain`: it
        moves off an instance that flips)."""
        self.remove(rec)
        rec.attempts += 1
        rec.migrations += migration
        rec.drains += drain
        self.add(rec)

    def holding(self, inst: Instance) -> list[Record]:
        """The records `inst` holds something for."""
        return [r for r in self._records.values() if r.holds(inst)]
