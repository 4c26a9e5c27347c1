"""Training and evaluating the length head, against baselines that use no model.

Split: by prompt (a prompt's greedy and sampled rows stay on one side), 70 / 10 / 20
train / validation / test, seeded. Labels: the bucket of the output length at a
granularity g over a window W (the generation cap): W / g + 1 buckets, the last one,
[W, inf), holding exactly the answers that ran to the cap.

Candidates, each scored by test accuracy (the bucket exactly right, TetriInfer's measure)
and by accuracy within one bucket:

- majority: always the most frequent training bucket;
- length regression: log(1 + output) fitted on log(1 + prompt) by least squares, then
  bucketed (the prompt length is the only thing a scheduler without a model knows);
- linear head and MLP head (one hidden layer of 256) on the final hidden state +
  log(1 + prompt length), softmax cross-entropy, full-batch Adam, the L2 weight chosen
  on the validation set. The better of the two on validation is the one shipped.

Everything is seeded: the same data and arguments give the same head and report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from pdserve.engine.head_spec import HeadSpec
from pdserve.engine.length_head import LengthHead, features
from pdserve.predictor.data import LengthData

L2_GRID = (1e-4, 1e-3, 1e-2)
EPOCHS = 300
MLP_HIDDEN = 256


@dataclass(frozen=True)
class Split:
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


TRAIN, VAL, TEST = 0, 1, 2  # the sides of a split


def prompt_sides(prompt_index: np.ndarray, seed: int) -> dict[int, int]:
    """The side (TRAIN, VAL or TEST) of every prompt index present, 70 / 10 / 20."""
    prompts = np.unique(prompt_index)
    rng = np.random.default_rng(seed)
    rng.shuffle(prompts)
    n = len(prompts)
    cut1, cut2 = int(0.7 * n), int(0.8 * n)
    side = {int(p): TRAIN for p in prompts[:cut1]}
    side.update({int(p): VAL for p in prompts[cut1:cut2]})
    side.update({int(p): TEST for p in prompts[cut2:]})
    return side


def split_by_prompt(data: LengthData, seed: int) -> Split:
    side = prompt_sides(data.prompt_index, seed)
    where = np.array([side[int(p)] for p in data.prompt_index])
    return Split(*(np.flatnonzero(where == k) for k in (TRAIN, VAL, TEST)))


def held_out_prompts(num_prompts: int, seed: int) -> list[int]:
    """The prompt indices `split_by_prompt` puts on the test side of a data set made from
    `make_prompts(num_prompts, seed)` (every prompt has a row), ascending."""
    side = prompt_sides(np.arange(num_prompts), seed)
    return sorted(p for p, s in side.items() if s == TEST)


def bucket_labels(output_lens: np.ndarray, spec: HeadSpec) -> np.ndarray:
    return np.minimum(output_lens // spec.granularity, spec.num_buckets - 1)


def num_buckets(window: int, granularity: int) -> int:
    """Buckets of width `granularity` below the window, and the window's own [W, inf)."""
    return -(-window // granularity) + 1


@dataclass(frozen=True)
class Scores:
    accuracy: float
    within_one: float
    confusion: list[list[int]]  # [predicted][actual]

    def as_dict(self) -> dict[str, object]:
        return {"accuracy": self.accuracy, "within_one": self.within_one}


def score(pred: np.ndarray, truth: np.ndarray, n: int) -> Scores:
    confusion = np.zeros((n, n), dtype=np.int64)
    np.add.at(confusion, (pred, truth), 1)
    return Scores(
        float(np.mean(pred == truth)),
        float(np.mean(np.abs(pred - truth) <= 1)),
        confusion.tolist(),
    )


def majority(y_train: np.ndarray, n_test: int) -> np.ndarray:
    return np.full(n_test, np.bincount(y_train).argmax())


def length_regression(
    data: LengthData, split: Split, spec: HeadSpec
) -> tuple[np.ndarray, tuple[float, float]]:
    """Test-set buckets from log-output ~ a + b log-prompt; and (a, b)."""
    x = np.log1p(data.prompt_lens[split.train].astype(float))
    y = np.log1p(data.output_lens[split.train].astype(float))
    b, a = np.polyfit(x, y, 1)
    pred_len = np.expm1(a + b * np.log1p(data.prompt_lens[split.test].astype(float)))
    pred = bucket_labels(np.maximum(pred_len, 0).astype(np.int64), spec)
    return pred, (float(a), float(b))


def fit_head(
    data: LengthData, split: Split, spec: HeadSpec, seed: int
) -> tuple[LengthHead, float, float]:
    """The head of `spec` with the best validation accuracy over `L2_GRID`; returns
    (head, its validation accuracy, the L2 weight)."""
    x = features(torch.from_numpy(data.hidden), data.prompt_lens.tolist())
    y = torch.from_numpy(bucket_labels(data.output_lens, spec))
    tr, va = torch.from_numpy(split.train), torch.from_numpy(split.val)
    best: tuple[LengthHead, float, float] | None = None
    for l2 in L2_GRID:
        head = _train(x[tr], y[tr], spec, l2, seed)
        acc = _accuracy(head, x[va], y[va])
        if best is None or acc > best[1]:
            best = (head, acc, l2)
    assert best is not None
    return best


def _train(x: torch.Tensor, y: torch.Tensor, spec: HeadSpec, l2: float, seed: int) -> LengthHead:
    torch.manual_seed(seed)
    head = LengthHead(spec)
    head.mean.copy_(x.mean(dim=0))
    head.std.copy_(x.std(dim=0).clamp_min(1e-6))
    opt = torch.optim.Adam(head.net.parameters(), lr=3e-3)
    weights = [p for n, p in head.net.named_parameters() if n.endswith("weight")]
    loss_fn = nn.CrossEntropyLoss()
    head.train()
    for _ in range(EPOCHS):
        opt.zero_grad()
        loss = loss_fn(head(x), y) + l2 * sum((w * w).sum() for w in weights)
        loss.backward()
        opt.step()
    return head.eval()


@torch.inference_mode()
def _accuracy(head: LengthHead, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((head(x).argmax(dim=1) == y).float().mean())


@torch.inference_mode()
def head_buckets(head: LengthHead, data: LengthData, rows: np.ndarray) -> np.ndarray:
    x = features(torch.from_numpy(data.hidden[rows]), data.prompt_lens[rows].tolist())
    return head(x).argmax(dim=1).numpy()


def head_scores(head: LengthHead, data: LengthData, rows: np.ndarray) -> Scores:
    """`head`'s scores on `rows` of `data` (the report's figures for the test rows)."""
    truth = bucket_labels(data.output_lens[rows], head.spec)
    return score(head_buckets(head, data, rows), truth, head.spec.num_buckets)


@dataclass(frozen=True)
class GranularityResult:
    spec: HeadSpec  # of the chosen head
    head: LengthHead
    scores: dict[str, Scores]  # candidate -> test scores

    def summary(self) -> dict[str, object]:
        return {
            "granularity": self.spec.granularity,
            "num_buckets": self.spec.num_buckets,
            "chosen": "mlp" if self.spec.mlp_hidden else "linear",
            **{name: s.as_dict() for name, s in self.scores.items() if name != "chosen"},
            "confusion_chosen": self.scores["chosen"].confusion,
        }


def evaluate_granularity(
    data: LengthData, split: Split, base: HeadSpec, granularity: int, window: int, seed: int
) -> GranularityResult:
    """Every candidate at one granularity, scored on the test prompts."""
    spec = replace(base, granularity=granularity, num_buckets=num_buckets(window, granularity))
    y_test = bucket_labels(data.output_lens[split.test], spec)
    n = spec.num_buckets
    scores = {
        "majority": score(
            majority(bucket_labels(data.output_lens[split.train], spec), len(y_test)), y_test, n
        ),
        "length_regression": score(length_regression(data, split, spec)[0], y_test, n),
    }
    linear, linear_val, _ = fit_head(data, split, replace(spec, mlp_hidden=0), seed)
    mlp, mlp_val, _ = fit_head(data, split, replace(spec, mlp_hidden=MLP_HIDDEN), seed)
    scores["linear_head"] = head_scores(linear, data, split.test)
    scores["mlp_head"] = head_scores(mlp, data, split.test)
    chosen = mlp if mlp_val > linear_val else linear
    scores["chosen"] = scores["mlp_head" if chosen is mlp else "linear_head"]
    return GranularityResult(chosen.spec, chosen, scores)


def head_cost(
    head: LengthHead, hidden: np.ndarray, prompt_lens: Sequence[int], repeats: int = 200
) -> float:
    """Median seconds of one prediction (one row, as at a prompt's first token)."""
    row = torch.from_numpy(hidden[:1])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        head.predict(row, prompt_lens[:1])
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
