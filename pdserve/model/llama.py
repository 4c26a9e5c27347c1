"""Llama (and SmolLM2, which is Llama-architecture): the plain family member."""

from __future__ import annotations

from pdserve.model.base import CausalLM


class LlamaForCausalLM(CausalLM):
    """q/k/v bias only when config.attention_bias; optional llama3 RoPE scaling."""
