"""Read a llama.cpp GGUF file's tensors as Hugging Face float tensors or kept blocks.

This module renames (`gguf_header.py`), reshapes and dequantizes; `loader.py` decides which
tensors must be present. The result equals what transformers' own GGUF loader builds
(`from_pretrained(..., gguf_file=...)`), tensor for tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import torch

from pdserve.errors import ModelLoadError
from pdserve.model.config import ModelConfig
from pdserve.model.gguf_header import gguf_architecture, hf_tensor_name, open_gguf
from pdserve.quant.formats import BLOCK, QuantType, QuantWeight


def iter_gguf_tensors(
    path: Path,
    names: Iterable[str],
    config: ModelConfig,
    dtype: torch.dtype,
    keep_blocks: Iterable[str] = (),
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """The named HF tensors (all must be present), in the order given: dequantized to
    `dtype`, except those named in `keep_blocks` whose GGUF type the kernels read
    (`QuantType`), which come as `QuantWeight`s, rows in HF order."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    by_name = {hf_tensor_name(t.name) or t.name: t for t in reader.tensors}
    keep = set(keep_blocks)
    for name in names:
        t = by_name[name]
        heads = None
        if arch == "llama" and ".self_attn.q_proj." in name:
            heads = config.num_attention_heads
        elif arch == "llama" and ".self_attn.k_proj." in name:
            heads = config.num_key_value_heads
        qtype = QuantType.from_ggml(t.tensor_type)
        if name in keep and qtype is not None:
            weight = _blocks(t, qtype, path)
            if heads is not None:
                order = _reverse_permute(torch.arange(weight.shape[0]).unsqueeze(1), heads)
                weight = weight.rows(order.squeeze(1))
            yield name, weight
            continue
        tensor = _dequantize(t, path)
        if heads is not None:
            tensor = _reverse_permute(tensor, heads)
        yield name, tensor.to(dtype)


def _blocks(t: gguf.ReaderTensor, qtype: QuantType, path: Path) -> QuantWeight:
    k, rows = int(t.shape[0]), int(np.prod(t.shape[1:]))
    raw = np.asarray(t.data)
    label = f"{path}: tensor {t.name!r} ({qtype.name}, shape {[int(n) for n in t.shape]})"
    per = qtype.block_values
    if k % per:
        raise ModelLoadError(f"{label}: rows of {k} values are not whole {per}-value blocks")
    want = rows * k // per * qtype.block_bytes
    if raw.size != want:
        raise ModelLoadError(
            f"{label} holds {raw.size} bytes, expected {want}: the file is truncated or corrupt"
        )
    weight = QuantWeight.from_blocks(qtype, raw, k)
    per = BLOCK // qtype.layout.scales_per_block
    for what, values in (("scale", weight.d), ("minimum", weight.m)):
        if values is not None:
            _check_finite(f"{label}: the block {what} of", values.numpy(), per, "values")
    return weight


def _check_finite(label: str, values: npt.NDArray[Any], per: int, unit: str) -> None:
    """Refuse NaN or infinity in a [rows, n] array (a corrupt file), naming the first
    one's place: entry j of a row covers `unit`s j*per .. (j+1)*per - 1 of it."""
    bad = ~np.isfinite(values)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        place = f"{unit} {col}" if per == 1 else f"{unit} {col * per}-{(col + 1) * per - 1}"
        raise ModelLoadError(
            f"{label} row {row}, {place}, is {values[row, col]}: the file is corrupt"
        )


def _dequantize(t: gguf.ReaderTensor, path: Path) -> torch.Tensor:
    try:
        weights = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} has quantization type {t.tensor_type.name}, "
            "which gguf cannot dequantize"
        ) from e
    weights = weights.reshape(tuple(int(n) for n in reversed(t.shape.tolist())))
    label = f"{path}: tensor {t.name!r} ({t.tensor_type.name}): the value of"
    _check_finite(label, weights.reshape(-1, weights.shape[-1]), 1, "column")
    if not weights.flags.writeable:  # F32 tensors are views of the read-only file map
        weights = weights.copy()
    return torch.from_numpy(weights)


def _reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (HF rotate-half RoPE -> interleaved pairs).

    The converter reshapes rows as (head, 2, half) and swaps the last two; this is the
    inverse, as in transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
