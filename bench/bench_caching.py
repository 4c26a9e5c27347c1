"""Cluster-wide caching (issue 18) against real servers: MemServe Fig. 8 (caching x
disaggregation), Fig. 14 (global scheduling policies) and the PD-Caching ablation (§5.1).

    .venv/bin/python bench/bench_caching.py --experiment all --repeats 3 --out bench-results/caching
    .venv/bin/python bench/bench_caching.py --experiment fig8 --quick     # smoke: 1 session
    .venv/bin/python bench/bench_caching.py --experiment ablation --rate-scale 0.5

Every setting is a fresh `python -m pdserve.cli serve` on 127.0.0.1 with `--num-threads 2`
in total (the instances split them), warmed by one short request per instance, driven by
`pdserve bench`'s own runner (`run_experiment`: the `sessions` workload, Poisson arrivals
of every request, the causal rule inside a session, `X-Session-Id` per session), then
stopped (SIGINT, then SIGKILL) and checked: no process of its tree may be left. The same
seeded requests (prompts, lengths, arrival offsets) go to every setting of a workload.

Experiments (`--experiment`, default all):

- fig8: chat, docqa and react sessions against PD = `--colocated 2 --no-prefix-cache`,
  PD-CC = `--colocated 2` (prefix cache, prefix routing), 1P1D = `--prefill 1 --decode 1
  --no-prefix-cache`, 1P1D-CC = `--prefill 1 --decode 1` (PD-Caching-3, prefix routing).
  Mean / p99 JCT (client E2E) and TTFT, the prefix-cache hit rate; ratios 1P1D-CC/1P1D,
  PD-CC/PD and 1P1D/PD. MemServe: caching over disaggregation -17 to -27% JCT, -56 to
  -79% mean TTFT; our target: mean TTFT -50% on docqa and react.
- fig14: docqa sessions at share ratio 1 and 2 (`--share-ratio`: each drawn session sent
  twice, same document and same questions, as MemServe duplicates its set of sessions)
  against `--prefill 2 --decode 1` with `--routing least-load`, `session` and `prefix`:
  mean / p99 TTFT, hit rate. MemServe (3P1D): prompt trees -59% p99 TTFT vs session.
- ablation: chat sessions of exactly 5 turns (`--session-turns 5`) against `--prefill 1
  --decode 1` with `--pd-caching 1`, `2`, `3` and `--no-prefix-cache`: mean TTFT per turn
  index, plotted (`ablation_ttft_per_turn.png`).

Order: within an experiment every setting runs once (A, B, C, ...), and `--repeats N` runs
that whole set N times (A, B, C, A, B, C, ...) so that drift of this shared machine hits
all settings alike; tables give medians over repeats, ratios are medians of the per-repeat
ratios (the settings of one repeat ran minutes apart). Read ratios, not absolute times.

Rates (CHAT, DOCQA, ... below, scaled by `--rate-scale`) were chosen so that the no-cache
setting is busy but not saturated on this 2-core machine under the load other work puts on
it (the reason is printed with each), and request counts so that one run's arrivals span
~40-60 s (`--quick`: one short session per setting, a smoke run). After every run a load
line gives the run's duration against its arrival span and the server's mean queueing vs
prefill time: a no-cache run whose queueing exceeds its prefill time is saturated, and its
rate should come down.

Time: starting a server takes ~30 s of CPU per instance (the model load), ~60-100 s of
wall time on the loaded machine, and every run gets a fresh one (no cache survives from
another run), so a repeat of fig8 (12 runs) takes ~30 min, fig14 (6) ~15 min, the ablation
(4) ~10 min; `--quick` fig8 ~20 min, almost all of it server starts.

Output: a table per experiment in the terminal; `--out DIR` (default
bench-results/caching) gets `results.json` (every run's figures, the tables), `caching.md`
(the tables in markdown, for docs/benchmarks.md), `ablation_ttft_per_turn.png`, and
`runs/*.json` (each run's full `pdserve bench` results file: `pdserve bench plot` reads
it). Both JSON files are rewritten after every run. Exit status: 0; 2 when a server did
not start (twice, a minute apart); 130 on Ctrl-C (the servers are stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_recovery as br
import httpx
import psutil

from pdserve.bench import results
from pdserve.bench.config import (
    SLO,
    ArrivalConfig,
    PlanConfig,
    RequestOptions,
    SearchConfig,
    Target,
)
from pdserve.bench.experiment import Experiment, run_experiment
from pdserve.bench.tokens import PromptFactory, load_tokenizer
from pdserve.bench.workloads import Workload, WorkloadOptions, build_workload

EXPERIMENTS = ("fig8", "fig14", "ablation")
THREADS = ("--num-threads", "2")
START_TIMEOUT_S = 300.0
RETRY_WAIT_S = 60.0
# bench_recovery.start_server puts its BASE_FLAGS (--prefill 1 --decode 2
# --enable-debug-endpoints) first; argparse keeps the last value of a flag, so every
# setting names --prefill and --decode again (0 for colocated).
COLOCATED_2 = ("--prefill", "0", "--decode", "0", "--colocated", "2")
P1D1 = ("--prefill", "1", "--decode", "1")
P2D1 = ("--prefill", "2", "--decode", "1")
NO_CACHE = ("--no-prefix-cache",)


@dataclass(frozen=True)
class Setting:
    name: str
    flags: tuple[str, ...]
    instances: int
    """Warm-up requests sent (one per instance, best effort: the router places them)."""


@dataclass(frozen=True)
class Load:
    """A sessions workload and the rate it is sent at."""

    style: str
    rate: float
    """Requests/s of the whole server (before --rate-scale)."""
    prompts: int
    quick_prompts: int
    why: str
    share_ratio: int = 1
    session_turns: int | None = None

    @property
    def group(self) -> str:
        return self.style if self.share_ratio == 1 else f"{self.style} share {self.share_ratio}"


@dataclass(frozen=True)
class Case:
    experiment: str
    load: Load
    setting: Setting

    @property
    def group(self) -> str:
        return self.load.group


# Rates: measured on this machine (2026-11-24, `--quick` runs, one session at a time, while
# other test suites kept the load average at 3-5 on its 2 cores): without the cache a
# ~1,050-token docqa prompt took 5.6 s to prefill on 1P1D's one prefill thread (8.3 s on a
# colocated instance), a ~1k-token react prompt ~5.3 s, and a 128-token chat answer ~15 s
# of decode (~120 ms a token); a quiet machine is ~3x faster (docs/benchmarks.md: 1 thread
# prefills 1k tokens in ~1.7 s). The rates below keep the no-cache settings busy but short
# of saturation under that load; on a quiet machine `--rate-scale 2` loads them alike.
# Request counts: arrivals over ~40-60 s with the seed-0 Poisson draw (the causal chain of
# a session's turns can make a run longer).
CHAT = Load(
    "chat",
    0.25,
    12,
    3,
    "chat: prompts grow to ~300-900 tokens with the history, answers ~128 tokens: decode "
    "bound (~15 s a request under load, ~5 s quiet); at 0.25 req/s the decode instance "
    "holds ~3-4 streams, batched, and prefill (~2 s a request without the cache) is ~50% busy",
)
DOCQA = Load(
    "docqa",
    0.15,
    10,
    3,
    "docqa: ~1,050-token prompts (a 1,000-token document), 16-token answers: prefill bound; "
    "5.6 s a request without the cache under load (~1.7 s quiet), so 0.15 req/s keeps "
    "1P1D's prefill instance ~85% busy under load (~25% quiet), short of saturation",
)
REACT = Load(
    "react",
    0.15,
    10,
    3,
    "react: an 800-token shared prefix plus steps, ~0.9-1.5k-token prompts, ~80-token "
    "generations; ~5 s of prefill a request without the cache under load, so 0.15 req/s "
    "keeps the no-cache prefill instance ~75-85% busy under load, short of saturation",
)
FIG14_LOADS = tuple(
    Load(
        "docqa",
        0.25,
        16,
        4,  # quick: one document; at share ratio 2 two sessions of 2 questions
        "fig14 docqa on 2P1D: two prefill instances (one thread each; 3 instances on 2 cores), "
        "each ~5-8 s a request under load when it misses the document; 0.25 req/s keeps them "
        "busy but not saturated under least-load routing, where reuse across sessions is luck",
        share_ratio=k,
    )
    for k in (1, 2)
)
ABLATION_LOAD = Load(
    "chat",
    0.25,
    15,
    5,  # quick: one session of 5 turns
    "ablation chat, 5 turns (3 sessions): turn k's prompt carries k answers of ~128 tokens, "
    "so the no-cache prefill grows with the turn; 0.25 req/s as fig8's chat",
    session_turns=5,
)

FIG8_SETTINGS = (
    Setting("PD", (*COLOCATED_2, *NO_CACHE, *THREADS), 2),
    Setting("PD-CC", (*COLOCATED_2, *THREADS), 2),
    Setting("1P1D", (*P1D1, *NO_CACHE, *THREADS), 1),
    Setting("1P1D-CC", (*P1D1, *THREADS), 1),
)
FIG14_SETTINGS = tuple(
    Setting(routing, (*P2D1, "--routing", routing, *THREADS), 2)
    for routing in ("least-load", "session", "prefix")
)
ABLATION_SETTINGS = (
    Setting("no cache", (*P1D1, *NO_CACHE, *THREADS), 1),
    *(Setting(f"PD-Caching-{k}", (*P1D1, "--pd-caching", str(k), *THREADS), 1) for k in (1, 2, 3)),
)


def cases(experiment: str) -> list[Case]:
    """One repeat of an experiment, in run order: each load, every setting in turn."""
    plan: dict[str, tuple[tuple[Load, ...], tuple[Setting, ...]]] = {
        "fig8": ((CHAT, DOCQA, REACT), FIG8_SETTINGS),
        "fig14": (FIG14_LOADS, FIG14_SETTINGS),
        "ablation": ((ABLATION_LOAD,), ABLATION_SETTINGS),
    }
    loads, settings = plan[experiment]
    return [Case(experiment, load, s) for load in loads for s in settings]


# ---- summarizing (pure: tests/test_bench_caching.py) -----------------------------------

KEYS = (
    "mean_e2el_ms",
    "p99_e2el_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "prefix_cache_hit_rate",
    "mean_server_queue_ms",
    "mean_server_prefill_ms",
    "mean_server_transfer_ms",
    "request_throughput",
)


def ttft_by_turn(records: Sequence[dict[str, Any]]) -> list[float | None]:
    """Mean TTFT (ms) of the successful requests at each turn index (0-based; None where
    none succeeded), from a bench results file's records."""
    by: dict[int, list[float]] = {}
    for r in records:
        by.setdefault(r["turn"], [])
        if r["success"] and r["ttft_s"] is not None:
            by[r["turn"]].append(1000.0 * r["ttft_s"])
    top = max(by, default=-1)
    return [statistics.fmean(by[t]) if by.get(t) else None for t in range(top + 1)]


def run_row(case: Case, repeat: int, rate: float, doc: dict[str, Any]) -> dict[str, Any]:
    """One run's figures from its bench results document."""
    run = doc["runs"][0]
    s = run["summary"]
    recs = run["records"]
    return {
        "experiment": case.experiment,
        "group": case.group,
        "setting": case.setting.name,
        "flags": list(case.setting.flags),
        "repeat": repeat,
        "rate": rate,
        "num_requests": s["num_requests"],
        "completed": s["completed"],
        "duration_s": s["duration_s"],
        "arrival_span_s": max((r["scheduled_at_s"] for r in recs), default=0.0),
        **{k: s.get(k) for k in KEYS},
        "ttft_by_turn_ms": ttft_by_turn(recs),
    }


def _pick(rows: Sequence[dict[str, Any]], group: str, setting: str) -> dict[int, dict[str, Any]]:
    return {r["repeat"]: r for r in rows if r["group"] == group and r["setting"] == setting}


def median_of(rows: Sequence[dict[str, Any]], group: str, setting: str, key: str) -> float | None:
    """The median over repeats of `key` (repeats without a value left out)."""
    vals = [r[key] for r in _pick(rows, group, setting).values() if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def paired_ratio(
    rows: Sequence[dict[str, Any]], group: str, num: str, den: str, key: str
) -> float | None:
    """The median over repeats of num/den for `key`, each ratio within one repeat."""
    a, b = _pick(rows, group, num), _pick(rows, group, den)
    ratios = [br.ratio(a[k].get(key), b[k].get(key)) for k in sorted(a.keys() & b.keys())]
    return br.median_or_none(ratios)


def median_by_turn(rows: Sequence[dict[str, Any]], group: str, setting: str) -> list[float | None]:
    """Per turn index, the median over repeats of the run's mean TTFT at that turn."""
    runs = [r["ttft_by_turn_ms"] for r in _pick(rows, group, setting).values()]
    turns = max((len(t) for t in runs), default=0)
    return [br.median_or_none([t[k] if k < len(t) else None for t in runs]) for k in range(turns)]


@dataclass(frozen=True)
class Table:
    title: str
    header: tuple[str, ...]
    rows: list[list[str]]
    notes: list[str]

    def markdown(self) -> str:
        """A markdown table, its columns padded (also the terminal's table)."""
        cells = [list(self.header), *self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(self.header))]

        def line(cs: Sequence[str]) -> str:
            return "| " + " | ".join(c.ljust(w) for c, w in zip(cs, widths, strict=True)) + " |"

        rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        return "\n".join([line(self.header), rule, *(line(r) for r in self.rows)])

    def text(self) -> str:
        return "\n".join([f"## {self.title}", "", self.markdown(), "", *self.notes])


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def rel(v: float | None) -> str:
    """A ratio and the change it means: 0.44 (-56%)."""
    return "-" if v is None else f"{v:.2f} ({100 * (v - 1):+.0f}%)"


LATENCY = (
    ("mean JCT ms", "mean_e2el_ms"),
    ("p99 JCT ms", "p99_e2el_ms"),
    ("mean TTFT ms", "mean_ttft_ms"),
    ("p99 TTFT ms", "p99_ttft_ms"),
)
FIG8_RATIOS = (("1P1D-CC", "1P1D"), ("PD-CC", "PD"), ("1P1D", "PD"))
FIG14_RATIOS = (("prefix", "session"), ("prefix", "least-load"))


def _metric_rows(
    rows: Sequence[dict[str, Any]],
    group: str,
    settings: Sequence[str],
    ratios: Sequence[tuple[str, str]],
    cols: Sequence[tuple[str, str]],
) -> list[list[str]]:
    out = [
        [
            group,
            s,
            *(ms(median_of(rows, group, s, k)) for _, k in cols),
            pct(median_of(rows, group, s, "prefix_cache_hit_rate")),
        ]
        for s in settings
    ]
    for num, den in ratios:
        cells = [rel(paired_ratio(rows, group, num, den, k)) for _, k in cols]
        out.append([group, f"{num} / {den}", *cells, "-"])
    return out


def fig8_table(rows: Sequence[dict[str, Any]]) -> Table:
    groups = [g for g in (CHAT.group, DOCQA.group, REACT.group) if _has(rows, g)]
    body = [
        r
        for g in groups
        for r in _metric_rows(rows, g, [s.name for s in FIG8_SETTINGS], FIG8_RATIOS, LATENCY)
    ]
    notes = [
        "MemServe Fig. 8 (1P2D-CC or 1P1D-CC over the same without caching): ShareGPT JCT "
        "mean -17% / p99 -29%, TTFT -58% / -45%; LooGLE JCT -26.9% / -22.5%, TTFT -56.2% / "
        "-45.2%; ReAct JCT -26.7% / -21.4%, TTFT -78.5% / -84.9%.",
    ]
    for g in (DOCQA.group, REACT.group):
        r = paired_ratio(rows, g, "1P1D-CC", "1P1D", "mean_ttft_ms")
        if r is not None:
            verdict = "met" if r <= 0.5 else "missed"
            notes.append(f"target mean TTFT 1P1D-CC/1P1D <= 0.50 on {g}: {r:.2f}, {verdict}")
    return Table("Fig. 8: caching x disaggregation", _header(LATENCY), body, notes)


def fig14_table(rows: Sequence[dict[str, Any]]) -> Table:
    cols = (("mean TTFT ms", "mean_ttft_ms"), ("p99 TTFT ms", "p99_ttft_ms"), LATENCY[0])
    names = [s.name for s in FIG14_SETTINGS]
    body = [
        r
        for load in FIG14_LOADS
        if _has(rows, load.group)
        for r in _metric_rows(rows, load.group, names, FIG14_RATIOS, cols)
    ]
    notes = ["MemServe Fig. 14 (3P1D, LooGLE): prompt-tree routing -59% p99 TTFT vs session."]
    return Table("Fig. 14: global scheduling policies (2P1D)", _header(cols), body, notes)


def ablation_table(rows: Sequence[dict[str, Any]]) -> Table:
    g = ABLATION_LOAD.group
    turns = max((len(median_by_turn(rows, g, s.name)) for s in ABLATION_SETTINGS), default=0)
    header = (
        "setting",
        *(f"turn {k + 1} TTFT ms" for k in range(turns)),
        "mean TTFT ms",
        "vs no cache",
        "hit rate",
    )
    body = []
    for s in ABLATION_SETTINGS:
        per_turn = median_by_turn(rows, g, s.name)
        per_turn += [None] * (turns - len(per_turn))
        vs = (
            None
            if s is ABLATION_SETTINGS[0]
            else paired_ratio(rows, g, s.name, ABLATION_SETTINGS[0].name, "mean_ttft_ms")
        )
        body.append(
            [
                s.name,
                *(ms(v) for v in per_turn),
                ms(median_of(rows, g, s.name, "mean_ttft_ms")),
                rel(vs),
                pct(median_of(rows, g, s.name, "prefix_cache_hit_rate")),
            ]
        )
    notes = [
        "chat sessions of 5 turns on --prefill 1 --decode 1; PD-Caching-1: cache at prefill; "
        "-2: also at decode; -3: decode returns prompt+answer KV to prefill (MemServe §5.1)."
    ]
    return Table("PD-Caching ablation: mean TTFT per turn", header, body, notes)


def _header(cols: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    return ("workload", "setting", *(c for c, _ in cols), "hit rate")


def _has(rows: Sequence[dict[str, Any]], group: str) -> bool:
    return any(r["group"] == group for r in rows)


TABLES: dict[str, Callable[[Sequence[dict[str, Any]]], Table]] = {
    "fig8": fig8_table,
    "fig14": fig14_table,
    "ablation": ablation_table,
}


def plot_ablation(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Turn index on x, the median over repeats of mean TTFT on y, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = ABLATION_LOAD.group
    if not _has(rows, g):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in ABLATION_SETTINGS:
        ys = median_by_turn(rows, g, s.name)
        pts = [(k + 1, y) for k, y in enumerate(ys) if y is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=s.name)
    ax.set_xlabel("turn index")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("1P1D, chat sessions of 5 turns")
    ax.set_ylim(bottom=0)
    ax.set_xticks(range(1, (ABLATION_LOAD.session_turns or 1) + 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- servers and runs --------------------------------------------------------------------


def start(setting: Setting) -> br.Server:
    """bench_recovery's start (waits for /health, log tail on failure); a second try a
    minute later when the first fails (the machine may be busy with other work)."""
    try:
        return br.start_server(setting.name, setting.flags, START_TIMEOUT_S)
    except br.ServerStartError as e:
        print(f"  {e}\n  retrying in {RETRY_WAIT_S:.0f} s", flush=True)
        time.sleep(RETRY_WAIT_S)
        return br.start_server(setting.name, setting.flags, START_TIMEOUT_S)


def stop(server: br.Server) -> None:
    """Stop the server and make sure no process of its tree is left (then drop its log)."""
    try:
        tree = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    server.stop()
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if left:
        raise RuntimeError(f"{server.label}: processes left after stop: {[p.pid for p in left]}")
    server.log.unlink(missing_ok=True)


def reap_children() -> None:
    """Whatever this script started and is still running (a server whose start was cut
    short by Ctrl-C, and its engines): SIGTERM, then SIGKILL after 30 s."""
    left = psutil.Process().children(recursive=True)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(left, timeout=30)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


def warm_up(url: str, n: int) -> None:
    """One short request per instance, at once, each with other leading words (so prefix
    routing has no reason to send them to one instance); they share no block with the
    workload's prompts."""

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt = " ".join(br.WORDS[i:] + br.WORDS[:i])
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        (await client.post(url + "/v1/completions", json=body)).raise_for_status()

    async def all_of() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(one(client, i) for i in range(n)))

    asyncio.run(all_of())


def run_case(
    case: Case,
    repeat: int,
    workload: Workload,
    factory: PromptFactory,
    args: argparse.Namespace,
    runs_dir: Path,
) -> dict[str, Any]:
    rate = case.load.rate * args.rate_scale
    server = start(case.setting)
    try:
        warm_up(server.url, case.setting.instances)
        exp = Experiment(
            # Chat messages: each turn's history is the server's own answers as assistant
            # messages, so the template re-encodes them token for token (plain-text
            # concatenation can merge tokens where an answer joins its prompt).
            targets=(Target(case.setting.name, server.url, "/v1/chat/completions"),),
            workload=workload,
            arrival=ArrivalConfig("poisson", 1.0, None),
            options=RequestOptions(timeout_s=args.request_timeout),
            plan=PlanConfig(rates=(rate,)),
            slo=SLO(),
            search=SearchConfig(),
            seed=args.seed,
            settings={
                "command": " ".join(["bench/bench_caching.py", *sys.argv[1:]]),
                "experiment": case.experiment,
                "server_flags": list(case.setting.flags),
                "load": asdict(case.load),
            },
        )
        path = (
            runs_dir
            / f"{case.experiment}-{_slug(case.group)}-{_slug(case.setting.name)}-r{repeat}.json"
        )
        doc = asyncio.run(run_experiment(exp, factory, lambda d: results.save_json(d, path), False))
    finally:
        stop(server)
    row = run_row(case, repeat, rate, doc)
    row["file"] = str(path)
    return row


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower())


def load_line(row: dict[str, Any]) -> str:
    def f(key: str) -> str:
        return ms(row.get(key))

    return (
        f"    {row['completed']}/{row['num_requests']} ok in {row['duration_s']:.0f} s (arrivals "
        f"over {row['arrival_span_s']:.0f} s); TTFT mean {f('mean_ttft_ms')} p99 "
        f"{f('p99_ttft_ms')} ms, JCT mean {f('mean_e2el_ms')} ms, hit "
        f"{pct(row['prefix_cache_hit_rate'])}; server queue {f('mean_server_queue_ms')} ms vs "
        f"prefill {f('mean_server_prefill_ms')} ms (mean)"
    )


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_outputs(out: Path, doc: dict[str, Any]) -> None:
    rows = doc["runs"]
    doc["tables"] = {}
    texts = []
    for name in doc["experiments"]:
        if any(r["experiment"] == name for r in rows):
            t = TABLES[name](rows)
            doc["tables"][name] = {"title": t.title, "header": t.header, "rows": t.rows}
            texts.append(t.text())
    results.save_json(doc, out / "results.json")
    head = (
        f"`bench/bench_caching.py {' '.join(doc['argv'])}` at {doc['commit']}, {doc['created']}; "
        f"{doc['repeats']} repeat(s), medians over repeats; ratios: medians of per-repeat ratios."
    )
    (out / "caching.md").write_text("\n\n".join([head, *texts]) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experiment", choices=[*EXPERIMENTS, "all"], default="all")
    p.add_argument("--repeats", type=int, default=1, help="times the whole set runs, interleaved")
    p.add_argument("--quick", action="store_true", help="~10 s of arrivals per setting (smoke)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="every rate times this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workloads",
        type=lambda v: set(v.split(",")),
        default=None,
        help="only these session styles (comma-separated: chat,docqa,react); default all",
    )
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=Path("bench-results/caching"))
    args = p.parse_args(argv)
    if args.repeats < 1 or not args.rate_scale > 0:
        p.error("--repeats must be >= 1 and --rate-scale positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    out = args.out
    factory = PromptFactory(load_tokenizer(None))
    doc: dict[str, Any] = {
        "format": "pdserve-bench-caching/1",
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "commit": _commit(),
        "experiments": names,
        "repeats": args.repeats,
        "quick": args.quick,
        "loads": {},
        "runs": [],
    }
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; out {out}")
    signal.signal(signal.SIGTERM, br._interrupted)  # `timeout` too stops the servers
    try:
        for name in names:
            plan = [
                c for c in cases(name) if args.workloads is None or c.load.style in args.workloads
            ]
            workloads: dict[Load, Workload] = {}
            for load in dict.fromkeys(c.load for c in plan):
                n = load.quick_prompts if args.quick else load.prompts
                opts = WorkloadOptions(
                    name="sessions",
                    num_prompts=n,
                    seed=args.seed,
                    session_style=load.style,
                    share_ratio=load.share_ratio,
                    session_turns=load.session_turns,
                )
                workloads[load] = build_workload(opts, factory)
                rate = load.rate * args.rate_scale
                doc["loads"][f"{name}/{load.group}"] = {
                    **asdict(load),
                    "rate_used": rate,
                    "requests": n,
                }
                print(
                    f"[{name}] {load.group}: {rate:g} req/s, {n} requests in "
                    f"{len(workloads[load].sessions)} sessions. Why: {load.why}"
                )
            for repeat in range(args.repeats):
                for case in plan:
                    print(
                        f"[{name}] repeat {repeat + 1}/{args.repeats}: {case.group} / "
                        f"{case.setting.name} ({' '.join(case.setting.flags)})",
                        flush=True,
                    )
                    row = run_case(case, repeat, workloads[case.load], factory, args, out / "runs")
                    print(load_line(row), flush=True)
                    doc["runs"].append(row)
                    write_outputs(out, doc)
            print("\n" + TABLES[name](doc["runs"]).text() + "\n", flush=True)
    except br.ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted; results so far in {out}", file=sys.stderr)
        return 130
    finally:
        reap_children()
        if doc["runs"]:
            write_outputs(out, doc)
    made = plot_ablation(doc["runs"], out / "ablation_ttft_per_turn.png")
    print(f"results: {out / 'results.json'}, {out / 'caching.md'}" + (f", {made}" if made else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
