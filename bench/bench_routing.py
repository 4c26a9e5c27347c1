"""Routing decisions per second with many instances (issue 56, item 3: >= 10,000 a
second at 64 instances).

    .venv/bin/python bench/bench_routing.py [--instances 1,8,64] [--sessions 64]
        [--tokens 1024] [--repeats 3000]

The front end's `Router` (cluster/routing.py) as the controller calls it for a request:
`key` (the prompt's block hashes) then `prefill` (the instance with the fewest prompt
tokens to compute after what its cache holds, by the global prompt tree) for colocated
instances, and `decode` for a disaggregated request's second choice. The instances are
the bench's own stand-ins (name, role, alive and the load counters the router reads:
no process is measured here; `bench_frontend.py` measures the whole front end over stub
instance processes); the prompt tree holds `--sessions` 2,048-token prompts per
instance, and a third of the requests start with one of them (a hit), the rest are new.
Also timed: one load report's upkeep (`on_report` with the stored events of one
2,048-token prompt: the tree's apply), per instance report.

Figures: median and p99 microseconds per call over `--repeats` calls (after 50 warm-up
calls) and decisions/s = 1e6 / median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdserve.cluster.config import ClusterConfig, Routing
from pdserve.cluster.policies import DecodeChooser
from pdserve.cluster.routing import Router
from pdserve.config import Role
from pdserve.kv.block_hash import block_hashes
from pdserve.protocol.core import LoadReport

BLOCK = 16
SESSION_TOKENS = 2048
VOCAB = 49_152


@dataclass
class StandIn:
    """What the router reads of an instance (cluster/instance.py's `Instance`)."""

    name: str
    role: Role
    alive: bool = True
    assigned_prefill_tokens: int = 0
    assigned_requests: int = 0
    assigned_heavy: int = 0
    report: LoadReport | None = None  # the last load report (None: room assumed)


def prompt(rng: random.Random, n: int) -> list[int]:
    ids: list[int] = np.random.default_rng(rng.getrandbits(64)).integers(0, VOCAB, n).tolist()
    return ids


def timed(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    for _ in range(50):
        call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e6 * statistics.median(times), 1e6 * times[int(0.99 * (len(times) - 1))]


def one(n: int, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(n)
    config = ClusterConfig(num_colocated=n, routing=Routing.PREFIX)
    router = Router(config, BLOCK, DecodeChooser(config.decode_policy))
    colocated = [StandIn(f"colocated-{i}", Role.COLOCATED) for i in range(n)]
    decode = [StandIn(f"decode-{i}", Role.DECODE) for i in range(n)]
    held: list[list[int]] = []
    now = time.monotonic()
    for inst in colocated + decode:
        inst.assigned_prefill_tokens = rng.randrange(4096)
        inst.assigned_requests = rng.randrange(32)
        for _ in range(args.sessions):
            p = prompt(rng, SESSION_TOKENS)
            router.trees[inst.role].apply(inst.name, block_hashes(p, BLOCK), [], now)
            held.append(p)
    requests = []
    for i in range(args.repeats + 50):
        if i % 3 == 0:
            start = rng.choice(held)[: args.tokens // 2]
            requests.append(start + prompt(rng, args.tokens - len(start)))
        else:
            requests.append(prompt(rng, args.tokens))
    it = iter(requests * 2)

    def route() -> None:
        key = router.key(next(it), None)
        router.prefill(colocated, key)

    def route_decode() -> None:
        key = router.key(next(it), None)
        router.decode(decode, key, args.tokens // BLOCK + 1)

    report_prompts = iter([block_hashes(prompt(rng, SESSION_TOKENS), BLOCK) for _ in range(400)])

    def report() -> None:
        stored = next(report_prompts, None)
        if stored is None:
            return
        r = LoadReport(time.monotonic(), 0, 0, 0, 0, 0, 0, 0, 0, cache_stored=list(stored))
        router.on_report(colocated[0], r)

    route_us, route_p99 = timed(route, args.repeats)
    it = iter(requests * 2)
    dec_us, dec_p99 = timed(route_decode, args.repeats)
    rep_us, rep_p99 = timed(report, 300)
    return {
        "instances": n,
        "route_us": route_us,
        "route_p99_us": route_p99,
        "decisions_per_s": 1e6 / route_us,
        "decode_us": dec_us,
        "decode_p99_us": dec_p99,
        "report_us": rep_us,
        "report_p99_us": rep_p99,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", default="1,8,64")
    p.add_argument("--sessions", type=int, default=64, help="2,048-token prompts per instance")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per request's prompt")
    p.add_argument("--repeats", type=int, default=3000)
    args = p.parse_args()
    print(
        "| instances | key + prefill us (p99) | decisions/s | key + decode us (p99) | "
        "report upkeep us (p99) |"
    )
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.instances.split(",")):
        r = one(n, args)
        print(
            f"| {n} | {r['route_us']:.1f} ({r['route_p99_us']:.1f}) | "
            f"{r['decisions_per_s']:.0f} | {r['decode_us']:.1f} ({r['decode_p99_us']:.1f}) | "
            f"{r['report_us']:.1f} ({r['report_p99_us']:.1f}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
