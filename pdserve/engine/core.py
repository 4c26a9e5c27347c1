"""EngineCore: schedule -> run -> sample -> check stop conditions, on token ids.

Text (detokenization, stop strings) is not the core's business: `Engine` layers an
output processor on top, and in serving the front end does that work while the core
runs in its own process. A stop string found there ends the request with `abort`.

Everything an instance does besides that loop is a participant (engine/participant.py:
the hooks, and when the core calls them): the instance's role first (colocated, prefill,
decode: roles/base.py), then the features `engine/features/` assembles. The core
calls its participants in order at fixed points of a step and routes their input
messages (`handle`); it knows none of them by name and never asks which role it holds.
`switch_role` replaces the role between steps. Decode bursts (several greedy decode
steps in one compiled call) are sized by `DecodeBursts` (engine/bursts.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from pdserve.config import EngineConfig, Role
from pdserve.engine.admission import AdmissionGate
from pdserve.engine.bursts import DecodeBursts, merged
from pdserve.engine.features import assemble
from pdserve.engine.intake import new_request, prefilled_request, stop_status, token_output
from pdserve.engine.mb_swap import stage_swap
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.participant import Handler, Participant
from pdserve.engine.ranks import RankGroup
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.roles import (
    ColocatedRole,
    DecodeRole,
    EngineRole,
    PrefillRole,
    TransferLink,
    TransferRole,
    open_link,
)
from pdserve.engine.sampler import SampledToken, SamplingRow, sample
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.errors import EngineOverloadedError, InvalidRequestError
from pdserve.kv.cache import KVCache
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.layout import KVLayout, whole_layout
from pdserve.kv.manager import KVManager
from pdserve.model.base import CausalLM
from pdserve.protocol.core import EngineOutput, RequestRejected
from pdserve.protocol.handoff import AddPrefilled, Handoff, ReleaseKV, ReserveKV
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.wire import EngineMessage

_TRANSFER_ROLES: dict[Role, type[TransferRole]] = {
    Role.PREFILL: PrefillRole,
    Role.DECODE: DecodeRole,
}

P = TypeVar("P", bound=Participant)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        kv_config: KVCacheConfig,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        ranks: RankGroup | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVManager(kv_config)
        # Messages for the controller besides step outputs (hand-offs, reservations).
        self.outbox: list[EngineMessage] = []
        self.link, cache = _open_pool(config, model, kv_config, ranks)
        self.scheduler = Scheduler(config.scheduler, self.kv, config.device)
        self.runner = ModelRunner(model, cache, self.kv)
        self.ranks = ranks  # a parallel instance's other ranks (`model`: the driver's shard)
        if ranks is not None:  # they run every step this core runs
            swap = stage_swap(config, cache, max_model_len)
            ranks.attach(self.runner, None if self.link is None else self.link.handles[1:], swap)
        self.bursts = DecodeBursts(config.scheduler, max_model_len, self.eos_token_ids)
        self.admission = AdmissionGate(config.scheduler.decode_admission, self.kv, max_model_len)
        self.requests: dict[str, Request] = {}
        self.features = assemble(self, model)
        own: dict[type, Handler] = {
            AddPrefilled: self.add_prefilled,
            ReserveKV: lambda msg: self.role.reserve(msg),
            ReleaseKV: lambda msg: self.release(msg.request_ids),
        }
        self._handlers = _handler_table(own, self.features)
        self._take_role(config.role)

    # ---- the role --------------------------------------------------------------

    def switch_role(self, role: Role, max_num_batched_tokens: int | None = None) -> None:
        """Make this a `role` instance (instance flip), between steps. The core must be
        idle (`holdings` is None): no request, and nothing held, moving or reserved for a
        hand-off, and no block in use; otherwise RuntimeError, and nothing changes. The
        prefix cache stays: what was cached in the old role is a hit in the new one.
        `max_num_batched_tokens`: the scheduler's token budget per step from now on (a
        prefill instance's chunk size); None keeps it.

        Prefill and decode need the pool in a transfer region (peers read and write it in
        place). A core that has none (built colocated) opens its link on the first switch
        to either (`transfer_link`). The link then stays open until `close`: switching
        back to colocated keeps it (nothing is handed to peers any more), and a later
        switch reuses it without a copy. A role the config refuses (prefill or decode on a
        GPU: EngineConfig's rule) is a ValueError, nothing changed.

        The participant list is replaced by a new one (the new role first): a loop over
        the old list (a participant's hook that switched) finishes over the old one."""
        scheduler = self.scheduler.config
        if max_num_batched_tokens is not None:
            scheduler = dataclasses.replace(
                scheduler, max_num_batched_tokens=max_num_batched_tokens
            )
        config = dataclasses.replace(self.config, role=role, scheduler=scheduler)  # validated
        held = self.holdings()
        if held is not None:
            raise RuntimeError(
                f"cannot switch the {self.config.role.value} core to {role.value}: it is not "
                f"idle ({held}); switch between steps once it has drained"
            )
        self._take_role(role)
        self.scheduler.config = scheduler
        self.config = config

    def holdings(self) -> str | None:
        """None when the core is idle (`switch_role` may run), else what it still holds."""
        return _holdings(self)

    def _take_role(self, role: Role) -> None:
        self.role: EngineRole
        if role is Role.COLOCATED:
            self.role = ColocatedRole(self.post)
        else:
            link = self.transfer_link()
            self.role = _TRANSFER_ROLES[role](self.kv, link, self.config.transfer, self.post)
        self.runner.hooks = self.role.forward_hooks
        self.participants: list[Participant] = [self.role, *self.features]

    # ---- what participants use (participant.CoreAccess) ---------------------------

    def transfer_link(self) -> TransferLink:
        """This core's link; opened on first use: the transport of `config.transfer`, a
        region of the pool's layout (one a rank, for a parallel instance), the transfer
        thread. The pool is copied into the region and the runner's cache uses the region's
        tensor from then on (the workers' likewise, before this returns); the copy keeps
        the prefix cache valid (cached blocks keep their KV and their accounting)."""
        if self.link is None:
            cache, ranks = self.runner.cache, self.ranks
            link = open_link(self.config, _rank_layouts(cache.layout, ranks))
            link.region.tensor.copy_(cache.device_tensor)
            cache.device_tensor = link.region.tensor
            if ranks is not None:
                ranks.link(link.handles[1:])
            self.link = link
        return self.link

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    @property
    def kv_layout(self) -> KVLayout:
        """Geometry of this instance's device KV (as the transfer library sees it): the
        driver's pool with every rank's layers and KV heads, for a parallel instance."""
        return whole_layout(_rank_layouts(self.runner.cache.layout, self.ranks))

    def post(self, msg: EngineMessage) -> None:
        self.outbox.append(msg)

    def has_room(self) -> bool:
        return len(self.scheduler.running) < self.scheduler.config.max_num_seqs

    # ---- messages, participants, shutdown -----------------------------------------

    def handlers(self) -> Mapping[type, Handler]:
        """The input messages the core and its participants take, type -> handler."""
        return self._handlers

    def handle(self, msg: Any) -> None:
        """Apply one input message (KeyError: nobody here takes its type)."""
        self._handlers[type(msg)](msg)

    def participant(self, kind: type[P]) -> P:
        """The participant of class `kind` (KeyError when there is none)."""
        for p in self.participants:
            if isinstance(p, kind):
                return p
        raise KeyError(kind.__name__)

    def take_messages(self) -> list[EngineMessage]:
        out, self.outbox = self.outbox, []
        return out

    def close(self) -> None:
        """Stop the participants' background work (in order: a background write in
        flight is waited for, the only place the core waits for one), then the transfer
        link: shared-memory regions released."""
        for p in self.participants:
            p.close()
        if self.link is not None:
            self.link.close()
        if self.runner.peers is not None:  # a tensor-parallel instance's other ranks
            self.runner.peers.close()

    def check_integrity(self) -> None:
        """AssertionError unless the pool's and every participant's accounting hold."""
        self.kv.check_integrity()
        for p in self.participants:
            p.check_integrity()

    def stats(self) -> dict[str, int]:
        """The participants' EngineStats fields, by name."""
        out: dict[str, int] = {}
        for p in self.participants:
            out.update(p.stats())
        return out

    # ---- requests --------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival: float | None = None,
        handoff: Handoff | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> Request:
        """Validate and queue. Raises InvalidRequestError or EngineOverloadedError;
        nothing is allocated then. `arrival` (time.monotonic(), system-wide) is when
        the request reached the frontend, so queue time includes the trip here.
        `handoff` (prefill role): pass the request on after its first token; the role
        refuses it (InvalidRequestError) on other instances.

        `output_token_ids` (a migrated request): tokens generated before, elsewhere. They
        count as output (max_tokens, min_tokens, penalties); their KV is computed with the
        prompt's, like a request preempted by recompute, and the next token sampled is the
        one after them. A seeded generator skips the draws they took (`resumed_generator`),
        so greedy and seeded requests continue exactly as if nothing had happened."""
        req = self.new_request(request_id, prompt_token_ids, params, arrival, output_token_ids)
        self.queue(req, handoff)
        return req

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival: float | None,
        output_token_ids: Sequence[int],
    ) -> Request:
        """A validated request (see `add_request`), not queued anywhere yet."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        vocab = self.model.config.vocab_size
        args = (prompt_token_ids, params, arrival, output_token_ids)
        return new_request(request_id, *args, vocab, self.max_model_len)

    def queue(self, req: Request, handoff: Handoff | None = None) -> None:
        """Queue a new request (a migrated one ahead of the waiting ones).
        EngineOverloadedError when the queue is full; the participants may refuse it."""
        limit = self.scheduler.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise EngineOverloadedError(
                f"the server is overloaded: its queue of {limit} waiting requests is full; "
                "retry later"
            )
        for p in self.participants:
            p.request_added(req, handoff)
        self.requests[req.request_id] = req
        self.scheduler.add(req, first=bool(req.output_token_ids))

    def join_batch(self, req: Request) -> None:
        """A new request whose KV is in place and committed joins the running batch."""
        for p in self.participants:
            p.request_added(req, None)
        self._enter_batch(req)

    def _enter_batch(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add_running(req)

    def add_prefilled(self, msg: AddPrefilled) -> None:
        """A request prefilled elsewhere, for the role (a decode role takes it:
        roles/decode.py). A request this instance cannot take is answered with
        RequestRejected."""
        ready = self.role.add_prefilled(msg, self._prefilled_request)
        if ready is not None:
            self._enter_batch(ready)

    def _prefilled_request(self, msg: AddPrefilled) -> Request | None:
        """The request an AddPrefilled describes; None (RequestRejected sent) if invalid."""
        try:
            return prefilled_request(msg, self.model.config.vocab_size, self.max_model_len)
        except InvalidRequestError as e:
            self.post(RequestRejected(msg.request_id, e.message, e.param))
            return None

    def release(self, request_ids: Sequence[str]) -> None:
        """ReleaseKV: free what a participant keeps for each id (hand-off KV, a
        reservation, KV kept for a peer); the first that holds it frees it."""
        for rid in request_ids:
            any(p.release(rid) for p in self.participants)

    def abort(self, request_id: str) -> EngineOutput | None:
        """Cancel; its KV returns to the pool now. None if unknown or already finished."""
        if any(p.abort(request_id) for p in self.participants):
            return None
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._end(req, RequestStatus.FINISHED_ABORTED)
        return EngineOutput(
            request_id,
            (),
            finish_reason="abort",
            num_cached_tokens=req.num_cached_prompt_tokens,
            metrics=req.times.metrics(req.num_preemptions),
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def transfers_in_flight(self) -> bool:
        """KV moves run in the background: the loop should poll again soon."""
        return any(p.busy() for p in self.participants)

    def poll_transfers(self) -> None:
        """Advance the participants' background work without blocking: finished fetches
        join the batch, finished pushes free their blocks, leases expire, waiting KV is
        admitted (the decode admission rule, `AdmissionGate`)."""
        running = self.scheduler.running

        def admissible(req: Request, incoming: Sequence[Request]) -> bool:
            return self.admission(req, [*running, *incoming])

        for p in self.participants:
            free_slots = self.scheduler.config.max_num_seqs - len(running)
            for req in p.poll(free_slots, admissible):
                self._enter_batch(req)

    # ---- one step --------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """One step, or a decode burst of several: `bursts.last_steps` says how many."""
        sched = self.scheduler.schedule()
        start = time.perf_counter()
        quiet = (
            not (self.scheduler.waiting or self.scheduler.swapped)
            and self.runner.bursts
            and not any(p.wants_every_step or p.busy() for p in self.participants)
        )
        steps = self.bursts.plan(sched, bool(quiet), lambda s: _sampling_row(s, self.eos_token_ids))
        if steps > 1 and self.scheduler.extend(sched.seqs, steps):
            return self._burst(sched.seqs, steps, start)
        self.bursts.stepped(sched.empty)
        for p in self.participants:
            p.begin_step(sched.seqs)
        result = self.runner.execute(sched)
        for p in self.participants:
            p.end_step()
        for seq in sched.seqs:
            self.scheduler.advance(seq)
        outputs: list[EngineOutput] = []
        if result.logits is not None and result.hidden is not None:
            for p in self.participants:
                p.sampled(result.sampled, result.hidden)
            outputs = self._sample(result.sampled, result.logits, result.argmax)
        if steps > 0:  # a decode step a burst could have taken: its time sizes the next
            self.bursts.timed(len(sched.seqs), time.perf_counter() - start)
        self._step_ended()
        return outputs

    def _burst(self, seqs: list[ScheduledSeq], steps: int, start: float) -> list[EngineOutput]:
        """Up to `steps` greedy decode steps of `seqs` in one compiled call (their blocks
        already cover them): the tokens each step of its own would sample, committed and
        stop-checked one step at a time as `step` does; a request's tokens come back in
        one output. The call ends after a step that samples an EOS or stop token, and no
        row passes its length limit (`DecodeBursts.plan`), so no request gets a token
        after it finished."""
        for p in self.participants:
            p.begin_step(seqs)
        tokens = self.runner.execute_burst(seqs, steps, self.bursts.stop_ids(seqs))
        for p in self.participants:
            p.end_step()
        self.bursts.burst_ran(len(tokens))
        news: dict[str, list[EngineOutput]] = {}
        for step_tokens in tokens:
            for seq, token in zip(seqs, step_tokens, strict=True):
                req = seq.request
                if req.status is not RequestStatus.RUNNING:
                    continue  # finished at an earlier step of the burst
                self.scheduler.advance(seq)
                out = self._append(req, SampledToken(token), [])
                news.setdefault(req.request_id, []).append(out)
        if tokens:
            self.bursts.timed(len(seqs), (time.perf_counter() - start) / len(tokens))
        self._step_ended()
        return [merged(outs) for outs in news.values()]

    def _step_ended(self) -> None:
        running = self.scheduler.running
        for p in self.participants:
            p.step_ended(running)

    def _sample(
        self, sampled: list[ScheduledSeq], logits: torch.Tensor, argmax: torch.Tensor | None
    ) -> list[EngineOutput]:
        """Sample, append and stop-check the step's tokens; then the participants'
        first-token hook. argmax: the rows' argmax, when the step took it (`sample`)."""
        masks = _token_masks(self.participants, sampled)
        eos = self.eos_token_ids
        rows = [_sampling_row(s, eos, masks.get(s.request.request_id)) for s in sampled]
        tokens = sample(logits, rows, argmax)
        firsts: list[Request] = []
        outputs = [self._append(s.request, t, firsts) for s, t in zip(sampled, tokens, strict=True)]
        for req in firsts:  # a participant's say once a prompt is done (prefill: hand-off)
            if any(p.first_token(req) for p in self.participants):
                self._leave_batch(req)
        return outputs

    def _append(self, req: Request, tok: SampledToken, firsts: list[Request]) -> EngineOutput:
        """Add the sampled token, check the stop conditions; a request whose first token
        this is goes to `firsts`."""
        req.output_token_ids.append(tok.token_id)
        first = req.times.first_token is None
        if first:
            req.times.first_token = time.monotonic()
            firsts.append(req)
        status = stop_status(req, tok.token_id, self.eos_token_ids, self.max_model_len)
        if status is not RequestStatus.RUNNING:
            self._end(req, status)
        return token_output(req, tok, status, first)

    def _end(self, req: Request, status: RequestStatus) -> None:
        """`req` finished or was aborted: the participants' say (before its blocks go:
        KV to keep is pinned then), then out of the core, its blocks freed."""
        for p in self.participants:
            p.request_ended(req, status)
        self.requests.pop(req.request_id, None)
        self.scheduler.finish(req, status)

    def _leave_batch(self, req: Request) -> None:
        """A participant took `req` over: out of the batch, its KV kept (it frees it)."""
        for p in self.participants:
            p.request_ended(req, None)
        self.requests.pop(req.request_id, None)
        self.scheduler.detach(req)


def _sampling_row(
    seq: ScheduledSeq, eos: frozenset[int], allowed: torch.Tensor | None = None
) -> SamplingRow:
    r = seq.request
    return SamplingRow(r.params, r.generator, r.prompt_token_ids, r.output_token_ids, eos, allowed)


def _token_masks(
    participants: Sequence[Participant], sampled: list[ScheduledSeq]
) -> dict[str, torch.Tensor]:
    """The participants' masks of the rows' allowed tokens; two on one row: both."""
    masks: dict[str, torch.Tensor] = {}
    for p in participants:
        for rid, mask in p.token_masks(sampled).items():
            masks[rid] = mask if rid not in masks else masks[rid] & mask
    return masks


def _holdings(core: EngineCore) -> str | None:
    """None when `core` is idle, else what it still holds (`switch_role`)."""
    r = core.role
    counts = (
        len(core.requests),
        r.num_held,
        r.num_transferring,
        r.num_reserved,
        core.kv.num_used_blocks,
    )
    if not any(counts) and not r.busy() and not core.scheduler.has_unfinished():
        return None
    names = ("requests", "held", "transferring", "reserved", "blocks in use")
    return ", ".join(f"{name} {n}" for name, n in zip(names, counts, strict=True))


def _open_pool(
    config: EngineConfig, model: CausalLM, kv_config: KVCacheConfig, ranks: RankGroup | None
) -> tuple[TransferLink | None, KVCache]:
    """The KV pool of a core: a prefill or decode pool is its transfer region's tensor
    from the start (peers read and write it in place), and so is each of its ranks'; a
    colocated core opens a link only if it ever needs one (`EngineCore.transfer_link`)."""
    mc = model.config
    layout = KVLayout(
        num_layers=mc.num_hidden_layers,
        num_blocks=kv_config.num_blocks,
        block_size=kv_config.block_size,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        dtype=config.kv_dtype(model.quantization.quantized),
    )
    link = None
    if config.role is not Role.COLOCATED:
        link = open_link(config, _rank_layouts(layout, ranks))
    tensor = link.region.tensor if link is not None else None
    return link, KVCache(layout, kv_config.num_host_blocks, config.device, device_tensor=tensor)


def _rank_layouts(driver: KVLayout, ranks: RankGroup | None) -> list[KVLayout]:
    return [driver] if ranks is None else ranks.kv_layouts(driver)


def _handler_table(
    own: dict[type, Handler], participants: Sequence[Participant]
) -> dict[type, Handler]:
    """The core's input messages and its participants', one handler per type."""
    table = dict(own)
    for p in participants:
        for kind, handler in p.handlers().items():
            if kind in table:
                raise ValueError(f"two participants handle {kind.__name__}")
            table[kind] = handler
    return table
