"""The compiled per-row path of quantized models (pdserve/kernels/_attention.c and the
prologues of _kernels.c): against torch's paged attention and ops, and its contract -
a row's result has the same bits alone, in any batch, on any thread count - down to the
model, where a decoded token's logits equal those of the same token recomputed by a
prefill (what a resumed request relies on).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.tiny_models import make_tiny_gguf

from pdserve.config import EngineConfig
from pdserve.engine.engine import load_model
from pdserve.kernels import kernels
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model.attention import (
    AttentionMetadata,
    RowRanges,
    SeqSpec,
    kv_is_f16,
    paged_attention,
    row_attention,
)
from pdserve.model.base import CausalLM, ForwardHooks
from pdserve.model.fused import norm_rows
from pdserve.model.layers import RMSNorm, apply_rope
from pdserve.quant.formats import QuantType, QuantWeight
from pdserve.quant.linear import QuantLinear

pytestmark = pytest.mark.kernels

BS = 4  # small blocks: many block boundaries inside each context


class Case:
    """Random q/k/v for a batch of sequences over a random paged cache (its earlier
    tokens already there), the rotary tables, and both metadata builds."""

    def __init__(
        self, seqs: list[tuple[int, int]], h: int, hkv: int, d: int, window: int | None = None
    ) -> None:
        gen = torch.Generator().manual_seed(h * 1000 + d + len(seqs))
        self.h, self.hkv, self.d, self.window = h, hkv, d, window
        n_blocks = sum(-(-(c + q) // BS) for c, q in seqs) + 3
        self.cache = torch.randn(2, n_blocks, BS, hkv, d, generator=gen)
        perm = torch.randperm(n_blocks - 1, generator=gen) + 1  # block 0 never used
        self.specs, used = [], 0
        for cached, query in seqs:
            n = -(-(cached + query) // BS)
            self.specs.append(SeqSpec(cached, query, perm[used : used + n].tolist()))
            used += n
        t = sum(q for _, q in seqs)
        self.qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen)
        self.positions = torch.cat([torch.arange(c, c + q) for c, q in seqs])
        longest = max(512, max(c + q for c, q in seqs))
        angles = torch.outer(torch.arange(float(longest)), torch.rand(d // 2, generator=gen))
        self.cos = torch.cat([angles.cos()] * 2, dim=1)
        self.sin = torch.cat([angles.sin()] * 2, dim=1)

    def meta(self, per_row: bool, specs: list[SeqSpec] | None = None) -> AttentionMetadata:
        return AttentionMetadata.build(specs or self.specs, BS, self.window, per_row=per_row)

    def compiled(
        self,
        threads: int | None = None,
        cache: torch.Tensor | None = None,
        qkv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """row_attention on copies of the case's cache and qkv, or on `cache` and `qkv`
        themselves (written: the K/V into the cache, RoPE into qkv)."""
        cache = self.cache.clone() if cache is None else cache
        qkv = self.qkv.clone() if qkv is None else qkv
        old = torch.get_num_threads()
        torch.set_num_threads(threads or old)
        try:
            return row_attention(
                qkv, self.positions, self.cos, self.sin, cache[0], cache[1], self.meta(True),
                self.h, self.d**-0.5,
            )  # fmt: skip
        finally:
            torch.set_num_threads(old)

    def reference(self) -> torch.Tensor:
        """RoPE, KV write and torch's paged attention, in float64."""
        t, h, hkv, d = self.qkv.shape[0], self.h, self.hkv, self.d
        cache = self.cache.double()
        qkv = self.qkv.double().view(t, h + 2 * hkv, d)
        pos = self.positions
        qk = apply_rope(
            qkv[:, : h + hkv], self.cos[pos, None].double(), self.sin[pos, None].double()
        )
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hkv :]
        meta = self.meta(False)
        cache[0].view(-1, hkv, d)[meta.slot_mapping] = k
        cache[1].view(-1, hkv, d)[meta.slot_mapping] = v
        out = paged_attention(q, k, v, cache[0], cache[1], meta, d**-0.5)
        return out.reshape(t, h * d).float()


# (cached, new) per sequence: decode rows first, then a fresh prompt and a continued one.
MIXED = [(0, 1), (9, 1), (30, 1), (0, 13), (11, 7)]


@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 4, 128), (4, 2, 16)])
def test_matches_torch_paged_attention(h: int, hkv: int, d: int) -> None:
    """Decodes, a fresh prompt and a prompt after a cached prefix in one batch; GQA and
    plain heads; the head sizes with their own code (64, 128) and the generic one."""
    case = Case(MIXED, h, hkv, d)
    torch.testing.assert_close(case.compiled(), case.reference(), atol=2e-6, rtol=1e-5)


def test_sliding_window() -> None:
    case = Case([(20, 1), (3, 12)], 4, 2, 32, window=5)
    torch.testing.assert_close(case.compiled(), case.reference(), atol=2e-6, rtol=1e-5)


# Eight decodes, contexts on and around block edges: a step of decodes, where each row's
# KV heads are one work item (a lone decode splits them between the threads).
DECODES = [(c, 1) for c in (0, 5, 15, 16, 17, 31, 40, 63)]


# Rows long enough that a lone decode's attention is shared between the threads (from
# ~114 keys: attention_plan's work threshold), a continued prompt's and a fresh one's.
LONG = [(200, 24), (0, 140)]


@pytest.mark.parametrize(
    ("h", "hkv", "d", "context"),
    [(9, 3, 64, 300), (4, 4, 128, 300), (4, 2, 16, 1100), (6, 3, 24, 600)],
    ids=["smollm2", "d128", "d16", "d24"],
)
def test_a_lone_decode_has_one_threads_bits_on_two_and_three(
    h: int, hkv: int, d: int, context: int
) -> None:
    """A step of one decode long enough to be shared between threads runs in phases
    (scores by key range, values by lanes of the V records, _attention.c's LONE): its
    bits are the 1-thread path's, on 2 and 3 threads, for head sizes whose lane split
    falls inside a KV head (d24: 9 vectors a record) and the generic head size; and it is
    torch's attention in float64 to within fp32 rounding."""
    case = Case([(context, 1)], h, hkv, d)
    one = case.compiled(threads=1)
    assert torch.equal(case.compiled(threads=2), one)
    assert torch.equal(case.compiled(threads=3), one)
    torch.testing.assert_close(one, case.reference(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("seqs", "window"),
    [(MIXED, None), (DECODES, None), (LONG, None), ([(180, 40)], 130)],
    # window: each row of the chunk starts at its own key, 130 keys before its end
    ids=["mixed", "decodes", "long", "window"],
)
def test_each_row_has_the_same_bits_alone_in_any_batch_and_on_any_threads(
    seqs: list[tuple[int, int]], window: int | None
) -> None:
    """Row t of a prefill chunk, recomputed as a decode (one query row over the same
    keys), gives the same bits; a decode in a step of eight gives its bits alone; so
    does a 1-thread run. And the rows are torch's attention, computed in float64, to
    within fp32 rounding."""
    case = Case(seqs, 9, 3, 64, window=window)
    batch = case.compiled()
    assert torch.equal(case.compiled(threads=1), batch)
    torch.testing.assert_close(batch, case.reference(), atol=2e-6, rtol=1e-5)
    row = 0
    for spec in case.specs:
        for i in range(spec.query_len):
            alone = Case(seqs, 9, 3, 64, window=window)  # same seed: same cache and qkv
            # The rows before this one are already in the cache; this row is a decode.
            before = [SeqSpec(spec.num_cached, i, spec.block_table)] if i else []
            if before:
                _write(alone, before, row - i)
            decode = SeqSpec(spec.num_cached + i, 1, spec.block_table)
            got = _single(alone, decode, row)
            assert torch.equal(got, batch[row]), (spec, i)
            row += 1


def _write(case: Case, specs: list[SeqSpec], first_row: int) -> None:
    """Put the K/V of rows [first_row, ...) of `specs` into the case's cache."""
    n = sum(s.query_len for s in specs)
    qkv = case.qkv[first_row : first_row + n].clone()
    row_attention(
        qkv, case.positions[first_row : first_row + n].contiguous(), case.cos, case.sin,
        case.cache[0], case.cache[1], case.meta(True, specs), case.h, case.d**-0.5,
    )  # fmt: skip


def _single(case: Case, spec: SeqSpec, row: int) -> torch.Tensor:
    qkv = case.qkv[row : row + 1].clone()
    out = row_attention(
        qkv, case.positions[row : row + 1].contiguous(), case.cos, case.sin,
        case.cache[0], case.cache[1], case.meta(True, [spec]), case.h, case.d**-0.5,
    )  # fmt: skip
    return out[0]


# ---- the projections' prologues ----------------------------------------------------------


def quant_op(n: int, k: int, qtype: QuantType = QuantType.Q4_1) -> QuantLinear:
    gen = torch.Generator().manual_seed(n + k)
    return QuantLinear(QuantWeight.quantize(torch.randn(n, k, generator=gen), qtype), None)


def test_row_ranges_name_each_rows_sequence_and_key_range_exactly() -> None:
    """A decode, a fresh prompt and a continued one; then the same under a sliding
    window: each row's (sequence, first key, end key) and the tables padded with 0."""
    specs = [SeqSpec(5, 1, [7, 3]), SeqSpec(0, 3, [4]), SeqSpec(6, 2, [9, 2])]
    r = RowRanges.build(specs, 4, None)
    assert r.rows.dtype == torch.int32 and r.tables.dtype == torch.int32
    want = [[0, 0, 6], [1, 0, 1], [1, 0, 2], [1, 0, 3], [2, 0, 7], [2, 0, 8]]
    assert r.rows.tolist() == want
    assert r.tables.tolist() == [[7, 3], [4, 0], [9, 2]]
    windowed = RowRanges.build(specs, 4, 2)
    assert windowed.rows.tolist() == [
        [0, 4, 6],
        [1, 0, 1],
        [1, 0, 2],
        [1, 1, 3],
        [2, 5, 7],
        [2, 6, 8],
    ]
    empty = RowRanges.build([], 4, None)
    assert empty.rows.shape == (0, 3) and empty.tables.shape == (0, 1)


def test_norm_rows_is_the_final_norm_of_the_rows_asked_in_their_order() -> None:
    """The compiled final norm: torch's RMSNorm of the gathered rows up to float order, a
    row's bits the same whatever other rows are asked with it, the rows in the order asked."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(6, 64, generator=gen)
    norm = RMSNorm(64, 1e-5, torch.float32)
    norm.weight.data = torch.randn(64, generator=gen)
    rows = torch.tensor([4, 0, 4, 2])
    got = norm_rows(h, rows, norm)
    torch.testing.assert_close(
        got, F.rms_norm(h[rows], (64,), norm.weight, 1e-5), atol=1e-6, rtol=1e-6
    )
    assert torch.equal(norm_rows(h, torch.tensor([2]), norm)[0], got[3])
    assert torch.equal(got[0], got[2])
    assert norm_rows(h, torch.tensor([], dtype=torch.long), norm).shape == (0, 64)
    with pytest.raises(IndexError, match=r"row 6 is outside \[0, 6\)"):
        norm_rows(h, torch.tensor([0, 6]), norm)
    with pytest.raises(IndexError, match=r"row -1 is outside \[0, 6\)"):
        norm_rows(h, torch.tensor([-1]), norm)


def test_rmsnorm_prologue_is_the_norm_then_the_product() -> None:
    """Within fp32 rounding of F.rms_norm then the product (the norm's own sum order
    differs, so not bit-equal), and row-invariant like the plain product."""
    op = quant_op(96, 128)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 128, generator=gen) * 3, torch.rand(128, generator=gen) + 0.5
    got = op.run(x, norm=w, eps=1e-5)
    torch.testing.assert_close(got, op(F.rms_norm(x, (128,), w, 1e-5)), atol=5e-5, rtol=1e-5)
    assert torch.equal(torch.cat([op.run(x[i : i + 1], norm=w, eps=1e-5) for i in range(37)]), got)


def test_swiglu_prologue_is_silu_gate_times_up_then_the_product() -> None:
    op = quant_op(64, 96, QuantType.Q8_0)
    x = torch.randn(21, 192, generator=torch.Generator().manual_seed(2)) * 4
    got = op.run(x, swiglu=True)
    gate, up = x.split(96, dim=1)
    torch.testing.assert_close(got, op(F.silu(gate) * up), atol=5e-5, rtol=1e-5)
    assert torch.equal(torch.cat([op.run(x[i : i + 1], swiglu=True) for i in range(21)]), got)


def test_into_adds_the_product_to_the_residual_in_place() -> None:
    op = quant_op(64, 64, QuantType.Q4_0)
    gen = torch.Generator().manual_seed(3)
    x, h = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    want = h + op(x)
    got = op.run(x, into=h)
    assert got is h and torch.equal(h, want)


def test_bad_prologue_arguments_name_the_shape() -> None:
    op = quant_op(8, 64)
    with pytest.raises(ValueError, match=r"expected \[T, 128\], got \[2, 64\]"):
        op.run(torch.randn(2, 64), swiglu=True)
    with pytest.raises(ValueError, match=r"norm: expected one contiguous fp32 \[64\] weight"):
        op.run(torch.randn(2, 64), norm=torch.ones(32))
    with pytest.raises(ValueError, match=r"into: expected a contiguous fp32 \[2, 8\]"):
        op.run(torch.randn(2, 64), into=torch.zeros(2, 9))


# ---- the model -------------------------------------------------------------------------


def tiny(tmp_path_factory: pytest.TempPathFactory, activations: str) -> CausalLM:
    path = make_tiny_gguf(tmp_path_factory.mktemp("tiny"), "LlamaForCausalLM", quant="Q4_1")
    config = EngineConfig(
        model=str(path), quantization="gguf", activations=activations, num_threads=2
    )
    model = load_model(config)
    assert model.fused and model.activations == [activations]
    return model


@pytest.fixture(scope="module")
def tiny_quantized(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    return tiny(tmp_path_factory, "fp32")


def run_steps(
    model: CausalLM, ids: list[int], chunks: list[int], decodes: int, kv: str = "float32"
) -> torch.Tensor:
    """Prefill `ids` in `chunks`, then greedy-decode, over a `kv` cache; the logits of
    every position from the last prompt token on, [1 + decodes, vocab]."""
    c = model.config
    layout = KVLayout(c.num_hidden_layers, 32, BS, c.num_key_value_heads, c.head_dim, kv)
    cache, table, seq, pos = KVCache(layout, num_host_blocks=0), list(range(1, 32)), list(ids), 0
    rows = []
    with torch.inference_mode():
        for n in [*chunks, *[1] * decodes]:
            if pos + n > len(seq):  # a decode: append the last greedy token
                seq.append(int(rows[-1].argmax()))
            meta = AttentionMetadata.build([SeqSpec(pos, n, table)], BS, per_row=True)
            logits = model(
                torch.tensor(seq[pos : pos + n]), torch.arange(pos, pos + n),
                cache.device_tensor, meta, torch.arange(n),
            )  # fmt: skip
            rows += list(logits) if pos + n >= len(ids) else []
            pos += n
    return torch.stack(rows[-(1 + decodes) :])


def test_decoded_logits_equal_a_prefill_recompute_of_the_same_tokens(
    tiny_quantized: CausalLM,
) -> None:
    """Decode 12 tokens; then prefill the prompt and the 12 tokens in one chunk, and in uneven
    chunks: every position's logits are bit-identical (the tokens a resumed request
    recomputes are the ones it decoded)."""
    assert_recompute_is_exact(tiny_quantized)


@pytest.mark.int8
def test_with_int8_activations_decoded_logits_equal_a_recompute_too(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The int8 kernels round each row alone, so `--activations int8` keeps the same
    guarantee: a resumed or migrated request recomputes the bits it decoded."""
    assert_recompute_is_exact(tiny(tmp_path_factory, "int8"))


def assert_recompute_is_exact(model: CausalLM, kv: str = "float32") -> None:
    prompt = [5, 9, 2, 77, 31, 8, 15]
    decoded = run_steps(model, prompt, [len(prompt)], 12, kv)
    tokens = prompt + [int(r.argmax()) for r in decoded[:-1]]
    once = run_steps(model, tokens, [len(tokens)], 0, kv)
    assert torch.equal(once[-1], decoded[-1])
    whole = _all_logits(model, tokens, None, kv)
    assert torch.equal(whole[len(prompt) - 1 :], decoded)
    assert torch.equal(_all_logits(model, tokens, [3, 9, 7], kv), whole)


def test_with_an_fp16_cache_decoded_logits_equal_a_recompute_too(
    tiny_quantized: CausalLM,
) -> None:
    """The fp16 cache is written and read the same way by a decode and a prefill, so a
    resumed request recomputes the bits it decoded over it too."""
    assert_recompute_is_exact(tiny_quantized, "float16")


def _all_logits(
    model: CausalLM, ids: list[int], chunks: list[int] | None = None, kv: str = "float32"
) -> torch.Tensor:
    c = model.config
    layout = KVLayout(c.num_hidden_layers, 32, BS, c.num_key_value_heads, c.head_dim, kv)
    cache, table, pos, out = KVCache(layout, num_host_blocks=0), list(range(1, 32)), 0, []
    with torch.inference_mode():
        for n in chunks or [len(ids)]:
            meta = AttentionMetadata.build([SeqSpec(pos, n, table)], BS, per_row=True)
            ids_, pos_ = torch.tensor(ids[pos : pos + n]), torch.arange(pos, pos + n)
            out.append(model(ids_, pos_, cache.device_tensor, meta, torch.arange(n)))
            pos += n
    return torch.cat(out)


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_the_compiled_path_agrees_with_the_torch_path(tiny_quantized: CausalLM, kv: str) -> None:
    """Same weights, torch attention and ops instead: logits within fp32 noise, over an
    fp32 cache or an fp16 one (which both round as they write)."""
    ids = [5, 9, 2, 77, 31, 8, 15, 40, 41]
    c = tiny_quantized.config
    layout = KVLayout(c.num_hidden_layers, 8, BS, c.num_key_value_heads, c.head_dim, kv)
    got = {}
    for per_row in (True, False):
        cache = KVCache(layout, num_host_blocks=0)
        meta = AttentionMetadata.build(
            [SeqSpec(0, len(ids), list(range(1, 8)))], BS, per_row=per_row
        )
        with torch.inference_mode():
            got[per_row] = tiny_quantized(
                torch.tensor(ids), torch.arange(len(ids)), cache.device_tensor, meta,
                torch.arange(len(ids)),
            )  # fmt: skip
    torch.testing.assert_close(got[True], got[False], atol=2e-5, rtol=1e-5)


# ---- the layers in one call (model/fused.py) --------------------------------------------


def test_the_one_call_refuses_rows_to_sample_outside_its_step_before_it_runs(
    tiny_quantized: CausalLM,
) -> None:
    """The call's tail (the final norm and LM head of the rows that sample): a row outside
    [0, T) or more rows than T are refused with the limit named, and nothing is written
    (the hidden states, the cache). Asked right, it gives the hidden states and logits of
    the rows asked for, in their order, and asked for them their argmax (numpy's); with
    no rows to sample, no head runs."""
    c = tiny_quantized.config
    layout = KVLayout(c.num_hidden_layers, 4, BS, c.num_key_value_heads, c.head_dim, "float32")
    cache = KVCache(layout, num_host_blocks=0)
    meta = AttentionMetadata.build([SeqSpec(0, 2, [1])], BS, per_row=True)
    h = torch.randn(2, c.hidden_size, generator=torch.Generator().manual_seed(3))
    before, pos, call = h.clone(), torch.arange(2), tiny_quantized._fused_layers()
    with pytest.raises(IndexError, match=r"^fused_layers: row 2 is outside \[0, 2\)$"):
        call(h, pos, cache.device_tensor, meta, torch.tensor([0, 2]))
    with pytest.raises(IndexError, match=r"^fused_layers: row -1 is outside \[0, 2\)$"):
        call(h, pos, cache.device_tensor, meta, torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"^fused_layers: 3 rows to sample, of 2$"):
        call(h, pos, cache.device_tensor, meta, torch.tensor([0, 1, 1]))
    assert torch.equal(h, before) and not cache.device_tensor.any()
    hidden, logits, argmax = call(h, pos, cache.device_tensor, meta, torch.tensor([1, 0]))
    assert torch.equal(hidden, norm_rows(h, torch.tensor([1, 0]), tiny_quantized.norm))
    assert logits is not None and torch.equal(logits, tiny_quantized.compute_logits(hidden))
    assert argmax is None  # not asked
    assert cache.device_tensor.any()  # the layers ran and wrote their K/V
    h2 = before.clone()
    hidden, logits, argmax = call(h2, pos, cache.device_tensor, meta, torch.tensor([1, 0]), True)
    assert logits is not None and argmax is not None
    assert argmax.tolist() == logits.numpy().argmax(axis=-1).tolist()
    h3 = before.clone()
    empty = torch.tensor([], dtype=torch.long)
    hidden, logits, argmax = call(h3, pos, cache.device_tensor, meta, empty, True)
    assert logits is None and argmax is None and hidden.shape == (0, c.hidden_size)


def _mixed_step(
    model: CausalLM, hooks: ForwardHooks | None, decodes: int = 0, kv: str = "float32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step mixing a 5-row prefill chunk with two decodes (or, with `decodes`, that many
    decodes alone: a step small enough for fused_layers' one-region path), on a `kv`
    cache written by an earlier chunked prefill: (logits of every row, the cache after)."""
    c = model.config
    layout = KVLayout(c.num_hidden_layers, 24, BS, c.num_key_value_heads, c.head_dim, kv)
    cache = KVCache(layout, num_host_blocks=0)
    tables = [list(range(1, 8)), list(range(8, 16)), list(range(16, 24))]
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, c.vocab_size, (3, 20), generator=gen)
    with torch.inference_mode():
        first = [SeqSpec(0, 9, tables[0]), SeqSpec(0, 13, tables[1]), SeqSpec(0, 4, tables[2])]
        flat = torch.cat([ids[0, :9], ids[1, :13], ids[2, :4]])
        pos = torch.cat([torch.arange(9), torch.arange(13), torch.arange(4)])
        meta = AttentionMetadata.build(first, BS, per_row=True)
        model(flat, pos, cache.device_tensor, meta, torch.arange(3), hooks)
        step = [SeqSpec(9, 1, tables[0]), SeqSpec(13, 1, tables[1]), SeqSpec(4, 5, tables[2])]
        flat = torch.cat([ids[0, 9:10], ids[1, 13:14], ids[2, 4:9]])
        pos = torch.tensor([9, 13, 4, 5, 6, 7, 8])
        if decodes:
            step = [SeqSpec(9, 1, tables[0]), SeqSpec(13, 1, tables[1]), SeqSpec(4, 1, tables[2])]
            step, flat, pos = step[:decodes], flat[:decodes], pos[:decodes]
        meta = AttentionMetadata.build(step, BS, per_row=True)
        logits = model(flat, pos, cache.device_tensor, meta, torch.arange(len(flat)), hooks)
    return logits, cache.device_tensor.clone()


@pytest.mark.parametrize(
    ("arch", "quant", "overrides", "activations"),
    [
        ("LlamaForCausalLM", "Q4_1", {}, "fp32"),
        pytest.param("LlamaForCausalLM", "Q4_1", {}, "int8", marks=pytest.mark.int8),
        # q/k in Q4_0 and v in Q8_0: a projection of two parts (llama.cpp's mixes); qkv bias
        ("Qwen2ForCausalLM", "Q4_0", {"blk.0.attn_v.weight": "Q8_0"}, "fp32"),
        pytest.param(
            "Qwen2ForCausalLM", "Q4_0", {"blk.1.attn_v.weight": "Q8_0"}, "int8",
            marks=pytest.mark.int8,
        ),
    ],
    ids=["llama-fp32", "llama-int8", "qwen2-mix-fp32", "qwen2-mix-int8"],
)  # fmt: skip
def test_the_layers_in_one_call_give_the_bits_of_the_calls_per_layer(
    tmp_path: pytest.TempPathFactory, arch: str, quant: str, overrides: dict, activations: str
) -> None:
    """`fused_layers` (one compiled call for every layer) against `forward_fused` layer by
    layer (what a forward with a per-layer hook runs): the same logits and the same cache,
    bit for bit, on a step mixing prefill rows and decodes - with a projection of two
    formats and a qkv bias too."""
    path = make_tiny_gguf(tmp_path, arch, quant=quant, quant_overrides=overrides)
    config = EngineConfig(
        model=str(path), quantization="gguf", activations=activations, num_threads=2
    )
    model = load_model(config)
    assert model.fused and torch.get_num_threads() == 2
    if arch == "Qwen2ForCausalLM":
        qkv = [layer.fused_ops()[0] for layer in model.layers]
        assert all(op.bias is not None for op in qkv)
        assert sorted(len(op.weights) for op in qkv) == [1, 2]
    done: list[int] = []
    per_layer = _mixed_step(model, ForwardHooks(on_layer_done=done.append))
    assert done == list(range(model.config.num_hidden_layers)) * 2
    one_call = _mixed_step(model, None)
    assert "_fused_layers_call" in model.__dict__  # the one-call path ran
    assert torch.equal(one_call[0], per_layer[0]) and torch.equal(one_call[1], per_layer[1])
    # 1-3 decodes: the layers run in one thread team (_kernels.c fused_layers_team)
    for decodes in (1, 2, 3):
        per_layer = _mixed_step(model, ForwardHooks(on_layer_done=lambda _: None), decodes)
        team = _mixed_step(model, None, decodes)
        assert team[0].shape[0] == decodes
        assert torch.equal(team[0], per_layer[0]) and torch.equal(team[1], per_layer[1])


def test_with_an_fp16_cache_the_layers_in_one_call_give_the_bits_of_the_calls_per_layer(
    tiny_quantized: CausalLM,
) -> None:
    """The one call, its thread team (1-3 decodes) and the calls per layer write and read
    an fp16 cache the same way: the same logits and the same cache, bit for bit."""
    for decodes in (0, 1, 2, 3):
        per_layer = _mixed_step(
            tiny_quantized, ForwardHooks(on_layer_done=lambda _: None), decodes, "float16"
        )
        one_call = _mixed_step(tiny_quantized, None, decodes, "float16")
        assert per_layer[1].dtype == torch.float16 and per_layer[1].any()
        assert torch.equal(one_call[0], per_layer[0]) and torch.equal(one_call[1], per_layer[1])


# ---- an fp16 KV cache ----------------------------------------------------------------------


def _attend_only(case: Case, qkv: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The compiled attention alone (no RoPE, no KV write) of the case's rows, over
    `cache` as it is, with the queries in `qkv` (already rotated)."""
    mod, ranges = kernels(), case.meta(True).ranges
    assert mod is not None and ranges is not None
    t, d = qkv.shape[0], case.d
    out = torch.empty(t, case.h * d)
    mod.paged_attention(
        qkv.data_ptr(), qkv.stride(0), t, case.h, case.hkv, d, cache[0].data_ptr(),
        cache[1].data_ptr(), kv_is_f16(cache), BS, ranges.rows.data_ptr(),
        ranges.tables.data_ptr(), ranges.tables.stride(0), out.data_ptr(), out.stride(0),
        d**-0.5, torch.get_num_threads(),
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("seqs", "h", "hkv", "d", "window"),
    [
        (MIXED, 9, 3, 64, None),
        (MIXED, 4, 4, 128, None),
        (MIXED, 4, 2, 16, None),
        (DECODES, 9, 3, 64, None),
        (LONG, 9, 3, 64, None),
        ([(300, 1)], 9, 3, 64, None),
        ([(600, 1)], 6, 3, 24, None),
        ([(180, 40)], 9, 3, 64, 130),
    ],
    ids=["mixed", "mixed-d128", "mixed-d16", "decodes", "long", "lone", "lone-d24", "window"],
)
def test_an_fp16_cache_is_an_fp32_cache_of_the_same_values(
    seqs: list[tuple[int, int]], h: int, hkv: int, d: int, window: int | None
) -> None:
    """With an fp16 cache the step's K/V are written rounded as torch's .to(float16)
    rounds them, and every row's output has the bits of the fp32 attention over an fp32
    cache holding the same values (the loads widen exactly; nothing after them differs):
    decodes, prefill chunks, a lone decode shared between threads, the head sizes with
    their own code and the generic one, a sliding window. Its bits are the same on 1 and
    2 threads, and it is torch's float64 attention over the unrounded cache to within
    fp16's rounding."""
    case = Case(seqs, h, hkv, d, window=window)
    cache16, qkv = case.cache.half(), case.qkv.clone()
    out = case.compiled(cache=cache16, qkv=qkv)
    slots, t = case.meta(True).slot_mapping, qkv.shape[0]
    rotated = qkv.view(t, h + 2 * hkv, d)
    assert torch.equal(cache16[0].view(-1, hkv, d)[slots], rotated[:, h : h + hkv].half())
    assert torch.equal(cache16[1].view(-1, hkv, d)[slots], rotated[:, h + hkv :].half())
    assert torch.equal(out, _attend_only(case, qkv, cache16.float()))
    assert torch.equal(case.compiled(threads=1, cache=case.cache.half()), out)
    assert torch.equal(case.compiled(threads=2, cache=case.cache.half()), out)
    torch.testing.assert_close(out, case.reference(), atol=2e-3, rtol=2e-3)


def test_the_compiled_attention_refuses_a_cache_dtype_it_cannot_read() -> None:
    case = Case(DECODES, 9, 3, 64)
    refused = r"^the compiled attention reads a float32 or float16 KV cache, not torch.bfloat16$"
    with pytest.raises(ValueError, match=refused):
        case.compiled(cache=case.cache.bfloat16())


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("threads", [2, 3])
def test_a_lone_decode_in_the_team_gives_the_bits_of_the_calls_per_layer(
    tmp_path: Path, kv: str, threads: int
) -> None:
    """One decode row with enough context for the attention to go by phases on the team
    (LONE in _attention.c: work x H x D >= 65,536): in the one-call team each thread
    rotates the query itself and writes only the new K and V it reads (LONE_ROPE: the K
    record by the thread whose keys hold the new one, the V record's lanes each by its
    own thread), where the calls per layer rotate and write all of it first. The same
    logits and the same cache, bit for bit, on 2 and 3 threads, the new key at a block's
    start or inside one."""
    path = make_tiny_gguf(
        tmp_path, "LlamaForCausalLM", quant="Q4_1", hidden_size=128, head_dim=32,
        max_position_embeddings=1024,
    )  # fmt: skip
    before = torch.get_num_threads()
    try:
        _lone_decodes_match(load_model(EngineConfig(model=str(path), quantization="gguf",
                                                    num_threads=threads)), kv)  # fmt: skip
    finally:
        torch.set_num_threads(before)


def _lone_decodes_match(model: CausalLM, kv: str) -> None:
    c = model.config
    assert model.fused and c.num_attention_heads * c.head_dim == 128
    gen = torch.Generator().manual_seed(5)
    for context in (512, 515, 600):  # >= 512 keys: LONE; 600 = 75 groups of 8 keys
        ids = torch.randint(0, c.vocab_size, (context + 1,), generator=gen)
        blocks = -(-(context + 1) // BS)
        layout = KVLayout(
            c.num_hidden_layers, blocks + 1, BS, c.num_key_value_heads, c.head_dim, kv
        )
        table = list(range(1, blocks + 1))
        results = []
        for hooks in (ForwardHooks(on_layer_done=lambda _: None), None):
            cache = KVCache(layout, num_host_blocks=0)
            with torch.inference_mode():
                meta = AttentionMetadata.build([SeqSpec(0, context, table)], BS, per_row=True)
                model(ids[:context], torch.arange(context), cache.device_tensor, meta,
                      torch.tensor([context - 1]))  # fmt: skip
                meta = AttentionMetadata.build([SeqSpec(context, 1, table)], BS, per_row=True)
                logits = model(ids[context:], torch.tensor([context]), cache.device_tensor,
                               meta, torch.tensor([0]), hooks)  # fmt: skip
            results.append((logits, cache.device_tensor.clone()))
        (per_layer, cache_a), (team, cache_b) = results
        assert torch.equal(team, per_layer) and torch.equal(cache_b, cache_a), context
        assert cache_b[:, :, table[context // BS]].any()  # the new token was written
