from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from pdserve.engine import sampler
from pdserve.engine.sampler import (
    SampledToken,
    SamplingRow,
    apply_penalties,
    draw,
    sample,
    sampling_probs,
)
from pdserve.protocol.sampling_params import SamplingParams

VOCAB = 64


def _row(
    params: SamplingParams,
    seed: int | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, gen, list(prompt), list(output), list(eos))


def _random_logits(n: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _logits_of(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log().float()


def _ids(tokens: list[SampledToken]) -> list[int]:
    return [t.token_id for t in tokens]


GREEDY = SamplingParams(temperature=0.0)


# --- greedy and the fast path ----------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = _random_logits(7)
    out = sample(logits, [_row(GREEDY) for _ in range(7)])
    assert out == [SampledToken(t, None, ()) for t in logits.argmax(dim=-1).tolist()]


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    logits = torch.zeros(3, 10)
    logits[0, [2, 7]] = 5.0
    logits[1, [9, 0]] = 1.0
    out = sample(logits, [_row(GREEDY) for _ in range(3)])
    assert _ids(out) == [2, 0, 0]


def test_all_greedy_batch_is_one_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("the greedy fast path must not reach the general path")

    for name in ("apply_penalties", "mask_min_tokens", "_choose_tokens", "_with_logprobs"):
        monkeypatch.setattr(sampler, name, forbidden)
    logits = _random_logits(4)
    # top_p / top_k / min_p / seed do not matter at temperature 0.
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, seed=1)
    out = sample(logits, [_row(params, seed=1) for _ in range(4)])
    assert _ids(out) == logits.argmax(dim=-1).tolist()


def test_sample_does_not_modify_logits() -> None:
    logits = _random_logits(3)
    before = logits.clone()
    params = SamplingParams(top_k=5, top_p=0.5, min_p=0.1, repetition_penalty=1.5, logprobs=2)
    sample(logits, [_row(params, seed=i, prompt=[1, 2], output=[3]) for i in range(3)])
    assert torch.equal(logits, before)


def test_greedy_rows_mixed_with_random_rows_are_argmax() -> None:
    logits = _random_logits(6, seed=3)
    rows = [_row(GREEDY if i % 2 == 0 else SamplingParams(), seed=i) for i in range(6)]
    out = _ids(sample(logits, rows))
    assert out[0::2] == logits[0::2].argmax(dim=-1).tolist()


def test_empty_batch() -> None:
    assert sample(torch.empty(0, VOCAB), []) == []


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[len\(rows\)=2, vocab\], got \(3, 64\)"):
        sample(_random_logits(3), [_row(GREEDY), _row(GREEDY)])


# --- filters that must reduce to greedy -------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.9),
    ],
)
def test_filters_that_keep_one_token_equal_greedy(params: SamplingParams) -> None:
    logits = _random_logits(8, vocab=2000, seed=5)
    rows = [_row(params, seed=i) for i in range(8)]
    for _ in range(3):
        assert _ids(sample(logits, rows)) == logits.argmax(dim=-1).tolist()


# --- the filtered distribution, exactly ------------------------------------------------

P4 = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), P4),
        (SamplingParams(top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(top_k=4), P4),
        (SamplingParams(top_k=100), P4),
        (SamplingParams(top_p=0.7), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(top_p=0.45), [1.0, 0.0, 0.0, 0.0]),
        # top-p applies to the top-k distribution: within the top 3, the first two hold 0.842.
        (SamplingParams(top_k=3, top_p=0.83), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(top_p=0.83), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        # min-p: keep p >= min_p * 0.5.
        (SamplingParams(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(min_p=0.5), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(min_p=0.05), P4),
        # temperature 0.5 squares the probabilities (then renormalises).
        (SamplingParams(temperature=0.5), [p * p / 0.365 for p in P4]),
        # temperature first: at T=0.5 the probs are [.685, .247, .062, .007]; min_p=0.08 keeps
        # p >= .055 (3 tokens), min_p=0.1 keeps p >= .0685 (2 tokens).
        (SamplingParams(temperature=0.5, min_p=0.08), [p * p / 0.3625 for p in P4[:3]] + [0.0]),
        (SamplingParams(temperature=0.5, min_p=0.1), [0.25 / 0.34, 0.09 / 0.34, 0.0, 0.0]),
    ],
)
def test_sampling_probs_exact(params: SamplingParams, expected: list[float]) -> None:
    probs = sampling_probs(_logits_of(P4), [params])
    torch.testing.assert_close(probs, torch.tensor([expected]), rtol=0, atol=1e-6)
    zero = [e == 0.0 for e in expected]
    assert (probs[0] == 0).tolist() == zero


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Straightforward full-sort implementation, one row, in float64."""
    x = logits.double() / p.temperature
    order = x.argsort(descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < p.top_k < x.numel():
        keep[order[p.top_k :]] = False
    probs = x.masked_fill(~keep, -math.inf).softmax(-1)
    sorted_probs = probs[order]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = (mass_before >= p.top_p) & (p.top_p < 1)
    drop[0] = False
    keep[order[drop]] = False
    probs = x.masked_fill(~keep, -math.inf).softmax(-1)
    keep &= probs >= p.min_p * probs.max()
    return x.masked_fill(~keep, -math.inf).softmax(-1)


def test_vectorised_filters_match_a_per_row_reference() -> None:
    # Rows of very different shapes in one batch: peaked rows whose top-p cut falls among the
    # first candidates, flat rows that need the full sort, and every filter combination.
    vocab = 3000
    scales = [0.2, 0.5, 4.0, 8.0, 1.0, 0.3, 6.0, 2.0]
    logits = torch.cat([_random_logits(1, vocab, seed=i, scale=s) for i, s in enumerate(scales)])
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.95, top_k=2000),
        SamplingParams(top_p=0.9, temperature=0.7),
        SamplingParams(top_k=40),
        SamplingParams(top_k=1500, min_p=0.3),
        SamplingParams(),
        SamplingParams(min_p=0.05, top_p=0.8, temperature=1.3),
        SamplingParams(top_k=10, top_p=0.6),
    ]
    probs = sampling_probs(logits, params)
    for i, p in enumerate(params):
        expected = _reference_probs(logits[i], p).float()
        assert torch.equal(probs[i] > 0, expected > 0), i
        torch.testing.assert_close(probs[i], expected, rtol=1e-4, atol=1e-7)
        # and the same row alone gives the same distribution
        torch.testing.assert_close(sampling_probs(logits[i : i + 1], [p])[0], probs[i])


def test_top_k_keeps_exactly_k_distinct_tokens() -> None:
    logits = _random_logits(3, vocab=500, seed=2)
    probs = sampling_probs(logits, [SamplingParams(top_k=k) for k in (1, 7, 499)])
    assert (probs > 0).sum(dim=-1).tolist() == [1, 7, 499]
    top7 = set(logits[1].topk(7).indices.tolist())
    assert set(torch.nonzero(probs[1]).flatten().tolist()) == top7


# --- seeded sampling --------------------------------------------------------------------


def _generate(params: SamplingParams, seed: int, batch_mates: int, steps: int = 20) -> list[int]:
    """Sample `steps` tokens for one seeded row, optionally inside a batch of random others."""
    target = _row(params, seed=seed, prompt=[1, 2, 3])
    others = [
        _row(
            SamplingParams(
                temperature=[0.0, 0.7, 1.0, 1.5, 1.0][i % 5],
                top_p=[1.0, 0.9, 0.5, 1.0, 0.99][i % 5],
                top_k=[-1, 50, -1, 5, 0][i % 5],
                repetition_penalty=[1.0, 1.2, 1.0, 1.0, 0.8][i % 5],
                logprobs=[None, 3, None, 0, None][i % 5],
            ),
            seed=None if i % 2 else 1000 + i,
            prompt=[i],
        )
        for i in range(batch_mates)
    ]
    tokens: list[int] = []
    for step in range(steps):
        target_logits = _random_logits(1, vocab=2000, seed=step, scale=2.0)
        other_logits = torch.randn(batch_mates, 2000) * 4
        rows = [*others[:2], target, *others[2:]] if others else [target]
        logits = torch.cat([other_logits[:2], target_logits, other_logits[2:]])
        out = sample(logits, rows)
        chosen = out[2 if others else 0].token_id
        tokens.append(chosen)
        target.output_token_ids = [*target.output_token_ids, chosen]
        mates_out = [o.token_id for i, o in enumerate(out) if i != 2] if others else []
        for row, t in zip(others, mates_out, strict=True):
            row.output_token_ids = [*row.output_token_ids, t]
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=7),
        SamplingParams(seed=7, top_p=0.9, temperature=0.8),
        SamplingParams(seed=7, top_k=20, min_p=0.05, repetition_penalty=1.3, logprobs=2),
    ],
)
def test_same_seed_same_tokens_whatever_the_batch(params: SamplingParams) -> None:
    alone = _generate(params, seed=7, batch_mates=0)
    torch.manual_seed(123)
    in_batch = _generate(params, seed=7, batch_mates=5)
    torch.manual_seed(456)
    in_other_batch = _generate(params, seed=7, batch_mates=5)
    assert alone == in_batch == in_other_batch
    assert len(set(alone)) > 5  # really sampled, not greedy


def test_different_seeds_give_different_tokens() -> None:
    params = SamplingParams()
    assert _generate(params, seed=1, batch_mates=0) != _generate(params, seed=2, batch_mates=0)


def test_unseeded_rows_use_the_global_rng() -> None:
    logits = _random_logits(4, vocab=1000, scale=0.5)
    rows = [_row(SamplingParams()) for _ in range(4)]
    torch.manual_seed(11)
    first = [_ids(sample(logits, rows)) for _ in range(5)]
    torch.manual_seed(11)
    assert [_ids(sample(logits, rows)) for _ in range(5)] == first
    assert len({tuple(f) for f in first}) > 1


def test_each_seeded_row_consumes_only_its_own_generator() -> None:
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    rows = [SamplingRow(SamplingParams(), gen, [], []), _row(SamplingParams(), seed=4)]
    sample(_random_logits(2), rows)
    expected = torch.Generator()
    expected.set_state(state)
    torch.rand(1, dtype=torch.float64, generator=expected)  # one number per call
    assert torch.equal(gen.get_state(), expected.get_state())


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(seed=0), [0.1, 0.2, 0.3, 0.4]),
        (SamplingParams(seed=0, temperature=0.5), [p * p / 0.3 for p in (0.1, 0.2, 0.3, 0.4)]),
        (SamplingParams(seed=0, top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
    ],
)
def test_empirical_distribution_matches(params: SamplingParams, expected: list[float]) -> None:
    n = 20000
    gen = torch.Generator().manual_seed(1234)
    logits = _logits_of([0.1, 0.2, 0.3, 0.4]).expand(n, 4)
    out = _ids(sample(logits, [SamplingRow(params, gen, [], []) for _ in range(n)]))
    freq = torch.bincount(torch.tensor(out), minlength=4).double() / n
    # 4 standard deviations of a frequency over 20000 draws is at most 0.0142.
    torch.testing.assert_close(
        freq, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=0.014
    )
    assert all(f == 0 for f, e in zip(freq.tolist(), expected, strict=True) if e == 0)


def test_draw_never_picks_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5000, 5)
    gen = torch.Generator().manual_seed(0)
    picked = set(draw(probs, [gen] * 5000).tolist())
    assert picked == {1, 3}


# --- penalties --------------------------------------------------------------------------


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [_row(params, prompt=[0, 1], output=[2, 2, 4])])
    # repetition on prompt+output {0,1,2,4}: 2/2, -1*2, 0.5/2, -2*2; then, on output only,
    # token 2 (twice): -0.5 - 2*0.25, token 4 (once): -0.5 - 0.25.
    assert logits.tolist() == [[1.0, -2.0, -0.75, 3.0, -4.75, 1.0]]


def test_penalties_per_row_and_untouched_rows() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [
        _row(SamplingParams(), prompt=[0, 1, 2], output=[2]),
        _row(SamplingParams(presence_penalty=-1.0), prompt=[0], output=[1, 1]),
        _row(SamplingParams(frequency_penalty=1.5, repetition_penalty=0.5), output=[0, 0, 0]),
    ]
    apply_penalties(logits, rows)
    # presence applies to output tokens only (token 0 is only in the prompt).
    # repetition_penalty < 1 boosts: 1.0 / 0.5 = 2.0, then frequency 3 * 1.5.
    assert logits.tolist() == [[1.0, 2.0, 3.0], [1.0, 3.0, 3.0], [-2.5, 2.0, 3.0]]


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, -5.0]])
    plain = sample(logits, [_row(GREEDY, output=[0])])
    penalised = sample(
        logits, [_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[0])]
    )
    in_prompt = sample(
        logits, [_row(SamplingParams(temperature=0.0, presence_penalty=2.0), prompt=[0])]
    )
    assert (_ids(plain), _ids(penalised), _ids(in_prompt)) == ([0], [1], [0])


# --- min_tokens -------------------------------------------------------------------------


def test_min_tokens_masks_stop_and_eos_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    assert _ids(sample(logits, [_row(params, output=[3], eos=[0])])) == [2]
    assert _ids(sample(logits, [_row(params, output=[3, 3], eos=[0])])) == [0]
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert _ids(sample(logits, [_row(ignore, output=[], eos=[0])])) == [0]
    # ids beyond the vocabulary are ignored, not an error
    far = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(10**6,))
    assert _ids(sample(logits, [_row(far, eos=[0])])) == [1]


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_values() -> None:
    logits = _random_logits(3, seed=9)
    rows = [
        _row(
            SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.5),
            seed=1,
            prompt=[0, 1],
        ),
        _row(SamplingParams(logprobs=0, temperature=0.0, presence_penalty=2.0), output=[3]),
        _row(SamplingParams(), seed=2),
    ]
    out = sample(logits, rows)
    for i in range(2):
        ref = torch.log_softmax(logits[i], dim=-1)
        assert out[i].logprob == ref[out[i].token_id].item()
    ref0 = torch.log_softmax(logits[0], dim=-1)
    top = ref0.topk(5)
    assert out[0].top_logprobs == tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    values = [lp for _, lp in out[0].top_logprobs]
    assert values == sorted(values, reverse=True)
    assert out[1].top_logprobs == ()
    assert (out[2].logprob, out[2].top_logprobs) == (None, ())


def test_logprobs_on_a_small_vocabulary_and_greedy_rows() -> None:
    logits = _logits_of(P4)
    out = sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=20))])
    assert out[0].token_id == 0
    assert [t for t, _ in out[0].top_logprobs] == [0, 1, 2, 3]
    expected = [math.log(p) for p in P4]
    assert [lp for _, lp in out[0].top_logprobs] == pytest.approx(expected, abs=1e-6)
    assert out[0].logprob == pytest.approx(math.log(0.5), abs=1e-6)


def test_bfloat16_logits_are_processed_in_float32() -> None:
    logits = _random_logits(3, seed=4).bfloat16()
    rows = [
        _row(GREEDY),
        _row(SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=1.2), prompt=[5]),
        _row(SamplingParams(top_k=1), seed=1),
    ]
    out = sample(logits, rows)
    ref = logits.float()
    assert [out[0].token_id, out[2].token_id] == [int(ref[0].argmax()), int(ref[2].argmax())]
    lp = torch.log_softmax(ref[1], dim=-1)
    assert out[1].logprob == lp[out[1].token_id].item()
    assert out[1].top_logprobs == ((int(lp.argmax()), lp.max().item()),)
