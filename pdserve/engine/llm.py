"""Offline batch generation: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine, Prompt
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.outputs import RequestOutput


class LLM:
    """Runs every prompt to completion with continuous batching; results in input order."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = Engine.from_config(EngineConfig(model=model, **config))

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        batch = _as_batch(prompts)
        plist = _as_params(params, len(batch))
        ids = [self.engine.add_request(p, sp) for p, sp in zip(batch, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
    ) -> RequestOutput:
        text = self.engine.tokenizer.apply_chat_template(list(messages))
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return self.generate([ids], params)[0]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    seq = list(prompts)
    if seq and all(isinstance(t, int) for t in seq):
        return [seq]  # type: ignore[list-item]
    return seq  # type: ignore[return-value]


def _as_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
    return [replace(p) for p in plist]
