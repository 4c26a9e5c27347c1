"""Where a model is and what it is: its location resolved, its architecture's
hyper-parameters and generation defaults, from a HF folder or a GGUF file's header.

Every entry point takes what a user names (`str | Path | ModelSource | None`):

* a Hugging Face folder: `config.json` plus one or more `*.safetensors` (with or without
  `model.safetensors.index.json`), tokenizer files, optional `generation_config.json`;
* a `.gguf` file (llama.cpp), its header read by `gguf_header`;
* `None`: the shipped SmolLM2-135M-Instruct GGUF (`default.py`).

Nothing here imports torch: the front end (the tokenizer, request limits) reads a model
through this module and `loader.py` its weights, in the instances. Every failure is a
ModelLoadError whose message starts with the offending path.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pdserve.errors import ModelLoadError
from pdserve.model import gguf_header
from pdserve.model.config import ModelConfig
from pdserve.model.default import default_model_path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

ModelPath = str | Path | None


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location. `format` says which reader handles it."""

    path: Path  # the HF folder or the .gguf file
    format: Literal["hf", "gguf"]

    @classmethod
    def resolve(cls, path: ModelPath | ModelSource) -> ModelSource:
        """Check that `path` names a model; `None` means the shipped default model."""
        if isinstance(path, ModelSource):
            return path
        p = default_model_path() if path is None else Path(path).expanduser()
        if not p.exists():
            raise ModelLoadError(f"{p}: no such file or directory")
        if p.is_dir():
            if not (p / CONFIG_FILE).is_file():
                raise ModelLoadError(
                    f"{p}: no {CONFIG_FILE} (expected a Hugging Face model folder or a .gguf file)"
                )
            return cls(p, "hf")
        if p.suffix.lower() == ".gguf":
            return cls(p, "gguf")
        raise ModelLoadError(f"{p}: not a model folder or a .gguf file")

    @property
    def folder(self) -> Path:
        """The folder holding the model's files (tokenizer, generation config)."""
        return self.path if self.format == "hf" else self.path.parent


def resolve_model(path: ModelPath | ModelSource) -> Path:
    """The model folder or GGUF file that `path` names; ModelLoadError if there is none."""
    return ModelSource.resolve(path).path


def load_config(path: ModelPath | ModelSource) -> ModelConfig:
    """The model's architecture hyper-parameters."""
    src = ModelSource.resolve(path)
    if src.format == "gguf":
        return gguf_header.load_gguf_config(src.path)
    config_file = src.path / CONFIG_FILE
    d = read_json(config_file)
    archs = d.get("architectures") or []
    if archs and archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{config_file}: unsupported architecture {archs[0]!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if d.get("mlp_bias"):
        raise ModelLoadError(f"{config_file}: mlp_bias=true is not supported")
    config = ModelConfig.from_hf_dict(d, source=str(config_file))
    return _architecture_specifics(config, d, config_file)


def _architecture_specifics(config: ModelConfig, d: dict[str, Any], source: Path) -> ModelConfig:
    """Make the fields mean what the HF model class does, whatever else config.json says."""
    if config.architecture == "Qwen2ForCausalLM":
        # Qwen2 always has q/k/v biases and has no `attention_bias` key.
        return dataclasses.replace(
            config, attention_bias=True, sliding_window=_qwen2_sliding_window(config, d, source)
        )
    if config.architecture == "LlamaForCausalLM":
        return dataclasses.replace(config, sliding_window=None)
    return dataclasses.replace(config, attention_bias=False)  # Mistral: no biases


def _qwen2_sliding_window(config: ModelConfig, d: dict[str, Any], source: Path) -> int | None:
    """Qwen2 slides the window only in layers >= max_window_layers; all or none is supported."""
    if not d.get("use_sliding_window") or config.sliding_window is None:
        return None
    first_sliding = int(d.get("max_window_layers", 28))  # transformers' default
    if first_sliding >= config.num_hidden_layers:
        return None
    if first_sliding > 0:
        raise ModelLoadError(
            f"{source}: sliding window in only some layers (max_window_layers={first_sliding}) "
            "is not supported"
        )
    return config.sliding_window


def load_generation_defaults(path: ModelPath | ModelSource) -> dict[str, Any]:
    """The folder's generation_config.json as a dict (eos_token_id, ...); {} if absent."""
    src = ModelSource.resolve(path)
    file = src.path / GENERATION_CONFIG_FILE
    if src.format != "hf" or not file.is_file():
        return {}
    return read_json(file)


def read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: cannot be read ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the HF model class has, by HF name, in state_dict order.

    Biases: Qwen2 has q/k/v biases; Llama with `attention_bias` has q/k/v/o biases.
    `lm_head.weight` is absent when the embeddings are tied.
    """
    c = config
    h = c.hidden_size
    o_bias = c.attention_bias and c.architecture == "LlamaForCausalLM"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        for proj, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if c.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, c.q_size)
        if o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (h,)
        shapes[f"{p}mlp.gate_proj.weight"] = (c.intermediate_size, h)
        shapes[f"{p}mlp.up_proj.weight"] = (c.intermediate_size, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, c.intermediate_size)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes
