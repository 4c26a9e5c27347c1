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

Failures: a `HandoffFailed`, or the death of an instance before the request produced a
token there, sends it back to the start (at most `max_retries` times) on other
instances; the retry keeps the first token already streamed (the new prefill's sampled
token is discarded; its KV is the same). Otherwise the request ends with
`InstanceFailedError` (HTTP 503). Every path releases what the other side holds
(ReleaseKV / AbortRequests), so no block stays allocated for a request that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec
import zmq.asyncio

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.instance import Instance
from pdserve.cluster.policies import DecodeChooser, choose_prefill
from pdserve.config import EngineConfig, Role, TransferMode
from pdserve.engine.output_processor import LoopBudget, OutputProcessor
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.validation import check_request
from pdserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InstanceFailedError,
    InvalidRequestError,
)
from pdserve.model.loader import resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.core import (
    AbortRequests,
    AddRequest,
    EngineOutput,
    EngineStats,
    OutputBatch,
    RequestRejected,
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
from pdserve.protocol.timing import RequestTimes
from pdserve.protocol.wire import EngineMessage, Handlers

_WATCH_S = 0.1

Item = RequestOutput | BaseException


class Phase(StrEnum):
    RESERVING = "reserving"  # push: waiting for the decode instance's blocks
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
    phase: Phase = Phase.PREFILL
    prefill: Instance | None = None  # holds (or will hold) something for this attempt
    decode: Instance | None = None
    # Instances whose assigned load counts this request (released exactly once).
    credit_prefill: Instance | None = None
    credit_decode: Instance | None = None
    attempts: int = 0
    first_tokens: list[int] = field(default_factory=list)  # streamed by the prefill side
    num_streamed: int = 0  # tokens forwarded to the client
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(self.arrival)

    @property
    def key(self) -> str:
        """The id instances know this attempt by: messages about an earlier attempt
        (stragglers) cannot be mistaken for the current one."""
        return self.request_id if self.attempts == 0 else f"{self.request_id}~retry{self.attempts}"


class Cluster:
    def __init__(self, config: ClusterConfig, engine: EngineConfig) -> None:
        self.config = config
        self.engine = engine
        self.mode = engine.transfer.mode
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.instances: list[Instance] = []
        self.records: dict[str, _Record] = {}  # by key (see _Record.key)
        # Push modes: decode reservations to release once the prefill side confirms it
        # stopped writing into them (key -> (prefill, decode)).
        self._push_stops: dict[str, tuple[Instance, Instance]] = {}
        self.decode_chooser = DecodeChooser(config.decode_policy, config.seed)
        self._ctx = zmq.asyncio.Context()
        self._processor: OutputProcessor | None = None
        self._budget = LoopBudget()
        self._ids = itertools.count()
        self._watch: asyncio.Task[None] | None = None
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
            }
        )
        self.num_retries = 0  # attempts started again from the prompt
        self.num_failed = 0  # requests ended with an instance / transfer error

    # ---- life cycle ----------------------------------------------------------------

    @classmethod
    async def start(
        cls, engine: EngineConfig, config: ClusterConfig | None = None, timeout: float = 600.0
    ) -> Cluster:
        """Start every instance (in parallel) and wait until all are ready. `config`
        None: a single engine. Raises what a failed start reports (EngineDeadError with
        the engine's message, ModelLoadError); no process is left running then."""
        cluster = cls(config or ClusterConfig(num_colocated=1), engine)
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
        self.instances = [
            Instance(cfg, self._ctx, self._on_message, silence)
            for cfg in instance_configs(self.config, self.engine)
        ]
        path = resolve_model(self.engine.model)
        self.tokenizer = await asyncio.to_thread(Tokenizer.from_model_path, path)
        self._processor = OutputProcessor(self.tokenizer)
        await asyncio.gather(*(self._start_instance(i, timeout) for i in self.instances))
        self.max_model_len = min(i.max_model_len for i in self.instances)
        self.vocab_size = self.instances[0].vocab_size
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
        self._fail_all(EngineDeadError("the server is shutting down"))
        await asyncio.gather(*(i.shutdown(timeout) for i in self.instances))
        self._ctx.term()

    def of_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances if i.role is role]

    @property
    def is_alive(self) -> bool:
        if self._closed or self._dead is not None:
            return False
        if self.config.disaggregated:
            return any(i.alive for i in self.of_role(Role.PREFILL)) and any(
                i.alive for i in self.of_role(Role.DECODE)
            )
        return any(i.alive for i in self.of_role(Role.COLOCATED))

    # ---- requests ------------------------------------------------------------------

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs; the last has `finished=True`.

        A request an instance refuses raises `InvalidRequestError` (or
        `EngineOverloadedError`: its waiting queue is full) from the first iteration;
        nothing was allocated for it. A consumer that stops iterating (client gone, task
        cancelled) aborts the request: the instance frees its KV before its next step.
        An instance failure ends the stream with `InstanceFailedError` (or, for a lone
        engine, `EngineDeadError`) unless the request can be retried elsewhere."""
        if not self.is_alive:
            raise self._dead or EngineDeadError("no live instance can serve requests")
        assert self._processor is not None
        token_ids = self._tokenize(prompt)
        check_request(token_ids, params, self.vocab_size, self.max_model_len)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.records:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        rec = _Record(rid, token_ids, params, time.monotonic(), asyncio.Queue())
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
        """Send a request (new, or retried from its prompt) to its first instance."""
        rec.phase = Phase.PREFILL
        if not self.config.disaggregated:
            self._send_prefill(rec, self.of_role(Role.COLOCATED), None)
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
        inst = choose_prefill(candidates)
        if inst is None:
            self._fail(rec, InstanceFailedError("no live prefill instance"))
            return
        rec.prefill = rec.credit_prefill = inst
        inst.assigned_prefill_tokens += len(rec.prompt)
        params = rec.params if rec.num_streamed == 0 else _retry_params(rec.params)
        inst.send(AddRequest(rec.key, rec.prompt, params, rec.arrival, handoff))

    def _choose_decode(self, rec: _Record) -> Instance | None:
        need = -(-(len(rec.prompt) + 1) // self.engine.cache.block_size)
        inst = self.decode_chooser.choose(self.of_role(Role.DECODE), need)
        if inst is None:
            self._fail(rec, InstanceFailedError("no live decode instance"))
            return None
        rec.decode = rec.credit_decode = inst
        inst.assigned_requests += 1
        return inst

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
        if rec is None:
            return
        from_prefill = self.config.disaggregated and inst is rec.prefill
        if from_prefill and rec.phase is not Phase.PREFILL:
            return
        if from_prefill and rec.num_streamed:
            # A retry's prefill: its KV is what we need, its token we already sent.
            if out.finish_reason is not None:
                self._fail(rec, InstanceFailedError("the retried prefill ended the request"))
            return
        if from_prefill:
            rec.times.first_token_seen = time.monotonic()
            rec.first_tokens = [t.token_id for t in out.new_tokens]
        self._forward(rec, inst, out)

    def _forward(self, rec: _Record, inst: Instance, out: EngineOutput) -> None:
        assert self._processor is not None
        if out.request_id != rec.request_id:  # a retry's key: the client knows the id
            out = msgspec.structs.replace(out, request_id=rec.request_id)
        result, stop_string = self._processor.process(out)
        if result is None:
            return
        rec.num_streamed += len(out.new_tokens)
        if result.finished:
            rec.times.finished = time.monotonic()
            if self.config.disaggregated:
                pulled = self.mode is TransferMode.PULL
                result = dataclasses.replace(result, metrics=rec.times.handoff_metrics(pulled))
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
        rec.times.handed_off = time.monotonic()
        decode = rec.decode if msg.source is None else self._choose_decode(rec)
        if decode is None:
            return
        decode.send(
            AddPrefilled(
                rec.key,
                rec.prompt,
                rec.first_tokens,
                rec.params,
                rec.arrival,
                msg.source,
                msg.generator_state,
            )
        )

    def _on_reserved(self, inst: Instance, msg: KVReserved) -> None:
        rec = self.records.get(msg.request_id)
        if rec is None or rec.decode is not inst or rec.phase is not Phase.RESERVING:
            inst.send(ReleaseKV([msg.request_id]))
            return
        self._send_prefill(rec, self.of_role(Role.PREFILL), Handoff(self.mode.value, msg.target))
        if rec.prefill is not None:
            rec.phase = Phase.PREFILL

    def _on_received(self, inst: Instance, msg: KVReceived) -> None:
        rec = self.records.get(msg.request_id)
        if rec is None or rec.decode is not inst:
            inst.send(AbortRequests([msg.request_id]))
            return
        rec.phase = Phase.DECODE
        rec.times.decode_queued = msg.queued
        rec.times.transfer_start, rec.times.transfer_end = msg.transfer_start, msg.transfer_end
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
        self._retry_or_fail(rec, f"{inst.name}: {msg.message}")

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
            for inst in self.instances:
                reason = inst.check(now)
                if reason is not None:
                    self._on_dead(inst, reason)

    def _on_dead(self, inst: Instance, reason: str) -> None:
        if self.single_engine:
            self._on_engine_dead(inst, reason)
            return
        for key, (prefill, decode) in list(self._push_stops.items()):
            if inst is prefill:  # a dead process writes nothing more
                del self._push_stops[key]
                decode.send(ReleaseKV([key]))
        for rec in list(self.records.values()):
            if inst is not rec.prefill and inst is not rec.decode:
                continue
            dead_decode = rec.decode
            if inst is rec.prefill:
                rec.prefill = None
            else:
                rec.decode = None
            self._release(rec, abort=True)
            produced_there = inst is dead_decode and rec.num_streamed > len(rec.first_tokens)
            if not self.config.disaggregated or produced_there:
                self._fail(rec, InstanceFailedError(f"instance {inst.name} failed: {reason}"))
            else:
                self._retry_or_fail(rec, f"instance {inst.name} failed: {reason}")

    def _on_engine_dead(self, inst: Instance, reason: str) -> None:
        """The lone engine is gone: every request, open or new, fails with why."""
        if inst.exit_code is not None:
            reason = f"the engine process exited (exit code {inst.exit_code})"
        self._dead = EngineDeadError(reason)
        self._fail_all(self._dead)

    def _retry_or_fail(self, rec: _Record, why: str) -> None:
        if rec.attempts >= self.config.max_retries or self._closed:
            tries = f" (after {rec.attempts} retries)" if rec.attempts else ""
            self._fail(rec, InstanceFailedError(f"the request failed{tries}: {why}"))
            return
        self.records.pop(rec.key, None)
        self.num_retries += 1
        rec.attempts += 1
        self.records[rec.key] = rec
        self._dispatch(rec)

    def _fail(self, rec: _Record, error: Exception) -> None:
        if isinstance(error, InstanceFailedError):
            self.num_failed += 1
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
            rec.credit_prefill.assigned_prefill_tokens -= len(rec.prompt)
            rec.credit_prefill = None

    def _unload_decode(self, rec: _Record) -> None:
        if rec.credit_decode is not None:
            rec.credit_decode.assigned_requests -= 1
            rec.credit_decode = None

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

    async def instance_stats(self, timeout: float = 5.0) -> list[dict[str, object]]:
        """Per instance: role, liveness, assigned load, last report and counters."""
        rows: list[dict[str, object]] = []
        for inst in self.instances:
            row: dict[str, object] = {
                "name": inst.name,
                "role": inst.role.value,
                "pid": inst.process.pid,
                "alive": inst.alive,
                "dead_reason": inst.dead,
                "assigned_prefill_tokens": inst.assigned_prefill_tokens,
                "assigned_requests": inst.assigned_requests,
            }
            if inst.alive:
                with contextlib.suppress(Exception):
                    stats = await inst.stats(True, timeout)
                    fields = [f for f in stats.__struct_fields__ if f != "request_id"]
                    row["stats"] = {f: getattr(stats, f) for f in fields}
            rows.append(row)
        return rows


def _retry_params(params: SamplingParams) -> SamplingParams:
    """A retry's prefill must hand off whatever it samples (the token is discarded)."""
    return dataclasses.replace(params, ignore_eos=True, stop_token_ids=(), min_tokens=0)


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
    """One EngineConfig per instance: role, name, and its share of the CPU threads."""
    roles = (
        [Role.PREFILL] * cluster.num_prefill
        + [Role.DECODE] * cluster.num_decode
        + [Role.COLOCATED] * cluster.num_colocated
    )
    threads = max(1, engine.threads // len(roles))
    counts: dict[Role, int] = {}
    configs = []
    for role in roles:
        index = counts[role] = counts.get(role, -1) + 1
        name = "engine" if len(roles) == 1 else f"{role.value}-{index}"
        scheduler = engine.scheduler
        if role is Role.PREFILL and cluster.prefill_chunk_size is not None:
            scheduler = dataclasses.replace(
                scheduler, max_num_batched_tokens=cluster.prefill_chunk_size
            )
        configs.append(
            dataclasses.replace(
                engine, role=role, instance_name=name, num_threads=threads, scheduler=scheduler
            )
        )
    return configs
