"""A quantized model's decoder layers as one compiled call per step.

`DecoderLayer.forward_fused` makes five compiled calls per layer (qkv with its RMSNorm,
RoPE + KV write, attention, o with the residual add, gate/up with its RMSNorm, down with
SwiGLU and the residual add); from Python that is ~25 us of argument handling and
allocation per layer, 0.75 ms of a 30-layer step - a tenth of a batch-1 decode step.
`FusedLayers` hands the same calls, in the same order and with the same arguments, to
`fused_layers` in _kernels.c, which loops over the layers itself: the same bits as the
per-layer path (tests/test_row_attention.py), without the Python between them. The call
also ends the step: the final norm of the rows that sample and, where the LM head is a
compiled op, the head over them (two more Python calls, ~0.1 ms of a b=1 step), and when
asked each of their rows' argmax: a greedy step's tokens, taken while the logits are still
in cache (numpy's argmax after the call: ~50 us of a b=1 step).

Contract: built from the model's finalized ops, whose tensors the model keeps for its
life; the records hold their addresses, so the ops must not be replaced afterwards
(they are not: finalize builds them once). One call at a time: small steps share one
scratch buffer (the engine runs one step at a time).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from pdserve.kernels import kernels
from pdserve.model.attention import AttentionMetadata, RowRanges, kv_is_f16
from pdserve.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from pdserve.model.linear import Linear
from pdserve.quant.linear import CompiledLinear, QuantEmbedding

# _kernels.c's Op: parts, N, K, bias, then MAX_PARTS parts of six words. A projection has
# a part per run of one format among the weights it fuses: at most three (q, k, v).
MAX_PARTS = 3
_OP = struct.Struct("<4q" + "6q" * MAX_PARTS)
# _kernels.c's Layer: four Ops, norm1, norm2, eps1, eps2, H, Hkv, D, scale.
_LAYER_TAIL = struct.Struct("<2q2d3qd")


def _op_record(op: CompiledLinear) -> bytes:
    calls = op.kernel_calls
    assert len(calls) <= MAX_PARTS  # one per fused weight at most
    words = [w for call in calls for w in call] + [0] * 6 * (MAX_PARTS - len(calls))
    bias = 0 if op.bias is None else op.bias.data_ptr()
    return _OP.pack(len(calls), op.out_features, op.in_features, bias, *words)


# Decode steps of up to this many rows reuse one scratch buffer for the layers'
# intermediates (three fresh tensors per step were ~10 us each with the caches cold).
SCRATCH_ROWS = 64


class FusedLayers:
    """`forward_fused` over every layer, then the final norm and the LM head of the rows
    that sample, in one compiled call (see the module docstring)."""

    def __init__(
        self,
        layers: Sequence[DecoderLayer],
        rotary: RotaryEmbedding,
        norm: RMSNorm,
        head: Linear,
        embed: torch.Tensor | QuantEmbedding | None = None,
    ) -> None:
        """`embed`: the token embedding, for `decode_burst` (None: no bursts)."""
        mod = kernels()
        assert mod is not None
        self._call = mod.fused_layers
        self._burst_call = mod.decode_burst
        self._rotary = rotary
        self._norm = norm
        records = []
        for layer in layers:
            ops = layer.fused_ops()
            if ops is None:
                raise ValueError("every layer must be a fused quantized layer")
            a, n1, n2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
            tail = _LAYER_TAIL.pack(
                n1.weight.data_ptr(), n2.weight.data_ptr(), float(n1.eps), float(n2.eps),
                a.num_heads, a.num_kv_heads, a.head_dim, float(a.scale),
            )  # fmt: skip
            records.append(b"".join(_op_record(op) for op in ops) + tail)
        self._records = torch.frombuffer(bytearray(b"".join(records)), dtype=torch.uint8)
        self._layers = len(records)
        # The LM head runs in the call where it is a compiled op (a head dequantized to a
        # full-precision matrix is left to the caller: `logits` None).
        self._head: torch.Tensor | None = None
        self._vocab = 0
        if isinstance(head, CompiledLinear):
            self._head = torch.frombuffer(bytearray(_op_record(head)), dtype=torch.uint8)
            self._vocab = head.out_features
        w = norm.weight
        assert w.dtype == torch.float32 and w.is_contiguous() and w.dim() == 1
        self._hidden = w.shape[0]
        first = layers[0]
        self._qkv_n = first.self_attn.q_size + 2 * first.self_attn.kv_size
        self._att_n = first.self_attn.q_size
        self._gate_up_n = 2 * first.mlp.intermediate
        self._width = self._qkv_n + self._att_n + self._gate_up_n  # scratch floats per row
        self._scratch = torch.empty(SCRATCH_ROWS * self._width)
        self._embed = _embedding_rows(embed)

    @property
    def bursts(self) -> bool:
        """Whether `decode_burst` can run: the LM head and the embedding are compiled
        lookups (or an fp32 table)."""
        return self._head is not None and self._embed is not None

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        sample: torch.Tensor,
        greedy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """h: contiguous fp32 [T, hidden], updated in place; positions: int64 [T];
        kv_caches: contiguous [layers, 2, blocks, bs, Hkv, D], fp32 or fp16; meta with
        `ranges`; sample: int64 rows of h, each in [0, T) (IndexError otherwise), at most T
        of them.

        Returns (the final-norm hidden states of the `sample` rows, [len(sample), hidden];
        their logits, [len(sample), vocab], or None with no rows to sample or where the LM
        head is not a compiled op; with `greedy` and logits, each logits row's argmax,
        int64 [len(sample)] - the first largest, a NaN counting as the largest, as
        numpy's argmax - else None)."""
        ranges = meta.ranges
        assert ranges is not None and kv_caches.is_contiguous() and h.is_contiguous()
        assert sample.dtype == torch.long and sample.is_contiguous()
        t, n = h.shape[0], sample.shape[0]
        scratch = self._scratch if t <= SCRATCH_ROWS else torch.empty(t * self._width)
        qkv = scratch.data_ptr()
        att = qkv + 4 * t * self._qkv_n
        gate_up = att + 4 * t * self._att_n
        hidden = torch.empty(n, self._hidden)
        head_record = self._head if n > 0 else None
        logits = None if head_record is None else torch.empty(n, self._vocab)
        argmax = torch.empty(n, dtype=torch.long) if greedy and logits is not None else None
        norm = self._norm
        self._call(
            self._records.data_ptr(), self._layers, h.data_ptr(), t, positions.data_ptr(),
            meta.slot_mapping.data_ptr(), self._rotary.cos.data_ptr(), self._rotary.sin.data_ptr(),
            kv_caches.data_ptr(), kv_caches.stride(1), kv_is_f16(kv_caches), kv_caches.shape[3],
            ranges.rows.data_ptr(), ranges.tables.data_ptr(), ranges.tables.stride(0),
            qkv, att, gate_up, torch.get_num_threads(),
            norm.weight.data_ptr(), float(norm.eps), sample.data_ptr(), n, hidden.data_ptr(),
            0 if head_record is None else head_record.data_ptr(),
            0 if logits is None else logits.data_ptr(),
            0 if argmax is None else argmax.data_ptr(),
        )  # fmt: skip
        return hidden, logits, argmax

    def decode_burst(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        ranges: RowRanges,
        kv_caches: torch.Tensor,
        stop: torch.Tensor,
    ) -> int:
        """Up to `steps` greedy decode steps of T sequences (one decode row each) in one
        compiled call: each step embeds its tokens, runs this call's layers, final norm and
        LM head, and takes every row's argmax as the next step's token - the operations of
        a step of its own, so the same tokens. Ends early after a step that samples a token
        of `stop`. Returns the steps run, k: their tokens are tokens[1 : k + 1].

        tokens: int64 [steps + 1, T], row 0 the first step's input ids (each in [0, vocab),
        else IndexError); positions, slots: int64 [steps, T]; ranges: rows int32
        [steps * T, 3] step by step (each step's key ranges), tables covering every step's
        slots; kv_caches as for a call; stop: int64 [n]. Requires `bursts`."""
        assert self._embed is not None and self._head is not None
        steps, t = positions.shape
        for x in (tokens, positions, slots, ranges.rows, ranges.tables, stop, kv_caches):
            assert x.is_contiguous()
        assert tokens.shape == (steps + 1, t) and slots.shape == (steps, t)
        assert ranges.rows.shape == (steps * t, 3) and tokens.dtype == torch.long
        scratch = self._scratch if t <= SCRATCH_ROWS else torch.empty(t * self._width)
        qkv = scratch.data_ptr()
        att = qkv + 4 * t * self._qkv_n
        gate_up = att + 4 * t * self._att_n
        hidden = torch.empty(t, self._hidden)
        logits = torch.empty(t, self._vocab)
        h = torch.empty(t, self._hidden)
        layout, qs, d, m, vocab = self._embed
        done: int = self._burst_call(
            self._records.data_ptr(), self._layers, h.data_ptr(), t, positions.data_ptr(),
            slots.data_ptr(), self._rotary.cos.data_ptr(), self._rotary.sin.data_ptr(),
            kv_caches.data_ptr(), kv_caches.stride(1), kv_is_f16(kv_caches), kv_caches.shape[3],
            ranges.rows.data_ptr(), ranges.tables.data_ptr(), ranges.tables.stride(0),
            qkv, att, gate_up, torch.get_num_threads(),
            self._norm.weight.data_ptr(), float(self._norm.eps), hidden.data_ptr(),
            self._head.data_ptr(), logits.data_ptr(), layout, qs, d, m, vocab,
            tokens.data_ptr(), steps, stop.data_ptr(), stop.shape[0],
        )  # fmt: skip
        return done


def _embedding_rows(
    embed: torch.Tensor | QuantEmbedding | None,
) -> tuple[int, int, int, int, int] | None:
    """(layout, qs, d, m, vocab) as decode_burst takes the embedding (layout -1: fp32
    rows at qs); None where it cannot look the rows up itself."""
    if isinstance(embed, QuantEmbedding):
        rows = embed.compiled_rows()
        return None if rows is None else (*rows, embed.shape[0])
    if embed is not None and embed.dtype == torch.float32 and embed.dim() == 2:
        table = embed.data
        if table.is_contiguous():
            return -1, table.data_ptr(), 0, 0, table.shape[0]
    return None


def norm_rows(h: torch.Tensor, rows: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """The final RMSNorm of the rows `rows` of h: [len(rows), hidden], in one compiled
    call (the gather and the norm were two torch ops, ~0.14 ms of a batch-1 step: they
    run with the caches cold after the weights streamed by). The operations of a
    projection's RMSNorm prologue, so every norm of the compiled path is the same code.

    h: contiguous fp32 [T, hidden]; rows: int64 (the runner's sampled rows); a row
    outside [0, T) raises IndexError."""
    mod = kernels()
    w = norm.weight
    assert mod is not None and h.is_contiguous() and rows.dtype == torch.long
    assert w.dtype == torch.float32 and w.is_contiguous() and w.shape == (h.shape[1],)
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], h.shape[1])
    mod.rms_norm_rows(
        h.data_ptr(), h.stride(0), h.shape[0], rows.data_ptr(), rows.shape[0], h.shape[1],
        w.data_ptr(), float(norm.eps), out.data_ptr(),
    )  # fmt: skip
    return out
