"""Read a model's weights, from a HF folder or a GGUF file (`source.py` finds the model
and reads its config; `quantization.py` decides how they are served).

Weights come out under HF parameter names, checked up front against the set the config
implies (`weight_shapes`), so a missing or misshapen tensor fails before anything is built.
Every failure is a ModelLoadError whose message starts with the offending path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pdserve.errors import ModelLoadError
from pdserve.model import gguf_header, gguf_loader
from pdserve.model.quantization import Quantization, is_quantizable
from pdserve.model.source import ModelPath, ModelSource, load_config, read_json, weight_shapes
from pdserve.quant.formats import QuantType, QuantWeight

INDEX_FILE = "model.safetensors.index.json"


def iter_weights(
    path: ModelPath | ModelSource,
    dtype: torch.dtype = torch.float32,
    quantization: Quantization | None = None,
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
    quantized = quantization is not None and quantization.quantized
    blocks = [n for n in expected if is_quantizable(n)] if quantized else []
    if src.format == "gguf":
        reader = gguf_header.open_gguf(src.path)
        found = gguf_header.gguf_tensor_shapes(reader)
        _check_tensors(expected, found, str(src.path), gguf_header.gguf_label)
        return gguf_loader.iter_gguf_tensors(src.path, expected, config, dtype, blocks)
    files, where = _safetensors_files(src.path)
    locations, found = _safetensors_index(files)
    _check_tensors(expected, found, where, repr)
    tensors = _iter_safetensors(expected, locations, dtype)
    if quantization is None or not quantized:
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
