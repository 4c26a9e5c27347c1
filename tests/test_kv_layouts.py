"""KV handed between instances of different layouts (issue 54, item 2: the transfer
library's half): a source instance of one (TP, PP, block size) to a destination of another,
each pair of ranks that shares layers and KV heads moving exactly those through a real
transport (in-process, /dev/shm, TCP), nothing gathered in one place.

The model: 6 layers, 9 query heads in 3 GQA groups (SmolLM2's shape, smaller), head size 4,
split by the engine's own rule (`split_model`: at TP 2 rank 0 holds KV heads 0-1, rank 1
KV head 2). The request's KV is a random tensor; each source rank's pool holds its shard
of it under a shuffled block table. After the move, every destination rank's pool must
equal - bit for bit, every slot, untouched slots still zero - its shard of the same KV
under the destination's own table, and the plans must move the request's KV exactly once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NamedTuple

import msgspec
import pytest
import torch

from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer import (
    LayoutMismatchError,
    Transport,
    make_transport,
    plans_between,
    scatter,
    stream_out,
)
from pdserve.model.config import ModelConfig
from pdserve.parallel.layout import rank_kv_layout, split_model

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=36,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
TOKENS = 37  # not a whole number of blocks of either size
NUM_BLOCKS = 8


class Instance(NamedTuple):
    tp: int
    pp: int
    block_size: int

    def layouts(self) -> list[KVLayout]:
        whole = KVLayout(
            CONFIG.num_hidden_layers,
            NUM_BLOCKS,
            self.block_size,
            CONFIG.num_key_value_heads,
            CONFIG.head_dim,
            "float32",
        )
        return [rank_kv_layout(s, whole) for s in split_model(CONFIG, self.tp, self.pp)]

    def table(self, seed: int) -> list[int]:
        """A shuffled block table for TOKENS tokens (with a pair of adjacent ids)."""
        order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))
        return order[: -(-TOKENS // self.block_size)].tolist()

    def __str__(self) -> str:
        return f"tp{self.tp}-pp{self.pp}-block{self.block_size}"


def shard_pools(
    instance: Instance, kv: torch.Tensor, table: list[int], start: int = 0
) -> list[torch.Tensor]:
    """Each rank's pool holding its shard of `kv` ([layers, 2, tokens, heads, head_dim], the
    whole model's) at tokens [start, TOKENS) under `table`; zeros elsewhere."""
    pools = []
    for lay in instance.layouts():
        pool = torch.zeros(lay.shape)
        layers, heads = lay.layers, lay.kv_heads
        part = kv[layers.start : layers.stop, :, start:, heads.start : heads.stop]
        scatter(part.contiguous(), pool, lay, table, start)
        pools.append(pool)
    return pools


@pytest.fixture(params=["inproc", "shm", "tcp"])
def transports(request: pytest.FixtureRequest) -> Iterator[tuple[Transport, Transport]]:
    """The source and the destination instance's transports."""
    a, b = make_transport(request.param), make_transport(request.param)
    yield a, b
    a.close()
    b.close()


# The hand-offs: TP 2 -> PP 2 and back, block 16 -> 32 and back, and more.
PAIRS = [
    (Instance(2, 1, 16), Instance(1, 2, 32)),
    (Instance(1, 2, 32), Instance(2, 1, 16)),
    (Instance(2, 2, 16), Instance(1, 1, 16)),
    (Instance(1, 1, 32), Instance(2, 2, 16)),
    (Instance(2, 1, 16), Instance(2, 1, 32)),
    (Instance(3, 1, 16), Instance(2, 3, 16)),
]


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_each_destination_rank_gets_exactly_its_shard(
    src: Instance, dst: Instance, transports: tuple[Transport, Transport]
) -> None:
    sender, receiver = transports
    kv = torch.randn(CONFIG.num_hidden_layers, 2, TOKENS, 3, CONFIG.head_dim)
    src_table, dst_table = src.table(1), dst.table(2)
    src_pools = shard_pools(src, kv, src_table)
    regions = [receiver.create_region(f"dst-{r}", lay) for r, lay in enumerate(dst.layouts())]
    plans = plans_between(
        src.layouts(), src_table, [r.handle.layout for r in regions], dst_table, 0, TOKENS
    )
    for s, d, plan in plans:
        sender.flush(regions[d].handle, plan, src_pools[s])
    want = shard_pools(dst, kv, dst_table)
    for r, region in enumerate(regions):
        assert torch.equal(region.tensor, want[r]), f"destination rank {r}"
    # every element of the request's KV moved once: no rank sent a shard twice
    assert sum(p.nbytes for _, _, p in plans) == kv.numel() * 4
    # each pair moves what the two ranks share, as whole rows where one holds it all
    for s, d, plan in plans:
        a, b = src.layouts()[s], dst.layouts()[d]
        heads = range(max(a.first_kv_head, b.first_kv_head), min(a.kv_heads.stop, b.kv_heads.stop))
        assert plan.token_bytes == len(heads) * CONFIG.head_dim * 4
        assert (plan.src_heads is None) == (heads == a.kv_heads)
        assert (plan.dst_heads is None) == (heads == b.kv_heads)


def test_a_prefix_fetch_and_one_layer_across_layouts(
    transports: tuple[Transport, Transport],
) -> None:
    """The receiver pulls (`fetch`) part of a request - tokens [16, 37), then one layer of
    them alone - from a PP 2 instance into TP 2 ranks: only those move."""
    sender, receiver = transports
    src, dst = Instance(1, 2, 16), Instance(2, 1, 32)
    kv = torch.randn(CONFIG.num_hidden_layers, 2, TOKENS, 3, CONFIG.head_dim)
    src_table, dst_table = src.table(3), dst.table(4)
    regions = [sender.create_region(f"src-{r}", lay) for r, lay in enumerate(src.layouts())]
    for region, pool in zip(regions, shard_pools(src, kv, src_table), strict=True):
        region.tensor.copy_(pool)
    layer = range(4, 5)
    for layers in (range(0, 6), layer):
        dst_pools = [torch.zeros(lay.shape) for lay in dst.layouts()]
        plans = plans_between(
            src.layouts(), src_table, dst.layouts(), dst_table, 16, TOKENS, layers
        )
        for s, d, plan in plans:
            receiver.fetch(regions[s].handle, plan, dst_pools[d])
        cut = torch.zeros_like(kv)
        cut[layers.start : layers.stop, :, 16:] = kv[layers.start : layers.stop, :, 16:]
        want = shard_pools(dst, cut, dst_table)
        for r in range(2):
            assert torch.equal(dst_pools[r], want[r]), (layers, r)
    assert len(plans) == 2  # layer 4 lives on stage 1 only: one source rank, two receivers


def test_layouts_that_cannot_exchange_are_refused_naming_both() -> None:
    tp2 = Instance(2, 1, 16).layouts()
    other = [msgspec_replace(lay, head_dim=8) for lay in Instance(1, 1, 16).layouts()]
    with pytest.raises(LayoutMismatchError) as info:
        plans_between(tp2, [0, 1, 2], other, [0, 1, 2], 0, TOKENS)
    assert str(info.value) == "head_dim differs: source has [4], destination has [8]"
    # a source of 2 KV heads (another model) cannot fill a destination of 3
    fewer = [msgspec_replace(lay, num_kv_heads=2) for lay in Instance(1, 1, 16).layouts()]
    with pytest.raises(LayoutMismatchError) as info:
        plans_between(fewer, [0, 1, 2], tp2, [0, 1, 2], 0, TOKENS)
    assert str(info.value) == (
        "destination rank 1 (layers [0, 6), KV heads [2, 3) of 4 float32, blocks of 16) is "
        "not covered by the source's ranks (rank 0: layers [0, 6), KV heads [0, 2) of 4 "
        "float32, blocks of 16)"
    )
    with pytest.raises(LayoutMismatchError) as info:
        stream_out(tp2[1], [0, 1, 2], fewer[0], [0, 1, 2], 0, TOKENS)
    assert str(info.value) == "no common KV heads: source holds [2, 3), destination holds [0, 2)"


def msgspec_replace(layout: KVLayout, **changes: int) -> KVLayout:
    return msgspec.structs.replace(layout, **changes)


def test_split_rule_the_plans_follow() -> None:
    """What each rank holds, as the plans above see it (SmolLM2's rule at this size)."""
    held = {
        (tp, pp): [(lay.layers, lay.kv_heads) for lay in Instance(tp, pp, 16).layouts()]
        for tp, pp in itertools.product((1, 2), (1, 2))
    }
    assert held[2, 1] == [(range(0, 6), range(0, 2)), (range(0, 6), range(2, 3))]
    assert held[1, 2] == [(range(0, 3), range(0, 3)), (range(3, 6), range(0, 3))]
    assert held[2, 2] == [
        (range(0, 3), range(0, 2)),
        (range(0, 3), range(2, 3)),
        (range(3, 6), range(0, 2)),
        (range(3, 6), range(2, 3)),
    ]


def test_instances_of_different_models_or_kv_dtypes_are_refused_at_registration() -> None:
    """`KVLayout.handoff_mismatch` names what differs between two instances' whole pools
    (block sizes may differ: plans map them); the controller's check as an instance
    registers names both instances and both layouts (`cluster.instance.layout_conflict`)."""
    from types import SimpleNamespace

    from pdserve.cluster.instance import layout_conflict

    smol = KVLayout(30, 64, 16, 3, 64, "float16")
    assert smol.handoff_mismatch(msgspec.structs.replace(smol, block_size=32)) is None
    other = KVLayout(24, 64, 16, 4, 128, "float32")
    assert smol.handoff_mismatch(other) == (
        "layers 30 vs 24; KV heads 3 vs 4; head size 64 vs 128; KV dtype float16 vs float32"
    )
    prefill = SimpleNamespace(name="prefill-0", alive=True, kv_layout=smol)
    decode = SimpleNamespace(name="decode-0", alive=True, kv_layout=other)
    instances = [prefill, decode]
    assert layout_conflict(decode, instances) == (  # type: ignore[arg-type]
        "decode-0 (layers [0, 24), KV heads [0, 4) of 128 float32, blocks of 16) cannot "
        "exchange KV with prefill-0 (layers [0, 30), KV heads [0, 3) of 64 float16, blocks "
        "of 16): layers 24 vs 30; KV heads 4 vs 3; head size 128 vs 64; KV dtype float32 vs "
        "float16"
    )
    decode.kv_layout = msgspec.structs.replace(smol, block_size=32)
    assert layout_conflict(decode, instances) is None  # type: ignore[arg-type]
    prefill.alive, decode.kv_layout = False, other  # a dead instance is not compared
    assert layout_conflict(decode, instances) is None  # type: ignore[arg-type]
