"""EngineCore: schedule -> run -> sample -> check stop conditions, on token ids.

Text (detokenization, stop strings) is not the core's business: `Engine` layers an
output processor on top, and in serving the front end does that work while the core
runs in its own process. A stop string found there ends the request with `abort`.

The instance's role (colocated, prefill, decode) is one `EngineRole` whose hooks the core
calls at fixed points (`roles/base.py` lists them); the core never asks which role it
holds. `switch_role` replaces it between steps.

Any core also takes part in DéjàVu's KV replication (protocol/replica.py): as a source its
`Replicator` streams running requests' KV into a holder's region after every step
(`ReplicateTo`); as a holder its `ReplicaStore` keeps other instances' regions and
records, and `resume_from_replica` turns a replica into a request's KV when its source
died. Either opens the core's transfer link on first use.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import msgspec
import torch

from pdserve.config import DecodeAdmission, EngineConfig, Role
from pdserve.engine.admission import KVJob, admits, remaining_tokens
from pdserve.engine.cache_exchange import CacheExchange
from pdserve.engine.length_head import LengthHead
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.replica_store import ReplicaStore
from pdserve.engine.replicator import Replicator
from pdserve.engine.request import (
    Request,
    RequestStatus,
    generator_from_state,
    resumed_generator,
)
from pdserve.engine.roles import (
    ColocatedRole,
    DecodeRole,
    EngineRole,
    PrefillRole,
    TransferLink,
    TransferRole,
    open_link,
)
from pdserve.engine.sampler import SampledToken, SamplingRow, is_plain_greedy, sample
from pdserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from pdserve.errors import EngineOverloadedError, InvalidRequestError
from pdserve.kv.cache import KVCache
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.layout import KVLayout
from pdserve.kv.manager import KVManager
from pdserve.kv.transfer import LayoutMismatchError, Region, apply_plan, stream_in
from pdserve.model.base import CausalLM
from pdserve.protocol.cache import FetchPrefix, OfferKind, OfferPrefix, PrefixFetched, offer_id
from pdserve.protocol.core import EngineOutput, NewToken, RequestRejected
from pdserve.protocol.handoff import AddPrefilled, Handoff, ReserveKV
from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.replica import (
    DropReplicas,
    OpenReplicaStore,
    ReplicaBlocks,
    ReplicasStored,
    ReplicaStoreOpened,
    ReplicateTo,
    ResumeFromReplica,
    StoreReplicas,
)
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.validation import check_request
from pdserve.protocol.wire import EngineMessage

_TRANSFER_ROLES: dict[Role, type[TransferRole]] = {
    Role.PREFILL: PrefillRole,
    Role.DECODE: DecodeRole,
}


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        kv_config: KVCacheConfig,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        length_head: LengthHead | None = None,
    ) -> None:
        """`length_head`: predicts each fresh prompt's output length from its final hidden
        state (pdserve/engine/length_head.py); None: no predictions."""
        self.config = config
        self.model = model
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVManager(kv_config)
        # Messages for the controller besides step outputs (hand-offs, reservations).
        self.outbox: list[EngineMessage] = []
        mc = model.config
        layout = KVLayout(
            num_layers=mc.num_hidden_layers,
            num_blocks=kv_config.num_blocks,
            block_size=kv_config.block_size,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=config.kv_dtype(model.quantization.quantized),
        )
        # A prefill or decode pool is its transfer region's tensor from the start: peers
        # read and write it in place. A colocated core opens one if it ever switches.
        self.link: TransferLink | None = None
        if config.role is not Role.COLOCATED:
            self.link = open_link(config, layout)
        cache = KVCache(
            layout,
            kv_config.num_host_blocks,
            config.device,
            device_tensor=self.link.region.tensor if self.link is not None else None,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, config.device)
        self.runner = ModelRunner(model, cache, self.kv)
        # Decode bursts: the steps the last `step` ran, and the last decode step's time
        # for each batch size (what sizes a burst). Since start: forward steps run (a
        # burst's one by one), and those that ran inside bursts.
        self.last_steps = 1
        self._step_s: dict[int, float] = {}
        self.num_steps = 0
        self.num_burst_steps = 0
        self.requests: dict[str, Request] = {}
        # Output-length prediction at each prompt's first token. `prompt_state_sink`
        # (the predictor's data tool) sees each fresh prompt's final hidden state.
        self.length_head = length_head
        self.num_admission_waits = 0  # times a request was held back by the admission rule
        self.num_admission_held = 0  # requests it held back (each once, however long)
        # Decode role: prefilled requests taken with a predicted length, and the low ends
        # of their predicted buckets summed (the decode work length-aware dispatch spreads).
        self.num_predicted_decodes = 0
        self.predicted_decode_tokens = 0
        self.prompt_state_sink: Callable[[str, torch.Tensor], None] | None = None
        # DéjàVu replication: the holder side (other instances' replicas kept here) and
        # the source side (this instance's running requests streamed to a holder).
        self.replicas = ReplicaStore(config.instance_name, self._transfer_link)
        self.replicator = Replicator(
            self.kv, self.runner.cache, self._post, config.transfer.timeout_s
        )
        # Cluster-wide caching (protocol/cache.py): KV offered to and fetched from peers.
        self.exchange = CacheExchange(self.kv, self._transfer_link, self._post, config.transfer)
        self._take_role(config.role)

    # ---- the role --------------------------------------------------------------

    def switch_role(self, role: Role) -> None:
        """Make this a `role` instance (instance flip), between steps. The core must be
        idle: no request, and nothing held, moving or reserved for a hand-off, and no block
        in use; otherwise RuntimeError, and nothing changes.

        Prefill and decode need the pool in a transfer region (peers read and write it in
        place). A core that has none (built colocated) opens its link on the first switch
        to either: the transport of `config.transfer`, a region of the pool's layout, the
        transfer thread; the pool is copied into the region and the runner's cache uses the
        region's tensor from then on. The copy keeps the prefix cache valid: cached blocks
        keep their KV, the block accounting does not change. The link then stays open
        until `close`: switching back to colocated keeps it (nothing is handed to peers
        any more), and a later switch reuses it without a copy. A role the config refuses
        (prefill or decode on a GPU: EngineConfig's rule) is a ValueError, nothing changed."""
        config = dataclasses.replace(self.config, role=role)  # validated before any change
        idle = self._idle_report()
        if idle is not None:
            raise RuntimeError(
                f"cannot switch the {self.config.role.value} core to {role.value}: it is not "
                f"idle ({idle}); switch between steps once it has drained"
            )
        self._take_role(role)
        self.config = config

    def _idle_report(self) -> str | None:
        """None when idle, else what the core still holds."""
        r = self.role
        counts = (
            len(self.requests),
            r.num_held,
            r.num_transferring,
            r.num_reserved,
            self.kv.num_used_blocks,
        )
        if not any(counts) and not r.busy() and not self.scheduler.has_unfinished():
            return None
        names = ("requests", "held", "transferring", "reserved", "blocks in use")
        return ", ".join(f"{name} {n}" for name, n in zip(names, counts, strict=True))

    def _take_role(self, role: Role) -> None:
        self.role: EngineRole
        if role is Role.COLOCATED:
            self.role = ColocatedRole(self._post)
        else:
            link = self._transfer_link()
            self.role = _TRANSFER_ROLES[role](self.kv, link, self.config.transfer, self._post)
        self.runner.hooks = self.role.forward_hooks

    def _transfer_link(self) -> TransferLink:
        """This core's link; opened on first use, the pool moving into its region."""
        if self.link is None:
            cache = self.runner.cache
            link = open_link(self.config, cache.layout)
            link.region.tensor.copy_(cache.device_tensor)
            cache.device_tensor = link.region.tensor
            self.link = link
        return self.link

    @property
    def kv_layout(self) -> KVLayout:
        """Geometry of this instance's device KV tensor (as the transfer library sees it)."""
        return self.runner.cache.layout

    def _post(self, msg: EngineMessage) -> None:
        self.outbox.append(msg)

    def take_messages(self) -> list[EngineMessage]:
        out, self.outbox = self.outbox, []
        return out

    def close(self) -> None:
        """Stop transfer threads and release the KV regions (shared memory): the pool's
        and the replica regions held for other instances. A replication write in flight
        is waited for first (the only place the core waits for one)."""
        self.replicator.close(self.config.transfer.timeout_s)
        self.exchange.close()
        self.replicas.close()
        if self.link is not None:
            self.link.close()

    def check_integrity(self) -> None:
        """AssertionError unless the pool's and the replica store's accounting hold."""
        self.kv.check_integrity()
        self.replicas.check_integrity()

    # ---- requests --------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival: float | None = None,
        handoff: Handoff | None = None,
        output_token_ids: Sequence[int] = (),
        prediction: LengthPrediction | None = None,
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
        so greedy and seeded requests continue exactly as if nothing had happened.
        `prediction`: its output length as predicted where it was first prefilled (a
        migrated request); a fresh prompt gets one from this core's length head."""
        req = self._new_request(request_id, prompt_token_ids, params, arrival, output_token_ids)
        req.prediction = prediction
        self._check_queue()
        self._queue(req, handoff)
        return req

    def _new_request(
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
        prompt = list(prompt_token_ids)
        self._validate(prompt, params)
        outputs = list(output_token_ids)
        if len(outputs) >= params.max_tokens:
            raise InvalidRequestError(
                f"a migrated request carries {len(outputs)} generated tokens, which leaves "
                f"nothing to generate under max_tokens={params.max_tokens}",
                "output_token_ids",
            )
        gen = resumed_generator(params, len(outputs))
        req = Request(request_id, prompt, params, gen, output_token_ids=outputs)
        if arrival is not None:
            req.times.arrival = arrival
        if outputs:
            req.times.first_token = req.times.arrival  # not a first token: no hand-off
        return req

    def _queue(self, req: Request, handoff: Handoff | None) -> None:
        """Queue a new request (a migrated one ahead of the waiting ones)."""
        self.role.request_added(req, handoff)
        self.requests[req.request_id] = req
        self.scheduler.add(req, first=bool(req.output_token_ids))

    # ---- replication (protocol/replica.py) ----------------------------------------

    def open_replica_store(self, msg: OpenReplicaStore) -> None:
        """Holder: a region for `msg.source`'s replicas (ReplicaStoreOpened)."""
        handle = self.replicas.open(msg.source, msg.layout)
        self._post(ReplicaStoreOpened(msg.source, handle))

    def store_replicas(self, msg: StoreReplicas) -> None:
        """Holder: record replicas (ReplicasStored: those recorded)."""
        self._post(ReplicasStored(msg.source, self.replicas.store(msg.source, msg.replicas)))

    def drop_replicas(self, msg: DropReplicas) -> None:
        self.replicas.drop(msg.source, msg.request_ids)

    def replicate_to(self, msg: ReplicateTo) -> None:
        """Source: stream running requests' KV into `msg.region` (None: stop). ValueError
        when the region's geometry is not the pool's (nothing changes then)."""
        if msg.region is None:
            self.replicator.stop()
        else:
            self.replicator.start(msg.holder, msg.region, self._transfer_link())

    def resume_from_replica(self, msg: ResumeFromReplica) -> Request:
        """Holder: continue `msg.request` from its replica (DéjàVu §4.3). The replica's KV
        of the first `num_tokens` tokens (at most all tokens but the last) is copied into
        pool blocks (prefix-cache hits first), committed, and the request joins the batch:
        the next step computes the tokens after `num_tokens` and samples on. When the
        replica is unknown, shorter than `num_tokens` or unusable, or the pool or batch
        has no room, the request is recomputed instead, as `add_request` would queue it.
        The replica is consumed either way. Raises like `add_request` (nothing changes)."""
        r = msg.request
        req = self._new_request(
            r.request_id, r.prompt_token_ids, r.params, r.arrival, r.output_token_ids
        )
        req.prediction = r.prediction
        found = self.replicas.get(msg.source, msg.replica_id)
        if found is None or not self._place_replica(req, *found, msg.num_tokens):
            self._check_queue()
            self._queue(req, None)
        else:
            self.role.request_added(req, None)
            self._join_batch(req)
        self.replicas.drop(msg.source, [msg.replica_id])
        return req

    def _place_replica(
        self, req: Request, region: Region, replica: ReplicaBlocks, num_tokens: int
    ) -> bool:
        """Give `req` pool blocks holding its first `num_tokens` tokens' KV (from the
        prefix cache, then copied from the replica) and commit them. False, with nothing
        allocated, when that cannot be done."""
        tokens = req.all_token_ids
        n = min(num_tokens, len(tokens) - 1)
        room = len(self.scheduler.running) < self.scheduler.config.max_num_seqs
        if n <= 0 or replica.num_tokens < n or not room:
            return False
        rid = req.request_id
        cached = self.kv.match_prefix(tokens).num_cached_tokens
        alloc = self.kv.allocate(rid, tokens, max(n - cached, 0))
        if alloc is None:
            return False
        cached = alloc.num_cached_tokens
        try:
            self._copy_replica(rid, region, replica, cached, n)
        except LayoutMismatchError:
            self.kv.free(rid)
            return False
        done = max(n, cached)
        self.kv.commit(rid, tokens, done)
        req.num_computed_tokens = done
        req.num_cached_prompt_tokens = min(cached, len(req.prompt_token_ids))
        return True

    def _copy_replica(
        self, request_id: str, region: Region, replica: ReplicaBlocks, start: int, end: int
    ) -> None:
        """Copy tokens [start, end) from the replica region into the request's blocks
        (both are tensors of this process). LayoutMismatchError if the replica's table or
        geometry does not fit."""
        if end <= start:
            return
        plan = stream_in(
            region.handle.layout,
            replica.blocks,
            self.kv_layout,
            self.kv.block_table(request_id),
            start,
            end,
        )
        apply_plan(plan, region.tensor, self.runner.cache.device_tensor)

    def add_prefilled(self, msg: AddPrefilled) -> None:
        """Decode role: a request prefilled elsewhere (see roles/decode.py). A request
        this instance cannot take is answered with RequestRejected."""
        ready = self.role.add_prefilled(msg, self._prefilled_request)
        if ready is not None:
            self._join_batch(ready)

    def _prefilled_request(self, msg: AddPrefilled) -> Request | None:
        """The request an AddPrefilled describes; None (RequestRejected sent) if invalid."""
        try:
            self._validate(msg.prompt_token_ids, msg.params)
        except InvalidRequestError as e:
            self._post(RequestRejected(msg.request_id, e.message, e.param))
            return None
        gen = generator_from_state(msg.generator_state)
        req = Request(msg.request_id, list(msg.prompt_token_ids), msg.params, gen)
        req.output_token_ids = list(msg.output_token_ids)
        req.times.arrival = msg.arrival
        req.return_to = msg.return_to
        req.prediction = msg.prediction
        if req.prediction is not None:
            self.num_predicted_decodes += 1
            self.predicted_decode_tokens += req.prediction.low
        return req

    def reserve(self, msg: ReserveKV) -> None:
        """Decode role, push modes: reserve blocks (KVReserved once granted)."""
        self.role.reserve(msg)

    def release(self, request_ids: Sequence[str]) -> None:
        """ReleaseKV: free hand-off KV (held prompt KV, or a reservation) or unpin KV
        offered to another instance."""
        for rid in request_ids:
            if not self.exchange.release(rid):
                self.role.release(rid)

    def fetch_prefix(self, msg: FetchPrefix) -> None:
        """Copy the offered KV this instance lacks into its prefix cache."""
        self.exchange.fetch(msg)

    def offer_prefix(self, msg: OfferPrefix) -> None:
        """Pin what the prefix cache holds of `msg.token_ids` for instance `msg.to`
        (KVOffered); PrefixFetched with the reason when it holds none of it."""
        if not self.exchange.offer(msg.offer_id, OfferKind.PREFETCH, msg.token_ids, msg.to):
            name = self.config.instance_name
            self._post(PrefixFetched(msg.offer_id, name, 0, 0, 0, "not cached here any more"))

    def _join_batch(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add_running(req)

    def _check_queue(self) -> None:
        limit = self.scheduler.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise EngineOverloadedError(
                f"the server is overloaded: its queue of {limit} waiting requests is full; "
                "retry later"
            )

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        check_request(prompt, params, self.model.config.vocab_size, self.max_model_len)

    def abort(self, request_id: str) -> EngineOutput | None:
        """Cancel; its KV returns to the pool now. None if unknown or already finished."""
        if self.role.abort(request_id):
            return None
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self.replicator.request_ended(request_id)
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
        return self.role.busy() or self.replicator.busy() or self.exchange.busy()

    def poll_transfers(self) -> None:
        """Advance hand-offs without blocking: finished fetches join the batch, finished
        pushes free their blocks, leases expire, waiting KV is admitted."""
        free_slots = self.scheduler.config.max_num_seqs - len(self.scheduler.running)
        for req in self.role.poll(free_slots, self._admissible):
            self._join_batch(req)
        self.replicator.poll()
        self.exchange.poll()

    def _admissible(self, req: Request, incoming: Sequence[Request]) -> bool:
        """Decode admission (engine/admission.py): may `req`, prefilled elsewhere, join
        the batch (the running requests and `incoming`, those whose KV is on its way)?
        An empty batch admits anything (allocation decides), so no prediction, however
        wrong, can keep an idle instance from taking work."""
        policy = self.scheduler.config.decode_admission
        batch = [*self.scheduler.running, *incoming]
        if policy is DecodeAdmission.GREEDY or not batch:
            return True
        jobs = [self._kv_job(r) for r in batch]
        bs = self.kv.cfg.block_size
        if admits(policy, jobs, self._kv_job(req), self.kv.num_obtainable_blocks, bs):
            return True
        self.num_admission_waits += 1
        self.num_admission_held += not req.held_by_admission
        req.held_by_admission = True
        return False

    def _kv_job(self, req: Request) -> KVJob:
        generated = len(req.output_token_ids)
        left = min(req.params.max_tokens - generated, self.max_model_len - req.num_tokens)
        return KVJob(req.num_tokens, remaining_tokens(req.prediction, generated, left))

    # ---- one step --------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """One step, or a decode burst of several (see `_burst`): `last_steps` says how
        many ran."""
        sched = self.scheduler.schedule()
        start = time.perf_counter()
        steps = self._burst_steps(sched)
        if steps > 1 and self.scheduler.extend(sched.seqs, steps):
            return self._burst(sched.seqs, steps, start)
        self.last_steps = 1
        self.num_steps += 0 if sched.empty else 1
        self.role.begin_step(sched.seqs)
        result = self.runner.execute(sched)
        self.role.end_step()
        for seq in sched.seqs:
            self.scheduler.advance(seq)
        outputs: list[EngineOutput] = []
        if result.logits is not None and result.hidden is not None:
            self._predict(result.sampled, result.hidden)
            outputs = self._sample(result.sampled, result.logits, result.argmax)
        if steps > 0:  # a decode step a burst could have taken: its time sizes the next
            self._step_s[len(sched.seqs)] = time.perf_counter() - start
        # The step's KV is committed and ended requests are gone: replicate the rest.
        self.replicator.after_step(self.scheduler.running)
        return outputs

    # ---- decode bursts -----------------------------------------------------------

    def _burst_steps(self, sched: SchedulerOutput) -> int:
        """How many steps this one may run as a burst: 0 when it cannot be one (not a
        step of greedy decodes alone, something waits, a role or the replicator wants
        every step, no compiled path), else up to `decode_burst`, no more than any row
        has left before its length limit and as many as fit `decode_burst_ms` at the last
        decode step's time for this batch size (1 until one was timed; 1, the rows not
        looked at, when two steps do not fit: at b=64 a row's checks cost ~0.1 ms)."""
        cfg = self.scheduler.config
        sch = self.scheduler
        if cfg.decode_burst == 1 or sched.empty or sched.swap_in or sched.swap_out:
            return 0
        if sch.waiting or sch.swapped or not self.runner.bursts:
            return 0
        if self.role.forward_hooks is not None or self.replicator.active:
            return 0
        if self.transfers_in_flight():
            return 0
        timed = self._step_s.get(len(sched.seqs))
        if timed is not None and cfg.decode_burst_ms / 1000 / timed < 2:
            return 1  # no burst fits this batch size (its rows go unchecked); still timed
        steps = cfg.decode_burst
        for s in sched.seqs:
            req = s.request
            if s.num_new_tokens != 1 or not s.samples or not req.output_token_ids:
                return 0
            if not is_plain_greedy(self._sampling_row(s)):
                return 0
            left = min(
                req.params.max_tokens - len(req.output_token_ids),
                self.max_model_len - req.num_tokens,
            )
            steps = min(steps, left)
        if timed is None:
            return 1
        return max(1, min(steps, int(cfg.decode_burst_ms / 1000 / timed)))

    def _burst(self, seqs: list[ScheduledSeq], steps: int, start: float) -> list[EngineOutput]:
        """Up to `steps` greedy decode steps of `seqs` in one compiled call (their blocks
        already cover them): the tokens each step of its own would sample, committed and
        stop-checked one step at a time as `step` does; a request's tokens come back in
        one output. The call ends after a step that samples an EOS or stop token, and no
        row passes its length limit (`_burst_steps`), so no request gets a token after it
        finished."""
        self.role.begin_step(seqs)
        tokens = self.runner.execute_burst(seqs, steps, self._stop_ids(seqs))
        self.role.end_step()
        self.last_steps = len(tokens)
        self.num_steps += len(tokens)
        self.num_burst_steps += len(tokens)
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
            self._step_s[len(seqs)] = (time.perf_counter() - start) / len(tokens)
        self.replicator.after_step(self.scheduler.running)
        return [_merged(outs) for outs in news.values()]

    def _stop_ids(self, seqs: Sequence[ScheduledSeq]) -> set[int]:
        """Every token that ends one of `seqs` (EOS unless ignored, its stop ids)."""
        stop: set[int] = set()
        for s in seqs:
            p = s.request.params
            stop.update(p.stop_token_ids)
            if not p.ignore_eos:
                stop.update(self.eos_token_ids)
        return stop

    def _predict(self, sampled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Predict the output length of each fresh prompt sampling its first token (one
        small matmul on rows the step computed anyway)."""
        if self.length_head is None and self.prompt_state_sink is None:
            return
        rows = [
            i
            for i, s in enumerate(sampled)
            if s.request.prediction is None and not s.request.output_token_ids
        ]
        if not rows:
            return
        reqs = [sampled[i].request for i in rows]
        states = hidden[rows]
        if self.prompt_state_sink is not None:
            for req, state in zip(reqs, states, strict=True):
                self.prompt_state_sink(req.request_id, state)
        if self.length_head is not None:
            lens = [len(r.prompt_token_ids) for r in reqs]
            for req, pred in zip(reqs, self.length_head.predict(states, lens), strict=True):
                req.prediction = pred

    def _sample(
        self, sampled: list[ScheduledSeq], logits: torch.Tensor, argmax: torch.Tensor | None
    ) -> list[EngineOutput]:
        """Sample, append and stop-check the step's tokens; then the role's first-token
        hook. argmax: the rows' argmax, when the step took it (`sample`)."""
        tokens = sample(logits, [self._sampling_row(s) for s in sampled], argmax)
        firsts: list[Request] = []
        outputs = [self._append(s.request, t, firsts) for s, t in zip(sampled, tokens, strict=True)]
        for req in firsts:  # the role's say once a prompt is done (prefill: the hand-off)
            if self.role.first_token(req):
                self._leave_batch(req)
        return outputs

    def _sampling_row(self, seq: ScheduledSeq) -> SamplingRow:
        r = seq.request
        return SamplingRow(
            r.params, r.generator, r.prompt_token_ids, r.output_token_ids, self.eos_token_ids
        )

    def _append(self, req: Request, tok: SampledToken, firsts: list[Request]) -> EngineOutput:
        """Add the sampled token, check the stop conditions; a request whose first token
        this is goes to `firsts`."""
        req.output_token_ids.append(tok.token_id)
        first = req.times.first_token is None
        if first:
            req.times.first_token = time.monotonic()
            firsts.append(req)
        status = self._check_stop(req, tok.token_id)
        new = (NewToken(tok.token_id, tok.logprob, tok.top_logprobs),)
        prediction = req.prediction if first else None  # said once, with the first token
        if status is RequestStatus.RUNNING:
            return EngineOutput(
                req.request_id,
                new,
                num_cached_tokens=req.num_cached_prompt_tokens,
                prediction=prediction,
            )
        self.requests.pop(req.request_id, None)
        if req.return_to is not None:  # pinned before the request lets go of its blocks
            self._offer_kv(req, req.return_to)
        self.scheduler.finish(req, status)
        self.replicator.request_ended(req.request_id)
        return EngineOutput(
            req.request_id,
            new,
            finish_reason=status.value,
            stop_reason=req.stop_reason,
            stopped_by_token=status is RequestStatus.FINISHED_STOPPED,
            num_cached_tokens=req.num_cached_prompt_tokens,
            metrics=req.times.metrics(req.num_preemptions),
            prediction=prediction,
        )

    def _offer_kv(self, req: Request, to: str) -> None:
        """PD-Caching-3: offer the KV of a finished request's prompt and answer (the
        full blocks whose KV was computed: the scheduler committed them to the prefix
        index step by step) to instance `to`."""
        bs = self.kv.cfg.block_size
        full = req.num_computed_tokens // bs * bs
        kind, tokens = OfferKind.RETURN, req.all_token_ids[:full]
        self.exchange.offer(offer_id(kind, req.request_id), kind, tokens, to)

    def _leave_batch(self, req: Request) -> None:
        """The role took `req` over: out of the batch, its KV kept (the role frees it)."""
        self.requests.pop(req.request_id, None)
        self.scheduler.detach(req)
        self.replicator.request_ended(req.request_id)

    def _check_stop(self, req: Request, token: int) -> RequestStatus:
        p = req.params
        n = len(req.output_token_ids)
        if n > p.min_tokens or n == p.max_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return RequestStatus.RUNNING


def _merged(outputs: list[EngineOutput]) -> EngineOutput:
    """One request's outputs of a burst's steps as one: all their tokens, the last's state
    (only the last can have finished; none is a first token, so none has a prediction)."""
    if len(outputs) == 1:
        return outputs[0]
    tokens = tuple(t for out in outputs for t in out.new_tokens)
    return msgspec.structs.replace(outputs[-1], new_tokens=tokens)
