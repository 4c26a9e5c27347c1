"""Tiny random models on disk, for loader tests and for comparing logits with transformers.

`make_tiny_model` writes a HF folder (config.json, model.safetensors, generation_config.json,
a ~360-token byte-level BPE tokenizer with a ChatML template) built by transformers' own
model class from a fixed seed, in well under a second. `load_hf_reference` loads it back
as the transformers reference model. `make_tiny_gguf` writes the same weights as an F32
GGUF the way llama.cpp's converter does (q/k rows permuted for `llama`), tokenizer included.

    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", tie_word_embeddings=True)
    ref = load_hf_reference(folder)      # transformers model, float32, eval mode
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from helpers.kquants import quantize_k

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "LlamaForCausalLM": LlamaConfig,
    "Qwen2ForCausalLM": Qwen2Config,
    "MistralForCausalLM": MistralConfig,
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (as SmolLM2)
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "Paged attention stores keys and values in fixed-size blocks of GPU memory.",
    "Prefill computes the prompt; decode then produces one token at a time.",
    "def main():\n    print('hello, world')\n    return 0\n",
]
DEFAULT_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # Larger than the 0.02 default so that logits differ clearly between tokens.
    "initializer_range": 0.1,
}


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on a fixed corpus (deterministic, ~5 ms)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    tmp_path: Path,
    arch: str,
    *,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    attention_bias: bool = False,
    chat_template: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny random HF model folder under `tmp_path` and return it.

    rope_scaling: llama3 parameters, e.g. {"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}.
    sliding_window: Mistral; Qwen2 (then in every layer). attention_bias: Llama only
      (q/k/v/o biases); Qwen2 always has q/k/v biases.
    overrides: any other config field (hidden_size, num_hidden_layers, vocab_size, ...).
    Norm weights and biases are random too, so that a swapped tensor changes the logits.
    """
    tokenizer = make_tokenizer()
    config = _make_config(
        arch, len(tokenizer), tie_word_embeddings, rope_scaling, sliding_window, attention_bias
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    folder = _fresh_folder(tmp_path, f"tiny-{arch.removesuffix('ForCausalLM').lower()}")
    model.save_pretrained(folder, safe_serialization=True)
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    return folder


def _make_config(
    arch: str,
    vocab_size: int,
    tie: bool,
    rope_scaling: dict[str, Any] | None,
    sliding_window: int | None,
    attention_bias: bool,
) -> PretrainedConfig:
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    kw: dict[str, Any] = dict(DEFAULT_DIMS)
    kw.update(vocab_size=vocab_size, tie_word_embeddings=tie, bos_token_id=BOS_ID)
    kw.update(eos_token_id=EOS_ID, pad_token_id=0, architectures=[arch])
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
    if rope_scaling is not None:
        kw["rope_parameters"].update(rope_scaling)
    if arch == "Qwen2ForCausalLM":
        kw.update(use_sliding_window=sliding_window is not None, max_window_layers=0)
        kw["sliding_window"] = sliding_window
    elif arch == "MistralForCausalLM":
        kw["sliding_window"] = sliding_window
    elif sliding_window is not None:
        raise ValueError("sliding_window: Mistral or Qwen2 only")
    if attention_bias and arch != "LlamaForCausalLM":
        raise ValueError("attention_bias: Llama only (Qwen2 always has q/k/v biases)")
    if arch == "LlamaForCausalLM":
        kw["attention_bias"] = attention_bias
    return _CONFIG_CLASSES[arch](**kw)


def _fresh_folder(parent: Path, stem: str) -> Path:
    n = 0
    while (parent / f"{stem}-{n}").exists():
        n += 1
    folder = parent / f"{stem}-{n}"
    folder.mkdir(parents=True)
    return folder


def load_hf_reference(folder: Path, attn_implementation: str = "eager") -> PreTrainedModel:
    """The transformers model of a folder written by `make_tiny_model`: float32, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def make_tiny_gguf(
    tmp_path: Path,
    arch: str = "LlamaForCausalLM",
    *,
    drop_tensors: Collection[str] = (),
    quant: str | None = None,
    quant_overrides: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Path:
    """A tiny model (see `make_tiny_model`) written as an F32 GGUF file, as llama.cpp would.

    `arch`: LlamaForCausalLM -> GGUF `llama` (q/k rows permuted), Qwen2ForCausalLM -> `qwen2`.
    The HF folder stays beside it (same name without `.gguf`). `drop_tensors`: GGUF tensor
    names to leave out (to test error reporting). `quant`: a GGML type name ("Q4_1") for
    every weight matrix, quantized by gguf-py as llama.cpp's converter would;
    `quant_overrides`: GGUF tensor name -> type name, for single tensors.
    """
    gguf_arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[arch]
    folder = make_tiny_model(tmp_path, arch, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    path = folder.with_suffix(".gguf")
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    _write_metadata(writer, hf.config, gguf_arch)
    _write_tokenizer(writer, make_tokenizer())
    types = {"": quant} if quant else {}
    _write_tensors(writer, hf, gguf_arch, drop_tensors, {**types, **(quant_overrides or {})})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: gguf.GGUFWriter, c: PretrainedConfig, gguf_arch: str) -> None:
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if gguf_arch == "llama":
        writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)


def _write_tokenizer(writer: gguf.GGUFWriter, tok: PreTrainedTokenizerFast) -> None:
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    specials = set(SPECIAL_TOKENS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in specials else 1 for t, _ in vocab])  # 3: control
    writer.add_token_merges(_merges(tok))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _merges(tok: PreTrainedTokenizerFast) -> list[str]:
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def _write_tensors(
    writer: gguf.GGUFWriter,
    hf: PreTrainedModel,
    gguf_arch: str,
    drop: Collection[str],
    types: Mapping[str, str],
) -> None:
    from pdserve.model.gguf_header import gguf_tensor_name

    c = hf.config
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if gguf_arch == "llama" and ".q_proj." in name:
            data = _permute(data, c.num_attention_heads)
        elif gguf_arch == "llama" and ".k_proj." in name:
            data = _permute(data, c.num_key_value_heads)
        gname = gguf_tensor_name(name)
        if gname in drop:
            continue
        qtype = types.get(gname, types.get("")) if data.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(gname, np.ascontiguousarray(data))
            continue
        ggml = gguf.GGMLQuantizationType[qtype]
        blocks = quantize_blocks(np.ascontiguousarray(data, dtype=np.float32), qtype)
        writer.add_tensor(gname, blocks, raw_shape=blocks.shape, raw_dtype=ggml)


def quantize_blocks(weight: np.ndarray, qtype: str) -> np.ndarray:
    """GGUF bytes of an fp32 [N, K] weight in the GGML type `qtype`: gguf-py's quantizer
    (llama.cpp's reference) for the 32-value formats, `kquants` for the K formats."""
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(weight, qtype)
    return gguf.quants.quantize(weight, gguf.GGMLQuantizationType[qtype])


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half -> interleaved rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
