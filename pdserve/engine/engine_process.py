"""The engine core in its own process, driven over ZeroMQ.

Life cycle: the front end (a cluster `Instance`) binds two IPC sockets and spawns
`run_engine_process`; the process connects, loads the model, sends `EngineReady`
(or `EngineFailed`), then loops: apply every queued input message, run one step if
anything is unfinished, push the step's outputs as one `OutputBatch`. While idle it
blocks on its input socket (100 ms at a time); it exits when the front end it serves
has ended (checked every loop).

Contract: inputs are applied between steps, so an abort frees its KV blocks before
the next step runs. An exception in a step is reported as `EngineFailed` and the
process exits with status 1; the frontend then fails every open request.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence

import msgspec
import zmq

from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.engine import build_core, load_model, start_ranks
from pdserve.engine.ranks import Spawn
from pdserve.engine.step_trace import StepTrace
from pdserve.engine.stub import run_stub
from pdserve.errors import EngineOverloadedError, InvalidRequestError
from pdserve.model.base import CausalLM
from pdserve.model.source import resolve_model
from pdserve.protocol.core import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    Heartbeat,
    LoadReport,
    OutputBatch,
    RequestRejected,
    Shutdown,
    StatsRequest,
    WeightsInfo,
)
from pdserve.protocol.wire import EngineInput, EngineMessage, Handlers
from pdserve.runtime import ended, freeze_startup_heap, pin_process

_IDLE_POLL_MS = 100
_TRANSFER_POLL_MS = 1  # while only background KV moves are in flight


class _Loop:
    def __init__(
        self,
        core: EngineCore,
        inp: zmq.Socket,
        out: zmq.Socket,
        report: bool = False,
        client: int | None = None,
    ) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.client_gone = ended(os.getppid() if client is None else client)
        self.report_every = core.config.report_interval_s if report else None
        if report:  # the controller's global prompt tree follows the prefix index
            core.kv.record_cache_events()
        self.last_report = 0.0
        self.trace = StepTrace.from_env(core.scheduler, core.config.instance_name)
        self.busy_s = 0.0  # wall time inside steps (TetriInfer's resource time)
        self.stopping = False
        # The loop's own inputs, then the core's and its participants' (EngineCore.handle).
        self.handlers = Handlers[None](
            {
                Shutdown: self.shutdown,
                AddRequest: self.add_request,
                AbortRequests: self.abort,
                StatsRequest: self.send_stats,
                **core.handlers(),
            }
        )

    def send(self, msg: EngineMessage) -> None:
        self.out.send(self.encoder.encode(msg))

    def run(self) -> None:
        while True:
            if not self.apply_inputs(self.poll_timeout_ms()) or self.client_gone():
                return  # told to stop, or the front end is gone: nobody to serve
            peers = self.core.runner.peers
            if peers is not None and not self.core.has_unfinished():
                peers.check()  # an idle parallel instance notices a rank gone (a step: send)
            self.core.poll_transfers()
            self.flush_messages()  # hand-off news before the outputs they precede
            if self.core.has_unfinished():
                t0 = time.perf_counter()
                outputs = self.core.step()
                dt = time.perf_counter() - t0
                self.busy_s += dt
                if self.trace is not None:
                    self.trace.record(t0, dt, self.core.bursts.last_steps)
                if outputs:
                    self.send(OutputBatch(outputs))
            self.flush_messages()

    def poll_timeout_ms(self) -> int:
        if self.core.has_unfinished():
            return 0
        if self.core.transfers_in_flight():
            return _TRANSFER_POLL_MS
        if self.report_every is not None:
            return min(_IDLE_POLL_MS, int(self.report_every * 1000))
        return _IDLE_POLL_MS

    def flush_messages(self) -> None:
        for msg in self.core.take_messages():
            self.send(msg)
        now = time.monotonic()
        if self.report_every is not None and now - self.last_report >= self.report_every:
            self.last_report = now
            self.send(self.load_report(now))

    def load_report(self, now: float) -> LoadReport:
        core, s, kv = self.core, self.core.scheduler, self.core.kv
        pending = sum(r.num_pending_tokens for r in s.waiting) + sum(
            r.num_pending_tokens
            for r in s.running
            if r.num_computed_tokens < len(r.prompt_token_ids)
        )
        role = core.role
        events = kv.take_cache_events()
        return LoadReport(
            sent_at=now,
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            num_waiting_tokens=pending,
            num_obtainable_blocks=kv.num_obtainable_blocks,
            num_blocks=kv.cfg.num_blocks,
            num_held=role.num_held,
            num_transferring=role.num_transferring,
            num_reserved=role.num_reserved,
            busy_s=self.busy_s,
            cache_stored=events.stored,
            cache_removed=events.removed,
        )

    def apply_inputs(self, timeout_ms: int) -> bool:
        """Apply all queued inputs; False on Shutdown."""
        if not self.inp.poll(timeout_ms):
            return True
        while True:
            try:
                raw = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if not self.apply(self.decoder.decode(raw)):
                return False

    def apply(self, msg: EngineInput) -> bool:
        """Apply one input; False once it was Shutdown."""
        self.handlers(msg)
        return not self.stopping

    # ---- handlers, one per input type -------------------------------------------------

    def shutdown(self, msg: Shutdown) -> None:
        self.stopping = True

    def add_request(self, msg: AddRequest) -> None:
        try:
            req = self.core.new_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                msg.arrival,
                msg.output_token_ids,
            )
            req.prediction = msg.prediction  # a migrated request keeps its first one
            self.core.queue(req, msg.handoff)
        except InvalidRequestError as e:
            self.send(RequestRejected(msg.request_id, e.message, e.param))
        except EngineOverloadedError as e:
            self.send(RequestRejected(msg.request_id, str(e), None, overloaded=True))

    def abort(self, msg: AbortRequests) -> None:
        aborted = [self.core.abort(rid) for rid in msg.request_ids]
        if any(aborted):
            self.send(OutputBatch([a for a in aborted if a is not None]))

    def send_stats(self, msg: StatsRequest) -> None:
        self.send(self.stats(msg.request_id, msg.check_integrity))

    def stats(self, request_id: int, check: bool) -> EngineStats:
        s, kv = self.core.scheduler, self.core.kv
        routes = self.core.link.transport.routes() if self.core.link is not None else {}
        stage = self.core.runner.stage
        swap = None if stage is None else stage.swap
        error = None
        if check:
            try:
                self.core.check_integrity()
            except AssertionError as e:
                error = str(e) or "integrity check failed"
        return EngineStats(
            request_id=request_id,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_swapped=len(s.swapped),
            num_free_blocks=kv.num_free_blocks,
            num_used_blocks=kv.num_used_blocks,
            num_cached_blocks=kv.num_cached_blocks,
            prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_queries=kv.prefix_cache_queries,
            integrity_error=error,
            num_preemptions=s.num_preemptions,
            num_admission_waits=self.core.admission.num_waits,
            num_admission_held=self.core.admission.num_held,
            num_prefill_batches=s.waiting.num_batches,
            num_prefill_overtakes=s.waiting.num_overtakes,
            busy_ms=round(self.busy_s * 1000),
            num_steps=self.core.bursts.num_steps,
            num_burst_steps=self.core.bursts.num_burst_steps,
            kv_routes_shm=routes.get("shm", 0),
            kv_routes_tcp=routes.get("tcp", 0),
            staged_peak_blocks=0 if swap is None else swap.peak_blocks,
            **self.core.stats(),  # the role's and the features' fields
        )


def _stop_token_ids(config: EngineConfig) -> Sequence[int]:
    """The ids that end a generation: the front end's, else the tokenizer's."""
    if config.stop_token_ids is not None:
        return config.stop_token_ids
    from pdserve.model.tokenizer import Tokenizer  # transformers: only when needed

    return Tokenizer.from_model_path(resolve_model(config.model)).stop_token_ids


def _start_heartbeat(ctx: zmq.Context, output_addr: str, interval_s: float) -> threading.Event:
    """A daemon thread sending `Heartbeat` every `interval_s` on its own socket (ZeroMQ
    sockets are not shared between threads) until the returned event is set. It runs
    while a step computes (torch releases the GIL), so silence means the process is
    stopped or gone, not busy."""
    stop = threading.Event()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()

    def beat() -> None:
        while not stop.wait(interval_s):
            sock.send(encoder.encode(Heartbeat(time.monotonic())))
        sock.close(0)

    threading.Thread(target=beat, name="pdserve-heartbeat", daemon=True).start()
    return stop


def weights_info(model: CausalLM, kv_dtype: str) -> WeightsInfo:
    q = model.quantization
    return WeightsInfo(
        q.mode, model.weight_formats, q.reason, model.activations, kv_dtype, model.compiled
    )


def run_engine_process(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    report: bool = False,
    client: int | None = None,
    spawn: Spawn | None = None,
) -> None:
    """Process entry point (spawned by a cluster `Instance`).
    `report`: send a `LoadReport` every `config.report_interval_s`. `client`: the pid of
    the process it serves (default: its parent); the engine exits when that ends.
    `spawn`: how a parallel instance starts its worker ranks (default: subprocesses).

    Ctrl-C in a terminal signals the whole process group: the server drains and then
    shuts its engines down, so an engine ignores SIGINT rather than die mid-drain."""
    if threading.current_thread() is threading.main_thread():  # a Ray actor's may not be
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    if config.stub_rate is not None:  # a benchmark's token source, no model (engine/stub.py)
        beat = _start_heartbeat(ctx, output_addr, config.report_interval_s) if report else None
        parent = os.getppid() if client is None else client
        try:
            run_stub(config, config.stub_rate, inp, out, report, parent)
        finally:
            if beat is not None:
                beat.set()
            inp.close(0)
            out.close()
            ctx.term()
        return
    try:
        if config.cpus is not None:
            pin_process(config.cpus)
        ranks = start_ranks(config, spawn)
        model = load_model(config, None if ranks is None else ranks.shard)
        core = build_core(config, model, _stop_token_ids(config), ranks)
    except Exception as e:  # report, then exit: the frontend shows the message
        out.send(encoder.encode(EngineFailed(f"engine failed to start: {e}")))
        sys.exit(1)
    freeze_startup_heap()
    ready = EngineReady(
        core.max_model_len,
        model.config.vocab_size,
        core.kv_layout,
        weights_info(model, core.kv_layout.dtype),
    )
    out.send(encoder.encode(ready))
    loop = _Loop(core, inp, out, report, client)
    beat = _start_heartbeat(ctx, output_addr, config.report_interval_s) if report else None
    try:
        loop.run()
    except Exception as e:
        traceback.print_exc()
        out.send(encoder.encode(EngineFailed(f"engine step failed: {type(e).__name__}: {e}")))
        sys.exit(1)
    finally:
        if loop.trace is not None:
            loop.trace.close()
        if beat is not None:
            beat.set()
        core.close()
        inp.close(0)
        out.close()
        ctx.term()
