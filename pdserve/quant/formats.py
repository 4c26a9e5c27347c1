"""GGUF block formats held as they are: Q8_0, Q4_0 and Q4_1 weights in the layout the
kernels read (`_kernels.c`), made from a GGUF file's bytes or by quantizing fp32 weights.

A GGUF row of K values is K/32 blocks; a block is an fp16 scale `d` (Q4_1: and an fp16
minimum `m`) then the 32 quantized values (Q8_0: int8; Q4: 16 bytes, byte j holding
value j in its low nibble and value j+16 in its high one). `QuantWeight` splits the
blocks into three row-major arrays - values, scales, minimums - so a kernel streams each
with plain vector loads; nothing is expanded to fp32 except by `dequantize` (the
reference, the embedding rows of one step, and tests).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import numpy.typing as npt
import torch

BLOCK = 32


class QuantType(enum.IntEnum):
    """The formats the kernels take; the values are the kernels' type codes."""

    Q8_0 = 0
    Q4_0 = 1
    Q4_1 = 2

    @property
    def ggml(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[self.name]

    @property
    def block_bytes(self) -> int:
        return int(gguf.GGML_QUANT_SIZES[self.ggml][1])

    @property
    def bits(self) -> float:
        """Bits per weight, scales included (Q8_0 8.5, Q4_0 4.5, Q4_1 5)."""
        return 8 * self.block_bytes / BLOCK

    @classmethod
    def from_ggml(cls, t: gguf.GGMLQuantizationType) -> QuantType | None:
        return cls.__members__.get(t.name)

    @classmethod
    def parse(cls, name: str) -> QuantType:
        return cls[name.upper()]


@dataclass(frozen=True)
class QuantWeight:
    """An [N, K] weight in blocks of 32 along K. `qs`: uint8 [N, K] (Q8_0, the int8 bits)
    or [N, K/2] (Q4); `d`, `m`: float16 [N, K/32] (`m` only for Q4_1)."""

    qtype: QuantType
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        extra = 0 if self.m is None else self.m.numel() * 2
        return self.qs.numel() + self.d.numel() * 2 + extra

    @classmethod
    def from_blocks(cls, qtype: QuantType, raw: npt.NDArray[np.uint8], k: int) -> QuantWeight:
        """From GGUF bytes: `raw` holds N rows of k/32 blocks each (any shape, C order)."""
        if k % BLOCK:
            raise ValueError(f"row length {k} is not a multiple of {BLOCK}")
        per_row = k // BLOCK * qtype.block_bytes
        if raw.size % per_row:
            raise ValueError(
                f"{raw.size} bytes are not whole rows of {k // BLOCK} {qtype.name} blocks"
            )
        blocks = np.ascontiguousarray(raw).reshape(raw.size // per_row, k // BLOCK, -1)
        scale_bytes = 4 if qtype == QuantType.Q4_1 else 2
        qs = blocks[:, :, scale_bytes:].reshape(blocks.shape[0], -1)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0] if scale_bytes == 4 else None
        return cls(
            qtype,
            torch.from_numpy(np.ascontiguousarray(qs)),
            torch.from_numpy(np.ascontiguousarray(d)),
            None if m is None else torch.from_numpy(np.ascontiguousarray(m)),
        )

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: QuantType) -> QuantWeight:
        """Quantize an fp [N, K] weight the way llama.cpp does (gguf-py's reference)."""
        w = weight.detach().to(torch.float32).contiguous().numpy()
        raw = gguf.quants.quantize(w, qtype.ggml)
        return cls.from_blocks(qtype, raw, w.shape[1])

    def to_blocks(self) -> npt.NDArray[np.uint8]:
        """Back to GGUF bytes, [N, K/32 * block_bytes]."""
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

    @staticmethod
    def cat(parts: Sequence[QuantWeight]) -> QuantWeight:
        """Row-wise concatenation (a fused q/k/v or gate/up); one format, one K."""
        first = parts[0]
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
        """The fp values, [N, K]: what every kernel output is compared against."""
        n, k = self.shape
        d = self.d.to(torch.float32).unsqueeze(-1)
        if self.qtype == QuantType.Q8_0:
            q = self.qs.view(torch.int8).reshape(n, k // BLOCK, BLOCK).to(torch.float32)
            w = d * q
        else:
            packed = self.qs.reshape(n, k // BLOCK, BLOCK // 2)
            q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).to(torch.float32)
            if self.qtype == QuantType.Q4_0:
                w = d * (q - 8)
            else:
                assert self.m is not None
                w = d * q + self.m.to(torch.float32).unsqueeze(-1)
        return w.reshape(n, k).to(dtype)
