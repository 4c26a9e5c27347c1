"""Architecture hyper-parameters of a decoder-only Llama-family model.

`ModelConfig` is the one description every model file, loader and KV-cache sizing
uses. It is built from a Hugging Face `config.json` dict (`from_hf_dict`) or from
GGUF metadata (by the GGUF loader, which produces the same dict shape first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import ModelLoadError


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (Llama 3.1+). `None` on ModelConfig = plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Mistral: keys more than `sliding_window` positions behind a query are masked.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V, all layers, for one token."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face config dict. `source` names the file in errors."""
        archs = d.get("architectures") or []
        if not archs:
            raise ModelLoadError(f"{source}: no 'architectures' entry")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
            return cls(
                architecture=str(archs[0]),
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(d)),
                rope_scaling=_rope_scaling(d, source),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                sliding_window=int(window) if window else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: invalid value ({e})") from None


def _rope_theta(d: dict[str, Any]) -> float:
    params = d.get("rope_parameters") or {}
    return float(d.get("rope_theta", params.get("rope_theta", 10000.0)))


def _rope_scaling(d: dict[str, Any], source: str) -> RopeScaling | None:
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(
            f"{source}: unsupported rope_scaling type {kind!r} (supported: llama3)"
        )
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )
