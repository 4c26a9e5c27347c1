"""Mistral: Llama layers with sliding-window attention (config.sliding_window)."""

from __future__ import annotations

from pdserve.model.base import CausalLM
from pdserve.model.config import ModelConfig


class MistralForCausalLM(CausalLM):
    use_sliding_window = True

    @classmethod
    def projection_biases(cls, config: ModelConfig) -> tuple[bool, bool]:
        return False, False
