"""`CacheCopies`: KV copied into an instance's prefix cache, as the front end sees it, and
the requests that wait for such a copy (docs/caching.md; the messages: protocol/cache.py).

A copy is one offer: a source instance pins the full blocks of a token sequence
(`KVOffered`), the front end relays it as `FetchPrefix` to the destination, which copies
the blocks it lacks, commits them into its prefix index and answers `PrefixFetched`. Two
kinds:

- a return (PD-Caching-3): a request finished on a decode instance; its prompt and answer
  go back to the prefill instance that prefilled it, where the conversation's next turn
  is expected. The front end knows of it from the request's last output on
  (`expect_return`): the decode instance posts the offer right after that output, but a
  client may send its next turn before the offer is read.
- a prefetch: the router chose a prefill instance for a request and another instance holds
  a longer prefix of its prompt; copying that part pays (cluster/routing.py), so the donor
  is asked to offer it (`prefetch`: `OfferPrefix`).

Waiting for remote KV (vLLM v1's WAITING_FOR_REMOTE_KVS, kept here at the front end): a
request is not sent to its prefill instance while a copy into that instance would give it
more of its prompt than the instance holds now - its own prefetch, another request's, or
the return of its conversation's previous turn, which an agent or a tool loop follows at
once. `inbound` finds such a copy and `wait` parks the request on it; when the copy ends,
`send` is called for the request and its prefill finds the blocks in the prefix cache. The
wait is bounded: past `ClusterConfig.kv_wait_s` (`tick`), or when the copy fails, is dropped
or loses its source, the request is sent anyway and the instance computes what it lacks.
A copy never fails a request. A request parked on a copy into an instance that dies is
dropped here: it moves with the rest of that instance's requests.

Ownership: a parked request holds nothing in any instance (it was not sent), so its abort
or timeout frees nothing. Every offer the front end reads is unpinned exactly once
(ReleaseKV to the source): when the destination answers, when the destination dies, or at
once when the copy is dropped; the blocks the destination allocates for a copy are its own
(protocol/cache.py).

The overhead of a copy - the hops through the front end, each instance's wait for its step
to end - is measured here: a copy that committed took (its `PrefixFetched` read - the front
end's first news of it) seconds, of which nbytes over the measured KV copy bandwidth were
the copy itself; the rest is one sample of the router's `fetch_overhead`, which its
prefetch rule reads.

Single-threaded: the controller's event loop calls every method.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import takewhile

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.costs import RecoveryCost
from pdserve.cluster.instance import Instance
from pdserve.cluster.routing import Router
from pdserve.kv.block_hash import block_hashes
from pdserve.protocol.cache import (
    FetchPrefix,
    KVOffered,
    OfferKind,
    OfferPrefix,
    PrefixFetched,
    offer_id,
)
from pdserve.protocol.core import AddRequest
from pdserve.protocol.handoff import ReleaseKV

log = logging.getLogger("pdserve.caching")


class CopyState(StrEnum):
    PENDING = "pending"  # the source has not offered it yet (no KVOffered read)
    COPYING = "copying"  # FetchPrefix sent; the destination answers PrefixFetched


@dataclass
class Copy:
    """One copy into `dest`'s prefix cache (the module docstring)."""

    offer_id: str
    kind: OfferKind
    source: Instance
    dest: Instance
    hashes: Sequence[int]  # chained block hashes of the tokens it brings
    asked: float  # monotonic: the front end's first news of it
    state: CopyState = CopyState.PENDING
    waiting: list[str] = field(default_factory=list)  # keys of requests parked on it


@dataclass(frozen=True)
class Waiter:
    """A request parked until copy `offer_id` into `dest` ends, or `deadline`."""

    key: str
    dest: Instance
    request: AddRequest
    offer_id: str
    deadline: float  # monotonic


# Sends a parked request to its instance: (key, instance, request). The controller checks
# that the request still waits there (an abort or a move may have come first).
SendParked = Callable[[str, Instance, AddRequest], None]


class CacheCopies:
    """Copies in flight and the requests parked on them (the module docstring)."""

    def __init__(
        self,
        config: ClusterConfig,
        block_size: int,
        router: Router,
        rates: RecoveryCost,
        instance: Callable[[str], Instance | None],
        send: SendParked,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.router = router  # its counters, its fetch overhead and prompt trees
        self.rates = rates  # the measured KV copy bandwidth
        self._instance = instance  # by name
        self._send = send
        self._clock = clock
        self._copies: dict[str, Copy] = {}  # by offer id
        self._waiters: dict[str, Waiter] = {}  # by request key

    @property
    def num_copies(self) -> int:
        return len(self._copies)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    # ---- starting copies -------------------------------------------------------------

    def expect_return(
        self, key: str, source: Instance, dest: Instance, token_ids: Sequence[int]
    ) -> None:
        """Request `key` finished on `source`, which offers the full blocks of `token_ids`
        (its prompt and answer, the KV it computed) to `dest` next."""
        hashes = block_hashes(token_ids, self.block_size)
        if hashes:
            oid = offer_id(OfferKind.RETURN, key)
            self._copies[oid] = Copy(oid, OfferKind.RETURN, source, dest, hashes, self._clock())

    def prefetch(
        self,
        key: str,
        donor: Instance,
        dest: Instance,
        token_ids: list[int],
        request: AddRequest,
        kind: OfferKind = OfferKind.PREFETCH,
    ) -> None:
        """Ask `donor` to offer the full blocks of `token_ids` to `dest` and park `request`
        (key `key`) until they are in `dest`'s cache. `kind`: PREFETCH (before a prefill)
        or MOVE (a running request's KV, to the instance it continues on)."""
        oid = offer_id(kind, key)
        hashes = block_hashes(token_ids, self.block_size)
        copy = Copy(oid, kind, donor, dest, hashes, self._clock())
        self._copies[oid] = copy
        donor.send(OfferPrefix(oid, token_ids, dest.name, kind))
        self._park(copy, key, request)

    # ---- waiting -----------------------------------------------------------------------

    def inbound(
        self, dest: Instance, prompt: Sequence[int], hashes: Sequence[int] = ()
    ) -> tuple[Copy, int] | None:
        """The copy on its way into `dest` that gives most of `prompt` (`hashes`: its
        block hashes, computed here when not given), and the prompt tokens it gives,
        capped as an instance caps its match (the last prompt token is computed); None
        when no copy into `dest` gives any."""
        copies = [c for c in self._copies.values() if c.dest is dest]
        if not copies:
            return None
        hashes = hashes or block_hashes(prompt, self.block_size)
        cap = (len(prompt) - 1) // self.block_size
        best, blocks = None, 0
        for copy in copies:
            n = min(_common(copy.hashes, hashes), cap)
            if n > blocks:
                best, blocks = copy, n
        return None if best is None else (best, blocks * self.block_size)

    def wait(self, copy: Copy, key: str, request: AddRequest) -> None:
        """Park `request` (key `key`) on a copy already on its way (`inbound`'s) until it
        ends or `kv_wait_s` passes."""
        self.router.counters.kv_waits += 1
        self._park(copy, key, request)

    def _park(self, copy: Copy, key: str, request: AddRequest) -> None:
        deadline = self._clock() + self.config.kv_wait_s
        self._waiters[key] = Waiter(key, copy.dest, request, copy.offer_id, deadline)
        copy.waiting.append(key)

    def tick(self, now: float) -> None:
        """Send the requests past their wait; forget copies whose offer never came."""
        for key, waiter in list(self._waiters.items()):
            if now >= waiter.deadline:
                del self._waiters[key]
                self.router.counters.kv_wait_timeouts += 1
                self._send(key, waiter.dest, waiter.request)
        for copy in list(self._copies.values()):
            if copy.state is CopyState.PENDING and now >= copy.asked + self.config.kv_wait_s:
                self._end(copy, failed="the source never offered it")

    # ---- messages ------------------------------------------------------------------------

    def on_offered(self, source: Instance, msg: KVOffered) -> None:
        """The source pinned the KV: relay it to the destination, or unpin it when the
        destination is gone (or already copies `max_returns_in_flight` returns)."""
        copy = self._copies.get(msg.offer_id)
        if copy is None:  # a return nobody expected, or forgotten after `kv_wait_s`
            dest = self._instance(msg.to)
            if dest is None or msg.kind is not OfferKind.RETURN:
                if msg.kind is OfferKind.RETURN:
                    self.router.counters.returns_dropped += 1
                source.send(ReleaseKV([msg.offer_id]))
                return
            copy = Copy(msg.offer_id, msg.kind, source, dest, (), self._clock())
            self._copies[msg.offer_id] = copy
        elif copy.source is not source or copy.state is not CopyState.PENDING:
            source.send(ReleaseKV([msg.offer_id]))  # not the offer asked for
            return
        copy.hashes = block_hashes(msg.token_ids, self.block_size)  # what it really brings
        if not self._may_copy(copy):
            source.send(ReleaseKV([msg.offer_id]))
            if copy.kind is OfferKind.RETURN:
                self.router.counters.returns_dropped += 1
                self._end(copy)
            else:
                self._end(copy, failed="its destination is gone")
            return
        copy.state = CopyState.COPYING
        copy.dest.send(FetchPrefix(msg.offer_id, source.name, msg.token_ids, msg.source))

    def _may_copy(self, copy: Copy) -> bool:
        if not copy.dest.alive:
            return False
        if copy.kind is not OfferKind.RETURN:
            return True
        copying = sum(
            1
            for c in self._copies.values()
            if c.dest is copy.dest and c.kind is OfferKind.RETURN and c.state is CopyState.COPYING
        )
        return copying < self.config.max_returns_in_flight

    def on_fetched(self, inst: Instance, msg: PrefixFetched) -> None:
        """A copy ended at its destination (committed, held already, or failed) - or a
        donor said it holds none of the prefix any more: unpin, count, send the parked."""
        copy = self._copies.get(msg.offer_id)
        if copy is None:
            return
        if copy.state is CopyState.PENDING:  # the donor's answer to OfferPrefix
            if inst is copy.source:
                self._end(copy, failed=msg.error or "not offered")
            return
        if inst is not copy.dest:
            return
        if copy.source.alive:
            copy.source.send(ReleaseKV([msg.offer_id]))
        if msg.error is not None:
            self._end(copy, failed=msg.error)
            return
        now = self._clock()
        copy_s = msg.nbytes / self.rates.copy.value
        self.router.fetch_overhead.observe(max(0.0, now - copy.asked - copy_s))
        blocks = msg.num_tokens // self.block_size
        self.router.stored(copy.dest, copy.hashes[:blocks], now)
        self._count(copy, msg.num_fetched)
        self._end(copy)

    def instance_dead(self, inst: Instance) -> None:
        """Copies into `inst` end (their sources unpin; the requests parked on them move
        with `inst`'s); copies out of it not offered yet end (their requests are sent)."""
        for copy in list(self._copies.values()):
            if copy.dest is inst:
                if copy.state is CopyState.COPYING:
                    if copy.source.alive:
                        copy.source.send(ReleaseKV([copy.offer_id]))
                    self._count(copy, 0, failed=True)
                for key in copy.waiting:
                    self._waiters.pop(key, None)
                del self._copies[copy.offer_id]
            elif copy.source is inst and copy.state is CopyState.PENDING:
                self._end(copy, failed=f"{inst.name} died before offering it")
            # copies out of `inst` being read end at their destination (PrefixFetched)

    # ---- internals -----------------------------------------------------------------------

    def _end(self, copy: Copy, failed: str | None = None) -> None:
        """Forget `copy` and send the requests parked on it. `failed`: why it failed
        (logged; counted, except a return never offered: that return never began)."""
        self._copies.pop(copy.offer_id, None)
        if failed is not None:
            log.info("KV %s %s to %s failed: %s", copy.kind, copy.offer_id, copy.dest.name, failed)
            if copy.kind is not OfferKind.RETURN or copy.state is CopyState.COPYING:
                self._count(copy, 0, failed=True)
        for key in copy.waiting:
            waiter = self._waiters.get(key)
            if waiter is not None and waiter.offer_id == copy.offer_id:
                del self._waiters[key]
                self._send(key, waiter.dest, waiter.request)

    def _count(self, copy: Copy, fetched: int, failed: bool = False) -> None:
        counters = self.router.counters
        if copy.kind is OfferKind.RETURN:
            counters.returned(fetched, "failed" if failed else None)
        elif copy.kind is OfferKind.MOVE:
            if failed:
                counters.kv_moves_failed += 1
            else:
                counters.kv_moves += 1
                counters.kv_moved_tokens += fetched
        elif failed:
            counters.prefetches_failed += 1
        else:
            counters.prefetches += 1
            counters.prefetched_tokens += fetched


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chained-hash lists share (equal hashes: equal prefixes)."""
    return sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1], zip(a, b, strict=False)))
