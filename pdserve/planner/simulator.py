"""Discrete-event simulation of a serving cluster (DistServe §4.1 "simulator building").

Instances step as our engines do; a step's duration comes from the latency model
(`StepCost`). Per-request results: TTFT, TPOT, E2E; per instance: utilisation.

Semantics (each mirrors an engine; tests pin them down exactly):

- **Prefill instance** (`engine/roles/prefill.py`): one FCFS queue. A step takes
  prompts from the head within the `max_batch_tokens` budget; with `chunked` the
  last one taken may be split (chunked prefill, TetriInfer's ChunkSize), without it
  whole prompts are batched while they fit L_m and a longer prompt runs alone
  (DistServe §4.3). A prompt's first token is emitted when the step holding its last
  chunk ends (pipelines: after all stages). A prompt is admitted only when its KV
  fits beside the prompts in progress; KV held after the prefill (waiting for the
  decode side to pull it) is not modelled.
- **Decode instance** (`engine/roles/decode.py`): FCFS queue; a request is admitted at
  a step boundary (or at once when idle) when a batch slot is free and its whole KV,
  prompt + output tokens, fits (reserved up front, so nothing is ever preempted).
  Its prompt KV then transfers (input_len * kv_bytes_per_token / bandwidth) and it
  joins the batch at the first step boundary after the transfer ends. It makes
  output_len - 1 tokens, one per step (the first came from the prefill).
- **Colocated instance** (`engine/scheduler.py`): with `chunked` (our engine,
  Sarathi-style) each step gives every decoding request 1 token, continues the
  prompt in progress, then admits waiting prompts FCFS while the token budget, the
  batch slots and the KV reservation allow (admission stops at the first that does
  not fit); while anything decodes, prompts take at most `prompt_cap` tokens of a
  step (when set: the engine's `max_prefill_tokens_with_decodes`). Without `chunked`
  (vLLM before chunked prefill) a step is either a
  prefill-only batch of whole admitted prompts or a decode step of everything
  running.
- **Dispatch**: prefill to the instance with the fewest requests not yet prefilled,
  decode and colocated to the fewest unfinished (ties: lowest index), at the moment
  of dispatch.

Step times: a decode or colocated iteration costs `stages * base + prices . counts`
(a pipeline cycles `stages` micro-batches; the per-count prices are per stage), where
the counts are prompt tokens, attention units ((k+c)^2 - k^2 per chunk), prompts
finishing, decode rows past the knee (`latency.decode_rows`), decode tokens (their
all-reduces and stage hops) and context tokens (a decoding request attends over its
prompt and every token generated so far). A prefill pipeline admits a new batch
every stage time; its requests finish `cost.latency(stage_time)` after it starts.

Speed: between events a decode batch is constant and its step times form an
arithmetic progression (the context grows by the batch size per step), so an
instance jumps straight to the next finish, transfer end or dispatch in closed form.
Prefill and decode are simulated in two passes (prefill completions do not depend on
the decode side when KV holding is not modelled); instances advance lazily to each
dispatch time.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.planner.latency import StepCost, decode_rows
from pdserve.planner.model_spec import PlanInputError
from pdserve.planner.workload import SimWorkload

INF = math.inf


@dataclass(frozen=True)
class InstanceSpec:
    cost: StepCost
    kv_capacity_tokens: int
    max_batch_size: int = 256
    max_batch_tokens: int = 512
    chunked: bool = True
    # Colocated, chunked: prompt tokens a step takes while anything decodes (the engine's
    # `SchedulerConfig.prompt_cap(device)`); None: the whole budget.
    prompt_cap: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_tokens < 1:
            raise PlanInputError("max_batch_size and max_batch_tokens must be >= 1")
        if self.prompt_cap is not None and self.prompt_cap < 1:
            raise PlanInputError(f"prompt_cap must be >= 1 (or None), got {self.prompt_cap}")


@dataclass(frozen=True)
class DisaggSystem:
    prefill: tuple[InstanceSpec, ...]
    decode: tuple[InstanceSpec, ...]
    kv_bytes_per_token: int
    transfer_bandwidth: float  # bytes/s; math.inf: free


@dataclass(frozen=True)
class ColocatedSystem:
    instances: tuple[InstanceSpec, ...]


@dataclass(frozen=True)
class SpeedNoise:
    """The machine's speed drifting: every `interval_s` of simulated time all step
    times are multiplied by a new factor, log-normal with mean 1 and log-std `sigma`
    (one sequence for the whole system, drawn from `seed`). A deterministic simulator
    gives every request of a light load the same TPOT; served steps scatter in runs
    of several seconds, and an SLO near the median TPOT sees that spread."""

    sigma: float
    interval_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.sigma >= 0 and self.interval_s > 0):
            raise PlanInputError(
                f"speed noise needs sigma >= 0 and interval_s > 0, got {self.sigma}, "
                f"{self.interval_s}"
            )


class _Speed:
    """Factors of a `SpeedNoise`, drawn as simulated time reaches them."""

    def __init__(self, noise: SpeedNoise) -> None:
        self.interval = noise.interval_s
        self.sigma = noise.sigma
        self.rng = np.random.default_rng(noise.seed)
        self.factors: list[float] = []

    def at(self, t: float) -> float:
        i = max(0, int(t / self.interval))
        while len(self.factors) <= i:
            z = self.rng.standard_normal(1024)
            self.factors += np.exp(self.sigma * z - self.sigma**2 / 2).tolist()
        return self.factors[i]

    def next_change(self, t: float) -> float:
        return (math.floor(t / self.interval) + 1) * self.interval


@dataclass
class SimResult:
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    utilization: dict[str, float] = field(default_factory=dict)
    makespan: float = 0.0

    def attainment(self, ttft_slo: float | None, tpot_slo: float | None) -> float:
        """Share of requests meeting both SLOs (None: that one is not judged)."""
        ok = np.ones(len(self.ttft), dtype=bool)
        if ttft_slo is not None:
            ok &= self.ttft <= ttft_slo
        if tpot_slo is not None:
            ok &= self.tpot <= tpot_slo
        return float(ok.mean())

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"makespan_s": self.makespan, "utilization": self.utilization}
        for name in ("ttft", "tpot", "e2e"):
            a = getattr(self, name)
            p50, p90, p99 = np.percentile(a, [50, 90, 99])
            out[name] = {
                "mean": float(a.mean()),
                "median": float(p50),
                "p90": float(p90),
                "p99": float(p99),
            }
        return out


class _Requests:
    """Per-request inputs and outputs as plain lists (fast scalar access)."""

    def __init__(self, w: SimWorkload, noise: SpeedNoise | None = None) -> None:
        # None: step times exactly as priced
        self.speed = _Speed(noise) if noise is not None and noise.sigma > 0 else None
        self.arrival: list[float] = w.arrivals.tolist()
        self.inp: list[int] = w.input_lens.tolist()
        self.out: list[int] = w.output_lens.tolist()
        n = len(self.inp)
        self.first: list[float] = [0.0] * n
        self.finish: list[float] = [0.0] * n


# ---- prefill ----------------------------------------------------------------------------


class _Prefill:
    def __init__(self, spec: InstanceSpec, reqs: _Requests, name: str) -> None:
        c = spec.cost
        self.spec, self.reqs, self.name = spec, reqs, name
        self.base, self.pt, self.pu, self.ps = c.base, c.prompt_token, c.prompt_unit, c.prompt_seq
        self.stages, self.hop = c.stages, c.hop_token
        self.t = 0.0
        self.busy = 0.0
        self.queue: deque[int] = deque()
        self.done_head = 0  # prompt tokens already computed for queue[0]
        self.used = 0  # KV tokens of admitted, unfinished prompts
        self.admitted_head = False  # queue[0] holds its KV already
        self.pending: list[float] = []  # completion times not yet reached (heap)
        self.assigned = 0
        self.completions: list[tuple[float, int]] = []

    def load_at(self, now: float) -> int:
        """Requests not yet prefilled at `now` (after advancing to it)."""
        self.advance_to(now)
        pend = self.pending
        while pend and pend[0] <= now:
            heapq.heappop(pend)
        return len(pend) + len(self.queue)

    def add(self, rid: int, now: float) -> None:
        if not self.queue and self.t < now:
            self.t = now
        self.queue.append(rid)

    def advance_to(self, now: float) -> None:
        while self.queue and self.t < now:
            self._step()

    def drain(self) -> None:
        while self.queue:
            self._step()

    def _step(self) -> None:
        """One batch from the head of the queue (never called with an empty queue)."""
        inp, cap = self.reqs.inp, self.spec.kv_capacity_tokens
        q = self.queue
        budget = self.spec.max_batch_tokens
        tokens = units = seqs = 0
        finished: list[int] = []
        partial: int | None = None  # tokens done of a prompt left unfinished
        i = 0
        while i < len(q) and budget > 0:
            rid = q[i]
            done = self.done_head if i == 0 else 0
            if not (i == 0 and self.admitted_head):
                if self.used + inp[rid] > cap:
                    break
                self.used += inp[rid]
                if i == 0:
                    self.admitted_head = True
            left = inp[rid] - done
            if not self.spec.chunked:
                if left > budget and i > 0:
                    self.used -= inp[rid]
                    break
                c = left
            else:
                c = left if left <= budget else budget
            tokens += c
            units += (done + c) * (done + c) - done * done
            budget -= c
            if c == left:
                finished.append(rid)
                seqs += 1
                i += 1
            else:
                partial = done + c
                break
        if tokens == 0:  # head waits for KV room: only possible if prompts are in flight
            raise PlanInputError(f"{self.name}: prompt {q[0]} can never fit its KV capacity")
        for _ in range(len(finished)):
            q.popleft()
        if partial is not None:
            self.done_head, self.admitted_head = partial, True
        elif finished:
            self.done_head, self.admitted_head = 0, False
        st = self.base + self.pt * tokens + self.pu * units + self.ps * seqs
        if self.reqs.speed is not None:
            st *= self.reqs.speed.at(self.t)
        end = self.t + self.stages * st + (self.stages - 1) * self.hop * tokens
        for rid in finished:
            self.reqs.first[rid] = end
            self.used -= inp[rid]
            heapq.heappush(self.pending, end)
            self.completions.append((end, rid))
        self.t += st
        self.busy += st


# ---- decode (and the decoding half of a colocated instance) -----------------------------


class _Decoder:
    """A batch of decoding requests stepping together; jumps between events."""

    def __init__(self, spec: InstanceSpec, reqs: _Requests, name: str) -> None:
        c = spec.cost
        self.spec, self.reqs, self.name = spec, reqs, name
        self.base = c.stages * c.base
        self.d = c.decode_token  # per decode row past the knee
        self.knee = c.knee
        self.every = c.decode_comm + (c.stages - 1) * c.hop_token  # per decode row
        self.x = c.context_token
        self.t = 0.0
        self.busy = 0.0
        self.steps = 0  # decode steps run so far
        self.batch = 0  # requests decoding
        self.context = 0  # their context tokens
        self.finishing: list[tuple[int, int]] = []  # (finish step, rid) heap
        self.unfinished = 0

    def join(self, rid: int) -> None:
        r = self.reqs
        self.batch += 1
        self.context += r.inp[rid] + 1
        heapq.heappush(self.finishing, (self.steps + r.out[rid] - 1, rid))

    def _first_step(self) -> float:
        """The next decode step's time (the batch's later steps add x * batch each)."""
        b = self.batch
        rows = b - self.knee if b > self.knee else 0.0
        return self.base + self.d * rows + self.every * b + self.x * self.context

    def run_until(self, horizon: float, limit: int) -> list[int]:
        """Run the fewest whole steps (<= limit, >= 1) whose end is at or after
        `horizon` (> self.t; INF: `limit` steps); returns the requests that finished
        at the end. The hot path of the simulator: k steps of a constant batch take
        k * a + q * k * (k - 1) / 2 (the context grows by the batch each step). With
        speed noise the jump also stops at the first boundary after the factor
        changes, so every step is priced at the factor of its start."""
        a = self._first_step()
        q = self.x * self.batch
        speed = self.reqs.speed
        if speed is not None:
            f = speed.at(self.t)
            a, q = a * f, q * f
            change = speed.next_change(self.t)
            horizon = change if change < horizon else horizon
        gap = horizon - self.t
        if gap == INF:
            j = limit
        else:
            if q > 0:
                half = q / 2
                j = math.ceil(
                    (-(a - half) + math.sqrt((a - half) ** 2 + 4 * half * gap)) / (2 * half)
                )
            else:
                j = math.ceil(gap / a) if a > 0 else limit
            j = 1 if j < 1 else limit if j > limit else j
            while j > 1 and (j - 1) * a + q * (j - 1) * (j - 2) / 2 >= gap:
                j -= 1
            while j < limit and j * a + q * j * (j - 1) / 2 < gap:
                j += 1
        dt = j * a + q * j * (j - 1) / 2
        self.t += dt
        self.busy += dt
        self.steps += j
        self.context += self.batch * j
        return self._pop_finished()

    def _pop_finished(self) -> list[int]:
        """Take the requests whose last token came out by now (`self.t`) off the batch."""
        done = []
        fin, r = self.finishing, self.reqs
        while fin and fin[0][0] <= self.steps:
            _, rid = heapq.heappop(fin)
            r.finish[rid] = self.t
            self.batch -= 1
            self.context -= r.inp[rid] + r.out[rid]
            done.append(rid)
        return done

    def steps_to_next_finish(self) -> int:
        return self.finishing[0][0] - self.steps


class _Decode(_Decoder):
    def __init__(
        self, spec: InstanceSpec, reqs: _Requests, name: str, kv_bytes: int, bandwidth: float
    ) -> None:
        super().__init__(spec, reqs, name)
        self.per_token_transfer = 0.0 if math.isinf(bandwidth) else kv_bytes / bandwidth
        self.queue: deque[int] = deque()
        self.transfers: list[tuple[float, int]] = []  # (ready time, rid) heap
        self.reserved = 0
        self.slots = 0  # admitted: transferring + decoding
        self.quiet_until = INF  # no request finishes before this time (see `load_at`)
        self.quiet_stale = False  # the state changed since quiet_until was computed

    def load_at(self, now: float) -> int:
        """The load once the step in progress at `now` ends (`advance_to(now)`), without
        advancing when that step cannot finish a request: most dispatches leave most
        instances as they are."""
        if self.quiet_stale:
            self._update_quiet()
        if now >= self.quiet_until - 1e-9:  # advancing when not needed is always right
            self.advance_to(now)
        return self.unfinished

    def _update_quiet(self) -> None:
        """Up to the start of the step that finishes the batch's next request, the step
        in progress finishes none. A transfer ending may add a request (finishing later
        still, but changing the step times), so the earliest transfer end bounds it too."""
        quiet = self.transfers[0][0] if self.transfers else INF
        if self.batch:
            k = self.finishing[0][0] - self.steps - 1
            f = 1.0
            speed = self.reqs.speed
            if speed is not None:  # the estimate holds until the factor changes
                f = speed.at(self.t)
                change = speed.next_change(self.t)
                quiet = change if change < quiet else quiet
            last = self.t + f * (k * self._first_step() + self.x * self.batch * k * (k - 1) / 2)
            quiet = last if last < quiet else quiet
        self.quiet_until = quiet
        self.quiet_stale = False

    def add(self, rid: int, now: float) -> None:
        """Called right after `advance_to(now)`: the instance is idle or at a step
        boundary; the request is admitted (its fetch starts) at `now` if there is room,
        and joins the batch at the first boundary after its KV has arrived."""
        self.unfinished += 1
        self.queue.append(rid)
        if self.batch == 0 and self.t < now:
            self.t = now
        self._admit(now)
        self._join_ready()
        self.quiet_stale = True

    def _admit(self, at: float) -> None:
        r, cap, limit = self.reqs, self.spec.kv_capacity_tokens, self.spec.max_batch_size
        q = self.queue
        while q and self.slots < limit:
            rid = q[0]
            need = r.inp[rid] + r.out[rid]
            if self.reserved + need > cap:
                break
            q.popleft()
            self.reserved += need
            self.slots += 1
            heapq.heappush(self.transfers, (at + r.inp[rid] * self.per_token_transfer, rid))

    def _join_ready(self) -> None:
        tr = self.transfers
        while tr and tr[0][0] <= self.t:
            self.join(heapq.heappop(tr)[1])

    def _finished(self, done: list[int]) -> None:
        r = self.reqs
        for rid in done:
            self.reserved -= r.inp[rid] + r.out[rid]
            self.slots -= 1
            self.unfinished -= 1
        self._admit(self.t)
        self._join_ready()

    def advance_to(self, now: float) -> None:
        while True:
            ready = self.transfers[0][0] if self.transfers else INF
            if self.batch == 0:
                if self.transfers and ready <= now:
                    self.t = max(self.t, ready)
                    self._join_ready()
                    continue
                if self.t < now < INF:
                    self.t = now
                self.quiet_stale = True
                return
            horizon = min(now, ready)
            if horizon <= self.t:
                if ready <= self.t:
                    self._join_ready()
                    continue
                self.quiet_stale = True
                return
            self._finished(self.run_until(horizon, self.steps_to_next_finish()))

    def drain(self) -> None:
        self.advance_to(INF)


# ---- colocated --------------------------------------------------------------------------


class _Colocated(_Decoder):
    def __init__(self, spec: InstanceSpec, reqs: _Requests, name: str) -> None:
        super().__init__(spec, reqs, name)
        c = spec.cost
        self.pt, self.pu, self.ps = c.prompt_token, c.prompt_unit, c.prompt_seq
        self.pt += (c.stages - 1) * c.hop_token
        self.waiting: deque[int] = deque()
        self.prefilling: deque[int] = deque()  # admitted, prompt not done (oldest first)
        self.done_head = 0  # prompt tokens computed for prefilling[0]
        self.reserved = 0
        if spec.chunked and spec.max_batch_size > spec.max_batch_tokens:
            raise PlanInputError(
                f"{name}: max_batch_size {spec.max_batch_size} exceeds the step's token budget "
                f"{spec.max_batch_tokens}: decodes alone could overflow a chunked step"
            )

    def load_at(self, now: float) -> int:
        """Unfinished requests at `now` (after advancing to it)."""
        self.advance_to(now)
        return self.unfinished

    def add(self, rid: int, now: float) -> None:
        self.unfinished += 1
        self.waiting.append(rid)
        if self.t < now and self.batch == 0 and not self.prefilling:
            self.t = now

    def _can_admit(self, rid: int) -> bool:
        r = self.reqs
        running = self.batch + len(self.prefilling)
        return (
            running < self.spec.max_batch_size
            and self.reserved + r.inp[rid] + r.out[rid] <= self.spec.kv_capacity_tokens
        )

    def _has_prompt_work(self) -> bool:
        if self.prefilling:
            return True
        if not self.waiting or not self._can_admit(self.waiting[0]):
            return False
        return not self.spec.chunked or self.batch < self.spec.max_batch_tokens

    def advance_to(self, now: float) -> None:
        while self.t < now:
            if self._has_prompt_work():
                self._prompt_step()
            elif self.batch:
                self._after_decode(self.run_until(now, self.steps_to_next_finish()))
            else:
                self.t = now

    def drain(self) -> None:
        while self.waiting or self.prefilling or self.batch:
            if self._has_prompt_work():
                self._prompt_step()
            elif self.batch:
                self._after_decode(self.run_until(INF, self.steps_to_next_finish()))
            else:
                raise PlanInputError(f"{self.name}: a request can never be admitted")

    def _after_decode(self, done: list[int]) -> None:
        r = self.reqs
        for rid in done:
            self.reserved -= r.inp[rid] + r.out[rid]
            self.unfinished -= 1

    def _prompt_step(self) -> None:
        chunked = self.spec.chunked
        budget = self.spec.max_batch_tokens - (self.batch if chunked else 0)
        cap = self.spec.prompt_cap
        if chunked and self.batch and cap is not None:
            budget = min(budget, cap)
        tokens = units = seqs = 0
        finished: list[int] = []
        inp = self.reqs.inp
        partial: int | None = None  # tokens done of the prompt left unfinished
        # the prompts in progress first (oldest first), then admissions
        i = 0
        while i < len(self.prefilling) and budget > 0:
            rid = self.prefilling[i]
            done = self.done_head if i == 0 else 0
            c = min(inp[rid] - done, budget)
            tokens += c
            units += (done + c) * (done + c) - done * done
            budget -= c
            if done + c == inp[rid]:
                finished.append(rid)
                i += 1
            else:
                partial = done + c
                break
        while budget > 0 and self.waiting and self._can_admit(self.waiting[0]):
            rid = self.waiting[0]
            if not chunked and inp[rid] > budget and (tokens or finished):
                break
            self.waiting.popleft()
            self.reserved += inp[rid] + self.reqs.out[rid]
            self.prefilling.append(rid)
            c = inp[rid] if not chunked else min(inp[rid], budget)
            tokens += c
            units += c * c
            budget -= c
            if c == inp[rid]:
                finished.append(rid)
            else:
                partial = c
                break
        for _ in finished:
            self.prefilling.popleft()
        if partial is not None:
            self.done_head = partial
        elif finished:
            self.done_head = 0
        seqs = len(finished)
        decode = self.batch if chunked else 0
        st = (
            self.base
            + self.pt * tokens
            + self.pu * units
            + self.ps * seqs
            + (
                self.d * decode_rows(tokens, decode, self.knee)
                + self.every * decode
                + self.x * self.context
                if decode
                else 0.0
            )
        )
        if self.reqs.speed is not None:
            st *= self.reqs.speed.at(self.t)
        self.t += st
        self.busy += st
        ended: list[int] = []
        if decode:
            self.steps += 1
            self.context += self.batch
            ended = self._pop_finished()
        self._after_decode(ended)
        self._prompts_done(finished)

    def _prompts_done(self, finished: list[int]) -> None:
        r = self.reqs
        for rid in finished:
            r.first[rid] = self.t
            if r.out[rid] == 1:
                r.finish[rid] = self.t
                self.reserved -= r.inp[rid] + r.out[rid]
                self.unfinished -= 1
            else:
                self.join(rid)


# ---- running a system -------------------------------------------------------------------


def _check_fits(w: SimWorkload, specs: tuple[InstanceSpec, ...], what: str, whole: bool) -> None:
    cap = min(s.kv_capacity_tokens for s in specs)
    need = w.input_lens + w.output_lens if whole else w.input_lens
    bad = np.nonzero(need > cap)[0]
    if len(bad):
        i = int(bad[0])
        raise PlanInputError(
            f"request {i} needs {int(need[i])} KV tokens "
            f"({'prompt + output' if whole else 'prompt'}), more than the {cap} a {what} "
            "instance holds"
        )


def _dispatch(instances: list[Any], rid: int, now: float) -> None:
    best = instances[0]
    if len(instances) > 1:
        best_load = None
        for inst in instances:
            load = inst.load_at(now)
            if best_load is None or load < best_load:
                best, best_load = inst, load
    best.advance_to(now)
    best.add(rid, now)


def _result(reqs: _Requests, instances: list[Any], start: float) -> SimResult:
    arrival = np.asarray(reqs.arrival)
    first = np.asarray(reqs.first)
    finish = np.asarray(reqs.finish)
    out = np.asarray(reqs.out)
    tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
    makespan = float(finish.max() - start) if len(finish) else 0.0
    util = {i.name: (i.busy / makespan if makespan > 0 else 0.0) for i in instances}
    return SimResult(first - arrival, tpot, finish - arrival, first, finish, util, makespan)


def _run_prefill(prefills: list[_Prefill], reqs: _Requests) -> list[tuple[float, int]]:
    for rid, t in enumerate(reqs.arrival):
        _dispatch(prefills, rid, t)
    for p in prefills:
        p.drain()
    done = [c for p in prefills for c in p.completions]
    done.sort()
    return done


def simulate(
    system: DisaggSystem | ColocatedSystem,
    workload: SimWorkload,
    noise: SpeedNoise | None = None,
) -> SimResult:
    """Every request of `workload` through `system`; `noise`: the machine's speed
    drifting (None: every step exactly as priced)."""
    reqs = _Requests(workload, noise)
    start = float(workload.arrivals[0])
    if isinstance(system, ColocatedSystem):
        if not system.instances:
            raise PlanInputError("a colocated system needs at least one instance")
        _check_fits(workload, system.instances, "colocated", whole=True)
        colo = [_Colocated(s, reqs, f"colocated-{i}") for i, s in enumerate(system.instances)]
        for rid, t in enumerate(reqs.arrival):
            _dispatch(colo, rid, t)
        for c in colo:
            c.drain()
        return _result(reqs, colo, start)
    if not system.prefill or not system.decode:
        raise PlanInputError("a disaggregated system needs prefill and decode instances")
    if not system.transfer_bandwidth > 0:
        raise PlanInputError("transfer bandwidth must be > 0")
    _check_fits(workload, system.prefill, "prefill", whole=False)
    _check_fits(workload, system.decode, "decode", whole=True)
    prefills = [_Prefill(s, reqs, f"prefill-{i}") for i, s in enumerate(system.prefill)]
    decodes = [
        _Decode(s, reqs, f"decode-{i}", system.kv_bytes_per_token, system.transfer_bandwidth)
        for i, s in enumerate(system.decode)
    ]
    out = reqs.out
    for t, rid in _run_prefill(prefills, reqs):
        if out[rid] == 1:
            reqs.finish[rid] = t
            continue
        _dispatch(decodes, rid, t)
    for d in decodes:
        d.drain()
    return _result(reqs, [*prefills, *decodes], start)


def simulate_prefill(instance: InstanceSpec, workload: SimWorkload) -> SimResult:
    """One prefill instance alone (DistServe's simu_prefill): TTFT only, TPOT 0."""
    reqs = _Requests(workload)
    _check_fits(workload, (instance,), "prefill", whole=False)
    p = _Prefill(instance, reqs, "prefill-0")
    for t, rid in _run_prefill([p], reqs):
        reqs.finish[rid] = t
    res = _result(reqs, [p], float(workload.arrivals[0]))
    res.tpot = np.zeros(len(workload))
    return res


def simulate_decode(
    instance: InstanceSpec, workload: SimWorkload, noise: SpeedNoise | None = None
) -> SimResult:
    """One decode instance alone (simu_decode): each request arrives with its first
    token and KV in place (TTFT 0) and decodes output_len - 1 tokens."""
    reqs = _Requests(workload, noise)
    _check_fits(workload, (instance,), "decode", whole=True)
    d = _Decode(instance, reqs, "decode-0", 0, INF)
    for rid, t in enumerate(reqs.arrival):
        reqs.first[rid] = t
        if reqs.out[rid] == 1:
            reqs.finish[rid] = t
            continue
        d.advance_to(t)
        d.add(rid, t)
    d.drain()
    return _result(reqs, [d], float(workload.arrivals[0]))
