"""Building blocks shared by every Llama-family model file.

Weights are held fused where the math allows it (q/k/v in one matrix, gate/up in
one matrix): fewer, larger matmuls matter on CPU where per-op overhead dominates
small-batch decode. `load_weights` in `base.py` maps HF parameter names onto them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.memory import HugePageArena
from pdserve.model.attention import AttentionMetadata, paged_attention, row_attention, write_kv
from pdserve.model.config import ModelConfig, RopeScaling
from pdserve.model.linear import Linear, PackedLinear, projection
from pdserve.quant.linear import CompiledLinear

# What a fused layer's step reads (DecoderLayer._fused_plan): qkv, o, gate/up and down
# ops, the two RMSNorms' weights and eps, query heads, attention scale.
FusedPlan = tuple[
    CompiledLinear, CompiledLinear, CompiledLinear, CompiledLinear, torch.Tensor, float,
    torch.Tensor,
    float, int, float,
]  # fmt: skip


def _param(*shape: int, dtype: torch.dtype, materialize: bool = True) -> nn.Parameter:
    """A frozen parameter of zeros; with `materialize` False an empty placeholder (a
    quantized model's projection: its weight arrives as blocks, see CausalLM)."""
    data = torch.zeros(*shape, dtype=dtype) if materialize else torch.empty(0, dtype=dtype)
    return nn.Parameter(data, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies, computed the way HF transformers does (bit-identical)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exps)
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table over all positions (looked up once per step)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [num_tokens, 1, head_dim]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, materialize: bool = True) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up = _param(2 * i, h, dtype=dtype, materialize=materialize)
        self.down = _param(h, i, dtype=dtype, materialize=materialize)
        self.gate_up_op: Linear = PackedLinear(self.gate_up, None, pack=False)
        self.down_op: Linear = PackedLinear(self.down, None, pack=False)

    def finalize(self, pack: bool, arena: HugePageArena | None = None) -> None:
        """Called once after the weights are loaded (`arena`: see `projection`)."""
        self.gate_up_op = projection(self.gate_up, None, pack, arena)
        self.down_op = projection(self.down, None, pack, arena)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_op(x).split(self.intermediate, dim=-1)
        return self.down_op(F.silu(gate) * up)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        qkv_bias: bool,
        o_bias: bool,
        dtype: torch.dtype,
        materialize: bool = True,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv = _param(qkv_rows, config.hidden_size, dtype=dtype, materialize=materialize)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if qkv_bias else None
        self.o = _param(config.hidden_size, self.q_size, dtype=dtype, materialize=materialize)
        self.o_bias = _param(config.hidden_size, dtype=dtype) if o_bias else None
        self.finalize(pack=False)

    def finalize(self, pack: bool, arena: HugePageArena | None = None) -> None:
        """Called once after the weights are loaded (`arena`: see `projection`)."""
        self.qkv_op: Linear = projection(self.qkv, self.qkv_bias, pack, arena)
        self.o_op: Linear = projection(self.o, self.o_bias, pack, arena)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_op(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k rotated together: one set of RoPE ops per layer instead of two.
        qk = apply_rope(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_op(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        qkv_bias: bool,
        o_bias: bool,
        dtype: torch.dtype,
        materialize: bool = True,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_idx, qkv_bias, o_bias, dtype, materialize)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, materialize)
        # A tensor-parallel rank's sum over the ranks of a partial output (in place; the
        # o and down projections' outputs: pdserve/parallel/shard.py); None alone.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # .forward directly: nn.Module.__call__ costs microseconds per call, and a
        # batch-1 decode step makes ~150 of these calls.
        a = self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, kv_cache, meta)
        h = h + (a if self.reduce is None else self.reduce(a))
        m = self.mlp.forward(self.post_attention_layernorm.forward(h))
        return h + (m if self.reduce is None else self.reduce(m))

    def fused_ops(
        self,
    ) -> tuple[CompiledLinear, CompiledLinear, CompiledLinear, CompiledLinear] | None:
        """qkv, o, gate_up and down when all four are compiled ops (quantized or fp32
        panels: the path of `forward_fused`), else None."""
        a, m = self.self_attn, self.mlp
        ops = (a.qkv_op, a.o_op, m.gate_up_op, m.down_op)
        if not all(isinstance(op, CompiledLinear) for op in ops):
            return None
        return ops  # type: ignore[return-value]

    def forward_fused(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`forward` for a quantized layer on CPU, in five compiled calls: each RMSNorm is
        fused into the next projection as its prologue, SwiGLU into down's,
        the residual adds into o's and down's output, RoPE and the KV write into the
        attention (`row_attention`). Every step is row-invariant (a row gets the same
        bits alone or in any batch), which recovery's recompute relies on.

        Updates `h` (contiguous fp32 [T, hidden]) in place and returns it."""
        plan = self.__dict__.get("_fused_plan") or self._fused_plan()
        qkv_op, o_op, gate_up_op, down_op, n1_w, n1_eps, n2_w, n2_eps, heads, scale = plan
        qkv = qkv_op.run(h, norm=n1_w, eps=n1_eps)
        o = row_attention(
            qkv, positions, rotary.cos, rotary.sin, kv_cache[0], kv_cache[1], meta, heads, scale
        )
        reduce = self.reduce
        if reduce is None:
            o_op.run(o, into=h)
        else:  # a rank's partial o, summed over the ranks, then the residual add
            h += reduce(o_op.run(o))
        gate_up = gate_up_op.run(h, norm=n2_w, eps=n2_eps)
        if reduce is None:
            return down_op.run(gate_up, swiglu=True, into=h)
        h += reduce(down_op.run(gate_up, swiglu=True))
        return h

    def _fused_plan(self) -> FusedPlan:
        """What `forward_fused` reads, gathered once into a plain attribute (each
        nn.Module attribute lookup costs ~0.5 us, ten per layer per step). The ops and
        norm weights are the layer's own objects: built at finalize, never replaced."""
        ops = self.fused_ops()
        assert ops is not None
        a, n1, n2 = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        plan: FusedPlan = (*ops, n1.weight, n1.eps, n2.weight, n2.eps, a.num_heads, a.scale)
        self.__dict__["_fused_plan"] = plan
        return plan
