"""The length predictor's tools (pdserve/predictor/): the prompt set, the data set the
engine records, training against the baselines, and `pdserve predictor train` end to end
on a tiny random model (the same code trains the shipped SmolLM2 head): a head it writes
loads on that model and only on it, and the same seed gives the same head and report.

The shipped head is measured again: its report's test figures on the held-out rows shipped
beside it (`heads/*.held-out.npz`, the report's test split made again by `pdserve predictor
held-out`), and a few of those rows made again here to show they are the model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.tiny_models import make_tiny_model
from safetensors.torch import load_file

from pdserve.cli import main
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine, load_model
from pdserve.engine.head_spec import HeadSpec
from pdserve.engine.length_head import load_length_head, read_head
from pdserve.predictor.data import LengthData, collect
from pdserve.predictor.prompts import KINDS, make_prompts
from pdserve.predictor.shipped import SHIPPED_DIR, SHIPPED_HEADS
from pdserve.predictor.train import (
    bucket_labels,
    head_buckets,
    head_scores,
    held_out_prompts,
    num_buckets,
    score,
    split_by_prompt,
)


def test_prompts_are_distinct_seeded_and_cover_every_kind() -> None:
    a = make_prompts(600, seed=3)
    assert a == make_prompts(600, seed=3) and a != make_prompts(600, seed=4)
    assert len({text for _, text in a}) == 600
    assert {kind for kind, _ in a} == {k.name for k in KINDS}
    assert [kind for kind, _ in a[:6]] == [k.name for k in KINDS]  # in turn


def test_buckets_and_scores_by_hand() -> None:
    assert num_buckets(512, 64) == 9 and num_buckets(512, 100) == 7
    data = LengthData(
        hidden=np.zeros((6, 2), np.float32),
        prompt_lens=np.arange(6),
        output_lens=np.array([0, 63, 64, 200, 511, 900]),
        truncated=np.array([False] * 5 + [True]),
        sampled=np.zeros(6, bool),
        prompt_index=np.array([0, 0, 1, 1, 2, 2]),
        kinds=["x"] * 6,
    )
    spec = HeadSpec(64, num_buckets(512, 64), 2, 10, "LlamaForCausalLM")
    assert bucket_labels(data.output_lens, spec).tolist() == [0, 0, 1, 3, 7, 8]
    s = score(np.array([0, 1, 1, 2, 7, 6]), bucket_labels(data.output_lens, spec), 9)
    assert (s.accuracy, s.within_one) == (3 / 6, 5 / 6)
    assert s.confusion[1][0] == 1 and s.confusion[6][8] == 1
    split = split_by_prompt(data, seed=0)
    sides = [set(data.prompt_index[rows]) for rows in (split.train, split.val, split.test)]
    assert sum(len(s) for s in sides) == 3 and not (sides[0] & sides[2])  # by prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("predictor"), "LlamaForCausalLM")


def test_collect_records_each_prompts_state_as_serving_computes_it(tiny: Path) -> None:
    engine = Engine.from_config(EngineConfig(model=str(tiny), num_threads=1))
    prompts = make_prompts(8, seed=0)
    data = collect(engine, prompts, max_tokens=12, sampled_fraction=0.5, seed=0, progress=False)
    assert len(data) == 12 and data.sampled.sum() == 4
    assert data.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7]
    assert data.hidden.shape == (12, engine.core.model.config.hidden_size)
    assert (data.output_lens <= 12).all() and (data.truncated == (data.output_lens == 12)).all()
    # A greedy and a sampled row of one prompt read the same prompt state (computed in
    # the same step, possibly in another row of the batch).
    assert np.allclose(data.hidden[0], data.hidden[1], atol=1e-5)
    assert not np.allclose(data.hidden[0], data.hidden[2], atol=1e-2)


def train(tiny: Path, out: Path, data: Path) -> dict:
    argv = ["predictor", "train", "--model", str(tiny), "--out", str(out), "--data", str(data)]
    argv += ["--num-prompts", "40", "--sampled-fraction", "0.5", "--window", "16"]
    argv += ["--granularities", "4,8"]
    argv += ["--granularity", "4", "--num-threads", "1", "--kv-cache-memory-gib", "0.05"]
    assert main(argv) == 0
    return json.loads(out.with_suffix(".json").read_text())


def test_train_writes_a_head_for_its_model_reproducibly(tiny: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.npz"
    report = train(tiny, tmp_path / "a.safetensors", data)
    assert set(report["granularities"]) == {"4", "8"}
    for row in report["granularities"].values():
        for candidate in ("majority", "length_regression", "linear_head", "mlp_head"):
            assert 0.0 <= row[candidate]["accuracy"] <= row[candidate]["within_one"] <= 1.0
        assert sum(map(sum, row["confusion_chosen"])) == report["data"]["test"]
    assert report["data"]["rows"] == 60 and report["cost"]["fraction_of_prefill"] > 0
    again = train(tiny, tmp_path / "b.safetensors", data)  # the saved data set, same seed
    assert again["granularities"] == report["granularities"]
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = load_model(EngineConfig(model=str(tiny), num_threads=1))
    head = load_length_head(tmp_path / "a.safetensors", model)
    assert (head.spec.granularity, head.spec.num_buckets) == (4, 5)


(HEAD_FILE,) = SHIPPED_HEADS.values()
HEAD = SHIPPED_DIR / HEAD_FILE
HELD_OUT = HEAD.with_suffix(".held-out.npz")  # `pdserve predictor held-out` made it


@pytest.fixture(scope="module")
def held_out() -> LengthData:
    return LengthData.load(HELD_OUT)


def report() -> dict:
    return dict(json.loads(HEAD.with_suffix(".json").read_text()))


def test_the_held_out_rows_are_the_reports_test_split(held_out: LengthData) -> None:
    """The shipped rows are those `split_by_prompt` put on the test side of the report's
    data set: each test prompt's greedy row, then its sampled one where it had one."""
    meta = report()["data"]
    n, seed = meta["num_prompts"], meta["seed"]
    sampled = round(n * meta["sampled_fraction"])
    rows = [(p, k) for p in held_out_prompts(n, seed) for k in (False, True)[: 1 + (p < sampled)]]
    assert len(held_out) == meta["test"] == len(rows)
    assert list(zip(held_out.prompt_index.tolist(), held_out.sampled.tolist(), strict=True)) == rows
    prompts = make_prompts(n, seed)
    assert held_out.kinds == [prompts[p][0] for p, _ in rows]
    assert (held_out.truncated == (held_out.output_lens == meta["max_tokens"])).all()
    assert held_out.hidden.shape == (len(rows), 576) and held_out.hidden.dtype == np.float32


def test_the_shipped_head_scores_what_its_report_says_on_its_held_out_rows(
    held_out: LengthData,
) -> None:
    """Measured again: the report's test accuracy, accuracy within one bucket and
    confusion matrix of the shipped head, exactly (the same rows, the same counts; the
    head's argmax on them is deterministic on the CPU)."""
    head = read_head(HEAD)
    assert (head.spec.granularity, head.spec.num_buckets) == (32, 9)
    assert (head.spec.hidden_size, head.spec.vocab_size) == (576, 49152)
    chosen = report()["granularities"]["32"]
    assert chosen["chosen"] == "mlp" and head.spec.mlp_hidden > 0
    s = head_scores(head, held_out, np.arange(len(held_out)))
    reported = chosen["mlp_head"]
    assert (s.accuracy, s.within_one) == (reported["accuracy"], reported["within_one"])
    assert s.confusion == chosen["confusion_chosen"]
    # The majority baseline (the commonest training bucket: the window's at 16 and 32
    # tokens, [0, 64) at 64), scored on the same rows' labels.
    for g, bucket in (("16", 16), ("32", 8), ("64", 0)):
        spec = HeadSpec(int(g), report()["granularities"][g]["num_buckets"], 576, 49152, "")
        always = np.full(len(held_out), bucket)
        s = score(always, bucket_labels(held_out.output_lens, spec), spec.num_buckets)
        reported = report()["granularities"][g]["majority"]
        assert (s.accuracy, s.within_one) == (reported["accuracy"], reported["within_one"])


REGENERATED = 6  # held-out prompts whose every row ended within 32 tokens, made again


def test_the_held_out_rows_are_what_the_shipped_model_generates(held_out: LengthData) -> None:
    """A few held-out prompts run again through the engine as `held-out` ran them: the
    same output lengths, the same prompt states (to float tolerance: another CPU's
    kernels may round differently) and so the same predictions."""
    meta = report()["data"]
    short = [
        p
        for p in dict.fromkeys(held_out.prompt_index.tolist())
        if (held_out.output_lens[held_out.prompt_index == p] < 32).all()
    ][:REGENERATED]
    kv = str(held_out.meta["kv_cache_dtype"])  # as the report's data set was made
    # The shipped set predates the field: it was made with fp32 activations (the default
    # then; int8 rounding gives other lengths).
    activations = str(held_out.meta.get("activations", "fp32"))
    engine = Engine.from_config(
        EngineConfig(num_threads=2, kv_cache_dtype=kv, activations=activations)
    )
    n, seed = meta["num_prompts"], meta["seed"]
    again = collect(
        engine,
        make_prompts(n, seed),
        meta["max_tokens"],
        meta["sampled_fraction"],
        seed,
        progress=False,
        only=set(short),
    )
    rows = np.flatnonzero(np.isin(held_out.prompt_index, short))
    assert again.prompt_index.tolist() == held_out.prompt_index[rows].tolist()
    assert again.output_lens.tolist() == held_out.output_lens[rows].tolist()
    # Bit for bit on the machine that made them; the fp16 cache (the engine's default
    # since) differs by up to 2e-2.
    assert np.allclose(again.hidden, held_out.hidden[rows], rtol=0, atol=1e-3)
    head = read_head(HEAD)
    everything = np.arange(len(again))
    assert (head_buckets(head, again, everything) == head_buckets(head, held_out, rows)).all()
