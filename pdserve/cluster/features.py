"""The features the controller runs, in the order it calls them (docs/controller.md).

Adding a family of messages to the front end (say, instance flip) is one new module with a
`Feature` subclass (cluster/hub.py) and one line here. The order matters where hooks meet:
dispatch's push stops and caching's copies end before recovery moves a dead instance's
requests (its `instance_dead`); replication re-arranges its ring after they moved
(`instances_changed`); a flip moves requests through recovery and the copies, so it
comes after both; scaling drains through the flip, and the watcher acts through both.
"""

from __future__ import annotations

from pdserve.cluster.cache_copies import CacheCopies
from pdserve.cluster.caching import Caching
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.costs import RecoveryCost
from pdserve.cluster.dispatch import Dispatch
from pdserve.cluster.evidence import FlipPolicy
from pdserve.cluster.flip import Flip
from pdserve.cluster.hub import Feature, Hub
from pdserve.cluster.instance import Instance
from pdserve.cluster.recovery import Recovery
from pdserve.cluster.replanning import DistServePolicy, SplitPlanner
from pdserve.cluster.replication import Replication
from pdserve.cluster.routing import Router
from pdserve.cluster.scaling import Scaling
from pdserve.cluster.watcher import NoFlips, TetriInferPolicy, Watcher
from pdserve.protocol.core import AddRequest


def assemble(
    hub: Hub, router: Router, planner: SplitPlanner | None = None
) -> tuple[Dispatch, list[Feature]]:
    """The hub's dispatch (also the first feature: the hand-off's messages) and every
    feature, in calling order. `planner`: what the `distserve` flip policy asks
    (planner/replan.py; the entry point builds it)."""
    rates = RecoveryCost()  # the measured prefill rate and KV copy bandwidth, shared
    block_size = hub.engine.cache.block_size

    def send_parked(key: str, inst: Instance, request: AddRequest) -> None:
        dispatch.send_waiting(key, inst, request)  # the copy a parked request waited for ended

    copies = CacheCopies(hub.config, block_size, router, rates, hub.instance, send_parked)
    dispatch = Dispatch(hub, router, copies, rates)
    recovery = Recovery(hub, dispatch, rates)
    flip = Flip(hub, router, copies, recovery)
    scaling = Scaling(hub, router, flip)
    config = hub.config
    return dispatch, [
        dispatch,
        Caching(router, copies),
        Replication(hub),
        recovery,
        flip,
        scaling,
        Watcher(hub, flip, scaling, make_policy(config, planner), config.replan_interval_s),
    ]


def make_policy(config: ClusterConfig, planner: SplitPlanner | None) -> FlipPolicy:
    """The flip policy `config.flip_policy` names (one of FLIP_POLICIES, checked there)."""
    if config.flip_policy == "tetriinfer":
        return TetriInferPolicy(config.flip_idle_load, config.flip_idle_s, config.flip_busy_load)
    if config.flip_policy == "distserve":
        if planner is None:
            raise ValueError(
                "the distserve flip policy needs a planner: --flip-profile, --slo-ttft and "
                "--slo-tpot"
            )
        return DistServePolicy(
            planner,
            config.replan_window_s,
            config.replan_gain,
            config.replan_min_requests,
            config.scale_bounds,
        )
    return NoFlips()
