"""Decode role: taking in requests whose prompt was prefilled on another instance.

Life cycle of a request on a decode instance (DistServe §4.3, MemServe §4.3):

- pull: `AddPrefilled` with a `KVSource` queues the request (FCFS). When the pool has room
  `admit` allocates its prompt blocks - tokens this instance already holds in its prefix
  cache are not fetched (MemServe's context caching on the decode side) - and starts a
  background fetch from the prefill instance's pool. When the fetch is done, `poll`
  commits the blocks (indexing them in the prefix cache: MemPool `transfer_with_insert`),
  sends `KVReceived` and hands the request to the scheduler, which decodes it from the
  next step on. A fetch is never started past the source's lease (it could read blocks the
  prefill side already reused): the request fails instead.
- push: `ReserveKV` queues a reservation; `admit` allocates the blocks when there is room
  and answers `KVReserved` with their ids; the prefill instance writes into them; then
  `AddPrefilled` without a source commits them and the request joins the batch.

Failure anywhere (fetch error, lease, abort) frees every block the request holds here
and, except for aborts, sends `HandoffFailed` so the controller can retry it elsewhere.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import Role
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.roles.base import Admissible, BuildRequest
from pdserve.engine.roles.transfer import TransferRole
from pdserve.kv.transfer import (
    TransferState,
    TransferTask,
    fetch_moves,
    moves_nbytes,
    plans_between,
)
from pdserve.protocol.handoff import (
    AddPrefilled,
    HandoffFailed,
    KVReceived,
    KVReserved,
    PushTarget,
    ReserveKV,
)


@dataclass
class _Incoming:
    request: Request
    msg: AddPrefilled
    queued: float
    task: TransferTask | None = None
    nbytes: int = 0
    dropped: bool = False  # aborted while its fetch runs


@dataclass
class _Reservation:
    request_id: str
    prompt_token_ids: list[int]
    queued: float
    start: int = 0  # tokens found in the local prefix cache
    granted: bool = False


class DecodeRole(TransferRole):
    role = Role.DECODE

    def _init_state(self) -> None:
        self.queue: deque[_Incoming] = deque()  # pull: waiting for room
        self.fetching: dict[str, _Incoming] = {}
        self.reservations: dict[str, _Reservation] = {}
        self._pending_reservations: deque[_Reservation] = deque()
        # Prefilled requests taken with a predicted length, and the low ends of their
        # predicted buckets summed (the decode work length-aware dispatch spreads), since
        # this core became a decode instance.
        self.num_predicted_decodes = 0
        self.predicted_decode_tokens = 0

    # ---- counters ---------------------------------------------------------------

    @property
    def num_transferring(self) -> int:
        return len(self.fetching)

    @property
    def num_reserved(self) -> int:
        return len(self.reservations) + len(self.queue)

    def busy(self) -> bool:
        return bool(self.fetching)

    def stats(self) -> dict[str, int]:
        return {
            **super().stats(),
            "num_predicted_decodes": self.num_predicted_decodes,
            "predicted_decode_tokens": self.predicted_decode_tokens,
        }

    # ---- inputs -------------------------------------------------------------------

    def add_prefilled(self, msg: AddPrefilled, build: BuildRequest) -> Request | None:
        """Queue a pulled request, or complete a pushed one (returned: ready to run)."""
        req = build(msg)
        if req is None:
            return None
        if req.prediction is not None:
            self.num_predicted_decodes += 1
            self.predicted_decode_tokens += req.prediction.low
        req.status = RequestStatus.WAITING_FOR_KV
        now = time.monotonic()
        if msg.source is not None:
            self.queue.append(_Incoming(req, msg, now))
            return None
        res = self.reservations.pop(req.request_id, None)
        if res is None or not res.granted:
            self.send(HandoffFailed(req.request_id, "no KV reservation for this request here"))
            return None
        self._commit(req)
        self.send(KVReceived(req.request_id, res.queued, now, now, 0))
        return req

    def reserve(self, msg: ReserveKV) -> None:
        res = _Reservation(msg.request_id, msg.prompt_token_ids, time.monotonic())
        self.reservations[msg.request_id] = res
        self._pending_reservations.append(res)

    def release(self, request_id: str) -> bool:
        """ReleaseKV: drop a reservation (the prefill side failed or the request ended)."""
        res = self.reservations.pop(request_id, None)
        if res is None:
            return False
        if res.granted:
            self.kv.free(request_id)
        else:
            self._pending_reservations.remove(res)
        return True

    def abort(self, request_id: str) -> bool:
        """Drop a request that has not reached the scheduler. False if not held here."""
        if request_id in self.reservations:
            self.release(request_id)
            return True
        incoming = self.fetching.get(request_id)
        if incoming is not None:
            incoming.dropped = True  # blocks freed when the fetch ends (`poll`)
            return True
        for queued in self.queue:
            if queued.request.request_id == request_id:
                self.queue.remove(queued)
                return True
        return False

    # ---- the step loop ------------------------------------------------------------

    def poll(self, free_seq_slots: int, admissible: Admissible) -> list[Request]:
        """Requests whose fetched KV is now in place (ready for the scheduler); then
        reservations and fetches are admitted into what is left."""
        ready = self._collect_fetches()
        self.admit(free_seq_slots - len(ready), admissible, ready)
        return ready

    def admit(
        self, free_seq_slots: int, admissible: Admissible, ready: Sequence[Request] = ()
    ) -> None:
        """Grant reservations, then start fetches, FCFS, while blocks and slots allow and
        the admission rule agrees (pull only: a push reservation is made before the
        prefill, so before any prediction; it is granted greedily). `ready`: requests
        about to join the batch."""
        while self._pending_reservations:
            res = self._pending_reservations[0]
            if not self._allocate(res.request_id, res.prompt_token_ids):
                break
            self._pending_reservations.popleft()
            res.granted = True
            res.start = self.kv.num_computed_tokens(res.request_id)
            blocks = self.kv.block_table(res.request_id)
            self.send(KVReserved(res.request_id, PushTarget(self.link.handles, blocks, res.start)))
        while self.queue and free_seq_slots - len(self.fetching) > 0:
            incoming = self.queue[0]
            on_the_way = [*ready, *(i.request for i in self.fetching.values())]
            if not admissible(incoming.request, on_the_way):
                break
            if not self._allocate(incoming.request.request_id, kv_tokens(incoming.msg)):
                break
            self.queue.popleft()
            self._start_fetch(incoming)

    def _collect_fetches(self) -> list[Request]:
        ready = []
        for rid, incoming in list(self.fetching.items()):
            assert incoming.task is not None
            state = incoming.task.poll()
            if state not in (TransferState.DONE, TransferState.FAILED):
                continue
            del self.fetching[rid]
            if incoming.dropped:
                self.kv.free(rid)
            elif state == TransferState.FAILED:
                self._fail(rid, f"fetching the KV failed: {incoming.task.error}")
            else:
                self._commit(incoming.request)
                task = incoming.task
                self.send(
                    KVReceived(
                        rid,
                        incoming.queued,
                        task.started or 0.0,
                        task.finished or 0.0,
                        incoming.nbytes,
                    )
                )
                ready.append(incoming.request)
        return ready

    # ---- internals ----------------------------------------------------------------

    def _allocate(self, request_id: str, prompt: list[int]) -> bool:
        cached = self.kv.match_prefix(prompt).num_cached_tokens
        return self.kv.allocate(request_id, prompt, len(prompt) - cached) is not None

    def _start_fetch(self, incoming: _Incoming) -> None:
        rid = incoming.request.request_id
        source = incoming.msg.source
        assert source is not None
        if time.monotonic() + self.config.timeout_s >= source.lease_deadline:
            self._fail(rid, "the prefill instance's lease on the KV ran out before it was fetched")
            return
        start = self.kv.num_computed_tokens(rid)
        moves = plans_between(
            [h.layout for h in source.regions],
            source.blocks,
            self.link.layouts,
            self.kv.block_table(rid),
            start,
            source.num_tokens,
        )
        local = self.link.tensors
        incoming.nbytes = moves_nbytes(moves)
        incoming.task = self.worker.submit(
            lambda: fetch_moves(self.transport, moves, source.regions, local),
            nbytes=incoming.nbytes,
            deadline_s=self.config.timeout_s,
        )
        self.fetching[rid] = incoming

    def _commit(self, req: Request) -> None:
        """The KV of every token but the last sampled one is in place (a pushed request:
        the prompt's; a pulled one: also the tokens a continuation streamed before)."""
        tokens = [*req.prompt_token_ids, *req.output_token_ids[:-1]]
        self.kv.commit(req.request_id, tokens, len(tokens))
        req.num_computed_tokens = len(tokens)

    def _fail(self, request_id: str, message: str) -> None:
        if request_id in self.kv:
            self.kv.free(request_id)
        self.send(HandoffFailed(request_id, message))


def kv_tokens(msg: AddPrefilled) -> list[int]:
    """The tokens whose KV the prefill instance computed: the prompt and, for a moved
    request continued through a prefill instance (cluster/recovery.py), the tokens it
    streamed before - every token but the last sampled one."""
    return [*msg.prompt_token_ids, *msg.output_token_ids[:-1]]
