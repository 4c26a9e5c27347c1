"""The header of a llama.cpp GGUF file: its metadata as a Hugging Face config dict, and its
tensors' names, shapes and types under HF names.

GGUF stores the same tensors as a HF checkpoint under other names (`blk.N.attn_q.weight`
for `model.layers.N.self_attn.q_proj.weight`), with dimensions listed innermost first.
Reading a header needs no torch (gguf's reader is numpy over the file's map): the front
end reads a model's config and tokenizer through this module alone, and `gguf_loader.py`
reads the tensors' data.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from pdserve.errors import ModelLoadError
from pdserve.model.config import ModelConfig

# GGUF `general.architecture` -> HF architecture. Mistral models converted by llama.cpp
# are `llama` GGUFs: same tensors, same permutation.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_LEVEL_GGUF = {v: k for k, v in _TOP_LEVEL_NAMES.items()}
_BLOCK_GGUF = {v: k for k, v in _BLOCK_NAMES.items()}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors HF models do not have."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        block, part, kind = m.groups()
        hf_part = _BLOCK_NAMES.get(part)
        return f"model.layers.{block}.{hf_part}.{kind}" if hf_part else None
    base, _, kind = gguf_name.rpartition(".")
    hf_base = _TOP_LEVEL_NAMES.get(base)
    return f"{hf_base}.{kind}" if hf_base and kind in ("weight", "bias") else None


def gguf_tensor_name(hf_name: str) -> str:
    """Inverse of `hf_tensor_name`, for error messages."""
    if m := _HF_BLOCK_RE.fullmatch(hf_name):
        block, part, kind = m.groups()
        return f"blk.{block}.{_BLOCK_GGUF.get(part, part)}.{kind}"
    base, _, kind = hf_name.rpartition(".")
    return f"{_TOP_LEVEL_GGUF.get(base, base)}.{kind}"


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Parse the GGUF header (0.1-0.4 s for the shipped model: `_PlainReader`).

    Cached per (path, size, mtime) so that load_config + iter_weights parse it once.
    """
    st = path.stat()
    return _open_cached(str(path), st.st_size, st.st_mtime_ns)


class _PlainReader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its file map. The header parse slices the
    map once per field part (~1M slices for the shipped model: every token string is one),
    and a `numpy.memmap` slice runs a Python-level `__array_finalize__`; a plain view does
    not (3.5 s -> 1.0 s here). Tensor data are then read-only ndarray views of the map."""

    @property  # type: ignore[override]
    def data(self) -> npt.NDArray[np.uint8]:
        return self._plain

    @data.setter
    def data(self, value: npt.NDArray[np.uint8]) -> None:
        self._file_map = value  # keeps the mapping alive
        self._plain = value.view(np.ndarray)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[gguf.GGUFValueType]]:
        """gguf's parse of one field, with its arrays of scalars and of strings taken in
        one pass (the shipped model's 49,152 tokens, scores and types and 48,900 merges:
        2 s -> 0.3 s here). The parts are the same views of the same bytes, in the same
        order, as gguf's own (tests/test_gguf_reader.py holds every field to it); any
        other field, and any file not in this host's byte order, is gguf's to parse."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = gguf.GGUFValueType(raw_itype[0])
        offs, n = orig_offs + 12, int(alen[0])
        parts: list[npt.NDArray[Any]] = [raw_itype, alen]
        if itype == gguf.GGUFValueType.STRING:
            lens = np.dtype(np.uint64)
            for _ in range(n):
                length = self.data[offs : offs + 8].view(lens)
                end = offs + 8 + int(length[0])
                parts += (length, self.data[offs + 8 : end])
                offs = end
            return (
                offs - orig_offs,
                parts,
                list(range(3, 2 * n + 2, 2)),
                [gguf.GGUFValueType.ARRAY, itype],
            )
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, n)
        if len(values) != n:
            raise ValueError(f"array of {n} values runs past the end of the file")
        parts += (values[i : i + 1] for i in range(n))
        size = 12 + int(values.nbytes)
        return size, parts, list(range(2, n + 2)), [gguf.GGUFValueType.ARRAY, itype]


@functools.lru_cache(maxsize=1)
def _open_cached(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        return _PlainReader(path)
    except Exception as e:  # the reader fails with whatever numpy raises on a short buffer
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file") from e


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def gguf_architecture(reader: gguf.GGUFReader, path: Path) -> str:
    """The GGUF architecture (`llama` or `qwen2`); ModelLoadError for any other."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {supported})"
        )
    return str(arch)


def load_gguf_config(path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata, via the HF config-dict shape."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    if _field(reader, f"{arch}.expert_count"):
        raise ModelLoadError(f"{path}: mixture-of-experts GGUF models are not supported")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp folds llama3 RoPE scaling into this tensor and drops its parameters.
        raise ModelLoadError(
            f"{path}: RoPE scaling stored as tensor 'rope_freqs.weight' (llama3 scaling) "
            "is not supported from GGUF; load the Hugging Face folder instead"
        )
    return ModelConfig.from_hf_dict(gguf_hf_config_dict(reader, arch), source=str(path))


def gguf_hf_config_dict(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """GGUF metadata in the shape of a HF config.json dict."""

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}")
        return default if value is None else value

    heads = get("attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    d: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": _vocab_size(reader, arch),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", get("rope.dimension_count")),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(reader),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        # Passed through so that ModelConfig names the unsupported kind (only llama3 is).
        d["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor")}
    # Absent keys are left out (ModelConfig then names a missing required one); numpy
    # scalars become Python values so that they do not leak into ModelConfig.
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in d.items() if v is not None}


def _vocab_size(reader: gguf.GGUFReader, arch: str) -> int | None:
    size = _field(reader, f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])
    return None


def _eos_token_ids(reader: gguf.GGUFReader) -> list[int]:
    """eos, then the other end-of-generation ids llama.cpp stops on (eot, eom), deduplicated."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def gguf_tensor_shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape of every tensor the file holds that a HF model has."""
    shapes: dict[str, tuple[int, ...]] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is not None:
            shapes[name] = tuple(int(n) for n in reversed(t.shape.tolist()))
    return shapes


def tensor_types(path: Path, names: Iterable[str]) -> dict[str, gguf.GGMLQuantizationType]:
    """The GGUF type of each named HF tensor."""
    by_name = {hf_tensor_name(t.name) or t.name: t for t in open_gguf(path).tensors}
    return {n: by_name[n].tensor_type for n in names}


def gguf_label(hf_name: str) -> str:
    """A tensor as error messages name it: its GGUF name, then its HF name."""
    return f"{gguf_tensor_name(hf_name)!r} ({hf_name})"
