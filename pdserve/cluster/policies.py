"""Which instance gets a request (DistServe §4.3, TetriInfer §3.3.4).

Load is what the controller itself assigned and has not yet seen leave the instance
(exact and current), plus what the instance last reported (its own view, up to one
report period old). Ties go to the instance listed first.

Decode dispatch (`DecodeChooser`), among live instances with room for the request
(every live one when none has room: the request then waits there for blocks):

- least-loaded: fewest requests assigned;
- power-of-two: two at random, the one with fewer requests assigned;
- length-aware (TetriInfer): room means room for the predicted length (the caller's
  `num_blocks`); two at random, and the request goes to the one with fewer decodes of
  its own class (heavy or light) assigned, then fewer requests, then the first drawn.
  TetriInfer's goal is the lowest average heavy:light ratio, i.e. heavy decodes spread
  evenly; taken literally (the lower ratio after joining, or the larger drop in the
  pair's mean ratio) the rule ignores load, and an instance rich in light decodes draws
  every request: the simulation in bench/bench_decode_dispatch.py put 1.5-2x the
  requests on the slowest instance that way. Balancing each class over the two drawn
  instances spreads heavy decodes evenly and keeps the load even;
- random: any one; imbalance (the worst case of TetriInfer's Fig. 19): every heavy decode
  to the first instance, light ones to the least loaded of the others.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pdserve.cluster.config import DecodePolicy
from pdserve.cluster.instance import Instance


def choose_prefill(instances: Sequence[Instance]) -> Instance | None:
    """Shortest queue: fewest prompt tokens assigned and not yet prefilled."""
    live = [i for i in instances if i.alive]
    if not live:
        return None
    return min(live, key=lambda i: i.assigned_prefill_tokens)


def has_room(instance: Instance, num_blocks: int) -> bool:
    """Whether the last report showed enough free (or evictable) blocks."""
    report = instance.report
    return report is None or report.num_obtainable_blocks >= num_blocks


def same_class(instance: Instance, heavy: bool) -> int:
    """Decodes of the class of a request (`heavy` or light) assigned to `instance`."""
    h = instance.assigned_heavy
    return h if heavy else instance.assigned_requests - h


class DecodeChooser:
    def __init__(self, policy: DecodePolicy, seed: int | None = None) -> None:
        self.policy = policy
        self.rng = random.Random(seed)

    @property
    def overrides_routing(self) -> bool:
        """The length-based policies decide decode dispatch under any `--routing`."""
        return self.policy in (
            DecodePolicy.LENGTH_AWARE,
            DecodePolicy.RANDOM,
            DecodePolicy.IMBALANCE,
        )

    def choose(
        self, instances: Sequence[Instance], num_blocks: int, heavy: bool = False
    ) -> Instance | None:
        """A live decode instance for a request needing `num_blocks` blocks; `heavy`: it
        is predicted to be a heavy decode (module docstring)."""
        live = [i for i in instances if i.alive]
        if not live:
            return None
        roomy = [i for i in live if has_room(i, num_blocks)] or live
        if self.policy is DecodePolicy.RANDOM:
            return self.rng.choice(roomy)
        if self.policy is DecodePolicy.IMBALANCE:
            return roomy[0] if heavy or len(roomy) == 1 else _least_loaded(roomy[1:])
        if self.policy in (DecodePolicy.POWER_OF_TWO, DecodePolicy.LENGTH_AWARE) and len(roomy) > 2:
            roomy = self.rng.sample(roomy, 2)
        if self.policy is DecodePolicy.LENGTH_AWARE:
            return min(roomy, key=lambda i: (same_class(i, heavy), i.assigned_requests))
        return _least_loaded(roomy)


def _least_loaded(instances: Sequence[Instance]) -> Instance:
    return min(instances, key=lambda i: i.assigned_requests)
