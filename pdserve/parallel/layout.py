"""How a model is split between the ranks of a tensor-parallel instance, as data.

A rank's `Shard` names what it holds, in the spirit of Mooncake's KV placement (RFC
#3692): the layer range, the query heads, the KV heads and the MLP's intermediate
columns, all contiguous ranges. The rule for heads: a rank holds whole GQA groups (a KV
head and the query heads that read it), the groups dealt out as evenly as they go, so no
KV head is held twice and each rank's attention reads only its own KV. SmolLM2 (9 query
heads in 3 groups of 3) at T = 2: rank 0 holds KV heads 0-1 and query heads 0-5, rank 1
KV head 2 and query heads 6-8. The intermediate columns are split as evenly as whole
blocks of 32 allow (a quantized weight's row is cut between blocks); the embedding, the
norms and the LM head are whole on every rank (the head runs on rank 0 only).

A split that cannot be made (more ranks than KV heads, fewer blocks of intermediate
columns than ranks) is a ValueError naming the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.model.config import ModelConfig

# A quantized weight's rows are cut only between blocks of this many values.
COLUMN_BLOCK = 32


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds: [start, stop) ranges."""

    rank: int
    world: int
    layers: tuple[int, int]
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]


def _even(n: int, parts: int, part: int) -> tuple[int, int]:
    """Part `part` of `n` items dealt into `parts` contiguous ranges, the first ones one
    larger where they do not divide."""
    base, extra = divmod(n, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def tensor_parallel(config: ModelConfig, world: int) -> list[Shard]:
    """Every rank's shard of `config` at tensor-parallel size `world`."""
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {world}")
    kv, q = config.num_key_value_heads, config.num_attention_heads
    if world > kv:
        raise ValueError(
            f"--tensor-parallel-size {world} is more than the model's {kv} KV heads: each "
            "rank holds whole GQA groups (a KV head and its query heads)"
        )
    blocks = config.intermediate_size // COLUMN_BLOCK
    if config.intermediate_size % COLUMN_BLOCK or blocks < world:
        raise ValueError(
            f"--tensor-parallel-size {world}: the MLP's {config.intermediate_size} "
            f"intermediate columns do not split into {world} runs of whole "
            f"{COLUMN_BLOCK}-column blocks"
        )
    group = q // kv
    shards = []
    for r in range(world):
        k0, k1 = _even(kv, world, r)
        b0, b1 = _even(blocks, world, r)
        shards.append(
            Shard(
                rank=r,
                world=world,
                layers=(0, config.num_hidden_layers),
                q_heads=(k0 * group, k1 * group),
                kv_heads=(k0, k1),
                intermediate=(b0 * COLUMN_BLOCK, b1 * COLUMN_BLOCK),
            )
        )
    return shards
