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
  fits the pool beside the KV already there, and its KV stays there, *held*, until
  the decode side's fetch of it ends (the engine's pull mode: `num_held`, freed on
  `ReleaseKV`); a one-token request frees it when its prefill ends. A pool full of
  held KV admits no prompt until the decode side pulls.
- **Prefill pipeline** (DistServe §3.3; our engine has no pipeline parallelism): each
  stage runs one micro-batch (one step's batch) at a time and takes the batch's stage
  time, set by its own tokens. A batch enters stage 1 when stage 1 is free and stage k
  when it has left stage k - 1 (plus the activation hop) and stage k is free, so a
  short batch behind a long one waits: a bubble. Batches of equal size never wait
  (a new one every stage time: DistServe eq. 2).
- **Decode instance** (`engine/roles/decode.py`, `engine/admission.py`,
  `engine/scheduler.py`): FCFS queue; at a step boundary (at once when idle, or when
  the request is dispatched mid-step) the head is admitted, its fetch starting, when a
  batch slot is free and its prompt's KV fits beside what the pool holds now (every
  running request's prompt and generated tokens, the fetches under way), under the
  default rule `greedy`; `reserve-static` (`InstanceSpec.decode_admission`) also needs
  its whole KV, prompt + output, to fit in what is free now, unless nothing runs or
  is fetched. The prompt KV transfers (input_len * kv_bytes_per_token / bandwidth) and
  the request joins the batch at the first boundary after the transfer ends. It
  makes output_len - 1 tokens, one per step (the first came from the prefill), and
  its KV grows by one token a step. When the pool cannot hold the next step's new
  tokens, the newest request is swapped out (the scheduler's `_make_room` with the
  default `swap` mode): it leaves the batch with its progress; swapped requests come
  back, oldest first, at a boundary where nothing was swapped out, when their KV fits
  again. A swap costs `swap_token_s` per KV token each way (0 by default).
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
- **Front end** (`FrontEnd`, when given): every token the instances make then passes
  through one FIFO server of a fixed cost per token (pdserve's HTTP process, measured
  by bench/bench_frontend.py) before its client sees it (`through_frontend`); TTFT and
  TPOT are the client's. It never slows the instances (pdserve's front end does not
  stop them: it queues).

Step times: a decode or colocated iteration costs `stages * base + prices . counts`
(a pipeline cycles `stages` micro-batches; the per-count prices are per stage), where
the counts are prompt tokens, attention units ((k+c)^2 - k^2 per chunk), prompts
finishing, decode rows past the knee (`latency.decode_rows`), decode tokens (their
all-reduces and stage hops) and context tokens (a decoding request attends over its
prompt and every token generated so far). A prefill batch's stage time is
`base + prices . counts` of its own prompts.

Not modelled: a colocated instance still reserves a request's whole KV at admission
(nothing is preempted there); swapped decode requests keep their batch slot; KV is
counted in tokens, not blocks; the prefill side allocates a prompt's whole KV at
admission (the engine allocates chunk by chunk).

Speed: between events a decode batch is constant and its step times form an
arithmetic progression (the context grows by the batch size per step), so an
instance jumps straight to the next finish, full pool, transfer end or dispatch in
closed form. A disaggregated system runs as one loop over arrivals, first tokens
and prefill steps in time order (`_DisaggRun`); decode instances advance lazily, to
each dispatch, or to the time of a prefill step that the pool binds and held KV
might be released for.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.config import DecodeAdmission
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
    # Decode: which waiting request may start its fetch (the engine's
    # `SchedulerConfig.decode_admission`; greedy is its default). Only greedy and
    # reserve-static are simulated: the other rules read predicted lengths.
    decode_admission: DecodeAdmission = DecodeAdmission.GREEDY
    # Decode: seconds per KV token a preemption copies to the host tier, and again back
    # (the engine's swap); 0: free (no profile prices the host link yet).
    swap_token_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_tokens < 1:
            raise PlanInputError("max_batch_size and max_batch_tokens must be >= 1")
        simulated = (DecodeAdmission.GREEDY, DecodeAdmission.RESERVE_STATIC)
        if self.decode_admission not in simulated:
            raise PlanInputError(
                f"decode admission {self.decode_admission.value!r} is not simulated "
                "(greedy or reserve-static)"
            )
        if not self.swap_token_s >= 0:
            raise PlanInputError(f"swap_token_s must be >= 0, got {self.swap_token_s}")
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


@dataclass(frozen=True)
class FrontEnd:
    """The one front end every streamed token of the cluster passes through (pdserve's
    HTTP process: detokenization, stop strings, the SSE write), as one FIFO server that
    spends `token_s` seconds of its core on each token: 1 / the tokens/s it sustains on
    its host (`bench/bench_frontend.py`; `pdserve plan --frontend-tokens-per-s`)."""

    token_s: float

    def __post_init__(self) -> None:
        if not (self.token_s >= 0 and math.isfinite(self.token_s)):
            raise PlanInputError(f"front end seconds per token must be >= 0, got {self.token_s}")


@dataclass
class SimResult:
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    utilization: dict[str, float] = field(default_factory=dict)
    makespan: float = 0.0
    preemptions: int = 0  # decode instances' swap-outs (the pool could not hold a step)

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
    """A prefill instance. KV contract: a prompt's KV (`inp` tokens) is taken from the
    pool when the prompt is admitted and given back at its release time: the end of its
    prefill when nothing pulls it (`hold` False, or a one-token output), else the end of
    the decode side's fetch, posted by the decode instance through `release`. Until then
    it is *held* (the engine's pull mode: `PrefillRole.num_held`)."""

    def __init__(self, spec: InstanceSpec, reqs: _Requests, name: str, hold: bool) -> None:
        c = spec.cost
        self.spec, self.reqs, self.name, self.hold = spec, reqs, name, hold
        self.base, self.pt, self.pu, self.ps = c.base, c.prompt_token, c.prompt_unit, c.prompt_seq
        self.stages, self.hop, self.hop_fixed = c.stages, c.hop_token, c.hop_fixed
        self.t = 0.0
        self.busy = 0.0
        self.queue: deque[int] = deque()
        self.done_head = 0  # prompt tokens already computed for queue[0]
        self.used = 0  # KV tokens in the pool: admitted prompts, finished or not, until released
        self.admitted_head = False  # queue[0] holds its KV already
        self.pending: list[float] = []  # completion times not yet reached (heap)
        # (first token time, rid), in step order; the disaggregated run makes it a heap
        self.completions: list[tuple[float, int]] = []
        self.max_prompt = max(reqs.inp) if reqs.inp else 0
        self.stage_free = [0.0] * c.stages  # when each pipeline stage ends its last batch
        self.releases: list[tuple[float, int]] = []  # (time its KV leaves the pool, rid) heap
        self.unreleased = 0  # held prompts whose release time is not known yet
        self.blocked = False  # the head waits for KV room that only a release can give
        self.next_t = INF  # when the next step starts (`next_time`), kept up to date
        # Called with a time t before a step that KV binds: afterwards every release
        # at or before t has been posted (the disaggregated run advances the decode side).
        self.sync: Callable[[float], None] | None = None

    def load_at(self, now: float) -> int:
        """Requests not yet prefilled at `now` (after advancing to it)."""
        if self.next_t < now:
            self.advance_to(now)
        pend = self.pending
        while pend and pend[0] <= now:
            heapq.heappop(pend)
        return len(pend) + len(self.queue)

    def add(self, rid: int, now: float) -> None:
        if not self.queue and self.t < now:
            self.t = now
        self.queue.append(rid)
        self._update_next()

    def next_time(self) -> float:
        """When the next step starts (INF: no work, or blocked on an unknown release)."""
        return self.next_t

    def _update_next(self) -> None:
        if not self.queue:
            self.next_t = INF
        elif self.blocked:
            self.next_t = max(self.t, self.releases[0][0]) if self.releases else INF
        else:
            self.next_t = self.t

    def release(self, rid: int, at: float) -> None:
        """The decode side fetched `rid`'s KV by `at` (the controller's ReleaseKV)."""
        self.unreleased -= 1
        heapq.heappush(self.releases, (at, rid))
        if self.blocked:
            self._update_next()

    def advance_to(self, now: float) -> None:
        while self.next_time() < now:
            self.step()

    def drain(self) -> None:
        while self.queue:
            if self.next_time() == INF:
                raise PlanInputError(f"{self.name}: waits for KV no decode instance pulls")
            self.step()

    def step(self) -> None:
        """One batch from the head of the queue at `next_time()`, or, when no prompt's KV
        fits until a release, mark the instance blocked."""
        self.t = self.next_t
        if self.releases and self.releases[0][0] <= self.t:
            self._free_released()
        if self.unreleased and self.sync is not None and self._short_of_room():
            self.sync(self.t)
            self._free_released()
        batch = self._take_batch()
        if batch is None:
            if not self.releases and not self.unreleased:
                raise PlanInputError(
                    f"{self.name}: prompt {self.queue[0]} can never fit its KV capacity"
                )
            self.blocked = True
            self._update_next()
            return
        self.blocked = False
        self._run(*batch)
        self.next_t = self.t if self.queue else INF

    def _free_released(self) -> None:
        rel, inp = self.releases, self.reqs.inp
        while rel and rel[0][0] <= self.t:
            self.used -= inp[heapq.heappop(rel)[1]]

    def _short_of_room(self) -> bool:
        """Would the prompts this step may take (by the token budget alone) overflow the
        pool? Only then may a release the decode side has not posted yet matter."""
        inp, q = self.reqs.inp, self.queue
        budget, need = self.spec.max_batch_tokens, 0
        if self.used + budget + self.max_prompt <= self.spec.kv_capacity_tokens:
            return False  # a step takes at most a budget of prompts and one more
        for i in range(len(q)):
            if budget <= 0:
                break
            if not (i == 0 and self.admitted_head):
                need += inp[q[i]]
            budget -= inp[q[i]] - (self.done_head if i == 0 else 0)
        return self.used + need > self.spec.kv_capacity_tokens

    def _take_batch(self) -> tuple[int, int, int, list[int]] | None:
        """Admit and take the step's prompts from the head of the queue: (tokens, attention
        units, prompts finishing, those prompts), or None when the head's KV does not fit."""
        inp, cap = self.reqs.inp, self.spec.kv_capacity_tokens
        q = self.queue
        budget = self.spec.max_batch_tokens
        tokens = units = 0
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
                i += 1
            else:
                partial = done + c
                break
        if tokens == 0:
            return None
        for _ in range(len(finished)):
            q.popleft()
        if partial is not None:
            self.done_head, self.admitted_head = partial, True
        elif finished:
            self.done_head, self.admitted_head = 0, False
        return tokens, units, len(finished), finished

    def _run(self, tokens: int, units: int, seqs: int, finished: list[int]) -> None:
        st = self.base + self.pt * tokens + self.pu * units + self.ps * seqs
        if self.reqs.speed is not None:
            st *= self.reqs.speed.at(self.t)
        end = self.t + st if self.stages == 1 else self._through_stages(st, tokens)
        out = self.reqs.out
        for rid in finished:
            self.reqs.first[rid] = end
            if self.hold and out[rid] > 1:
                self.unreleased += 1
            else:
                heapq.heappush(self.releases, (end, rid))
            heapq.heappush(self.pending, end)
            heapq.heappush(self.completions, (end, rid))
        self.t += st
        self.busy += st

    def _through_stages(self, st: float, tokens: int) -> float:
        """The batch enters stage 1 now; it enters stage k once it left stage k - 1 and
        its activations arrived (`hop_fixed + hop * tokens`), and stage k has finished the batch
        before (DistServe §3.3: a stage runs one micro-batch at a time, so a long batch
        holds a short one behind it: a bubble). Each stage takes `st`. Returns when the
        batch leaves the last stage; batches of equal `st` and tokens never wait."""
        free = self.stage_free
        end = self.t + st
        free[0] = end
        hop = self.hop_fixed + self.hop * tokens
        for k in range(1, self.stages):
            start = end + hop
            if free[k] > start:
                start = free[k]
            end = start + st
            free[k] = end
        return end


# ---- decode (and the decoding half of a colocated instance) -----------------------------


class _Decoder:
    """A batch of decoding requests stepping together; jumps between events."""

    def __init__(self, spec: InstanceSpec, reqs: _Requests, name: str) -> None:
        c = spec.cost
        self.spec, self.reqs, self.name = spec, reqs, name
        self.base = c.stages * c.base + (c.stages - 1) * c.hop_fixed  # a step's fixed cost
        self.d = c.decode_token  # per decode row past the knee
        self.knee = c.knee
        self.every = c.decode_comm + (c.stages - 1) * c.hop_token  # per decode row
        self.x = c.context_token
        self.t = 0.0
        self.busy = 0.0
        self.steps = 0  # decode steps run so far
        self.batch = 0  # requests decoding
        self.context = 0  # their context tokens
        self.finishing: list[tuple[int, int]] = []  # (finish step, rid) heap; stale entries
        # rid -> finish step of each request in the batch, oldest join first (an entry of
        # `finishing` that disagrees is stale: its request was preempted)
        self.live: dict[int, int] = {}
        self.unfinished = 0

    def join(self, rid: int) -> None:
        r = self.reqs
        self.batch += 1
        self.context += r.inp[rid] + 1
        self.live[rid] = self.steps + r.out[rid] - 1
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
        fin, r, live = self.finishing, self.reqs, self.live
        while fin and fin[0][0] <= self.steps:
            step, rid = heapq.heappop(fin)
            if live.get(rid) != step:
                continue
            del live[rid]
            r.finish[rid] = self.t
            self.batch -= 1
            self.context -= r.inp[rid] + r.out[rid]
            done.append(rid)
        return done

    def steps_to_next_finish(self) -> int:
        fin, live = self.finishing, self.live
        while live.get(fin[0][1]) != fin[0][0]:
            heapq.heappop(fin)
        return fin[0][0] - self.steps


class _Decode(_Decoder):
    """A decode instance. KV contract (the engine's pool, in tokens rather than blocks):
    a request admitted for its fetch holds its prompt's KV (`xfer_kv`); once it has
    joined, `inp + g - 1` tokens after g generated ones, and a step needs one more slot
    for each decoding request, so the batch needs `context` (+ `xfer_kv`) tokens to step.
    When that exceeds the pool, the newest request is preempted by swapping it out
    (engine/scheduler.py `_make_room`: its KV leaves the pool, its progress stays); the
    swapped return oldest first, at a boundary where nothing was preempted, when their
    KV fits again. Swapped requests keep their batch slot (a simplification: the engine
    frees it)."""

    def __init__(
        self, spec: InstanceSpec, reqs: _Requests, name: str, kv_bytes: int, bandwidth: float
    ) -> None:
        super().__init__(spec, reqs, name)
        self.per_token_transfer = 0.0 if math.isinf(bandwidth) else kv_bytes / bandwidth
        self.queue: deque[int] = deque()
        self.transfers: list[tuple[float, int]] = []  # (ready time, rid) heap
        self.xfer_kv = 0  # prompt KV of admitted requests not yet in the batch
        self.swapped: deque[tuple[int, int, int]] = deque()  # (rid, steps left, generated)
        self.slots = 0  # admitted: transferring + decoding + swapped
        self.num_preemptions = 0
        self.preempted_at = -1  # `steps` at the last preemption (a boundary's id)
        # `t` is a boundary whose preemptions and swap-ins are not done yet: they wait
        # until the instance moves past it, so that every request dispatched before the
        # boundary has been admitted first (the engine's poll at a step start sees all
        # that arrived during the step, then its scheduler makes room)
        self.unsettled = False
        self.quiet_until = INF  # no request finishes before this time (see `load_at`)
        self.quiet_stale = False  # the state changed since quiet_until was computed
        # Called with (rid, time its fetch ends) when a request is admitted: the prefill
        # instance holding its KV may free it then.
        self.on_fetch: Callable[[int, float], None] | None = None

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
        """Up to the start of the step that finishes the batch's next request (or fills
        the pool), the step in progress finishes none. A transfer ending may add a request
        (finishing later still, but changing the step times), so the earliest transfer
        end bounds it too."""
        quiet = self.transfers[0][0] if self.transfers else INF
        if self.unsettled:
            quiet = self.t
        elif self.batch:
            k = self._jump_limit() - 1
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

    def next_boundary(self) -> float:
        """When the step in progress ends (idle: the next transfer end; INF: none; an
        unsettled boundary: now)."""
        if self.unsettled:
            return self.t
        if self.batch:
            f = self.reqs.speed.at(self.t) if self.reqs.speed is not None else 1.0
            return self.t + f * self._first_step()
        return self.transfers[0][0] if self.transfers else INF

    def _jump_limit(self) -> int:
        """Steps the batch may run as it is: to its next finish, and while the pool
        holds every step's new slots (step j + 1 needs context + j * batch + xfer_kv).
        Right after a preemption, one step: the next boundary may take a swapped request
        back (later ones have less room, until a request finishes)."""
        if self.swapped and self.preempted_at == self.steps:
            return 1
        room = (self.spec.kv_capacity_tokens - self.xfer_kv - self.context) // self.batch + 1
        fin, live = self.finishing, self.live
        while live.get(fin[0][1]) != fin[0][0]:  # steps_to_next_finish, inlined
            heapq.heappop(fin)
        left = fin[0][0] - self.steps
        return room if room < left else left

    def add(self, rid: int, now: float) -> None:
        """Called right after `advance_to(now)`: the instance is idle (then at `now`) or
        at the step boundary ending the step in progress at `now`; the request is
        admitted (its fetch starts) at that boundary if there is room, and joins the
        batch at the first boundary after its KV has arrived."""
        self.unfinished += 1
        self.queue.append(rid)
        if self.batch == 0 and self.t < now:
            self.t = now
        self._settle(final=False, at=now)
        self.quiet_stale = True

    def _admit(self, at: float) -> None:
        """FCFS while a slot is free, the prompt's KV fits the pool now (allocation) and
        the admission rule agrees (engine/roles/decode.py `admit`, engine/admission.py)."""
        r, cap, limit = self.reqs, self.spec.kv_capacity_tokens, self.spec.max_batch_size
        static = self.spec.decode_admission is DecodeAdmission.RESERVE_STATIC
        q = self.queue
        while q and self.slots < limit:
            rid = q[0]
            held = self.context - self.batch + self.xfer_kv
            if held + r.inp[rid] > cap:
                break
            # reserve-static: the whole KV (prompt, first token, the rest) fits now; an
            # empty batch (nothing running or fetching) admits anything (AdmissionGate)
            if static and self.batch + len(self.transfers) and held + r.inp[rid] + r.out[rid] > cap:
                break
            q.popleft()
            self.xfer_kv += r.inp[rid]
            self.slots += 1
            ready = at + r.inp[rid] * self.per_token_transfer
            heapq.heappush(self.transfers, (ready, rid))
            if self.on_fetch is not None:
                self.on_fetch(rid, ready)

    def _settle(self, final: bool, at: float | None = None) -> None:
        """The boundary at `t`, in the engine's order: admissions (its poll), arrived
        KV joins, the pool is made to hold the next step (preempting the newest), and,
        when nothing was preempted, swapped requests come back. Not `final` (a request
        may still be dispatched before `t`): the last two wait unless they do nothing.
        `at`: when a request admitted now starts its fetch (default `t`; a dispatch
        mid-step starts it at once, as the simulator always has: at most a step early)."""
        if self.queue:
            self._admit(self.t if at is None else at)
        tr = self.transfers
        while tr and tr[0][0] <= self.t:
            rid = heapq.heappop(tr)[1]
            self.xfer_kv -= self.reqs.inp[rid]
            self.join(rid)
        fits = self.context + self.xfer_kv <= self.spec.kv_capacity_tokens
        if fits and not self.swapped:  # nothing to preempt or bring back
            self.unsettled = False
            return
        self.unsettled = not final
        if self.unsettled:
            return
        self._make_room()
        if self.preempted_at != self.steps or self.batch == 0:
            self._swap_in()

    def _make_room(self) -> None:
        """Preempt the newest requests while the next step's KV overflows the pool."""
        cap, r = self.spec.kv_capacity_tokens, self.reqs
        while self.batch and self.context + self.xfer_kv > cap:
            rid = next(reversed(self.live))
            left = self.live.pop(rid) - self.steps
            g = r.out[rid] - left
            self.batch -= 1
            self.context -= r.inp[rid] + g
            self.swapped.append((rid, left, g))
            self._swap_cost(r.inp[rid] + g - 1)
            self.num_preemptions += 1
            self.preempted_at = self.steps

    def _swap_in(self) -> None:
        cap, r = self.spec.kv_capacity_tokens, self.reqs
        sw = self.swapped
        while sw and self.context + self.xfer_kv + r.inp[sw[0][0]] + sw[0][2] <= cap:
            rid, left, g = sw.popleft()
            self._swap_cost(r.inp[rid] + g - 1)
            self.batch += 1
            self.context += r.inp[rid] + g
            self.live[rid] = self.steps + left
            heapq.heappush(self.finishing, (self.steps + left, rid))

    def _swap_cost(self, tokens: int) -> None:
        """The engine copies swapped blocks before the step's forward pass."""
        dt = self.spec.swap_token_s * tokens
        self.t += dt
        self.busy += dt

    def _finished(self, done: list[int]) -> None:
        for _ in done:
            self.slots -= 1
            self.unfinished -= 1
        self._settle(final=False)

    def advance_to(self, now: float, settle: bool = False) -> None:
        """Run to the boundary ending the step in progress at `now` (idle: to `now`),
        settling every boundary before `now` (`settle`: also one at `now`)."""
        self.quiet_stale = True
        while True:
            if self.unsettled:
                if self.t > now or (self.t == now and not settle):
                    return
                self._settle(final=True)
            ready = self.transfers[0][0] if self.transfers else INF
            if self.batch == 0:
                if ready <= now and ready < INF:
                    self.t = max(self.t, ready)
                    self._settle(final=False)
                    continue
                if self.t < now < INF:
                    self.t = now
                return
            horizon = now if now < ready else ready
            if horizon <= self.t:
                if ready <= self.t:
                    self._settle(final=False)
                    continue
                return
            self._finished(self.run_until(horizon, self._jump_limit()))

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


def _dispatch(instances: list[Any], rid: int, now: float) -> Any:
    """Send `rid` to the least loaded instance at `now`; returns it."""
    best = instances[0]
    if len(instances) > 1:
        best_load = None
        for inst in instances:
            load = inst.load_at(now)
            if best_load is None or load < best_load:
                best, best_load = inst, load
    best.advance_to(now)
    best.add(rid, now)
    return best


def _result(
    reqs: _Requests, instances: list[Any], start: float, frontend: FrontEnd | None = None
) -> SimResult:
    arrival = np.asarray(reqs.arrival)
    first = np.asarray(reqs.first)
    finish = np.asarray(reqs.finish)
    out = np.asarray(reqs.out)
    busy = {i.name: i.busy for i in instances}
    if frontend is not None:
        first, finish = through_frontend(first, finish, out, frontend.token_s)
        busy["frontend"] = frontend.token_s * float(out.sum())
    tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
    makespan = float(finish.max() - start) if len(finish) else 0.0
    util = {name: (b / makespan if makespan > 0 else 0.0) for name, b in busy.items()}
    swaps = sum(i.num_preemptions for i in instances if isinstance(i, _Decode))
    return SimResult(first - arrival, tpot, finish - arrival, first, finish, util, makespan, swaps)


def through_frontend(
    first: np.ndarray, finish: np.ndarray, out: np.ndarray, token_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """When each request's first and last token reach its client through one FIFO front
    end spending `token_s` on each token (`FrontEnd`), given when the instances made them:
    request i's k-th token (k = 0 .. out[i] - 1) at first[i] + k * its TPOT (between
    events a decode batch's steps are even: the simulator's own jumps). The queue is
    exact for those times: token j (in time order) leaves at d_j = max(a_j, d_(j-1)) + c,
    which is c (j + 1) + max over i <= j of (a_i - c i) - one cumulative maximum, so a
    million tokens cost milliseconds. Past 1 / token_s tokens/s the queue grows without
    bound and every later token waits longer: what saturation does to TTFT and TPOT."""
    n = out.astype(np.int64)
    if n.sum() == 0:
        return first, finish
    step = np.where(n > 1, (finish - first) / np.maximum(n - 1, 1), 0.0)
    owner = np.repeat(np.arange(len(n)), n)
    begins = np.cumsum(n) - n
    k = np.arange(int(n.sum())) - np.repeat(begins, n)
    made = first[owner] + k * step[owner]
    order = np.argsort(made, kind="stable")
    j = np.arange(len(made))
    left = np.empty_like(made)
    left[order] = np.maximum.accumulate(made[order] - token_s * j) + token_s * (j + 1)
    has = n > 0
    return (
        np.where(has, left[np.minimum(begins, len(made) - 1)], first),
        np.where(has, left[np.minimum(begins + n - 1, len(made) - 1)], finish),
    )


class _DisaggRun:
    """Prefill and decode instances advanced together in time order, because a prefill
    instance's admissions depend on when the decode side pulls the KV it holds.

    One loop over the earliest of: an arrival (dispatched to a prefill instance), a
    first token (dispatched to a decode instance), a prefill step. Decode instances
    advance lazily (at dispatch, or to post the releases a prefill step waits for:
    `_sync`); only while a prefill instance is blocked on KV whose fetch has not
    started does the loop step the decode side itself, one boundary at a time. Ties:
    arrivals, then first tokens, then steps (a step at t sees the prompts that arrived
    at t and the releases at t)."""

    def __init__(self, prefills: list[_Prefill], decodes: list[_Decode], reqs: _Requests) -> None:
        self.prefills, self.decodes, self.reqs = prefills, decodes, reqs
        self.source: list[_Prefill] = [prefills[0]] * len(reqs.arrival)  # rid -> its prefill
        self.done: list[tuple[float, int]] = []  # (first token time, rid) heap
        self.woke = False  # a release reached a blocked prefill instance
        for p in prefills:
            p.sync = self._sync
            p.completions = self.done  # each step pushes its first tokens here
        for d in decodes:
            d.on_fetch = self._fetched

    def _fetched(self, rid: int, at: float) -> None:
        p = self.source[rid]
        self.woke |= p.blocked  # its next step may come earlier now
        p.release(rid, at)

    def _sync(self, t: float) -> None:
        for d in self.decodes:
            d.advance_to(t)

    def run(self) -> None:
        arrival = self.reqs.arrival
        i, n = 0, len(arrival)
        rescan = True  # the prefill instances' next steps may have changed
        while True:
            ta = arrival[i] if i < n else INF
            tc = self.done[0][0] if self.done else INF
            if rescan or self.woke:
                tp, p, stuck = self._next_prefill()
                rescan = self.woke = False
            td, d = self._next_decode_boundary() if stuck else (INF, None)
            t = ta if ta < tc else tc
            t = t if t < tp else tp
            t = t if t < td else td
            if t == INF:
                if stuck:
                    raise PlanInputError("a prefill instance waits for KV nothing pulls")
                break
            if ta == t:
                i, q = self._arrivals(i, min(tc, tp, td))
                if q.next_t < tp:  # an idle instance took work
                    tp, p = q.next_t, q
            elif tc == t:
                self._first_tokens(ta, min(tp, td))
            elif tp == t:
                p.step()
                rescan = True
            else:
                assert d is not None
                d.advance_to(td, settle=True)
        for dec in self.decodes:
            dec.drain()

    def _next_prefill(self) -> tuple[float, _Prefill, bool]:
        """The prefill instance whose step comes first, its time, and whether any
        instance waits for a release the decode side has not posted."""
        tp, best, stuck = INF, self.prefills[0], False
        for p in self.prefills:
            t = p.next_t
            if t < tp:
                tp, best = t, p
            elif t == INF and p.queue:
                stuck = True
        return tp, best, stuck

    def _arrivals(self, i: int, until: float) -> tuple[int, _Prefill]:
        """Dispatch arrivals from the `i`th on while they come at or before `until` and
        before the next prefill step; returns the index of the first left and the
        instance of the earliest step among those that took them."""
        arrival, prefills, source = self.reqs.arrival, self.prefills, self.source
        n = len(arrival)
        first = None
        while i < n and arrival[i] <= until:
            p = source[i] = _dispatch(prefills, i, arrival[i])
            i += 1
            if first is None or p.next_t < first.next_t:
                first = p
            if p.next_t < until:
                until = p.next_t
        assert first is not None
        return i, first

    def _first_tokens(self, arrival: float, until: float) -> None:
        """Dispatch first tokens to the decode side while they come before `arrival`
        and at or before `until`, and no blocked prefill instance got a release."""
        done, reqs = self.done, self.reqs
        while True:
            t, rid = heapq.heappop(done)
            if reqs.out[rid] == 1:
                reqs.finish[rid] = t
            else:
                _dispatch(self.decodes, rid, t)
            if not done or self.woke or done[0][0] >= arrival or done[0][0] > until:
                return

    def _next_decode_boundary(self) -> tuple[float, _Decode | None]:
        """The decode instance whose next step boundary comes first, and that boundary:
        stepped by the loop while a prefill instance waits for it to pull."""
        best: tuple[float, _Decode | None] = (INF, None)
        for d in self.decodes:
            t = d.next_boundary()
            if t < best[0]:
                best = (t, d)
        return best


def _run_prefill(prefills: list[_Prefill], reqs: _Requests) -> list[tuple[float, int]]:
    for rid, t in enumerate(reqs.arrival):
        _dispatch(prefills, rid, t)
    for p in prefills:
        p.drain()
    return sorted(c for p in prefills for c in p.completions)


def simulate(
    system: DisaggSystem | ColocatedSystem,
    workload: SimWorkload,
    noise: SpeedNoise | None = None,
    frontend: FrontEnd | None = None,
) -> SimResult:
    """Every request of `workload` through `system`; `noise`: the machine's speed
    drifting (None: every step exactly as priced); `frontend`: the front end the tokens
    then pass through (None: free), its busy share in `utilization["frontend"]`."""
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
        return _result(reqs, colo, start, frontend)
    if not system.prefill or not system.decode:
        raise PlanInputError("a disaggregated system needs prefill and decode instances")
    if not system.transfer_bandwidth > 0:
        raise PlanInputError("transfer bandwidth must be > 0")
    _check_fits(workload, system.prefill, "prefill", whole=False)
    _check_fits(workload, system.decode, "decode", whole=True)
    prefills = [_Prefill(s, reqs, f"prefill-{i}", True) for i, s in enumerate(system.prefill)]
    decodes = [
        _Decode(s, reqs, f"decode-{i}", system.kv_bytes_per_token, system.transfer_bandwidth)
        for i, s in enumerate(system.decode)
    ]
    _DisaggRun(prefills, decodes, reqs).run()
    return _result(reqs, [*prefills, *decodes], start, frontend)


def simulate_prefill(instance: InstanceSpec, workload: SimWorkload) -> SimResult:
    """One prefill instance alone (DistServe's simu_prefill): TTFT only, TPOT 0."""
    reqs = _Requests(workload)
    _check_fits(workload, (instance,), "prefill", whole=False)
    p = _Prefill(instance, reqs, "prefill-0", False)
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
