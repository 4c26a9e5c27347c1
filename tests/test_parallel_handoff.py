"""The KV hand-off between parallel instances of different layouts (issue 54, item 2;
docs/parallelism.md), on the shipped SmolLM2 (Q4_1; 30 layers, 3 KV heads: at TP 2 one
rank holds KV heads 0-1, the other 2; at PP 2 each stage 15 layers).

Engine level: a prefill core and a decode core in this process (tests/helpers/pairs.py's
router plays the controller), one of them parallel - its worker ranks real processes
computing in the shared-memory pools their driver made - with block sizes that differ,
in each transfer mode. Every request's text equals a colocated one-process core's, and
the KV the decode instance holds for each prompt equals, bit for bit, the KV the prefill
instance held when it handed the request off: each rank's pool gathered into the layers
and heads it holds, every element from exactly one rank (`instance_kv`). Every side takes
fp32 activations (`exact_engine`'s): what a deployment with a tensor-parallel instance
serves by default.

Served: a prefill TP 2 -> decode PP 2 cluster started from a placement file, and a
`--prefill-pp 2 --decode-tp 2` one from flags, answer as the undisturbed colocated engine
does; and a decode instance of TP 2 whose worker rank is SIGKILLed mid-stream fails as
one instance - its requests move to the other decode instance and end with the
undisturbed text, no rank process or segment is left.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
from helpers.pairs import Router, assert_clean, colocated_outputs, make_core
from helpers.reference import run
from helpers.server import Server, cluster, row_of, wait_clean, wait_dead, wait_for
from helpers.streams import Streams
from test_fault_tolerance import assert_identical, bodies

from pdserve.config import CacheConfig, EngineConfig, Role, SchedulerConfig, TransferConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.engine import Engine, build_core, load_model, start_ranks
from pdserve.model.source import resolve_model
from pdserve.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Count on: " + ", ".join(str(i) for i in range(30)),
    "1, 2, 3, 4,",
]


def parallel_core(
    role: Role, tp: int, pp: int, mode: str, block_size: int, swap: int = 0
) -> EngineCore:
    """A `role` core of tp x pp ranks (this process the driver) over the shipped model,
    moving KV through shared memory (`swap`: its stages' microbatch swapping staging
    blocks, over sequences of at most 128 tokens)."""
    config = EngineConfig(
        role=role,
        instance_name=f"{role.value}-tp{tp}-pp{pp}",
        num_threads=tp * pp,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        activations="fp32",  # exact_engine's, which the one-process side shares
        microbatch_swap_blocks=swap,
        max_model_len=128 if swap else None,
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=64),
        cache=CacheConfig(block_size=block_size, num_blocks=256, num_host_blocks=64),
        transfer=TransferConfig(mode=mode, transport="shm"),  # type: ignore[arg-type]
    )
    ranks = start_ranks(config)
    assert ranks is not None
    return build_core(config, load_model(config, ranks.shard), [], ranks)


OneProcess = tuple[list[list[int]], dict[str, list[int]]]


@pytest.fixture(scope="module")
def one_process(exact_engine: Engine) -> OneProcess:
    """TEXTS' token ids and each one's greedy tokens by a colocated one-process core."""
    model, path = exact_engine.core.model, resolve_model(None)
    batch = [exact_engine.tokenizer.encode(t) for t in TEXTS]
    return batch, colocated_outputs(make_core(path, model, Role.COLOCATED), batch, GREEDY)


def hand_off(prefill: EngineCore, decode: EngineCore, mode: str, one: OneProcess) -> None:
    """Every prompt through `prefill` to `decode` in `mode`: no failure, one process's
    tokens, the decode instance's KV for each prompt the prefill instance's at its
    hand-off bit for bit, both pools clean after."""
    batch, reference = one
    router = Router(prefill, decode, mode, batch, GREEDY)
    router.run()
    assert router.failures == {}
    assert router.tokens == reference
    assert router.kv_equal == {f"r{i}": True for i in range(len(batch))}
    assert_clean(prefill, decode)


@pytest.fixture
def threads() -> Iterator[None]:
    """A parallel core's driver sets this process's torch threads (one a rank): put them
    back for the tests that run after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# (prefill tp, pp, block), (decode tp, pp, block), transfer mode: a parallel prefill
# instance pushing layer by layer (its driver's layers as they run, its worker's after the
# step), parallel decode instances pulling and pushed to, block sizes both ways.
HANDOFFS = [
    ((2, 1, 16), (1, 1, 32), "layer-push"),
    ((1, 2, 32), (1, 1, 16), "layer-push"),
    ((1, 1, 32), (1, 2, 16), "pull"),
    ((1, 1, 16), (2, 1, 32), "request-push"),
]


@pytest.mark.parametrize(
    ("prefill", "decode", "mode"),
    HANDOFFS,
    ids=[f"P{p}-D{d}-{m}".replace(" ", "") for p, d, m in HANDOFFS],
)
def test_a_parallel_instance_hands_kv_to_another_layout(
    exact_engine: Engine,
    one_process: OneProcess,
    threads: None,
    prefill: tuple[int, int, int],
    decode: tuple[int, int, int],
    mode: str,
) -> None:
    model, path = exact_engine.core.model, resolve_model(None)
    sides: list[EngineCore] = []
    try:
        for role, (tp, pp, block) in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            if tp * pp > 1:
                sides.append(parallel_core(role, tp, pp, mode, block))
            else:
                sides.append(make_core(path, model, role, mode, "shm", block))
        hand_off(sides[0], sides[1], mode, one_process)
    finally:
        for core in sides:
            core.close()


@pytest.mark.parametrize(("tp", "pp", "swap"), [(2, 1, 0), (1, 2, 16)], ids=["tp2", "pp2-swap"])
def test_a_colocated_parallel_instance_flips_to_prefill_with_its_cache(
    exact_engine: Engine, one_process: OneProcess, threads: None, tp: int, pp: int, swap: int
) -> None:
    """A colocated TP 2 (or PP 2 swapping its micro-batches) instance keeps its pools
    private until its first hand-off: the flip to prefill opens its link, and its worker
    copies its pool into the shared-memory region the driver made before the driver goes
    on (`RankGroup.link`). The prompts it cached as a colocated instance are then hits
    whose KV - both ranks' - reaches a decode instance intact: one process's text again,
    the KV bit for bit. With swapping, each stage's staging copies from and writes back
    to the pool where it now is (a stage that kept the private pool would hand off stale
    KV)."""
    model, path = exact_engine.core.model, resolve_model(None)
    batch, reference = one_process
    sides = [parallel_core(Role.COLOCATED, tp, pp, "pull", 16, swap)]
    try:
        core = sides[0]
        assert colocated_outputs(core, batch, GREEDY) == reference
        assert core.link is None
        hits = core.kv.prefix_cache_hits
        core.switch_role(Role.PREFILL)
        assert core.link is not None and len(core.link.regions) == 2
        sides.append(make_core(path, model, Role.DECODE, "pull", "shm", 32))
        hand_off(core, sides[1], "pull", one_process)
        assert core.kv.prefix_cache_hits > hits
        stage = core.runner.stage
        staged = 0 if stage is None or stage.swap is None else stage.swap.peak_blocks
        assert 0 < staged <= swap if swap else staged == 0, staged
    finally:
        for c in sides:
            c.close()


def load() -> list[dict]:
    """The fault-tolerance workload's first 12 requests, greedy, 48 tokens: a tensor-
    parallel rank's logits are one process's within 1e-4 (the sums' order), which a greedy
    token does not notice but a seeded draw near a boundary may."""
    return [{**b, "temperature": 0, "max_tokens": 48} for b in bodies()[:12]]


@pytest.fixture(scope="module")
def reference(exact_engine: Engine) -> list:
    """The servers below each hold a tensor-parallel instance: under the default
    activations (`auto`) the whole deployment serves fp32 (config.py
    `deployment_activations`), `exact_engine`'s."""
    return run(exact_engine, load())


def test_served_prefill_tp2_to_decode_pp2_answers_as_one_engine(
    start: Callable[..., Server], reference: list, tmp_path: Path
) -> None:
    """Started from a placement (`serve --placement`, this machine: node 0) that names
    each instance's devices (threads) and ranks; the decode pipeline's stages swap their
    micro-batches (DéjàVu) through 32-block staging areas - every block lives in the pool
    the prefill instance's KV arrives in, moved into shared memory at the first hand-off
    - while the one-stage prefill instance takes no staging. The 12 streams hold up to 59
    blocks at the decode instance (ceil((prompt + 48) / 16) each), its driver's stage at
    most the 32 of its staging area."""
    placement = tmp_path / "placement.json"
    instances = [
        {"role": "prefill", "node": 0, "devices": 2, "tp": 2, "pp": 1},
        {"role": "decode", "node": 0, "devices": 2, "tp": 1, "pp": 2},
    ]
    placement.write_text(json.dumps({"instances": instances}))
    server = start(
        "--placement", str(placement), "--microbatch-swap-blocks", "32",
        "--max-model-len", "256",
    )  # fmt: skip
    assert_identical(Streams(server.url, load()).results(), reference)
    status = cluster(server)
    layouts = {
        r["name"]: (r["tensor_parallel_size"], r["pipeline_parallel_size"])
        for r in status["instances"]
    }
    assert layouts == {"prefill-0": (2, 1), "decode-0": (1, 2)}
    staged = {r["name"]: r["stats"]["staged_peak_blocks"] for r in status["instances"]}
    assert staged["prefill-0"] == 0 and 0 < staged["decode-0"] <= 32, staged
    counters = status["controller"]
    assert (counters["migrations"], counters["retries"], counters["failed"]) == (0, 0, 0)
    wait_clean(server)


def test_a_killed_rank_of_a_tp2_decode_instance_moves_its_requests(
    start: Callable[..., Server], reference: list
) -> None:
    """`--prefill-pp 2 --decode-tp 2 --kv-replication`, two decode instances replicating
    to each other (DéjàVu): the answers are one engine's; then decode-0's worker rank is
    SIGKILLed once every stream has 8 tokens. decode-0 fails as one instance (its driver
    names the rank and exits), its requests move to decode-1 and end with the undisturbed
    text, every one resumed from its replica - which decode-0's two ranks wrote, each its
    KV heads, into decode-1's store, and which decode-1 copied into both its ranks' pools
    - and no rank process of decode-0 is left."""
    server = start(
        "--prefill", "1", "--decode", "2", "--prefill-pp", "2", "--decode-tp", "2",
        "--num-threads", "6", "--instance-timeout", "30", "--kv-replication",
    )  # fmt: skip
    assert_identical(Streams(server.url, load()).results(), reference)
    driver = psutil.Process(row_of(server, "decode-0")["pid"])
    (worker,) = [p for p in driver.children() if "worker_entry" in " ".join(p.cmdline())]
    streams = Streams(server.url, load())
    streams.wait_tokens(8)
    held = row_of(server, "decode-0")["assigned_requests"]
    os.kill(worker.pid, signal.SIGKILL)
    reason = wait_dead(server, "decode-0")
    assert reason == (
        f"engine step failed: RankFailed: rank 1 (pid {worker.pid}) of this instance exited "
        "with signal SIGKILL"
    )
    assert_identical(streams.results(), reference)
    counters = cluster(server)["controller"]
    assert counters["instance_failures"] == {"decode": 1}, counters
    assert counters["failed"] == 0 and counters["migrations"] >= held > 0, (counters, held)
    assert counters["resumed_from_replica"] == counters["migrations"], counters
    wait_for(lambda: not driver.is_running() or driver.status() == psutil.STATUS_ZOMBIE)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    wait_clean(server, every_role=False)
