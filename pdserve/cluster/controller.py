"""`Cluster`: the one front end, in front of one engine or many instances.

It owns the request table, tokenization, detokenization and stop strings
(`OutputProcessor`), cancellation, timings (`RequestTimes`), and the choice of instances;
each instance is an engine process behind an `Instance` handle. It is the
`ServingBackend` the HTTP server runs on, and what `pdserve serve` starts for every
deployment: a single engine is a cluster of one colocated instance (named "engine").
One class rather than a single-engine client beside a cluster: the request life cycle,
stop strings, aborts and engine death then have one implementation, and the only
differences of a lone engine are policy - it has nowhere to retry, so a silent engine
is never declared dead and its death fails every request with `EngineDeadError` (HTTP
500, "the engine is not available"), as a server with no engine left must.

Request life cycle (disaggregated; `_Record.phase`):

    pull:  PREFILL  AddRequest(handoff=pull) -> prefill instance P (shortest queue)
           P streams the first token back (forwarded at once: that is the TTFT) and
           KVHandedOff(source) -> choose decode instance D -> AddPrefilled(source) to D
           HANDOFF  D fetches when it has room -> KVReceived -> ReleaseKV to P
           DECODE   D streams the remaining tokens
    push:  RESERVING  ReserveKV -> D (chosen first) -> KVReserved(target)
           PREFILL    AddRequest(handoff=push, target) -> P; P writes into D's blocks
           HANDOFF    KVHandedOff -> AddPrefilled(no source) -> D -> KVReceived
           DECODE

Failures (`cluster/recovery.py`, docs/fault-tolerance.md): when an instance dies every
request on it is migrated (at most `max_migrations` times), and a `HandoffFailed` with
both instances alive is retried (at most `max_retries` times). A request that streamed
nothing yet starts again from its prompt; one that did continues after its last streamed
token on a live instance that decodes (`AddRequest.output_token_ids`: the KV of prompt and
tokens is recomputed there; a seeded generator skips the draws already taken), so the
client's stream only pauses. With no live instance of a role left the other role runs
requests whole. Past the bound, or with no live instance at all, the request ends with
`InstanceFailedError` (HTTP 503). A dead instance is fenced: its process is killed and
gone before its requests move, and nothing it sent after its death is read. Every path
releases what the other side holds (ReleaseKV / AbortRequests), so no block stays
allocated for a request that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec
import zmq.asyncio

from pdserve.cluster.cache_copies import CacheCopies
from pdserve.cluster.config import ClusterConfig, DecodePolicy
from pdserve.cluster.instance import Instance, Launcher, LocalLauncher
from pdserve.cluster.policies import DecodeChooser
from pdserve.cluster.recovery import FaultCounters
from pdserve.cluster.replication import RecoveryCost, ring
from pdserve.cluster.routing import Donor, RouteKey, Router, session_key
from pdserve.config import EngineConfig, Role, TransferMode
from pdserve.engine.admission import remaining_tokens
from pdserve.engine.length_head import HeadSpec, read_head
from pdserve.engine.output_processor import LoopBudget, OutputProcessor
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.validation import check_request
from pdserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InstanceFailedError,
    InvalidRequestError,
)
from pdserve.model.loader import resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.predictor.confusion import PredictionCounters
from pdserve.protocol.cache import KVOffered, PrefixFetched
from pdserve.protocol.core import (
    AbortRequests,
    AddRequest,
    EngineOutput,
    EngineStats,
    LoadReport,
    OutputBatch,
    RequestRejected,
    WeightsInfo,
)
from pdserve.protocol.handoff import (
    AddPrefilled,
    Handoff,
    HandoffFailed,
    KVHandedOff,
    KVReceived,
    KVReserved,
    ReleaseKV,
    ReserveKV,
)
from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.replica import (
    DropReplicas,
    KVReplicated,
    OpenReplicaStore,
    ReplicasStored,
    ReplicaStoreOpened,
    ReplicateTo,
    ResumeFromReplica,
    StoreReplicas,
)
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.timing import RequestTimes
from pdserve.protocol.wire import EngineMessage, Handlers

_WATCH_S = 0.1
_RESTART_TRIES = 5  # --ray-restart: starts tried for one dead instance
_RESTART_WAIT_S = 2.0  # between them
log = logging.getLogger("pdserve.recovery")

Item = RequestOutput | BaseException


class Phase(StrEnum):
    RESERVING = "reserving"  # push: waiting for the decode instance's blocks
    # Not sent yet: its prefill instance is receiving a copy of more of its prompt (its
    # own prefix fetch, or the return of the previous turn: cluster/cache_copies.py).
    WAITING_FOR_KV = "waiting-for-kv"
    PREFILL = "prefill"  # at the prefill (or colocated) instance
    HANDOFF = "handoff"  # first token out; KV on its way to the decode instance
    DECODE = "decode"  # KV in place; generating at the decode instance


@dataclass
class _Record:
    """One row of the request table."""

    request_id: str  # the client's; instances see `key` (one per attempt)
    prompt: list[int]
    params: SamplingParams
    arrival: float
    queue: asyncio.Queue[Item]
    route: RouteKey  # what the router knows of it (cluster/routing.py)
    phase: Phase = Phase.PREFILL
    prefill: Instance | None = None  # holds (or will hold) something for this attempt
    decode: Instance | None = None
    # Instances whose assigned load counts this request (released exactly once).
    credit_prefill: Instance | None = None
    credit_decode: Instance | None = None
    credit_tokens: int = 0  # the prompt tokens `credit_prefill` has to compute
    # What the prompt trees said the prefill instance (or a prefix fetch's donor) holds.
    predicted_cached: int = 0
    # PD-Caching-3: where its decode instance returns its KV when it finishes.
    return_to: Instance | None = None
    # Prompt tokens the instance that ran the prefill served from its cache (the
    # `cached_tokens` of the API), as its first output said; None before it.
    cached_tokens: int | None = None
    attempts: int = 0  # dispatches after the first (retries and migrations)
    migrations: int = 0
    streamed: list[int] = field(default_factory=list)  # token ids forwarded to the client
    recompute: int = 0  # tokens a move sent to be computed again (counted on its output)
    # Replication (`config.replicate`): where this attempt's KV is replicated and how far
    # the holder acknowledged it (tokens of prompt + output).
    replica_source: Instance | None = None
    replica_holder: Instance | None = None
    replicated: int = 0
    # Its output length as predicted at the prefill (first output), and whether
    # `credit_decode` counts it as a heavy decode (cluster/policies.py).
    prediction: LengthPrediction | None = None
    heavy: bool = False
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(self.arrival)

    def forget_replica(self) -> None:
        self.replica_source = self.replica_holder = None
        self.replicated = 0

    @property
    def key(self) -> str:
        """The id instances know this attempt by: messages about an earlier attempt
        (stragglers) cannot be mistaken for the current one."""
        return self.request_id if self.attempts == 0 else f"{self.request_id}~move{self.attempts}"


@dataclass(frozen=True)
class _Replica:
    """A lost request's replicated KV: on `holder`, under `source`'s name and the key the
    source knew the request by, through `tokens` tokens."""

    holder: Instance
    source: str
    key: str
    tokens: int


class Cluster:
    def __init__(
        self, config: ClusterConfig, engine: EngineConfig, launcher: Launcher | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        # Where the instances' processes run: children of this process by default.
        self.launcher: Launcher = launcher or LocalLauncher()
        self.mode = engine.transfer.mode
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.weights = WeightsInfo("none", [])
        self.instances: list[Instance] = []
        self.records: dict[str, _Record] = {}  # by key (see _Record.key)
        # Push modes: decode reservations to release once the prefill side confirms it
        # stopped writing into them (key -> (prefill, decode)).
        self._push_stops: dict[str, tuple[Instance, Instance]] = {}
        self.decode_chooser = DecodeChooser(config.decode_policy, config.seed)
        self.router = Router(config, engine.cache.block_size, self.decode_chooser)
        self.recovery = RecoveryCost()
        # KV copied into prefix caches (returns, prefix fetches), and requests waiting.
        self.copies = CacheCopies(
            config,
            engine.cache.block_size,
            self.router,
            self.recovery,
            self._instance,
            self._send_waiting,
        )
        self._ctx = zmq.asyncio.Context()
        self._processor: OutputProcessor | None = None
        self._budget = LoopBudget()
        self._ids = itertools.count()
        self._watch: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()  # --ray-restart: starts in flight
        self._closed = False
        self._dead: EngineDeadError | None = None  # a lone engine died: why
        self._handlers = Handlers[Awaitable[None] | None](
            {
                OutputBatch: self._on_outputs,
                KVHandedOff: self._on_handed_off,
                KVReserved: self._on_reserved,
                KVReceived: self._on_received,
                HandoffFailed: self._on_handoff_failed,
                RequestRejected: self._on_rejected,
                ReplicaStoreOpened: self._on_store_opened,
                KVReplicated: self._on_replicated,
                ReplicasStored: self._on_replicas_stored,
                KVOffered: self.copies.on_offered,
                PrefixFetched: self.copies.on_fetched,
            }
        )
        self.faults = FaultCounters()
        self.predictions = PredictionCounters(_head_spec(engine.length_predictor))
        self.holders: dict[str, Instance] = {}  # replication: source name -> holder

    # ---- life cycle ----------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        engine: EngineConfig,
        config: ClusterConfig | None = None,
        timeout: float = 600.0,
        launcher: Launcher | None = None,
    ) -> Cluster:
        """Start every instance (in parallel) and wait until all are ready. `config`
        None: a single engine. `launcher`: where the instances' processes run (None:
        children of this process; cluster/ray_launch.py: Ray actors). Raises what a
        failed start reports (EngineDeadError with the engine's message,
        ModelLoadError); no process is left running then."""
        cluster = cls(config or ClusterConfig(num_colocated=1), engine, launcher)
        try:
            await cluster._start(timeout)
        except BaseException:
            await cluster.shutdown()
            raise
        return cluster

    @property
    def single_engine(self) -> bool:
        """One instance: nowhere to retry or fail over (see the module docstring)."""
        return self.config.num_instances == 1

    async def _start(self, timeout: float) -> None:
        silence = None if self.single_engine else self.config.instance_timeout_s
        path = resolve_model(self.engine.model)
        self.tokenizer = await asyncio.to_thread(Tokenizer.from_model_path, path)
        self._processor = OutputProcessor(self.tokenizer)
        # The instances get the stop ids from here: each would build the tokenizer again.
        stops = tuple(self.tokenizer.stop_token_ids)
        self.instances = [
            Instance(
                dataclasses.replace(cfg, stop_token_ids=stops),
                self._ctx,
                self._on_message,
                silence,
                self._on_report,
                self.launcher,
            )
            for cfg in instance_configs(self.config, self.engine)
        ]
        await asyncio.gather(*(self._start_instance(i, timeout) for i in self.instances))
        self.max_model_len = min(i.max_model_len for i in self.instances)
        self.vocab_size = self.instances[0].vocab_size
        self.weights = self.instances[0].weights  # every instance loads the same way
        self._arrange_replication()
        self._watch = asyncio.create_task(self._watchdog())

    async def _start_instance(self, inst: Instance, timeout: float) -> None:
        try:
            await inst.start(timeout)
        except EngineDeadError as e:
            if self.single_engine:
                raise
            raise EngineDeadError(f"{inst.name}: {e}") from None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Fail what is open, then stop every instance (Shutdown; killed past `timeout`)."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        for task in self._restarts:
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        self._fail_all(EngineDeadError("the server is shutting down"))
        await asyncio.gather(*(i.shutdown(timeout) for i in self.instances))
        self._ctx.term()

    def of_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances if i.role is role]

    def live(self, role: Role) -> list[Instance]:
        return [i for i in self.instances if i.role is role and i.alive]

    @property
    def is_alive(self) -> bool:
        """Some instance can serve: with only prefill or only decode instances left, they
        run requests whole (see `_dispatch`)."""
        if self._closed or self._dead is not None:
            return False
        return any(i.alive for i in self.instances)

    # ---- requests ------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        session: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs; the last has `finished=True`.

        A request an instance refuses raises `InvalidRequestError` (or
        `EngineOverloadedError`: its waiting queue is full) from the first iteration;
        nothing was allocated for it. A consumer that stops iterating (client gone, task
        cancelled) aborts the request: the instance frees its KV before its next step.
        An instance failure ends the stream with `InstanceFailedError` (or, for a lone
        engine, `EngineDeadError`) unless the request can be retried elsewhere.
        `session`: the client's session id (any string; `session` routing keeps a
        session's requests on the same instances)."""
        if not self.is_alive:
            raise self._dead or EngineDeadError("no live instance can serve requests")
        assert self._processor is not None
        token_ids = self._tokenize(prompt)
        check_request(token_ids, params, self.vocab_size, self.max_model_len)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.records:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        sid = session_key(session) if session is not None else None
        route = self.router.key(token_ids, sid)
        rec = _Record(rid, token_ids, params, time.monotonic(), asyncio.Queue(), route)
        self.records[rid] = rec
        self._processor.add(rid, token_ids, params)
        finished = False
        try:
            self._dispatch(rec)
            while not finished:
                item = await rec.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.records.pop(rec.key, None)
            self._processor.discard(rid)
            self._release(rec, abort=not finished)

    def cancel_all(self, error: Exception) -> int:
        for rec in self.records.values():
            rec.queue.put_nowait(error)
        return len(self.records)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        assert self.tokenizer is not None
        return self.tokenizer.prompt_ids(prompt)

    # ---- dispatch ------------------------------------------------------------------

    def _dispatch(self, rec: _Record) -> None:
        """Send a request (new, or moved before it streamed anything) to its first
        instance. With every prefill (or every decode) instance dead, a live instance of
        the other role runs it whole: slower for everyone, but no request is refused."""
        rec.phase = Phase.PREFILL
        rec.return_to = None
        if not self.config.disaggregated:
            self._send_prefill(rec, self.of_role(Role.COLOCATED), None)
        elif not self.live(Role.DECODE):
            self._send_prefill(rec, self.of_role(Role.PREFILL), None)
        elif not self.live(Role.PREFILL):
            self._run_whole_on_decode(rec)
        elif self.mode is TransferMode.PULL:
            self._send_prefill(rec, self.of_role(Role.PREFILL), Handoff(self.mode.value))
        else:
            decode = self._choose_decode(rec)
            if decode is not None:
                rec.phase = Phase.RESERVING
                decode.send(ReserveKV(rec.key, rec.prompt))

    def _send_prefill(
        self, rec: _Record, candidates: list[Instance], handoff: Handoff | None
    ) -> None:
        """Route the request to a prefill instance and send it there - or, while a copy
        of more of its prompt is on its way there (or worth starting: a prefix fetch),
        park it until that copy ends (cluster/cache_copies.py)."""
        choice = self.router.prefill(candidates, rec.route)
        if choice is None:
            self._fail(rec, InstanceFailedError("no live prefill instance"))
            return
        inst, cached = choice.instance, choice.cached_tokens
        request = AddRequest(rec.key, rec.prompt, rec.params, rec.arrival, handoff)
        inbound = self.copies.inbound(inst, rec.prompt, rec.route.hashes)
        if inbound is not None and inbound[1] <= cached:
            inbound = None  # it brings nothing the instance lacks
        donor = None if inbound or not handoff else self._prefix_donor(rec, inst, cached)
        rec.predicted_cached = cached  # the tree's belief (a miss: it held less)
        if inbound is not None:
            cached = inbound[1]
        elif donor is not None:
            cached = rec.predicted_cached = donor.cached_tokens
        rec.prefill = rec.credit_prefill = inst
        rec.credit_tokens = len(rec.prompt) - cached
        inst.assigned_prefill_tokens += rec.credit_tokens
        rec.phase = Phase.WAITING_FOR_KV
        if inbound is not None:
            self.copies.wait(inbound[0], rec.key, request)
        elif donor is not None:
            tokens = rec.prompt[: donor.cached_tokens]
            self.copies.prefetch(rec.key, donor.instance, inst, tokens, request)
        else:
            rec.phase = Phase.PREFILL
            inst.send(request)

    def _send_waiting(self, key: str, inst: Instance, request: AddRequest) -> None:
        """A parked request goes to its prefill instance: the copy it waited for ended, or
        its wait did. Not when it was aborted or moved meanwhile."""
        rec = self.records.get(key)
        if rec is None or rec.phase is not Phase.WAITING_FOR_KV or rec.prefill is not inst:
            return
        rec.phase = Phase.PREFILL
        inst.send(request)

    def _prefix_donor(self, rec: _Record, inst: Instance, cached: int) -> Donor | None:
        """Another instance to copy a longer cached prefix from, when copying pays."""
        if not (self.config.prefix_fetch and self.config.disaggregated):
            return None
        if not self.engine.cache.enable_prefix_cache or inst.kv_layout is None:
            return None
        donor = self.router.donor(self.instances, rec.route, inst, cached)
        if donor is None:
            return None
        layout = inst.kv_layout
        token_bytes = 2 * layout.num_layers * layout.token_bytes
        tokens, overhead = donor.cached_tokens - cached, self.router.fetch_overhead.value
        pays = self.router.fetch_pays(tokens, token_bytes, self.recovery, overhead)
        return donor if pays else None

    def _run_whole_on_decode(self, rec: _Record) -> None:
        """No prefill instance is alive: a decode instance prefills the prompt itself."""
        inst = self._choose_decode(rec)
        if inst is not None:
            rec.phase = Phase.DECODE
            inst.send(AddRequest(rec.key, rec.prompt, rec.params, rec.arrival))

    def _choose_decode(self, rec: _Record) -> Instance | None:
        heavy = self._is_heavy(rec)
        inst = self.router.decode(
            self.of_role(Role.DECODE), rec.route, self._decode_blocks(rec), heavy
        )
        if inst is None:
            self._fail(rec, InstanceFailedError("no live decode instance"))
            return None
        self._credit_decode(rec, inst, heavy)
        return inst

    def _decode_blocks(self, rec: _Record) -> int:
        """Blocks a decode instance needs for `rec`: its tokens so far and the next one;
        under the length-aware policy, its predicted remaining tokens too (TetriInfer:
        room for the predicted length)."""
        tokens = len(rec.prompt) + len(rec.streamed)
        if self.config.decode_policy is DecodePolicy.LENGTH_AWARE:
            left = rec.params.max_tokens - len(rec.streamed)
            tokens += remaining_tokens(rec.prediction, len(rec.streamed), left)
        else:
            tokens += 1
        return -(-tokens // self.engine.cache.block_size)

    def _is_heavy(self, rec: _Record) -> bool:
        """A heavy decode: predicted to generate >= `heavy_decode_tokens` (its bucket lies
        there). Without a prediction, max_tokens, the client's bound, decides."""
        threshold = self.config.heavy_decode_tokens
        if rec.prediction is not None:
            return rec.prediction.low >= threshold
        return rec.params.max_tokens >= threshold

    def _credit_decode(self, rec: _Record, inst: Instance, heavy: bool) -> None:
        rec.decode = rec.credit_decode = inst
        rec.heavy = heavy
        inst.assigned_requests += 1
        inst.assigned_heavy += heavy

    # ---- messages from instances -----------------------------------------------------

    async def _on_message(self, inst: Instance, msg: EngineMessage) -> None:
        """Messages of one instance, in order (its reader awaits each)."""
        pending = self._handlers(msg, inst)
        if pending is not None:
            await pending

    async def _on_outputs(self, inst: Instance, msg: OutputBatch) -> None:
        self._budget.reset()
        for out in msg.outputs:
            self._on_output(inst, out)
            await self._budget.checkpoint()

    def _on_output(self, inst: Instance, out: EngineOutput) -> None:
        rec = self.records.get(out.request_id)
        if rec is None or (inst is not rec.prefill and inst is not rec.decode):
            return
        from_prefill = self.config.disaggregated and inst is rec.prefill
        if from_prefill and rec.phase is not Phase.PREFILL:
            return
        if out.prediction is not None and rec.prediction is None:
            rec.prediction = out.prediction
        if rec.times.first_token_seen is None:
            rec.times.first_token_seen = time.monotonic()
        if rec.cached_tokens is None:  # the instance that ran the prefill: its own count
            rec.cached_tokens = out.num_cached_tokens
            self.router.observe(rec.predicted_cached, out.num_cached_tokens)
        if rec.recompute:  # the first output after a move: what it really recomputed
            self.faults.recomputed_tokens += max(0, rec.recompute - out.num_cached_tokens)
            rec.recompute = 0
        self._forward(rec, inst, out)

    def _forward(self, rec: _Record, inst: Instance, out: EngineOutput) -> None:
        assert self._processor is not None
        if out.request_id != rec.request_id or out.num_cached_tokens != rec.cached_tokens:
            # a retry's key (the client knows the id); the prefill instance's cache count
            out = msgspec.structs.replace(
                out, request_id=rec.request_id, num_cached_tokens=rec.cached_tokens or 0
            )
        rec.streamed.extend(t.token_id for t in out.new_tokens)
        result, stop_string = self._processor.process(out)
        if result is None:
            return
        if result.finished:
            rec.times.finished = time.monotonic()
            reason = result.finish_reason or "stop"
            self.predictions.observe(rec.prediction, len(rec.streamed), reason)
            if self.config.disaggregated:
                pulled = self.mode is TransferMode.PULL
                result = dataclasses.replace(result, metrics=rec.times.handoff_metrics(pulled))
            if stop_string is None:
                self._expect_return(rec, inst)
            self._release(rec, abort=stop_string is not None)
        rec.queue.put_nowait(result)

    def _on_handed_off(self, inst: Instance, msg: KVHandedOff) -> None:
        rec = self.records.get(msg.request_id)
        if rec is None or rec.prefill is not inst or rec.phase is not Phase.PREFILL:
            inst.send(ReleaseKV([msg.request_id]))
            return
        self._unload_prefill(rec)
        rec.phase = Phase.HANDOFF
        if msg.source is None:
            rec.prefill = None  # pushed: the prefill side holds nothing any more
        if msg.first_scheduled is not None:
            rec.times.first_scheduled = msg.first_scheduled
        if msg.first_token is not None:
            rec.times.first_token = msg.first_token
        if msg.first_scheduled is not None and msg.first_token is not None:
            self.recovery.prefill.observe(len(rec.prompt), msg.first_token - msg.first_scheduled)
        rec.times.handed_off = time.monotonic()
        decode = rec.decode if msg.source is None else self._choose_decode(rec)
        if decode is None:
            return
        decode.send(
            AddPrefilled(
                rec.key,
                rec.prompt,
                rec.streamed,
                rec.params,
                rec.arrival,
                msg.source,
                msg.generator_state,
                return_to=inst.name if self.returns_kv else None,
                prediction=rec.prediction,
            )
        )
        rec.return_to = inst if self.returns_kv else None

    def _on_reserved(self, inst: Instance, msg: KVReserved) -> None:
        rec = self.records.get(msg.request_id)
        if rec is None or rec.decode is not inst or rec.phase is not Phase.RESERVING:
            inst.send(ReleaseKV([msg.request_id]))
            return
        self._send_prefill(rec, self.of_role(Role.PREFILL), Handoff(self.mode.value, msg.target))

    def _on_received(self, inst: Instance, msg: KVReceived) -> None:
        rec = self.records.get(msg.request_id)
        if rec is None or rec.decode is not inst:
            inst.send(AbortRequests([msg.request_id]))
            return
        rec.phase = Phase.DECODE
        rec.times.decode_queued = msg.queued
        rec.times.transfer_start, rec.times.transfer_end = msg.transfer_start, msg.transfer_end
        self.recovery.copy.observe(msg.nbytes, msg.transfer_end - msg.transfer_start)
        if rec.prefill is not None:
            rec.prefill.send(ReleaseKV([rec.key]))
        rec.prefill = None

    def _on_handoff_failed(self, inst: Instance, msg: HandoffFailed) -> None:
        """Either side gave up on the KV (and released what it held for it)."""
        stop = self._push_stops.pop(msg.request_id, None)
        if stop is not None:
            stop[1].send(ReleaseKV([msg.request_id]))  # the prefill side stopped writing
        rec = self.records.get(msg.request_id)
        if rec is None:
            return
        if inst is rec.prefill:
            rec.prefill = None
        elif inst is rec.decode:
            rec.decode = None
        self._release(rec, abort=True)
        self._move(rec, f"{inst.name}: {msg.message}", migration=False)

    def _on_rejected(self, inst: Instance, msg: RequestRejected) -> None:
        rec = self.records.get(msg.request_id)
        if rec is None:
            return
        self._release(rec, abort=True)
        if msg.overloaded:
            self._fail(rec, EngineOverloadedError(msg.message))
        else:
            self._fail(rec, InvalidRequestError(msg.message, msg.param))

    # ---- failures --------------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            now = time.monotonic()
            self.router.expire(now)
            self.copies.tick(now)
            for inst in self.instances:
                reason = inst.check(now)
                if reason is not None:
                    await inst.fence()
                    self._on_dead(inst, reason)

    def _on_dead(self, inst: Instance, reason: str) -> None:
        """`inst` is dead and fenced (its process is gone): move what it held, then
        rearrange replication around it."""
        if self.single_engine:
            self._on_engine_dead(inst, reason)
            return
        self.faults.instance_failed(inst.role.value)
        self.router.forget(inst)
        self.copies.instance_dead(inst)
        for key, (prefill, decode) in list(self._push_stops.items()):
            if inst is prefill:  # a dead process writes nothing more
                del self._push_stops[key]
                decode.send(ReleaseKV([key]))
        why = f"instance {inst.name} failed: {reason}"
        held = sum(1 for r in self.records.values() if inst in (r.prefill, r.decode))
        log.warning("%s; moving its %d requests", why, held)
        for rec in list(self.records.values()):
            if rec.replica_holder is inst:  # its replica died with the holder
                rec.forget_replica()
            if inst is not rec.prefill and inst is not rec.decode:
                continue
            replica = self._take_replica(rec) if inst is rec.decode else None
            if inst is rec.prefill:
                rec.prefill = None
            else:
                rec.decode = None
            self._release(rec, abort=True)
            self._move(rec, why, migration=True, replica=replica)
        holder = self.holders.pop(inst.name, None)
        if holder is not None and holder.alive:
            holder.send(DropReplicas(inst.name, []))  # after the resumes it consumed
        self._arrange_replication()
        if self.config.restart_dead and not self._closed:
            task = asyncio.create_task(self._restart(inst))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)

    async def _restart(self, dead: Instance, timeout: float = 600.0) -> None:
        """Start `dead`'s config again as a new instance (the launcher places it) and, once
        ready, put it in `dead`'s place: it rejoins empty (no cache, no requests) and the
        router, the decode chooser and replication see it from then on. A failed start
        is tried again `_RESTART_TRIES` times, `_RESTART_WAIT_S` apart (a node that just
        died may still be offered by Ray for a few seconds); then the instance stays dead."""
        for attempt in range(1, _RESTART_TRIES + 1):
            fresh = await self._start_again(dead, timeout)
            if fresh is not None:
                await dead.shutdown(0)  # its process is gone (fenced); this closes its sockets
                self.instances[self.instances.index(dead)] = fresh
                self.faults.instance_restarted(fresh.role.value)
                log.warning("instance %s restarted on node %s, empty", fresh.name, fresh.node)
                self._arrange_replication()
                return
            if self._closed:
                return
            if attempt < _RESTART_TRIES:
                await asyncio.sleep(_RESTART_WAIT_S)
        log.warning("instance %s stays dead: %d restarts failed", dead.name, _RESTART_TRIES)

    async def _start_again(self, dead: Instance, timeout: float) -> Instance | None:
        """A ready new instance of `dead`'s config; None if its start failed (logged)."""
        fresh = Instance(
            dead.config,
            self._ctx,
            self._on_message,
            self.config.instance_timeout_s,
            self._on_report,
            self.launcher,
        )
        try:
            await fresh.start(timeout)
        except asyncio.CancelledError:  # the server is shutting down
            await fresh.shutdown()
            raise
        except Exception as e:  # its start failed (Ray could not place it, it died, ...)
            log.warning("instance %s could not be restarted: %s", dead.name, e)
            await fresh.shutdown()
            return None
        if self._closed:
            await fresh.shutdown()
            return None
        return fresh

    def _on_engine_dead(self, inst: Instance, reason: str) -> None:
        """The lone engine is gone: every request, open or new, fails with why."""
        if inst.exit_code is not None:
            reason = f"the engine process exited (exit code {inst.exit_code})"
        self._dead = EngineDeadError(reason)
        self._fail_all(self._dead)

    def _move(
        self,
        rec: _Record,
        why: str,
        migration: bool,
        replica: _Replica | None = None,
    ) -> None:
        """Run `rec` again elsewhere, or fail it past its bound. `migration`: its instance
        died (bounded by `max_migrations`), else its hand-off failed (`max_retries`).
        `replica`: the KV replicated before the death."""
        done, bound = (
            (rec.migrations, self.config.max_migrations)
            if migration
            else (rec.attempts - rec.migrations, self.config.max_retries)
        )
        if done >= bound or self._closed:
            moves = "migrations" if migration else "retries"
            tries = f" (after {done} {moves})" if done else ""
            self._fail(rec, InstanceFailedError(f"the request failed{tries}: {why}"))
            return
        self.records.pop(rec.key, None)
        rec.attempts += 1
        if migration:
            rec.migrations += 1
            self.faults.migrations += 1
        else:
            self.faults.retries += 1
        self.records[rec.key] = rec
        if rec.streamed and replica is not None and self._resume_from_replica(rec, replica):
            return
        if rec.streamed:
            self._resume(rec)
        else:
            self._dispatch(rec)

    def _take_replica(self, rec: _Record) -> _Replica | None:
        """The live replica of `rec`'s KV, detached from the record (its source died: the
        holder consumes it on resume or drops it with the rest of the source's)."""
        holder, source, through = rec.replica_holder, rec.replica_source, rec.replicated
        rec.forget_replica()
        if holder is None or source is None or not holder.alive or through <= 0:
            return None
        return _Replica(holder, source.name, rec.key, through)

    def _resume_from_replica(self, rec: _Record, replica: _Replica) -> bool:
        """The cost rule (`RecoveryCost`): resume on the holder from the replica when that
        is cheaper than recomputing every token; the choice is logged with its numbers.
        `rec` has been re-keyed already; the replica is known by the previous key."""
        holder, layout = replica.holder, replica.holder.kv_layout
        assert layout is not None
        total = len(rec.prompt) + len(rec.streamed) - 1
        through = min(replica.tokens, total)
        choice = self.recovery.choose(through, total, 2 * layout.num_layers * layout.token_bytes)
        log.info("request %s: %s", rec.request_id, choice.describe())
        if not choice.resume:
            return False
        request = self._continue_on(rec, holder)
        holder.send(ResumeFromReplica(request, replica.source, replica.key, through))
        self.faults.resumed_from_replica += 1
        self.faults.recomputed_tokens += total - through
        return True

    def _resume(self, rec: _Record) -> None:
        """Continue `rec` after its last streamed token: the instance computes the KV of
        prompt + streamed tokens again (prefix-cache hits excepted) and samples the next
        token."""
        inst = self._continuation_instance(rec)
        if inst is None:
            self._fail(rec, InstanceFailedError("no live instance to continue the request on"))
            return
        rec.recompute = len(rec.prompt) + len(rec.streamed) - 1
        inst.send(self._continue_on(rec, inst))

    def _continue_on(self, rec: _Record, inst: Instance) -> AddRequest:
        """Make `inst` the instance `rec` decodes on (its load credited) and return the
        request that continues it there after its streamed tokens."""
        self._credit_decode(rec, inst, self._is_heavy(rec))
        rec.prefill, rec.phase, rec.return_to = None, Phase.DECODE, None
        return AddRequest(
            rec.key,
            rec.prompt,
            rec.params,
            rec.arrival,
            output_token_ids=rec.streamed,
            prediction=rec.prediction,
        )

    def _continuation_instance(self, rec: _Record) -> Instance | None:
        """Where a moved request continues: a live decode instance (by the decode policy,
        preferring room for its tokens), else a colocated one, else - no instance that
        decodes is left - a prefill instance, which runs it to the end."""
        need = -(-(len(rec.prompt) + len(rec.streamed) + 1) // self.engine.cache.block_size)
        for role in (Role.DECODE, Role.COLOCATED, Role.PREFILL):
            live = self.live(role)
            if live:
                return self.decode_chooser.choose(live, need)
        return None

    def _fail(self, rec: _Record, error: Exception) -> None:
        if isinstance(error, InstanceFailedError):
            self.faults.failed += 1
        self._release(rec, abort=True)
        rec.queue.put_nowait(error)

    def _fail_all(self, error: Exception) -> None:
        for rec in list(self.records.values()):
            self._fail(rec, error)

    # ---- releasing what instances hold ---------------------------------------------------

    def _release(self, rec: _Record, abort: bool) -> None:
        """Make sure no instance keeps anything for this attempt of the request.

        `abort`: it may still run somewhere (client gone, stop string, failure). In push
        modes the decode side's reservation is only released once the prefill side says
        it stopped writing into it (HandoffFailed after the abort, or its death)."""
        prefill, decode, key = rec.prefill, rec.decode, rec.key
        self._drop_replica(rec)
        writing = (
            abort
            and self.mode is not TransferMode.PULL
            and prefill is not None
            and prefill.alive
            and decode is not None
            and rec.phase in (Phase.PREFILL, Phase.HANDOFF)
        )
        if abort and prefill is not None:
            prefill.send(AbortRequests([key]))
        if writing:
            assert prefill is not None and decode is not None
            self._push_stops[key] = (prefill, decode)
        elif decode is not None and (abort or rec.phase is not Phase.DECODE):
            decode.send(AbortRequests([key]))  # frees a reservation or a running request
        self._unload_prefill(rec)
        self._unload_decode(rec)
        rec.prefill = rec.decode = None

    def _unload_prefill(self, rec: _Record) -> None:
        if rec.credit_prefill is not None:
            rec.credit_prefill.assigned_prefill_tokens -= rec.credit_tokens
            rec.credit_prefill = None

    def _unload_decode(self, rec: _Record) -> None:
        if rec.credit_decode is not None:
            rec.credit_decode.assigned_requests -= 1
            rec.credit_decode.assigned_heavy -= rec.heavy
            rec.credit_decode = None
            rec.heavy = False

    # ---- replication (cluster/replication.py, protocol/replica.py) --------------------

    def _arrange_replication(self) -> None:
        """Point every live source at its holder in the ring (`ring`): a source whose
        holder is new gets a store opened there and replicates from token 0 (its requests'
        old replicas are forgotten); a source without one stops."""
        if not self.config.replicate or self._closed:
            return
        sources, others = self._replication_roles()
        wanted = ring(sources, others)
        for source in sources:
            if not source.alive:
                continue
            holder = wanted.get(source.name)
            old = self.holders.get(source.name)
            if holder is old:
                continue
            self._forget_replicas(source)
            if old is not None and old.alive:
                old.send(DropReplicas(source.name, []))
            if holder is None:
                self.holders.pop(source.name, None)
                source.send(ReplicateTo("", None))
                continue
            self.holders[source.name] = holder
            assert source.kv_layout is not None
            holder.send(OpenReplicaStore(source.name, source.kv_layout))

    def _replication_roles(self) -> tuple[list[Instance], list[Instance]]:
        """(sources: the instances that decode, others: where a lone source may replicate)."""
        if self.config.disaggregated:
            return self.of_role(Role.DECODE), self.of_role(Role.PREFILL)
        return self.of_role(Role.COLOCATED), []

    def _forget_replicas(self, source: Instance) -> None:
        for rec in self.records.values():
            if rec.replica_source is source:
                rec.forget_replica()

    def _on_store_opened(self, inst: Instance, msg: ReplicaStoreOpened) -> None:
        source = self._instance(msg.source)
        if source is not None and source.alive and self.holders.get(msg.source) is inst:
            source.send(ReplicateTo(inst.name, msg.region))

    def _on_replicated(self, inst: Instance, msg: KVReplicated) -> None:
        """A source's write completed: relay the records of requests it still runs for us
        to the holder (others ended: their records must not reach the holder)."""
        holder = self.holders.get(inst.name)
        if holder is None or holder.name != msg.holder or not holder.alive:
            return
        keep = []
        for replica in msg.replicas:
            rec = self.records.get(replica.request_id)
            if rec is not None and rec.decode is inst:
                rec.replica_source, rec.replica_holder = inst, holder
                keep.append(replica)
        if keep:
            holder.send(StoreReplicas(inst.name, keep))

    def _on_replicas_stored(self, inst: Instance, msg: ReplicasStored) -> None:
        """The holder's acknowledgement: how far each request is replicated."""
        for replica in msg.replicas:
            rec = self.records.get(replica.request_id)
            if rec is not None and rec.replica_holder is inst:
                rec.replicated = max(rec.replicated, replica.num_tokens)

    def _drop_replica(self, rec: _Record) -> None:
        """The attempt ended or moves: its holder forgets the replica."""
        holder, source = rec.replica_holder, rec.replica_source
        rec.forget_replica()
        if holder is not None and source is not None and holder.alive:
            holder.send(DropReplicas(source.name, [rec.key]))

    def _holder_name(self, source: Instance) -> str | None:
        holder = self.holders.get(source.name)
        return holder.name if holder is not None else None

    def _instance(self, name: str) -> Instance | None:
        return next((i for i in self.instances if i.name == name), None)

    def replicated_tokens(self) -> dict[str, int]:
        """Per holder: tokens the front end knows are replicated there, summed (equal to
        the holder's own `num_replicated_tokens` once messages in flight arrive)."""
        out = {i.name: 0 for i in self.instances}
        for rec in self.records.values():
            if rec.replica_holder is not None:
                out[rec.replica_holder.name] += rec.replicated
        return out

    # ---- cluster-wide caching (cluster/routing.py, protocol/cache.py) ---------------------

    @property
    def returns_kv(self) -> bool:
        """PD-Caching-3: decode instances offer finished requests' KV to the prefill
        instance that prefilled them."""
        return (
            self.config.disaggregated
            and self.config.pd_caching == 3
            and self.engine.cache.enable_prefix_cache
        )

    def _on_report(self, inst: Instance, report: LoadReport) -> None:
        self.router.on_report(inst, report)

    def _expect_return(self, rec: _Record, inst: Instance) -> None:
        """`rec` finished on `inst`, its decode instance: with a return, `inst` offers the
        full blocks whose KV it computed (all tokens but the last) right after this output."""
        if rec.return_to is None or inst is not rec.decode:
            return
        tokens = (rec.prompt + rec.streamed)[:-1]
        self.copies.expect_return(f"{rec.key}@return", inst, rec.return_to, tokens)

    # ---- reporting -----------------------------------------------------------------------

    async def stats(self, check_integrity: bool = False, timeout: float = 10.0) -> EngineStats:
        """Counters summed over the live instances; integrity errors name the instance."""
        if self._dead is not None:
            raise self._dead
        live = [i for i in self.instances if i.alive]
        if not live:
            raise EngineDeadError("no live instance")
        replies = await asyncio.gather(
            *(i.stats(check_integrity, timeout) for i in live), return_exceptions=True
        )
        return _sum_stats(live, replies)

    def status(self) -> dict[str, object]:
        """The cluster as the controller sees it now, without asking any instance: the
        nodes and which instances run on each, every instance's role, liveness and load
        (its last load report and what the front end assigned it). `pdserve cluster
        status` prints it."""
        nodes = self.launcher.nodes()
        for row in nodes:
            row["instances"] = [i.name for i in self.instances if i.node == row["node"]]
        instances = []
        for inst in self.instances:
            report = inst.report
            instances.append(
                {
                    **_identity(inst),
                    "running": report.num_running if report else None,
                    "waiting": report.num_waiting if report else None,
                    "free_blocks": report.num_obtainable_blocks if report else None,
                    "blocks": report.num_blocks if report else None,
                }
            )
        return {"launcher": self.launcher.kind, "nodes": nodes, "instances": instances}

    async def instance_stats(self, timeout: float = 5.0) -> list[dict[str, object]]:
        """Per instance: role, liveness, assigned load, last report and counters."""
        rows: list[dict[str, object]] = []
        replicated = self.replicated_tokens()
        for inst in self.instances:
            row: dict[str, object] = {
                **_identity(inst),
                "replicating_to": self._holder_name(inst),
                "replicated_tokens": replicated[inst.name],  # held here, as the front end knows
            }
            if inst.alive:
                with contextlib.suppress(Exception):
                    stats = await inst.stats(True, timeout)
                    fields = [f for f in stats.__struct_fields__ if f != "request_id"]
                    row["stats"] = {f: getattr(stats, f) for f in fields}
            rows.append(row)
        return rows


def _identity(inst: Instance) -> dict[str, object]:
    """What every per-instance row starts with: who and where it is, whether it lives,
    and the load the front end assigned it."""
    return {
        "name": inst.name,
        "role": inst.role.value,
        "node": inst.node,
        "pid": inst.process.pid,
        "alive": inst.alive,
        "dead_reason": inst.dead,
        "assigned_requests": inst.assigned_requests,
        "assigned_prefill_tokens": inst.assigned_prefill_tokens,
    }


def _sum_stats(live: list[Instance], replies: Sequence[EngineStats | BaseException]) -> EngineStats:
    totals: dict[str, int] = {}
    errors: list[str] = []
    for inst, reply in zip(live, replies, strict=True):
        if isinstance(reply, BaseException):
            errors.append(f"{inst.name}: no stats ({reply})")
            continue
        for name in reply.__struct_fields__:
            value = getattr(reply, name)
            if name not in ("request_id", "integrity_error") and isinstance(value, int):
                totals[name] = totals.get(name, 0) + value
        if reply.integrity_error:
            errors.append(f"{inst.name}: {reply.integrity_error}")
    if not totals:
        raise EngineDeadError("no instance answered: " + "; ".join(errors))
    return EngineStats(request_id=0, integrity_error="; ".join(errors) or None, **totals)


def instance_configs(cluster: ClusterConfig, engine: EngineConfig) -> list[EngineConfig]:
    """One EngineConfig per instance: role, name, and its share of the CPU threads (or, with
    a placement, the devices it names)."""
    roles = (
        [Role.PREFILL] * cluster.num_prefill
        + [Role.DECODE] * cluster.num_decode
        + [Role.COLOCATED] * cluster.num_colocated
    )
    even = max(1, engine.threads // len(roles))
    shares = [p.devices for p in cluster.placement] if cluster.placement else [even] * len(roles)
    counts: dict[Role, int] = {}
    configs = []
    for role, threads in zip(roles, shares, strict=True):
        index = counts[role] = counts.get(role, -1) + 1
        name = "engine" if len(roles) == 1 else f"{role.value}-{index}"
        scheduler, cache = engine.scheduler, engine.cache
        if role is Role.PREFILL and cluster.prefill_chunk_size is not None:
            scheduler = dataclasses.replace(
                scheduler, max_num_batched_tokens=cluster.prefill_chunk_size
            )
        if role is Role.DECODE and cluster.pd_caching == 1:  # PD-Caching-1: caching at P only
            cache = dataclasses.replace(cache, enable_prefix_cache=False)
        configs.append(
            dataclasses.replace(
                engine,
                role=role,
                instance_name=name,
                num_threads=threads,
                scheduler=scheduler,
                cache=cache,
            )
        )
    return configs


def _head_spec(path: str | None) -> HeadSpec | None:
    """What the instances' length head predicts (its file is read here first, so a
    missing or corrupt one stops the start before any instance spawns)."""
    return None if path is None else read_head(path).spec
