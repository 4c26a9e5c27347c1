"""Tensor parallelism inside an instance (pdserve/parallel): each rank a real process
holding its shard (its GQA groups' heads, its intermediate columns) and its own KV, the
partial outputs summed over a gloo process group. Every step's logits on rank 0 equal
one process's whole model within 1e-4 (fp32; the sums' order differs) and give the same
greedy tokens: tiny models of each architecture (heads that divide the ranks and heads
that do not) and the shipped SmolLM2 (9 query heads in 3 groups: 6 + 3 at T = 2), its
fp32 weights and its Q4_1 blocks."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from helpers.forward import run_steps, workload
from helpers.reference import greedy, run
from helpers.server import Server, segments_left, wait_for
from helpers.tiny_models import make_tiny_model
from test_quant_model import run_cli, run_clis
from test_server import sse

from pdserve.config import CacheConfig, EngineConfig, PreemptionMode, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.mb_swap import stage_swap
from pdserve.engine.pipeline import Part, microbatches
from pdserve.model.attention import SeqSpec
from pdserve.model.config import ModelConfig
from pdserve.model.quantization import Quantization, resolve_quantization
from pdserve.model.source import load_config, resolve_model
from pdserve.parallel import group
from pdserve.parallel.layout import Shard, check_ranks_fit, split_model
from pdserve.parallel.shard import load_shard
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.quant.formats import QuantType, QuantWeight

TOL = 1e-4


def _rank(rank: int, tp: int, pp: int, port: int, models: list[tuple[str, str]], out: str) -> None:
    torch.set_num_threads(1)
    group.join(rank, tp * pp, port, tp=tp)
    try:
        results = []
        for path, quant in models:
            shard = split_model(load_config(path), tp, pp)[rank]
            quantization = resolve_quantization(quant, path) if quant != "none" else Quantization()
            model = load_shard(path, shard, quantization=quantization)
            if tp > 1:
                model.set_reduce(group.all_reduce_sum)
            results.append(run_steps(model, workload(model.config.vocab_size), shard=shard))
        if rank == 0:
            torch.save(results, out)
    finally:
        group.leave()


def _rank_server(rank: int, jobs: mp.Queue, done: mp.Queue) -> None:
    """A rank process of the module's pool: runs `_rank` for each job it is given (a
    fresh group each time: `group.leave` ends the last), until told to stop (None)."""
    while (job := jobs.get()) is not None:
        try:
            _rank(rank, *job)
            done.put((rank, None))
        except BaseException as e:  # reported to the test, which fails
            done.put((rank, repr(e)))


RankPool = tuple[list[mp.Queue], mp.Queue]


@pytest.fixture(scope="module")
def rank_pool() -> Iterator[RankPool]:
    """Four rank processes for the logits tests (spawned once: each start imports torch,
    seconds of the suite's two cores per process)."""
    ctx = mp.get_context("spawn")
    jobs, done = [ctx.Queue() for _ in range(4)], ctx.Queue()
    procs = [ctx.Process(target=_rank_server, args=(r, jobs[r], done)) for r in range(4)]
    for p in procs:
        p.start()
    yield jobs, done
    for q in jobs:
        q.put(None)
    for p in procs:
        p.join(30)
        if p.exitcode is None:
            p.kill()


def parallel_logits(
    pool: RankPool, models: list[tuple[Path, str]], tmp_path: Path, tp: int, pp: int = 1
) -> list:
    """Rank 0's logits of `workload` with each (model, quantization) split over `tp` x
    `pp` ranks, each rank a process of the pool."""
    jobs, done = pool
    out, port = tmp_path / f"tp{tp}pp{pp}.pt", group.free_port()
    args = [(str(path), quant) for path, quant in models]
    for r in range(tp * pp):
        jobs[r].put((tp, pp, port, args, str(out)))
    errors = [done.get(timeout=300) for _ in range(tp * pp)]
    assert [e for _, e in errors if e is not None] == []
    return torch.load(out)


@functools.cache
def whole_logits(path: Path, quant: str = "none") -> list:
    """One process's logits of the workload (a model's are computed once a session: the
    shipped model's are every layout's reference). Read only."""
    quantization = resolve_quantization(quant, path) if quant != "none" else Quantization()
    shard = split_model(load_config(path), 1)[0]
    model = load_shard(path, shard, quantization=quantization)
    return run_steps(model, workload(model.config.vocab_size))


def assert_same(got: list, want: list, tol: float = TOL, case: str = "") -> None:
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < tol, case
        assert torch.equal(g.argmax(-1), w.argmax(-1)), case


CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-bias-tied": ("LlamaForCausalLM", {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 7}),
    # 3 KV groups of 2 query heads on 2 ranks: 2 groups and 1 (the heads do not divide)
    "llama-uneven": (
        "LlamaForCausalLM",
        {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
    ),
}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_ranks_give_the_whole_models_logits(
    rank_pool: RankPool, tmp_path: Path, tp: int, pp: int
) -> None:
    """Each architecture's tiny model (CASES) on tp x pp ranks: one process's logits.
    Stages alone (tp = 1) give its bits: the workload's micro-batches cut a prefill chunk
    (12 rows: 6 + 6) and a decode batch, and each row's bits do not depend on its batch."""
    paths = {c: make_tiny_model(tmp_path, arch, **kw) for c, (arch, kw) in CASES.items()}
    split = parallel_logits(rank_pool, [(p, "none") for p in paths.values()], tmp_path, tp, pp)
    for (case, path), got in zip(paths.items(), split, strict=True):
        want = whole_logits(path)
        assert_same(got, want, case=case)
        if tp == 1:
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), case


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_the_shipped_model_on_parallel_ranks(
    rank_pool: RankPool, tmp_path: Path, tp: int, pp: int
) -> None:
    """SmolLM2 fp32 and Q4_1: its logits reach ~20 and its residual stream passes 30
    layers of partial sums, so within 1e-5 of the largest logit (1.09e-4 measured at
    worst, fp32, T = 2); stages alone give its bits."""
    path = resolve_model(None)
    split = parallel_logits(rank_pool, [(path, "none"), (path, "gguf")], tmp_path, tp, pp)
    for quant, got in zip(["none", "gguf"], split, strict=True):
        want = whole_logits(path, quant)
        scale = max(w.abs().max().item() for w in want)
        assert 10 < scale < 40
        assert_same(got, want, 1e-5 * scale, case=quant)
        if tp == 1:
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), quant


def smollm2_config() -> ModelConfig:
    return load_config(resolve_model(None))


def test_smollm2_splits_into_whole_groups() -> None:
    assert split_model(smollm2_config(), 2) == [
        Shard(0, 2, (0, 30), (0, 6), (0, 2), (0, 768), tp=2),
        Shard(1, 2, (0, 30), (6, 9), (2, 3), (768, 1536), tp=2),
    ]
    assert [s.intermediate for s in split_model(smollm2_config(), 3)] == [
        (0, 512),
        (512, 1024),
        (1024, 1536),
    ]


def test_splits_that_cannot_be_made() -> None:
    with pytest.raises(ValueError) as e:
        split_model(smollm2_config(), 4)
    assert str(e.value) == (
        "--tensor-parallel-size 4 is more than the model's 3 KV heads: each rank holds whole "
        "GQA groups (a KV head and its query heads)"
    )
    with pytest.raises(ValueError, match="at least 1, got 0"):
        split_model(smollm2_config(), 0)
    with pytest.raises(ValueError) as e:
        split_model(smollm2_config(), 1, 31)
    assert str(e.value) == (
        "--pipeline-parallel-size 31 is more than the model's 30 layers: each stage holds at "
        "least one"
    )


def test_quantized_columns_are_whole_blocks() -> None:
    w = torch.randn(8, 128)
    for qtype in (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0):
        q = QuantWeight.quantize(w, qtype)
        assert torch.equal(q.columns(32, 96).dequantize(), q.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match=r"columns \[16, 96\) of a \[8, 128\] weight"):
        QuantWeight.quantize(w, QuantType.Q8_0).columns(16, 96)


BODY = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
]


LONG_PROMPT = "Count on: " + ", ".join(str(i) for i in range(50))


def rank_processes() -> list[psutil.Process]:
    """This process's tensor-parallel worker ranks, and its servers' (any depth)."""
    me = psutil.Process()
    return [p for p in me.children(recursive=True) if "worker_entry" in " ".join(p.cmdline())]


@pytest.mark.parametrize("tp,pp,blocks", [(2, 1, 24), (1, 2, 24), (2, 2, None)])
def test_an_engine_on_parallel_ranks_generates_the_whole_engines_text(
    served_engine: Engine, exact_engine: Engine, tp: int, pp: int, blocks: int | None
) -> None:
    """An engine of tp x pp ranks (the default quantized weights, split): the greedy text
    of one process's engine, token for token, a long prompt's prefill (over 2 x
    MIN_PART_ROWS rows) cut into micro-batches; its worker ranks leave with it. With a pool
    too small for the load (24 blocks) requests are preempted by swapping their KV to the
    host tier and back - on every rank: the driver's swap plans run on the workers' pools,
    each of its own heads and layers - and the texts are still one big-pool engine's: with
    the default activations, `served_engine`'s where no rank is tensor-parallel (int8
    where it runs: the stages' logits are one process's bit for bit) and `exact_engine`'s
    (fp32) where one is (config.py `deployment_activations`)."""
    # 4 ranks on a 2-core machine: asked for with the threads (check_ranks_fit)
    config = EngineConfig(
        num_threads=max(2, tp * pp),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        scheduler=SchedulerConfig(preemption_mode=PreemptionMode.SWAP),
        cache=CacheConfig(num_blocks=blocks, num_host_blocks=256, enable_prefix_cache=False),
    )
    engine = Engine.from_config(config)
    prompts, tokens = [*PROMPTS, LONG_PROMPT], 24
    if blocks is not None:
        prompts = [f"{p} Number {i}." for i in range(3) for p in PROMPTS] + prompts
    try:
        workers = rank_processes()
        assert len(workers) == tp * pp - 1
        assert engine.core.runner.peers is not None and not engine.core.runner.bursts
        model = engine.core.model.config
        assert model.num_key_value_heads == (2 if tp == 2 else 3)  # rank 0: groups 0-1
        assert model.num_hidden_layers == 30 // pp  # rank 0: its stage's layers
        assert engine.core.cache.layout.num_layers == 30 // pp
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        if blocks is not None:
            assert sum(done[i].metrics.num_preemptions for i in ids) > 0
        assert engine.core.kv.num_free_host_blocks == 256
        body = {**BODY, "max_tokens": tokens}
        reference = exact_engine if tp > 1 else served_engine
        want = [e.text for e in run(reference, [{**body, "prompt": p} for p in prompts])]
        assert [done[i].text for i in ids] == want
    finally:
        engine.core.close()
    for worker in workers:
        worker.wait(10)
    assert rank_processes() == []


def test_a_server_on_two_stages_answers_as_one_engine_and_names_a_killed_rank(
    served_engine: Engine,
) -> None:
    """`serve --pipeline-parallel-size 2`: a completion is one engine's; then, a stream
    under way, SIGKILL of the worker rank: the engine process reports the rank
    (EngineFailed) and exits, its close leaving nothing behind; the stream ends with an
    error event naming the rank, not a hang, and the server answers that the engine is
    gone."""
    s = Server("--pipeline-parallel-size", "2", "--keep-running-on-engine-failure")
    try:
        (worker,) = rank_processes()
        body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        status, reply = s.post("/v1/completions", json.dumps(body).encode())
        assert status == 200, reply
        assert reply["choices"][0]["text"] == greedy(served_engine, PROMPTS[:1], 16)[0]
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = sse(s.url + "/v1/completions", body)
        assert next(events)["choices"][0]["text"]  # streaming has started
        worker.kill()
        rest = list(events)  # it ends (else the client's timeout fails the test)
        assert rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        assert (error["type"], error["code"]) == ("internal_server_error", 500)
        assert error["message"] == (
            "the engine is not available: engine step failed: RankFailed: rank 1 (pid "
            f"{worker.pid}) of this instance exited with signal SIGKILL"
        )
        wait_for(lambda: rank_processes() == [], timeout=10)
        status, reply = s.post("/v1/completions", b'{"prompt": "hi"}', key=None)
        assert status == 500 and reply["error"]["message"].startswith("the engine is not available")
    finally:
        s.stop()
    assert segments_left(set(), "pdtp-") == set()


def test_layouts_the_commands_refuse() -> None:
    """Each a usage error (exit 2) before any instance starts, its message exact."""
    cluster = ("serve", "--decode-pp", "2", "--prefill", "1", "--decode", "1")
    cases = {
        ("generate", "hi", "--tensor-parallel-size", "4"): "--tensor-parallel-size 4 is "
        "more than the model's 3 KV heads: each rank holds whole GQA groups (a KV head and "
        "its query heads)",
        # two instances on this machine's 2 threads: one each, and a TP 2 prefill needs two
        ("serve", "--prefill-tp", "2", "--prefill", "1", "--decode", "1"): "prefill-0: "
        "--tensor-parallel-size 2 x --pipeline-parallel-size 1 = 2 ranks, but the instance "
        "has 1 threads (each rank takes at least one; --num-threads sets them)",
        (*cluster, "--kv-transport", "tcp"): "--kv-transport tcp: a parallel instance's "
        "ranks keep their KV in shared memory; use shm or auto",
        ("serve", "--prefill", "1", "--decode", "1", "--microbatch-swap-blocks", "16"): (
            "--microbatch-swap-blocks swaps a pipeline stage's micro-batches: no instance has "
            "more than one stage (--pipeline-parallel-size, --prefill-pp, --decode-pp or a "
            "placement's pp)"
        ),
        (*cluster, "--num-threads", "4", "--microbatch-swap-blocks", "4"): (
            "--microbatch-swap-blocks 4: a half of 2 blocks cannot hold one 8192-token "
            "sequence (512 blocks of 16); give at least 1024 or lower --max-model-len"
        ),
    }
    for proc, message in zip(run_clis(*cases), cases.values(), strict=True):
        assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (
            2,
            f"pdserve: error: {message}",
        ), proc.stderr
    with pytest.raises(ValueError) as e:  # (exit 2 from the commands, as above)
        check_ranks_fit(
            EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, num_threads=3)
        )
    assert str(e.value) == (
        "--tensor-parallel-size 2 x --pipeline-parallel-size 2 = 4 ranks, but the instance "
        "has 3 threads (each rank takes at least one; --num-threads sets them)"
    )
    proc = run_cli("generate", "hi", "--tensor-parallel-size", "0")
    assert proc.returncode == 2
    assert proc.stderr == "pdserve: error: tensor_parallel_size must be an integer >= 1, got 0\n"


def test_microbatches_cut_rows_evenly_and_sequences_where_they_must() -> None:
    """A 12-row prefill chunk after 4 cached tokens, then two decode rows, in 2 parts of
    7 rows: the chunk's first 7 rows, then its last 5 (their cached context 4 + 7) and
    the decode rows; a part's sampling rows numbered within it. Never an empty part, nor
    one under `min_rows`."""
    table = [0, 1, 2, 3]
    specs = [SeqSpec(4, 12, table), SeqSpec(9, 1, [4, 5]), SeqSpec(3, 1, [6])]
    parts = microbatches(specs, [11, 12, 13], 2)
    assert microbatches(specs, [11, 12, 13], 2, min_rows=8) == [Part(0, 14, specs, [11, 12, 13])]
    assert parts == [
        Part(0, 7, [SeqSpec(4, 7, table)], []),
        Part(7, 14, [SeqSpec(11, 5, table), SeqSpec(9, 1, [4, 5]), SeqSpec(3, 1, [6])], [4, 5, 6]),
    ]
    decode = [SeqSpec(5, 1, [0]), SeqSpec(6, 1, [1]), SeqSpec(7, 1, [2])]
    assert [(p.start, p.stop, p.logit_rows) for p in microbatches(decode, [0, 1, 2], 2)] == [
        (0, 1, [0]),
        (1, 3, [0, 1]),
    ]
    one = microbatches([SeqSpec(0, 1, [0])], [0], 4)
    assert one == [Part(0, 1, [SeqSpec(0, 1, [0])], [0])]
    # Microbatch swapping: whole sequences, each part within a staging half's blocks (4
    # here, blocks of 4 tokens: a context of 7 needs 2 blocks, of 9 needs 3, a shared
    # prefix block counted once).
    seqs = [SeqSpec(6, 1, [0, 1, 9]), SeqSpec(6, 1, [0, 2]), SeqSpec(8, 1, [3, 4, 5])]
    packed = microbatches(seqs, [0, 1, 2], 2, capacity=4, block_size=4)
    assert packed == [Part(0, 2, seqs[:2], [0, 1]), Part(2, 3, seqs[2:], [0])]
    with pytest.raises(ValueError, match="a sequence of 3 blocks does not fit a staging half of 2"):
        microbatches(seqs, [0, 1, 2], 2, capacity=2, block_size=4)


def parallel_engine(tp: int, pp: int) -> tuple[Engine, psutil.Process]:
    engine = Engine.from_config(
        EngineConfig(num_threads=2, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    )
    (worker,) = rank_processes()
    return engine, worker


@pytest.mark.parametrize("tp,pp,phase", [(2, 1, "decode"), (2, 1, "prefill"), (1, 2, "decode")])
def test_a_rank_killed_mid_step_fails_the_instance_at_once(tp: int, pp: int, phase: str) -> None:
    """SIGKILL of the worker rank while the ranks step - decode steps (TP: sums through
    shared memory, which look at the ranks' processes every 50 ms while they wait; PP: a
    stage's receive) or a long prefill (TP: gloo's sums, which fail as the dead rank's
    connection closes): the driver's step raises RankFailed naming it within seconds, not
    after the 60 s wait limit; closing leaves no rank process and no shared-memory
    segment."""
    engine, worker = parallel_engine(tp, pp)
    try:
        prompt, tokens = (LONG_PROMPT * 8, 4) if phase == "prefill" else ("Hello", 400)
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0))
        engine.step()  # the first (chunk of the) prompt: the ranks are in step
        killer = threading.Timer(0.2, worker.kill)
        killer.start()
        start = time.monotonic()
        with pytest.raises(group.RankFailed) as failed:
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < group.WAIT_LIMIT_S / 6
        assert str(failed.value) == (
            f"rank 1 (pid {worker.pid}) of this instance exited with signal SIGKILL"
        )
    finally:
        engine.core.close()
    assert rank_processes() == []
    assert segments_left(set(), "pdtp-") == set()


def test_a_rank_gone_between_steps_is_named_before_the_next() -> None:
    engine, worker = parallel_engine(2, 1)
    try:
        engine.add_request("Hello", SamplingParams(max_tokens=8, temperature=0.0))
        engine.step()
        worker.kill()  # not waited for here: the driver reaps it
        wait_for(lambda: worker.status() == psutil.STATUS_ZOMBIE, timeout=10)
        with pytest.raises(group.RankFailed) as failed:
            engine.step()
        assert str(failed.value) == (
            f"rank 1 (pid {worker.pid}) of this instance exited with signal SIGKILL"
        )
    finally:
        engine.core.close()
    assert rank_processes() == []


def test_microbatch_swapping_keeps_the_text_and_holds_two_micro_batches(
    served_engine: Engine,
) -> None:
    """PP 2 with DéjàVu's microbatch swapping: 8 greedy streams of 12 prompt tokens and 20
    generated (4 blocks of 8 each at the end, 32 in use) through stages that compute from
    a staging area of 8 blocks - two micro-batches of one 32-token sequence. The driver's
    stage held at most those 8 blocks at once (its own count; the other stage cuts the
    same parts), never the 32, and every text is one undisturbed engine's."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (12,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def texts(engine: Engine) -> tuple[list[str], int]:
        ids = [engine.add_request(p, params) for p in prompts]
        done, most = {}, 0
        while engine.has_unfinished():
            done.update((o.request_id, o.text) for o in engine.step() if o.finished)
            most = max(most, engine.core.kv.num_used_blocks)
        return [done[i] for i in ids], most

    want, _ = texts(served_engine)
    config = EngineConfig(
        num_threads=2,
        max_model_len=32,
        cache=CacheConfig(block_size=8),
        pipeline_parallel_size=2,
        microbatch_swap_blocks=8,
    )
    engine = Engine.from_config(config)
    try:
        got, most = texts(engine)
        stage = engine.core.runner.stage
        assert stage is not None and stage.swap is not None
        assert (most, stage.swap.peak_blocks, stage.swap.half_blocks) == (32, 8, 4)
        assert got == want
    finally:
        engine.core.close()


def test_microbatch_swapping_refuses_what_it_cannot_stage() -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig(microbatch_swap_blocks=8)
    assert str(e.value) == (
        "microbatch_swap_blocks swaps a pipeline stage's micro-batches: it needs "
        "pipeline_parallel_size > 1"
    )
    with pytest.raises(ValueError, match=r"an even number >= 2 .*got 7"):
        EngineConfig(pipeline_parallel_size=2, microbatch_swap_blocks=7)
    pool = SimpleNamespace(device_tensor=torch.zeros(2, 2, 8, 16, 1, 8))  # a stage's pool
    config = EngineConfig(pipeline_parallel_size=2, microbatch_swap_blocks=8)
    with pytest.raises(ValueError) as e:
        stage_swap(config, pool, 65)
    assert str(e.value) == (
        "--microbatch-swap-blocks 8: a half of 4 blocks cannot hold one 65-token sequence "
        "(5 blocks of 16); give at least 10 or lower --max-model-len"
    )
    swap = stage_swap(config, pool, 64)
    assert swap is not None and swap.staging.shape == (2, 2, 8, 16, 1, 8)
