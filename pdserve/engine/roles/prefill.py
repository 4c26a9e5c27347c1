"""Prefill role: what a prefill instance does with a request once its first token is out.

Life cycle of a request on a prefill instance (DistServe §4.3, TetriInfer §3.3):

1. `AddRequest` with a `Handoff` arrives. The scheduler runs the prompt in prefill-only
   chunks of at most `max_num_batched_tokens` tokens, packed with other prompts (a
   request's progress is its `num_computed_tokens`).
2. The step that computes the last prompt token samples the first token. The core emits
   it at once (TTFT does not wait for the KV to move) and calls `first_token`, which hands
   the request off: it leaves the batch but keeps its blocks.
3. By mode (one `_Mode` per `TransferMode`, chosen from `_MODES` when the request
   arrives):
   - pull: the KV stays in the pool as a queue buffer. `KVHandedOff` says where it is and
     until when (the lease). The blocks are freed on `ReleaseKV` (the controller sends it
     once the decode side has fetched the KV, or gave up) or when the lease expires.
   - layer-push: during every step, the forward hook flushed each layer of the request's
     chunk into the decode instance's reserved blocks right after that layer ran, while
     the next layers computed (a parallel instance's driver so pushes its own layers and
     heads; its workers' part of the chunk goes once the step is done). Once the last
     flush is done the blocks are freed (retired to the prefix cache) and `KVHandedOff`
     is sent.
   - request-push: after the first token one background task gathers the prompt KV into
     one contiguous buffer (one a rank) and flushes it in one call (one a pair of ranks
     that share layers and heads); then as layer-push.

Between instances of different layouts (tensor or pipeline parallel, block sizes) every
move is planned rank to rank (`plans_between`): each of this instance's ranks sends its
own shard to the decode ranks that hold those layers and heads.

A failed flush sends `HandoffFailed`; the blocks are freed once no task reads them.

Contract with the step loop (`EngineRole`'s call points): `begin_step` before the forward
pass, `end_step` after it and before the scheduler commits the step (a commit may swap a
block for an identical indexed one and free the original, which must not happen while a
flush still reads it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec

from pdserve.config import Role
from pdserve.engine.request import Request, generator_state
from pdserve.engine.roles.base import Admissible
from pdserve.engine.roles.transfer import TransferRole
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.kv.transfer import (
    Move,
    TransferPlan,
    TransferState,
    TransferTask,
    flush_moves,
    gather,
    moves_nbytes,
    plans_between,
)
from pdserve.model.base import ForwardHooks
from pdserve.protocol.handoff import (
    Handoff,
    HandoffFailed,
    KVHandedOff,
    KVSource,
    PushTarget,
    TransferMode,
)


@dataclass
class _Outgoing:
    request: Request
    handoff: Handoff
    mode: _Mode  # the hand-off's `TransferMode`
    tasks: list[TransferTask] = field(default_factory=list)
    pushed_upto: int = 0  # layer-push: tokens flushed for every layer
    handed_off: bool = False  # the first token is out; the request left the batch
    lease_deadline: float | None = None  # pull: when the KV may be freed unclaimed
    dropped: bool = False  # aborted or released while tasks still read its blocks

    @property
    def target(self) -> PushTarget:
        assert self.handoff.target is not None
        return self.handoff.target

    def tasks_done(self) -> bool:
        return all(t.poll() in (TransferState.DONE, TransferState.FAILED) for t in self.tasks)

    def failure(self) -> str | None:
        failed = (t for t in self.tasks if t.poll() == TransferState.FAILED)
        return next((t.error or "transfer failed" for t in failed), None)


@dataclass(frozen=True)
class _Chunk:
    """One request's tokens computed this step, planned once for all layers."""

    entry: _Outgoing
    moves: list[Move]  # every layer; `on_layer_done` narrows the driver's to one
    end: int


class PrefillRole(TransferRole):
    role = Role.PREFILL

    def _init_state(self) -> None:
        self.outgoing: dict[str, _Outgoing] = {}
        self._step_chunks: list[_Chunk] = []
        self._step_tasks: list[TransferTask] = []
        self.last_tail_s = 0.0  # layer-push: wait after the last layer, previous step
        self.forward_hooks = ForwardHooks(on_layer_done=self.on_layer_done)

    # ---- counters ---------------------------------------------------------------

    @property
    def num_held(self) -> int:
        return sum(1 for e in self.outgoing.values() if e.handed_off)

    @property
    def num_transferring(self) -> int:
        return sum(1 for e in self.outgoing.values() if not e.tasks_done())

    def busy(self) -> bool:
        """Background work the step loop should keep polling for."""
        return any(not e.tasks_done() for e in self.outgoing.values())

    # ---- requests ---------------------------------------------------------------

    def request_added(self, req: Request, handoff: Handoff | None) -> None:
        """A request with a `handoff` is passed on after its first token; one without
        runs here to the end, as on a colocated instance."""
        if handoff is None:
            return
        mode = _MODES[handoff.mode]
        if mode.pushes and handoff.target is None:
            raise ValueError(f"transfer mode {handoff.mode.value!r} needs a push target")
        self.outgoing[req.request_id] = _Outgoing(req, handoff, mode)

    def first_token(self, req: Request) -> bool:
        """Hand `req` off (True: it leaves the batch holding its blocks), unless it has no
        hand-off or its first token was its last."""
        entry = self.outgoing.get(req.request_id)
        if entry is None:
            return False
        if req.status.finished:
            del self.outgoing[req.request_id]  # nothing to pass on; the core freed it
            return False
        self.hand_off(req)
        return True

    def hand_off(self, req: Request) -> None:
        """The first token is out; `req` leaves the batch holding its blocks."""
        entry = self.outgoing[req.request_id]
        entry.handed_off = True
        entry.mode.hand_off(self, entry)

    def release(self, request_id: str) -> bool:
        """ReleaseKV from the controller: the decode side has the KV or gave up."""
        entry = self.outgoing.get(request_id)
        if entry is None or not entry.handed_off:
            return False
        entry.dropped = True
        self._free_when_idle(entry)
        return True

    def abort(self, request_id: str) -> bool:
        """Drop a handed-off request (True) or just its hand-off record (False: the
        scheduler still owns it and the caller aborts it there)."""
        entry = self.outgoing.get(request_id)
        if entry is None:
            return False
        if not entry.handed_off:
            del self.outgoing[request_id]
            self._wait(entry.tasks)  # its blocks go back to the pool right after
            self._confirm_stopped(entry)
            return False
        entry.dropped = True
        self._free_when_idle(entry)
        return True

    # ---- the step loop ------------------------------------------------------------

    def begin_step(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Note this step's layer-push chunks (token range and block table)."""
        self._step_chunks = []
        for seq in seqs:
            entry = self.outgoing.get(seq.request.request_id)
            chunk = None if entry is None else entry.mode.chunk(self, entry, seq)
            if chunk is not None:
                self._step_chunks.append(chunk)

    def on_layer_done(self, layer: int) -> None:
        """Forward hook: layer `layer` of this step is in the pool; push it. Runs between
        two layers of the forward pass, so it only narrows a ready plan and queues it."""
        for chunk in self._step_chunks:
            for s, d, whole in chunk.moves:
                plan = _one_layer(whole, layer) if s == 0 else None
                if plan is not None:  # else not the driver's, or not held by rank d
                    self._push(chunk.entry, [(s, d, plan)])

    def end_step(self) -> None:
        """Push what the workers of a parallel instance computed this step, then wait for
        this step's pushes (see the module contract). The wait is the transfer time the
        forward pass did not hide (`last_tail_s`)."""
        for chunk in self._step_chunks:
            theirs = [move for move in chunk.moves if move[0] != 0]
            if theirs:
                self._push(chunk.entry, theirs)
        t0 = time.monotonic()
        self._wait(self._step_tasks)
        self.last_tail_s = time.monotonic() - t0 if self._step_tasks else 0.0
        for chunk in self._step_chunks:
            chunk.entry.pushed_upto = chunk.end
        self._step_chunks = []
        self._step_tasks = []

    def poll(self, free_seq_slots: int, admissible: Admissible) -> list[Request]:
        """Finish pushes whose last task is done; expire unclaimed pull leases. Nothing
        joins the batch here."""
        now = time.monotonic()
        for entry in list(self.outgoing.values()):
            if not entry.handed_off or not entry.tasks_done():
                continue
            if entry.dropped:
                self._free(entry)
                self._confirm_stopped(entry)
            else:
                entry.mode.settle(self, entry, now)
        return []

    # ---- internals ----------------------------------------------------------------

    def _handed_off(self, entry: _Outgoing, source: KVSource | None) -> KVHandedOff:
        req = entry.request
        return KVHandedOff(
            req.request_id,
            source,
            generator_state(req.generator),
            req.times.first_scheduled,
            req.times.first_token,
        )

    def _push(self, entry: _Outgoing, moves: list[Move]) -> None:
        """Queue `moves` from this instance's pools into the entry's target, as one of
        this step's tasks."""
        local, remote = self.link.tensors, entry.target.regions
        task = self.worker.submit(
            lambda: flush_moves(self.transport, moves, local, remote),
            nbytes=moves_nbytes(moves),
            deadline_s=self.config.timeout_s,
        )
        entry.tasks.append(task)
        self._step_tasks.append(task)

    def _free_when_idle(self, entry: _Outgoing) -> None:
        if entry.tasks_done():  # otherwise `poll` frees it when its tasks end
            self._free(entry)
            self._confirm_stopped(entry)

    def _confirm_stopped(self, entry: _Outgoing) -> None:
        """Push modes: tell the controller nothing writes into the target any more, so
        the decode side may reuse the reserved blocks."""
        if entry.handoff.target is not None:
            rid = entry.request.request_id
            self.send(HandoffFailed(rid, "aborted: no more writes into the reserved blocks"))

    def _free(self, entry: _Outgoing) -> None:
        rid = entry.request.request_id
        if self.outgoing.pop(rid, None) is not None and rid in self.kv:
            self.kv.free(rid)

    @staticmethod
    def _wait(tasks: Sequence[TransferTask]) -> None:
        for task in tasks:
            task.wait(None)


# ---- the transfer modes ------------------------------------------------------------


class _Mode:
    """How a request's prompt KV leaves this instance: one per `TransferMode` (`_MODES`),
    chosen once when the request arrives. Stateless; each hook acts through the role (its
    pool, transport, transfer thread, `send`); each default does nothing."""

    pushes: ClassVar[bool] = False  # writes into blocks the decode side reserved (target)

    def hand_off(self, role: PrefillRole, entry: _Outgoing) -> None:
        """The first token is out and the request left the batch holding its blocks."""

    def chunk(self, role: PrefillRole, entry: _Outgoing, seq: ScheduledSeq) -> _Chunk | None:
        """`begin_step`: this step's part of the request, to push layer by layer as each
        layer runs (None: nothing moves during the step)."""
        return None

    def settle(self, role: PrefillRole, entry: _Outgoing, now: float) -> None:
        """`poll`, on a handed-off entry neither dropped nor with a task running."""


class _Pull(_Mode):
    """The KV stays in the pool, leased, until the decode side fetched it (ReleaseKV)."""

    def hand_off(self, role: PrefillRole, entry: _Outgoing) -> None:
        req = entry.request
        entry.lease_deadline = time.monotonic() + role.config.lease_s
        # every token but the one just sampled: the prompt, and for a continuation
        # (output_token_ids given: a moved request) the tokens streamed before it
        computed = len(req.prompt_token_ids) + len(req.output_token_ids) - 1
        source = KVSource(
            role.link.handles,
            role.kv.block_table(req.request_id),
            computed,
            entry.lease_deadline,
        )
        role.send(role._handed_off(entry, source))

    def settle(self, role: PrefillRole, entry: _Outgoing, now: float) -> None:
        """Frees the KV once its lease ran out unclaimed."""
        if entry.lease_deadline is not None and now > entry.lease_deadline:
            role._free(entry)


class _Push(_Mode):
    """The KV is written into the decode side's reserved blocks; once every write is
    done the blocks are freed and the controller told (KVHandedOff or HandoffFailed)."""

    pushes = True

    def settle(self, role: PrefillRole, entry: _Outgoing, now: float) -> None:
        error = entry.failure()
        role._free(entry)
        rid = entry.request.request_id
        if error is not None:
            role.send(HandoffFailed(rid, f"pushing the KV to the decode instance failed: {error}"))
        else:
            role.send(role._handed_off(entry, None))


class _LayerPush(_Push):
    """Each layer of each step's chunk is flushed right after it ran (the forward hook,
    `PrefillRole.on_layer_done`); at the hand-off every layer is on its way already."""

    def chunk(self, role: PrefillRole, entry: _Outgoing, seq: ScheduledSeq) -> _Chunk | None:
        req, target = seq.request, entry.target
        start = max(target.start, entry.pushed_upto)
        end = min(req.num_computed_tokens + seq.num_new_tokens, len(req.prompt_token_ids))
        if end <= start:
            return None
        moves = plans_between(
            role.link.layouts,
            role.kv.block_table(req.request_id),
            [h.layout for h in target.regions],
            target.blocks,
            start,
            end,
        )
        return _Chunk(entry, moves, end)


class _RequestPush(_Push):
    """After the first token one task gathers the prompt KV into one contiguous buffer
    and flushes it in one call."""

    def hand_off(self, role: PrefillRole, entry: _Outgoing) -> None:
        req, target = entry.request, entry.target
        blocks = role.kv.block_table(req.request_id)
        start, end = target.start, len(req.prompt_token_ids)
        n = end - start
        # Each rank's tokens [start, end) as one buffer: token i in row i - start (a pool
        # of n blocks of one token, the rank's layers and heads).
        layouts = [
            msgspec.structs.replace(layout, num_blocks=n, block_size=1)
            for layout in role.link.layouts
        ]
        buf_blocks = [0] * start + list(range(n))
        pools = list(zip(role.link.tensors, role.link.layouts, layouts, strict=True))

        def run() -> None:
            moves = plans_between(
                layouts, buf_blocks, [h.layout for h in target.regions], target.blocks, start, end
            )
            bufs = [
                gather(pool, layout, blocks, start, end).view(buf.shape)
                for pool, layout, buf in pools
            ]
            flush_moves(role.transport, moves, bufs, target.regions)

        nbytes = sum(2 * b.num_layers * n * b.token_bytes for b in layouts)
        entry.tasks.append(role.worker.submit(run, nbytes=nbytes, deadline_s=role.config.timeout_s))


_MODES: dict[TransferMode, _Mode] = {
    TransferMode.PULL: _Pull(),
    TransferMode.LAYER_PUSH: _LayerPush(),
    TransferMode.REQUEST_PUSH: _RequestPush(),
}


def _one_layer(plan: TransferPlan, local_layer: int) -> TransferPlan | None:
    """The part of an all-layer plan that moves the sender's local layer `local_layer`."""
    lo, hi = plan.src_layers
    if not lo <= local_layer < hi:
        return None
    dst = plan.dst_layers[0] + local_layer - lo
    return msgspec.structs.replace(
        plan, src_layers=(local_layer, local_layer + 1), dst_layers=(dst, dst + 1)
    )
