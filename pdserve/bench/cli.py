"""`pdserve bench`: run, compare, plot, stub-server, overhead.

    pdserve bench run --base-url URL --workload chatbot --request-rates 1,2,4 \
        --slo ttft:250 tpot:100
    pdserve bench compare URL_A URL_B --workload LPHD --request-rates 1,2 --search-goodput ...
    pdserve bench plot results.json
    pdserve bench stub-server --port 8100
    pdserve bench overhead

Flag names follow `vllm bench serve` where the two overlap (--base-url, --endpoint,
--model, --tokenizer, --num-prompts, --request-rate, --burstiness, --max-concurrency,
--seed, --random-*, --dataset-path, --num-warmups, --disable-tqdm; --goodput is an
alias of --slo and takes the same KEY:MS values).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdserve.bench.config import (
    ENDPOINTS,
    SLO,
    ArrivalConfig,
    BenchInputError,
    PlanConfig,
    RequestOptions,
    SearchConfig,
    Target,
)
from pdserve.workload.errors import WorkloadInputError

SYNTHETIC_DEFAULT_PROMPTS = 200


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` and its subcommands to a `pdserve` subparsers object."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmark OpenAI-compatible servers (SLO attainment, goodput)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = bench.add_subparsers(dest="bench_command", required=True)
    run = sub.add_parser("run", help="benchmark one server")
    run.add_argument("--base-url", default=None, help="server root (default http://HOST:PORT)")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8000)
    _add_common(run)
    run.set_defaults(func=_run_cli)
    cmp = sub.add_parser("compare", help="the same requests against several servers, interleaved")
    cmp.add_argument(
        "urls", nargs="+", metavar="URL", help="server roots; the first is the baseline"
    )
    cmp.add_argument("--labels", default=None, help="comma-separated names (default A,B,...)")
    _add_common(cmp)
    cmp.set_defaults(func=_compare_cli)
    plot = sub.add_parser(
        "plot", help="regenerate the PNG plots (and the table) from a results file"
    )
    plot.add_argument("results", type=Path)
    plot.add_argument("--out-dir", type=Path, default=None, help="default: RESULTS_STEM-plots/")
    plot.set_defaults(func=_plot_cli)
    from pdserve.bench.stub_server import add_stub_parser

    add_stub_parser(sub.add_parser("stub-server", help="an instant OpenAI streaming stand-in"))
    from pdserve.bench.overhead import add_overhead_parser

    add_overhead_parser(sub.add_parser("overhead", help="measure the load generator on the stub"))
    return bench


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    g.add_argument("--model", default=None, help="model name sent (default: the /v1/models id)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument(
        "--num-instances",
        default=None,
        help="instances (devices) per server for per-instance goodput, one value or "
        "one per server (default: the model card's num_instances, else 1)",
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        "--dataset-name",
        dest="workload",
        default="random",
        help="random, chatbot, code, summarization, LPLD, LPHD, HPLD, HPHD, mixed, sessions, file",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF folder, .gguf or hub name of the served model's tokenizer "
        "(default: the shipped SmolLM2)",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests (default {SYNTHETIC_DEFAULT_PROMPTS}; file: every line)",
    )
    g.add_argument("--seed", type=int, default=0, help="for prompts, lengths and arrivals")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--session-style", default="chat", help="sessions: chat, docqa or react")
    g.add_argument(
        "--share-ratio",
        type=int,
        default=1,
        help="sessions: K sessions per context, each drawn session sent K times (MemServe Fig. 14)",
    )
    g.add_argument(
        "--session-turns", type=int, default=None, help="sessions: exactly N turns per session"
    )
    g.add_argument("--dataset-path", default=None, help="file: JSONL trace or ShareGPT JSON")
    g.add_argument("--multi-turn", action="store_true", help="file/ShareGPT: whole conversations")
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        default=None,
        help="requests/s, Poisson (burstiness 1) or gamma; inf: all at once "
        "(default: inf, or a trace's own times)",
    )
    g.add_argument("--request-rates", default=None, help="comma-separated rates to sweep")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--repeats", type=int, default=1, help="runs per rate and server")
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that refuse it)",
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, help="JSON object merged into every body")
    g = p.add_argument_group("SLO and goodput")
    g.add_argument(
        "--slo",
        "--goodput",
        dest="slo",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="objectives in ms: ttft:250 tpot:100 e2el:5000",
    )
    g.add_argument("--attainment-target", type=float, default=0.9)
    g.add_argument(
        "--search-goodput",
        action="store_true",
        help="after the sweep, bisect for the highest rate meeting the target",
    )
    g.add_argument("--search-iters", type=int, default=4, help="extra runs per server")
    g.add_argument("--search-tolerance", type=float, default=0.05, help="relative bracket width")
    g.add_argument("--slo-scales", default=None, help="comma-separated SLO scales, e.g. 0.5,1,2")
    g = p.add_argument_group("output")
    g.add_argument(
        "--result-file",
        type=Path,
        default=None,
        help="results JSON (default bench-results/<time>-<workload>.json)",
    )
    g.add_argument("--plot-dir", type=Path, default=None, help="default: RESULT_STEM-plots/")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--disable-tqdm", action="store_true")


# ---- argument -> config -------------------------------------------------------------


def _floats(text: str | None, flag: str) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BenchInputError(f"{flag} {text!r}: expected comma-separated numbers") from None


def _rates(args: argparse.Namespace) -> tuple[float | None, ...]:
    if args.request_rate is not None and args.request_rates is not None:
        raise BenchInputError("give --request-rate or --request-rates, not both")
    text = args.request_rate if args.request_rate is not None else args.request_rates
    if text is None:
        return ()
    return tuple(None if r == float("inf") else r for r in _floats(text, "--request-rate(s)"))


def _targets(args: argparse.Namespace, urls: list[str], labels: list[str]) -> tuple[Target, ...]:
    counts: list[int | None] = [None] * len(urls)
    if args.num_instances:
        parsed = [int(x) for x in _floats(args.num_instances, "--num-instances")]
        if len(parsed) not in (1, len(urls)) or min(parsed) < 1:
            raise BenchInputError("--num-instances: one positive value, or one per server")
        counts = list(parsed * len(urls) if len(parsed) == 1 else parsed)
    return tuple(
        Target(lab, url, args.endpoint, args.model, args.api_key, n)
        for lab, url, n in zip(labels, urls, counts, strict=True)
    )


def _options(args: argparse.Namespace) -> RequestOptions:
    import json

    extra: dict[str, object] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError as e:
            raise BenchInputError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise BenchInputError("--extra-body must be a JSON object")
    if not args.request_timeout > 0:
        raise BenchInputError(f"--request-timeout must be positive, got {args.request_timeout}")
    return RequestOptions(not args.no_ignore_eos, args.temperature, args.request_timeout, extra)


def _arrival(args: argparse.Namespace) -> ArrivalConfig:
    kind = "poisson" if args.burstiness == 1.0 else "gamma"
    return ArrivalConfig(kind, args.burstiness, args.max_concurrency)  # type: ignore[arg-type]


def _workload_options(args: argparse.Namespace) -> Any:
    from pdserve.bench.workloads import WorkloadOptions, canonical_name

    name = canonical_name(args.workload)
    n = args.num_prompts
    if n is None:
        n = 10**9 if name == "file" else SYNTHETIC_DEFAULT_PROMPTS
    return WorkloadOptions(
        name=name,
        num_prompts=n,
        seed=args.seed,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        session_style=args.session_style,
        share_ratio=args.share_ratio,
        session_turns=args.session_turns,
        dataset_path=args.dataset_path,
        multi_turn=args.multi_turn,
        sharegpt_output_len=args.sharegpt_output_len,
    )


# ---- commands -----------------------------------------------------------------------


def _run_cli(args: argparse.Namespace) -> int:
    url = args.base_url or f"http://{args.host}:{args.port}"
    return _bench(args, [url], ["A"])


def _compare_cli(args: argparse.Namespace) -> int:
    if len(args.urls) < 2:
        raise BenchInputError("compare needs at least two server URLs")
    labels = (
        args.labels.split(",")
        if args.labels
        else [chr(ord("A") + i) for i in range(len(args.urls))]
    )
    if len(labels) != len(args.urls) or len(set(labels)) != len(labels):
        raise BenchInputError("--labels: one distinct name per URL")
    return _bench(args, list(args.urls), labels)


def _bench(args: argparse.Namespace, urls: list[str], labels: list[str]) -> int:
    from pdserve.bench import plots, report, results
    from pdserve.bench.experiment import Experiment, run_experiment
    from pdserve.bench.tokens import PromptFactory, load_tokenizer
    from pdserve.bench.workloads import build_workload

    slo = SLO.parse(args.slo)
    if args.slo_scales and not slo.is_set:
        raise BenchInputError("--slo-scales scales the objectives: give them with --slo")
    search = SearchConfig(args.attainment_target, args.search_iters, args.search_tolerance)
    plan = PlanConfig(
        _rates(args),
        args.repeats,
        args.search_goodput,
        _floats(args.slo_scales, "--slo-scales"),
        args.num_warmups,
    )
    targets, options, arrival = _targets(args, urls, labels), _options(args), _arrival(args)
    wopts = _workload_options(args)
    factory = PromptFactory(load_tokenizer(args.tokenizer))
    workload = build_workload(wopts, factory)
    settings = {
        "command": shlex.join(["pdserve", "bench", *sys.argv[1:]]),
        "workload": asdict(wopts),
        "arrival": asdict(arrival),
        "request": asdict(options),
        "plan": asdict(plan),
        "seed": args.seed,
        "tokenizer": args.tokenizer or "shipped SmolLM2-135M GGUF",
    }
    exp = Experiment(targets, workload, arrival, options, plan, slo, search, args.seed, settings)
    path = args.result_file or _default_path(wopts.name)
    try:
        doc = asyncio.run(
            run_experiment(
                exp, factory, lambda d: results.save_json(d, path), progress=not args.disable_tqdm
            )
        )
    except KeyboardInterrupt:
        print(f"\ninterrupted; results so far in {path}", file=sys.stderr)
        return 130
    print(report.render(doc))
    print(f"results: {path}")
    if not args.no_plots:
        out = args.plot_dir or path.with_name(path.stem + "-plots")
        made = plots.plot_all(doc, out)
        print(f"plots: {', '.join(str(p) for p in made)}")
    ok = sum(a["summary"]["completed"] for a in doc["aggregates"])
    return 0 if ok > 0 else 1  # every request failed: say so to scripts


def _default_path(workload: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("bench-results") / f"{stamp}-{workload}.json"


def _plot_cli(args: argparse.Namespace) -> int:
    from pdserve.bench import plots, report, results

    doc = results.load_json(args.results)
    if not doc["complete"]:
        print(f"{args.results}: an interrupted run; summarizing the runs it has", file=sys.stderr)
        results.finish_loaded(doc)
    out = args.out_dir or args.results.with_name(args.results.stem + "-plots")
    print(report.render(doc))
    made = plots.plot_all(doc, out)
    print(f"plots: {', '.join(str(p) for p in made)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.bench`: the `bench` subcommands on their own."""
    parser = argparse.ArgumentParser(prog="pdserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args))
    except WorkloadInputError as e:  # BenchInputError included
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
