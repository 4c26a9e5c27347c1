"""Q4_K, Q5_K and Q6_K blocks from fp32 weights, for test models and kernel tests.

gguf-py quantizes only the 32-value formats; llama.cpp's `llama-quantize` makes K-format
files with an importance-weighted search this does not attempt: here each sub-block's
scale (and minimum) come from its min and max, and the super-block's fp16 scales from
the largest of those. The blocks are valid GGUF blocks all the same (their layout is
what the tests exercise), and gguf-py's dequantization is the reference for them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

SUPER = 256


def quantize_k(weight: npt.NDArray[np.float32], qtype: str) -> npt.NDArray[np.uint8]:
    """[N, K] fp32 (K a multiple of 256) -> [N, K/256 * block bytes] GGUF bytes."""
    n, k = weight.shape
    x = np.ascontiguousarray(weight, dtype=np.float32).reshape(n * k // SUPER, SUPER)
    blocks = {"Q4_K": _q4_5_k, "Q5_K": _q4_5_k, "Q6_K": _q6_k}[qtype](x, qtype)
    return blocks.reshape(n, -1)


def _f16_bytes(v: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _ratio(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return np.divide(a, b, out=np.zeros_like(a), where=b > 0)


def _q4_5_k(x: npt.NDArray[np.float32], qtype: str) -> npt.NDArray[np.uint8]:
    levels = 15 if qtype == "Q4_K" else 31
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_ratio(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    offset = dmin[:, None] * mn
    q = np.clip(np.round(_ratio(sub + offset[..., None], step[..., None])), 0, levels)
    q = q.astype(np.uint8)
    packed = np.empty((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), packed]
    if qtype == "Q5_K":
        high = ((q >> 4) & 1).astype(np.uint8)  # [blocks, 8, 32]
        parts.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(1).astype(np.uint8))
    parts.append(nibbles)
    return np.concatenate(parts, axis=1)


def _q6_k(x: npt.NDArray[np.float32], qtype: str) -> npt.NDArray[np.uint8]:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_ratio(scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.clip(np.round(_ratio(sub, step[..., None])), -32, 31).astype(np.int16) + 32
    v = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # half, i, l: value 128 h + 32 i + l
    ql = np.concatenate(
        (
            (v[:, :, 0] & 0x0F) | ((v[:, :, 2] & 0x0F) << 4),
            (v[:, :, 1] & 0x0F) | ((v[:, :, 3] & 0x0F) << 4),
        ),
        axis=-1,
    ).reshape(-1, 128)
    qh = sum((v[:, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
