"""`Cluster`: the one front end, in front of one engine or many instances.

It is the hub of the front end (docs/controller.md): it owns the request table
(cluster/table.py), tokenization, detokenization and stop strings (`OutputProcessor`),
cancellation, and the instances - each an engine process behind an `Instance` handle - and
it sends new requests on their way (cluster/dispatch.py). Everything else is a feature
that plugs in through cluster/hub.py: the P/D hand-off (dispatch.py), recovery
(recovery.py), replication (replication.py) and cluster-wide caching (caching.py); the hub
calls them at fixed points and knows none of them by name. It is the `ServingBackend` the
HTTP server runs on, and what `pdserve serve` starts for every deployment: a single engine
is a cluster of one colocated instance (named "engine"). A lone engine differs only in
policy - it has nowhere to retry, so a silent engine is never declared dead and its death
fails every request with `EngineDeadError` (HTTP 500, "the engine is not available"), as a
server with no engine left must.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

import zmq.asyncio

from pdserve.cluster import reporting
from pdserve.cluster.config import ClusterConfig, instance_configs
from pdserve.cluster.faults import FaultCounters
from pdserve.cluster.features import assemble
from pdserve.cluster.hub import Feature, Handler, MessageBus
from pdserve.cluster.instance import Instance, Launcher, LocalLauncher, layout_conflict
from pdserve.cluster.outputs import OutputRelay
from pdserve.cluster.policies import DecodeChooser
from pdserve.cluster.replanning import SplitPlanner
from pdserve.cluster.routing import Router, session_key
from pdserve.cluster.table import Item, Phase, Record, RequestTable, take_queued
from pdserve.config import EngineConfig, Role
from pdserve.engine.head_spec import HeadSpec, read_head_file
from pdserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InstanceFailedError,
    InvalidRequestError,
)
from pdserve.model.source import resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.predictor.confusion import PredictionCounters
from pdserve.protocol.core import (
    AbortRequests,
    EngineStats,
    OutputBatch,
    RequestRejected,
    WeightsInfo,
)
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.validation import check_request
from pdserve.text.output_processor import OutputProcessor
from pdserve.text.outputs import RequestOutput

_WATCH_S = 0.1
F = TypeVar("F", bound=Feature)


class Cluster:
    def __init__(
        self,
        config: ClusterConfig,
        engine: EngineConfig,
        launcher: Launcher | None = None,
        planner: SplitPlanner | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        # Where the instances' processes run: children of this process by default.
        started = sum(c.threads for c in instance_configs(config, engine))
        self.launcher: Launcher = launcher or LocalLauncher(started)
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.weights = WeightsInfo("none", [])
        self.instances: list[Instance] = []
        self.table = RequestTable()
        self.faults = FaultCounters()
        self.predictions = PredictionCounters(_head_spec(engine.length_predictor))
        self.router = Router(
            config, engine.cache.block_size, DecodeChooser(config.decode_policy, config.seed)
        )
        self.dispatcher, self.features = assemble(self, self.router, planner)
        self.outputs = OutputRelay(self, self.features, self.predictions)
        own: dict[type, Handler] = {
            OutputBatch: self.outputs.on_outputs,
            RequestRejected: self._on_rejected,
        }
        self._bus = MessageBus([own, *(f.handlers() for f in self.features)])
        self._ctx = zmq.asyncio.Context()
        self._ids = itertools.count()
        self._watch: asyncio.Task[None] | None = None
        self._closed = False
        self._dead: EngineDeadError | None = None  # a lone engine died: why

    # ---- life cycle ----------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        engine: EngineConfig,
        config: ClusterConfig | None = None,
        timeout: float = 600.0,
        launcher: Launcher | None = None,
        planner: SplitPlanner | None = None,
    ) -> Cluster:
        """Start every instance (in parallel) and wait until all are ready. `config`
        None: a single engine. `launcher`: where the instances' processes run (None:
        children of this process; cluster/ray_launch.py: Ray actors). `planner`: what the
        distserve flip policy asks (cluster/replanning.py). Raises what a
        failed start reports (EngineDeadError with the engine's message,
        ModelLoadError); no process is left running then."""
        cluster = cls(config or ClusterConfig(num_colocated=1), engine, launcher, planner)
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

    @property
    def closed(self) -> bool:
        return self._closed

    async def _start(self, timeout: float) -> None:
        path = resolve_model(self.engine.model)
        self.tokenizer = await asyncio.to_thread(Tokenizer.from_model_path, path)
        self.outputs.processor = OutputProcessor(self.tokenizer)
        # The instances get the stop ids from here: each would build the tokenizer again.
        stops = tuple(self.tokenizer.stop_token_ids)
        self.instances = [
            self.new_instance(dataclasses.replace(cfg, stop_token_ids=stops))
            for cfg in instance_configs(self.config, self.engine)
        ]
        await asyncio.gather(*(self._start_instance(i, timeout) for i in self.instances))
        for inst in self.instances:
            if why := layout_conflict(inst, self.instances):
                raise EngineDeadError(why)
        self.max_model_len = min(i.max_model_len for i in self.instances)
        self.vocab_size = self.instances[0].vocab_size
        self.weights = self.instances[0].weights  # every instance loads the same way
        self.instances_changed()
        self._watch = asyncio.create_task(self._watchdog())

    def new_instance(self, config: EngineConfig) -> Instance:
        silence = None if self.single_engine else self.config.instance_timeout_s
        report = self.router.on_report  # the prompt trees and load of each instance
        return Instance(config, self._ctx, self._bus.deliver, silence, report, self.launcher)

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
        for feature in self.features:
            await feature.close()
        self._fail_all(EngineDeadError("the server is shutting down"))
        await asyncio.gather(*(i.shutdown(timeout) for i in self.instances))
        self._ctx.term()

    def of_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances if i.role is role and i.flipping_to is None]

    def live(self, role: Role) -> list[Instance]:
        return [i for i in self.of_role(role) if i.alive]

    def feature(self, kind: type[F]) -> F:
        """The feature of class `kind` (KeyError when there is none): what the HTTP
        layer's operator routes call (an instance flip)."""
        for feature in self.features:
            if isinstance(feature, kind):
                return feature
        raise KeyError(kind.__name__)

    def instance(self, name: str) -> Instance | None:
        return next((i for i in self.instances if i.name == name), None)

    def replace(self, dead: Instance, fresh: Instance) -> None:
        self.instances[self.instances.index(dead)] = fresh
        self.instances_changed()

    def admit(self, inst: Instance) -> None:
        self.instances.append(inst)
        self.instances_changed()

    def retire(self, inst: Instance) -> None:
        self.instances.remove(inst)
        self.instances_changed()

    @property
    def is_alive(self) -> bool:
        """Some instance can serve: with only prefill or only decode instances left, they
        run requests whole (cluster/dispatch.py)."""
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
        engine, `EngineDeadError`) unless the request can be retried elsewhere. Outputs
        that queued up while the consumer was busy come as one (`take_queued`).
        `session`: the client's session id (any string; `session` routing keeps a
        session's requests on the same instances)."""
        if not self.is_alive:
            raise self._dead or EngineDeadError("no live instance can serve requests")
        processor, tokenizer = self.outputs.processor, self.tokenizer
        assert processor is not None and tokenizer is not None
        token_ids = tokenizer.prompt_ids(prompt)
        check_request(token_ids, params, self.vocab_size, self.max_model_len)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.table:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        sid = session_key(session) if session is not None else None
        route = self.router.key(token_ids, sid)
        rec = Record(rid, token_ids, params, time.monotonic(), asyncio.Queue(), route)
        self.table.add(rec)
        processor.add(rid, token_ids, params)
        finished = False
        try:
            self.dispatch(rec)
            while not finished:
                item: Item = await rec.queue.get()
                if isinstance(item, BaseException):
                    raise item
                out, error = take_queued(item, rec.queue)
                finished = out.finished
                yield out
                if error is not None:
                    raise error
        finally:
            self.table.remove(rec)
            processor.discard(rid)
            self.release(rec, abort=not finished)

    def cancel_all(self, error: Exception) -> int:
        records = list(self.table)
        for rec in records:
            rec.queue.put_nowait(error)
        return len(records)

    def dispatch(self, rec: Record) -> None:
        self.dispatcher.dispatch(rec)

    def fail(self, rec: Record, error: Exception) -> None:
        if isinstance(error, InstanceFailedError):
            self.faults.failed += 1
        self.release(rec, abort=True)
        rec.queue.put_nowait(error)

    def _fail_all(self, error: Exception) -> None:
        for rec in self.table:
            self.fail(rec, error)

    def release(self, rec: Record, abort: bool) -> None:
        """Make sure no instance keeps anything for this attempt of the request (the
        features' `released` first: one may take a side over). `abort`: it may still run
        somewhere (client gone, stop string, failure)."""
        for feature in self.features:
            feature.released(rec, abort)
        if abort and rec.prefill is not None:
            rec.prefill.send(AbortRequests([rec.key]))
        if rec.decode is not None and (abort or rec.phase is not Phase.DECODE):
            rec.decode.send(AbortRequests([rec.key]))  # frees a reservation or a request
        rec.unload()
        rec.prefill = rec.decode = None

    # ---- messages from instances -----------------------------------------------------

    def _on_rejected(self, inst: Instance, msg: RequestRejected) -> None:
        rec = self.table.get(msg.request_id)
        if rec is None:
            return
        if msg.overloaded:
            self.fail(rec, EngineOverloadedError(msg.message))
        else:
            self.fail(rec, InvalidRequestError(msg.message, msg.param))

    # ---- instances dying -------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            now = time.monotonic()
            for feature in self.features:
                feature.tick(now)
            for inst in self.instances:
                if inst.check(now) is not None:
                    await inst.fence()
                    self._on_dead(inst)

    def _on_dead(self, inst: Instance) -> None:
        """`inst` is dead and fenced (its process is gone): the features end what it held
        (recovery moves its requests), then see the instances as they are now. A lone
        engine's death fails every request, open or new."""
        if self.single_engine:
            reason = inst.dead or "the engine died"
            if inst.exit_code is not None:
                reason = f"the engine process exited (exit code {inst.exit_code})"
            self._dead = EngineDeadError(reason)
            self._fail_all(self._dead)
            return
        self.faults.instance_failed(inst.role.value)
        for feature in self.features:
            feature.instance_dead(inst)
        self.instances_changed()

    def instances_changed(self) -> None:
        for feature in self.features:
            feature.instances_changed()

    # ---- reporting (cluster/reporting.py) ---------------------------------------------

    async def stats(self, check_integrity: bool = False, timeout: float = 10.0) -> EngineStats:
        """Counters summed over the live instances; integrity errors name the instance."""
        if self._dead is not None:
            raise self._dead
        return await reporting.summed_stats(self.instances, check_integrity, timeout)

    def status(self) -> dict[str, object]:
        """The cluster as the controller sees it now (`pdserve cluster status`)."""
        return reporting.status(self.instances, self.launcher)

    async def instance_stats(self, timeout: float = 5.0) -> list[dict[str, object]]:
        """Per instance: role, liveness, assigned load, last report and counters (those
        of an instance that does not answer within `timeout`: `stats_error`)."""
        return await reporting.instance_rows(self.instances, self.features, timeout)


def _head_spec(path: str | None) -> HeadSpec | None:
    """What the instances' length head predicts (its file is read here first, so a
    missing or corrupt one stops the start before any instance spawns)."""
    return None if path is None else read_head_file(path)[0]
