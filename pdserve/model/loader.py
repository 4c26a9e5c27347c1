"""Read a model's weights, from a HF folder or a GGUF file (`source.py` finds the model
and reads its config), and decide how they are computed (`resolve_quantization`).

Weights come out under HF parameter names, checked up front against the set the config
implies (`weight_shapes`), so a missing or misshapen tensor fails before anything is built.
Every failure is a ModelLoadError whose message starts with the offending path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pdserve.config import ACTIVATIONS, EngineConfig, deployment_activations
from pdserve.errors import ModelLoadError
from pdserve.kernels import unavailable_reason
from pdserve.model import gguf_header, gguf_loader
from pdserve.model.config import ModelConfig
from pdserve.model.source import ModelPath, ModelSource, load_config, read_json
from pdserve.quant.formats import QuantType, QuantWeight
from pdserve.quant.linear import int8_blocker

INDEX_FILE = "model.safetensors.index.json"


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


# ---- quantization -----------------------------------------------------------------------

_FOR_GGUF = ("auto", "none", "gguf")
_FOR_HF = ("auto", "none", "q8_0", "q4_0")


def is_quantizable(name: str) -> bool:
    """The weights a quantized model holds in blocks: projections, embeddings, LM head."""
    return name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Quantization:
    """What `--quantization` came to for one model file.

    mode: "none" (fp weights in the engine's dtype), "gguf" (a GGUF file's Q8_0 / Q4_0 /
    Q4_1 blocks served as they are), "q8_0" / "q4_0" (fp weights quantized at load; the
    embeddings and LM head to Q8_0, as llama.cpp keeps its output layer at 8 bits or
    more). reason: why `auto` chose what it chose ("" otherwise). activations: how the
    kernels take activations ("fp32" or "int8", `--activations`; "fp32" when mode is
    "none")."""

    mode: str = "none"
    reason: str = ""
    activations: str = "fp32"

    @property
    def quantized(self) -> bool:
        return self.mode != "none"


def resolve_quantization(
    requested: str,
    path: ModelPath | ModelSource,
    device: str = "cpu",
    activations: str = "fp32",
    dtype: str = "float32",
) -> Quantization:
    """The effective quantization; ValueError (a usage error) when `requested` does not
    fit the file or this install, naming the values that do, or when `activations` is
    "int8" and the weights will not be in blocks or this CPU cannot run the int8 kernels.
    `activations` "auto" is "int8" where it can run, else "fp32" (never an error)."""
    quant = _resolve_weights(requested, path, device, dtype)
    if activations == "fp32":
        return quant
    if activations not in ACTIVATIONS:
        raise ValueError(f"--activations {activations}: use one of: {', '.join(ACTIVATIONS)}")
    if activations == "auto":
        if quant.quantized and not int8_blocker():
            return dataclasses.replace(quant, activations="int8")
        return quant
    if not quant.quantized:
        why = f" ({quant.reason})" if quant.reason else ""
        raise ValueError(
            f"--activations {activations} needs weights in blocks (--quantization auto, gguf, "
            f"q8_0 or q4_0); they would be served as fp{why}"
        )
    if blocker := int8_blocker():
        raise ValueError(f"--activations {activations}: {blocker}")
    return dataclasses.replace(quant, activations=activations)


def instance_quantization(config: EngineConfig, path: ModelPath | ModelSource) -> Quantization:
    """`resolve_quantization` for an instance (or rank) of `config`: its activations as
    `deployment_activations` gives them for its own layout (a deployment has already
    set them for all its instances: server/launch.py)."""
    activations = deployment_activations(config.activations, [config.tensor_parallel_size])
    return resolve_quantization(config.quantization, path, config.device, activations, config.dtype)


def _resolve_weights(
    requested: str, path: ModelPath | ModelSource, device: str, dtype: str
) -> Quantization:
    src = ModelSource.resolve(path)
    allowed = _FOR_GGUF if src.format == "gguf" else _FOR_HF
    if requested not in allowed:
        kind = "a GGUF file" if src.format == "gguf" else "a Hugging Face folder"
        raise ValueError(
            f"--quantization {requested} does not fit {src.path} ({kind}); "
            f"use one of: {', '.join(allowed)}"
        )
    if requested == "none":
        return Quantization()
    blocker = _kernel_blocker(device, dtype)
    if requested == "auto":
        if not blocker and src.format != "gguf":
            blocker = "the weights are fp (--quantization q8_0 or q4_0 quantizes them at load)"
        blocker = blocker or _gguf_blocker(src)
        return Quantization(reason=blocker) if blocker else Quantization("gguf")
    if not blocker and requested == "gguf":
        blocker = _gguf_blocker(src)
    if blocker:
        raise ValueError(f"--quantization {requested}: {blocker}")
    return Quantization(requested)


def _kernel_blocker(device: str, dtype: str) -> str:
    """Why no quantized weights can be served here ("" when they can)."""
    if device != "cpu":
        return f"quantized weights are served on the CPU only (device {device})"
    if dtype != "float32":
        return f"the quantized kernels compute in float32 (dtype {dtype})"
    return unavailable_reason() or ""


def _gguf_blocker(src: ModelSource) -> str:
    """Why this GGUF file's blocks cannot be served as they are ("" when they can)."""
    names = [n for n in weight_shapes(load_config(src)) if is_quantizable(n)]
    types = gguf_header.tensor_types(src.path, names)
    for name, t in types.items():
        if QuantType.from_ggml(t) is None and t.name not in ("F32", "F16", "BF16"):
            readable = ", ".join(q.name for q in QuantType)
            return (
                f"tensor {_gguf_label(name)} has GGUF type {t.name}, which the kernels do not "
                f"read (they read {readable}); serve it with --quantization none"
            )
    if all(QuantType.from_ggml(t) is None for t in types.values()):
        return "the file holds no quantized weights"
    return ""


def iter_weights(
    path: ModelPath | ModelSource,
    dtype: torch.dtype = torch.float32,
    quantization: Quantization = Quantization(),
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """(HF parameter name, tensor in `dtype`) for every parameter, in `weight_shapes` order;
    with a quantization, the weights it covers (`is_quantizable`) come as `QuantWeight`s
    (a GGUF's fp tensors stay tensors).

    The file is checked before this returns (missing tensor, wrong shape, unreadable
    file); tensors are then read one at a time as the iterator is consumed.
    Tensors the model does not use (e.g. rotary caches) are skipped.
    """
    src = ModelSource.resolve(path)
    config = load_config(src)
    expected = weight_shapes(config)
    blocks = [n for n in expected if is_quantizable(n)] if quantization.quantized else []
    if src.format == "gguf":
        reader = gguf_header.open_gguf(src.path)
        found = gguf_header.gguf_tensor_shapes(reader)
        _check_tensors(expected, found, str(src.path), _gguf_label)
        return gguf_loader.iter_gguf_tensors(src.path, expected, config, dtype, blocks)
    files, where = _safetensors_files(src.path)
    locations, found = _safetensors_index(files)
    _check_tensors(expected, found, where, repr)
    tensors = _iter_safetensors(expected, locations, dtype)
    if not quantization.quantized:
        return iter(tensors)
    return quantize_weights(tensors, QuantType.parse(quantization.mode), where)


def quantize_weights(
    tensors: Iterator[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor | QuantWeight]],
    qtype: QuantType,
    where: str = "",
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Quantize the fp weights `is_quantizable` names: projections to `qtype`, the
    embeddings and LM head to Q8_0 (see `Quantization`); the rest pass as they are."""
    for name, tensor in tensors:
        if not is_quantizable(name) or not isinstance(tensor, torch.Tensor):
            yield name, tensor
            continue
        target = QuantType.Q8_0 if not name.endswith("_proj.weight") else qtype
        if tensor.shape[-1] % 32:
            raise ModelLoadError(
                f"{where or 'model'}: tensor {name!r} has rows of {tensor.shape[-1]} values; "
                f"{target.name} needs a multiple of 32 (serve it with --quantization none)"
            )
        yield name, QuantWeight.quantize(tensor, target)


def _gguf_label(hf_name: str) -> str:
    return f"{gguf_header.gguf_tensor_name(hf_name)!r} ({hf_name})"


def _check_tensors(
    expected: dict[str, tuple[int, ...]],
    found: dict[str, tuple[int, ...]],
    where: str,
    label: Callable[[str], str],
) -> None:
    for name, shape in expected.items():
        if name not in found:
            raise ModelLoadError(f"{where}: missing tensor {label(name)}")
        if found[name] != shape:
            raise ModelLoadError(
                f"{where}: tensor {label(name)} has shape {list(found[name])}, "
                f"expected {list(shape)} from the model config"
            )


def _safetensors_files(folder: Path) -> tuple[list[Path], str]:
    """The weight files to read, and what to name in a 'missing tensor' error."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no 'weight_map' object")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index}: names shard {file.name!r}, which does not exist")
        return files, str(index)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    return files, str(files[0] if len(files) == 1 else folder)


def _safetensors_index(
    files: list[Path],
) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """Read only the headers: tensor name -> file, tensor name -> shape (first file wins)."""
    locations: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 -- safe_open is not a Mapping
                    if name not in locations:
                        locations[name] = file
                        shapes[name] = tuple(f.get_slice(name).get_shape())
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: truncated or corrupt safetensors file ({e})") from e
    return locations, shapes


def _iter_safetensors(
    expected: dict[str, tuple[int, ...]], locations: dict[str, Path], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name in expected:
            file = locations[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            yield name, handles[file].get_tensor(name).to(dtype)
