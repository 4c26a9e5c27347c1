"""Continuous batching with chunked prefill under a per-step token budget.

Each step the scheduler decides, for every request it will run, how many new tokens
to compute ("num_new_tokens"). Decodes compute 1; prompts compute a chunk that fits
the remaining budget, so a long prompt is split across steps while the decodes of
running requests ride along (Sarathi-style, for the colocated role).

Order of a step (FCFS throughout, except the order of waiting prompts, which
engine/prefill_queue.py decides: fcfs by default, sjf / ljf per scheduling batch):
1. running requests, oldest first: each gets its tokens, or - when the KV pool is
   full - the newest running request is preempted (swapped to the host tier when it
   fits there, otherwise its KV is dropped and it is recomputed later) until it fits;
2. swapped requests come back (oldest first) if nothing was preempted this step;
3. waiting requests are admitted while budget, sequence slots and blocks remain.
   Admission stops at the first one that does not fit (no overtaking: FCFS).

Prompt tokens (chunks of waiting, resumed or partly prefilled requests: every request
not yet past its prompt) have a budget of their own while any running request is
decoding: `SchedulerConfig.prompt_cap` (128 on CPU by default), within the step's
budget. A decode's time between tokens is then a decode step plus at most that much
prefill, not a whole 512-token chunk (Sarathi-Serve); a step with nothing decoding
gives prompts everything.

The scheduler never touches block ids: it asks `KVManager` and forwards the swap
plans it returns to the model runner, which executes copies before the forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.config import PreemptionMode, SchedulerConfig
from pdserve.engine.prefill_queue import PrefillQueue
from pdserve.engine.request import Request, RequestStatus
from pdserve.kv.manager import KVManager, SwapPlan


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the last known token, so its logits are sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[SwapPlan] = field(default_factory=list)  # run first
    swap_in: list[SwapPlan] = field(default_factory=list)  # then these, then the forward

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, device: str = "cpu") -> None:
        self.config = config
        self.kv = kv
        self.prompt_cap = config.prompt_cap(device)
        self.waiting = PrefillQueue(
            config.prefill_policy, config.prefill_sched_batch, self._uncached_tokens
        )
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0  # since start (swap and recompute alike)

    # ---- queue management ------------------------------------------------------

    def add(self, req: Request, first: bool = False) -> None:
        """Queue `req`; `first`: ahead of every waiting request (a migrated request
        already waited once, before its instance failed)."""
        if first:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Admit a request whose KV is already in its block table (decode role: it
        arrived from a prefill instance). Joins the batch as the newest."""
        req.status = RequestStatus.RUNNING
        if req.times.first_scheduled is None:
            req.times.first_scheduled = time.monotonic()
        self.running.append(req)

    def detach(self, req: Request) -> None:
        """Take a running request out of the batch but keep its KV (prefill role: the
        blocks now wait to be handed off; whoever detaches frees them)."""
        self.running.remove(req)
        req.status = RequestStatus.HANDING_OFF

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove `req` from whichever queue holds it and release its KV."""
        assert status.finished
        was = req.status
        if was == RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req.request_id)
        elif was == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif was == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.kv.free(req.request_id)
        req.status = status
        req.times.finished = time.monotonic()

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self._prompt_budget())
        preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        return out

    def _prompt_budget(self) -> int:
        """Prompt tokens this step may take: the cap while anything decodes."""
        cap = self.prompt_cap
        if cap is not None and any(_is_decoding(r) for r in self.running):
            return cap
        return self.config.max_num_batched_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: _Budget) -> bool:
        """Give running requests their tokens, oldest first. Returns whether anything
        was preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and budget.total > 0:
            req = self.running[i]
            num_new = budget.grant(req, req.num_pending_tokens)
            if num_new == 0:  # a prompt chunk, and no prompt budget left this step
                i += 1
                continue
            fits, evicted_any = self._make_room(req, num_new, out)
            preempted |= evicted_any
            if not fits:
                break  # req itself was the newest and got preempted
            out.seqs.append(ScheduledSeq(req, num_new))
            budget.spend(req, num_new)
            i += 1
        return preempted

    def _make_room(self, req: Request, num_new: int, out: SchedulerOutput) -> tuple[bool, bool]:
        """Allocate for `req`, preempting the newest running requests until it fits.

        Returns (req got its blocks, something was preempted). When req is itself the
        newest, it is preempted and (False, True) comes back."""
        preempted = False
        while not self._allocate(req, num_new):
            victim = self.running[-1]
            self._preempt(victim, out)
            preempted = True
            if victim is req:
                return False, True
        return True, preempted

    def _schedule_swapped(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.swapped and budget.total > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            num_new = budget.grant(req, req.num_pending_tokens)
            if num_new == 0 or not self.kv.can_swap_in(req.request_id):
                break
            out.swap_in.append(self.kv.swap_in(req.request_id))
            self.swapped.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if not self._allocate(req, num_new):
                break  # holds its blocks; continues next step
            out.seqs.append(ScheduledSeq(req, num_new))
            budget.spend(req, num_new)

    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.waiting and budget.prompt > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            assert req is not None
            cached = self.kv.match_prefix(req.all_token_ids).num_cached_tokens
            num_new = min(req.num_tokens - cached, budget.prompt)
            alloc = self.kv.allocate(req.request_id, req.all_token_ids, num_new)
            if alloc is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = self.kv.num_computed_tokens(req.request_id)
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = alloc.num_cached_tokens
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = time.monotonic()
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, num_new))
            budget.spend(req, num_new)

    def _uncached_tokens(self, req: Request) -> int:
        """The tokens a waiting request's prefill computes (its size for sjf / ljf)."""
        return req.num_tokens - self.kv.match_prefix(req.all_token_ids).num_cached_tokens

    def _allocate(self, req: Request, num_new: int) -> bool:
        return self.kv.allocate(req.request_id, req.all_token_ids, num_new) is not None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        swap = self.config.preemption_mode == PreemptionMode.SWAP
        if swap and self.kv.can_swap_out(req.request_id):
            out.swap_out.append(self.kv.swap_out(req.request_id))
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            return
        # Recompute: drop the KV; prompt + generated tokens are prefilled again later.
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def extend(self, seqs: list[ScheduledSeq], steps: int) -> bool:
        """Make every decode row of `seqs` hold blocks for `steps` tokens (a decode burst,
        engine/core.py), if the pool has them all; else False with nothing allocated."""
        need = sum(max(0, self.kv.num_new_blocks(s.request.request_id, steps)) for s in seqs)
        if need > self.kv.num_obtainable_blocks:
            return False
        for s in seqs:
            fits = self._allocate(s.request, steps)
            assert fits  # counted above
        return True

    # ---- after the forward pass ------------------------------------------------

    def advance(self, seq: ScheduledSeq) -> None:
        """Record that `seq`'s new tokens now have KV in the cache."""
        req = seq.request
        req.num_computed_tokens += seq.num_new_tokens
        self.kv.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)


def _is_decoding(req: Request) -> bool:
    """Past its prompt: each step computes one generated token."""
    return req.num_computed_tokens >= len(req.prompt_token_ids)


class _Budget:
    """One step's token budget: `total` for everything, `prompt` (<= total) for the
    tokens of requests not yet past their prompt."""

    def __init__(self, total: int, prompt: int) -> None:
        self.total = total
        self.prompt = min(prompt, total)

    def grant(self, req: Request, wanted: int) -> int:
        """Tokens `req` may compute this step (0: none)."""
        return min(wanted, self.total if _is_decoding(req) else self.prompt)

    def spend(self, req: Request, n: int) -> None:
        self.total -= n
        if not _is_decoding(req):
            self.prompt -= n
        self.prompt = min(self.prompt, self.total)
