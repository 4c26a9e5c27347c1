"""Decode admission: may a waiting request join the running batch now? (TetriInfer §3.4)

Each rule sees the batch as `KVJob`s (KV tokens held now, tokens still to generate, the
latter from the length prediction: `remaining_tokens`) and the blocks obtainable now
(free, or cached and evictable). Blocks are whole: a job of t tokens holds ceil(t / bs).

- greedy: the new request's KV fits now (what allocation checks anyway). Running out
  later is handled by preemption (swap or recompute).
- reserve-static: its predicted total KV (now + remaining) fits now.
- reserve-dynamic: let s be the shortest predicted remaining length in the batch (the new
  request included). Over the next s steps every job grows by s tokens; admit only if
  that growth, and the new request's KV, fit in what is obtainable now, i.e. memory is
  still free when the shortest job finishes and releases its blocks.
- past-future (LightLLM's rule, with predicted lengths instead of max_tokens): order the
  jobs by remaining length r_1 <= ... <= r_n. At time r_k the jobs k..n are still alive
  (each holding its tokens + r_k), the others have finished and freed theirs; admit only
  if the largest of these sums (the peak) fits in the blocks held now plus those
  obtainable.

Predictions below the truth never stop a request: a request past its predicted bucket
is assumed to need one more bucket (`remaining_tokens`), and the scheduler's preemption
stays the safety net whichever rule admitted it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import DecodeAdmission
from pdserve.engine.request import Request
from pdserve.kv.manager import KVManager
from pdserve.protocol.prediction import remaining_tokens


@dataclass(frozen=True)
class KVJob:
    tokens: int  # tokens whose KV the request holds (or will, once admitted)
    remaining: int  # tokens it is predicted to generate still (>= 1 while running)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def admits(
    policy: DecodeAdmission,
    batch: Sequence[KVJob],
    new: KVJob,
    obtainable_blocks: int,
    block_size: int,
) -> bool:
    """Whether `new` may join `batch` under `policy` (module docstring)."""
    if policy is DecodeAdmission.GREEDY:
        return _blocks(new.tokens, block_size) <= obtainable_blocks
    if policy is DecodeAdmission.RESERVE_STATIC:
        return _blocks(new.tokens + new.remaining, block_size) <= obtainable_blocks
    if policy is DecodeAdmission.RESERVE_DYNAMIC:
        return _dynamic_need(batch, new, block_size) <= obtainable_blocks
    held = sum(_blocks(j.tokens, block_size) for j in batch)
    return peak_future_blocks([*batch, new], block_size) <= held + obtainable_blocks


def _dynamic_need(batch: Sequence[KVJob], new: KVJob, block_size: int) -> int:
    """Blocks needed from now until the shortest job (new included) finishes."""
    s = min(j.remaining for j in [*batch, new])
    grow = sum(_blocks(j.tokens + s, block_size) - _blocks(j.tokens, block_size) for j in batch)
    return grow + _blocks(new.tokens + s, block_size)


def peak_future_blocks(jobs: Sequence[KVJob], block_size: int) -> int:
    """The most blocks `jobs` hold at once if each runs its remaining length (and frees
    its blocks when it ends); the peak is at one of the finishing times."""
    ordered = sorted(jobs, key=lambda j: j.remaining)
    peak = 0
    for k, job in enumerate(ordered):
        t = job.remaining
        peak = max(peak, sum(_blocks(j.tokens + t, block_size) for j in ordered[k:]))
    return peak


class AdmissionGate:
    """The core's decode admission rule over its own batch and pool: may `req`, prefilled
    elsewhere, join `batch` (the running requests and those whose KV is on its way)? An
    empty batch admits anything (allocation decides), so no prediction, however wrong,
    can keep an idle instance from taking work."""

    def __init__(self, policy: DecodeAdmission, kv: KVManager, max_model_len: int) -> None:
        self.policy = policy
        self.kv = kv
        self.max_model_len = max_model_len
        self.num_waits = 0  # since start: times a request was held back
        self.num_held = 0  # requests it held back (each once, however long)

    def __call__(self, req: Request, batch: Sequence[Request]) -> bool:
        if self.policy is DecodeAdmission.GREEDY or not batch:
            return True
        jobs = [self._job(r) for r in batch]
        bs = self.kv.cfg.block_size
        if admits(self.policy, jobs, self._job(req), self.kv.num_obtainable_blocks, bs):
            return True
        self.num_waits += 1
        self.num_held += not req.held_by_admission
        req.held_by_admission = True
        return False

    def _job(self, req: Request) -> KVJob:
        generated = len(req.output_token_ids)
        left = min(req.params.max_tokens - generated, self.max_model_len - req.num_tokens)
        return KVJob(req.num_tokens, remaining_tokens(req.prediction, generated, left))
