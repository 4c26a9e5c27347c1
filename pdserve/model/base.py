"""The decoder-only causal LM shared by the Llama-family files.

`CausalLM.forward` takes one step's flat batch and returns logits only for the rows
that will be sampled. A per-layer hook (`ForwardHooks.on_layer_done`) fires after
each layer has written its K/V into the cache: the point where DéjàVu-style
layer-by-layer streaming can ship that layer's KV while later layers compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.errors import ModelLoadError
from pdserve.model.attention import AttentionMetadata
from pdserve.model.config import ModelConfig
from pdserve.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from pdserve.model.linear import PackedLinear


@dataclass(frozen=True)
class ForwardHooks:
    """Optional callbacks during a forward pass. `on_layer_done(layer_idx)` runs after
    layer `layer_idx` has written this step's K/V into the cache."""

    on_layer_done: Callable[[int], None] | None = None


class CausalLM(nn.Module):
    """Embedding, decoder layers over the paged cache, final norm, LM head.

    Family files subclass this and set the class attributes that distinguish them.
    """

    use_sliding_window: bool = False  # honour config.sliding_window (Mistral)

    @classmethod
    def projection_biases(cls, config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v carry a bias, o_proj carries a bias). Llama: both follow attention_bias."""
        return config.attention_bias, config.attention_bias

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        qkv_bias, o_bias = self.projection_biases(config)
        self.embed_tokens = nn.Parameter(
            torch.zeros(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        self.rotary = RotaryEmbedding(config, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, o_bias, dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(
                torch.zeros(config.vocab_size, config.hidden_size, dtype=dtype),
                requires_grad=False,
            )
        )
        self.finalized = False
        self.finalize(pack=False)

    @property
    def sliding_window(self) -> int | None:
        return self.config.sliding_window if self.use_sliding_window else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        hooks: ForwardHooks | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: [num_layers, 2, blocks, bs, Hkv, D];
        logits_indices: rows to produce logits for. Returns [len(logits_indices), vocab]."""
        rows = self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices, hooks)
        return self.compute_logits(rows)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        hooks: ForwardHooks | None = None,
    ) -> torch.Tensor:
        """`forward` without the LM head: the final-norm hidden states of the rows in
        `logits_indices`, [len(logits_indices), hidden] (what the length head reads)."""
        h = self.embed_tokens[input_ids]
        cos, sin = self.rotary.lookup(positions)
        on_layer_done = hooks.on_layer_done if hooks else None
        for i, layer in enumerate(self.layers):
            h = layer.forward(h, cos, sin, kv_caches[i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.norm(h[logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] final-norm hidden states -> [rows, vocab] logits."""
        return self.lm_head_op(hidden)

    def finalize(self, pack: bool = True) -> None:
        """Prepare the loaded weights for serving: oneDNN-packed projections on CPU.

        With `pack`, later `load_weights` calls are refused: the kernels no longer
        read the parameters (see model/linear.py)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.finalize(pack)
            layer.mlp.finalize(pack)
        self.lm_head_op = PackedLinear(self.lm_head, None, pack)
        self.finalized = pack
        if pack:
            self._release_packed_originals()

    def _release_packed_originals(self) -> None:
        """Free the row-major copies of weights that now live packed (halves memory)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            a, m = layer.self_attn, layer.mlp
            for param, op in (
                (a.qkv, a.qkv_op),
                (a.o, a.o_op),
                (m.gate_up, m.gate_up_op),
                (m.down, m.down_op),
            ):
                if op.packed is not None:
                    param.data = torch.empty(0, dtype=param.dtype)
        if not self.config.tie_word_embeddings and self.lm_head_op.packed is not None:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)

    # ---- weights ---------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters; fail on any missing one.

        Call `finalize()` afterwards to get the fast kernels."""
        if self.finalized:
            raise RuntimeError("weights are packed for serving; build a new model to reload")
        targets = self._weight_targets()
        seen: set[str] = set()
        for name, tensor in weights:
            if name not in targets:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ModelLoadError(f"unexpected weight {name!r} for {self.config.architecture}")
            dst = targets[name]
            if dst.shape != tensor.shape:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            seen.add(name)
        missing = [n for n in targets if n not in seen]
        if self.config.tie_word_embeddings:
            missing = [n for n in missing if n != "lm_head.weight"]
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {missing[0]!r}")

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF name -> the view of our (possibly fused) parameter it fills."""
        c = self.config
        t: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if not c.tie_word_embeddings:
            t["lm_head.weight"] = self.lm_head.data
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            a, m = layer.self_attn, layer.mlp
            qkv = a.qkv.data.split([c.q_size, c.kv_size, c.kv_size])
            t.update({f"{p}self_attn.{n}_proj.weight": w for n, w in zip("qkv", qkv, strict=True)})
            if a.qkv_bias is not None:
                bias = a.qkv_bias.data.split([c.q_size, c.kv_size, c.kv_size])
                t.update(
                    {f"{p}self_attn.{n}_proj.bias": b for n, b in zip("qkv", bias, strict=True)}
                )
            t[f"{p}self_attn.o_proj.weight"] = a.o.data
            if a.o_bias is not None:
                t[f"{p}self_attn.o_proj.bias"] = a.o_bias.data
            gate, up = m.gate_up.data.split(c.intermediate_size)
            t[f"{p}mlp.gate_proj.weight"] = gate
            t[f"{p}mlp.up_proj.weight"] = up
            t[f"{p}mlp.down_proj.weight"] = m.down.data
            t[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight.data
            t[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
        return t
