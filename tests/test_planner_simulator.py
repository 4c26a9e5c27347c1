"""The discrete-event simulator: hand-computed timelines, a naive step-by-step
reference, queueing theory, workloads and bad input."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.config import DecodeAdmission
from pdserve.planner.latency import StepCost
from pdserve.planner.model_spec import PlanInputError
from pdserve.planner.simulator import (
    ColocatedSystem,
    DisaggSystem,
    FrontEnd,
    InstanceSpec,
    simulate,
    simulate_decode,
    simulate_prefill,
)
from pdserve.planner.workload import SimWorkload, fit_trace, sample_workload


def cost(
    base: float = 1.0,
    prompt_token: float = 0.0,
    prompt_unit: float = 0.0,
    prompt_seq: float = 0.0,
    decode_token: float = 0.0,
    context_token: float = 0.0,
    stages: int = 1,
    knee: float = 0.0,
    decode_comm: float = 0.0,
    hop_fixed: float = 0.0,
) -> StepCost:
    return StepCost(
        base,
        prompt_token,
        prompt_unit,
        prompt_seq,
        decode_token,
        context_token,
        stages,
        knee=knee,
        decode_comm=decode_comm,
        hop_fixed=hop_fixed,
    )


def wl(arrivals: list[float], inputs: list[int], outputs: list[int]) -> SimWorkload:
    return SimWorkload(
        np.array(arrivals, dtype=float), np.array(inputs), np.array(outputs), name="test"
    )


# ---- prefill ------------------------------------------------------------------------------


def test_chunked_prefill_splits_prompts_within_the_budget() -> None:
    c = cost(base=1.0, prompt_token=0.01, prompt_unit=1e-5, prompt_seq=0.5)
    inst = InstanceSpec(c, 10_000, max_batch_tokens=100, chunked=True)
    r = simulate_prefill(inst, wl([0.0, 0.0], [250, 30], [1, 1]))
    s1 = 1 + 100 * 0.01 + 100**2 * 1e-5  # A 0..100
    s2 = 1 + 100 * 0.01 + (200**2 - 100**2) * 1e-5  # A 100..200
    s3 = 1 + 80 * 0.01 + (250**2 - 200**2 + 30**2) * 1e-5 + 2 * 0.5  # A 200..250, B 0..30
    assert r.first_token.tolist() == pytest.approx([s1 + s2 + s3] * 2, abs=1e-12)
    assert r.utilization["prefill-0"] == pytest.approx(1.0)


def test_prefill_without_chunking_batches_whole_prompts_up_to_lm() -> None:
    inst = InstanceSpec(cost(base=1.0, prompt_token=0.01), 10_000, 256, 100, chunked=False)
    r = simulate_prefill(inst, wl([0.0, 0.0, 0.0, 0.0], [60, 30, 50, 150], [1] * 4))
    # [A 60 + B 30] = 1.9; C 50 alone (140 > 100) = 1.5; D 150 > L_m runs alone = 2.5
    assert r.ttft.tolist() == pytest.approx([1.9, 1.9, 3.4, 5.9])


def test_pipelined_prefill_admits_a_batch_every_stage_time() -> None:
    # two stages: a stage of a 100-token prompt takes 1 + 1 = 2 s, the request 4 s
    inst = InstanceSpec(cost(base=1.0, prompt_token=0.01, stages=2), 10_000, 256, 100, False)
    r = simulate_prefill(inst, wl([0.0, 0.0, 0.0], [100, 100, 100], [1] * 3))
    assert r.ttft.tolist() == pytest.approx([4.0, 6.0, 8.0])


def test_pipeline_bubble_a_short_batch_waits_behind_a_long_one() -> None:
    """DistServe §3.3: a stage runs one micro-batch at a time, so a short prompt behind
    a long one waits at stage 2 (a bubble at stage 1), and a prompt after it too."""
    # per stage: 1 ms a token; budget 400: each prompt is its own micro-batch
    inst = InstanceSpec(cost(base=0.0, prompt_token=0.001, stages=2), 10_000, 256, 400, False)
    r = simulate_prefill(inst, wl([0.0, 0.0, 0.0], [400, 300, 300], [1] * 3))
    # A: stage 1 [0, 0.4], stage 2 [0.4, 0.8]; B: stage 1 [0.4, 0.7], stage 2 waits for A:
    # [0.8, 1.1]; C: stage 1 [0.7, 1.0], stage 2 [1.1, 1.4] (no bubbles: 1.0 and 1.3)
    assert r.first_token.tolist() == pytest.approx([0.8, 1.1, 1.4], abs=1e-12)
    # short first: the long one waits for nothing, the prompt after it does
    r = simulate_prefill(inst, wl([0.0, 0.0, 0.0], [300, 400, 300], [1] * 3))
    # A: [0, 0.3], [0.3, 0.6]; B: [0.3, 0.7], [0.7, 1.1]; C: [0.7, 1.0], [1.1, 1.4]
    assert r.first_token.tolist() == pytest.approx([0.6, 1.1, 1.4], abs=1e-12)


def test_pipeline_stages_wait_for_activation_hops() -> None:
    """A batch enters stage k after its activations crossed (hop_token per token)."""
    c = StepCost(0.0, 0.001, 0.0, 0.0, 0.0, 0.0, 2, hop_token=0.0005)
    inst = InstanceSpec(c, 10_000, 256, 400, chunked=False)
    r = simulate_prefill(inst, wl([0.0, 0.0], [400, 100], [1, 1]))
    # A: [0, 0.4], hop 0.2, [0.6, 1.0]; B: [0.4, 0.5], hop 0.05, stage 2 free at 1.0: [1.0, 1.1]
    assert r.first_token.tolist() == pytest.approx([1.0, 1.1], abs=1e-12)
    # a fixed 0.1 s a hand-off: A [0, 0.4], hop 0.3, [0.7, 1.1]; B [0.4, 0.5], hop 0.15,
    # stage 2 free at 1.1: [1.1, 1.2]
    fixed = InstanceSpec(dataclasses.replace(c, hop_fixed=0.1), 10_000, 256, 400, chunked=False)
    r = simulate_prefill(fixed, wl([0.0, 0.0], [400, 100], [1, 1]))
    assert r.first_token.tolist() == pytest.approx([1.1, 1.2], abs=1e-12)


def test_prefill_queueing_is_fcfs_across_idle_gaps() -> None:
    inst = InstanceSpec(cost(base=1.0), 10_000, 256, 100, chunked=True)
    r = simulate_prefill(inst, wl([0.0, 0.5, 5.0], [10, 10, 10], [1] * 3))
    assert r.first_token.tolist() == pytest.approx([1.0, 2.0, 6.0])


# ---- decode --------------------------------------------------------------------------------


def test_decode_batches_join_at_step_boundaries() -> None:
    inst = InstanceSpec(cost(base=0.1, decode_token=0.01, context_token=0.001), 10_000)
    r = simulate_decode(inst, wl([0.0, 0.15], [10, 20], [4, 3]))
    s1 = 0.1 + 0.01 + 0.011  # A alone, context 11
    s2 = 0.1 + 0.01 + 0.012
    s3 = 0.1 + 0.02 + (13 + 21) * 0.001  # B joined at the boundary after 0.15
    s4 = 0.1 + 0.01 + 0.022  # A finished after its 3 steps; B's second (last) step
    a_end = s1 + s2 + s3
    b_end = a_end + s4
    assert r.finish.tolist() == pytest.approx([a_end, b_end])
    assert r.tpot.tolist() == pytest.approx([a_end / 3, (b_end - 0.15) / 2])
    assert r.ttft.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("policy", "swaps"), [(DecodeAdmission.GREEDY, 1), (DecodeAdmission.RESERVE_STATIC, 0)]
)
def test_decode_kv_capacity_delays_admission(policy: DecodeAdmission, swaps: int) -> None:
    # 30 tokens. reserve-static: B's whole KV (20 + 3) does not fit beside A's 10, so B
    # waits for A to finish. greedy: B's prompt fits beside A's (10 + 20), but the first
    # step needs a slot each (11 + 21 > 30): B, the newest, is swapped out at once and
    # comes back when A has finished
    inst = InstanceSpec(cost(base=0.1), 30, decode_admission=policy)
    r = simulate_decode(inst, wl([0.0, 0.0], [10, 20], [4, 3]))
    assert r.finish.tolist() == pytest.approx([0.3, 0.5])
    assert r.preemptions == swaps


def test_decode_kv_on_demand_admits_what_a_whole_reservation_refuses() -> None:
    # 30 tokens: A (10 + 4) would reserve 14, B (15 + 3) 18: 32 > 30, so B used to wait
    # for A (B done at 0.5). On demand B joins at once: the steps need 11 + 16 = 27 and
    # 29 tokens; B makes its two tokens by 0.2, A its three by 0.3
    inst = InstanceSpec(cost(base=0.1), 30)
    r = simulate_decode(inst, wl([0.0, 0.0], [10, 15], [4, 3]))
    assert r.finish.tolist() == pytest.approx([0.3, 0.2])
    assert r.preemptions == 0


def test_decode_swaps_out_the_newest_when_the_pool_is_full() -> None:
    # 30 tokens: A (10 + 4) and B (15 + 10) both join at 0 (10 + 15 held). Steps need
    # 27 and 29 tokens; before the third (31) B, the newest, is swapped out with 3
    # tokens made; A's third step (0.3) ends it; B comes back and makes 7 more: 1.0
    inst = InstanceSpec(cost(base=0.1), 30)
    r = simulate_decode(inst, wl([0.0, 0.0], [10, 15], [4, 10]))
    assert r.finish.tolist() == pytest.approx([0.3, 1.0])
    assert r.preemptions == 1
    # the swap copies B's 17 tokens out before A's third step and back after it
    priced = InstanceSpec(cost(base=0.1), 30, swap_token_s=0.01)
    r = simulate_decode(priced, wl([0.0, 0.0], [10, 15], [4, 10]))
    assert r.finish.tolist() == pytest.approx([0.2 + 0.17 + 0.1, 0.2 + 0.17 + 0.1 + 0.17 + 0.7])


def test_decode_admission_policies_the_simulator_cannot_price_are_refused() -> None:
    with pytest.raises(PlanInputError, match="decode admission 'past-future' is not simulated"):
        InstanceSpec(cost(), 100, decode_admission=DecodeAdmission.PAST_FUTURE)


def test_decode_batch_size_cap() -> None:
    inst = InstanceSpec(cost(base=0.1), 10_000, max_batch_size=1)
    r = simulate_decode(inst, wl([0.0, 0.0, 0.0], [5, 5, 5], [3, 3, 3]))
    assert r.finish.tolist() == pytest.approx([0.2, 0.4, 0.6])


def test_disaggregated_pipeline_with_transfer_time() -> None:
    pre = InstanceSpec(cost(base=1.0, prompt_token=0.01), 10_000, 256, 512, chunked=False)
    dec = InstanceSpec(cost(base=0.1), 10_000)
    system = DisaggSystem((pre,), (dec,), kv_bytes_per_token=100, transfer_bandwidth=1000.0)
    r = simulate(system, wl([0.0, 0.0], [100, 50], [3, 1]))
    # prefill batch of both: 1 + 1.5 = 2.5; A transfers 100 * 100 / 1000 = 10 s, then 2 steps
    assert r.first_token.tolist() == pytest.approx([2.5, 2.5])
    assert r.finish.tolist() == pytest.approx([2.5 + 10 + 0.2, 2.5])  # B: one token, no decode
    assert r.tpot.tolist() == pytest.approx([(10 + 0.2) / 2, 0.0])  # TPOT holds the transfer


def test_prefill_kv_is_held_until_the_decode_side_pulls_it() -> None:
    """A prefill instance keeps a prompt's KV until the decode side's fetch ends
    (the engine's pull mode); a full pool admits no prompt meanwhile."""
    pre = InstanceSpec(cost(base=1.0), 100, 256, 512, chunked=False)
    dec = InstanceSpec(cost(base=0.1), 10_000)
    system = DisaggSystem((pre,), (dec,), kv_bytes_per_token=100, transfer_bandwidth=1000.0)
    r = simulate(system, wl([0.0, 0.0], [60, 60], [3, 3]))
    # A prefills [0, 1]; its fetch takes 6 s (60 * 100 / 1000), so B (60 + 60 > 100)
    # waits for it: [7, 8]; without holding, B would prefill [1, 2]
    assert r.first_token.tolist() == pytest.approx([1.0, 8.0])
    assert r.finish.tolist() == pytest.approx([7.2, 14.2])


def test_a_prefill_instance_full_of_held_kv_waits_for_the_decode_side_to_admit() -> None:
    """The decode side cannot admit B until A finishes, so B's KV stays on the prefill
    instance and C cannot start its prefill: the two sides are coupled."""
    pre = InstanceSpec(cost(base=1.0), 100, 256, 512, chunked=False)
    dec = InstanceSpec(cost(base=0.1), 100)
    system = DisaggSystem((pre,), (dec,), kv_bytes_per_token=1, transfer_bandwidth=math.inf)
    r = simulate(system, wl([0.0, 0.0, 0.0], [60, 60, 60], [30, 3, 3]))
    # A: [0, 1], pulled at once, decodes 29 steps: 3.9. B: [1, 2]; the decode pool holds
    # A's 60+ tokens, so B waits there until 3.9, holding 60 of the prefill's 100; C (60)
    # prefills [3.9, 4.9]. B decodes [3.9, 4.1], C [4.9, 5.1]. (Without holding: C
    # prefills [2, 3] and waits on the decode side until B ends: 4.3.)
    assert r.first_token.tolist() == pytest.approx([1.0, 2.0, 4.9])
    assert r.finish.tolist() == pytest.approx([3.9, 4.1, 5.1])


def test_decode_dispatch_goes_to_the_least_loaded_instance() -> None:
    pre = InstanceSpec(cost(base=1.0), 10_000, 256, 10, chunked=False)
    dec = InstanceSpec(cost(base=0.5), 10_000, max_batch_size=1)
    system = DisaggSystem((pre,), (dec, dec), 1, math.inf)
    r = simulate(system, wl([0.0, 0.0, 0.0], [10, 10, 10], [3, 3, 3]))
    # prefills end at 1, 2, 3; A -> decode-0, B -> decode-1, C -> decode-0 (A done at 2)
    assert r.finish.tolist() == pytest.approx([2.0, 3.0, 4.0])


def test_lazy_load_queries_change_no_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch advances a decode instance only when the step in progress may finish a
    request; advancing every instance at every dispatch gives the same timeline."""
    from pdserve.planner import simulator

    rng = np.random.default_rng(7)
    n = 3000
    w = wl(
        np.cumsum(rng.exponential(0.02, n)).tolist(),
        rng.integers(1, 200, n).tolist(),
        rng.integers(1, 120, n).tolist(),
    )
    pre = InstanceSpec(cost(base=0.01, prompt_token=1e-4), 10_000, 64, 512, chunked=False)
    dec = InstanceSpec(cost(base=0.02, decode_token=1e-3, context_token=1e-6, knee=3), 6_000, 32)
    system = DisaggSystem((pre,) * 3, (dec,) * 4, kv_bytes_per_token=100, transfer_bandwidth=1e6)
    lazy = simulate(system, w)

    def eager(self: simulator._Decode, now: float) -> int:
        self.advance_to(now)
        return self.unfinished

    monkeypatch.setattr(simulator._Decode, "load_at", eager)
    every = simulate(system, w)
    # the same dispatch choices and step boundaries (fewer, longer jumps: rounding only;
    # first tokens too, since held KV couples the prefill side to the decode side's pulls)
    assert np.allclose(lazy.finish, every.finish, rtol=0, atol=1e-9)
    assert np.allclose(lazy.first_token, every.first_token, rtol=0, atol=1e-9)
    assert lazy.tpot.mean() > 0.02  # decodes did queue and batch


# ---- colocated -------------------------------------------------------------------------


def test_colocated_chunked_steps_mix_prompts_and_decodes() -> None:
    c = cost(base=1.0, prompt_token=0.01, decode_token=0.1)
    inst = InstanceSpec(c, 10_000, 64, 100, chunked=True)
    r = simulate(ColocatedSystem((inst,)), wl([0.0, 4.0], [150, 50], [3, 2]))
    # A: 100 (2.0), 50 (1.5) -> first 3.5; decode (1.1) -> 4.6; B joins: A decode + B 50
    # (1.6) -> 6.2 = A's finish and B's first token; B decode (1.1) -> 7.3
    assert r.first_token.tolist() == pytest.approx([3.5, 6.2])
    assert r.finish.tolist() == pytest.approx([6.2, 7.3])


def test_colocated_prompt_cap_while_decoding() -> None:
    """The engine's prompt cap (max_prefill_tokens_with_decodes): beside a decode, a step
    takes at most 20 prompt tokens; with nothing decoding, the whole budget."""
    c = cost(base=1.0, prompt_token=0.01, decode_token=0.1)
    inst = InstanceSpec(c, 10_000, 64, 100, chunked=True, prompt_cap=20)
    r = simulate(ColocatedSystem((inst,)), wl([0.0, 4.0], [150, 50], [3, 2]))
    # A: 100 (2.0), 50 (1.5) -> 3.5 (nothing decodes: no cap); decode (1.1) -> 4.6;
    # A decode + B's first 20 (1.3) -> 5.9 = A's finish; B's last 30 alone (1.3) -> 7.2;
    # B decode (1.1) -> 8.3
    assert r.first_token.tolist() == pytest.approx([3.5, 7.2])
    assert r.finish.tolist() == pytest.approx([5.9, 8.3])


def test_a_prompt_cap_below_one_is_refused() -> None:
    with pytest.raises(PlanInputError, match=r"prompt_cap must be >= 1 \(or None\), got 0"):
        InstanceSpec(cost(), 100, prompt_cap=0)


def test_colocated_decodes_under_the_knee_ride_along() -> None:
    c = cost(base=1.0, prompt_token=0.01, decode_token=0.1, knee=2)
    inst = InstanceSpec(c, 10_000, 64, 100, chunked=True)
    r = simulate(ColocatedSystem((inst,)), wl([0.0, 4.0], [150, 50], [3, 2]))
    # as above, but a lone decode row is under the knee: A decodes (1.0) -> 4.5; A's
    # decode row beside B's 50 prompt rows is past it (1 + 0.5 + 0.1) -> 6.1; B (1.0) -> 7.1
    assert r.first_token.tolist() == pytest.approx([3.5, 6.1])
    assert r.finish.tolist() == pytest.approx([6.1, 7.1])


def test_colocated_prefill_first_pauses_decodes() -> None:
    c = cost(base=1.0, prompt_token=0.01, decode_token=0.1)
    inst = InstanceSpec(c, 10_000, 64, 100, chunked=False)
    r = simulate(ColocatedSystem((inst,)), wl([0.0, 2.5], [50, 50], [3, 2]))
    # A prefill 1.5; decode 1.1 -> 2.6; B prefill-only step 1.5 -> 4.1; then A and B decode
    # together (1.2) -> 5.3: A's second decode token and B's only one
    assert r.first_token.tolist() == pytest.approx([1.5, 4.1])
    assert r.finish.tolist() == pytest.approx([5.3, 5.3])


# ---- the closed-form jumps against a naive step-by-step loop ----------------------------


def naive_decode(
    c: StepCost, cap: int, max_batch: int, w: SimWorkload, speed: Any = None
) -> np.ndarray:
    """One step at a time, as the engine's decode side (greedy admission): at each
    boundary admit arrived requests FCFS while a slot is free and the prompt's KV fits
    beside what the batch holds (inp + generated - 1 each); a step needs one more slot
    per request: while the pool cannot give them, swap out the newest; if nothing was
    swapped out, swap back the oldest while they fit; then run a step of the batch
    (priced at `speed.at(its start)`). Swapped requests keep their slot."""
    arr, inp, out = w.arrivals.tolist(), w.input_lens.tolist(), w.output_lens.tolist()
    finish = [0.0] * len(arr)
    pending = [i for i in range(len(arr)) if out[i] > 1]
    for i in range(len(arr)):
        if out[i] == 1:
            finish[i] = arr[i]
    running: dict[int, int] = {}  # rid -> tokens generated so far, oldest join first
    swapped: list[tuple[int, int]] = []  # (rid, generated), oldest first
    t = 0.0
    while pending or running or swapped:
        held = sum(inp[i] + g - 1 for i, g in running.items())
        while pending and arr[pending[0]] <= t and len(running) + len(swapped) < max_batch:
            i = pending[0]
            if held + inp[i] > cap:
                break
            pending.pop(0)
            running[i] = 1
            held += inp[i]
        preempted = False
        while running and sum(inp[i] + g for i, g in running.items()) > cap:
            i = list(running)[-1]
            swapped.append((i, running.pop(i)))
            preempted = True
        while swapped and (not preempted or not running):
            i, g = swapped[0]
            if sum(inp[j] + h for j, h in running.items()) + inp[i] + g > cap:
                break
            swapped.pop(0)
            running[i] = g
        if not running:
            t = max(t, arr[pending[0]])
            continue
        ctx = sum(inp[i] + g for i, g in running.items())
        rows = max(0, len(running) - c.knee)
        dt = c.stages * c.base + (c.stages - 1) * c.hop_fixed
        dt += c.decode_token * rows + c.decode_comm * len(running)
        dt += c.context_token * ctx
        t += dt * (speed.at(t) if speed is not None else 1.0)
        for i in list(running):
            running[i] += 1
            if running[i] == out[i]:
                finish[i] = t
                del running[i]
    return np.array(finish)


def random_decodes(seed: int, n: int = 60) -> SimWorkload:
    rng = np.random.default_rng(seed)
    return wl(
        np.cumsum(rng.exponential(0.05, n)).tolist(),
        rng.integers(1, 50, n).tolist(),
        rng.integers(1, 40, n).tolist(),
    )


@pytest.mark.parametrize("seed", range(6))
def test_jumps_match_the_naive_loop(seed: int) -> None:
    w = random_decodes(seed)
    c = cost(
        base=0.01,
        decode_token=0.002,
        context_token=1e-4,
        stages=1 + seed % 2,
        knee=2 * (seed % 3),  # 0, 2, 4
        decode_comm=1e-4 * (seed % 2),
        hop_fixed=3e-3 * (seed % 2),  # two stages: one hand-off a step
    )
    cap, batch = 400 + 50 * seed, 4 + seed
    got = simulate_decode(InstanceSpec(c, cap, max_batch_size=batch), w)
    assert np.allclose(got.finish, naive_decode(c, cap, batch, w), rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_on_demand_kv_and_swapping_match_the_naive_loop(seed: int) -> None:
    """A pool too small for the batch's growth: requests are swapped out and back."""
    w = random_decodes(seed)
    c = cost(base=0.01, decode_token=0.002, context_token=1e-4, knee=2 * (seed % 3))
    cap = 100 + 20 * seed
    got = simulate_decode(InstanceSpec(c, cap, max_batch_size=8), w)
    assert got.preemptions > 0
    assert np.allclose(got.finish, naive_decode(c, cap, 8, w), rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_jumps_with_speed_noise_match_the_naive_loop(seed: int) -> None:
    """Every step is priced at the speed factor of its start, also in long jumps."""
    from pdserve.planner.simulator import SpeedNoise, _Speed

    w = random_decodes(seed)
    c = cost(base=0.01, decode_token=0.002, context_token=1e-4, knee=2 * (seed % 2))
    noise = SpeedNoise(sigma=0.3, interval_s=0.07, seed=seed)
    got = simulate_decode(InstanceSpec(c, 500, max_batch_size=6), w, noise)
    want = naive_decode(c, 500, 6, w, _Speed(noise))
    assert np.allclose(got.finish, want, rtol=0, atol=1e-9)
    plain = simulate_decode(InstanceSpec(c, 500, max_batch_size=6), w)
    assert not np.allclose(got.finish, plain.finish)  # the factors did change the steps


def test_speed_noise_spreads_tpot_around_the_same_mean() -> None:
    """At a light load every request's TPOT is the same step time without noise; with
    it they spread, with the same mean (the factors have mean 1)."""
    from pdserve.planner.simulator import SpeedNoise

    n = 400
    w = wl([5.0 * i for i in range(n)], [100] * n, [40] * n)  # one request at a time
    inst = InstanceSpec(cost(base=0.05, prompt_token=1e-4), 10_000, 64, 512)
    plain = simulate(ColocatedSystem((inst,)), w)
    assert np.allclose(plain.tpot, 0.05)
    noisy = simulate(ColocatedSystem((inst,)), w, SpeedNoise(0.2, 10.0, seed=1))
    assert noisy.tpot.std() > 0.005
    assert noisy.tpot.mean() == pytest.approx(0.05, rel=0.03)
    with pytest.raises(PlanInputError) as exc:
        SpeedNoise(0.1, 0)
    assert str(exc.value) == "speed noise needs sigma >= 0 and interval_s > 0, got 0.1, 0"


# ---- queueing theory -----------------------------------------------------------------------


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_non_batching_prefill_is_an_md1_queue(rho: float) -> None:
    d = 0.1
    rate = rho / d
    n = 200_000
    rng = np.random.default_rng(11)
    w = wl(np.cumsum(rng.exponential(1 / rate, n)).tolist(), [100] * n, [1] * n)
    r = simulate_prefill(InstanceSpec(cost(base=d), 10**9, 1, 100, chunked=False), w)
    expected = d + rate * d * d / (2 * (1 - rate * d))  # DistServe eq. 1
    assert r.ttft.mean() == pytest.approx(expected, rel=0.025)
    assert r.utilization["prefill-0"] == pytest.approx(rho, rel=0.02)


def test_two_stage_pipeline_matches_distserve_eq2() -> None:
    d, rate, n = 0.1, 12.0, 200_000  # D_m = d / 2 per stage; R * D_m = 0.6
    rng = np.random.default_rng(5)
    w = wl(np.cumsum(rng.exponential(1 / rate, n)).tolist(), [100] * n, [1] * n)
    inst = InstanceSpec(cost(base=d / 2, stages=2), 10**9, 1, 100, chunked=False)
    r = simulate_prefill(inst, w)
    expected = d + rate * d * d / (4 * (2 - rate * d))  # eq. 2
    assert r.ttft.mean() == pytest.approx(expected, rel=0.025)


# ---- the front end --------------------------------------------------------------------------


def test_tokens_reach_the_client_through_a_fifo_front_end() -> None:
    """The colocated timeline above (A's tokens made at 3.5, 4.85, 6.2, B's at 6.2, 7.3)
    through a front end of 1 s a token: they leave at 4.5, 5.85, 7.2 (A), 8.2, 9.2 (B;
    A's last token, made at the same time, first). A front end of 0 s changes nothing."""
    c = cost(base=1.0, prompt_token=0.01, decode_token=0.1)
    system = ColocatedSystem((InstanceSpec(c, 10_000, 64, 100, chunked=True),))
    w = wl([0.0, 4.0], [150, 50], [3, 2])
    r = simulate(system, w, frontend=FrontEnd(1.0))
    assert r.first_token.tolist() == pytest.approx([4.5, 8.2])
    assert r.finish.tolist() == pytest.approx([7.2, 9.2])
    assert r.ttft.tolist() == pytest.approx([4.5, 4.2])
    assert r.tpot.tolist() == pytest.approx([1.35, 1.0])
    assert r.utilization["frontend"] == pytest.approx(5 / 9.2)
    free = simulate(system, w, frontend=FrontEnd(0.0))
    plain = simulate(system, w)
    assert free.first_token.tolist() == plain.first_token.tolist() == pytest.approx([3.5, 6.2])
    assert free.finish.tolist() == plain.finish.tolist()


def test_a_front_end_under_poisson_tokens_is_an_md1_queue() -> None:
    """One-token requests on an instance that costs nothing: the front end alone, an
    M/D/1 queue at 80% busy (TTFT = its service time + eq. 1's wait)."""
    c, rho, n = 0.001, 0.8, 200_000
    rate = rho / c
    rng = np.random.default_rng(3)
    w = wl(np.cumsum(rng.exponential(1 / rate, n)).tolist(), [1] * n, [1] * n)
    system = ColocatedSystem((InstanceSpec(cost(base=0.0), 10**9, 10**6, 10**6),))
    r = simulate(system, w, frontend=FrontEnd(c))
    assert r.ttft.mean() == pytest.approx(c + rho * c / (2 * (1 - rho)), rel=0.025)
    assert r.utilization["frontend"] == pytest.approx(rho, rel=0.02)


def test_a_saturated_front_end_delays_every_token_more_than_the_last() -> None:
    """Tokens offered at 1.25x what the front end serves (every 0.8 s, 1 s each): the
    k-th leaves at k + 1, so its wait grows by 0.2 s a request, without bound."""
    n = 50
    w = wl([0.8 * k for k in range(n)], [1] * n, [1] * n)
    system = ColocatedSystem((InstanceSpec(cost(base=0.0), 10**9, 10**6, 10**6),))
    r = simulate(system, w, frontend=FrontEnd(1.0))
    assert r.ttft.tolist() == pytest.approx([1 + 0.2 * k for k in range(n)])
    with pytest.raises(PlanInputError) as exc:
        FrontEnd(-1.0)
    assert str(exc.value) == "front end seconds per token must be >= 0, got -1.0"


# ---- workloads and bad input -------------------------------------------------------------


def test_sample_workload_draws_what_pdserve_bench_sends() -> None:
    from pdserve.bench.config import ArrivalConfig
    from pdserve.bench.tokens import PromptFactory, load_tokenizer
    from pdserve.bench.workloads import WorkloadOptions, build_workload
    from pdserve.workload.arrivals import unit_offsets

    bench = build_workload(
        WorkloadOptions(name="chatbot", num_prompts=40, seed=7), PromptFactory(load_tokenizer(None))
    )
    w = sample_workload("chatbot", 40, 2.0, seed=7)
    assert w.input_lens.tolist() == [bench.turn(i).num_tokens for i in range(40)]
    assert w.output_lens.tolist() == [bench.turn(i).output_len for i in range(40)]
    assert np.array_equal(w.arrivals, unit_offsets(40, ArrivalConfig(), 7) / 2.0)
    assert np.allclose(w.with_rate(4.0).arrivals, w.arrivals / 2)


@pytest.mark.parametrize("name", ["chatbot", "summarization", "HPLD", "mixed"])
def test_planner_and_bench_draw_lengths_through_one_function(name: str) -> None:
    """Equal draws by construction: both call `pdserve.workload.profiles.draw_lengths`."""
    import pdserve.planner.workload as planner_workload
    from pdserve.bench.workloads import synthetic
    from pdserve.workload.profiles import draw_lengths, find_profile

    assert synthetic.draw_lengths is draw_lengths is planner_workload.draw_lengths
    profile = find_profile(name)
    assert profile is not None
    for seed in (0, 5, 123):
        drawn = draw_lengths(profile, 30, seed)
        w = sample_workload(name.lower(), 30, 1.0, seed)
        assert w.input_lens.tolist() == drawn.inputs
        assert w.output_lens.tolist() == drawn.outputs


def test_trace_files_are_resampled_and_malformed_ones_refused(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl"
    good.write_text(
        "\n".join(
            f'{{"input_len": {10 * i + 1}, "output_len": {i + 1}, "arrival_time": {0.5 * i}}}'
            for i in range(5)
        )
    )
    fit = fit_trace(good)
    assert fit.rate == pytest.approx(2.0)
    w = sample_workload(str(good), 100, 3.0, seed=1)
    pairs = set(zip(w.input_lens.tolist(), w.output_lens.tolist(), strict=True))
    assert pairs <= {(10 * i + 1, i + 1) for i in range(5)}
    for text, message in [
        ('{"input_len": 5}', "'output_len' must be an integer >= 1"),
        ('{"prompt": "hi", "output_len": 3}', "needs 'input_len'"),
        ("not json", "not JSON"),
        ('{"input_len": 5, "output_len": 2, "arrival_time": -1}', "'arrival_time' must be"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(PlanInputError, match=message):
            fit_trace(bad)


def test_requests_that_can_never_fit_are_refused() -> None:
    inst = InstanceSpec(cost(), 100)
    with pytest.raises(PlanInputError, match="request 1 needs 130 KV tokens"):
        simulate(ColocatedSystem((inst,)), wl([0.0, 0.0], [10, 120], [5, 10]))
    with pytest.raises(PlanInputError, match="has no requests"):
        wl([], [], [])
    with pytest.raises(PlanInputError, match="unknown workload 'nope'"):
        sample_workload("nope", 10, 1.0)
