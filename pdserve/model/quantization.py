"""What `--quantization` and `--activations` come to for a model file on this install
(`resolve_quantization`), or the usage error naming what fits.

Nothing here imports torch until it runs: whether the compiled kernels load here
(pdserve/kernels/, which loads torch first) is asked of them when a resolution needs it.
`pdserve serve` resolves in a child of its instances' fork server, which has them
imported (server/launch.py `engine_config`), so its own process never loads torch; an
instance resolves for itself as it loads its weights (`instance_quantization`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.config import ACTIVATIONS, EngineConfig, deployment_activations
from pdserve.model import gguf_header
from pdserve.model.source import ModelPath, ModelSource, load_config, weight_shapes

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
    from pdserve.quant.linear import int8_blocker  # torch: see the module docstring

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
    from pdserve.kernels import unavailable_reason  # torch: see the module docstring

    return unavailable_reason() or ""


def _gguf_blocker(src: ModelSource) -> str:
    """Why this GGUF file's blocks cannot be served as they are ("" when they can)."""
    from pdserve.quant.formats import QuantType  # torch: see the module docstring

    names = [n for n in weight_shapes(load_config(src)) if is_quantizable(n)]
    types = gguf_header.tensor_types(src.path, names)
    for name, t in types.items():
        if QuantType.from_ggml(t) is None and t.name not in ("F32", "F16", "BF16"):
            readable = ", ".join(q.name for q in QuantType)
            label = gguf_header.gguf_label(name)
            return (
                f"tensor {label} has GGUF type {t.name}, which the kernels do not "
                f"read (they read {readable}); serve it with --quantization none"
            )
    if all(QuantType.from_ggml(t) is None for t in types.values()):
        return "the file holds no quantized weights"
    return ""
