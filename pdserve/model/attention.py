"""Attention over the paged KV cache, for a flat batch of many sequences.

One step's batch is a flat list of tokens from many sequences. Every sequence
contributes `query_len` new tokens at positions `[num_cached, num_cached + query_len)`
and attends to all `num_cached + query_len` tokens of its own context. That single
description covers the three cases the engine mixes in one step: a fresh prompt
(num_cached = 0), a prompt continuing after a cached prefix or an earlier chunk
(num_cached > 0, query_len > 1) and single-token decode (query_len = 1).

Layout contract
---------------
* The cache of one layer is `k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
  head_dim]`. Token `i` of a sequence lives in slot `block_table[i // block_size] *
  block_size + i % block_size`.
* Rows of the flat batch are ordered: all sequences with query_len == 1 first (the
  decode rows), then the others (the "prefill group", one call per sequence).
  `AttentionMetadata.build` takes sequences in that order; the model runner arranges it.
* Decode rows are attended in a few batched calls ("decode groups" of similar context
  length, see `group_by_length`): one batched call pads every row to the longest
  context, so a batch mixing 20- and 600-token contexts would cost as if all were
  600 long. Grouping keeps the work close to the sum of the contexts, which is what
  the planner's latency model (`planner/latency.py`) prices.
* The cache must be zero-initialised: padded block-table entries point at block 0
  and are masked, but a NaN there would still poison `softmax(.) @ V`.

Two implementations read this layout. `paged_attention` (torch: gathers and SDPA) serves
every dtype and device. `row_attention` (the compiled kernel in pdserve/kernels/
_attention.c) serves quantized models on CPU: it attends each query row on its own, in
the same float operations whether the row is a decode or one row of a prefill chunk, so
a recomputed token gets the bits its decode got (see that file's contract). It reads the
step as `RowRanges` (`AttentionMetadata.build(..., per_row=True)`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.kernels import kernels


@dataclass(frozen=True)
class SeqSpec:
    """One sequence of a step's batch, as the attention needs it."""

    num_cached: int  # tokens of this sequence already in the cache before this step
    query_len: int  # new tokens this step
    block_table: Sequence[int]

    @property
    def context_len(self) -> int:
        return self.num_cached + self.query_len


@dataclass(frozen=True)
class PrefillSeq:
    start: int  # first row of this sequence in the flat batch
    end: int
    num_cached: int
    block_table: torch.Tensor  # [n_blocks] covering context_len
    mask: torch.Tensor | None  # [query_len, context_len] bool (True = attend); None = plain causal

    def to(self, device: torch.device) -> PrefillSeq:
        mask = None if self.mask is None else self.mask.to(device, non_blocking=True)
        table = self.block_table.to(device, non_blocking=True)
        return dataclasses.replace(self, block_table=table, mask=mask)


class GatherWorkspace:
    """Reusable buffers for K/V gathered from the paged cache.

    A fresh multi-megabyte tensor per layer costs page faults on every allocation
    (measured: 5x slower gathers at batch 64). Layers run one after another and each
    consumes its gathered K/V before the next gather, so one pair of buffers serves
    every layer and every sequence of a step. Not thread-safe: one per model runner.
    """

    def __init__(self) -> None:
        self._k = torch.empty(0)
        self._v = torch.empty(0)

    def buffers(self, n_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [n_blocks, *like.shape[1:]] buffers (views of larger ones)."""
        shape = like.shape[1:]
        if (
            self._k.shape[0] < n_blocks
            or self._k.shape[1:] != shape
            or self._k.dtype != like.dtype
            or self._k.device != like.device
        ):
            cap = max(n_blocks, 2 * self._k.shape[0] if self._k.shape[1:] == shape else 0)
            self._k = torch.empty((cap, *shape), dtype=like.dtype, device=like.device)
            self._v = torch.empty_like(self._k)
        return self._k[:n_blocks], self._v[:n_blocks]


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows attended in one batched call, padded to the group's longest context."""

    rows: torch.Tensor  # [n] long: the rows of the flat batch (all < num_decode)
    block_tables: torch.Tensor  # [n, max_blocks], padded with block 0
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool (True = attend)

    def to(self, device: torch.device) -> DecodeGroup:
        return DecodeGroup(*(t.to(device, non_blocking=True) for t in dataclasses.astuple(self)))


# What one more decode group costs per step, in padded context tokens (its extra
# gather, attention call and copy-out in every layer). Measured on SmolLM2 (CPU, fp32,
# 1 thread, 48 decodes with contexts 20-620): one padded call 523-587 ms a step,
# groups with no group cost 339-347 ms, a uniform batch of the same total context
# 400-444 ms; so the fixed cost is small and a small value keeps tiny groups apart.
GROUP_COST_TOKENS = 64

# The most K + V bytes (per layer) one decode group may gather on a CPU. The gather
# copies K/V into a buffer that attention then reads: while it stays in cache that
# costs ~250-290 ns per context token and layer (SmolLM2, 1 thread); one 40 x 1024-token
# call (63 MB) costs 566 ns. Measured caps of 0.75 / 1.5 / 3 / 6 / 12 MB: 6 MB was
# fastest. (A GPU backend would rather pass None: its batched kernels prefer size.)
CPU_GROUP_BYTES = 6 * 2**20


def group_by_length(
    blocks: Sequence[int], block_size: int, group_cost: int, max_group_tokens: int | None = None
) -> list[list[int]]:
    """Partition decode rows (their context lengths in blocks) into groups so that
    sum over groups of (rows x longest context, in tokens) + groups x `group_cost` is
    smallest, with no group over `max_group_tokens` padded tokens (a single row may
    exceed it). Rows are sorted by length, so an optimal partition is a segmentation
    of that order: dynamic programming over the distinct lengths, O(distinct^2); a
    segment over the cap is cut into pieces of `max_group_tokens // longest` rows.
    Returns each group's row indices in ascending order, longest contexts first (one
    group is therefore `[0, n)` in order). Cost, once per step: 0.8 ms for 64 rows of
    52 distinct lengths, 2.9 ms for 256 rows (a CPU decode step of that size takes
    hundreds of ms)."""
    if not blocks:
        return []
    order = sorted(range(len(blocks)), key=lambda i: blocks[i])
    values: list[int] = []  # distinct lengths, ascending
    ends: list[int] = [0]  # ends[j]: rows of `order` shorter than values[j] (then all)
    for n, i in enumerate(order, 1):
        if not values or values[-1] != blocks[i]:
            values.append(blocks[i])
            ends.append(n)
        else:
            ends[-1] = n

    def per_group(j: int) -> int:  # rows a group whose longest is values[j - 1] may hold
        top = values[j - 1] * block_size
        return len(blocks) if max_group_tokens is None else max(1, max_group_tokens // top)

    def cost(i: int, j: int) -> int:  # the rows with lengths values[i:j] as one segment
        rows = ends[j] - ends[i]
        return rows * values[j - 1] * block_size + -(-rows // per_group(j)) * group_cost

    best = [0] * (len(values) + 1)  # best[j]: cost of the rows with the j shortest lengths
    cut = [0] * (len(values) + 1)
    for j in range(1, len(values) + 1):
        best[j], cut[j] = min((best[i] + cost(i, j), i) for i in range(j))
    groups: list[list[int]] = []
    j = len(values)
    while j:
        i, size = cut[j], per_group(j)
        rows = order[ends[i] : ends[j]]
        groups += [
            sorted(rows[k - size if k > size else 0 : k]) for k in range(len(rows), 0, -size)
        ]
        j = i
    return groups


@dataclass(frozen=True)
class RowRanges:
    """A step as the compiled attention reads it: for each row of the flat batch, its
    sequence and the range of key positions it attends, and each sequence's block table.
    """

    rows: torch.Tensor  # int32 [T, 3]: sequence index, first key, end key (exclusive)
    tables: torch.Tensor  # int32 [S, max_blocks], padded with 0

    @staticmethod
    def build(seqs: Sequence[SeqSpec], block_size: int, sliding_window: int | None) -> RowRanges:
        # Python lists and one tensor each, not torch ops over the rows: a batch-1 decode
        # step builds this with its caches cold (the weights streamed through them), where
        # a dozen torch ops cost ~0.3 ms; a 2,000-row prefill chunk's loop costs ~0.2 ms.
        flat: list[int] = []
        for i, s in enumerate(seqs):
            ends = range(s.num_cached + 1, s.context_len + 1)  # row r attends keys < its end
            if sliding_window:
                starts: Iterable[int] = (max(0, e - sliding_window) for e in ends)
            else:
                starts = itertools.repeat(0, s.query_len)
            flat.extend(itertools.chain.from_iterable(zip(itertools.repeat(i), starts, ends)))
        n_blocks = [-(-s.context_len // block_size) for s in seqs]
        width = max(n_blocks, default=1)
        tables = [
            [*s.block_table[:n], *itertools.repeat(0, width - n)]
            for s, n in zip(seqs, n_blocks, strict=True)
        ]
        return RowRanges(
            torch.tensor(flat, dtype=torch.int32).view(-1, 3),
            torch.tensor(tables, dtype=torch.int32).view(-1, width),
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once per step).

    Built for one of the two implementations (module docstring): `paged_attention`
    reads `decode_groups` and `prefills`; `row_attention` reads `ranges`, which only a
    `per_row` build has (its decode groups and prefills are then left empty)."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decode: int  # rows [0, num_decode) are decode rows
    decode_groups: tuple[DecodeGroup, ...]  # a partition of the decode rows
    prefills: tuple[PrefillSeq, ...]
    workspace: GatherWorkspace = field(default_factory=GatherWorkspace)
    ranges: RowRanges | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same step with its tensors on `device` (built on the host; this is the
        one copy to an accelerator per step). On the CPU: itself. The compiled path's
        `ranges` are host-only and stay."""
        if device.type == "cpu":
            return self
        return dataclasses.replace(
            self,
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            decode_groups=tuple(g.to(device) for g in self.decode_groups),
            prefills=tuple(p.to(device) for p in self.prefills),
        )

    @staticmethod
    def build(
        seqs: Sequence[SeqSpec],
        block_size: int,
        sliding_window: int | None = None,
        workspace: GatherWorkspace | None = None,
        group_cost: int = GROUP_COST_TOKENS,
        max_group_tokens: int | None = None,
        per_row: bool = False,
    ) -> AttentionMetadata:
        slots: list[int] = []
        for s in seqs:
            slots.extend(slots_of(s, block_size))
        if per_row:
            return AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long),
                num_decode=sum(1 for s in seqs if s.query_len == 1),
                decode_groups=(),
                prefills=(),
                ranges=RowRanges.build(seqs, block_size, sliding_window),
            )
        num_decode = 0
        while num_decode < len(seqs) and seqs[num_decode].query_len == 1:
            num_decode += 1
        groups = _decode_groups(
            seqs[:num_decode], block_size, sliding_window, group_cost, max_group_tokens
        )
        prefills = []
        row = num_decode
        for s in seqs[num_decode:]:
            if s.query_len == 1:
                raise ValueError("sequences with query_len == 1 must come first")
            prefills.append(_prefill_seq(s, row, block_size, sliding_window))
            row += s.query_len
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode=num_decode,
            decode_groups=groups,
            prefills=tuple(prefills),
            workspace=workspace or GatherWorkspace(),
        )


def slots_of(s: SeqSpec, block_size: int) -> list[int]:
    """The cache slots of `s`'s new tokens, in order."""
    table = s.block_table
    return [
        table[i // block_size] * block_size + i % block_size
        for i in range(s.num_cached, s.context_len)
    ]


def _decode_groups(
    seqs: Sequence[SeqSpec],
    block_size: int,
    sliding_window: int | None,
    group_cost: int,
    max_group_tokens: int | None,
) -> tuple[DecodeGroup, ...]:
    blocks = [-(-s.context_len // block_size) for s in seqs]
    return tuple(
        _decode_group(rows, [seqs[i] for i in rows], block_size, sliding_window)
        for rows in group_by_length(blocks, block_size, group_cost, max_group_tokens)
    )


def _decode_group(
    rows: list[int], seqs: Sequence[SeqSpec], block_size: int, sliding_window: int | None
) -> DecodeGroup:
    max_blocks = max(-(-s.context_len // block_size) for s in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = -(-s.context_len // block_size)
        tables[i, :n] = torch.tensor(s.block_table[:n], dtype=torch.long)
    lens = torch.tensor([s.context_len for s in seqs])
    key_pos = torch.arange(max_blocks * block_size)
    mask = key_pos[None, :] < lens[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > (lens[:, None] - 1 - sliding_window)
    return DecodeGroup(torch.tensor(rows, dtype=torch.long), tables, mask[:, None, None, :])


def _prefill_seq(s: SeqSpec, row: int, block_size: int, sliding_window: int | None) -> PrefillSeq:
    n_blocks = -(-s.context_len // block_size)
    table = torch.tensor(s.block_table[:n_blocks], dtype=torch.long)
    mask = None
    if s.num_cached > 0 or sliding_window is not None:
        q_pos = torch.arange(s.num_cached, s.context_len)[:, None]
        k_pos = torch.arange(s.context_len)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    return PrefillSeq(row, row + s.query_len, s.num_cached, table, mask)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots,
    rounded to the cache's dtype where it is narrower (round to nearest even)."""
    nkv, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a flat batch. q: [T, H, D]; k, v: [T, Hkv, D] (already in the cache).

    Returns [T, H, D].
    """
    out = torch.empty_like(q)
    groups, n = meta.decode_groups, meta.num_decode
    if len(groups) == 1:  # the common case: rows [0, num_decode), in order
        out[:n] = _decode_attention(q[:n], k_cache, v_cache, groups[0], meta.workspace, scale)
    else:
        for g in groups:
            o = _decode_attention(
                q.index_select(0, g.rows), k_cache, v_cache, g, meta.workspace, scale
            )
            out.index_copy_(0, g.rows, o)
    for p in meta.prefills:
        out[p.start : p.end] = _prefill_attention(
            q, k, v, k_cache, v_cache, p, scale, meta.workspace
        )
    return out


def _gather(cache: torch.Tensor, tables: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hkv, D] x [B, nb] -> [B, Hkv, nb * bs, D], a strided view of `out`."""
    b, nb = tables.shape
    torch.index_select(cache, 0, tables.reshape(-1), out=out)
    _, bs, hkv, d = cache.shape
    return out.view(b, nb * bs, hkv, d).transpose(1, 2)


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ws: GatherWorkspace,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' K and V, in `dtype` (the queries'; widened from a narrower cache)."""
    kbuf, vbuf = ws.buffers(tables.numel(), k_cache)
    ks, vs = _gather(k_cache, tables, kbuf), _gather(v_cache, tables, vbuf)
    return ks.to(dtype), vs.to(dtype)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    ws: GatherWorkspace,
    scale: float,
) -> torch.Tensor:
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    # GQA without repeating K/V: the `h // hkv` query heads sharing a KV head become
    # the "query length" axis of that KV head (HF orders heads kv-major, as here).
    qg = q.view(b, hkv, h // hkv, d)
    kc, vc = _gather_kv(k_cache, v_cache, group.block_tables, ws, q.dtype)
    o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=group.mask, scale=scale)
    return o.reshape(b, h, d)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: PrefillSeq,
    scale: float,
    ws: GatherWorkspace,
) -> torch.Tensor:
    qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if p.num_cached == 0:
        # Fresh prompt: its whole context is this step's K/V; no cache read needed. Its
        # values are the cache's (rounded as the cache holds them), as a decode reads them.
        ks = k[p.start : p.end].to(k_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
        vs = v[p.start : p.end].to(v_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
    else:
        n_ctx = p.num_cached + (p.end - p.start)
        ks, vs = _gather_kv(k_cache, v_cache, p.block_table[None], ws, q.dtype)
        ks, vs = ks[:, :, :n_ctx], vs[:, :, :n_ctx]
    gqa = q.shape[1] != k.shape[1]
    if p.mask is None:
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=p.mask, scale=scale, enable_gqa=gqa
        )
    return o[0].transpose(0, 1)


# The cache dtypes the compiled kernels read: fp32, and fp16 widened exactly to fp32 as it
# is read (so the float operations after the load are the ones an fp32 cache holding the
# same values gets).
COMPILED_KV_DTYPES = (torch.float32, torch.float16)


def kv_is_f16(cache: torch.Tensor) -> int:
    """The kernels' `kv16` argument for a cache: 1 for fp16, 0 for fp32 (else ValueError)."""
    if cache.dtype not in COMPILED_KV_DTYPES:
        raise ValueError(
            f"the compiled attention reads a float32 or float16 KV cache, not {cache.dtype}"
        )
    return int(cache.dtype == torch.float16)


def row_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """The compiled path from a fused q/k/v projection to attention output: RoPE on q and
    k (in place in `qkv`), this step's K/V into the cache, then each row over its keys.

    qkv: [T, (H + 2 Hkv) D] fp32, contiguous rows; positions: [T] int64; cos, sin: the
    whole [max_positions, D] tables; caches [num_blocks, bs, Hkv, D], fp32 or fp16 (K/V
    rounded to fp16 as they are written, widened exactly as they are read: `kv_is_f16`).
    Returns [T, H D].
    Needs a `per_row` metadata and the compiled kernels (the caller checks both)."""
    mod, ranges = kernels(), meta.ranges
    assert mod is not None and ranges is not None
    t, (_, bs, hkv, d) = qkv.shape[0], k_cache.shape
    slots, ld = meta.slot_mapping, qkv.stride(0)
    f16 = kv_is_f16(k_cache)
    mod.rope_write_kv(
        qkv.data_ptr(), ld, t, num_heads, hkv, d, positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), f16,
        slots.data_ptr(),
    )  # fmt: skip
    out = torch.empty(t, num_heads * d, dtype=qkv.dtype)
    mod.paged_attention(
        qkv.data_ptr(), ld, t, num_heads, hkv, d, k_cache.data_ptr(), v_cache.data_ptr(), f16, bs,
        ranges.rows.data_ptr(), ranges.tables.data_ptr(), ranges.tables.stride(0),
        out.data_ptr(), out.stride(0), scale, torch.get_num_threads(),
    )  # fmt: skip
    return out
