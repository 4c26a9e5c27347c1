"""Our paged-KV forward equals HF transformers' logits on the same weights (fp32).

For each supported architecture (tiny random configs written to disk and loaded
through the real loaders), every way the engine feeds a sequence is checked against
HF's full-sequence forward: a fresh prompt, a continuation after a cached prefix,
chunked prefill, single-token decode, and all of them mixed in one flat batch. The
"packed" models run the path the engine runs: with the compiled kernels, fp32 panels
(`DenseLinear`) and the compiled per-row layers; with the kernels off (the `fallback`
pass of scripts/test.sh), oneDNN's packed projections and the torch layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import load_hf_reference, make_tiny_model

from pdserve.kernels import kernels
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model.attention import GROUP_COST_TOKENS, AttentionMetadata, SeqSpec
from pdserve.model.base import CausalLM, ForwardHooks
from pdserve.model.layers import DecoderLayer
from pdserve.model.linear import Linear, PackedLinear, onednn_available
from pdserve.model.loader import iter_weights
from pdserve.model.registry import build_model
from pdserve.model.source import load_config
from pdserve.quant.linear import DenseLinear

pytestmark = pytest.mark.fallback

TOL = 1e-4
BLOCK = 4

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied-llama3-rope": (
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-attention-bias": ("LlamaForCausalLM", {"attention_bias": True}),
    "qwen2-bias": ("Qwen2ForCausalLM", {}),
    "mistral-sliding-window": ("MistralForCausalLM", {"sliding_window": 7}),
}


class Harness:
    """Our model over a real paged cache; hands out disjoint, shuffled block tables."""

    def __init__(self, folder: Path, pack: bool) -> None:
        self.config = load_config(folder)
        self.model: CausalLM = build_model(self.config)
        self.model.load_weights(iter_weights(folder))
        self.model.finalize(pack)
        self.pack = pack
        c = self.config
        layout = KVLayout(
            c.num_hidden_layers, 64, BLOCK, c.num_key_value_heads, c.head_dim, "float32"
        )
        self.cache = KVCache(layout, num_host_blocks=0)
        self._free = list(torch.randperm(64).tolist())

    def blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BLOCK)
        out, self._free = self._free[:n], self._free[n:]
        return out

    @torch.inference_mode()
    def step(
        self,
        parts: list[tuple[list[int], int, list[int]]],
        group_cost: int = GROUP_COST_TOKENS,
        per_row: bool | None = None,
    ) -> list[torch.Tensor]:
        """parts: (token ids of this step, num_cached, block table); decodes first.
        Returns per part the logits of all its new tokens. `per_row`: the compiled per-row
        path (default: where the model has it, as the engine runs it)."""
        ids, pos, specs, rows = [], [], [], []
        for toks, cached, table in parts:
            ids += toks
            pos += range(cached, cached + len(toks))
            specs.append(SeqSpec(cached, len(toks), table))
        rows = torch.arange(len(ids))
        meta = AttentionMetadata.build(
            specs,
            BLOCK,
            self.model.sliding_window,
            group_cost=group_cost,
            per_row=self.model.fused if per_row is None else per_row,
        )
        self.last_meta = meta
        logits = self.model(
            torch.tensor(ids), torch.tensor(pos), self.cache.device_tensor, meta, rows
        )
        return list(logits.split([len(p[0]) for p in parts]))


@pytest.fixture(
    scope="module",
    params=[(case, pack) for case in sorted(CASES) for pack in (True, False)],
    ids=lambda p: f"{p[0]}-{'packed' if p[1] else 'plain'}",
)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(our model, HF reference); ours with oneDNN-packed projections and without."""
    case, pack = request.param
    arch, overrides = CASES[case]
    folder = make_tiny_model(tmp_path_factory.mktemp(case), arch, **overrides)
    return Harness(folder, pack), load_hf_reference(folder)


def projections(model: CausalLM) -> dict[str, tuple[Linear, torch.Tensor]]:
    """Every projection the forward pass runs, with the parameter it was built from."""
    out: dict[str, tuple[Linear, torch.Tensor]] = {"lm_head": (model.lm_head_op, model.lm_head)}
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        a, m = layer.self_attn, layer.mlp
        out[f"{i}.qkv"] = (a.qkv_op, a.qkv)
        out[f"{i}.o"] = (a.o_op, a.o)
        out[f"{i}.gate_up"] = (m.gate_up_op, m.gate_up)
        out[f"{i}.down"] = (m.down_op, m.down)
    return out


def test_packed_cases_run_the_fast_kernels(pair) -> None:
    """`projection` falls back silently (to oneDNN, then to F.linear); the "packed" cases
    must not: with the kernels every projection is fp32 panels and the model takes the
    compiled per-row path; without, every projection holds a oneDNN-packed weight and no
    row-major copy. Either way each original parameter was released (tied embeddings
    excepted: the embedding still reads it)."""
    ours, _ = pair
    ops = projections(ours.model)
    if not ours.pack:
        plain = [isinstance(op, PackedLinear) and op.packed is None for op, _ in ops.values()]
        assert all(plain) and not ours.model.fused
        return
    if kernels() is not None:
        assert [n for n, (op, _) in ops.items() if not isinstance(op, DenseLinear)] == []
        assert ours.model.fused
    else:
        assert onednn_available(torch.zeros(1, 1)), "this torch has no oneDNN linear kernels"
        packed = [isinstance(op, PackedLinear) and op.packed is not None for op, _ in ops.values()]
        assert all(packed) and not ours.model.fused
        assert all(op.weight is None for op, _ in ops.values())  # type: ignore[attr-defined]
    tied = ours.config.tie_word_embeddings
    kept = [n for n, (_, p) in ops.items() if p.numel() > 0 and not (n == "lm_head" and tied)]
    assert kept == []


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_fresh_prompt(pair) -> None:
    ours, hf = pair
    ids = _prompt(19, 1, ours.config.vocab_size)
    (got,) = ours.step([(ids, 0, ours.blocks(19))])
    assert (got - hf_logits(hf, ids)).abs().max().item() < TOL


def test_chunked_prefill_then_decode(pair) -> None:
    ours, hf = pair
    ids = _prompt(23, 2, ours.config.vocab_size)
    table = ours.blocks(23)
    ref = hf_logits(hf, ids)
    got = []
    for lo, hi in [(0, 5), (5, 13), (13, 21), (21, 22), (22, 23)]:  # chunks, then decodes
        got += ours.step([(ids[lo:hi], lo, table)])
    assert (torch.cat(got) - ref).abs().max().item() < TOL


def test_continuation_after_cached_prefix(pair) -> None:
    """A second request reuses the first's prefix blocks (prefix-cache hit) and
    computes only its suffix."""
    ours, hf = pair
    v = ours.config.vocab_size
    prefix = _prompt(12, 3, v)  # 3 full blocks
    first, second = prefix + _prompt(5, 4, v), prefix + _prompt(9, 5, v)
    t1 = ours.blocks(len(first))
    ours.step([(first, 0, t1)])
    t2 = t1[:3] + ours.blocks(len(second) - 12)
    (got,) = ours.step([(second[12:], 12, t2)])
    assert (got - hf_logits(hf, second)[12:]).abs().max().item() < TOL


def test_mixed_flat_batch(pair) -> None:
    """Two decodes, a continuing chunk and a fresh prompt in one forward pass."""
    ours, hf = pair
    v = ours.config.vocab_size
    seqs = [_prompt(n, 10 + n, v) for n in (9, 14, 17, 6)]
    tables = [ours.blocks(len(s)) for s in seqs]
    # Prime: a and b have all but their last token cached, c has its first 8.
    ours.step([(seqs[0][:8], 0, tables[0])])
    ours.step([(seqs[1][:13], 0, tables[1])])
    ours.step([(seqs[2][:8], 0, tables[2])])
    got = ours.step(
        [
            (seqs[0][8:], 8, tables[0]),
            (seqs[1][13:], 13, tables[1]),
            (seqs[2][8:], 8, tables[2]),
            (seqs[3], 0, tables[3]),
        ]
    )
    refs = [hf_logits(hf, s) for s in seqs]
    assert (got[0] - refs[0][8:]).abs().max().item() < TOL
    assert (got[1] - refs[1][13:]).abs().max().item() < TOL
    assert (got[2] - refs[2][8:]).abs().max().item() < TOL
    assert (got[3] - refs[3]).abs().max().item() < TOL


def test_decodes_of_different_lengths_in_several_groups(pair) -> None:
    """Decode rows split into length groups (row order unsorted) give HF's logits (the
    torch layers' grouping: the compiled per-row path has none)."""
    ours, hf = pair
    v = ours.config.vocab_size
    lengths = (13, 2, 22, 5, 7)  # contexts of 4, 1, 6, 2 and 2 blocks
    seqs = [_prompt(n, 30 + n, v) for n in lengths]
    tables = [ours.blocks(n) for n in lengths]
    for s, t in zip(seqs, tables, strict=True):
        if len(s) > 1:
            ours.step([(s[:-1], 0, t)])
    got = ours.step(
        [(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)],
        group_cost=0,
        per_row=False,
    )
    groups = [g.rows.tolist() for g in ours.last_meta.decode_groups]
    assert groups == [[2], [0], [3, 4], [1]]
    for s, g in zip(seqs, got, strict=True):
        assert (g - hf_logits(hf, s)[-1:]).abs().max().item() < TOL


def test_layer_hook_fires_once_per_layer_after_kv_write(pair) -> None:
    ours, _ = pair
    ids = _prompt(6, 7, ours.config.vocab_size)
    table = ours.blocks(6)
    seen: list[tuple[int, bool]] = []
    slot = table[0] * BLOCK

    kv = ours.cache.device_tensor

    def on_layer_done(i: int) -> None:
        # This step's K of layer i is in the cache (fresh blocks start zeroed).
        k_slots = kv[i, 0].reshape(-1, *kv.shape[-2:])
        seen.append((i, bool(k_slots[slot].abs().sum() > 0)))

    meta = AttentionMetadata.build([SeqSpec(0, 6, table)], BLOCK)
    with torch.inference_mode():
        ours.model(
            torch.tensor(ids),
            torch.arange(6),
            ours.cache.device_tensor,
            meta,
            torch.tensor([5]),
            ForwardHooks(on_layer_done),
        )
    assert seen == [(i, True) for i in range(ours.config.num_hidden_layers)]


@pytest.mark.parametrize(
    ("blocks", "cost", "cap", "groups"),
    [
        ([], 0, None, []),
        ([3], 0, None, [[0]]),
        ([5, 1, 5, 1], 0, None, [[0, 2], [1, 3]]),
        ([5, 1, 5, 1], 33, None, [[0, 1, 2, 3]]),  # splitting saves 2 rows x 4 blocks = 32 tokens
        ([5, 1, 5, 1], 31, None, [[0, 2], [1, 3]]),
        ([40, 2, 3, 39, 1], 64, None, [[0, 3], [1, 2, 4]]),
        ([40, 2, 3, 39, 1], 0, None, [[0], [3], [2], [1], [4]]),
        ([4, 4, 4, 4], 0, 32, [[2, 3], [0, 1]]),  # 16 tokens a row: 2 rows a group
        ([10], 0, 8, [[0]]),  # a row longer than the cap is a group of its own
        ([5, 1, 5, 1], 31, 20, [[2], [0], [1, 3]]),
    ],
)
def test_group_by_length_minimises_padded_tokens_plus_group_cost(blocks, cost, cap, groups) -> None:
    from pdserve.model.attention import group_by_length

    assert group_by_length(blocks, BLOCK, cost, cap) == groups
