"""EngineCore: schedule -> run -> sample -> check stop conditions, on token ids.

Text (detokenization, stop strings) is not the core's business: `Engine` layers an
output processor on top, and later the HTTP process does that work while the core
runs in its own process. A stop string found there comes back as `finish_request`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pdserve.config import EngineConfig
from pdserve.engine.messages import EngineOutput, NewToken
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestMetrics
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import SampledToken, SamplingRow, sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.errors import EngineOverloadedError, InvalidRequestError
from pdserve.kv.cache import KVCache
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.manager import KVManager
from pdserve.model.base import CausalLM


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
        cache = KVCache(
            model.config,
            kv_config.num_blocks,
            kv_config.num_host_blocks,
            kv_config.block_size,
            config.torch_dtype,
            config.device,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(model, cache, self.kv)
        self.requests: dict[str, Request] = {}

    # ---- requests --------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival: float | None = None,
    ) -> Request:
        """Validate and queue. Raises InvalidRequestError or EngineOverloadedError;
        nothing is allocated then. `arrival` (time.monotonic(), system-wide) is when
        the request reached the frontend, so queue time includes the trip here."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        prompt = list(prompt_token_ids)
        self._validate(prompt, params)
        self._check_queue()
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(request_id, prompt, params, gen)
        if arrival is not None:
            req.times.arrival = arrival
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _check_queue(self) -> None:
        limit = self.scheduler.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise EngineOverloadedError(
                f"the server is overloaded: its queue of {limit} waiting requests is full; "
                "retry later"
            )

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not prompt:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt"
            )
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"stop token id {bad} is outside the vocabulary [0, {vocab})", "stop_token_ids"
            )
        limit = self.max_model_len
        if len(prompt) + params.max_tokens > limit:
            param = "prompt" if len(prompt) >= limit else "max_tokens"
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, but {len(prompt)} "
                f"prompt tokens plus max_tokens={params.max_tokens} would need "
                f"{len(prompt) + params.max_tokens}",
                param,
            )

    def abort(self, request_id: str) -> EngineOutput | None:
        """Cancel; its KV returns to the pool now. None if unknown or already finished."""
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
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.stop_reason = stop_reason
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step --------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        sched = self.scheduler.schedule()
        sampled, logits = self.runner.execute(sched)
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
        if status is RequestStatus.RUNNING:
            return EngineOutput(req.request_id, new, num_cached_tokens=req.num_cached_prompt_tokens)
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
