"""The engine on a CUDA GPU: exact against HF transformers there, its KV swap tier
between the GPU and pinned host memory, and its speed beside HF's on the same GPU.

    python bench/bench_cuda.py [--device cuda] [--repeats 3] [--json out.json]

Needs no download: every model is made here from a fixed seed (tests/helpers/tiny_models),
loaded through pdserve's own loaders as a user's HF folder would be.

1. Exactness. Tiny Llama (tied embeddings) and Qwen2 (q/k/v biases) models, fp32: greedy
   continuations of 8 prompts of 5-60 tokens, all in one batch, equal HF transformers'
   `generate` on the same device token for token; then the same with a KV pool too small
   for the batch, so requests are preempted to the host tier and swapped back in
   (pinned host memory on a GPU), and the tokens must not change.
2. The swap tier: `KVCache.swap_out` / `swap_in` of 512 blocks of a SmolLM2-shaped pool
   against one plain device -> pinned-host copy of the same bytes (the ceiling).
3. The command line as a user runs it: `pdserve generate --device` prints the CPU's
   greedy text, `pdserve serve --device` answers an OpenAI completion with it, and a
   disaggregated serve on a GPU exits 2 (its KV transports move host memory).
4. Speed: a random model of the shipped SmolLM2-135M's shape (30 layers, 576 wide, 49152
   vocabulary, tied), fp32, pdserve vs HF transformers on the same device, alternating:
   prefill 512 / 2048 tokens, decode steps at batch 1 / 8 / 32 / 64 (`bench_engine`'s
   measurements, which end each step with its tokens on the host).

Prints one line per check and the speed table; exits 1 if a check fails. On a machine
without a GPU, `--device cpu` runs the same checks (a dry run of the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_engine import (
    DECODE_CONTEXT,
    _alternate,
    _sync,
    hf_decode,
    hf_model,
    hf_prefill,
    ours_decode,
    ours_prefill,
)
from helpers.tiny_models import load_hf_reference, make_tiny_model

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.protocol.sampling_params import SamplingParams

NEW_TOKENS = 24
# The shipped SmolLM2's shape, written out: the GPU machine has no room to carry the
# 98 MB package (its lent machines take 64 MB), so `load_config(None)` is not there.
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    initializer_range=0.02,
)


def tiny_prompts(vocab: int, n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 61, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


@torch.inference_mode()
def hf_greedy(folder: Path, prompts: list[list[int]], device: str) -> list[list[int]]:
    model = load_hf_reference(folder).to(device)
    model.generation_config.eos_token_id = None
    out = []
    for ids in prompts:
        seq = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(seq[0, len(ids) :].tolist())
    return out


def ours_greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [list(done[i]) for i in ids]


def check_exact(root: Path, device: str) -> list[dict[str, object]]:
    """Greedy tokens vs HF on `device`, with a roomy pool and with one that must swap."""
    results = []
    for arch, kw in (("LlamaForCausalLM", {"tie_word_embeddings": True}), ("Qwen2ForCausalLM", {})):
        folder = make_tiny_model(root, arch, **kw)
        prompts = tiny_prompts(384)
        ref = hf_greedy(folder, prompts, device)
        # 12 blocks of 16 tokens hold ~2 of the 8 sequences (up to 84 tokens each):
        # the rest wait or are swapped to the 64 host blocks and back.
        for pool, blocks in (("roomy", 256), ("swapping", 12)):
            config = EngineConfig(
                model=str(folder),
                device=device,
                quantization="none",
                num_threads=1,
                cache=CacheConfig(num_blocks=blocks, num_host_blocks=64),
            )
            engine = Engine.from_config(config)
            got = ours_greedy(engine, prompts)
            sched = engine.core.scheduler
            same = sum(g == r for g, r in zip(got, ref, strict=True))
            results.append(
                {
                    "check": f"exact {arch} pool={pool}",
                    "ok": same == len(ref) and engine.core.kv.num_used_blocks == 0,
                    "identical": f"{same}/{len(ref)}",
                    "preemptions": sched.num_preemptions,
                    "blocks_left_in_use": engine.core.kv.num_used_blocks,
                }
            )
            if pool == "swapping" and sched.num_preemptions == 0:
                results[-1]["ok"] = False  # the pool was meant to force swaps
    return results


def check_swap(device: str) -> dict[str, object]:
    """Swap-out and swap-in of 512 blocks vs one plain copy of the same bytes."""
    layout = KVLayout(
        num_layers=30, num_blocks=1024, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32"
    )
    cache = KVCache(layout, 1024, device)
    cache.device_tensor.normal_()
    pairs = [(2 * i, i) for i in range(512)]  # every other device block -> host 0..511
    nbytes = cache.device_tensor[:, :, :512].numel() * cache.device_tensor.element_size()
    plain_src = torch.empty(nbytes // 4, device=device)
    plain_dst = torch.empty(nbytes // 4, pin_memory=device != "cpu")

    def timed(fn: functools.partial[object]) -> float:
        _sync(torch.device(device))
        t = time.perf_counter()
        fn()
        _sync(torch.device(device))
        return time.perf_counter() - t

    out_s, in_s, plain_s = [], [], []
    for _ in range(5):
        out_s.append(timed(functools.partial(cache.swap_out, pairs)))
        in_s.append(timed(functools.partial(cache.swap_in, [(h, d + 1) for d, h in pairs])))
        plain_s.append(timed(functools.partial(plain_dst.copy_, plain_src)))
    dev, host = cache.device_tensor, cache.host_tensor
    assert host is not None
    src = torch.tensor([d for d, _ in pairs], device=dev.device)
    same = bool(torch.equal(host[:, :, :512].to(dev.device), dev[:, :, src]))
    same &= bool(torch.equal(dev[:, :, src + 1], dev[:, :, src]))
    plain = statistics.median(plain_s)
    return {
        "check": "swap tier round trip",
        "ok": same,
        "bytes": nbytes,
        "swap_out_GBps": nbytes / statistics.median(out_s) / 1e9,
        "swap_in_GBps": nbytes / statistics.median(in_s) / 1e9,
        "plain_copy_GBps": nbytes / plain / 1e9,
    }


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def check_cli(root: Path, device: str) -> list[dict[str, object]]:
    """As a user runs it: `pdserve generate` on the device prints the CPU's text; `pdserve
    serve` on the device answers an OpenAI completion with that text; a disaggregated
    serve on a GPU is refused with exit 2 (the transports move host memory)."""
    folder = make_tiny_model(root, "LlamaForCausalLM", tie_word_embeddings=True)
    common = ["--model", str(folder), "--max-tokens", "16", "--raw", "Hello world"]
    here, cpu = pdserve("generate", "--device", device, *common), pdserve("generate", *common)
    text = cpu.stdout.removesuffix("\n")
    results: list[dict[str, object]] = [
        {
            "check": f"pdserve generate --device {device}",
            "ok": here.returncode == 0 and cpu.returncode == 0 and here.stdout == cpu.stdout,
            "text": here.stdout,
            "stderr": here.stderr[-300:],
        }
    ]
    served = serve_one_completion(folder, device, "Hello world")
    results.append(
        {"check": f"pdserve serve --device {device}", "ok": served == text, "text": served}
    )
    if device != "cpu":
        proc = pdserve("serve", str(folder), "--device", device, "--prefill", "1", "--decode", "1")
        results.append(
            {
                "check": "disaggregated serve on a GPU is a usage error",
                "ok": proc.returncode == 2 and "needs its KV pool in host memory" in proc.stderr,
                "stderr": proc.stderr[-300:],
            }
        )
    return results


def serve_one_completion(folder: Path, device: str, prompt: str) -> str | None:
    """Start `pdserve serve` on a free port, POST one greedy completion, stop it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", str(folder), "--device", device]
    server = subprocess.Popen([*cmd, "--port", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and server.poll() is None:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        body = {"model": folder.name, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        req = urllib.request.Request(
            f"{url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return str(json.load(resp)["choices"][0]["text"])
    except OSError:
        return None
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def speed(root: Path, device: str, repeats: int) -> list[dict[str, object]]:
    folder = make_tiny_model(root, "LlamaForCausalLM", tie_word_embeddings=True, **SMOLLM2_SHAPE)
    config = EngineConfig(
        model=str(folder),
        device=device,
        quantization="none",
        scheduler=SchedulerConfig(
            max_num_batched_tokens=4096, max_num_seqs=128, max_prefill_tokens_with_decodes=0
        ),
        cache=CacheConfig(kv_cache_memory_gib=2.0, enable_prefix_cache=False),
    )
    engine = Engine.from_config(config)
    hf = hf_model(str(folder)).to(device)
    rows = []
    for n in (512, 2048):
        ours_prefill(engine, n)  # warm-up
        hf_prefill(hf, n)
        ours, theirs = (
            functools.partial(ours_prefill, engine, n),
            functools.partial(hf_prefill, hf, n),
        )
        rows.append(side_by_side(f"prefill {n} tok", "tok/s", ours, theirs, repeats))
    for b in (1, 8, 32, 64):
        ours_decode(engine, b)  # warm-up (the GPU's kernels for this shape)
        ours, theirs = (
            functools.partial(ours_decode, engine, b),
            functools.partial(hf_decode, hf, b),
        )
        case = f"decode b={b} ctx~{DECODE_CONTEXT}"
        rows.append(side_by_side(case, "ms/step", ours, theirs, repeats))
    return rows


def side_by_side(
    case: str, unit: str, ours: Callable[[], float], hf: Callable[[], float], repeats: int
) -> dict[str, object]:
    """Medians of alternating runs; ours_vs_hf > 1 when pdserve is faster."""
    o, h = _alternate({"ours": ours}, hf, repeats)
    speedup = o["ours"] / h if unit == "tok/s" else h / o["ours"]
    return {"case": case, "unit": unit, "pdserve": o["ours"], "hf": h, "ours_vs_hf": speedup}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-speed", action="store_true", help="the checks only")
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {args.device} ({name}), torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checks = [
            *check_exact(root, args.device),
            check_swap(args.device),
            *check_cli(root, args.device),
        ]
        for c in checks:
            print(("PASS " if c["ok"] else "FAIL ") + json.dumps(c))
        rows = [] if args.skip_speed else speed(root, args.device, args.repeats)
    for r in rows:
        print(
            f"| {r['case']:22} | pdserve {r['pdserve']:9.2f} | HF {r['hf']:9.2f} | "
            f"{r['unit']:7} | ours/HF speed {r['ours_vs_hf']:5.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "checks": checks, "speed": rows}, f, indent=2)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
