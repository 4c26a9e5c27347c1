"""What structured outputs cost: grammar compile times, the mask per token, and TPOT with
a JSON-schema constraint against the same server unconstrained.

    .venv/bin/python bench/bench_structured.py [--requests 6] [--json out.json]

1. Compile (in this process, llguidance as the server uses it, the tokenizer built
   first): a typical schema (5 fields) and a large one (120 fields, nested), cold (a
   new matcher from the grammar text: what an engine does the first time it sees a
   grammar, and the front end's check) and cached (a deep copy of the compiled one:
   every later request with that grammar); and one token mask on the shipped model's
   49k vocabulary. Medians of `--repeats`.
2. TPOT over real servers, each started alone (`pdserve serve`, colocated, then
   `--prefill 1 --decode 1`): greedy streamed chat requests, unconstrained
   (`ignore_eos`, 96 tokens), "one-step" (the same with a -100 bias on a token never
   chosen: a constrained row without a grammar, so no decode burst and the full sampler)
   and under a JSON schema that makes ~100 tokens (a list of short notes), in the order
   A B C C B A so drift on a shared machine falls on all; 1 stream (`--requests` of
   each) and 16 concurrent streams (two rounds of each). TPOT = first to last token over
   the tokens after the first, from the client's clock, median over requests. The
   ratios: json_schema / unconstrained (what a user sees) and json_schema / one-step
   (the grammar's own cost: its mask is computed while the forward pass runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx
import llguidance
import llguidance.numpy

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_server import free_port

from pdserve.grammar.compiler import LIMITS, ll_tokenizer
from pdserve.grammar.requests import json_schema
from pdserve.model.source import resolve_model
from pdserve.model.tokenizer import Tokenizer

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}


def large_schema(n: int = 120) -> dict:
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "label": {"type": "string", "pattern": "^[A-Z][a-z]{2,12}$"},
            "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
            "weights": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        },
        "required": ["id", "label", "kind"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {f"field_{i}": item for i in range(n)},
        "required": [f"field_{i}" for i in range(0, n, 3)],
        "additionalProperties": False,
    }


NOTES = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 30},
            "minItems": 10,
            "maxItems": 10,
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}


def compile_figures(repeats: int) -> dict[str, float]:
    tok = ll_tokenizer(Tokenizer.from_model_path(resolve_model(None)).backend, 49152)
    out: dict[str, float] = {}
    for name, schema in (("typical", TYPICAL), ("large", large_schema())):
        grammar = json_schema(schema, "schema").grammar
        cold, cached = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            m = llguidance.LLMatcher(tok, grammar, log_level=0, limits=LIMITS)
            cold.append(time.perf_counter() - t)
            assert not m.is_error(), m.get_error()
            t = time.perf_counter()
            m.deep_copy()
            cached.append(time.perf_counter() - t)
        out[f"{name}_cold_ms"] = round(statistics.median(cold) * 1000, 3)
        out[f"{name}_cached_ms"] = round(statistics.median(cached) * 1000, 4)
        bitmask = llguidance.numpy.allocate_token_bitmask(1, 49152)  # as the engine fills it
        masks = []
        for _ in range(repeats):
            t = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(m, bitmask, 0)
            masks.append(time.perf_counter() - t)
        out[f"{name}_mask_ms"] = round(statistics.median(masks) * 1000, 4)
    return out


KINDS = ("unconstrained", "one-step", "json_schema")


def body(kind: str) -> dict:
    b: dict = {
        "messages": [{"role": "user", "content": "Write ten short notes about the sea."}],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "json_schema":
        rf = {"type": "json_schema", "json_schema": {"name": "notes", "schema": NOTES}}
        return {**b, "max_tokens": 400, "response_format": rf}
    if kind == "one-step":  # a bias on a token never chosen: no burst, the full sampler
        return {**b, "max_tokens": 96, "ignore_eos": True, "logit_bias": {"49151": -100}}
    return {**b, "max_tokens": 96, "ignore_eos": True}


async def one(client: httpx.AsyncClient, url: str, kind: str) -> float:
    """The request's TPOT (s) from the client's clock: first to last token over the
    tokens after the first (`usage`: a decode burst's tokens come in one chunk)."""
    first, last, n = None, None, 0
    async with client.stream("POST", url, json=body(kind)) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
            for c in event.get("choices", []):
                if c["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
    assert first is not None and last is not None and n > 2, n
    return (last - first) / (n - 1)


async def tpots(url: str, streams: int, rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    order = [*KINDS, *reversed(KINDS)] * ((rounds + 1) // 2)
    async with httpx.AsyncClient(timeout=600) as client:
        for kind in KINDS:  # warm: the engine's grammar tokenizer, the routes
            await one(client, url, kind)
        for kind in order[: len(KINDS) * rounds]:
            got = await asyncio.gather(*(one(client, url, kind) for _ in range(streams)))
            samples[kind] += got
    tpot = {k: statistics.median(v) for k, v in samples.items()}
    out: dict[str, float] = {f"tpot_ms_{k}": round(v * 1000, 2) for k, v in tpot.items()}
    out["json_schema / unconstrained"] = round(tpot["json_schema"] / tpot["unconstrained"], 3)
    out["json_schema / one-step"] = round(tpot["json_schema"] / tpot["one-step"], 3)
    return out


def serve(args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1/chat/completions"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=6, help="single-stream requests of each kind")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--deployments", default="colocated,1P1D")
    args = p.parse_args()
    report: dict = {"compile": compile_figures(args.repeats)}
    print(json.dumps(report["compile"]), flush=True)
    deployments = {"colocated": [], "1P1D": ["--prefill", "1", "--decode", "1"]}
    for name in args.deployments.split(","):
        flags = deployments[name]
        proc, url = serve(flags)
        try:
            report[name] = {
                "1 stream": asyncio.run(tpots(url, 1, args.requests)),
                "16 streams": asyncio.run(tpots(url, 16, 2)),
            }
        finally:
            proc.terminate()
            proc.wait(60)
        print(name, json.dumps(report[name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
