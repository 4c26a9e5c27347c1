"""Long contexts against their floors (issue 56, item 2): TTFT and TPOT of one stream at
1K, 4K and 8K prompt tokens and of 16 concurrent streams at 4K, each figure next to the
least time this machine could take for it; llama.cpp's own server beside it, alone, when
`--llama-server` names its binary.

    .venv/bin/python bench/bench_long_context.py [--lengths 1024,4096,8128]
        [--streams 16] [--streams-len 4096] [--output-len 64] [--repeats 2]
        [--serve-args "--kv-cache-memory-gib 2"] [--llama-server PATH] [--json out.json]

Each server is started alone, measured with `pdserve bench run` (random prompts of
exactly the given token count, `ignore_eos` so every answer is `--output-len` tokens,
distinct prompts so no prefix cache helps; one stream: `--repeats` requests one after
another; concurrent: `--streams` requests sent at once), and stopped. 8,128 + 64 = the
model's 8,192 positions. pdserve gets a 2 GiB KV pool so the 16 streams at 4K
(16 x 4,160 tokens x 23,040 B fp16 = 1.5 GiB) all fit; llama-server gets 16 slots of
8,192 tokens (`-np 16 -c 131072`: a slot holds one request's context).

The floors (the model's shapes from its config, the machine's rates measured here by
bench/reads.py's plain C loops):
* TPOT of one step with `b` sequences at context `L`: every weight byte (the GGUF's
  tensors; the tied embedding is read whole as the output head) and every KV byte the
  batch holds (`b * L * 2 * layers * kv_heads * head_dim * 2` for fp16) over the read
  bandwidth of two threads;
* TTFT of one `L`-token prompt: its FLOPs over the machine's fp32 multiply-add rate on
  two threads: `2 * L * P` for the projections and MLP (`P` their parameters) plus the
  causal attention's `4 * heads * head_dim * L (L + 1) / 2` per layer, the output head
  for the last token only. For `k` prompts sent at once the median one waits for about
  `(k + 1) / 2` prefills, so its floor is that many.
A figure more than 1.5x its floor is flagged: the issue asks what dominates there.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import reads
from servers import free_port, pdserve_cmd, start, stop

from pdserve.model.source import load_config, resolve_model

FLAG_RATIO = 1.5


@dataclass(frozen=True)
class Floors:
    read_bw: float  # bytes/s, two threads
    flops: float  # fp32 FLOP/s, two threads
    weight_bytes: int
    kv_bytes_per_token: int
    linear_params: int
    layers: int
    heads: int
    head_dim: int
    vocab: int
    hidden: int

    def tpot(self, batch: int, context: int) -> float:
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.read_bw

    def prefill(self, n: int) -> float:
        attention = self.layers * 4 * self.heads * self.head_dim * n * (n + 1) / 2
        head = 2 * self.hidden * self.vocab
        return (2 * n * self.linear_params + attention + head) / self.flops


def measure_floors(model: Path) -> Floors:
    cfg = load_config(model)
    lib = reads.build()
    read_bw = max(reads.flat_read_bandwidth(lib, gib << 30, 2) for gib in (1, 2))
    flops = max(lib.fma_rate(2) for _ in range(3))
    hd = cfg.head_dim
    per_layer = (
        cfg.hidden_size * hd * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
        + cfg.num_attention_heads * hd * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    return Floors(
        read_bw=read_bw,
        flops=flops,
        weight_bytes=model.stat().st_size,
        kv_bytes_per_token=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * 2,
        linear_params=cfg.num_hidden_layers * per_layer,
        layers=cfg.num_hidden_layers,
        heads=cfg.num_attention_heads,
        head_dim=hd,
        vocab=cfg.vocab_size,
        hidden=cfg.hidden_size,
    )


def bench(
    port: int, prompt_len: int, output_len: int, requests: int, at_once: int, seed: int
) -> tuple[float, float]:
    """Median TTFT and TPOT (seconds) of `requests` random prompts, `at_once` in flight."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        cmd = [
            sys.executable, "-m", "pdserve.cli", "bench", "run", "--base-url",
            f"http://127.0.0.1:{port}", "--workload", "random", "--random-input-len",
            str(prompt_len), "--random-output-len", str(output_len), "--num-prompts",
            str(requests), "--max-concurrency", str(at_once), "--seed", str(seed),
            "--request-timeout", "1200", "--result-file", str(result), "--no-plots",
            "--disable-tqdm",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        doc = json.loads(result.read_text())
    [run] = doc["runs"]
    s = run["summary"]
    if s["completed"] != requests:
        raise RuntimeError(f"{requests - s['completed']} of {requests} requests failed: {s}")
    return s["median_ttft_ms"] / 1e3, s["median_tpot_ms"] / 1e3


@dataclass
class Row:
    server: str
    case: str
    prompt: int
    streams: int
    ttft_s: float
    ttft_floor_s: float
    tpot_s: float
    tpot_floor_s: float


def measure(name: str, port: int, args: argparse.Namespace, floors: Floors) -> list[Row]:
    out = args.output_len
    bench(port, 64, 8, 2, 1, seed=99)  # warm-up
    rows = []
    for i, n in enumerate(args.lengths):
        ttft, tpot = bench(port, n, out, args.repeats, 1, seed=i)
        rows.append(
            Row(name, "1 stream", n, 1, ttft, floors.prefill(n), tpot, floors.tpot(1, n + out // 2))
        )
        print(f"  {name} {n}: TTFT {ttft:.3g} s TPOT {tpot * 1e3:.3g} ms", flush=True)
    k, n = args.streams, args.streams_len
    ttft, tpot = bench(port, n, out, k, k, seed=100)
    rows.append(
        Row(
            name,
            f"{k} at once",
            n,
            k,
            ttft,
            (k + 1) / 2 * floors.prefill(n),
            tpot,
            floors.tpot(k, n + out // 2),
        )
    )
    print(f"  {name} {k}x{n}: TTFT {ttft:.3g} s TPOT {tpot * 1e3:.3g} ms", flush=True)
    return rows


def run_server(
    name: str, cmd: list[str], port: int, args: argparse.Namespace, floors: Floors
) -> list[Row]:
    print(f"{name}: {shlex.join(cmd)}", flush=True)
    proc = start(cmd, port)
    try:
        return measure(name, port, args, floors)
    finally:
        stop(proc)


def _ratio(x: float) -> str:
    return f"**{x:.2f}**" if x > FLAG_RATIO else f"{x:.2f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| server | case | prompt | TTFT s | floor | x | TPOT ms | floor | x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r.ttft_s / r.ttft_floor_s, r.tpot_s / r.tpot_floor_s
        lines.append(
            f"| {r.server} | {r.case} | {r.prompt} | {r.ttft_s:.3g} | {r.ttft_floor_s:.3g} | "
            f"{_ratio(a)} | {r.tpot_s * 1e3:.3g} | {r.tpot_floor_s * 1e3:.3g} | {_ratio(b)} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,4096,8128")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--streams-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--serve-args", default="--kv-cache-memory-gib 2")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    model = resolve_model(None)
    floors = measure_floors(model)
    print(
        f"floors: read {floors.read_bw / 1e9:.1f} GB/s, {floors.flops / 1e9:.0f} GFLOP/s fp32, "
        f"weights {floors.weight_bytes / 1e6:.0f} MB, KV {floors.kv_bytes_per_token} B/token",
        flush=True,
    )
    rows = []
    port = free_port()
    cmd = pdserve_cmd(port, *shlex.split(args.serve_args))
    rows += run_server("pdserve", cmd, port, args, floors)
    if args.llama_server:
        port = free_port()
        cmd = [
            args.llama_server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", "2", "-np", str(args.streams), "-c", str(args.streams * 8192),
        ]  # fmt: skip
        rows += run_server("llama.cpp", cmd, port, args, floors)
    print(table(rows))
    if args.json:
        doc = {"floors": asdict(floors), "rows": [asdict(r) for r in rows]}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    slow = [
        r for r in rows if max(r.ttft_s / r.ttft_floor_s, r.tpot_s / r.tpot_floor_s) > FLAG_RATIO
    ]
    if slow:
        print(f"{len(slow)} figure(s) more than {FLAG_RATIO}x their floor", file=sys.stderr)


if __name__ == "__main__":
    main()
