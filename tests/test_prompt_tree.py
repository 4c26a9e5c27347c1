"""Global prompt tree: chained block hashes, match per instance, TTL, LRU cap, instance drop,
and the whole loop from a real `KVManager`'s prefix-index events to the front end's tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.cluster.prompt_tree import PromptTree
from pdserve.kv import KVCacheConfig, KVManager
from pdserve.kv.block_hash import ROOT_HASH, block_hashes, chain_hash
from pdserve.kv.radix import CacheEvents, RadixPrefixIndex

BS = 4
TTL = 10.0


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def tree(max_entries: int = 1000) -> PromptTree:
    return PromptTree(block_size=BS, ttl_s=TTL, max_entries=max_entries)


def paths(*prompts: list[int]) -> list[list[int]]:
    return [block_hashes(p, BS) for p in prompts]


def entries(t: PromptTree) -> int:
    """The entry count, checked against the per-instance maps it summarises."""
    assert t.num_entries == sum(t.entries_by_instance().values())
    return t.num_entries


# -- block hashes ------------------------------------------------------------------------------


def test_block_hashes_chain_full_blocks_only() -> None:
    tokens = toks(14)
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 3  # the 2 trailing tokens are a partial block
    assert hashes == block_hashes(tokens[:12], BS)
    assert block_hashes(tokens, BS, num_blocks=2) == hashes[:2]
    assert block_hashes(tokens, BS, num_blocks=0) == []
    assert block_hashes(tokens[:3], BS) == []
    parent = ROOT_HASH
    for i, h in enumerate(hashes):
        assert h == chain_hash(parent, i, tuple(tokens[i * BS : (i + 1) * BS]))
        parent = h
    assert all(-(2**63) <= h < 2**63 for h in hashes)  # msgspec's int64
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_hashes(tokens, 0)


def test_a_hash_names_the_whole_prefix() -> None:
    a = toks(8)
    swapped = a[4:] + a[:4]  # same blocks, other order
    diverged = a[:4] + toks(4, 900)
    ha, hs, hd = paths(a, swapped, diverged)
    assert hd[0] == ha[0] and hd[1] != ha[1]
    assert hs[1] != ha[1]
    assert block_hashes(a[4:], BS)[0] != ha[1]  # block 1's tokens alone are another prefix
    assert len(set(block_hashes(toks(4000), BS))) == 1000


def test_block_hashes_are_the_same_in_another_process() -> None:
    tokens = toks(64, 31_000)
    code = (
        "import json, sys\n"
        "from pdserve.kv.block_hash import block_hashes\n"
        "print(json.dumps(block_hashes(json.loads(sys.argv[1]), 4)))\n"
    )
    # A different str/bytes hash seed than this process's: the hash must not depend on it.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(tokens)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == block_hashes(tokens, 4)


def test_radix_nodes_carry_the_same_hashes() -> None:
    index = RadixPrefixIndex(BS)
    index.record_events()
    a, b = toks(12), toks(8) + toks(8, 500)
    index.insert(a, [0, 1, 2])
    index.insert(b, [0, 1, 3, 4])
    index.check_integrity()
    ha, hb = paths(a, b)
    assert index.take_events() == CacheEvents(stored=ha + hb[2:], removed=[])


# -- match -------------------------------------------------------------------------------------


def test_match_counts_leading_blocks_per_instance() -> None:
    t = tree()
    system = toks(8)
    a, b, c = system + toks(8, 200), system + toks(8, 300), toks(12, 900)
    ha, hb, hc = paths(a, b, c)
    t.apply("p0", ha, [], now=0.0)
    t.apply("p1", hb, [], now=0.0)
    t.apply("p1", hc[:2], [], now=0.0)
    assert t.match(ha, now=1.0) == {"p0": 4, "p1": 2}
    assert t.match(hb, now=1.0) == {"p0": 2, "p1": 4}
    assert t.match(hc, now=1.0) == {"p1": 2}
    assert t.match(block_hashes(a + toks(8, 700), BS), now=1.0) == {"p0": 4, "p1": 2}
    assert t.match(block_hashes(toks(8, 5000), BS), now=1.0) == {}
    assert t.match([], now=1.0) == {}
    t.apply("p2", ha[1:], [], now=0.0)  # not from block 0: matches nothing
    assert t.match(ha, now=1.0) == {"p0": 4, "p1": 2}
    assert entries(t) == 4 + 4 + 2 + 3
    assert t.entries_by_instance() == {"p0": 4, "p1": 6, "p2": 3}


def test_removed_events_forget_entries() -> None:
    t = tree()
    (ha,) = paths(toks(16))
    t.apply("p0", ha, [], now=0.0)
    t.apply("p0", [], ha[:1:-1], now=1.0)  # evicted leaf first, as the instance reports
    assert t.match(ha, now=1.0) == {"p0": 2}
    t.apply("p0", [], [ha[0]], now=1.0)
    assert t.match(ha, now=1.0) == {}  # ha[1] is still held but not reachable from block 0
    assert entries(t) == 1
    t.apply("p0", [], [12345], now=1.0)  # never held: nothing to forget
    assert entries(t) == 1


# -- TTL ---------------------------------------------------------------------------------------


def test_entries_expire_ttl_after_their_last_refresh() -> None:
    t = tree()
    a, b = toks(12), toks(8) + toks(4, 500)
    ha, hb = paths(a, b)
    t.apply("p0", ha, [], now=0.0)
    t.apply("p1", hb, [], now=2.0)
    assert t.match(ha, now=9.5) == {"p0": 3, "p1": 2}
    assert t.match(ha, now=10.0) == {"p1": 2}  # expired at 0 + TTL, even before expire()
    t.touch("p1", hb[:1], now=5.0)
    t.apply("p1", [hb[2]], [], now=6.0)  # stored again: refreshed
    assert t.expire(now=10.0) == 3  # p0's
    assert t.expired_total == 3
    assert entries(t) == 3
    assert t.match(hb, now=12.5) == {"p1": 1}  # hb[1] expired at 12; hb[2] is cut off
    assert t.expire(now=12.5) == 1
    assert t.match(hb, now=15.0) == {}
    assert t.expire(now=15.0) == 1
    assert t.expire(now=16.0) == 1
    assert (entries(t), t.expired_total) == (0, 6)


def test_touch_refreshes_only_the_entries_held() -> None:
    t = tree()
    (ha,) = paths(toks(12))
    t.apply("p0", ha[:2], [], now=0.0)
    t.touch("p0", ha, now=5.0)
    t.touch("p9", ha, now=5.0)  # unknown instance: nothing happens
    assert t.entries_by_instance() == {"p0": 2}
    assert t.match(ha, now=14.0) == {"p0": 2}
    assert t.expire(now=15.0) == 2


# -- bounds ------------------------------------------------------------------------------------


def test_cap_evicts_least_recently_refreshed_deepest_first() -> None:
    t = tree(max_entries=5)
    a, b = toks(12), toks(12, 500)
    ha, hb = paths(a, b)
    t.apply("p0", ha, [], now=0.0)
    t.apply("p1", hb, [], now=1.0)  # 6 entries: p0's oldest goes, its deepest block
    assert t.match(ha, now=2.0) == {"p0": 2}
    assert (entries(t), t.evicted_total) == (5, 1)
    t.touch("p0", ha, now=2.0)  # p0's path is now newer than p1's
    t.apply("p2", paths(toks(8, 900))[0], [], now=3.0)
    assert t.match(hb, now=3.0) == {"p1": 1}
    assert t.match(ha, now=3.0) == {"p0": 2}
    assert (entries(t), t.evicted_total) == (5, 3)
    assert t.approx_bytes > 0


def test_drop_instance_removes_all_its_entries() -> None:
    t = tree()
    (ha,) = paths(toks(12))
    t.apply("p0", ha, [], now=0.0)
    t.apply("p1", ha[:2], [], now=0.0)
    assert t.drop_instance("p0") == 3
    assert t.drop_instance("p0") == 0
    assert t.match(ha, now=1.0) == {"p1": 2}
    assert entries(t) == 2
    assert t.expire(now=100.0) == 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        PromptTree(block_size=0, ttl_s=1.0, max_entries=1)
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        PromptTree(block_size=4, ttl_s=0.0, max_entries=1)
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        PromptTree(block_size=4, ttl_s=1.0, max_entries=0)


# -- from a real KVManager's events to the tree ------------------------------------------------


def run(m: KVManager, req: str, tokens: list[int]) -> None:
    """Allocate and commit the whole prompt of req, as if its prefill ran."""
    alloc = m.allocate(req, tokens, len(tokens) - m.match_prefix(tokens).num_cached_tokens)
    assert alloc is not None
    m.commit(req, tokens, len(tokens))


def cached_blocks(m: KVManager, t: PromptTree, prompt: list[int], now: float) -> int:
    """Blocks of `prompt` the tree says instance "p0" holds, checked against the manager's
    own match (which leaves the last token uncached, hence num_blocks)."""
    hashes = block_hashes(prompt, BS, num_blocks=(len(prompt) - 1) // BS)
    blocks = t.match(hashes, now).get("p0", 0)
    assert blocks * BS == m.match_prefix(prompt).num_cached_tokens
    return blocks


def test_manager_events_keep_the_tree_equal_to_the_local_index() -> None:
    m = KVManager(KVCacheConfig(block_size=BS, num_blocks=8))
    m.record_cache_events()
    t = tree()
    a = toks(12)
    b = a[:8] + toks(8, 500)
    c = toks(24, 900)
    ha, hb, hc = paths(a, b, c)

    run(m, "a", a)
    m.free("a")
    run(m, "b", b)  # reuses a's first 2 blocks
    m.free("b")
    events = m.take_cache_events()
    assert events == CacheEvents(stored=ha + hb[2:], removed=[])
    t.apply("p0", events.stored, events.removed, now=0.0)
    assert [cached_blocks(m, t, [*p, 1], 1.0) for p in (a, b, a[:8], c)] == [3, 4, 2, 0]

    # c needs 6 blocks: 3 free, and 3 evicted (LRU leaves: a's last, then b's two).
    run(m, "c", c)
    m.check_integrity()
    events = m.take_cache_events()
    assert events == CacheEvents(stored=hc, removed=[ha[2], hb[3], hb[2]])
    t.apply("p0", events.stored, events.removed, now=2.0)
    assert [cached_blocks(m, t, [*p, 1], 3.0) for p in (a, b, c)] == [2, 2, 6]
    assert entries(t) == 2 + 6
    assert m.take_cache_events() == CacheEvents(stored=[], removed=[])


def test_manager_without_prefix_cache_has_no_events() -> None:
    m = KVManager(KVCacheConfig(block_size=BS, num_blocks=8, enable_prefix_cache=False))
    m.record_cache_events()
    run(m, "a", toks(12))
    assert m.take_cache_events() == CacheEvents(stored=[], removed=[])


def test_an_instance_moves_to_another_tree_with_its_expiries_and_the_cap() -> None:
    """Instance flip: what an instance holds moves to its new role's tree, expiries and
    LRU order kept, the counts exact on both sides; the new tree's cap still holds."""
    old, new = PromptTree(16, 10.0, 100), PromptTree(16, 10.0, 4)
    old.apply("d1", [1, 2, 3], [], now=0.0)
    old.apply("d1", [7], [], now=5.0)
    old.apply("d0", [1, 2], [], now=0.0)
    new.apply("p0", [1], [], now=1.0)
    assert old.move_instance("d1", new) == 4
    assert (old.num_entries, new.num_entries) == (2, 4)  # 5 entries over a cap of 4
    # The least recently refreshed entry went: d1's deepest of its t=0 path (p0's is t=1).
    assert new.evicted_total == 1 and new.entries_by_instance() == {"p0": 1, "d1": 3}
    assert old.entries_by_instance() == {"d0": 2}
    assert new.match([1, 2, 3], now=9.0) == {"p0": 1, "d1": 2}
    assert new.match([7], now=14.0) == {"d1": 1}  # its t=5 expiry came along
    assert new.match([1], now=10.5) == {"p0": 1}  # d1's t=0 entries expired at 10
    assert old.move_instance("d1", new) == 0  # nothing left to move
