"""The decoder-only causal LM shared by the Llama-family files.

`CausalLM.forward` takes one step's flat batch and returns logits only for the rows
that will be sampled. A per-layer hook (`ForwardHooks.on_layer_done`) fires after
each layer has written its K/V into the cache: the point where DéjàVu-style
layer-by-layer streaming can ship that layer's KV while later layers compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
from torch import nn

from pdserve.errors import ModelLoadError
from pdserve.memory import HugePageArena
from pdserve.model.attention import AttentionMetadata
from pdserve.model.config import ModelConfig
from pdserve.model.fused import FusedLayers, norm_rows
from pdserve.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from pdserve.model.linear import Linear, PackedLinear, projection
from pdserve.model.quantization import Quantization, is_quantizable
from pdserve.model.source import weight_shapes
from pdserve.quant.formats import QuantWeight
from pdserve.quant.linear import CompiledLinear, DenseLinear, QuantEmbedding, QuantLinear

Weight = torch.Tensor | QuantWeight


@dataclass(frozen=True)
class ForwardHooks:
    """Optional callbacks during a forward pass. `on_layer_done(layer_idx)` runs after
    layer `layer_idx` has written this step's K/V into the cache."""

    on_layer_done: Callable[[int], None] | None = None


class FinalStates(NamedTuple):
    """What a step leaves for sampling, for its rows that sample."""

    hidden: torch.Tensor  # [rows, hidden]: final-norm states (what the length head reads)
    logits: torch.Tensor  # [rows, vocab]
    # [rows] int64: each logits row's argmax, where it was asked for (`greedy`) and the one
    # compiled call ran the LM head (it takes it while the logits are in cache); else None
    argmax: torch.Tensor | None = None


class CausalLM(nn.Module):
    """Embedding, decoder layers over the paged cache, final norm, LM head.

    Family files subclass this and set the class attributes that distinguish them.

    `quantized`: the projections, embeddings and LM head may arrive in GGUF blocks
    (`QuantWeight`) and are then served as they are (pdserve/quant). Their fp32
    parameters are never allocated: `load_weights` keeps what arrives by name and
    `finalize` builds each op from it - quantized where every part of a fused op has
    the same block format, dequantized to `dtype` otherwise.
    """

    use_sliding_window: bool = False  # honour config.sliding_window (Mistral)

    @classmethod
    def projection_biases(cls, config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v carry a bias, o_proj carries a bias). Llama: both follow attention_bias."""
        return config.attention_bias, config.attention_bias

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, quantized: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.quantized = quantized
        self._parts: dict[str, Weight] = {}  # quantized: weights by HF name until finalize
        self.quantization = Quantization()  # what --quantization came to (set by the loader)
        qkv_bias, o_bias = self.projection_biases(config)
        self.rotary = RotaryEmbedding(config, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, o_bias, dtype, materialize=not quantized)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.finalized = False
        # Whether this model holds the embedding and the LM head (`drop_ends`).
        self.has_ends = True
        # The compiled per-row path (`DecoderLayer.forward_fused`): a model whose every
        # layer's projections are compiled ops (set by finalize). The engine then builds per-row
        # attention metadata (`AttentionMetadata.build(per_row=True)`).
        self.fused = False
        # On the fused path, all layers in one compiled call (model/fused.py) unless a
        # forward has a per-layer hook; off, one call per layer (bench_step_breakdown.py
        # turns it off to time each call).
        self.layers_in_one_call = True
        if quantized:
            # Set by finalize: a QuantEmbedding, or a tensor where the file has fp values.
            self.embed_tokens: torch.Tensor | QuantEmbedding = torch.empty(0)
            return
        self.embed_tokens = nn.Parameter(
            torch.zeros(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(
                torch.zeros(config.vocab_size, config.hidden_size, dtype=dtype),
                requires_grad=False,
            )
        )
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
        args = (input_ids, positions, kv_caches, meta, logits_indices, hooks)
        return self.hidden_and_logits(*args).logits

    def hidden_and_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        hooks: ForwardHooks | None = None,
        greedy: bool = False,
    ) -> FinalStates:
        """The final-norm hidden states of the `logits_indices` rows, [len(logits_indices),
        hidden], and their logits, [len(logits_indices), vocab]. On the one-call path the
        head runs inside that call (and not at all for no rows: a step of partial prompt
        chunks), and with `greedy` so does each row's argmax (FinalStates.argmax)."""
        h = self.embed(input_ids)
        per_row = meta.ranges is not None
        if per_row and self.layers_in_one_call and (hooks is None or hooks.on_layer_done is None):
            if not self.fused:
                raise ValueError("per-row attention metadata, but this model is not fused")
            if kv_caches.is_contiguous():  # the one-call compiled path
                rows = logits_indices.contiguous()
                call = self._fused_layers()
                hidden, logits, argmax = call(h, positions, kv_caches, meta, rows, greedy)
                if logits is None:
                    return FinalStates(hidden, self.compute_logits(hidden))
                return FinalStates(hidden, logits, argmax)
        h = self.run_layers(h, positions, kv_caches, meta, hooks)
        return self.finish(h, logits_indices, per_row)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] (contiguous: the compiled layers update it in
        place)."""
        if not self.has_ends:
            raise RuntimeError("a later pipeline stage holds no embedding")
        return self.embed_tokens[input_ids].contiguous()

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        hooks: ForwardHooks | None = None,
    ) -> torch.Tensor:
        """Every layer of this model over `h` ([T, hidden], every row), one call a layer:
        the hidden states after the last layer (before the final norm). The compiled
        per-row path where `meta` is per-row (it may update `h` in place)."""
        on_layer_done = hooks.on_layer_done if hooks else None
        if meta.ranges is not None:
            if not self.fused:
                raise ValueError("per-row attention metadata, but this model is not fused")
            for i, fused in enumerate(cast(list[DecoderLayer], self.layers)):
                h = fused.forward_fused(h, positions, self.rotary, kv_caches[i], meta)
                if on_layer_done is not None:
                    on_layer_done(i)
            return h
        cos, sin = self.rotary.lookup(positions)
        for i, layer in enumerate(self.layers):
            h = layer.forward(h, cos, sin, kv_caches[i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return h

    def finish(self, h: torch.Tensor, rows: torch.Tensor, per_row: bool) -> FinalStates:
        """The last layer's hidden states `h` -> the final-norm states and logits of its
        rows `rows` (the compiled norm on the per-row path, as the layers ran)."""
        if not self.has_ends:
            raise RuntimeError("a later pipeline stage holds no LM head")
        hidden = norm_rows(h.contiguous(), rows, self.norm) if per_row else self.norm(h[rows])
        return FinalStates(hidden, self.compute_logits(hidden))

    def drop_ends(self) -> None:
        """Release the embedding and the LM head: this model is a pipeline stage after
        the first, which takes hidden states in and hands them on (pdserve/parallel)."""
        empty = torch.empty(0, dtype=self.dtype)
        if isinstance(self.embed_tokens, nn.Parameter):
            self.embed_tokens.data = empty
        else:
            self.embed_tokens = empty
        if not self.quantized and not self.config.tie_word_embeddings:
            self.lm_head.data = empty
        del self.lm_head_op
        self.__dict__.pop("_fused_layers_call", None)
        self.has_ends = False
        self.layers_in_one_call = False

    def set_reduce(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Make this model one rank of a tensor-parallel group (pdserve/parallel): every
        layer sums its partial attention and MLP outputs over the ranks with `reduce`
        (in place). The layers then run one call each (the compiled loop has no point to
        reduce at), and no decode burst runs."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.reduce = reduce
        self.layers_in_one_call = False

    def burst_call(self) -> FusedLayers | None:
        """The compiled call that runs decode bursts (`FusedLayers.decode_burst`), where
        this model has one: the one-call compiled path with a compiled LM head and an
        embedding the call can look up; else None."""
        if not (self.fused and self.layers_in_one_call):
            return None
        call = self._fused_layers()
        return call if call.bursts else None

    def _fused_layers(self) -> FusedLayers:
        """Every layer's `forward_fused`, the final norm and the LM head as one compiled
        call (model/fused.py), built on first use and kept: the ops it points at are built
        once, by finalize."""
        layers = self.__dict__.get("_fused_layers_call")
        if layers is None:
            layers = FusedLayers(
                cast(list[DecoderLayer], self.layers),
                self.rotary,
                self.norm,
                self.lm_head_op,
                self.embed_tokens,
            )
            self.__dict__["_fused_layers_call"] = layers
        return cast(FusedLayers, layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] final-norm hidden states -> [rows, vocab] logits."""
        return self.lm_head_op(hidden)

    def finalize(self, pack: bool = True) -> None:
        """Prepare the loaded weights for serving: compiled fp32 ops on CPU where the
        kernels are built (model/linear.py `projection`), else oneDNN-packed ones.

        With `pack`, later `load_weights` calls are refused: the kernels no longer
        read the parameters (see model/linear.py)."""
        if self.quantized:
            self._finalize_quantized(pack)
            return
        arena = HugePageArena()  # the fp32 panels, where the kernels take them
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.finalize(pack, arena)
            layer.mlp.finalize(pack, arena)
        self.lm_head_op: Linear = projection(self.lm_head, None, pack, arena)
        self.finalized = pack
        if pack:
            self._release_packed_originals()
        self.fused = self._can_fuse()

    def _finalize_quantized(self, pack: bool) -> None:
        """Build every op from the weights `load_weights` kept (see the class docstring),
        what their kernels stream on 2 MB pages (pdserve/memory.py)."""
        arena = HugePageArena()
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            a, m = layer.self_attn, layer.mlp
            qkv = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
            a.qkv_op = self._op(qkv, a.qkv_bias, pack, arena)
            a.o_op = self._op([f"{p}self_attn.o_proj.weight"], a.o_bias, pack, arena)
            gate_up = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
            m.gate_up_op = self._op(gate_up, None, pack, arena)
            m.down_op = self._op([f"{p}mlp.down_proj.weight"], None, pack, arena)
        embed = self._parts["model.embed_tokens.weight"]
        tied = self.config.tie_word_embeddings
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.lm_head_op = self._op([head], None, pack, arena)
        if tied and isinstance(self.lm_head_op, QuantLinear) and len(self.lm_head_op.weights) == 1:
            embed = self.lm_head_op.weights[0]  # one copy of a tied matrix, wherever it went
        self.embed_tokens = QuantEmbedding(embed) if isinstance(embed, QuantWeight) else embed
        self._parts.clear()
        self.finalized = True
        self.fused = self._can_fuse()

    def _can_fuse(self) -> bool:
        """Whether every layer can run `DecoderLayer.forward_fused`: all its projections
        compiled ops (quantized, or fp32 panels), fp32, and a head size the attention
        kernel takes."""
        c = self.config
        return (
            self.dtype == torch.float32
            and c.head_dim % 8 == 0
            and c.head_dim <= 256
            and all(isinstance(x, DecoderLayer) and x.fused_ops() is not None for x in self.layers)
        )

    def _op(
        self, names: list[str], bias: torch.Tensor | None, pack: bool, arena: HugePageArena
    ) -> Linear:
        parts = [self._parts[n] for n in names]
        quant = [p for p in parts if isinstance(p, QuantWeight)]
        if len(quant) == len(parts):
            return QuantLinear(quant, bias, self.quantization.activations, arena)
        fp = [p.dequantize(self.dtype) if isinstance(p, QuantWeight) else p for p in parts]
        return projection(torch.cat(fp).to(self.dtype), bias, pack, arena)

    def projection_ops(self) -> list[Linear]:
        """The LM head (where this model holds one), then each layer's qkv, o, gate_up and
        down ops, in that order."""
        ops: list[Linear] = [self.lm_head_op] if self.has_ends else []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            a, m = layer.self_attn, layer.mlp
            ops += [a.qkv_op, a.o_op, m.gate_up_op, m.down_op]
        return ops

    @property
    def compiled(self) -> bool:
        """Whether every projection runs on the compiled kernels (quantized blocks, or
        fp32 panels: model/linear.py `projection`)."""
        return all(isinstance(op, CompiledLinear) for op in self.projection_ops())

    @property
    def weight_formats(self) -> list[str]:
        """The block formats the ops read ("Q4_1", "Q8_0", ...), or ["fp32"]-like dtype
        names where they read full-precision weights; sorted, each once."""
        return self._projection_labels(lambda op: op.formats)

    @property
    def activations(self) -> list[str]:
        """How the projections take activations ("fp32", "int8"; a full-precision op:
        its dtype's name), sorted, each once."""
        return self._projection_labels(lambda op: op.activations)

    def _projection_labels(self, of: Callable[[QuantLinear], list[str]]) -> list[str]:
        """The union of `of(op)` over the quantized ops, the dtype's name for the others."""
        dtype = str(self.dtype).removeprefix("torch.")
        ops = self.projection_ops()
        return sorted({x for o in ops for x in (of(o) if isinstance(o, QuantLinear) else [dtype])})

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
                if _copied(op):
                    param.data = torch.empty(0, dtype=param.dtype)
        head = self.lm_head_op
        tied = self.config.tie_word_embeddings
        if not tied and _copied(head):
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)

    # ---- weights ---------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Copy HF-named tensors into the fused parameters; fail on any missing one.

        Call `finalize()` afterwards to get the fast kernels."""
        if self.finalized:
            raise RuntimeError("weights are packed for serving; build a new model to reload")
        targets = self._weight_targets()
        kept = self._kept_shapes()
        seen: set[str] = set()
        for name, tensor in weights:
            if name in kept:
                shape = tensor.shape if isinstance(tensor, QuantWeight) else tuple(tensor.shape)
                if tuple(shape) != kept[name]:
                    raise ModelLoadError(
                        f"weight {name!r} has shape {tuple(shape)}, expected {kept[name]}"
                    )
                self._parts[name] = tensor
                seen.add(name)
                continue
            assert isinstance(tensor, torch.Tensor), name
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
        missing = [n for n in [*targets, *kept] if n not in seen]
        if self.config.tie_word_embeddings:
            missing = [n for n in missing if n != "lm_head.weight"]
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {missing[0]!r}")

    def _kept_shapes(self) -> dict[str, tuple[int, ...]]:
        """Quantized models: the HF names whose weights are kept as they arrive, with the
        shape each must have."""
        if not self.quantized:
            return {}
        return {n: s for n, s in weight_shapes(self.config).items() if is_quantizable(n)}

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF name -> the view of our (possibly fused) parameter it fills: norms and
        biases, and (unless quantized, see `_kept_shapes`) the weight matrices."""
        c = self.config
        t: dict[str, torch.Tensor] = {"model.norm.weight": self.norm.weight.data}
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            a = layer.self_attn
            if a.qkv_bias is not None:
                bias = a.qkv_bias.data.split([c.q_size, c.kv_size, c.kv_size])
                t.update(
                    {f"{p}self_attn.{n}_proj.bias": b for n, b in zip("qkv", bias, strict=True)}
                )
            if a.o_bias is not None:
                t[f"{p}self_attn.o_proj.bias"] = a.o_bias.data
            t[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight.data
            t[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
        if not self.quantized:
            t.update(_matrix_targets(self))
        return t


def _matrix_targets(model: CausalLM) -> dict[str, torch.Tensor]:
    """HF name -> the view of the fp model's (possibly fused) weight matrix it fills."""
    c = model.config
    assert isinstance(model.embed_tokens, torch.Tensor)
    t = {"model.embed_tokens.weight": model.embed_tokens.data}
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = model.lm_head.data
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        a, m = layer.self_attn, layer.mlp
        qkv = a.qkv.data.split([c.q_size, c.kv_size, c.kv_size])
        t.update({f"{p}self_attn.{n}_proj.weight": w for n, w in zip("qkv", qkv, strict=True)})
        t[f"{p}self_attn.o_proj.weight"] = a.o.data
        gate, up = m.gate_up.data.split(c.intermediate_size)
        t[f"{p}mlp.gate_proj.weight"] = gate
        t[f"{p}mlp.up_proj.weight"] = up
        t[f"{p}mlp.down_proj.weight"] = m.down.data
    return t


def _copied(op: Linear) -> bool:
    """Whether `op` reads its own copy of its weight (oneDNN's packed one, or fp32
    panels), so the parameter it was made from can be released."""
    return isinstance(op, DenseLinear) or (isinstance(op, PackedLinear) and op.packed is not None)
