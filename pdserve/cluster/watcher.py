"""The transition watcher: when to flip an instance, decided from the observed load
(TetriInfer §3.5: "flip an instance if its load has been under 10% for the past minute";
docs/elastic.md).

Every `--replan-interval` seconds the watcher takes a `Snapshot` of every live instance
that is not flipping: its role, its utilisation since the previous snapshot (the wall
time its step loop spent in steps over the time between two of its load reports,
`LoadReport.busy_s`: TetriInfer's resource usage; no new report since the last snapshot
means it is inside a long step: busy) and its queue. A `LoadHistory` keeps the
snapshots of the last window; a policy, chosen by name (`--flip-policy`), reads it and
may return one `FlipDecision`, which the watcher carries out through the flip feature
(cluster/flip.py). Every decision is logged with its reason and the numbers behind it
and kept (`decisions`: /debug/cluster).

Policies:

- `none` (the default): never flips.
- `tetriinfer`: an instance whose role has run under `idle_load` for a whole window of
  `idle_s` seconds - every snapshot of the window, every instance of the role - while the
  other role averaged at least `busy_load` over it (or kept requests queued in every
  snapshot) flips to the other role: the least loaded instance of the idle role, never
  its last one. After a flip the history starts again, so the next decision needs a
  whole new window of evidence: a steady workload never flips, and a shift is followed
  one flip per window, never back and forth within one.

The decision logic is pure (a policy reads a history; tests build histories by hand).
Single-threaded: the controller's event loop runs every method.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.flip import Flip
from pdserve.cluster.hub import Feature, Hub
from pdserve.cluster.instance import Instance
from pdserve.config import Role
from pdserve.errors import PdserveError
from pdserve.protocol.core import LoadReport

log = logging.getLogger("pdserve.watcher")


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
    span a whole window)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.snapshots: deque[Snapshot] = deque()

    def add(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)
        start = snapshot.at - self.window_s
        while len(self.snapshots) > 1 and self.snapshots[1].at <= start:
            self.snapshots.popleft()

    def clear(self) -> None:
        self.snapshots.clear()

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


class FlipPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def decide(self, history: LoadHistory) -> FlipDecision | None:
        """At most one flip, from what the history shows (None: keep the placement)."""
        ...


@dataclass(frozen=True)
class NoFlips:
    name: str = "none"

    def decide(self, history: LoadHistory) -> FlipDecision | None:
        return None


@dataclass(frozen=True)
class TetriInferPolicy:
    """Flip out of a role that idled a whole window while the other was saturated."""

    idle_load: float = 0.1
    idle_s: float = 60.0
    busy_load: float = 0.8
    name: str = "tetriinfer"

    def decide(self, history: LoadHistory) -> FlipDecision | None:
        if not history.covers(self.idle_s):
            return None
        window = list(history.snapshots)
        for role, other in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
            decision = self._out_of(role, other, window)
            if decision is not None:
                return decision
        return None

    def _out_of(self, role: Role, other: Role, window: Sequence[Snapshot]) -> FlipDecision | None:
        latest = window[-1].of_role(role)
        if len(latest) < 2:
            return None  # never its last instance
        peak = max((u.utilisation for s in window for u in s.of_role(role).values()), default=1)
        if peak >= self.idle_load:
            return None
        busy = [list(s.of_role(other).values()) for s in window]
        if not all(busy):
            return None
        mean = sum(sum(u.utilisation for u in s) / len(s) for s in busy) / len(busy)
        queued = all(any(u.waiting for u in s) for s in busy)
        if mean < self.busy_load and not queued:
            return None
        name = min(
            latest,
            key=lambda n: (sum(s.loads[n].utilisation for s in window if n in s.loads), n),
        )
        why = "queued requests in every snapshot" if queued else f"averaged {mean:.0%}"
        reason = (
            f"{name}: every {role} instance ran under {self.idle_load:.0%} for "
            f"{self.idle_s:g} s (peak {peak:.1%}) while the {other} instances {why}"
        )
        numbers = {"peak_idle_load": peak, "other_mean_load": mean, "window_s": self.idle_s}
        return FlipDecision(name, other, reason, numbers)


def make_policy(config: ClusterConfig) -> FlipPolicy:
    """The policy `config.flip_policy` names (one of FLIP_POLICIES, checked there)."""
    if config.flip_policy == "tetriinfer":
        return TetriInferPolicy(config.flip_idle_load, config.flip_idle_s, config.flip_busy_load)
    return NoFlips()


@dataclass(frozen=True)
class Decided:
    """A decision the watcher carried out, and how it went."""

    at: float  # time.time()
    decision: FlipDecision
    flipped: bool
    outcome: str  # "flipped in N ms (M moved)", or why the flip failed


class Watcher(Feature):
    """Snapshots every `interval_s`, the policy's decisions carried out (module doc)."""

    def __init__(
        self,
        hub: Hub,
        flip: Flip,
        policy: FlipPolicy,
        interval_s: float,
        window_s: float,
    ) -> None:
        self.hub = hub
        self.flip = flip
        self.policy = policy
        self.interval_s = interval_s
        self.history = LoadHistory(window_s)
        self.decisions: list[Decided] = []
        self._next = time.monotonic() + interval_s
        self._seen: dict[str, tuple[float, float]] = {}  # name -> (sent_at, busy_s)
        self._acting: asyncio.Task[None] | None = None

    def tick(self, now: float) -> None:
        if now < self._next:
            return
        self._next = now + self.interval_s
        snapshot = self._snapshot(now)
        if self._acting is not None or not snapshot.loads:
            return  # a flip in flight (it clears the history when done), or nothing heard
        self.history.add(snapshot)
        decision = self.policy.decide(self.history)
        if decision is not None:
            log.info("flip: %s -> %s: %s", decision.instance, decision.role, decision.reason)
            self._acting = asyncio.create_task(self._carry_out(decision))

    def summary(self) -> dict[str, object]:
        """/debug/cluster's `elastic`: the policy, every flip done (by hand or decided)
        and every decision with its reason, numbers and outcome."""
        return {
            "policy": self.policy.name,
            "flips": [r.as_dict() for r in self.flip.reports],
            "decisions": [
                {
                    "at": d.at,
                    "instance": d.decision.instance,
                    "role": str(d.decision.role),
                    "reason": d.decision.reason,
                    "numbers": d.decision.numbers,
                    "flipped": d.flipped,
                    "outcome": d.outcome,
                }
                for d in self.decisions
            ],
        }

    def instance_dead(self, inst: Instance) -> None:
        """A plan that counted it is void: the evidence starts again."""
        self.history.clear()
        self._seen.pop(inst.name, None)

    async def close(self) -> None:
        if self._acting is not None:
            self._acting.cancel()

    def _snapshot(self, now: float) -> Snapshot:
        loads = {}
        for inst in self.hub.instances:
            report = inst.report
            if report is None or not inst.alive or inst.flipping_to is not None:
                continue
            load = utilisation(self._seen.get(inst.name), report)
            self._seen[inst.name] = (report.sent_at, report.busy_s)
            if load is not None:
                loads[inst.name] = InstanceLoad(inst.role, load, report.num_waiting)
        return Snapshot(now, loads)

    async def _carry_out(self, decision: FlipDecision) -> None:
        try:
            report = await self.flip.flip(decision.instance, decision.role)
            flipped = True
            outcome = f"flipped in {report.total_s * 1000:.0f} ms ({report.moved} moved)"
        except PdserveError as e:
            flipped, outcome = False, f"not flipped: {e}"
        log.info("flip of %s to %s: %s", decision.instance, decision.role, outcome)
        self.decisions.append(Decided(time.time(), decision, flipped, outcome))
        self.history.clear()  # the next decision needs a whole window after this one
        self._seen.clear()
        self._acting = None


def utilisation(previous: tuple[float, float] | None, report: LoadReport) -> float | None:
    """The fraction of the time between two load reports the instance spent in steps;
    None without an earlier report. The same report again means the instance sent none
    since: it reports between steps (and every `report_interval_s` when idle), so it has
    been inside one step all along - busy (its heartbeats say it lives)."""
    if previous is None:
        return None
    sent_at, busy_s = previous
    if report.sent_at <= sent_at:
        return 1.0
    return min(1.0, max(0.0, (report.busy_s - busy_s) / (report.sent_at - sent_at)))
