"""A rank's model: the config of its shard and its slices of the checkpoint's weights.

A pipeline stage's rank holds its stage's layers only, numbered from 0 (the checkpoint's
layer l0 + i is its layer i; its KV pool's `first_layer` says l0), and, on stages after
the first, no embedding and no LM head (`CausalLM.drop_ends`). A tensor-parallel rank
runs an ordinary `CausalLM` built from `shard_config` (its query and KV heads, its
intermediate columns; hidden size and vocabulary whole) and loaded from `shard_weights`
(each HF-named tensor cut to the rank's rows or columns), so the model code, the KV pool
(its KV heads only) and the compiled kernels are those of a smaller model. What makes
the ranks one model is the sum of their partial outputs after the attention's o
projection and after the MLP's down projection (`CausalLM.reduce`, set by the process
group): column-parallel q/k/v and gate/up (rows of W cut), row-parallel o and down
(columns of W cut), Megatron-LM's split.

Contract: a row-parallel projection's bias (o_proj's, where the model has one) is added
once, by its stage's tensor rank 0; the other ranks' copies are zero.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch

from pdserve.model.base import CausalLM, Weight
from pdserve.model.config import ModelConfig
from pdserve.model.loader import iter_weights
from pdserve.model.quantization import Quantization
from pdserve.model.registry import build_model
from pdserve.model.source import ModelPath, load_config
from pdserve.parallel.layout import Shard
from pdserve.quant.formats import QuantWeight


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """`config` as rank `shard.rank` holds it."""
    return dataclasses.replace(
        config,
        num_hidden_layers=shard.num_layers,
        num_attention_heads=shard.num_q_heads,
        num_key_value_heads=shard.num_kv_heads,
        intermediate_size=shard.intermediate_size,
    )


_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")
_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _stage_name(name: str, layers: tuple[int, int]) -> str | None:
    """`name` renumbered into the stage holding `layers` ([l0, l1)), or None for another
    stage's layer; names outside the layers unchanged."""
    m = _INDEX.match(name)
    if m is None:
        return name
    i = int(m.group(1))
    if not layers[0] <= i < layers[1]:
        return None
    return f"model.layers.{i - layers[0]}.{name[m.end() :]}"


def _rows(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, QuantWeight):
        return w.rows(torch.arange(start, stop))
    return w[start:stop].contiguous()


def _columns(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, QuantWeight):
        return w.columns(start, stop)
    return w[:, start:stop].contiguous()


def shard_weights(
    weights: Iterable[tuple[str, Weight]], config: ModelConfig, shard: Shard
) -> Iterator[tuple[str, Weight]]:
    """The rank's slice of each HF-named weight of the full model `config`: its stage's
    layers (renumbered from 0), of them q/k/v and gate/up rows (and biases), o and down
    columns; the rest whole."""
    d = config.head_dim
    q = (shard.q_heads[0] * d, shard.q_heads[1] * d)
    kv = (shard.kv_heads[0] * d, shard.kv_heads[1] * d)
    inter = shard.intermediate
    for hf_name, w in weights:
        name = _stage_name(hf_name, shard.layers)
        if name is None:
            continue
        m = _LAYER.search(name)
        if m is None:
            yield name, w
            continue
        proj, kind = m.group(2), m.group(3)
        if proj == "q":
            yield name, _rows(w, *q)
        elif proj in ("k", "v"):
            yield name, _rows(w, *kv)
        elif proj in ("gate", "up"):
            yield name, _rows(w, *inter)
        elif kind == "bias":  # o_proj's: added once, by the stage's tensor rank 0
            assert isinstance(w, torch.Tensor)
            yield name, w if shard.tp_rank == 0 else torch.zeros_like(w)
        elif proj == "o":
            yield name, _columns(w, *q)
        elif proj == "down":
            yield name, _columns(w, *inter)
        else:
            raise ValueError(f"no tensor-parallel rule for weight {name!r}")


def load_shard(
    path: ModelPath,
    shard: Shard,
    dtype: torch.dtype = torch.float32,
    quantization: Quantization | None = None,
) -> CausalLM:
    """Rank `shard.rank`'s model of the checkpoint at `path`, finalized: the shard's config
    and weight slices (`quantization` as `resolve_quantization` decided for the whole
    model; a GGUF's blocks are cut between blocks). Its `reduce` is not set: the caller
    joins the group first (`CausalLM.set_reduce`)."""
    quantization = quantization or Quantization()
    full = load_config(path)
    model = build_model(shard_config(full, shard), dtype, quantization.quantized)
    model.quantization = quantization
    model.load_weights(shard_weights(iter_weights(path, dtype, quantization), full, shard))
    model.finalize()
    if not shard.first:
        model.drop_ends()
    return model
