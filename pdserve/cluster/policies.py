"""Which instance gets a request (DistServe §4.3, TetriInfer §3.3.4).

Load is what the controller itself assigned and has not yet seen leave the instance
(exact and current), plus what the instance last reported (its own view, up to one
report period old). Ties go to the instance listed first.
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


class DecodeChooser:
    def __init__(self, policy: DecodePolicy, seed: int | None = None) -> None:
        self.policy = policy
        self.rng = random.Random(seed)

    def choose(self, instances: Sequence[Instance], num_blocks: int) -> Instance | None:
        """A live decode instance for a request needing `num_blocks` blocks. Instances
        without room are avoided while another has room (the request waits there
        otherwise: the decode side queues it until blocks free up)."""
        live = [i for i in instances if i.alive]
        if not live:
            return None
        roomy = [i for i in live if has_room(i, num_blocks)] or live
        if self.policy is DecodePolicy.POWER_OF_TWO and len(roomy) > 2:
            roomy = self.rng.sample(roomy, 2)
        return min(roomy, key=lambda i: i.assigned_requests)
