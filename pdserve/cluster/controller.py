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
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec
import zmq.asyncio

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.instance import Instance
from pdserve.cluster.policies import DecodeChooser, choose_prefill
from pdserve.cluster.recovery import FaultCounters
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
    attempts: int = 0  # dispatches after the first (retries and migrations)
    migrations: int = 0
    streamed: list[int] = field(default_factory=list)  # token ids forwarded to the client
    recompute: int = 0  # tokens a move sent to be computed again (counted on its output)
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(self.arrival)

    @property
    def key(self) -> str:
        """The id instances know this attempt by: messages about an earlier attempt
        (stragglers) cannot be mistaken for the current one."""
        return self.request_id if self.attempts == 0 else f"{self.request_id}~move{self.attempts}"


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
        self.faults = FaultCounters()

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
        """Send a request (new, or moved before it streamed anything) to its first
        instance. With every prefill (or every decode) instance dead, a live instance of
        the other role runs it whole: slower for everyone, but no request is refused."""
        rec.phase = Phase.PREFILL
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
        inst = choose_prefill(candidates)
        if inst is None:
            self._fail(rec, InstanceFailedError("no live prefill instance"))
            return
        rec.prefill = rec.credit_prefill = inst
        inst.assigned_prefill_tokens += len(rec.prompt)
        inst.send(AddRequest(rec.key, rec.prompt, rec.params, rec.arrival, handoff))

    def _run_whole_on_decode(self, rec: _Record) -> None:
        """No prefill instance is alive: a decode instance prefills the prompt itself."""
        inst = self._choose_decode(rec)
        if inst is not None:
            rec.phase = Phase.DECODE
            inst.send(AddRequest(rec.key, rec.prompt, rec.params, rec.arrival))

    def _choose_decode(self, rec: _Record) -> Instance | None:
        need = -(-(len(rec.prompt) + len(rec.streamed) + 1) // self.engine.cache.block_size)
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
        if rec is None or (inst is not rec.prefill and inst is not rec.decode):
            return
        from_prefill = self.config.disaggregated and inst is rec.prefill
        if from_prefill and rec.phase is not Phase.PREFILL:
            return
        if rec.times.first_token_seen is None:
            rec.times.first_token_seen = time.monotonic()
        if rec.recompute:  # the first output after a move: what it really recomputed
            self.faults.recomputed_tokens += max(0, rec.recompute - out.num_cached_tokens)
            rec.recompute = 0
        self._forward(rec, inst, out)

    def _forward(self, rec: _Record, inst: Instance, out: EngineOutput) -> None:
        assert self._processor is not None
        if out.request_id != rec.request_id:  # a retry's key: the client knows the id
            out = msgspec.structs.replace(out, request_id=rec.request_id)
        rec.streamed.extend(t.token_id for t in out.new_tokens)
        result, stop_string = self._processor.process(out)
        if result is None:
            return
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
                rec.streamed,
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
            for inst in self.instances:
                reason = inst.check(now)
                if reason is not None:
                    await inst.fence()
                    self._on_dead(inst, reason)

    def _on_dead(self, inst: Instance, reason: str) -> None:
        """`inst` is dead and fenced (its process is gone): move what it held."""
        if self.single_engine:
            self._on_engine_dead(inst, reason)
            return
        self.faults.instance_failed(inst.role.value)
        for key, (prefill, decode) in list(self._push_stops.items()):
            if inst is prefill:  # a dead process writes nothing more
                del self._push_stops[key]
                decode.send(ReleaseKV([key]))
        for rec in list(self.records.values()):
            if inst is not rec.prefill and inst is not rec.decode:
                continue
            if inst is rec.prefill:
                rec.prefill = None
            else:
                rec.decode = None
            self._release(rec, abort=True)
            self._move(rec, f"instance {inst.name} failed: {reason}", migration=True)

    def _on_engine_dead(self, inst: Instance, reason: str) -> None:
        """The lone engine is gone: every request, open or new, fails with why."""
        if inst.exit_code is not None:
            reason = f"the engine process exited (exit code {inst.exit_code})"
        self._dead = EngineDeadError(reason)
        self._fail_all(self._dead)

    def _move(self, rec: _Record, why: str, migration: bool) -> None:
        """Run `rec` again elsewhere, or fail it past its bound. `migration`: its instance
        died (bounded by `max_migrations`), else its hand-off failed (`max_retries`)."""
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
        if rec.streamed:
            self._resume(rec)
        else:
            self._dispatch(rec)

    def _resume(self, rec: _Record) -> None:
        """Continue `rec` after its last streamed token: the instance computes the KV of
        prompt + streamed tokens again (prefix-cache hits excepted) and samples the next
        token."""
        inst = self._continuation_instance(rec)
        if inst is None:
            self._fail(rec, InstanceFailedError("no live instance to continue the request on"))
            return
        rec.decode = rec.credit_decode = inst
        inst.assigned_requests += 1
        rec.prefill, rec.phase = None, Phase.DECODE
        rec.recompute = len(rec.prompt) + len(rec.streamed) - 1
        inst.send(
            AddRequest(rec.key, rec.prompt, rec.params, rec.arrival, output_token_ids=rec.streamed)
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
