"""The waiting prompts of one instance, in the order the scheduler admits them.

TetriInfer §3.3.1: a raw queue of arrivals and a scheduled queue the scheduler takes
from. Whenever the scheduled queue is empty, the oldest `sched_batch` raw requests form
the next scheduling batch, sorted by the policy:

- fcfs: arrival order (nothing is sorted; the engine's behaviour before this existed);
- sjf: fewest tokens to compute first; ljf: most first. Ties keep arrival order.

Each policy is a `PrefillOrder` (`PREFILL_ORDERS`, by `PrefillPolicy`), chosen once by
the queue.

Starvation bound (the contract the tests check): a request is passed only by requests
of its own scheduling batch, so at most `sched_batch - 1` later arrivals run before it,
and a request at position p of the raw queue is scheduled in the ceil(p / sched_batch)-th
batch formed from then on, whatever arrives later. A batch is formed from what is queued
then; it never waits to fill (that would add latency at low load, where sorting cannot
help anyway).

Counters (each instance's stats): `num_batches` formed, and `num_overtakes`, the pairs of
a batch in which the later arrival was scheduled first.

Requests put back at the front (`appendleft`: a recompute-preempted or migrated request)
go to the head of the scheduled queue: they already waited their turn once.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from typing import ClassVar

from pdserve.config import PrefillPolicy
from pdserve.engine.request import Request


class PrefillOrder:
    """A prefill policy: whether arrivals wait in the raw queue to be sorted a scheduling
    batch at a time, and the order of one such batch."""

    batches: ClassVar[bool]  # False: arrivals go straight to the scheduled queue

    def sort(self, sizes: list[int]) -> list[int]:
        """Indices of a batch (arrival order) by its jobs' `sizes`, in the order to run
        them; stable: equal sizes keep arrival order."""
        raise NotImplementedError


class Fcfs(PrefillOrder):
    """Arrival order: no batch is ever formed (the raw queue stays empty)."""

    batches = False

    def sort(self, sizes: list[int]) -> list[int]:
        return list(range(len(sizes)))


class Sjf(PrefillOrder):
    """Fewest tokens to compute first."""

    batches = True

    def sort(self, sizes: list[int]) -> list[int]:
        return sorted(range(len(sizes)), key=lambda i: sizes[i])


class Ljf(PrefillOrder):
    """Most tokens to compute first."""

    batches = True

    def sort(self, sizes: list[int]) -> list[int]:
        return sorted(range(len(sizes)), key=lambda i: -sizes[i])


PREFILL_ORDERS: dict[PrefillPolicy, PrefillOrder] = {
    PrefillPolicy.FCFS: Fcfs(),
    PrefillPolicy.SJF: Sjf(),
    PrefillPolicy.LJF: Ljf(),
}


class PrefillQueue:
    def __init__(
        self, policy: PrefillPolicy, sched_batch: int, job_size: Callable[[Request], int]
    ) -> None:
        """`job_size(request)`: the tokens its prefill computes (the sort key)."""
        self.policy = policy
        self.order = PREFILL_ORDERS[policy]
        self.sched_batch = sched_batch
        self.job_size = job_size
        self.raw: deque[Request] = deque()
        self.scheduled: deque[Request] = deque()
        self.num_batches = 0  # scheduling batches formed
        # Pairs of a batch whose later arrival was scheduled first: how much the policy
        # reorders (0 under fcfs; a batch of n, fully reversed, adds n(n-1)/2).
        self.num_overtakes = 0

    def append(self, req: Request) -> None:
        if self.order.batches:
            self.raw.append(req)
        else:
            self.scheduled.append(req)  # one queue: arrival order

    def appendleft(self, req: Request) -> None:
        self.scheduled.appendleft(req)

    def peek(self) -> Request | None:
        """The request the scheduler admits next (forms a batch when none is scheduled)."""
        if not self.scheduled and self.raw:
            self._form_batch()
        return self.scheduled[0] if self.scheduled else None

    def popleft(self) -> Request:
        if not self.scheduled:
            self._form_batch()
        return self.scheduled.popleft()

    def remove(self, req: Request) -> None:
        """Take `req` out of either queue (ValueError if queued in neither)."""
        if req in self.scheduled:
            self.scheduled.remove(req)
        else:
            self.raw.remove(req)

    def __len__(self) -> int:
        return len(self.scheduled) + len(self.raw)

    def __bool__(self) -> bool:
        return bool(self.scheduled or self.raw)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request: the scheduled ones in order, then the raw ones."""
        yield from self.scheduled
        yield from self.raw

    def _form_batch(self) -> None:
        n = min(self.sched_batch, len(self.raw))
        batch = [self.raw.popleft() for _ in range(n)]
        order = self.order.sort([self.job_size(r) for r in batch])
        self.scheduled.extend(batch[i] for i in order)
        self.num_batches += 1
        self.num_overtakes += _inversions(order)


def _inversions(order: list[int]) -> int:
    """Pairs (i, j) with i before j in `order` and i > j."""
    seen: list[int] = []
    count = 0
    for i in order:
        k = bisect.bisect(seen, i)
        count += len(seen) - k
        seen.insert(k, i)
    return count
