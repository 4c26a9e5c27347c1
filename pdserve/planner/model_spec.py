"""The shape of a model as the planner sees it: sizes, FLOPs and bytes, no weights.

A `ModelSpec` is built from a preset name (the OPT models DistServe evaluates, a few
Llama-family models), from a model the engine can load (HF folder, .gguf, or a
`config.json` file), or from a plain JSON description. Everything the latency model
and the memory checks need derives from it:

- `linear_params_per_layer`: parameters of the QKV, output and FFN matrices of one
  layer. For a multi-head model with a two-matrix FFN (OPT) this is DistServe's
  `4h^2 + 2hm` (App. A); grouped-query attention and gated FFNs change the terms.
- `weight_bytes`, `layer_weight_bytes`: what the weights occupy.
- `kv_bytes_per_token`: K and V of one token over all layers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ModelLoadError


class PlanInputError(ValueError):
    """Bad planner input (model, hardware, cluster, workload, SLO): the CLI exits 2."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    ffn_matrices: int = 3
    """2 for a plain FFN (OPT: fc1, fc2), 3 for a gated one (Llama: gate, up, down)."""
    dtype_bytes: int = 2
    tied_embeddings: bool = True
    max_context: int = 2048

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "dtype_bytes",
            "max_context",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanInputError(f"model {self.name!r}: {name} must be a positive integer")
        if self.ffn_matrices not in (2, 3):
            raise PlanInputError(f"model {self.name!r}: ffn_matrices must be 2 or 3")
        if self.num_heads % self.num_kv_heads:
            raise PlanInputError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_params_per_layer(self) -> int:
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        return attn + self.ffn_matrices * h * self.intermediate_size

    @property
    def layer_weight_bytes(self) -> int:
        """One decoder layer (its matrices; norms and biases are under 0.1% and left out)."""
        return self.linear_params_per_layer * self.dtype_bytes

    @property
    def embedding_bytes(self) -> int:
        heads = 1 if self.tied_embeddings else 2
        return heads * self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.num_layers * self.layer_weight_bytes + self.embedding_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.kv_size * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "model") -> ModelSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanInputError(f"{source}: unknown model fields {unknown}")
        missing = sorted(
            f
            for f, fd in cls.__dataclass_fields__.items()
            if f not in d and fd.default is dataclasses.MISSING
        )
        if missing:
            raise PlanInputError(f"{source}: missing model fields {missing}")
        try:
            return cls(**d)
        except TypeError as e:
            raise PlanInputError(f"{source}: {e}") from None


def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=4 * hidden,
        vocab_size=50272,
        ffn_matrices=2,
    )


PRESETS: dict[str, ModelSpec] = {
    # OPT (Zhang et al. 2022), the models of DistServe's evaluation; fp16.
    "opt-13b": _opt("opt-13b", 40, 5120, 40),
    "opt-30b": _opt("opt-30b", 48, 7168, 56),
    "opt-66b": _opt("opt-66b", 64, 9216, 72),
    "opt-175b": _opt("opt-175b", 96, 12288, 96),
    "llama-2-7b": ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 3, 2, False, 4096),
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 3, 2, False, 8192),
    "llama-2-70b": ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, 3, 2, False, 4096),
}


def resolve_model_spec(name_or_path: str | None, dtype_bytes: int | None = None) -> ModelSpec:
    """A preset name, a planner JSON description, an HF config.json, a model folder or a
    .gguf file; None: the shipped SmolLM2. `dtype_bytes` overrides the weight/KV width
    (a model the engine loads defaults to fp32 = 4, the engine's CPU dtype)."""
    spec = _resolve(name_or_path)
    if dtype_bytes is not None:
        spec = dataclasses.replace(spec, dtype_bytes=dtype_bytes)
    return spec


def _resolve(name_or_path: str | None) -> ModelSpec:
    if name_or_path is not None and name_or_path.lower() in PRESETS:
        return PRESETS[name_or_path.lower()]
    if name_or_path is not None:
        path = Path(name_or_path)
        if path.suffix == ".json" and path.is_file():
            return _from_json_file(path)
        if not path.exists():
            raise PlanInputError(
                f"model {name_or_path!r}: not a preset ({', '.join(sorted(PRESETS))}) "
                "and no such file or folder"
            )
    return _from_engine_model(name_or_path)


def _from_json_file(path: Path) -> ModelSpec:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanInputError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise PlanInputError(f"{path}: expected a JSON object")
    if "architectures" in d:  # a Hugging Face config.json
        from pdserve.model.config import ModelConfig

        try:
            return from_model_config(ModelConfig.from_hf_dict(d, str(path)), path.parent.name)
        except ModelLoadError as e:
            raise PlanInputError(str(e)) from None
    return ModelSpec.from_dict(d, str(path))


def _from_engine_model(path: str | None) -> ModelSpec:
    from pdserve.model.default import default_model_path
    from pdserve.model.source import load_config

    try:
        target = path if path is not None else default_model_path()
        config = load_config(target)
    except ModelLoadError as e:
        raise PlanInputError(str(e)) from None
    return from_model_config(config, Path(target).stem, dtype_bytes=4)


def from_model_config(config: Any, name: str, dtype_bytes: int = 2) -> ModelSpec:
    """From the engine's `ModelConfig` (Llama family: gated FFN)."""
    return ModelSpec(
        name=name,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        ffn_matrices=3,
        dtype_bytes=dtype_bytes,
        tied_embeddings=config.tie_word_embeddings,
        max_context=config.max_position_embeddings,
    )
