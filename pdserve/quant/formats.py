"""GGUF block formats held as the kernels read them (`_kernels.c`), made from a GGUF
file's bytes or by quantizing fp32 weights.

A GGUF row of K values is K/32 blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or K/256
super-blocks (the K formats Q4_K, Q5_K, Q6_K). `QuantWeight` splits them into row-major
arrays - values, scales, minimums - in one of five layouts (`Layout`) so that a kernel
streams each with plain vector loads and dequantizes a block of 32 values with a few
instructions. Q8_0, Q4_0 and Q4_1 keep the file's bytes exactly; the other formats are
repacked at load, losslessly: their values widened to bytes (5 and 6 bits: Q5_0 as q-16,
Q6_K as q-32, Q5_1/Q5_K as q) and the K formats' two-level scales multiplied out into one
fp32 scale (and minimum) per 32 values (Q6_K: per 16), exact in fp32 as gguf-py's
dequantization computes them. So every format dequantizes to the bits gguf-py gives; the
repacked ones hold more bytes than the file (see `Layout`). Nothing is expanded to fp32
except by `dequantize` (the reference, the embedding rows of one step, and tests).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import numpy.typing as npt
import torch

BLOCK = 32
_F32 = npt.NDArray[np.float32]
_U8 = npt.NDArray[np.uint8]


class Layout(enum.IntEnum):
    """How a weight is held for the kernels; the values are `_kernels.c`'s layout codes.
    Bits per weight held (values + fp32 scales/minimums): I8 9, Q4 5, Q4M 6, I8_16 10,
    U8M 10 (the file's Q4_0/Q4_1/Q8_0 fp16 scales are held too: +0.5/1 bit)."""

    I8 = 0  # int8 q, a scale per 32: q*d (Q8_0; Q5_0 as q-16)
    Q4 = 1  # nibbles, a scale per 32: (q-8)*d (Q4_0)
    Q4M = 2  # nibbles, scale and minimum per 32: q*d + m (Q4_1; Q4_K)
    I8_16 = 3  # int8 q, a scale per 16: q*d (Q6_K as q-32)
    U8M = 4  # uint8 q, scale and minimum per 32: q*d + m (Q5_1; Q5_K)

    @property
    def nibbles(self) -> bool:
        return self in (Layout.Q4, Layout.Q4M)

    @property
    def scales_per_block(self) -> int:
        return 2 if self == Layout.I8_16 else 1

    @property
    def has_min(self) -> bool:
        return self in (Layout.Q4M, Layout.U8M)


class QuantType(enum.IntEnum):
    """The GGUF formats the kernels read."""

    Q8_0 = 0
    Q4_0 = 1
    Q4_1 = 2
    Q5_0 = 3
    Q5_1 = 4
    Q4_K = 5
    Q5_K = 6
    Q6_K = 7

    @property
    def ggml(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[self.name]

    @property
    def block_values(self) -> int:
        """Values per block in the file: 32, or 256 for the K formats."""
        return int(gguf.GGML_QUANT_SIZES[self.ggml][0])

    @property
    def block_bytes(self) -> int:
        return int(gguf.GGML_QUANT_SIZES[self.ggml][1])

    @property
    def bits(self) -> float:
        """Bits per weight in the file, scales included (Q8_0 8.5, Q4_0 4.5, Q4_K 4.5)."""
        return 8 * self.block_bytes / self.block_values

    @property
    def layout(self) -> Layout:
        return _LAYOUTS[self]

    @classmethod
    def from_ggml(cls, t: gguf.GGMLQuantizationType) -> QuantType | None:
        return cls.__members__.get(t.name)

    @classmethod
    def parse(cls, name: str) -> QuantType:
        return cls[name.upper()]


_LAYOUTS = {
    QuantType.Q8_0: Layout.I8,
    QuantType.Q4_0: Layout.Q4,
    QuantType.Q4_1: Layout.Q4M,
    QuantType.Q5_0: Layout.I8,
    QuantType.Q5_1: Layout.U8M,
    QuantType.Q4_K: Layout.Q4M,
    QuantType.Q5_K: Layout.U8M,
    QuantType.Q6_K: Layout.I8_16,
}
# The formats whose blocks are held as they are in the file (`to_blocks` gives them back).
_AS_IN_FILE = (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1)


@dataclass(frozen=True)
class QuantWeight:
    """An [N, K] weight of format `qtype`, held in `qtype.layout`: `qs` uint8 [N, K/2]
    (nibble layouts) or [N, K] (byte layouts; I8 and I8_16 hold int8 bits); `d` [N, K/32]
    scales (I8_16: [N, K/16]); `m` [N, K/32] minimums for the layouts that have them, else
    None. `d` and `m` are the file's float16 for Q8_0/Q4_x/Q5_x, float32 for the K
    formats (their products d*sc, dmin*m need up to 18 bits)."""

    qtype: QuantType
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        per_byte = 2 if self.qtype.layout.nibbles else 1
        return self.qs.shape[0], self.qs.shape[1] * per_byte

    @classmethod
    def from_blocks(cls, qtype: QuantType, raw: npt.NDArray[np.uint8], k: int) -> QuantWeight:
        """From GGUF bytes: `raw` holds N rows of k/block_values blocks each (any shape, C
        order)."""
        per = qtype.block_values
        if k % per:
            raise ValueError(f"row length {k} is not a multiple of {per} ({qtype.name})")
        per_row = k // per * qtype.block_bytes
        if raw.size % per_row:
            raise ValueError(
                f"{raw.size} bytes are not whole rows of {k // per} {qtype.name} blocks"
            )
        blocks = np.ascontiguousarray(raw).reshape(raw.size // per_row, k // per, -1)
        qs, d, m = _SPLIT[qtype](blocks, qtype)
        rows = blocks.shape[0]

        def tensor(a: npt.NDArray[np.generic]) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1)))

        return cls(qtype, tensor(qs), tensor(d), None if m is None else tensor(m))

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: QuantType) -> QuantWeight:
        """Quantize an fp [N, K] weight the way llama.cpp does (gguf-py's reference; it
        quantizes the 32-value formats only)."""
        w = weight.detach().to(torch.float32).contiguous().numpy()
        try:
            raw = gguf.quants.quantize(w, qtype.ggml)
        except NotImplementedError as e:
            raise ValueError(f"gguf-py cannot quantize to {qtype.name}") from e
        return cls.from_blocks(qtype, raw, w.shape[1])

    def to_blocks(self) -> npt.NDArray[np.uint8]:
        """Back to GGUF bytes, [N, K/32 * block_bytes] (the formats held as in the file)."""
        if self.qtype not in _AS_IN_FILE:
            raise ValueError(f"{self.qtype.name} blocks are repacked at load; no file bytes kept")
        n, k = self.shape
        parts = [self.d.numpy().view(np.uint8).reshape(n, k // BLOCK, 2)]
        if self.m is not None:
            parts.append(self.m.numpy().view(np.uint8).reshape(n, k // BLOCK, 2))
        parts.append(self.qs.numpy().reshape(n, k // BLOCK, -1))
        return np.concatenate(parts, axis=2).reshape(n, -1)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows `index` (a permutation, a selection), still quantized."""
        return QuantWeight(
            self.qtype,
            self.qs[index].contiguous(),
            self.d[index].contiguous(),
            None if self.m is None else self.m[index].contiguous(),
        )

    def columns(self, start: int, stop: int) -> QuantWeight:
        """Values [start, stop) of every row, still quantized: whole blocks of 32 (a
        tensor-parallel rank's part of a row-parallel weight, pdserve/parallel)."""
        n, k = self.shape
        if start % BLOCK or stop % BLOCK or not 0 <= start < stop <= k:
            raise ValueError(f"columns [{start}, {stop}) of a [{n}, {k}] weight: not whole blocks")
        per_byte = 2 if self.qtype.layout.nibbles else 1
        scales = self.d.shape[1] // (k // BLOCK)  # I8_16: two per block

        def cut(t: torch.Tensor, per_block: int) -> torch.Tensor:
            return t[:, start // BLOCK * per_block : stop // BLOCK * per_block].contiguous()

        return QuantWeight(
            self.qtype,
            self.qs[:, start // per_byte : stop // per_byte].contiguous(),
            cut(self.d, scales),
            None if self.m is None else cut(self.m, 1),
        )

    @staticmethod
    def cat(parts: Sequence[QuantWeight]) -> QuantWeight:
        """Row-wise concatenation (a fused q/k/v or gate/up); one format, one K. A single
        part is returned as it is (no copy: a tied embedding and LM head share it)."""
        first = parts[0]
        if len(parts) == 1:
            return first
        for p in parts[1:]:
            if p.qtype != first.qtype or p.shape[1] != first.shape[1]:
                raise ValueError(
                    f"cannot fuse {first.qtype.name} [*, {first.shape[1]}] with "
                    f"{p.qtype.name} [*, {p.shape[1]}]"
                )
        ms = [p.m for p in parts]
        return QuantWeight(
            first.qtype,
            torch.cat([p.qs for p in parts]),
            torch.cat([p.d for p in parts]),
            None if first.m is None else torch.cat([m for m in ms if m is not None]),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The fp values, [N, K]: what every kernel output is compared against. The same
        float operations as gguf-py's (q*d exact, then + m: one rounding)."""
        n, k = self.shape
        layout = self.qtype.layout
        per = BLOCK // layout.scales_per_block
        d = self.d.to(torch.float32).reshape(n, k // per, 1)
        if layout.nibbles:
            packed = self.qs.reshape(n, k // BLOCK, BLOCK // 2)
            q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).to(torch.float32)
            q = q.reshape(n, k // per, per)
        elif layout == Layout.U8M:
            q = self.qs.reshape(n, k // per, per).to(torch.float32)
        else:
            q = self.qs.view(torch.int8).reshape(n, k // per, per).to(torch.float32)
        if layout == Layout.Q4:
            w = d * (q - 8)
        elif layout.has_min:
            assert self.m is not None
            w = d * q + self.m.to(torch.float32).reshape(n, k // per, 1)
        else:
            w = d * q
        return w.reshape(n, k).to(dtype)


# ---- splitting a file's blocks into a layout ----------------------------------------------
# Each takes blocks [rows, blocks per row, block bytes] and gives (qs, d, m), any shapes
# whose C-order reshape to [rows, -1] is the layout's.

_Split = tuple[npt.NDArray[np.generic], npt.NDArray[np.generic], npt.NDArray[np.generic] | None]


def _f16(b: _U8) -> npt.NDArray[np.float16]:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: _U8) -> _U8:
    """[..., 16] bytes of one 32-block -> [..., 32] values (low nibbles, then high)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _fifth_bits(qh: _U8) -> _U8:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, value j's in bit j."""
    bits = np.ascontiguousarray(qh).view("<u4")
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _split_plain(blocks: _U8, qtype: QuantType) -> _Split:
    """Q8_0, Q4_0, Q4_1: as in the file (fp16 scale, [fp16 minimum], values)."""
    has_m = qtype == QuantType.Q4_1
    head = 4 if has_m else 2
    return blocks[..., head:], _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]) if has_m else None


def _split_q5(blocks: _U8, qtype: QuantType) -> _Split:
    """Q5_0 (fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles) -> I8 as q-16; Q5_1 (d, m
    first) -> U8M."""
    has_m = qtype == QuantType.Q5_1
    head = 4 if has_m else 2
    q = _nibbles(blocks[..., head + 4 :]) | (_fifth_bits(blocks[..., head : head + 4]) << 4)
    m = _f16(blocks[..., 2:4]) if has_m else None
    values = q if has_m else (q.astype(np.int8) - 16).view(np.uint8)
    return values, _f16(blocks[..., 0:2]), m


def _k_scales(packed: _U8) -> tuple[_U8, _U8]:
    """The 12 bytes of 6-bit scales and minimums of a Q4_K/Q5_K super-block -> [..., 8]
    each: j < 4 in the low 6 bits of bytes j and j+4; j >= 4 split between byte j+4's
    nibbles (low bits) and the top 2 bits of bytes j-4 and j (high bits)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)), axis=-1)
    mn = np.concatenate((b & 0x3F, (c >> 4) | ((b >> 6) << 4)), axis=-1)
    return sc, mn


def _k_scale_min(blocks: _U8) -> tuple[_F32, _F32]:
    """Q4_K/Q5_K: per 32 values, d*sc and -(dmin*m) in fp32 (exact: 11 x 6 bits)."""
    d = _f16(blocks[..., 0:2]).astype(np.float32)[..., None]
    dmin = _f16(blocks[..., 2:4]).astype(np.float32)[..., None]
    sc, mn = _k_scales(blocks[..., 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _split_q4_k(blocks: _U8, qtype: QuantType) -> _Split:
    """Q4_K: d, dmin, 12 bytes of scales, 128 bytes: 32-byte groups whose low nibbles are
    one sub-block of 32 and high nibbles the next -> Q4M with GGUF's 32-block nibble order."""
    groups = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)
    values = np.stack((groups & 0x0F, groups >> 4), axis=3).reshape(*blocks.shape[:2], 8, 32)
    packed = values[..., :16] | (values[..., 16:] << 4)
    d, m = _k_scale_min(blocks)
    return packed, d, m


def _split_q5_k(blocks: _U8, qtype: QuantType) -> _Split:
    """Q5_K: as Q4_K with 32 bytes of fifth bits before the nibbles (sub-block j's in bit
    j of byte l) -> U8M."""
    lead = blocks.shape[:2]
    groups = blocks[..., 48:].reshape(*lead, 4, 32)
    low = np.stack((groups & 0x0F, groups >> 4), axis=3).reshape(*lead, 8, 32)
    high = (blocks[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    d, m = _k_scale_min(blocks)
    return low | (high << 4), d, m


def _split_q6_k(blocks: _U8, qtype: QuantType) -> _Split:
    """Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, fp16 d; two
    halves of 128 values, value l + 32i of a half (i < 4) taking nibble i // 2 of low byte
    l + 32 (i % 2) and bits 2i of high byte l -> I8_16 as q-32, scale d*sc per 16."""
    lead = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(*lead, 2, 2, 32)  # half, byte group, l
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=-2)  # half, i, l
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - 32
    d = _f16(blocks[..., 208:210]).astype(np.float32)[..., None]
    scales = blocks[..., 192:208].view(np.int8).astype(np.float32)
    return q.view(np.uint8), d * scales, None


_SPLIT: dict[QuantType, Callable[[_U8, QuantType], _Split]] = {
    QuantType.Q8_0: _split_plain,
    QuantType.Q4_0: _split_plain,
    QuantType.Q4_1: _split_plain,
    QuantType.Q5_0: _split_q5,
    QuantType.Q5_1: _split_q5,
    QuantType.Q4_K: _split_q4_k,
    QuantType.Q5_K: _split_q5_k,
    QuantType.Q6_K: _split_q6_k,
}
