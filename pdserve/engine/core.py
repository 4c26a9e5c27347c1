"""EngineCore: schedule -> run -> sample -> check stop conditions, on token ids.

Text (detokenization, stop strings) is not the core's business: `Engine` layers an
output processor on top, and later the HTTP process does that work while the core
runs in its own process. A stop string found there comes back as `finish_request`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pdserve.config import EngineConfig, Role
from pdserve.engine.decode_role import DecodeRole
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestMetrics
from pdserve.engine.prefill_role import PrefillRole, generator_from_state
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import SampledToken, SamplingRow, sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.engine.validation import check_request
from pdserve.errors import EngineOverloadedError, InvalidRequestError
from pdserve.kv.cache import KVCache
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.layout import KVLayout
from pdserve.kv.manager import KVManager
from pdserve.kv.transfer import (
    FaultConfig,
    Region,
    TransferWorker,
    Transport,
    make_transport,
)
from pdserve.model.base import CausalLM, ForwardHooks
from pdserve.protocol.core import EngineOutput, NewToken, RequestRejected
from pdserve.protocol.handoff import AddPrefilled, Handoff, ReserveKV
from pdserve.protocol.wire import EngineMessage


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        kv_config: KVCacheConfig,
        max_model_len: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.config = config
        self.model = model
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVManager(kv_config)
        # Messages for the controller besides step outputs (hand-offs, reservations).
        self.outbox: list[EngineMessage] = []
        self.transport: Transport | None = None
        self.worker: TransferWorker | None = None
        mc = model.config
        layout = KVLayout(
            num_layers=mc.num_hidden_layers,
            num_blocks=kv_config.num_blocks,
            block_size=kv_config.block_size,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=config.dtype,
        )
        region = self._open_transfer(layout) if config.role is not Role.COLOCATED else None
        cache = KVCache(
            layout,
            kv_config.num_host_blocks,
            config.device,
            device_tensor=region.tensor if region is not None else None,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(model, cache, self.kv)
        self.requests: dict[str, Request] = {}
        self.prefill_role: PrefillRole | None = None
        self.decode_role: DecodeRole | None = None
        if region is not None:
            self._start_role(region)

    def _open_transfer(self, layout: KVLayout) -> Region:
        t = self.config.transfer
        self.transport = make_transport(
            t.transport,
            host=t.host,
            timeout_s=t.timeout_s,
            verify_checksum=t.verify_checksum,
            faults=fault_config(self.config),
        )
        self.worker = TransferWorker(num_threads=1, name=f"{self.config.instance_name}-kv")
        return self.transport.create_region(self.config.instance_name, layout)

    def _start_role(self, region: Region) -> None:
        assert self.transport is not None and self.worker is not None
        args = (self.kv, region, self.transport, self.worker, self.config.transfer, self._post)
        if self.config.role is Role.PREFILL:
            self.prefill_role = PrefillRole(*args)
            self.runner.hooks = ForwardHooks(on_layer_done=self.prefill_role.on_layer_done)
        else:
            self.decode_role = DecodeRole(*args)

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
        """Stop transfer threads and release the KV region (shared memory)."""
        if self.worker is not None:
            self.worker.close()
        if self.transport is not None:
            self.transport.close()

    # ---- requests --------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival: float | None = None,
        handoff: Handoff | None = None,
    ) -> Request:
        """Validate and queue. Raises InvalidRequestError or EngineOverloadedError;
        nothing is allocated then. `arrival` (time.monotonic(), system-wide) is when
        the request reached the frontend, so queue time includes the trip here.
        `handoff` (prefill role): pass the request on after its first token."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        prompt = list(prompt_token_ids)
        self._validate(prompt, params)
        self._check_queue()
        if handoff is not None and self.prefill_role is None:
            raise InvalidRequestError("this instance is not a prefill instance", "handoff")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(request_id, prompt, params, gen)
        if arrival is not None:
            req.times.arrival = arrival
        if handoff is not None:
            assert self.prefill_role is not None
            self.prefill_role.register(req, handoff)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def add_prefilled(self, msg: AddPrefilled) -> None:
        """Decode role: a request prefilled elsewhere (see decode_role.py). A request
        this instance cannot take is answered with RequestRejected."""
        if self.decode_role is None:
            self._post(RequestRejected(msg.request_id, "not a decode instance", None))
            return
        try:
            self._validate(msg.prompt_token_ids, msg.params)
        except InvalidRequestError as e:
            self._post(RequestRejected(msg.request_id, e.message, e.param))
            return
        gen = generator_from_state(msg.generator_state)
        req = Request(msg.request_id, list(msg.prompt_token_ids), msg.params, gen)
        req.output_token_ids = list(msg.output_token_ids)
        req.times.arrival = msg.arrival
        ready = self.decode_role.add(req, msg)
        if ready is not None:
            self._start_decoding(ready)

    def reserve(self, msg: ReserveKV) -> None:
        if self.decode_role is None:
            self._post(RequestRejected(msg.request_id, "not a decode instance", None))
            return
        self.decode_role.reserve(msg)

    def release(self, request_ids: Sequence[str]) -> None:
        """ReleaseKV: free hand-off KV (held prompt KV, or a reservation)."""
        for rid in request_ids:
            if self.prefill_role is not None:
                self.prefill_role.release(rid)
            if self.decode_role is not None:
                self.decode_role.release(rid)

    def _start_decoding(self, req: Request) -> None:
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
        if self.prefill_role is not None and self.prefill_role.abort(request_id):
            return None
        if self.decode_role is not None and self.decode_role.abort(request_id):
            return None
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return EngineOutput(
            request_id,
            (),
            finish_reason="abort",
            num_cached_tokens=req.num_cached_prompt_tokens,
            metrics=request_metrics(req),
        )

    def finish_request(self, request_id: str, stop_reason: str) -> None:
        """End a request that the output processor found a stop string in."""
        if self.prefill_role is not None and self.prefill_role.abort(request_id):
            return
        if self.decode_role is not None and self.decode_role.abort(request_id):
            return
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.stop_reason = stop_reason
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def transfers_in_flight(self) -> bool:
        """KV moves run in the background: the loop should poll again soon."""
        return bool(
            (self.prefill_role is not None and self.prefill_role.busy())
            or (self.decode_role is not None and self.decode_role.busy())
        )

    def poll_transfers(self) -> None:
        """Advance hand-offs without blocking: finished fetches join the batch, finished
        pushes free their blocks, leases expire, waiting KV is admitted."""
        if self.prefill_role is not None:
            self.prefill_role.poll()
        if self.decode_role is not None:
            for req in self.decode_role.poll():
                self._start_decoding(req)
            free_slots = self.scheduler.config.max_num_seqs - len(self.scheduler.running)
            self.decode_role.admit(free_slots)

    # ---- one step --------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        sched = self.scheduler.schedule()
        if self.prefill_role is not None:
            self.prefill_role.begin_step(sched.seqs)
        sampled, logits = self.runner.execute(sched)
        if self.prefill_role is not None:
            self.prefill_role.end_step()
        for seq in sched.seqs:
            self.scheduler.advance(seq)
        if logits is None:
            return []
        tokens = sample(logits, [self._sampling_row(s) for s in sampled])
        return [self._append(s, t) for s, t in zip(sampled, tokens, strict=True)]

    def _sampling_row(self, seq: ScheduledSeq) -> SamplingRow:
        r = seq.request
        return SamplingRow(
            r.params, r.generator, r.prompt_token_ids, r.output_token_ids, self.eos_token_ids
        )

    def _append(self, seq: ScheduledSeq, tok: SampledToken) -> EngineOutput:
        req = seq.request
        req.output_token_ids.append(tok.token_id)
        if req.times.first_token is None:
            req.times.first_token = time.monotonic()
        status = self._check_stop(req, tok.token_id)
        new = (NewToken(tok.token_id, tok.logprob, tok.top_logprobs),)
        role = self.prefill_role
        if status is RequestStatus.RUNNING:
            if role is not None and req.request_id in role.outgoing:
                self.requests.pop(req.request_id, None)
                self.scheduler.detach(req)
                role.hand_off(req)
            return EngineOutput(req.request_id, new, num_cached_tokens=req.num_cached_prompt_tokens)
        if role is not None:
            role.forget(req.request_id)
        self.requests.pop(req.request_id, None)
        self.scheduler.finish(req, status)
        return EngineOutput(
            req.request_id,
            new,
            finish_reason=status.value,
            stop_reason=req.stop_reason,
            stopped_by_token=status is RequestStatus.FINISHED_STOPPED,
            num_cached_tokens=req.num_cached_prompt_tokens,
            metrics=request_metrics(req),
        )

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


def fault_config(config: EngineConfig) -> FaultConfig | None:
    t = config.transfer
    if not t.injects_faults:
        return None
    return FaultConfig(
        failure_rate=t.fault_failure_rate,
        delay_s=t.fault_delay_s,
        bandwidth_bytes_per_s=t.fault_bandwidth,
        seed=t.fault_seed,
    )


def request_metrics(req: Request) -> RequestMetrics:
    t = req.times

    def span(a: float | None, b: float | None) -> float | None:
        return b - a if a is not None and b is not None else None

    return RequestMetrics(
        queue_time=span(t.arrival, t.first_scheduled),
        prefill_time=span(t.first_scheduled, t.first_token),
        decode_time=span(t.first_token, t.finished),
        ttft=span(t.arrival, t.first_token),
        e2e=span(t.arrival, t.finished),
        num_preemptions=req.num_preemptions,
    )
