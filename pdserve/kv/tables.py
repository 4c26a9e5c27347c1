"""`ReqState`: the block tables of one KV state, and the checks they must pass.

A KV state (a request, or a `KVManager.hold`) lists its device blocks in token order, or,
while swapped out, its private host blocks. `KVManager` owns the states and changes them;
`check_commit` vets what a commit claims (ValueError), and `check_tables` checks every state
against the device and host tiers for `KVManager.check_integrity` (AssertionError).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from pdserve.kv.block_pool import integrity_check
from pdserve.kv.device_tier import DeviceTier
from pdserve.kv.host_tier import HostTier

ReqId: TypeAlias = Hashable


@dataclass(slots=True)
class ReqState:
    blocks: list[int]  # device block table; empty while swapped out
    num_computed: int  # tokens whose KV is written (survives swapping)
    num_committed: int = 0  # leading blocks of `blocks` already in the prefix index
    host_blocks: list[int] | None = None  # set exactly while swapped out


def check_commit(
    req_id: ReqId, state: ReqState, token_ids: Sequence[int], num_computed: int, bs: int
) -> None:
    """ValueError unless `num_computed` tokens of `token_ids` may be committed for a running
    state: no fewer than already committed, no more than known or than its table holds."""
    if num_computed < state.num_computed:
        raise ValueError(
            f"commit of {req_id!r}: num_computed_tokens {num_computed} < "
            f"{state.num_computed} already committed"
        )
    if num_computed > len(token_ids):
        raise ValueError(
            f"commit of {req_id!r}: num_computed_tokens {num_computed} > "
            f"{len(token_ids)} known tokens"
        )
    capacity = len(state.blocks) * bs
    if num_computed > capacity:
        raise ValueError(
            f"commit of {req_id!r}: num_computed_tokens {num_computed} > "
            f"{capacity} tokens allocated"
        )


def check_tables(
    states: Mapping[ReqId, ReqState], device: DeviceTier, host: HostTier, block_size: int
) -> None:
    """Raise AssertionError unless the tables and both tiers agree (O(all blocks)).

    No table lists a block twice; every device refcount equals the number of tables holding
    the block and the device tier's own accounting holds (`DeviceTier.check_integrity`);
    host blocks have exactly one owner; each state's committed blocks form a root path of
    the prefix index and its tables fit its num_computed.
    """
    holders: Counter[int] = Counter()
    for req_id, state in states.items():
        integrity_check(
            len(set(state.blocks)) == len(state.blocks), f"{req_id!r}: block listed twice"
        )
        holders.update(state.blocks)
    device.check_integrity(holders)
    host.check_integrity()
    _check_host_refs(states, host)
    for req_id, state in states.items():
        _check_request(req_id, state, device, block_size)


def _check_host_refs(states: Mapping[ReqId, ReqState], host: HostTier) -> None:
    holders: Counter[int] = Counter()
    for state in states.values():
        holders.update(state.host_blocks or ())
    for block_id in range(host.num_blocks):
        refs = host.refcount(block_id)
        integrity_check(
            refs == holders[block_id],
            f"host block {block_id}: refcount {refs}, {holders[block_id]} owners",
        )
    integrity_check(host.num_free + host.num_used == host.num_blocks, "host free + used != total")


def _check_request(req_id: ReqId, state: ReqState, device: DeviceTier, bs: int) -> None:
    if state.host_blocks is not None:
        integrity_check(not state.blocks, f"{req_id!r}: swapped but holds device blocks")
        integrity_check(
            len(state.host_blocks) == -(-state.num_computed // bs),
            f"{req_id!r}: host copy does not match num_computed",
        )
        return
    integrity_check(
        state.num_computed <= len(state.blocks) * bs, f"{req_id!r}: computed beyond table"
    )
    integrity_check(
        state.num_committed * bs <= state.num_computed,
        f"{req_id!r}: committed blocks beyond num_computed",
    )
    parent: int | None = None
    for block_id in state.blocks[: state.num_committed]:
        integrity_check(
            device.is_indexed(block_id), f"{req_id!r}: committed block {block_id} not indexed"
        )
        integrity_check(
            device.parent_block(block_id) == parent,
            f"{req_id!r}: committed blocks are not a path of the index",
        )
        parent = block_id
