"""`CacheExchange`: an instance's side of cluster-wide caching (protocol/cache.py).

Two jobs, both MemServe MemPool calls between instances (§4.3):

- offering (the source, e.g. a decode instance after a request finished): pin the full
  blocks of a token sequence that the local prefix index holds and say where they are
  (`KVOffered`). The pin is a KV state of its own in the `KVManager` (an id that no
  request uses), so the pinned blocks cannot be evicted or reused until `release` or the
  lease ends; they stay cached afterwards.
- fetching (the destination, e.g. the prefill instance that will see the session's next
  turn): `FetchPrefix` -> match the local index, allocate blocks only for what it lacks,
  copy those from the source on the transfer thread, then commit them (the index insert
  of `transfer_with_insert`) and free them: they stay in the prefix cache.

Everything here runs on the step loop's thread between steps, except the copy itself
(the link's transfer thread). It never blocks the loop. A request that waits for a copy
waits at the front end, bounded (cluster/cache_copies.py); a failure only loses the cache
entry (`PrefixFetched.error`): the blocks are freed on both sides (the destination at
once, the source on ReleaseKV or at the end of its lease). Faults injected with the
"cache" scope (`TransferConfig.fault_scope`) hit these copies only, through a fault
wrapper around the link's transport.

It is a participant of the core (engine/participant.py): it owns FetchPrefix and
OfferPrefix, offers a finished request's prompt and answer back to the instance its
`return_to` names (PD-Caching-3, `request_ended`: before the request's blocks are freed),
and unpins offers on ReleaseKV.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdserve.config import TransferConfig
from pdserve.engine.participant import Admissible, Handler, Participant
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.roles.transfer import TransferLink, fault_config
from pdserve.kv.manager import KVManager
from pdserve.kv.transfer import (
    FaultyTransport,
    LayoutMismatchError,
    TransferState,
    TransferTask,
    Transport,
    fetch_moves,
    moves_nbytes,
    plans_between,
)
from pdserve.protocol.cache import (
    FetchPrefix,
    KVOffered,
    OfferKind,
    OfferPrefix,
    PrefixFetched,
)
from pdserve.protocol.cache import (
    offer_id as make_offer_id,
)
from pdserve.protocol.handoff import KVSource
from pdserve.protocol.wire import EngineMessage


@dataclass
class _Fetch:
    msg: FetchPrefix
    hold: str  # the KV state of the blocks being written
    cached: int  # tokens this instance held already
    task: TransferTask
    nbytes: int


class CacheExchange(Participant):
    """Offers and fetches of one instance. Single-threaded like the step loop."""

    def __init__(
        self,
        instance_name: str,
        kv: KVManager,
        link: Callable[[], TransferLink],
        post: Callable[[EngineMessage], None],
        config: TransferConfig,
    ) -> None:
        self.instance_name = instance_name
        self.kv = kv
        self._link = link  # opened on first use (a colocated core has none before)
        self._post = post
        self.config = config
        self.offers: dict[str, float] = {}  # offer id -> lease deadline (monotonic)
        self.fetches: dict[str, _Fetch] = {}  # by offer id
        self._faulty: FaultyTransport | None = None  # faults scoped to these copies

    @property
    def num_offers(self) -> int:
        return len(self.offers)

    @property
    def num_fetches(self) -> int:
        return len(self.fetches)

    def busy(self) -> bool:
        return bool(self.fetches)

    def stats(self) -> dict[str, int]:
        return {"num_offers": self.num_offers, "num_prefix_fetches": self.num_fetches}

    def handlers(self) -> Mapping[type, Handler]:
        return {FetchPrefix: self.fetch, OfferPrefix: self.offer_prefix}

    # ---- the source side -------------------------------------------------------------

    def offer(self, offer_id: str, kind: OfferKind, token_ids: list[int], to: str) -> bool:
        """Pin the indexed full-block prefix of `token_ids` and offer it to instance `to`
        (`kind`: why). False (nothing pinned) when the index holds none of it or the id is
        in use."""
        if offer_id in self.offers or offer_id in self.kv:
            return False
        pinned = self.kv.hold(offer_id, token_ids, 0)
        if not pinned:
            self.kv.free(offer_id)
            return False
        bs = self.kv.cfg.block_size
        link = self._link()
        deadline = time.monotonic() + self.config.lease_s
        blocks = self.kv.block_table(offer_id)[: pinned // bs]
        self.offers[offer_id] = deadline
        source = KVSource(link.handles, blocks, pinned, deadline)
        self._post(KVOffered(offer_id, kind, to, token_ids[:pinned], source))
        return True

    def offer_prefix(self, msg: OfferPrefix) -> None:
        """Pin what the prefix cache holds of `msg.token_ids` for instance `msg.to`
        (KVOffered); PrefixFetched with the reason when it holds none of it."""
        if not self.offer(msg.offer_id, msg.kind, msg.token_ids, msg.to):
            reason = "not cached here any more"
            self._post(PrefixFetched(msg.offer_id, self.instance_name, 0, 0, 0, reason))

    def request_ended(self, req: Request, status: RequestStatus | None) -> None:
        """PD-Caching-3: offer the KV of a finished request's prompt and answer (the full
        blocks whose KV was computed: the scheduler committed them to the prefix index
        step by step) to the instance its `return_to` names."""
        if req.return_to is None or status is None or status is RequestStatus.FINISHED_ABORTED:
            return
        bs = self.kv.cfg.block_size
        full = req.num_computed_tokens // bs * bs
        kind, tokens = OfferKind.RETURN, req.all_token_ids[:full]
        self.offer(make_offer_id(kind, req.request_id), kind, tokens, req.return_to)

    def release(self, offer_id: str) -> bool:
        """Unpin an offer (ReleaseKV). False when it is not an offer of this instance."""
        if self.offers.pop(offer_id, None) is None:
            return False
        self.kv.free(offer_id)
        return True

    # ---- the destination side ----------------------------------------------------------

    def fetch(self, msg: FetchPrefix) -> None:
        """Start copying the blocks of `msg.token_ids` this instance lacks; the answer
        (PrefixFetched) comes from `poll`, or at once when nothing needs to move or the
        fetch cannot start."""
        n = msg.source.num_tokens
        tokens = msg.token_ids[:n]
        hold = f"{msg.offer_id}@fetch"
        error = self._refusal(msg, hold, len(tokens))
        if error is not None:
            self._answer(msg, 0, 0, 0, error)
            return
        cached = self.kv.hold(hold, tokens, n)
        if cached is None:
            self._answer(msg, 0, 0, 0, f"no room: {n} tokens, {self._free_tokens()} obtainable")
            return
        if cached >= n:
            self.kv.free(hold)
            self._answer(msg, n, 0, 0, None)
            return
        try:
            task, nbytes = self._start_copy(msg, hold, cached, n)
        except LayoutMismatchError as e:
            self.kv.free(hold)
            self._answer(msg, 0, 0, 0, f"the offered KV does not fit this pool: {e}")
            return
        self.fetches[msg.offer_id] = _Fetch(msg, hold, cached, task, nbytes)

    def _refusal(self, msg: FetchPrefix, hold: str, num_tokens: int) -> str | None:
        bs = self.kv.cfg.block_size
        if not self.kv.cfg.enable_prefix_cache:
            return "this instance keeps no prefix cache"
        if msg.offer_id in self.fetches or hold in self.kv:
            return f"offer {msg.offer_id!r} is already being fetched"
        if num_tokens != msg.source.num_tokens or num_tokens % bs or num_tokens <= 0:
            return f"an offer must be whole blocks of {bs} tokens, got {num_tokens}"
        if time.monotonic() + self.config.timeout_s >= msg.source.lease_deadline:
            return "the source's lease on the KV ends before a fetch could finish"
        return None

    def _start_copy(
        self, msg: FetchPrefix, hold: str, start: int, end: int
    ) -> tuple[TransferTask, int]:
        link = self._link()
        moves = plans_between(
            [h.layout for h in msg.source.regions],
            msg.source.blocks,
            link.layouts,
            self.kv.block_table(hold),
            start,
            end,
        )
        remote, local, transport = msg.source.regions, link.tensors, self._transport(link)
        task = link.worker.submit(
            lambda: fetch_moves(transport, moves, remote, local),
            nbytes=moves_nbytes(moves),
            deadline_s=self.config.timeout_s,
        )
        return task, moves_nbytes(moves)

    def _transport(self, link: TransferLink) -> Transport:
        """The link's transport, behind the faults injected into cache copies only."""
        faults = fault_config(self.config, "cache")
        if faults is None:
            return link.transport
        if self._faulty is None:  # one wrapper: its seeded draws run in one sequence
            self._faulty = FaultyTransport(link.transport, faults)
        return self._faulty

    def _free_tokens(self) -> int:
        return self.kv.num_obtainable_blocks * self.kv.cfg.block_size

    # ---- between steps -----------------------------------------------------------------

    def poll(self, free_seq_slots: int, admissible: Admissible) -> list[Request]:
        """Finish fetches that ended; unpin offers whose lease ran out."""
        for offer_id, fetch in list(self.fetches.items()):
            state = fetch.task.poll()
            if state not in (TransferState.DONE, TransferState.FAILED):
                continue
            del self.fetches[offer_id]
            self._finish(fetch, state)
        now = time.monotonic()
        for offer_id, deadline in list(self.offers.items()):
            if now >= deadline:
                self.release(offer_id)
        return []

    def _finish(self, fetch: _Fetch, state: TransferState) -> None:
        msg, n = fetch.msg, fetch.msg.source.num_tokens
        if state is TransferState.DONE:
            self.kv.commit(fetch.hold, msg.token_ids[:n], n)  # the insert: now indexed
            self.kv.free(fetch.hold)  # indexed blocks stay cached
            self._answer(msg, n, n - fetch.cached, fetch.nbytes, None)
        else:
            self.kv.free(fetch.hold)
            self._answer(msg, 0, 0, 0, f"fetching the KV failed: {fetch.task.error}")

    def _answer(
        self, msg: FetchPrefix, num_tokens: int, fetched: int, nbytes: int, error: str | None
    ) -> None:
        self._post(
            PrefixFetched(msg.offer_id, msg.source_instance, num_tokens, fetched, nbytes, error)
        )

    def close(self) -> None:
        """Wait for copies in flight to end (they write into this pool), then free."""
        for fetch in self.fetches.values():
            fetch.task.wait(self.config.timeout_s)
        self.fetches.clear()
