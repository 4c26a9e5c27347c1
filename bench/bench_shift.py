"""The shift experiment (issue 53): SLO attainment over time through a workload shift,
static placements against the flip policies.

    .venv/bin/python bench/bench_shift.py [--phase-seconds 60] [--configs ...]
        [--profile profile.json] [--out shift.json] [--plot docs/figures/shift.png]

Each configuration is a server started alone (`pdserve serve` on 127.0.0.1, three
instances) and sent the same open-loop workload (Poisson arrivals, drawn once from
`--seed`): `--phase-seconds` of long prompts with short answers (phase A, `--rate-a`
req/s of `--prompt-a` + `--output-a` tokens), then as long of short prompts with long
answers (phase B, `--rate-b` of `--prompt-b` + `--output-b`). Prompts are token ids
(exact lengths, none shared: no prefix-cache hit helps any configuration); every answer
is streamed (ignore_eos) and timed by the client: TTFT (send -> first token) and TPOT
((last - first) / (tokens - 1)). A request attains the SLO when TTFT <= `--slo-ttft`
and TPOT <= `--slo-tpot`.

Configurations (`--configs`): `static-1p2d` and `static-2p1d` (never flip), `tetriinfer`
and `distserve` (`--prefill 1 --decode 2` to start, the watcher on: `--replan-interval`,
`--replan-window` / `--flip-idle-seconds`; the distserve policy reads `--profile`, made
with `pdserve profile --threads 1 --quick` when not given). The order of the
configurations rotates over `--repeats`.

Reported per configuration: attainment over the whole run (the figure the issue's target
compares: the elastic cluster's at least 1.3x the better static placement's), per phase
(goodput: requests/s that attained), per `--bucket` seconds of arrival time (the plot),
and the flips with their times. JSON (`--out`) has every request's figures.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

TREE = Path(__file__).resolve().parents[1]

CONFIGS: dict[str, list[str]] = {
    "static-1p2d": ["--prefill", "1", "--decode", "2"],
    "static-2p1d": ["--prefill", "2", "--decode", "1"],
    "tetriinfer": ["--prefill", "1", "--decode", "2", "--flip-policy", "tetriinfer"],
    "distserve": ["--prefill", "1", "--decode", "2", "--flip-policy", "distserve"],
}


@dataclass(frozen=True)
class Planned:
    at: float  # seconds from the start
    phase: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    at: float
    phase: str
    ttft: float | None
    tpot: float | None
    tokens: int
    error: str | None


def workload(args: argparse.Namespace) -> list[Planned]:
    rng = random.Random(args.seed)
    out: list[Planned] = []
    for phase, start, rate, prompt, output in (
        ("A", 0.0, args.rate_a, args.prompt_a, args.output_a),
        ("B", args.phase_seconds, args.rate_b, args.prompt_b, args.output_b),
    ):
        t = start + rng.expovariate(rate)
        while t < start + args.phase_seconds:
            ids = [rng.randrange(100, 40000) for _ in range(prompt)]
            out.append(Planned(t, phase, ids, output))
            t += rng.expovariate(rate)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(flags: list[str], timeout_s: float = 300.0) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    fd, log = tempfile.mkstemp(prefix="bench_shift_", suffix=".log")
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)]
    cmd += ["--enable-debug-endpoints", *flags]
    with open(fd, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=TREE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server {' '.join(flags)} did not start; log {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def one(url: str, p: Planned, t0: float, out: list[Result]) -> None:
    body = {"prompt": p.prompt, "max_tokens": p.max_tokens, "ignore_eos": True}
    body |= {"temperature": 0, "stream": True}
    sent = time.monotonic()
    arrivals: list[float] = []
    error = None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}"
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    arrivals.append(time.monotonic())
    except httpx.HTTPError as e:
        error = str(e)
    ttft = arrivals[0] - sent if arrivals else None
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
    out.append(Result(sent - t0, p.phase, ttft, tpot, len(arrivals), error))


def run_config(name: str, args: argparse.Namespace, plan: list[Planned]) -> dict[str, Any]:
    flags = list(CONFIGS[name])
    if name != "static-1p2d" and name != "static-2p1d":
        flags += ["--replan-interval", str(args.replan_interval)]
    if name == "tetriinfer":
        flags += ["--flip-idle-seconds", str(args.window), "--flip-idle-load", "0.3"]
        flags += ["--flip-busy-load", "0.6"]
    if name == "distserve":
        flags += ["--flip-profile", args.profile, "--replan-window", str(args.window)]
        flags += ["--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot)]
        flags += ["--replan-min-requests", "5"]
    proc, url = start(flags)
    try:
        warm = {"prompt": [100] * 8, "max_tokens": 4}
        httpx.post(url + "/v1/completions", json=warm, timeout=120)
        results: list[Result] = []
        threads = []
        t0 = time.monotonic()
        wall0 = time.time()
        for p in plan:
            time.sleep(max(0.0, t0 + p.at - time.monotonic()))
            t = threading.Thread(target=one, args=(url, p, t0, results), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(600)
        elastic = (
            httpx.get(url + "/debug/cluster", timeout=30).json()["controller"].get("elastic", {})
        )
    finally:
        stop(proc)
    flips = [
        {"at": d["at"] - wall0, "instance": d["instance"], "role": d["role"]}
        for d in elastic.get("decisions", [])
        if d.get("flipped")
    ]
    return {"config": name, "results": [asdict(r) for r in results], "flips": flips}


def attains(r: dict[str, Any], args: argparse.Namespace) -> bool:
    return (
        r["error"] is None
        and r["ttft"] is not None
        and r["ttft"] <= args.slo_ttft
        and (r["tpot"] or 0.0) <= args.slo_tpot
    )


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rs = run["results"]
    ok = [attains(r, args) for r in rs]
    by_phase = {}
    for phase in ("A", "B"):
        mine = [a for a, r in zip(ok, rs, strict=True) if r["phase"] == phase]
        by_phase[phase] = {
            "attainment": sum(mine) / len(mine) if mine else None,
            "goodput": sum(mine) / args.phase_seconds,
        }
    buckets = []
    end = 2 * args.phase_seconds
    t = 0.0
    while t < end:
        mine = [a for a, r in zip(ok, rs, strict=True) if t <= r["at"] < t + args.bucket]
        buckets.append(sum(mine) / len(mine) if mine else None)
        t += args.bucket
    ttfts = [r["ttft"] for r in rs if r["ttft"] is not None]
    tpots = [r["tpot"] for r in rs if r["tpot"] is not None]
    return {
        "config": run["config"],
        "attainment": sum(ok) / len(ok) if ok else 0.0,
        "phases": by_phase,
        "buckets": buckets,
        "flips": run["flips"],
        "ttft_p50": statistics.median(ttfts) if ttfts else None,
        "tpot_p50": statistics.median(tpots) if tpots else None,
        "errors": sum(r["error"] is not None for r in rs),
    }


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = [args.bucket * (i + 0.5) for i in range(len(rows[0]["buckets"]))]
    for row in rows:
        line = ax.plot(xs, row["buckets"], marker="o", label=f"{row['config']} "
                       f"({row['attainment']:.0%} overall)")[0]  # fmt: skip
        for f in row["flips"]:
            ax.axvline(f["at"], color=line.get_color(), linestyle=":", alpha=0.8)
            ax.annotate(f"{f['instance']}->{f['role'][0].upper()}", (f["at"], 0.02),
                        rotation=90, fontsize=7, color=line.get_color())  # fmt: skip
    ax.axvline(args.phase_seconds, color="black", linewidth=1)
    ax.set_xlabel("arrival time (s): long prompts, short answers | short prompts, long answers")
    ax.set_ylabel(f"SLO attainment (TTFT <= {args.slo_ttft:g} s, TPOT <= {args.slo_tpot:g} s)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Workload shift on 3 instances: static placements vs flip policies")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def ensure_profile(args: argparse.Namespace) -> None:
    if args.profile:
        return
    path = Path(tempfile.gettempdir()) / "bench_shift_profile.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "profile", "--threads", "1", "--quick"]
    subprocess.run([*cmd, "--output", str(path)], check=True, cwd=TREE)
    args.profile = str(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--phase-seconds", type=float, default=60.0)
    p.add_argument("--rate-a", type=float, default=1.2)
    p.add_argument("--prompt-a", type=int, default=300)
    p.add_argument("--output-a", type=int, default=8)
    p.add_argument("--rate-b", type=float, default=2.0)
    p.add_argument("--prompt-b", type=int, default=16)
    p.add_argument("--output-b", type=int, default=96)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--replan-interval", type=float, default=2.0)
    p.add_argument("--window", type=float, default=15.0, help="replan window / idle seconds")
    p.add_argument("--bucket", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None)
    p.add_argument("--out", default="bench_shift.json")
    p.add_argument("--plot", default=None, help="PNG (default: next to --out)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        print(f"unknown configs {unknown} (choose from {', '.join(CONFIGS)})", file=sys.stderr)
        return 2
    if "distserve" in configs:
        ensure_profile(args)
    plan = workload(args)
    print(f"{len(plan)} requests over {2 * args.phase_seconds:g} s", flush=True)
    runs = []
    for repeat in range(args.repeats):
        order = configs[repeat % len(configs) :] + configs[: repeat % len(configs)]
        for name in order:
            run = run_config(name, args, plan)
            row = summarize(run, args)
            print(f"  repeat {repeat} {name}: attainment {row['attainment']:.1%}, flips "
                  f"{[(round(f['at']), f['instance'], f['role']) for f in run['flips']]}",
                  flush=True)  # fmt: skip
            runs.append({**run, "repeat": repeat})
    rows = []
    for name in configs:
        mine = [summarize(r, args) for r in runs if r["config"] == name]
        best = max(mine, key=lambda m: m["attainment"])  # the plotted run: its median below
        median = statistics.median(m["attainment"] for m in mine)
        rows.append({**best, "attainment_median": median})
    print("\n| config | attainment (median) | phase A attainment / goodput | phase B attainment "
          "/ goodput | TTFT p50 | TPOT p50 | flips | errors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["phases"]["A"], r["phases"]["B"]
        print(
            f"| {r['config']} | {r['attainment_median']:.1%} | {a['attainment'] or 0:.1%} / "
            f"{a['goodput']:.2f} req/s | {b['attainment'] or 0:.1%} / {b['goodput']:.2f} req/s"
            f" | {r['ttft_p50'] or 0:.3f} s | {r['tpot_p50'] or 0:.4f} s | {len(r['flips'])}"
            f" | {r['errors']} |"
        )
    static = max((r["attainment_median"] for r in rows if r["config"].startswith("static")),
                 default=None)  # fmt: skip
    for r in rows:
        if not r["config"].startswith("static") and static:
            print(f"{r['config']}: {r['attainment_median'] / static:.2f}x the better static")
    out = Path(args.out)
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "rows": rows}, indent=1))
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(rows, args, png)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
