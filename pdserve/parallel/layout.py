"""How a model is split between the ranks of a parallel instance, as data.

An instance of T x P ranks runs P pipeline stages, each of T tensor-parallel ranks: rank
r is stage r // T, tensor rank r % T. A rank's `Shard` names what it holds, in the spirit
of Mooncake's KV placement (RFC #3692): the layer range (its stage's: the layers dealt
into P contiguous runs, the first ones one larger where they do not divide), the query
heads, the KV heads and the MLP's intermediate columns, all contiguous ranges. The rule
for heads: a rank holds whole GQA groups (a KV
head and the query heads that read it), the groups dealt out as evenly as they go, so no
KV head is held twice and each rank's attention reads only its own KV. SmolLM2 (9 query
heads in 3 groups of 3) at T = 2: rank 0 holds KV heads 0-1 and query heads 0-5, rank 1
KV head 2 and query heads 6-8. The intermediate columns are split as evenly as whole
blocks of 32 allow (a quantized weight's row is cut between blocks). The norms of a
stage's layers are whole on its ranks; the embedding, the final norm and the LM head are
held by the first stage only (the driver's: it embeds the tokens and turns the last
stage's hidden rows into logits), whole on each of its ranks (the head runs on rank 0).

A split that cannot be made (more tensor ranks than KV heads, fewer blocks of
intermediate columns than tensor ranks, more stages than layers) is a ValueError naming
the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdserve.config import EngineConfig
from pdserve.kv.layout import KVLayout
from pdserve.model.config import ModelConfig
from pdserve.parallel.split import COLUMN_BLOCK, split_problem


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` (= tp x pp) holds: [start, stop) ranges."""

    rank: int
    world: int
    layers: tuple[int, int]
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    tp: int = 1  # tensor-parallel ranks per stage
    pp: int = 1  # pipeline stages

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def first(self) -> bool:
        """Whether this rank's stage is the first (it holds the model's ends)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

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


def split_model(config: ModelConfig, world: int, stages: int = 1) -> list[Shard]:
    """Every rank's shard of `config` at tensor-parallel size `world` and pipeline-parallel
    size `stages`, in rank order (stage-major)."""
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {world}")
    if stages < 1:
        raise ValueError(f"--pipeline-parallel-size must be at least 1, got {stages}")
    layers = config.num_hidden_layers
    kv, q = config.num_key_value_heads, config.num_attention_heads
    problem = split_problem(kv, config.intermediate_size, layers, world, stages)
    if problem is not None:
        raise ValueError(problem)
    blocks = config.intermediate_size // COLUMN_BLOCK
    group = q // kv
    shards = []
    for s in range(stages):
        for r in range(world):
            k0, k1 = _even(kv, world, r)
            b0, b1 = _even(blocks, world, r)
            shards.append(
                Shard(
                    rank=s * world + r,
                    world=world * stages,
                    layers=_even(layers, stages, s),
                    q_heads=(k0 * group, k1 * group),
                    kv_heads=(k0, k1),
                    intermediate=(b0 * COLUMN_BLOCK, b1 * COLUMN_BLOCK),
                    tp=world,
                    pp=stages,
                )
            )
    return shards


def rank_kv_layout(shard: Shard, whole: KVLayout) -> KVLayout:
    """The layout of `shard`'s KV pool in an instance whose pools have `whole`'s geometry
    (blocks, block size, head size, dtype): its layers and KV heads, by global index."""
    return msgspec.structs.replace(
        whole,
        num_layers=shard.num_layers,
        first_layer=shard.layers[0],
        num_kv_heads=shard.num_kv_heads,
        first_kv_head=shard.kv_heads[0],
    )


def check_layout(config: EngineConfig, model: ModelConfig, here: bool = True) -> None:
    """An instance's layout splits `model` (`split_model`) and, when its ranks run on this
    machine (`here`), fits it (`check_ranks_fit`): ValueError, a usage error, naming the
    first problem. One rank needs neither."""
    if config.world_size == 1:
        return
    split_model(model, config.tensor_parallel_size, config.pipeline_parallel_size)
    if here:
        check_ranks_fit(config)


def check_ranks_fit(config: EngineConfig) -> None:
    """Each rank needs a device of its own (CUDA) or a thread of its own (CPU: the
    instance's threads, `--num-threads`, default the cores it may use, are shared among
    its ranks; more ranks than cores must be asked for with --num-threads)."""
    world = config.world_size
    label = "" if config.instance_name == "engine" else f"{config.instance_name}: "
    label += (
        f"--tensor-parallel-size {config.tensor_parallel_size} x --pipeline-parallel-size "
        f"{config.pipeline_parallel_size} = {world} ranks"
    )
    if config.device.startswith("cuda"):
        import torch  # the server's flag checks run before torch loads; a CUDA node's need it

        have = torch.cuda.device_count()
        if world > have:
            raise ValueError(f"{label}, but this node has {have} CUDA devices")
    elif world > config.threads:
        raise ValueError(
            f"{label}, but the instance has {config.threads} threads (each rank takes at "
            "least one; --num-threads sets them)"
        )
