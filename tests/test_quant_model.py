"""Quantized models: GGUF blocks served as they are, fp weights quantized at load, and
`--quantization` resolved for each kind of file (pdserve/model/loader.py).

The loading checks are exact: every quantized op's blocks dequantize to exactly the
fp32 weight the unquantized load builds (same permutation, same fusion), so what the
kernels read is the file's weights; the kernels themselves are tests/test_quant_kernels.py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers.reference import FRANCE_ANSWERS, resolved_activations
from helpers.tiny_models import make_tiny_gguf, make_tiny_model

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, deployment_activations
from pdserve.engine.engine import Engine, load_model
from pdserve.errors import ModelLoadError
from pdserve.model.base import CausalLM
from pdserve.model.loader import iter_weights
from pdserve.model.quantization import Quantization, resolve_quantization
from pdserve.model.registry import build_model
from pdserve.model.source import load_config
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.quant.formats import QuantType, QuantWeight
from pdserve.quant.linear import QuantEmbedding, QuantLinear

# What is served depends on whether the kernels load: every test here runs in the
# fallback pass too (those of the compiled path itself are `kernels` and left out there).
pytestmark = pytest.mark.fallback


def fp_model(path: Path) -> CausalLM:
    """The unquantized load, ops unpacked (their `.weight` is the fp32 matrix)."""
    model = build_model(load_config(path))
    model.load_weights(iter_weights(path))
    model.finalize(pack=False)
    return model


def assert_same_weights(quant: CausalLM, fp: CausalLM, qtype: QuantType | None) -> None:
    """Every op quantized (all in `qtype` unless None) and reading exactly the fp weights."""
    for q, f in zip(quant.projection_ops(), fp.projection_ops(), strict=True):
        assert isinstance(q, QuantLinear) and (qtype is None or q.formats == [qtype.name])
        assert torch.equal(q.dequantize(), f.weight)  # type: ignore[attr-defined]
        if f.bias is None:  # type: ignore[attr-defined]
            assert q.bias is None
        else:
            assert torch.equal(q.bias, f.bias)  # type: ignore[attr-defined]
    ids = torch.tensor([0, 5, 17, 3, 5])
    assert torch.equal(quant.embed_tokens[ids], fp.embed_tokens[ids])


# Rows of 256 values for the K formats (hidden 256, 4 heads of 64, intermediate 512).
K_DIMS = {"hidden_size": 256, "head_dim": 64, "intermediate_size": 512}


@pytest.mark.kernels
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("qtype", list(QuantType))
def test_a_quantized_gguf_is_served_from_its_own_blocks(
    tmp_path: Path, arch: str, qtype: QuantType
) -> None:
    """Llama (q/k rows permuted in the file) and Qwen2 (q/k/v biases), untied head."""
    dims = K_DIMS if qtype.block_values == 256 else {}
    path = make_tiny_gguf(tmp_path, arch, quant=qtype.name, **dims)
    exact = EngineConfig(model=str(path), quantization="gguf", activations="fp32", num_threads=1)
    model = load_model(exact)
    assert model.quantization == Quantization("gguf")
    assert model.weight_formats == [qtype.name]
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert_same_weights(model, fp_model(path), qtype)


@pytest.mark.kernels
@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q4_0])
def test_hf_weights_quantized_at_load(tmp_path: Path, qtype: QuantType) -> None:
    """Projections in the asked format; embeddings and LM head (tied here) in Q8_0."""
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", tie_word_embeddings=True)
    quantization = resolve_quantization(qtype.name.lower(), folder)
    model = build_model(load_config(folder), quantized=True)
    model.load_weights(iter_weights(folder, quantization=quantization))
    model.finalize()
    fp = fp_model(folder)
    assert model.weight_formats == sorted({qtype.name, "Q8_0"})
    head = model.lm_head_op
    assert isinstance(head, QuantLinear) and head.formats == ["Q8_0"]
    want = QuantWeight.quantize(fp.lm_head_op.weight, QuantType.Q8_0)  # type: ignore[attr-defined]
    assert (head.weights[0].to_blocks() == want.to_blocks()).all()
    for q, f in zip(model.projection_ops()[1:], fp.projection_ops()[1:], strict=True):
        assert isinstance(q, QuantLinear) and q.formats == [qtype.name]
        want = QuantWeight.quantize(f.weight, qtype)  # type: ignore[attr-defined]
        assert (q.weights[0].to_blocks() == want.to_blocks()).all()


# llama.cpp's Q4_K_M: Q4_K, with Q6_K for the LM head and for v and down in some layers.
Q4_K_M = {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"}


def greedy_text(path: Path, quantization: str, prompt: str) -> tuple[Engine, str]:
    engine = Engine.from_config(EngineConfig(model=str(path), quantization=quantization))
    engine.add_request(
        engine.tokenizer.encode(prompt), SamplingParams(max_tokens=16, temperature=0)
    )
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            text = out.text
    return engine, text


@pytest.mark.kernels
def test_a_q4_k_m_mix_is_served_in_its_own_formats_with_the_fp32_text(tmp_path: Path) -> None:
    """q/k in Q4_K beside a Q6_K v (one op, two kernel calls), every layer on the
    compiled path, the same weights as the fp32 load and the same greedy text."""
    path = make_tiny_gguf(tmp_path, quant="Q4_K", quant_overrides=Q4_K_M, **K_DIMS)
    assert resolve_quantization("auto", path) == Quantization("gguf")
    engine, text = greedy_text(path, "auto", "the cat sat on the")
    model = engine.core.model
    assert model.weight_formats == ["Q4_K", "Q6_K"] and model.fused
    qkv = model.projection_ops()[1]
    assert isinstance(qkv, QuantLinear) and [w.qtype.name for w in qkv.weights] == ["Q4_K", "Q6_K"]
    assert_same_weights(model, fp_model(path), None)
    _, fp_text = greedy_text(path, "none", "the cat sat on the")
    assert text and text == fp_text


@pytest.mark.kernels
def test_auto_falls_back_on_a_type_the_kernels_do_not_read_and_gguf_refuses_it(
    tmp_path: Path,
) -> None:
    path = make_tiny_gguf(tmp_path, quant="Q4_1", quant_overrides={"blk.1.attn_v.weight": "MXFP4"})
    why = (
        "tensor 'blk.1.attn_v.weight' (model.layers.1.self_attn.v_proj.weight) has GGUF type "
        "MXFP4, which the kernels do not read (they read Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
        "Q5_K, Q6_K); serve it with --quantization none"
    )
    assert resolve_quantization("auto", path) == Quantization("none", why)
    with pytest.raises(ValueError) as info:
        resolve_quantization("gguf", path)
    assert str(info.value) == f"--quantization gguf: {why}"


@pytest.mark.kernels
def test_each_value_fits_its_kind_of_file(tmp_path: Path) -> None:
    gguf_file = make_tiny_gguf(tmp_path)  # F32
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    assert resolve_quantization("auto", gguf_file) == Quantization(
        "none", "the file holds no quantized weights"
    )
    assert resolve_quantization("auto", folder) == Quantization(
        "none", "the weights are fp (--quantization q8_0 or q4_0 quantizes them at load)"
    )
    assert resolve_quantization("q8_0", folder) == Quantization("q8_0")
    assert resolve_quantization("none", gguf_file) == Quantization()
    with pytest.raises(ValueError) as info:
        resolve_quantization("q4_0", gguf_file)
    assert str(info.value) == (
        f"--quantization q4_0 does not fit {gguf_file} (a GGUF file); use one of: auto, none, gguf"
    )
    with pytest.raises(ValueError) as info:
        resolve_quantization("gguf", folder)
    assert str(info.value) == (
        f"--quantization gguf does not fit {folder} (a Hugging Face folder); "
        "use one of: auto, none, q8_0, q4_0"
    )


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def run_clis(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """`run_cli` of each command, all at once (a usage error's run waits mostly on its
    imports), in the commands' order."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run_cli(*args), commands))


def nan_scale(path: Path, tensor: str, row: int, block: int) -> None:
    """Write an fp16 NaN over the scale of one Q4_1 block of `tensor` in the file."""
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor)
    per_row = int(t.shape[0]) // 32
    with path.open("r+b") as f:
        f.seek(int(t.data_offset) + (row * per_row + block) * QuantType.Q4_1.block_bytes)
        f.write(np.array([np.nan], np.float16).tobytes())


def load_error(path: Path, quantization: Quantization) -> str:
    with pytest.raises(ModelLoadError) as info:
        list(iter_weights(path, quantization=quantization))
    return str(info.value)


@pytest.mark.kernels
def test_a_non_finite_block_scale_is_a_load_error_naming_its_place(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, quant="Q4_1")
    nan_scale(path, "blk.0.attn_q.weight", row=3, block=1)
    assert load_error(path, Quantization("gguf")) == (
        f"{path}: tensor 'blk.0.attn_q.weight' (Q4_1, shape [64, 64]): the block scale of "
        "row 3, values 32-63, is nan: the file is corrupt"
    )


def test_a_non_finite_weight_is_a_load_error_when_dequantized_too(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, quant="Q4_1")
    nan_scale(path, "blk.1.ffn_down.weight", row=5, block=3)
    assert load_error(path, Quantization()) == (
        f"{path}: tensor 'blk.1.ffn_down.weight' (Q4_1): the value of row 5, column 96, is "
        "nan: the file is corrupt"
    )


def test_a_value_that_does_not_fit_the_model_exits_2_before_loading() -> None:
    proc = run_cli("serve", "--port", "0", "--quantization", "q4_0")
    assert proc.returncode == 2, proc.stderr
    assert "pdserve: error: --quantization q4_0 does not fit " in proc.stderr
    assert "(a GGUF file); use one of: auto, none, gguf" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("generate", "hi", "--quantization", "bogus")
    assert proc.returncode == 2
    assert "argument --quantization: invalid choice: 'bogus'" in proc.stderr


def test_without_the_kernels_auto_serves_fp32_and_gguf_says_why(tmp_path: Path) -> None:
    """The fallback path (CI runs it here): PDSERVE_NO_KERNELS=1 - as on a machine
    where the extension could not be built - serves a quantized GGUF as fp32, with the
    exact text of `--quantization none`; asking for the blocks is a usage error."""
    path = make_tiny_gguf(tmp_path, quant="Q4_1")
    off = {"PDSERVE_NO_KERNELS": "1"}
    proc = run_cli("generate", "--model", str(path), "--quantization", "gguf", "hi", env=off)
    assert proc.returncode == 2
    assert "pdserve: error: --quantization gguf: PDSERVE_NO_KERNELS is set" in proc.stderr
    prompt = "the cat sat on the"
    args = ("--model", str(path), "--raw", "--max-tokens", "12", "--quantization", "auto")
    proc = run_cli("generate", *args, prompt, env=off)
    assert proc.returncode == 0, proc.stderr
    engine = Engine.from_config(EngineConfig(model=str(path), quantization="none"))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    engine.add_request(engine.tokenizer.encode(prompt), greedy)
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            text = out.text
    assert text and proc.stdout == text + "\n"


def test_int8_activations_need_weights_in_blocks_and_say_so() -> None:
    """--activations int8 with weights that will be fp: exit 2 before loading, naming
    why (also on the fallback path, where auto serves fp32)."""
    proc = run_cli("generate", "hi", "--quantization", "none", "--activations", "int8")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pdserve: error: --activations int8 needs weights in blocks (--quantization auto, "
        "gguf, q8_0 or q4_0); they would be served as fp"
    )
    off = {"PDSERVE_NO_KERNELS": "1"}
    proc = run_cli("serve", "--port", "0", "--activations", "int8", env=off)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("they would be served as fp (PDSERVE_NO_KERNELS is set)"), (
        proc.stderr
    )
    proc = run_cli("generate", "hi", "--activations", "int4")
    assert proc.returncode == 2
    assert (
        "argument --activations: invalid choice: 'int4' (choose from 'auto', 'fp32', 'int8')"
        in proc.stderr
    )


@pytest.mark.kernels
@pytest.mark.int8
def test_auto_activations_are_int8_where_they_run_and_fp32_where_the_weights_are_fp() -> None:
    """`--activations auto` (the default): the shipped GGUF's blocks with int8 activations
    on a CPU that runs them; fp weights (`--quantization none`) keep fp32 activations
    without the usage error that an explicit `int8` gets; `fp32` stays fp32."""
    from pdserve.model.default import default_model_path

    path = default_model_path()
    assert resolve_quantization("auto", path, activations="auto") == Quantization(
        "gguf", activations="int8"
    )
    assert resolve_quantization("none", path, activations="auto") == Quantization()
    assert resolve_quantization("auto", path, activations="fp32") == Quantization("gguf")
    with pytest.raises(ValueError, match="--activations int8 needs weights in blocks"):
        resolve_quantization("none", path, activations="int8")
    assert EngineConfig().activations == "auto"


def test_a_deployment_with_a_tensor_parallel_instance_takes_fp32_activations_under_auto() -> None:
    """`auto` is fp32 for every instance of a deployment where any is tensor-parallel (its
    ranks' sums in another order would move int8's rounding, and with it the text); an
    explicit choice is kept, and `auto` without tensor parallelism is left to each
    instance's kernels (int8 where they run)."""
    assert deployment_activations("auto", [1, 2]) == "fp32"
    assert deployment_activations("auto", [2]) == "fp32"
    assert deployment_activations("auto", [1, 1]) == "auto"
    assert deployment_activations("auto", []) == "auto"
    assert deployment_activations("int8", [2, 1]) == "int8"
    assert deployment_activations("fp32", [1]) == "fp32"


def test_the_startup_line_says_how_activations_are_taken_and_what_the_kv_cache_holds() -> None:
    from pdserve.protocol.core import WeightsInfo
    from pdserve.server.launch import weights_line

    int8 = WeightsInfo("gguf", ["Q4_1", "Q8_0"], "", ["int8"], "float16")
    assert weights_line(int8) == (
        "pdserve: weights: Q4_1, Q8_0 blocks (gguf), by the compiled kernels (int8 activations)"
        "; KV cache: float16"
    )
    fp32 = WeightsInfo("gguf", ["Q4_1", "Q8_0"], "", ["fp32"], "float32")
    line = weights_line(fp32)
    assert line.endswith("by the compiled kernels (fp32 activations); KV cache: float32")
    dense = WeightsInfo("none", ["float32"], "", ["float32"], "float32", compiled=True)
    assert weights_line(dense) == (
        "pdserve: weights: float32, by the compiled kernels; KV cache: float32"
    )
    onednn = WeightsInfo("none", ["float32"], "", ["float32"], "float32")
    assert weights_line(onednn) == "pdserve: weights: float32; KV cache: float32"


@pytest.mark.kernels
@pytest.mark.int8
def test_int8_activations_serve_a_gguf_the_same_batched_or_alone(tmp_path: Path) -> None:
    """A tiny Q4_1 GGUF with --activations int8: every projection takes int8
    activations, and four greedy requests decoded together give each one's text alone
    (the rounding is per row). Not fp32's text: that is not the point here (see
    bench/bench_quant_accuracy.py for how far it moves)."""
    path = make_tiny_gguf(tmp_path, quant="Q4_1")
    config = EngineConfig(model=str(path), quantization="gguf", activations="int8")
    engine = Engine.from_config(config)
    model = engine.core.model
    assert model.fused and model.activations == ["int8"]
    assert model.weight_formats == ["Q4_1"]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["the cat sat on the", "one two three", "a b c d e f g", "hello"]

    def texts(batch: list[str]) -> dict[str, str]:
        ids = {engine.add_request(engine.tokenizer.encode(p), greedy): p for p in batch}
        out: dict[str, str] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out[ids[o.request_id]] = o.text
        return out

    together = texts(prompts)
    alone = {p: texts([p])[p] for p in prompts}
    assert together == alone and all(together.values())


@pytest.mark.kernels
def test_a_greedy_step_takes_its_tokens_from_the_argmax_of_its_one_call(tmp_path: Path) -> None:
    """Every row greedy: the compiled call that ran the LM head also took each row's
    argmax, and those are the tokens (numpy's argmax of the same logits); a step with a
    sampled row does not ask for it and samples as before. One step a call (decode
    bursts take the same argmax in their call: tests/test_decode_burst.py)."""
    path = make_tiny_gguf(tmp_path, quant="Q8_0")
    scheduler = SchedulerConfig(decode_burst=1)
    config = EngineConfig(model=str(path), quantization="gguf", scheduler=scheduler)
    engine = Engine.from_config(config)
    runner = engine.core.runner
    execute, steps = runner.execute, []

    def spy(sched):  # type: ignore[no-untyped-def]
        steps.append(execute(sched))
        return steps[-1]

    runner.execute = spy  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    rids = [engine.add_request(engine.tokenizer.encode(p), greedy) for p in ("a b c", "one")]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = list(o.token_ids)
    taken: dict[str, list[int]] = {r: [] for r in rids}
    for step in steps:
        assert step.argmax is not None and step.logits is not None
        assert step.argmax.tolist() == step.logits.numpy().argmax(axis=-1).tolist()
        for seq, t in zip(step.sampled, step.argmax.tolist(), strict=True):
            taken[seq.request.request_id].append(t)
    assert taken == tokens and all(len(t) == 6 for t in tokens.values())
    steps.clear()
    engine.add_request(engine.tokenizer.encode("a b c"), SamplingParams(max_tokens=3, seed=1))
    while engine.has_unfinished():
        engine.step()
    assert steps and all(s.argmax is None and s.logits is not None for s in steps)


@pytest.mark.kernels
def test_under_quantized_weights_the_kv_pool_is_fp16_and_holds_twice_the_blocks(
    tmp_path: Path,
) -> None:
    """`--kv-cache-dtype auto` under a quantized GGUF: an fp16 pool, so the same KV memory
    holds exactly twice the blocks of `float32`'s (and twice the tokens of context), for
    the pool and its host tier; under fp weights auto is the weights' dtype. The K/V a
    request writes land in the fp16 pool, and its greedy text is the same alone and
    batched with others (the fp16 cache keeps the kernels' row invariance)."""
    from pdserve.config import CacheConfig

    path = make_tiny_gguf(tmp_path, quant="Q4_1")
    cache = CacheConfig(kv_cache_memory_gib=1 / 64, swap_space_gib=1 / 128)
    engines = {
        kv: Engine.from_config(EngineConfig(model=str(path), kv_cache_dtype=kv, cache=cache))
        for kv in ("auto", "float32")
    }
    auto, fp32 = engines["auto"].core, engines["float32"].core
    assert (auto.kv_layout.dtype, fp32.kv_layout.dtype) == ("float16", "float32")
    assert auto.runner.cache.device_tensor.dtype == torch.float16
    # A block: 16 tokens x 2 layers x K, V x 2 heads x 16 = 2,048 elements, 8 KiB in fp32.
    blocks = (auto.kv_layout.num_blocks, fp32.kv_layout.num_blocks)
    assert blocks == (16 * 2**20 // 4096, 16 * 2**20 // 8192)
    hosts = [c.runner.cache.host_layout for c in (auto, fp32)]
    assert [h.num_blocks if h else 0 for h in hosts] == [8 * 2**20 // 4096, 8 * 2**20 // 8192]
    fp = Engine.from_config(EngineConfig(model=str(path), quantization="none", cache=cache))
    assert fp.core.kv_layout.dtype == "float32"

    engine = engines["auto"]
    prompts = [[5, 9, 2, 77, 31], [8, 15, 40], [41, 3, 3, 7, 19, 23, 2]]
    batched = greedy_tokens(engine, prompts, 16)
    assert batched == [greedy_tokens(engine, [p], 16)[0] for p in prompts]
    assert auto.runner.cache.device_tensor.any()


@pytest.mark.kernels
def test_a_kv_cache_dtype_the_attention_cannot_read_is_a_usage_error() -> None:
    """bfloat16 under quantized weights (their compiled attention reads fp32 or fp16):
    exit 2 before any instance starts, naming the flag and the way out; a dtype that is
    none of the choices: exit 2 with the choices."""
    proc = run_cli("serve", "--port", "0", "--kv-cache-dtype", "bfloat16")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pdserve: error: --kv-cache-dtype bfloat16: quantized weights' compiled attention "
        "reads a float32 or float16 KV cache (or serve fp weights: --quantization none)"
    )
    proc = run_cli("generate", "hi", "--kv-cache-dtype", "fp8")
    assert proc.returncode == 2
    assert (
        "argument --kv-cache-dtype: invalid choice: 'fp8' (choose from 'auto', 'float32', "
        "'float16', 'bfloat16')" in proc.stderr
    )


# ---- what the README promises of the quantized paths' outputs ---------------------------


def greedy_tokens(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (EOS ignored), all prompts in one batch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[i] for i in ids]


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.mark.kernels
def test_the_shipped_models_blocks_give_fp32s_greedy_tokens(
    make_engine: Callable[..., Engine], served_engine: Engine
) -> None:
    """README "Quantized weights": the shipped GGUF's blocks are read as their exact fp32
    values and the activations stay fp32, "so the results are fp32's up to the order of
    the sums" (`--activations fp32`). On these chats that order changes no greedy token:
    the compiled kernels (KV cache in float32, to compare the weights alone) give every
    token of `--quantization none` (the fp32 weights, tests/conftest.py's `smollm2`). And
    the README's own question gets the README's answer from both, and from what `pdserve
    serve` runs by default (`served_engine`: the blocks over an fp16 KV cache, int8
    activations where they run: llama.cpp's answer, helpers/reference.py)."""
    fp = make_engine()
    cache = CacheConfig(num_blocks=256)
    blocks = Engine.from_config(
        EngineConfig(kv_cache_dtype="float32", activations="fp32", num_threads=2, cache=cache)
    )
    assert blocks.core.model.weight_formats == ["Q4_1", "Q8_0"]
    assert (fp.core.kv_layout.dtype, blocks.core.kv_layout.dtype) == ("float32", "float32")
    tok = fp.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts = [tok.encode(c, add_special_tokens=False) for c in chats]
    assert greedy_tokens(blocks, prompts, 24) == greedy_tokens(fp, prompts, 24)

    readme = SamplingParams(max_tokens=32, temperature=0)  # the README's example
    served = FRANCE_ANSWERS[resolved_activations(EngineConfig.activations)]
    for engine, answer in (
        (fp, FRANCE_ANSWERS["fp32"]),
        (blocks, FRANCE_ANSWERS["fp32"]),
        (served_engine, served),
    ):
        engine.add_request(prompts[0], readme)
        texts = []
        while engine.has_unfinished():
            texts += [out.text for out in engine.step() if out.finished]
        assert texts == [answer]


def dequantized_folder(folder: Path, qtype: QuantType, out: Path) -> Path:
    """A copy of the HF folder whose weights are what `--quantization <qtype>` quantizes them
    to, dequantized back to fp32 by gguf-py's own reference (not pdserve's code): the
    projections in `qtype`, the embeddings and LM head in Q8_0, the rest as they are."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    weights = load_file(str(folder / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight"):
            target = qtype if name.endswith("_proj.weight") else QuantType.Q8_0
            raw = gguf.quants.quantize(w.numpy(), target.ggml)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(raw, target.ggml).copy())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.kernels
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q4_0], ids=["q8_0", "q4_0"])
def test_hf_weights_quantized_at_load_give_the_greedy_tokens_of_their_blocks_in_fp32(
    tmp_path: Path, qtype: QuantType, tied: bool
) -> None:
    """README: `--quantization q8_0|q4_0` quantizes a Hugging Face model at load. What it
    must then generate: the tokens of the same quantized weights computed in fp32 - the
    folder's weights quantized and dequantized by gguf-py, served `--quantization none`
    (up to the order of the sums, which changes no token of this tiny model). Four
    prompts batched, 24 tokens each."""
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", tie_word_embeddings=tied)
    reference = dequantized_folder(folder, qtype, tmp_path / "dequantized")
    quantized = Engine.from_config(
        EngineConfig(
            model=str(folder), quantization=qtype.name.lower(), activations="fp32", num_threads=1
        )
    )
    fp = Engine.from_config(EngineConfig(model=str(reference), quantization="none", num_threads=1))
    assert quantized.core.model.weight_formats == sorted({qtype.name, "Q8_0"})
    prompts = [[5, 9, 2, 77, 31], [8, 15, 40], [41, 3, 3, 7, 19, 23, 2], [100, 200, 300]]
    tokens = greedy_tokens(quantized, prompts, 24)
    assert tokens == greedy_tokens(fp, prompts, 24)
    # Not the fp weights' tokens: the quantization is there to be seen.
    unquantized = Engine.from_config(EngineConfig(model=str(folder), quantization="none"))
    assert tokens != greedy_tokens(unquantized, prompts, 24)
