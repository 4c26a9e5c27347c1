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
(cluster/flip.py), or a `Keep` saying why it keeps the placement. The history also holds
the requests finished over the window (`Served`: the workload the `distserve` policy
replans for). Every decision is logged with its reason and the numbers behind it and
kept (`decisions`, `last_keep`: /debug/cluster and Prometheus).

Policies:

- `none` (the default): never flips.
- `tetriinfer`: an instance whose role has run under `idle_load` for a whole window of
  `idle_s` seconds - every snapshot of the window, every instance of the role - while the
  other role averaged at least `busy_load` over it (or kept requests queued in every
  snapshot) flips to the other role: the least loaded instance of the idle role, never
  its last one. After a flip the history starts again, so the next decision needs a
  whole new window of evidence: a steady workload never flips, and a shift is followed
  one flip per window, never back and forth within one.
- `distserve`: the planner's search on the window's workload and this machine's
  profile; a flip toward its best prefill:decode split when that gains enough
  (cluster/replanning.py).

The decision logic is pure (a policy reads a history; tests build histories by hand). A
policy decides on a worker thread (the planner simulates), on a copy of the history; the
controller's event loop runs every method of the watcher itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.cluster.evidence import (
    Decision,
    FlipDecision,
    FlipPolicy,
    InstanceLoad,
    Keep,
    LoadHistory,
    ScaleDecision,
    Served,
    Snapshot,
)
from pdserve.cluster.flip import Flip
from pdserve.cluster.hub import Feature, Hub
from pdserve.cluster.instance import Instance
from pdserve.cluster.scaling import Scaling
from pdserve.cluster.table import Record
from pdserve.config import Role
from pdserve.errors import PdserveError
from pdserve.protocol.core import LoadReport

log = logging.getLogger("pdserve.watcher")


@dataclass(frozen=True)
class NoFlips:
    name: str = "none"
    window_s: float = 60.0

    def decide(self, history: LoadHistory) -> FlipDecision | Keep | None:
        return None


@dataclass(frozen=True)
class TetriInferPolicy:
    """Flip out of a role that idled a whole window while the other was saturated."""

    idle_load: float = 0.1
    idle_s: float = 60.0
    busy_load: float = 0.8
    name: str = "tetriinfer"

    @property
    def window_s(self) -> float:
        return self.idle_s

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


@dataclass(frozen=True)
class Decided:
    """A decision the watcher carried out, and how it went."""

    at: float  # time.time()
    decision: Decision
    flipped: bool  # it was carried out (flipped, added, removed)
    outcome: str  # "flipped in N ms (M moved)", "added decode-2 in S s", or why not


class Watcher(Feature):
    """Snapshots every `interval_s`, the policy's decisions carried out (module doc)."""

    def __init__(
        self,
        hub: Hub,
        flip: Flip,
        scaling: Scaling,
        policy: FlipPolicy,
        interval_s: float,
    ) -> None:
        self.hub = hub
        self.flip = flip
        self.scaling = scaling
        self.policy = policy
        self.interval_s = interval_s
        self.history = LoadHistory(policy.window_s)
        self.decisions: list[Decided] = []
        self.last_keep: tuple[float, Keep] | None = None  # (time.time(), the verdict)
        self.kept = 0  # Keep verdicts so far
        self.last_numbers: dict[str, float] = {}  # the latest verdict's, flip or keep
        self._deaths = 0  # instances seen to die: a verdict judged before one is void
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
        self._acting = asyncio.create_task(self._decide(self.history.copy(), self._deaths))

    def finished(self, rec: Record, inst: Instance, clean: bool) -> None:
        times = rec.times
        if times.first_token_seen is None:
            return
        now = time.monotonic()
        tokens = len(rec.streamed)
        tpot = (now - times.first_token_seen) / (tokens - 1) if tokens > 1 else 0.0
        served = Served(
            rec.arrival,
            now,
            len(rec.prompt),
            max(tokens, 1),
            times.first_token_seen - rec.arrival,
            tpot,
        )
        self.history.add_served(served)

    def summary(self) -> dict[str, object]:
        """/debug/cluster's `elastic`: the policy, every flip done (by hand or decided)
        and every decision with its reason, numbers and outcome."""
        return {
            "policy": self.policy.name,
            "flips": [r.as_dict() for r in self.flip.reports],
            "last_keep": None
            if self.last_keep is None
            else {
                "at": self.last_keep[0],
                "reason": self.last_keep[1].reason,
                "numbers": self.last_keep[1].numbers,
            },
            "scaling": [r.as_dict() for r in self.scaling.reports],
            "decisions": [
                {
                    "at": d.at,
                    "action": d.decision.action,
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
        self._deaths += 1
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

    async def _decide(self, history: LoadHistory, deaths: int) -> None:
        try:
            verdict = await asyncio.to_thread(self.policy.decide, history)
        except Exception:
            log.exception("the %s policy failed; the placement stays", self.policy.name)
            verdict = None
        if deaths != self._deaths:
            verdict = None  # it counted an instance that has died since
        if verdict is not None:
            self.last_numbers = verdict.numbers
        if isinstance(verdict, FlipDecision | ScaleDecision):
            what = (verdict.action, verdict.instance, verdict.role, verdict.reason)
            log.info("%s %s (%s): %s", *what)
            await self._carry_out(verdict)
            return
        if isinstance(verdict, Keep):  # every look: shown, counted, not logged at INFO
            log.debug("placement kept: %s", verdict.reason)
            self.last_keep = (time.time(), verdict)
            self.kept += 1
        self._acting = None

    async def _carry_out(self, decision: Decision) -> None:
        try:
            outcome = await self._act(decision)
            flipped = True
        except PdserveError as e:
            flipped, outcome = False, f"not done: {e}"
        log.info("%s %s (%s): %s", decision.action, decision.instance, decision.role, outcome)
        self.decisions.append(Decided(time.time(), decision, flipped, outcome))
        self.history.clear()  # the next decision needs a whole window after this one
        self._seen.clear()
        self._acting = None

    async def _act(self, decision: Decision) -> str:
        """Carry `decision` out; what happened (PdserveError: it was refused or failed)."""
        if isinstance(decision, FlipDecision):
            flip = await self.flip.flip(decision.instance, decision.role)
            return f"flipped in {flip.total_s * 1000:.0f} ms ({flip.moved} moved)"
        if decision.instance is None:
            added = await self.scaling.add(decision.role)
            return f"added {added.instance} in {added.seconds:.1f} s"
        removed = await self.scaling.remove(decision.instance)
        return f"removed in {removed.seconds * 1000:.0f} ms ({removed.moved} moved)"


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
