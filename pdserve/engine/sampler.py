"""Pick one token per request from a batch of logits.

`sample(logits, rows)` processes each row in this order:

1. penalties on a copy of the logits: repetition (tokens seen in prompt + output: positive
   logits divided by the penalty, negative ones multiplied, as HF / vLLM do), then presence
   and frequency (output tokens only: `logit -= presence * (count > 0) + frequency * count`,
   as OpenAI defines them);
2. while fewer than `min_tokens` tokens were generated, `stop_token_ids` and the row's EOS ids
   (unless `ignore_eos`) get logit -inf;
3. constraints: `logit_bias` added (a bias of -100 bans its token: -inf), then the tokens
   outside the row's `allowed` bitmask (its grammar's) get -inf. A bias never empties what
   the grammar allows: a row left with no token takes the grammar's mask alone;
4. temperature 0: argmax. Otherwise temperature scaling, top-k, top-p, min-p, then one draw
   with the row's own generator (inverse CDF with one uniform number, as torch.multinomial).

Contracts:

- `logits` is never modified.
- Determinism: a row with a generator draws exactly one float64 from it per call, and its
  token depends only on its own logits, history, parameters and generator state, so a seeded
  request produces the same tokens whatever else is in the batch. Rows without a generator
  share the global default RNG.
- Logprobs are those of the raw model distribution (log-softmax of the unpenalised logits at
  temperature 1), as vLLM reports them by default.
- Hot path: when every row is greedy with no penalties, no constraint, no logprobs and no
  min_tokens mask, `sample` is one batched argmax (or takes the one the compiled step
  computed, `argmax`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from pdserve.protocol.sampling_params import LOGIT_BIAS_LIMIT, SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One request's view for one sampling step (built by the engine each step).

    `generator` is the request's own generator (created by the engine from params.seed, and
    kept across steps), or None to use the global default RNG. `eos_token_ids` are the ids the
    engine stops on (they are masked, with params.stop_token_ids, until min_tokens tokens were
    generated); leaving it empty means EOS is not masked by min_tokens. `allowed`: the
    tokens the request's grammar allows now, a packed bitmask (int32 words, token t is
    bit t % 32 of word t // 32: llguidance's layout), or None when unconstrained.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Collection[int] = ()
    allowed: torch.Tensor | None = None


@dataclass(frozen=True)
class SampledToken:
    """The chosen token and, when params.logprobs is not None, its log-probabilities.

    logprob: log-softmax of the raw logits (before penalties, temperature 1) at token_id.
    top_logprobs: the params.logprobs most likely (id, logprob) of the same distribution,
    best first; () when logprobs is None or 0.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], argmax: torch.Tensor | None = None
) -> list[SampledToken]:
    """One token per row of `logits` ([len(rows), vocab]); see the module docstring.
    argmax: each row's argmax of `logits`, already taken (the compiled step's), or None."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}"
        )
    if all(is_plain_greedy(row) for row in rows):
        ids = _argmax(logits) if argmax is None else cast(list[int], argmax.tolist())
        return [SampledToken(t) for t in ids]
    x = logits.to(torch.float32, copy=True)
    apply_penalties(x, rows)
    mask_min_tokens(x, rows)
    apply_constraints(x, rows)
    token_ids = _choose_tokens(x, rows)
    return _with_logprobs(logits, token_ids, rows)


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first of equal maxima (a NaN counting as the largest). Host
    logits go through numpy: torch's argmax over a 49k vocabulary costs ~43 us, numpy's ~4
    (a batch-1 step samples this way every token, unless its compiled call took the argmax
    itself: _kernels.c's argmax_rows, the same choice)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return cast(list[int], logits.numpy().argmax(axis=-1).tolist())
    return cast(list[int], logits.argmax(dim=-1).tolist())


def is_plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is its logits' argmax: greedy, no penalties, no grammar
    or logit bias, no logprobs, nothing masked by min_tokens."""
    p = row.params
    return (
        p.temperature == 0.0
        and p.logprobs is None
        and not p.has_penalties
        and not p.constrained
        and row.allowed is None
        and not _min_tokens_blocked(row)
    )


def _min_tokens_blocked(row: SamplingRow) -> tuple[int, ...]:
    """Token ids that may not be sampled yet because min_tokens is not reached."""
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return ()
    eos = () if p.ignore_eos else tuple(row.eos_token_ids)
    return p.stop_token_ids + eos


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply repetition, presence and frequency penalties to `logits` [n, vocab] in place."""
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = _ids_tensor(row.prompt_token_ids, logits.device)
            seen = torch.cat([seen, _ids_tensor(row.output_token_ids, logits.device)])
            _apply_repetition_penalty(logits[i], seen, p.repetition_penalty)
        has_additive = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        if has_additive and len(row.output_token_ids) > 0:
            out = _ids_tensor(row.output_token_ids, logits.device)
            _apply_additive_penalties(logits[i], out, p.presence_penalty, p.frequency_penalty)


def _ids_tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long, device=device)


def _apply_repetition_penalty(row: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    if seen.numel() == 0:
        return
    seen = seen.unique()
    vals = row[seen]
    row[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)


def _apply_additive_penalties(
    row: torch.Tensor, out: torch.Tensor, presence: float, frequency: float
) -> None:
    counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
    row -= frequency * counts + presence * (counts > 0).to(row.dtype)


def mask_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Set to -inf, in place, the stop/EOS ids of rows that have not reached min_tokens."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        blocked = [t for t in _min_tokens_blocked(row) if t < vocab]
        if blocked:
            logits[i, blocked] = _NEG_INF


def apply_constraints(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's logit bias and mask what its grammar forbids, in place (step 3 of
    the module docstring)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        bias = [(t, b) for t, b in row.params.logit_bias if t < vocab]
        if not bias and row.allowed is None:
            continue
        x = logits[i]
        allowed = None if row.allowed is None else unpack_bitmask(row.allowed, vocab)
        if bias:
            before = x.clone() if allowed is not None else None
            ids = torch.tensor([t for t, _ in bias], device=x.device)
            vals = torch.tensor([b for _, b in bias], dtype=x.dtype, device=x.device)
            x[ids] += vals.masked_fill(vals <= -LOGIT_BIAS_LIMIT, _NEG_INF)
            if allowed is not None and before is not None and bool(x[allowed].isneginf().all()):
                x.copy_(before)  # the bias would leave nothing the grammar allows
        if allowed is not None:
            _mask_outside(x, allowed)


def _mask_outside(x: torch.Tensor, allowed: torch.Tensor) -> None:
    """-inf where `allowed` (bool [vocab]) is False; through numpy on the host (~10x
    faster than a torch masked_fill over 49k entries)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        np.copyto(x.numpy(), _NEG_INF, where=~allowed.numpy())
    else:
        x.masked_fill_(~allowed, _NEG_INF)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """A packed bitmask (int32 words, bit t % 32 of word t // 32) as bools [vocab]."""
    if words.device.type == "cpu":
        bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[:vocab].view(np.bool_))
    shifted = (words.to(torch.int32).unsqueeze(-1) >> _SHIFTS.to(words.device)) & 1
    return shifted.reshape(-1)[:vocab].bool()


def _choose_tokens(x: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """Argmax for greedy rows, a filtered random draw for the others."""
    rand = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not rand:
        return _argmax(x)
    rand_rows = [rows[i] for i in rand]
    all_rand = len(rand) == len(rows)
    probs = sampling_probs(x if all_rand else x[rand], [r.params for r in rand_rows])
    drawn = draw(probs, [r.generator for r in rand_rows])
    if all_rand:
        return drawn.tolist()
    token_ids = x.argmax(dim=-1)
    token_ids[rand] = drawn
    return token_ids.tolist()


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution to draw from: temperature, then top-k, top-p and min-p filtering.

    `logits` [n, vocab] (penalties already applied) is not modified; every params[i] must
    have temperature > 0. top-p applies to the distribution left by top-k, min-p to the one
    left by both. Returns probabilities [n, vocab] (float32), zero where filtered.
    """
    temps = _column([p.temperature for p in params], logits)
    # Subtracting the max first keeps tiny temperatures finite and makes the best token's
    # scaled logit exactly 0, which min-p relies on.
    x = (logits - logits.amax(dim=-1, keepdim=True)) / temps
    _apply_top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])
    _apply_min_p(x, [p.min_p for p in params])
    return x.softmax(dim=-1)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _apply_top_k_top_p(x: torch.Tensor, top_ks: Sequence[int], top_ps: Sequence[float]) -> None:
    """Set to -inf, in place, the logits that top-k and then top-p remove.

    Both keep a prefix of the tokens sorted by logit, so each row reduces to a threshold
    (the smallest kept logit; tokens tied with it are kept too). Sorting the whole vocabulary
    is slow on CPU, so the cut is searched among the best few tokens first, and only rows
    whose top-p cut lies beyond them are searched again with more (see _candidate_sizes).
    """
    vocab = x.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_ps):
        return
    threshold = torch.empty(len(ks), 1, dtype=x.dtype, device=x.device)
    rows = list(range(len(ks)))
    for n_cand in _candidate_sizes(x, ks, top_ps):
        sub = x if len(rows) == len(ks) else x[rows]
        sub_ks, sub_ps = [ks[i] for i in rows], [top_ps[i] for i in rows]
        threshold[rows], covered = _prefix_thresholds(sub, sub_ks, sub_ps, n_cand)
        rows = [i for i, ok in zip(rows, covered, strict=True) if not ok]
        if not rows:
            break
    x.masked_fill_(x < threshold, _NEG_INF)


_TOP_P_CANDIDATES = 1024
"""Most tokens searched in the first pass for a top-p cut (topk of 1024 of 49k logits is
about ten times cheaper than a full sort); LLM distributions rarely need more."""


def _candidate_sizes(x: torch.Tensor, ks: Sequence[int], top_ps: Sequence[float]) -> list[int]:
    """Increasing numbers of best tokens in which to look for the cut; the last one suffices.

    top-k rows need their k. For top-p-only rows: tokens with probability below
    eps = (1 - top_p) / (2 * vocab) hold less than (1 - top_p) / 2 together, so the cut lies
    before the first of them, and `count(p >= eps) + 1` candidates always hold it.
    """
    vocab = x.shape[1]
    n_k = max([k for k in ks if k < vocab], default=1)
    p_only = [i for i, (k, p) in enumerate(zip(ks, top_ps, strict=True)) if p < 1.0 and k == vocab]
    if not p_only:
        return [n_k]
    probs = (x if len(p_only) == len(ks) else x[p_only]).softmax(dim=-1)
    eps = _column([(1.0 - top_ps[i]) / (2 * vocab) for i in p_only], x)
    bound = min(vocab, int((probs >= eps).sum(dim=-1).max()) + 1)
    first = max(n_k, min(bound, _TOP_P_CANDIDATES))
    return sorted({first, max(n_k, bound), vocab})


def _prefix_thresholds(
    x: torch.Tensor, ks: Sequence[int], top_ps: Sequence[float], n_cand: int
) -> tuple[torch.Tensor, list[bool]]:
    """Per row, the smallest logit kept by top-k (ks, vocab = off) then top-p.

    Looks at the n_cand largest logits only. Returns the thresholds [n, 1] (-inf where nothing
    is removed) and, per row, whether the cut was found among the candidates.
    """
    vocab = x.shape[1]
    vals = x.topk(n_cand, dim=-1).values  # sorted, best first
    k = torch.tensor(ks, device=x.device).unsqueeze(1)
    keep = k.clamp(max=n_cand)
    limited = k < vocab
    covered = [True] * len(ks)
    if any(p < 1.0 for p in top_ps):
        top_p = _column(top_ps, x)
        n_top_p = _top_p_counts(x, vals, k, top_p)
        keep = torch.where(top_p < 1.0, torch.minimum(keep, n_top_p), keep)
        limited |= top_p < 1.0
        # A top-p-only row whose kept prefix fills all candidates may need more tokens.
        more = (k == vocab) & (top_p < 1.0) & (n_top_p >= n_cand) & (n_cand < vocab)
        covered = (~more).squeeze(1).tolist()
    threshold = vals.gather(1, keep - 1)
    return threshold.masked_fill_(~limited, _NEG_INF), covered


def _top_p_counts(
    x: torch.Tensor, vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per row, how many of the sorted candidates `vals` top-p keeps ([n, 1]).

    top-p sees the distribution renormalised over the top-k survivors (k = vocab: all).
    """
    vocab = x.shape[1]
    in_k = torch.arange(vals.shape[1], device=x.device).unsqueeze(0) < k
    log_norm = vals.masked_fill(~in_k, _NEG_INF).logsumexp(dim=-1, keepdim=True)
    if bool((k == vocab).any()) and vals.shape[1] < vocab:
        log_norm = torch.where(k < vocab, log_norm, x.logsumexp(dim=-1, keepdim=True))
    probs = (vals - log_norm).exp().masked_fill_(~in_k, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    # mass_before[0] == 0 < top_p, so at least one token is always kept.
    return ((mass_before < top_p) & in_k).sum(dim=-1, keepdim=True)


def _apply_min_p(x: torch.Tensor, min_ps: Sequence[float]) -> None:
    """Drop tokens with probability < min_p * max probability.

    `x` has its row maximum at exactly 0, so p_i / p_max = exp(x_i) and the test is done on
    logits: x_i < log(min_p).
    """
    if all(p <= 0.0 for p in min_ps):
        return
    log_min_p = _column([math.log(p) if p > 0 else _NEG_INF for p in min_ps], x)
    x.masked_fill_(x < log_min_p, _NEG_INF)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One index per row of `probs` [n, vocab], row i drawn with generators[i].

    Inverse-CDF sampling, as torch.multinomial does: one uniform u per row (float64, from the
    row's generator, or from the global default RNG when it is None), and the index is the
    first j with cdf[j] > u * cdf[-1]. Index j is chosen with probability probs[j] / sum(probs)
    (zero-probability indices never). One number per row, instead of the `vocab` numbers of
    an exponential race, keeps this cheap on CPU.
    """
    cdf = probs.cumsum(dim=-1)  # CPU accumulates float32 in double, one rounding per entry
    total = cdf[:, -1:]
    u = _uniforms(generators).to(probs.device).unsqueeze(1)
    target = (u * total.double()).to(cdf.dtype)
    # Rounding to float32 may reach `total`; stay strictly below it.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)


def _uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) float64 per row: rows with a generator use it, the others share one call."""
    u = torch.empty(len(generators), dtype=torch.float64)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=g, device=g.device).item()
    return u


def _with_logprobs(
    logits: torch.Tensor, token_ids: list[int], rows: Sequence[SamplingRow]
) -> list[SampledToken]:
    want = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    out = [SampledToken(t) for t in token_ids]
    if not want:
        return out
    lp = torch.log_softmax(logits[want].to(torch.float32), dim=-1)
    chosen_idx = torch.tensor([token_ids[i] for i in want], device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, chosen_idx).squeeze(1).tolist()
    k_max = min(max(rows[i].params.logprobs or 0 for i in want), lp.shape[1])
    top_vals: list[list[float]] = [[] for _ in want]
    top_ids: list[list[int]] = [[] for _ in want]
    if k_max > 0:
        top = lp.topk(k_max, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(want):
        k = rows[i].params.logprobs or 0
        pairs = tuple(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
        out[i] = SampledToken(token_ids[i], chosen[j], pairs)
    return out
