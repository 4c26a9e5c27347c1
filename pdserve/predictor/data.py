"""The length predictor's data set: what the served model generates for each prompt.

TetriInfer §3.3.2, step 2: send prompt-only data to the target model and record how long
its answers are. Here the target model runs in pdserve's own engine, so each row also
gets the model's final hidden state at the prompt's last token exactly as serving computes
it (the core's `prompt_state_sink`): the length head is trained on what it will read.

Every prompt (`prompts.make_prompts`, as a one-turn chat through the model's template)
runs greedily; a fraction also runs sampled (temperature 0.8, top-p 0.95, seeded per
prompt), since served traffic samples and the answer length is then a distribution. A
greedy and a sampled row of one prompt share `prompt_index` (splits keep them together).
Generations stop at EOS or at `max_tokens` (the window; `truncated` marks those).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pdserve.engine.engine import Engine
from pdserve.engine.features.length_prediction import LengthPredictor
from pdserve.protocol.sampling_params import SamplingParams

SAMPLED_TEMPERATURE = 0.8
SAMPLED_TOP_P = 0.95


@dataclass
class LengthData:
    hidden: np.ndarray  # [N, H] float32: final-norm state at the prompt's last token
    prompt_lens: np.ndarray  # [N] tokens
    output_lens: np.ndarray  # [N] tokens generated
    truncated: np.ndarray  # [N] bool: stopped by max_tokens (true length >= output_lens)
    sampled: np.ndarray  # [N] bool: sampled (else greedy)
    prompt_index: np.ndarray  # [N] which prompt
    kinds: list[str]  # [N] the prompt's task kind (prompts.KINDS)
    meta: dict[str, object] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.output_lens)

    def save(self, path: str | Path) -> None:
        np.savez_compressed(
            path,
            hidden=self.hidden,
            prompt_lens=self.prompt_lens,
            output_lens=self.output_lens,
            truncated=self.truncated,
            sampled=self.sampled,
            prompt_index=self.prompt_index,
            kinds=np.array(self.kinds),
            meta=np.array(json.dumps(self.meta)),
        )

    @classmethod
    def join(cls, first: LengthData, second: LengthData) -> LengthData:
        """`first`'s rows, then `second`'s (with `first`'s meta)."""
        return cls(
            hidden=np.concatenate([first.hidden, second.hidden]),
            prompt_lens=np.concatenate([first.prompt_lens, second.prompt_lens]),
            output_lens=np.concatenate([first.output_lens, second.output_lens]),
            truncated=np.concatenate([first.truncated, second.truncated]),
            sampled=np.concatenate([first.sampled, second.sampled]),
            prompt_index=np.concatenate([first.prompt_index, second.prompt_index]),
            kinds=first.kinds + second.kinds,
            meta=dict(first.meta),
        )

    @classmethod
    def load(cls, path: str | Path) -> LengthData:
        with np.load(path, allow_pickle=False) as f:
            return cls(
                hidden=f["hidden"],
                prompt_lens=f["prompt_lens"],
                output_lens=f["output_lens"],
                truncated=f["truncated"],
                sampled=f["sampled"],
                prompt_index=f["prompt_index"],
                kinds=[str(k) for k in f["kinds"]],
                meta=json.loads(str(f["meta"])),
            )


@dataclass(frozen=True)
class _Job:
    prompt_index: int
    kind: str
    sampled: bool


def collect(
    engine: Engine,
    prompts: list[tuple[str, str]],
    max_tokens: int,
    sampled_fraction: float,
    seed: int,
    progress: bool = True,
    only: Collection[int] | None = None,
) -> LengthData:
    """Run `prompts` ((kind, text) pairs) through `engine` (module docstring). `only`:
    run just the prompts of these indices, each with the rows (greedy, and sampled with
    its seed) it has in the whole set: one side of a split, made again by itself."""
    states: dict[str, np.ndarray] = {}

    def keep(request_id: str, state: torch.Tensor) -> None:
        states[request_id] = state.float().numpy().copy()

    engine.core.participant(LengthPredictor).state_sink = keep
    jobs: dict[str, _Job] = {}
    n_sampled = round(len(prompts) * sampled_fraction)
    for i, (kind, text) in enumerate(prompts):
        if only is not None and i not in only:
            continue
        ids = _chat_ids(engine, text)
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        jobs[engine.add_request(ids, greedy)] = _Job(i, kind, False)
        if i < n_sampled:
            sampled = SamplingParams(
                temperature=SAMPLED_TEMPERATURE,
                top_p=SAMPLED_TOP_P,
                max_tokens=max_tokens,
                seed=seed * 1_000_003 + i,
            )
            jobs[engine.add_request(ids, sampled)] = _Job(i, kind, True)
    rows: dict[str, tuple[int, int, bool]] = {}
    with tqdm(total=len(jobs), disable=not progress, unit="req") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    rid = out.request_id
                    rows[rid] = (
                        len(out.prompt_token_ids),
                        len(out.token_ids),
                        out.finish_reason == "length",
                    )
                    bar.update(1)
    engine.core.participant(LengthPredictor).state_sink = None
    order = list(jobs)
    return LengthData(
        hidden=np.stack([states[r] for r in order]).astype(np.float32),
        prompt_lens=np.array([rows[r][0] for r in order], dtype=np.int64),
        output_lens=np.array([rows[r][1] for r in order], dtype=np.int64),
        truncated=np.array([rows[r][2] for r in order], dtype=bool),
        sampled=np.array([jobs[r].sampled for r in order], dtype=bool),
        prompt_index=np.array([jobs[r].prompt_index for r in order], dtype=np.int64),
        kinds=[jobs[r].kind for r in order],
        meta={
            "num_prompts": len(prompts),
            "max_tokens": max_tokens,
            "sampled_fraction": sampled_fraction,
            "seed": seed,
            "temperature": SAMPLED_TEMPERATURE,
            "top_p": SAMPLED_TOP_P,
        },
    )


def _chat_ids(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), False)
