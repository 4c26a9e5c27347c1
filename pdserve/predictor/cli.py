"""`pdserve predictor train`: make the data set, train the length head, report.

    pdserve predictor train --out head.safetensors                 # the shipped SmolLM2
    pdserve predictor train --model PATH --out head.safetensors --data data.npz
    pdserve predictor held-out --report head.json --out held-out.npz

With `--data FILE` the data set is read from FILE when it exists, else made and saved
there. The report (accuracy of every candidate at every granularity, the confusion matrix
of the shipped one, the head's cost against a prefill) is printed and written as JSON
(`--report`, default next to the head).

`held-out` makes the rows of a report's test split again, by themselves (the prompts the
split put on the test side, with the seeds they had), so the head's figures can be
measured again without the whole data set: the shipped head's are
(`heads/*.held-out.npz`, tests/test_predictor.py). It saves as it goes and resumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.config import KV_CACHE_DTYPES

# The data a head was trained on must be made again as it was made: the shipped head's
# (before --kv-cache-dtype existed) with a float32 cache.
KV_HELP = "the KV cache while generating (auto: as `serve`'s)"

if TYPE_CHECKING:  # torch and the engine load only when the command runs
    from pdserve.engine.engine import Engine
    from pdserve.predictor.data import LengthData


def add_predictor_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("predictor", help="train the output-length predictor")
    sub = p.add_subparsers(dest="predictor_command", required=True)
    t = sub.add_parser("train", help="make the data set (or read it), train, report")
    t.add_argument("--model", default=None, help="HF folder or .gguf (default: shipped SmolLM2)")
    t.add_argument("--out", required=True, help="the head file to write (.safetensors)")
    t.add_argument("--data", default=None, help="data set (.npz): read if it exists, else saved")
    t.add_argument("--report", default=None, help="report JSON (default: OUT with .json)")
    t.add_argument("--num-prompts", type=int, default=3000)
    t.add_argument("--sampled-fraction", type=float, default=0.2)
    t.add_argument("--window", type=int, default=256, help="generation cap (max_tokens)")
    t.add_argument("--granularities", default="16,32,64", help="reported, comma-separated")
    t.add_argument("--granularity", type=int, default=32, help="the head written to --out")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--num-threads", type=int, default=None)
    t.add_argument("--kv-cache-memory-gib", type=float, default=2.0, help="while generating")
    t.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_HELP)
    t.add_argument("--max-num-seqs", type=int, default=64, help="while generating")
    t.set_defaults(func=_train)
    h = sub.add_parser(
        "held-out", help="make a report's test rows again (the data its figures were measured on)"
    )
    h.add_argument("--report", required=True, help="the report JSON `train` wrote")
    h.add_argument("--out", required=True, help="the data set to write (.npz)")
    h.add_argument("--model", default=None, help="HF folder or .gguf (default: shipped SmolLM2)")
    h.add_argument("--num-threads", type=int, default=None)
    h.add_argument("--kv-cache-memory-gib", type=float, default=2.0, help="while generating")
    h.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_HELP)
    h.add_argument("--max-num-seqs", type=int, default=64, help="while generating")
    h.add_argument("--group", type=int, default=64, help="prompts made between two saves")
    h.set_defaults(func=_held_out)


def _engine(args: argparse.Namespace) -> Engine:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.engine import Engine

    return Engine.from_config(
        EngineConfig(
            model=args.model,
            num_threads=args.num_threads,
            kv_cache_dtype=args.kv_cache_dtype,
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
            cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_memory_gib),
        )
    )


def _kv_dtype(engine: Engine) -> str:
    return engine.config.kv_dtype(engine.core.model.quantization.quantized)


def _made_with(engine: Engine) -> dict[str, str]:
    """How the engine computed a data set's rows (its meta): its KV cache dtype and how
    its projections took activations - what a rerun must match to give the same rows."""
    return {
        "kv_cache_dtype": _kv_dtype(engine),
        "activations": engine.core.model.quantization.activations,
    }


def _data(args: argparse.Namespace, engine: Engine) -> LengthData:
    from pdserve.predictor.data import LengthData, collect
    from pdserve.predictor.prompts import make_prompts

    if args.data is not None and Path(args.data).is_file():
        print(f"reading the data set {args.data}", file=sys.stderr)
        return LengthData.load(args.data)
    prompts = make_prompts(args.num_prompts, args.seed)
    t0 = time.monotonic()
    data = collect(engine, prompts, args.window, args.sampled_fraction, args.seed)
    data.meta["model"] = engine.config.model or "shipped SmolLM2-135M-Instruct"
    data.meta.update(_made_with(engine))
    data.meta["collect_s"] = time.monotonic() - t0
    if args.data is not None:
        data.save(args.data)
        print(f"saved the data set ({len(data)} rows) to {args.data}", file=sys.stderr)
    return data


def _prefill_seconds(engine: Engine, texts: list[str]) -> float:
    """Median seconds from scheduling to the first token of single prompts (no batch)."""
    from pdserve.protocol.sampling_params import SamplingParams

    times = []
    for text in texts:
        ids = engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]), False
        )
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.metrics is not None and out.metrics.prefill_time:
                    times.append(out.metrics.prefill_time)
    return statistics.median(times)


def _train(args: argparse.Namespace) -> int:
    import numpy as np

    from pdserve.engine.head_spec import HeadSpec
    from pdserve.engine.length_head import set_probe
    from pdserve.predictor.prompts import make_prompts
    from pdserve.predictor.train import evaluate_granularity, head_cost, split_by_prompt

    engine = _engine(args)
    data = _data(args, engine)
    model = engine.core.model
    base = HeadSpec(
        granularity=args.granularity,
        num_buckets=2,
        hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size,
        architecture=model.config.architecture,
        model_name=Path(engine.config.model).name
        if engine.config.model
        else "SmolLM2-135M-Instruct",
    )
    split = split_by_prompt(data, args.seed)
    grans = sorted({int(g) for g in args.granularities.split(",")} | {args.granularity})
    results = {g: evaluate_granularity(data, split, base, g, args.window, args.seed) for g in grans}
    shipped = results[args.granularity]
    set_probe(shipped.head, model.embed_tokens)
    texts = [t for _, t in make_prompts(20, args.seed + 1)]
    prefill_s = _prefill_seconds(engine, texts)
    head_s = head_cost(shipped.head, data.hidden, data.prompt_lens.tolist())
    report = {
        "data": {
            **data.meta,
            "rows": len(data),
            "train": len(split.train),
            "val": len(split.val),
            "test": len(split.test),
            "truncated": int(data.truncated.sum()),
            "output_len_median": float(np.median(data.output_lens)),
        },
        "granularities": {str(g): r.summary() for g, r in results.items()},
        "shipped": {"granularity": args.granularity, "chosen": shipped.summary()["chosen"]},
        "cost": {
            "head_s": head_s,
            "prefill_s": prefill_s,
            "fraction_of_prefill": head_s / prefill_s,
        },
    }
    shipped.head.save(
        args.out,
        trained={
            "test_accuracy": shipped.scores["chosen"].accuracy,
            "seed": args.seed,
            "rows": len(data),
        },
    )
    report_path = Path(args.report or Path(args.out).with_suffix(".json"))
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    _print(report)
    print(f"wrote {args.out} and {report_path}", file=sys.stderr)
    return 0


def _print(report: dict[str, object]) -> None:
    grans = report["granularities"]
    assert isinstance(grans, dict)
    print(
        "granularity  majority  length-regr  linear-head  mlp-head"
        "   (test accuracy; within one bucket)"
    )
    for g, r in grans.items():
        cells = [
            f"{r[k]['accuracy']:.1%} ({r[k]['within_one']:.0%})"
            for k in ("majority", "length_regression", "linear_head", "mlp_head")
        ]
        print(f"{g:>11}  " + "  ".join(f"{c:>13}" for c in cells))
    cost = report["cost"]
    assert isinstance(cost, dict)
    print(
        f"head: {cost['head_s'] * 1e6:.0f} us per prediction = {cost['fraction_of_prefill']:.3%} "
        f"of a median prefill ({cost['prefill_s'] * 1e3:.1f} ms)"
    )


def _held_out(args: argparse.Namespace) -> int:
    """The report's test rows, `--group` prompts at a time; OUT is written after each
    group, and a run finds in it the prompts already made (it goes on where a killed run
    stopped). Rows do not depend on what they were batched with (the kernels are batch
    invariant), so the groups give the rows one run would."""
    from pdserve.predictor.data import LengthData, collect
    from pdserve.predictor.prompts import make_prompts
    from pdserve.predictor.train import held_out_prompts

    meta = json.loads(Path(args.report).read_text())["data"]
    n, seed = int(meta["num_prompts"]), int(meta["seed"])
    out = Path(args.out)
    done = LengthData.load(out) if out.is_file() else None
    have = set() if done is None else set(done.prompt_index.tolist())
    todo = [p for p in held_out_prompts(n, seed) if p not in have]
    engine = _engine(args)
    prompts = make_prompts(n, seed)
    for start in range(0, len(todo), args.group):
        t0 = time.monotonic()
        group = collect(
            engine,
            prompts,
            int(meta["max_tokens"]),
            float(meta["sampled_fraction"]),
            seed,
            only=set(todo[start : start + args.group]),
        )
        spent = time.monotonic() - t0
        if done is None:
            done = group
        else:
            spent += float(str(done.meta["collect_s"]))
            done = LengthData.join(done, group)
        done.meta.update(split="test", collect_s=spent, **_made_with(engine))
        done.save(out)
        print(f"{len(done)} of the test rows of {args.report} in {out}", file=sys.stderr)
    return 0
