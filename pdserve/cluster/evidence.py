"""What the transition watcher's policies read and what they answer (cluster/watcher.py,
cluster/replanning.py): per-instance load snapshots, the requests finished over the
window, a flip or scaling decision or a reason to keep the placement.

Plain data and one container (`LoadHistory`); tests build histories by hand.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.config import Role


@dataclass(frozen=True)
class Served:
    """One request the cluster finished, as the window keeps it."""

    arrival: float  # monotonic
    finished: float  # monotonic
    prompt_len: int
    output_len: int
    ttft: float  # seconds, as the front end saw it
    tpot: float  # seconds per output token after the first (0 for one token)


@dataclass(frozen=True)
class ObservedWindow:
    """The requests that finished over the last `seconds` (their rate: the arrival
    rate of a steady workload; their lengths: the workload's shape)."""

    seconds: float
    requests: tuple[Served, ...]

    @property
    def rate(self) -> float:
        return len(self.requests) / self.seconds

    def attainment(self, ttft: float, tpot: float) -> float:
        """The fraction of the window's requests that met both SLOs."""
        met = sum(1 for r in self.requests if r.ttft <= ttft and r.tpot <= tpot)
        return met / len(self.requests) if self.requests else 1.0

    def trace_rows(self) -> list[dict[str, float | int]]:
        """The window as a JSONL trace (`pdserve plan --workload FILE` reads it)."""
        start = min((r.arrival for r in self.requests), default=0.0)
        return [
            {
                "input_len": r.prompt_len,
                "output_len": r.output_len,
                "arrival_time": r.arrival - start,
            }
            for r in sorted(self.requests, key=lambda r: r.arrival)
        ]


@dataclass(frozen=True)
class InstanceLoad:
    """One instance in one snapshot."""

    role: Role
    utilisation: float  # fraction of the interval its step loop spent in steps
    waiting: int  # requests queued there at the end of the interval


@dataclass(frozen=True)
class Snapshot:
    at: float  # monotonic
    loads: dict[str, InstanceLoad]  # by instance name

    def of_role(self, role: Role) -> dict[str, InstanceLoad]:
        return {name: load for name, load in self.loads.items() if load.role is role}


class LoadHistory:
    """The snapshots of the last `window_s` seconds, oldest first, and the last one
    before them (so that, snapshots being taken at jittered intervals, the evidence can
    span a whole window); the requests finished since the first of them."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.snapshots: deque[Snapshot] = deque()
        self.served: deque[Served] = deque()  # by finishing time

    def add(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)
        start = snapshot.at - self.window_s
        while len(self.snapshots) > 1 and self.snapshots[1].at <= start:
            self.snapshots.popleft()
        while self.served and self.served[0].finished < self.snapshots[0].at:
            self.served.popleft()

    def add_served(self, served: Served) -> None:
        if self.snapshots:  # evidence starts with the first snapshot
            self.served.append(served)

    def clear(self) -> None:
        self.snapshots.clear()
        self.served.clear()

    def copy(self) -> LoadHistory:
        twin = LoadHistory(self.window_s)
        twin.snapshots.extend(self.snapshots)
        twin.served.extend(self.served)
        return twin

    def window(self) -> ObservedWindow:
        """The requests finished over the history's span (`window_s` once it `covers`)."""
        span = self.snapshots[-1].at - self.snapshots[0].at if self.snapshots else 0.0
        return ObservedWindow(max(span, 1e-9), tuple(self.served))

    def mean_loads(self, role: Role) -> dict[str, float]:
        """The latest snapshot's instances of `role`, each with its mean utilisation over
        the snapshots that saw it."""
        out = {}
        for name in self.snapshots[-1].of_role(role) if self.snapshots else {}:
            seen = [s.loads[name].utilisation for s in self.snapshots if name in s.loads]
            out[name] = sum(seen) / len(seen)
        return out

    def covers(self, seconds: float) -> bool:
        """The snapshots span at least `seconds` (a whole window of evidence)."""
        return bool(self.snapshots) and (
            self.snapshots[-1].at - self.snapshots[0].at >= seconds - 1e-9
        )


@dataclass(frozen=True)
class FlipDecision:
    instance: str
    role: Role  # the role it flips to
    reason: str  # why, with the numbers
    numbers: dict[str, float] = field(default_factory=dict)

    @property
    def action(self) -> str:
        return "flip"


@dataclass(frozen=True)
class ScaleDecision:
    """Start one more instance of `role` (`instance` None), or remove `instance` (a
    `role` instance) after draining it (cluster/scaling.py)."""

    role: Role
    instance: str | None
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)

    @property
    def action(self) -> str:
        return "add" if self.instance is None else "remove"


Decision = FlipDecision | ScaleDecision


@dataclass(frozen=True)
class Keep:
    """A policy judged the window and keeps the placement: why, with the numbers."""

    reason: str
    numbers: dict[str, float] = field(default_factory=dict)


class FlipPolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def window_s(self) -> float:
        """The evidence it judges on: the history's span."""
        ...

    def decide(self, history: LoadHistory) -> Decision | Keep | None:
        """At most one flip (or one instance added or removed), from what the history
        shows; `Keep` with the reason when it judged and keeps the placement; None: not
        enough evidence to judge."""
        ...
