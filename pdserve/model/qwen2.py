"""Qwen2: Llama layers with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from pdserve.model.base import CausalLM
from pdserve.model.config import ModelConfig


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def projection_biases(cls, config: ModelConfig) -> tuple[bool, bool]:
        return True, False
