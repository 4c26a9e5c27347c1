"""The `distserve` flip policy: replanning that acts (DistServe §4.4; docs/elastic.md).

Every `--replan-interval` the watcher hands this policy what the cluster served over the
last `--replan-window` seconds (`ObservedWindow`: each finished request's arrival,
prompt and output lengths, TTFT and TPOT) and the roles it runs. The policy asks a
`SplitPlanner` - the planner's search on this machine's measured profile
(planner/replan.py; the controller cannot import the planner, which sits above it, so
the entry point hands one in) - how many requests per second one prefill and one decode
instance serve within the SLOs on that workload (DistServe's per-instance goodput), and
how many of each the observed rate needs. From that:

- a split of n instances, p prefill and n - p decode, serves min(p * g_prefill,
  (n - p) * g_decode) requests/s within the SLOs (the planner's model: replicas of a
  phase add their goodput);
- no split of n that gives each phase what the planner says the rate needs: keep the
  placement, and say so (a workload no split can serve);
- the best split serves the rate with the most headroom; when it is not the running
  one and its predicted goodput beats the running split's by more than `gain`, flip one
  instance toward it (the least loaded of the role that gives one up, never a role's
  last instance). One flip per window: the watcher clears its evidence after a flip,
  so the next step needs a whole new window of the new split's behaviour.

Hysteresis: a flip from split A to B needs goodput(B) > (1 + gain) * goodput(A); going
back needs goodput(A) > (1 + gain) * goodput(B) on the same workload - both cannot hold,
so on a steady workload the policy never oscillates. Every verdict, flip or keep,
carries its reason and the numbers behind it (/debug/cluster, Prometheus).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.cluster.evidence import FlipDecision, Keep, LoadHistory, ObservedWindow
from pdserve.config import Role


@dataclass(frozen=True)
class SplitAdvice:
    """The planner's answer for one window (planner/replan.py)."""

    prefill_goodput: float  # requests/s one prefill instance serves within the SLOs
    decode_goodput: float
    needed_prefill: int  # instances the observed rate needs (`pdserve plan`'s sizing)
    needed_decode: int
    running_attainment: float  # the running split's, simulated on the window's workload
    slo_ttft: float
    slo_tpot: float


class SplitPlanner(Protocol):
    def advise(self, window: ObservedWindow, prefill: int, decode: int) -> SplitAdvice:
        """The per-instance goodputs and the sizing for `window`'s workload and rate on
        the running split's `prefill + decode` instances, and that split's simulated
        attainment; ValueError naming why when no placement meets the SLOs. Runs on a
        worker thread (it simulates; ~10 ms for 3 instances)."""
        ...


def split_goodput(advice: SplitAdvice, prefill: int, decode: int) -> float:
    """Requests/s a split serves within the SLOs (the planner's model)."""
    return min(prefill * advice.prefill_goodput, decode * advice.decode_goodput)


def best_split(advice: SplitAdvice, instances: int) -> int | None:
    """The number of prefill instances, of `instances`, that gives each phase what the
    rate needs with the most goodput (ties: fewer prefill instances); None when no
    split gives both phases enough."""
    lo, hi = advice.needed_prefill, instances - advice.needed_decode
    if lo > hi:
        return None
    return max(range(lo, hi + 1), key=lambda p: (split_goodput(advice, p, instances - p), -p))


class DistServePolicy:
    """Move toward the planner's best split, one flip per window (module doc)."""

    name = "distserve"

    def __init__(
        self, planner: SplitPlanner, window_s: float, gain: float, min_requests: int
    ) -> None:
        self.planner = planner
        self.window_s = window_s
        self.gain = gain
        self.min_requests = min_requests

    def decide(self, history: LoadHistory) -> FlipDecision | Keep | None:
        if not history.covers(self.window_s):
            return None
        loads = {role: history.mean_loads(role) for role in (Role.PREFILL, Role.DECODE)}
        window = history.window()
        p, d = len(loads[Role.PREFILL]), len(loads[Role.DECODE])
        n = p + d
        if len(window.requests) < self.min_requests:
            return Keep(
                f"{len(window.requests)} requests finished in the last {window.seconds:g} s; "
                f"replanning needs {self.min_requests}",
                {"requests": len(window.requests)},
            )
        try:
            advice = self.planner.advise(window, p, d)
        except ValueError as e:
            return Keep(f"the planner finds no placement: {e}", {"rate": window.rate})
        numbers = self._numbers(window, advice, p, d)
        target = best_split(advice, n)
        if target is None:
            return Keep(
                f"no split of {n} instances serves {window.rate:.3g} req/s within the SLOs: "
                f"the planner needs {advice.needed_prefill} prefill + {advice.needed_decode} "
                "decode instances",
                numbers,
            )
        now, best = split_goodput(advice, p, d), split_goodput(advice, target, n - target)
        numbers |= {"target_prefill": target, "target_goodput": best}
        if target == p:
            return Keep(f"the running split {p}P:{d}D is the planner's best", numbers)
        if best <= (1 + self.gain) * now:
            return Keep(
                f"the best split {target}P:{n - target}D serves {best:.3g} req/s, not more "
                f"than {1 + self.gain:g}x the running {p}P:{d}D's {now:.3g}",
                numbers,
            )
        source = Role.PREFILL if target < p else Role.DECODE
        other = Role.DECODE if source is Role.PREFILL else Role.PREFILL
        name = min(loads[source], key=lambda k: (loads[source][k], k))
        return FlipDecision(
            name,
            other,
            f"the planner's best split for {window.rate:.3g} req/s is {target}P:{n - target}D "
            f"({best:.3g} req/s within the SLOs) against the running {p}P:{d}D's {now:.3g}: "
            f"{name} moves from {source} to {other}",
            numbers,
        )

    @staticmethod
    def _numbers(window: ObservedWindow, advice: SplitAdvice, p: int, d: int) -> dict[str, float]:
        return {
            "rate": window.rate,
            "requests": len(window.requests),
            "mean_prompt": sum(r.prompt_len for r in window.requests) / len(window.requests),
            "mean_output": sum(r.output_len for r in window.requests) / len(window.requests),
            "prefill_goodput": advice.prefill_goodput,
            "decode_goodput": advice.decode_goodput,
            "needed_prefill": advice.needed_prefill,
            "needed_decode": advice.needed_decode,
            "running_goodput": split_goodput(advice, p, d),
            "predicted_attainment": advice.running_attainment,
            "observed_attainment": window.attainment(advice.slo_ttft, advice.slo_tpot),
        }
