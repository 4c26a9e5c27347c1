"""Quantized serving vs the fp32 reference on the same model file: greedy agreement and
perplexity (issue 20, acceptance 2).

    .venv/bin/python bench/bench_quant_accuracy.py [--model PATH] [--quantization gguf]
        [--activations fp32] [--kv-cache-dtype auto]
        [--reference none] [--reference-kv-cache-dtype float32]

The reference is `--quantization none` with an fp32 KV cache: the file's blocks
dequantized to fp32, so both settings hold exactly the same weights and the only
difference is the order of the kernels' fp32 sums, and their compiled attention
(pdserve/kernels/README.md) - or, with `--activations int8`, also the rounding of the
activations to int8 (llama.cpp's method), and with an fp16 KV cache (`auto` under
quantized weights) the rounding of each K and V to fp16. `--reference gguf` compares two
settings of the quantized model instead (e.g. `--kv-cache-dtype float16` against
`--reference-kv-cache-dtype float32`: what the fp16 cache alone changes).

* Greedy agreement: 16 varied chat prompts (the length predictor's six task kinds,
  predictor/prompts.py, seed 0) x 64 tokens with ignore_eos: the share of continuations
  identical to fp32's, and where each other one first differs.
* Perplexity over the first 2,048 tokens of a fixed English text (the "assignment",
  "if", "for", "while", "try", "with" and "function" topics of CPython's own pydoc data,
  shipped with every Python 3.11), one prefill each; the ratio must be within 1%.

With `--llama-cpp PYTHON` (the python of bench/peers/setup_llamacpp.sh's venv) llama.cpp
computes the same GGUF over the same token ids (bench/peers/llamacpp_logits.py: its own
Q8 rounding of the activations, an fp16 KV cache), and its distance from the reference is
printed beside the tested setting's: the yardstick for `--activations int8` (the gate in
docs/benchmarks.md, "Quality of the default").
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from pdserve.config import KV_CACHE_DTYPES, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model.attention import AttentionMetadata, SeqSpec
from pdserve.model.base import CausalLM
from pdserve.model.source import resolve_model
from pdserve.predictor.prompts import make_prompts
from pdserve.protocol.sampling_params import SamplingParams

NUM_PROMPTS = 16
NUM_TOKENS = 64
PPL_TOKENS = 2048
TOPICS = ("assignment", "if", "for", "while", "try", "with", "function")
BLOCK = 16


def greedy(engine: Engine, prompts: list[str]) -> list[list[int]]:
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    for i, text in enumerate(prompts):
        chat = tok.apply_chat_template([{"role": "user", "content": text}])
        engine.add_request(tok.encode(chat, False), params, f"p{i}")
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[f"p{i}"] for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """How many continuations are identical, and the mean number of tokens each keeps
    before its first difference (NUM_TOKENS when identical)."""
    diffs = [first_difference(a, b) for a, b in zip(ref, got, strict=True)]
    kept = [NUM_TOKENS if d is None else d for d in diffs]
    return sum(d is None for d in diffs), sum(kept) / len(kept)


def chat_ids(engine: Engine, prompts: list[str]) -> list[list[int]]:
    tok = engine.tokenizer
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), False)
        for t in prompts
    ]


def llama_cpp(python: str, gguf: Path, ppl_ids: list[int], prompts: list[list[int]]) -> dict:
    """llama.cpp's perplexity and greedy continuations of these ids (its own venv)."""
    req = {"gguf": str(gguf), "ppl_ids": ppl_ids, "prompts": prompts, "num_tokens": NUM_TOKENS}
    script = Path(__file__).parent / "peers" / "llamacpp_logits.py"
    out = subprocess.run(
        [python, str(script)], input=json.dumps(req), capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout))


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[t] for t in TOPICS)


@torch.inference_mode()
def perplexity(model: CausalLM, ids: list[int], kv_dtype: str) -> float:
    """exp(mean NLL of each token given those before it), one prefill over a fresh pool
    of `kv_dtype`."""
    c = model.config
    blocks = -(-len(ids) // BLOCK)
    layout = KVLayout(
        c.num_hidden_layers, blocks, BLOCK, c.num_key_value_heads, c.head_dim, kv_dtype
    )
    cache = KVCache(layout, num_host_blocks=0)
    seqs = [SeqSpec(0, len(ids), list(range(blocks)))]
    meta = AttentionMetadata.build(seqs, BLOCK, per_row=model.fused)
    n = len(ids)
    logits = model(
        torch.tensor(ids), torch.arange(n), cache.device_tensor, meta, torch.arange(n - 1)
    )
    nll = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--activations", default="fp32", choices=("fp32", "int8"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--reference", default="none", help="the reference's --quantization")
    ap.add_argument("--reference-kv-cache-dtype", default="float32", choices=KV_CACHE_DTYPES)
    ap.add_argument("--llama-cpp", default=None, help="llama-cpp-python venv's python")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = [text for _, text in make_prompts(NUM_PROMPTS, seed=0)]
    settings = {
        "reference": EngineConfig(
            model=args.model, quantization=args.reference,
            kv_cache_dtype=args.reference_kv_cache_dtype,
        ),
        "tested": EngineConfig(
            model=args.model, quantization=args.quantization, activations=args.activations,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
    }  # fmt: skip
    results = {}
    for name, config in settings.items():
        engine = Engine.from_config(config)
        ids = engine.tokenizer.encode(fixed_text(), False)[:PPL_TOKENS]
        assert len(ids) == PPL_TOKENS, len(ids)
        kv = engine.core.kv_layout.dtype
        results[name] = {
            "tokens": greedy(engine, prompts),
            "perplexity": perplexity(engine.core.model, ids, kv),
            "formats": engine.core.model.weight_formats,
            "kv": kv,
        }
        if args.llama_cpp and name == "tested":
            gguf = Path(resolve_model(args.model))
            results["llama.cpp"] = llama_cpp(args.llama_cpp, gguf, ids, chat_ids(engine, prompts))
            results["llama.cpp"]["tokens"] = results["llama.cpp"].pop("greedy")
        del engine
    ref, got = results["reference"], results["tested"]
    diffs = [first_difference(a, b) for a, b in zip(ref["tokens"], got["tokens"], strict=True)]
    same = sum(d is None for d in diffs)
    ratio = got["perplexity"] / ref["perplexity"]
    print(
        f"{args.quantization} ({', '.join(got['formats'])}, {args.activations} activations, "
        f"{got['kv']} KV) vs {args.reference} ({', '.join(ref['formats'])}, {ref['kv']} KV):"
    )
    print(f"  identical greedy continuations: {same}/{NUM_PROMPTS} ({NUM_TOKENS} tokens each)")
    print(
        f"  first divergence positions of the others: {sorted(d for d in diffs if d is not None)}"
    )
    print(
        f"  perplexity over {PPL_TOKENS} tokens: reference {ref['perplexity']:.4f}, "
        f"tested {got['perplexity']:.4f} (ratio {ratio:.4f})"
    )
    if "llama.cpp" in results:
        cpp = results["llama.cpp"]
        print(
            f"llama.cpp (llama-cpp-python {cpp['version']}, the same file, fp16 KV) "
            "vs the reference:"
        )
        for name in ("tested", "llama.cpp"):
            n, kept = agreement(ref["tokens"], results[name]["tokens"])
            r = results[name]["perplexity"] / ref["perplexity"]
            print(
                f"  {name:9s} perplexity {results[name]['perplexity']:.4f} (x{r:.4f}); "
                f"identical {n}/{NUM_PROMPTS}; tokens kept before the first difference "
                f"{kept:.1f} of {NUM_TOKENS}"
            )
        n, kept = agreement(cpp["tokens"], got["tokens"])
        print(f"  tested vs llama.cpp: identical {n}/{NUM_PROMPTS}, tokens kept {kept:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"diffs": diffs, "ppl": {q: r["perplexity"] for q, r in results.items()}}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
