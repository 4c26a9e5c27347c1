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

With room to scale (`--max-instances`, `--min-instances`; cluster/scaling.py), two
more verdicts, judged before a flip:

- no split of n serves the rate and n < the most: add an instance of the role short
  of what the planner says the rate needs (both short: the one short by the larger
  share);
- n > the fewest, and the best split of n - 1 serves the rate with `gain` to spare
  (its goodput at least (1 + gain) times the rate): remove the least loaded instance of
  the role that split has fewer of (never a role's last). The instance is drained
  first: no request is lost.

Hysteresis: a flip from split A to B needs goodput(B) > (1 + gain) * goodput(A); going
back needs goodput(A) > (1 + gain) * goodput(B) on the same workload - both cannot hold,
so on a steady workload the policy never oscillates. Likewise a scale-out from n
needs the planner's a + b instances to exceed n, and a scale-in from n + 1 needs a + b
<= n on the same workload. Every verdict, flip, scaling or keep, carries its reason and
the numbers behind it (/debug/cluster, Prometheus).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.cluster.evidence import (
    FlipDecision,
    Keep,
    LoadHistory,
    ObservedWindow,
    ScaleDecision,
)
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


def least_loaded(loads: dict[str, float]) -> str:
    """The instance of the lowest mean load (ties: the first name)."""
    return min(loads, key=lambda k: (loads[k], k))


class DistServePolicy:
    """Move toward the planner's best split, one flip per window (module doc)."""

    name = "distserve"

    def __init__(
        self,
        planner: SplitPlanner,
        window_s: float,
        gain: float,
        min_requests: int,
        bounds: tuple[int, int] | None = None,
    ) -> None:
        """`bounds`: the fewest and most instances it may run (None: it never scales)."""
        self.planner = planner
        self.window_s = window_s
        self.gain = gain
        self.min_requests = min_requests
        self.bounds = bounds

    def decide(self, history: LoadHistory) -> FlipDecision | ScaleDecision | Keep | None:
        if not history.covers(self.window_s):
            return None
        loads = {role: history.mean_loads(role) for role in (Role.PREFILL, Role.DECODE)}
        window = history.window()
        p, d = len(loads[Role.PREFILL]), len(loads[Role.DECODE])
        n = p + d
        if not (p and d):
            return Keep(
                f"the cluster runs {p} prefill and {d} decode instances: the distserve "
                "policy plans prefill:decode splits of disaggregated instances",
                {"prefill": p, "decode": d},
            )
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
        lo, hi = self.bounds or (n, n)
        target = best_split(advice, n)
        if target is None and n < hi:
            return self._add(advice, window, p, d, hi, numbers)
        if n > lo:
            removal = self._remove(advice, window, loads, lo, numbers)
            if removal is not None:
                return removal
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
        name = least_loaded(loads[source])
        return FlipDecision(
            name,
            other,
            f"the planner's best split for {window.rate:.3g} req/s is {target}P:{n - target}D "
            f"({best:.3g} req/s within the SLOs) against the running {p}P:{d}D's {now:.3g}: "
            f"{name} moves from {source} to {other}",
            numbers,
        )

    def _add(
        self,
        advice: SplitAdvice,
        window: ObservedWindow,
        p: int,
        d: int,
        most: int,
        numbers: dict[str, float],
    ) -> ScaleDecision:
        """The role short of what the rate needs (both short: by the larger share)."""
        short_p, short_d = advice.needed_prefill / p, advice.needed_decode / d
        role = Role.PREFILL if short_p > short_d else Role.DECODE
        return ScaleDecision(
            role,
            None,
            f"no split of {p + d} instances serves {window.rate:.3g} req/s within the SLOs: "
            f"the planner needs {advice.needed_prefill} prefill + {advice.needed_decode} "
            f"decode instances; a {role} instance is added (at most {most})",
            numbers,
        )

    def _remove(
        self,
        advice: SplitAdvice,
        window: ObservedWindow,
        loads: dict[Role, dict[str, float]],
        fewest: int,
        numbers: dict[str, float],
    ) -> ScaleDecision | None:
        """One instance fewer when the best split of n - 1 serves the rate with `gain`
        to spare; the least loaded of the role it has fewer of, never a role's last."""
        p, d = len(loads[Role.PREFILL]), len(loads[Role.DECODE])
        fewer = best_split(advice, p + d - 1)
        if fewer is None:
            return None
        goodput = split_goodput(advice, fewer, p + d - 1 - fewer)
        if goodput < (1 + self.gain) * window.rate:
            return None
        role = Role.PREFILL if p > fewer else Role.DECODE
        if len(loads[role]) < 2:
            return None
        name = least_loaded(loads[role])
        return ScaleDecision(
            role,
            name,
            f"{fewer}P:{p + d - 1 - fewer}D serves {goodput:.3g} req/s within the SLOs, at "
            f"least {1 + self.gain:g}x the observed {window.rate:.3g}: {name} (the least "
            f"loaded {role} instance, {loads[role][name]:.0%}) is removed (at least {fewest})",
            numbers | {"fewer_prefill": fewer, "fewer_goodput": goodput},
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
