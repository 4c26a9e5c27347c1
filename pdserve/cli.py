"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from pdserve.bench.cli import add_bench_parser
from pdserve.cluster.status import add_cluster_parser
from pdserve.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from pdserve.planner.cli import add_plan_parser
from pdserve.planner.profiler import add_profile_parser
from pdserve.predictor.cli import add_predictor_parser

if TYPE_CHECKING:
    from pdserve.cluster.config import ClusterConfig
    from pdserve.config import EngineConfig
    from pdserve.planner.replan import ProfileSplitPlanner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub.add_parser("generate", help="complete one prompt and print the text"))
    _add_serve(sub.add_parser("serve", help="serve the OpenAI API over HTTP"))
    add_bench_parser(sub)
    add_cluster_parser(sub)
    add_plan_parser(sub)
    add_profile_parser(sub)
    add_predictor_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (InvalidRequestError, ModelLoadError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except EngineDeadError as e:  # an instance failed to start (it says why), no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1


def add_quantization_flag(p: argparse.ArgumentParser) -> None:
    """--quantization, shared by `generate` and `serve` (pdserve/model/loader.py)."""
    from pdserve.config import ACTIVATIONS, QUANTIZATIONS, EngineConfig

    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=EngineConfig.quantization,
        help="how weights are held: gguf = a GGUF file's blocks (Q8_0, Q4_0/1, Q5_0/1, Q4_K, "
        "Q5_K, Q6_K) read directly "
        "by the compiled kernels; q8_0/q4_0 = quantize a HF model's fp weights at load; "
        "none = fp32; auto = gguf where the file and this install allow it, else none "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default=EngineConfig.activations,
        help="how the quantized kernels take activations: int8 = rounded per 32 values "
        "and multiplied as integers (llama.cpp's method and default; 2-4x faster "
        "products, needs AVX2, fastest with AVX-512 VNNI; perplexity +0.5%% on SmolLM2, "
        "greedy text can differ from fp32's); fp32 = exact (the fp32 model's text); "
        "auto = int8 where the weights are quantized and this CPU runs it, else fp32 "
        "(default: %(default)s)",
    )


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """--device, --dtype and --kv-cache-dtype, shared by `generate` and `serve`."""
    from pdserve.config import KV_CACHE_DTYPES, EngineConfig
    from pdserve.kv.layout import DTYPE_SIZES

    p.add_argument(
        "--device",
        default=EngineConfig.device,
        help="where the model and its KV cache live: cpu, cuda or cuda:N (a CUDA build of "
        "torch; colocated instances only, as the KV transports between prefill and decode "
        "instances move host memory; default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPE_SIZES),
        default=EngineConfig.dtype,
        help="weights and activations of fp weights; quantized weights are served "
        "in float32 (default: %(default)s)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=EngineConfig.kv_cache_dtype,
        help="what the KV cache holds: auto = float16 under quantized weights (as llama.cpp; "
        "half the bytes to read, hold and move, widened exactly as the attention reads "
        "them) and --dtype under fp weights (default: %(default)s)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=EngineConfig.tensor_parallel_size,
        metavar="T",
        help="split the engine over T processes, each holding whole GQA groups of every "
        "layer's heads and a share of its MLP columns, summed over a gloo (CPU) or NCCL "
        "group; the threads are shared among them (docs/parallelism.md; default: "
        "%(default)s)",
    )
    p.add_argument(
        "--microbatch-swap-blocks",
        type=int,
        default=EngineConfig.microbatch_swap_blocks,
        metavar="S",
        help="DéjàVu's microbatch swapping on pipeline stages: each stage computes from a "
        "staging area of S blocks (two micro-batches' worth, each at least one "
        "--max-model-len sequence), every block living in the pool proper; 0: off "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of the engine (split among cluster instances and among an "
        "instance's ranks; default: all cores)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=EngineConfig.pipeline_parallel_size,
        metavar="P",
        help="split the layers into P stages, each of --tensor-parallel-size processes; "
        "a step's rows pass through them in micro-batches so the stages overlap; the "
        "threads are shared among all T x P processes (docs/parallelism.md; default: "
        "%(default)s)",
    )


def add_decode_burst_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--decode-burst, shared by `generate` and `serve` (engine/core.py, decode bursts)."""
    from pdserve.config import SchedulerConfig

    p.add_argument(
        "--decode-burst",
        type=int,
        default=SchedulerConfig.decode_burst,
        metavar="N",
        help="while every running request decodes greedily and nothing waits, run up to N "
        "steps in one compiled call (at most ~25 ms of them; their tokens stream together); "
        "1: off (default: %(default)s)",
    )


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    add_quantization_flag(p)
    add_device_flags(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--stats", action="store_true", help="print timing to stderr")
    add_decode_burst_flag(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from pdserve.config import EngineConfig, SchedulerConfig, check_device
    from pdserve.protocol.sampling_params import SamplingParams
    from pdserve.runtime import quiet_openmp_waits

    quiet_openmp_waits()  # before check_device may load torch (runtime.py)

    params = SamplingParams(  # validated before the (slow) engine import and model load
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        activations=args.activations,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        num_threads=args.num_threads,
        microbatch_swap_blocks=args.microbatch_swap_blocks,
        max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(decode_burst=args.decode_burst),
    )
    check_device(config.device)
    if config.world_size > 1:  # the layout's usage errors before torch loads
        from pdserve.model.source import load_config, resolve_model
        from pdserve.parallel.layout import check_layout

        check_layout(config, load_config(resolve_model(config.model)))
    from pdserve.engine.engine import Engine

    engine = Engine.from_config(config)
    tok = engine.tokenizer
    if args.raw or not tok.has_chat_template:
        prompt_ids = tok.encode(args.prompt)
    else:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt_ids = tok.encode(text, add_special_tokens=False)
    start = time.perf_counter()
    engine.add_request(prompt_ids, params)
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            n = len(out.token_ids)
    sys.stdout.write("\n")
    if args.stats:
        dt = time.perf_counter() - start
        print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)", file=sys.stderr)
    return 0


def cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6); a bad list is an ArgumentTypeError (a usage error)."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list like 0 or 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise argparse.ArgumentTypeError(f"CPU range {part.strip()!r} runs backwards")
        cpus.extend(range(first, last + 1))
    return tuple(sorted(set(cpus)))


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF folder or .gguf (default: SmolLM2); stub:RATE with --allow-stub: stub "
        "instances, a token source at RATE tokens/s per request for benchmarking the front "
        "end (docs/bench.md)",
    )
    p.add_argument(
        "--allow-stub",
        action="store_true",
        help="serve stub:RATE (never served without this flag: it is no model)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    add_quantization_flag(p)
    add_device_flags(p)
    p.add_argument(
        "--engine-cpus",
        type=cpu_list,
        default=None,
        metavar="LIST",
        help="run the engine (every instance of a cluster) on these CPUs, e.g. 0 or 0-3,6; "
        "start the server under `taskset` to keep the HTTP front end off them",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute every prompt token (no reuse of cached prefixes)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="at most this many requests run at once"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="token budget of one engine step (prefill chunks and decodes together)",
    )
    p.add_argument(
        "--max-prefill-tokens-with-decodes",
        type=int,
        default=None,
        help="while requests are decoding, a step takes at most this many prompt tokens "
        "(keeps their time between tokens near a decode step's; default 128 on CPU, no "
        "cap on other devices; 0: no cap)",
    )
    add_decode_burst_flag(p)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 503 to new requests while this many wait for the engine (default: no limit)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="answer 413 to request bodies larger than this (default: 4 MiB)",
    )
    p.add_argument(
        "--grammar-timeout",
        type=float,
        default=10.0,
        help="answer 400 to a request whose JSON schema, regex or grammar takes longer "
        "than this many seconds to compile (default: 10; docs/api.md)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="close a connection whose request headers have not all arrived this many "
        "seconds after its first byte (or after it opened) with 408 (default: 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="answer 408 and close the connection when a request body has not all "
        "arrived this many seconds after its headers (default: 30)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / Ctrl-C, let in-flight requests finish for up to this many "
        "seconds (new ones get 503), then cancel them and exit; a second signal exits now",
    )
    p.add_argument(
        "--keep-running-on-engine-failure",
        action="store_true",
        help="keep answering (/health 500, requests 500) after the engine process dies "
        "instead of exiting with status 1",
    )
    p.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve GET /debug/engine (engine counters and a KV-pool integrity check)",
    )
    p.add_argument(
        "--disable-admin-endpoints",
        action="store_true",
        help="do not serve the operator's routes (POST /admin/instances/NAME/role: "
        "instance flip; POST /admin/instances, DELETE /admin/instances/NAME: scaling; "
        "docs/elastic.md); with --api-key they need the key",
    )
    _add_cluster(p.add_argument_group("instances and disaggregation"))
    _add_ray(p.add_argument_group("several machines: instances placed by Ray (docs/deploy.md)"))
    _add_scheduling(p.add_argument_group("length-aware scheduling (docs/scheduling.md)"))
    p.set_defaults(func=_serve)


def _add_scheduling(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--predictor",
        default="auto",
        metavar="auto|none|PATH",
        help="output-length head file (pdserve predictor train); auto: the one shipped for "
        "the model, if any; none: policies use prompt length and max_tokens only",
    )
    g.add_argument(
        "--prefill-policy",
        choices=["fcfs", "sjf", "ljf"],
        default="fcfs",
        help="order of waiting prompts within each scheduling batch (default fcfs)",
    )
    g.add_argument(
        "--prefill-sched-batch",
        type=int,
        default=16,
        help="prompts sorted together; a prompt is passed only by later arrivals of its own "
        "batch (default 16)",
    )
    g.add_argument(
        "--decode-policy",
        choices=["least-loaded", "power-of-two", "length-aware", "random", "imbalance"],
        default="least-loaded",
        help="which decode instance takes a prefilled request (default least-loaded)",
    )
    g.add_argument(
        "--decode-admission",
        choices=["greedy", "reserve-static", "reserve-dynamic", "past-future"],
        default="greedy",
        help="when a prefilled request may join a decode batch (default greedy)",
    )
    g.add_argument(
        "--heavy-decode-tokens",
        type=int,
        default=128,
        help="a request predicted to generate at least this many tokens is a heavy decode",
    )


def _add_cluster(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="N",
        help="run N prefill instances (with --decode)",
    )
    g.add_argument(
        "--decode", type=int, default=0, metavar="M", help="run M decode instances (with --prefill)"
    )
    g.add_argument(
        "--colocated",
        type=int,
        default=None,
        metavar="K",
        help="run K colocated instances (both phases; default 1 when no --prefill/--decode)",
    )
    g.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="prefill instances: tokens per prefill-only chunk (default: --max-num-batched-tokens)",
    )
    for role in ("prefill", "decode"):
        g.add_argument(
            f"--{role}-tp",
            type=int,
            default=None,
            metavar="T",
            help=f"{role} instances: --tensor-parallel-size (default: that flag's); the KV "
            "moves between any two layouts (docs/parallelism.md)",
        )
        g.add_argument(
            f"--{role}-pp",
            type=int,
            default=None,
            metavar="P",
            help=f"{role} instances: --pipeline-parallel-size (default: that flag's)",
        )
    g.add_argument(
        "--transfer-mode",
        choices=["pull", "layer-push", "request-push"],
        default="pull",
        help="how KV moves from prefill to decode (default: pull)",
    )
    g.add_argument(
        "--kv-transport",
        choices=["shm", "tcp", "auto"],
        default=None,
        help="how KV moves between instances: shm (one host), tcp, or auto: shm between "
        "instances on one node, tcp between nodes (default: auto with --ray, else shm)",
    )
    g.add_argument(
        "--instance-timeout",
        type=float,
        default=1.0,
        help="mark an instance dead after this many seconds without a message (its "
        "heartbeats come every 0.1 s whatever it computes)",
    )
    g.add_argument(
        "--kv-wait",
        type=float,
        default=2.0,
        help="a request waiting for a KV copy into its instance (a prefix fetch, the "
        "previous turn's return, a move off a flipping instance) waits at most this many "
        "seconds, then is computed there anyway",
    )
    g.add_argument(
        "--flip-timeout",
        type=float,
        default=60.0,
        help="instance flip (POST /admin/instances/NAME/role): give a flip up after this "
        "many seconds without the instance drained and switched; it keeps its old role",
    )
    g.add_argument(
        "--flip-policy",
        choices=["none", "tetriinfer", "distserve"],
        default="none",
        help="the transition watcher (docs/elastic.md): tetriinfer flips an instance out "
        "of a role that stayed under --flip-idle-load for --flip-idle-seconds while the "
        "other role was saturated; distserve runs the planner on the last "
        "--replan-window of requests (--flip-profile, --slo-ttft, --slo-tpot) and flips "
        "toward its best prefill:decode split; none (the default) flips only by hand",
    )
    g.add_argument(
        "--replan-interval",
        type=float,
        default=10.0,
        help="seconds between the transition watcher's looks at the load",
    )
    g.add_argument(
        "--flip-idle-load",
        type=float,
        default=0.1,
        help="tetriinfer policy: a role's load (the fraction of time its instances spend "
        "in steps) under which it counts as idle",
    )
    g.add_argument(
        "--flip-idle-seconds",
        type=float,
        default=60.0,
        help="tetriinfer policy: how long a role must stay idle (and the evidence window)",
    )
    g.add_argument(
        "--flip-busy-load",
        type=float,
        default=0.8,
        help="tetriinfer policy: the other role's mean load that counts as saturated",
    )
    g.add_argument(
        "--flip-profile",
        default=None,
        help="distserve policy: this machine's profile (`pdserve profile --threads T`, T "
        "the threads each instance runs)",
    )
    g.add_argument("--slo-ttft", type=float, default=None, help="distserve policy: seconds")
    g.add_argument("--slo-tpot", type=float, default=None, help="distserve policy: seconds")
    g.add_argument(
        "--slo-attainment",
        type=float,
        default=0.9,
        help="distserve policy: the share of requests that must meet both SLOs",
    )
    g.add_argument(
        "--replan-window",
        type=float,
        default=60.0,
        help="distserve policy: seconds of finished requests it replans for",
    )
    g.add_argument(
        "--replan-gain",
        type=float,
        default=0.2,
        help="distserve policy: flip only when the best split's predicted goodput beats the "
        "running split's by more than this fraction (hysteresis)",
    )
    g.add_argument(
        "--replan-min-requests",
        type=int,
        default=20,
        help="distserve policy: the fewest finished requests in a window it judges on",
    )
    g.add_argument(
        "--min-instances",
        type=int,
        default=None,
        help="distserve policy: it may remove idle instances down to this many (drained "
        "first; default: the number started)",
    )
    g.add_argument(
        "--max-instances",
        type=int,
        default=None,
        help="distserve policy: it may add instances, where the launcher has room (free "
        "cores; with --ray, a node with the instance's resources free), up to this many "
        "(default: the number started)",
    )
    g.add_argument(
        "--max-migrations",
        type=int,
        default=2,
        help="times a request may move off a failed instance before it fails (default 2)",
    )
    g.add_argument(
        "--kv-replication",
        action="store_true",
        help="stream each decoding instance's KV to a peer; a lost request resumes from it",
    )
    g.add_argument(
        "--routing",
        choices=["prefix", "session", "least-load"],
        default="prefix",
        help="where a request is prefilled: the instance whose cache holds most of its prompt "
        "unless its queue is longer by more than that (prefix), a session's instances "
        "(session: the user field or X-Session-Id header), or the shortest queue (least-load)",
    )
    g.add_argument(
        "--pd-caching",
        type=int,
        choices=[1, 2, 3],
        default=3,
        help="caching over disaggregation (MemServe): 1 at prefill only, 2 also at decode, "
        "3 also returns each finished request's KV to its prefill instance (default 3)",
    )
    g.add_argument(
        "--no-prefix-fetch",
        action="store_true",
        help="prefix routing: never copy a cached prefix from another instance before a "
        "prefill (by default it is copied when that is cheaper than computing it)",
    )
    g.add_argument(
        "--prefix-ttl",
        type=float,
        default=300.0,
        help="seconds a prompt-tree entry lives without a refresh (default 300)",
    )
    g.add_argument(
        "--prefix-tree-max-entries",
        type=int,
        default=1_000_000,
        help="cap on (block, instance) entries of each prompt tree (default 1000000)",
    )
    g.add_argument(
        "--decode-balance",
        type=int,
        default=2,
        help="prefix/session routing: a decode instance holding the prefix is preferred while "
        "it runs at most this many more requests than the least loaded (default 2)",
    )
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0)
    g.add_argument(
        "--kv-lease", type=float, default=60.0, help="pull: seconds unclaimed prefill KV is kept"
    )
    g.add_argument("--kv-verify-checksum", action="store_true", help="tcp: crc32 every payload")
    g.add_argument("--kv-fault-rate", type=float, default=0.0, help="inject transfer failures")
    g.add_argument("--kv-fault-delay", type=float, default=0.0, help="seconds added per transfer")
    g.add_argument(
        "--kv-fault-bandwidth", type=float, default=None, help="cap transfers at BYTES per second"
    )
    g.add_argument("--kv-fault-seed", type=int, default=None)
    g.add_argument(
        "--kv-fault-scope",
        choices=["all", "cache"],
        default="all",
        help="the transfers the faults hit: all, or only cache copies (returns, prefix fetches)",
    )


def _add_ray(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--ray",
        action="store_true",
        help="start the instances as Ray actors on the nodes of a Ray cluster (pip install "
        "pdserve[ray]); without it every instance is a child process of the server",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join: 'auto', HOST:PORT of its head (default: RAY_ADDRESS, "
        "else a new one-node cluster on this machine)",
    )
    g.add_argument(
        "--ray-restart",
        action="store_true",
        help="with --ray: start a dead instance again (a new actor, on its node while that "
        "node lives); it rejoins the cluster empty",
    )
    g.add_argument(
        "--placement",
        default=None,
        metavar="JSON",
        help="with --ray: run the instances a `pdserve plan` placement names, on its nodes",
    )


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.server.flags import check_serve_flags, listen

    flags, cluster = check_serve_flags(args)  # usage errors before the server's ~5 s import
    planner = _split_planner(args, flags, cluster)
    listener = listen(args.host, args.port)
    if not args.ray:
        from pdserve.cluster import forkserver

        forkserver.start()  # the instances' imports, beside the server's (cluster/forkserver.py)
    from pdserve.server.launch import serve

    return asyncio.run(serve(args, flags, cluster, listener, planner))


def _split_planner(
    args: argparse.Namespace, flags: EngineConfig, cluster: ClusterConfig
) -> ProfileSplitPlanner | None:
    """The distserve flip policy's planner (planner/replan.py), built here: the
    controller sits below the planner and is handed it. None for other policies."""
    if cluster.flip_policy != "distserve":
        return None
    from pdserve.planner.candidates import InstanceKnobs
    from pdserve.planner.hardware import load_profile
    from pdserve.planner.model_spec import resolve_model_spec
    from pdserve.planner.replan import ProfileSplitPlanner
    from pdserve.planner.search import SLOTarget

    if args.flip_profile is None or args.slo_ttft is None or args.slo_tpot is None:
        raise ValueError(
            "--flip-policy distserve needs --flip-profile (pdserve profile's output), "
            "--slo-ttft and --slo-tpot"
        )
    from pdserve.cluster.config import role_scheduler
    from pdserve.config import Role

    decode = role_scheduler(cluster, flags, Role.DECODE)
    prefill = role_scheduler(cluster, flags, Role.PREFILL)
    knobs = InstanceKnobs(
        decode.max_num_seqs, prefill.max_num_batched_tokens, decode.max_num_batched_tokens
    )
    return ProfileSplitPlanner(
        resolve_model_spec(args.model),
        load_profile(args.flip_profile),
        SLOTarget(args.slo_ttft, args.slo_tpot, args.slo_attainment),
        knobs,
    )


if __name__ == "__main__":
    sys.exit(main())
