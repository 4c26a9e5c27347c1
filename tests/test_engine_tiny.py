"""Every architecture end to end through `Engine.from_config` (the real loaders, HF
folder and GGUF), greedy tokens equal to HF transformers' `generate`, batched."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import load_hf_reference, make_tiny_gguf, make_tiny_model

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.protocol.sampling_params import SamplingParams

NEW = 12
PROMPTS = [[5, 17, 42, 99, 3, 250], [7] * 11, list(range(60, 90))]


def engine_for(path) -> Engine:
    return Engine.from_config(
        EngineConfig(
            model=str(path),
            scheduler=SchedulerConfig(max_num_batched_tokens=16),  # forces chunking
            cache=CacheConfig(block_size=4, num_blocks=64, num_host_blocks=16),
        )
    )


def greedy_all(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    engine.core.kv.check_integrity()
    assert engine.core.kv.num_used_blocks == 0
    return [done[i] for i in ids]


@torch.inference_mode()
def hf_greedy(folder) -> list[list[int]]:
    hf = load_hf_reference(folder)
    hf.generation_config.eos_token_id = None
    outs = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("LlamaForCausalLM", {"tie_word_embeddings": True}),
        ("Qwen2ForCausalLM", {}),
        ("MistralForCausalLM", {"sliding_window": 8}),
    ],
)
def test_hf_folder_end_to_end(tmp_path, arch, overrides) -> None:
    folder = make_tiny_model(tmp_path, arch, **overrides)
    assert greedy_all(engine_for(folder)) == hf_greedy(folder)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_gguf_end_to_end(tmp_path, arch) -> None:
    path = make_tiny_gguf(tmp_path, arch)
    assert greedy_all(engine_for(path)) == hf_greedy(path.with_suffix(""))
