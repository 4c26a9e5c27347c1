"""A stub instance: a token source in place of the model, for measuring the front end.

`pdserve serve stub:RATE --allow-stub` (docs/bench.md "The front end") runs the real
front end - HTTP, tokenization, detokenization, stop strings, the controller, routing,
the prompt trees - over real instance processes that speak the real protocol on the real
sockets, but compute nothing: each running request gets one token every `1 / RATE`
seconds, all of an instance's requests in one `OutputBatch` per tick, as a decode step
would send them. The front end and controller can then be loaded far beyond what this
CPU computes (64 instances streaming 100 tokens/s to 16 requests each).

What a request gets is fixed, so a test can check it token for token: its prompt's
token ids again, from the first, cycling, until `max_tokens` (finish "length"); one of
the prompt ids that is a stop id does not end it. Sampling (temperature, penalties,
grammars, logit biases, seeds) is ignored; a request asking for logprobs gets 0.0 for
its token and no alternatives. It is never a model: `serve` refuses `stub:` without
`--allow-stub`, and only colocated instances of one rank can be stubs
(server/flags.py).

Contract: the same as `engine_process.run_engine_process`'s, for the messages a
colocated instance receives (AddRequest, AbortRequests, StatsRequest, Shutdown):
EngineReady first (geometry from the model's config and the KV flags, as the real
instance computes it), outputs in order, an abort answered with its "abort" output,
load reports and heartbeats on the same interval. Any other input is a bug of the
caller (`Handlers` raises) and fails the instance.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import msgspec
import zmq

from pdserve.config import EngineConfig
from pdserve.kv.layout import KVLayout
from pdserve.protocol.core import (
    AbortRequests,
    AddRequest,
    EngineOutput,
    EngineReady,
    EngineStats,
    LoadReport,
    NewToken,
    OutputBatch,
    Shutdown,
    StatsRequest,
    WeightsInfo,
)
from pdserve.protocol.timing import RequestTimes
from pdserve.protocol.wire import EngineInput, EngineMessage, Handlers
from pdserve.runtime import ended

_IDLE_POLL_MS = 100


@dataclass
class _Stream:
    prompt: list[int]
    max_tokens: int
    logprobs: bool
    times: RequestTimes
    sent: int = 0  # tokens given so far (a migrated request's carried output counts)

    def next_token(self) -> NewToken:
        token = self.prompt[self.sent % len(self.prompt)]
        self.sent += 1
        return NewToken(token, 0.0 if self.logprobs else None)


class StubLoop:
    """The stub instance's loop (module doc): apply inputs, tick, report."""

    def __init__(
        self,
        config: EngineConfig,
        rate: float,
        max_model_len: int,
        num_blocks: int,
        inp: zmq.Socket,
        out: zmq.Socket,
        report: bool,
        client: int,
    ) -> None:
        self.gap = 1.0 / rate
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.inp, self.out = inp, out
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.client_gone = ended(client)
        self.report_every = config.report_interval_s if report else None
        self.last_report = 0.0
        self.streams: dict[str, _Stream] = {}
        self.next_tick = 0.0
        self.busy_s = 0.0
        self.num_ticks = 0
        self.stopping = False
        self.handlers = Handlers[None](
            {
                Shutdown: self.shutdown,
                AddRequest: self.add_request,
                AbortRequests: self.abort,
                StatsRequest: self.send_stats,
            }
        )

    def send(self, msg: EngineMessage) -> None:
        self.out.send(self.encoder.encode(msg))

    def run(self) -> None:
        while not self.stopping and not self.client_gone():
            self.apply_inputs(self.poll_timeout_ms())
            now = time.monotonic()
            if self.streams and now >= self.next_tick:
                t0 = time.perf_counter()
                self.send(OutputBatch(self.tick(now)))
                self.busy_s += time.perf_counter() - t0
                # On schedule; a tick that came late does not make the next one early.
                self.next_tick = max(self.next_tick + self.gap, now)
            if self.report_every is not None and now - self.last_report >= self.report_every:
                self.last_report = now
                self.send(self.load_report(now))

    def poll_timeout_ms(self) -> int:
        if self.streams:
            return max(0, math.ceil((self.next_tick - time.monotonic()) * 1000))
        if self.report_every is not None:
            return min(_IDLE_POLL_MS, int(self.report_every * 1000))
        return _IDLE_POLL_MS

    def apply_inputs(self, timeout_ms: int) -> None:
        if not self.inp.poll(timeout_ms):
            return
        while not self.stopping:
            try:
                raw = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handlers(self.decoder.decode(raw))

    def tick(self, now: float) -> list[EngineOutput]:
        """One token for every running request; the finished ones leave."""
        self.num_ticks += 1
        outputs = []
        for rid, s in list(self.streams.items()):
            token = s.next_token()
            if s.times.first_token is None:
                s.times.first_scheduled = s.times.first_token = now
            if s.sent < s.max_tokens:
                outputs.append(EngineOutput(rid, (token,)))
                continue
            s.times.finished = now
            del self.streams[rid]
            outputs.append(EngineOutput(rid, (token,), "length", metrics=s.times.metrics()))
        return outputs

    # ---- handlers -------------------------------------------------------------------

    def shutdown(self, msg: Shutdown) -> None:
        self.stopping = True

    def add_request(self, msg: AddRequest) -> None:
        """The front end validated the request (lengths against `max_model_len`)."""
        p = msg.params
        limit = self.max_model_len - len(msg.prompt_token_ids) - len(msg.output_token_ids)
        arrival = time.monotonic() if msg.arrival is None else msg.arrival
        if not self.streams:  # an idle instance's first tick is one gap away, as a step is
            self.next_tick = time.monotonic() + self.gap
        self.streams[msg.request_id] = _Stream(
            prompt=list(msg.prompt_token_ids),
            max_tokens=min(p.max_tokens, len(msg.output_token_ids) + max(limit, 1)),
            logprobs=p.logprobs is not None,
            times=RequestTimes(arrival),
            sent=len(msg.output_token_ids),
        )

    def abort(self, msg: AbortRequests) -> None:
        gone = [rid for rid in msg.request_ids if self.streams.pop(rid, None) is not None]
        if gone:
            self.send(OutputBatch([EngineOutput(rid, (), "abort") for rid in gone]))

    def send_stats(self, msg: StatsRequest) -> None:
        self.send(
            EngineStats(
                request_id=msg.request_id,
                num_running=len(self.streams),
                num_waiting=0,
                num_swapped=0,
                num_free_blocks=self.num_blocks,
                num_used_blocks=0,
                num_cached_blocks=0,
                prefix_cache_hits=0,
                prefix_cache_queries=0,
                busy_ms=round(self.busy_s * 1000),
                num_steps=self.num_ticks,
            )
        )

    def load_report(self, now: float) -> LoadReport:
        return LoadReport(
            sent_at=now,
            num_waiting=0,
            num_running=len(self.streams),
            num_waiting_tokens=0,
            num_obtainable_blocks=self.num_blocks,
            num_blocks=self.num_blocks,
            num_held=0,
            num_transferring=0,
            num_reserved=0,
            busy_s=self.busy_s,
        )


def run_stub(
    config: EngineConfig,
    rate: float,
    inp: zmq.Socket,
    out: zmq.Socket,
    report: bool,
    client: int,
) -> None:
    """Serve as a stub instance until Shutdown or the client's end (the caller sends the
    heartbeats and closes the sockets). The geometry is the real instance's for the same
    flags (`build_core`)."""
    from pdserve.engine.engine import kv_config_for, max_model_len_for
    from pdserve.model.source import load_config, resolve_model

    model = load_config(resolve_model(config.model))
    kv = kv_config_for(config, model, quantized=True)
    max_len = max_model_len_for(config, model, kv)
    layout = KVLayout(
        model.num_hidden_layers,
        kv.num_blocks,
        kv.block_size,
        model.num_key_value_heads,
        model.head_dim,
        config.kv_dtype(True),
    )
    note = f"a stub instance: no model, {rate:g} tokens/s per request"
    weights = WeightsInfo("none", ["stub"], note, [], layout.dtype, False)
    out.send(msgspec.msgpack.encode(EngineReady(max_len, model.vocab_size, layout, weights)))
    StubLoop(config, rate, max_len, kv.num_blocks, inp, out, report, client).run()
