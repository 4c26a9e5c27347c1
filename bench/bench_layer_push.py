"""Layer-wise KV push: what streaming each layer during the prefill costs the prefill.

One process, the shipped SmolLM2 (fp32), a prefill core with 1 thread (its share in
`serve --prefill 1 --decode 1` on 2 cores) and a decode core whose reserved blocks
receive the push through shared memory. For each prompt length, the same prompt is
prefilled alternately without any transfer (pull mode: the KV stays put until fetched)
and with layer-push; median of the repeats. Also reported: the transfer time left after
the last layer (the step waits for it before the next step may reuse blocks), and the
time a pull fetch of the same KV takes afterwards.

    .venv/bin/python bench/bench_layer_push.py [--lengths 128,512,2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.config import CacheConfig, EngineConfig, Role, SchedulerConfig, TransferConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.engine import build_core, load_model
from pdserve.engine.roles import PrefillRole
from pdserve.model.base import CausalLM
from pdserve.protocol.handoff import (
    AddPrefilled,
    Handoff,
    KVHandedOff,
    KVReceived,
    KVReserved,
    ReserveKV,
    TransferMode,
)
from pdserve.protocol.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def core(model: CausalLM, role: Role, mode: str, chunk: int, name: str) -> EngineCore:
    config = EngineConfig(
        role=role,
        instance_name=name,
        num_threads=1,
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
        # No prefix reuse between repeats: every run computes (and moves) the whole prompt.
        cache=CacheConfig(kv_cache_memory_gib=0.5, swap_space_gib=0.01, enable_prefix_cache=False),
        transfer=TransferConfig(mode=mode, transport="shm"),  # type: ignore[arg-type]
    )
    return build_core(config, model, [])


def prefill_once(p: EngineCore, d: EngineCore, rid: str, prompt: list[int], mode: str) -> dict:
    """Prefill `prompt` on p (handing off per `mode`); returns timings in seconds."""
    target = None
    if mode != "pull":
        d.reserve(ReserveKV(rid, prompt))
        d.poll_transfers()
        (reserved,) = [m for m in d.take_messages() if isinstance(m, KVReserved)]
        target = reserved.target
    p.add_request(rid, prompt, PARAMS, handoff=Handoff(TransferMode(mode), target))
    t0 = time.perf_counter()
    tails = []
    while p.has_unfinished():
        p.step()
        tails.append(p.role.last_tail_s if isinstance(p.role, PrefillRole) else 0.0)
    prefill_s = time.perf_counter() - t0
    handed = None
    while handed is None:
        time.sleep(0.0002)  # like the engine loop's poll: leave the GIL to the worker
        p.poll_transfers()
        handed = next((m for m in p.take_messages() if isinstance(m, KVHandedOff)), None)
    out = {"prefill_s": prefill_s, "tail_s": sum(tails)}
    d.add_prefilled(AddPrefilled(rid, prompt, [0], PARAMS, 0.0, handed.source, None))
    t1 = time.perf_counter()
    received = None
    while received is None:
        time.sleep(0.0002)
        d.poll_transfers()
        received = next((m for m in d.take_messages() if isinstance(m, KVReceived)), None)
    out["fetch_s"] = time.perf_counter() - t1 if mode == "pull" else 0.0
    d.abort(rid)
    p.release([rid])
    p.poll_transfers()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(EngineConfig(num_threads=1))
    cores = {
        m: (
            core(model, Role.PREFILL, m, args.chunk, f"bp-{m}"),
            core(model, Role.DECODE, m, args.chunk, f"bd-{m}"),
        )
        for m in ("pull", "layer-push")
    }
    vocab = model.config.vocab_size
    print(
        "| prompt tokens | prefill, no transfer (ms) | prefill, layer-push (ms) | slowdown | "
        "tail after last layer (ms) | pull fetch afterwards (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    n = 0
    for length in [int(x) for x in args.lengths.split(",")]:
        rows: dict[str, list[dict]] = {"pull": [], "layer-push": []}
        for rep in range(args.repeats + 1):
            prompt = torch.randint(10, vocab, (length,)).tolist()
            for mode in ("pull", "layer-push") if rep % 2 else ("layer-push", "pull"):
                p, d = cores[mode]
                n += 1
                r = prefill_once(p, d, f"r{n}", prompt, mode)
                if rep:  # the first round warms up
                    rows[mode].append(r)
        base = statistics.median(r["prefill_s"] for r in rows["pull"])
        push = statistics.median(r["prefill_s"] for r in rows["layer-push"])
        tail = statistics.median(r["tail_s"] for r in rows["layer-push"])
        fetch = statistics.median(r["fetch_s"] for r in rows["pull"])
        print(
            f"| {length} | {base * 1e3:.1f} | {push * 1e3:.1f} | {push / base:.3f}x | "
            f"{tail * 1e3:.2f} | {fetch * 1e3:.2f} |"
        )
    for p, d in cores.values():
        p.close()
        d.close()


if __name__ == "__main__":
    main()
