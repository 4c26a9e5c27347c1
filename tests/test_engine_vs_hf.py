"""Greedy continuations on the shipped SmolLM2 equal HF transformers' `generate`.

The HF model is built from the same dequantized weights our loader produces (which
tests/test_loader.py shows equal to transformers' own GGUF loader, tensor for tensor).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pdserve.model.loader import iter_weights
from pdserve.protocol.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "List three colors of the rainbow.",
    "Explain photosynthesis to a child in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Think step by step.",
    "Give me a haiku about autumn leaves.",
    "Why is the sky blue?",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def hf_smollm2(smollm2, smollm2_path):
    model, _ = smollm2
    c = model.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=1,
        # No EOS for HF: it then neither stops nor suppresses it; ours uses ignore_eos.
        eos_token_id=None,
    )
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict(dict(iter_weights(smollm2_path)), strict=False)
    hf.tie_weights()
    hf.generation_config.eos_token_id = None
    return hf.eval()


@pytest.mark.slow
def test_greedy_matches_transformers_generate(make_engine, smollm2, hf_smollm2) -> None:
    _, tok = smollm2
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), False)
        for p in PROMPTS
    ]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf_smollm2.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            refs.append(out[0, len(ids) :].tolist())
    assert all(len(r) == NEW_TOKENS for r in refs)
    engine = make_engine()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    got = [done[i].token_ids for i in ids]
    for prompt, g, r in zip(PROMPTS, got, refs, strict=True):
        assert g == r, prompt
    assert "Paris" in done[ids[0]].text
