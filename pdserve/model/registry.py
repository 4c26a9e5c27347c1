"""Model classes by the HF `architectures` name."""

from __future__ import annotations

import torch

from pdserve.errors import ModelLoadError
from pdserve.model.base import CausalLM
from pdserve.model.config import ModelConfig
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.mistral import MistralForCausalLM
from pdserve.model.qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, quantized: bool = False
) -> CausalLM:
    """An unloaded model of the config's architecture (weights zero until load_weights;
    `quantized`: see CausalLM)."""
    cls = MODEL_REGISTRY.get(config.architecture)
    if cls is None:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(
            f"unsupported architecture {config.architecture!r} (supported: {supported})"
        )
    return cls(config, dtype, quantized)
