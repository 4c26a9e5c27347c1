"""RadixPrefixIndex: full-block matching, duplicate detection, LRU eviction, delete, and the
events it records for the front end's global prompt tree."""

from __future__ import annotations

import pytest

from pdserve.kv.block_hash import block_hashes
from pdserve.kv.radix import CacheEvents, RadixPrefixIndex

BS = 2


def always(_: int) -> bool:
    return True


def make() -> RadixPrefixIndex:
    return RadixPrefixIndex(BS)


def test_match_walks_full_blocks_only() -> None:
    index = make()
    assert index.match([1, 2, 3]) == []
    assert index.insert([1, 2, 3, 4, 5], [10, 11]) == [10, 11]
    assert index.match([1, 2, 3, 4, 5, 6]) == [10, 11]
    assert index.match([1, 2, 3]) == [10]  # [3] is a partial block
    assert index.match([1, 2, 9, 9]) == [10]
    assert index.match([2, 1]) == []
    assert index.match([]) == []
    assert index.match([1, 2, 3, 4], max_blocks=1) == [10]
    assert index.match([1, 2, 3, 4], max_blocks=0) == []
    assert len(index) == 2
    index.check_integrity(always)


def test_insert_keeps_the_block_already_indexed() -> None:
    index = make()
    assert index.insert([1, 2, 3, 4], [10, 11]) == [10, 11]
    # Same first two blocks computed again into 20, 21: the index keeps 10, 11.
    assert index.insert([1, 2, 3, 4, 5, 6], [20, 21, 22]) == [10, 11, 22]
    assert sorted(index.block_ids()) == [10, 11, 22]
    assert 20 not in index
    assert index.parent_block(22) == 11
    assert index.parent_block(10) is None
    assert index.match([1, 2, 3, 4, 5, 6]) == [10, 11, 22]
    index.check_integrity(always)


def test_insert_range_starts_below_an_indexed_block() -> None:
    index = make()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert index.insert(tokens, [10, 11, 12, 13], 0, 1) == [10]
    assert index.insert(tokens, [10, 11, 12, 13], 1, 3) == [11, 12]
    assert index.insert(tokens, [10, 11, 12, 13], 3) == [13]
    assert index.insert(tokens, [10, 11, 12, 13], 4) == []
    assert index.match(tokens) == [10, 11, 12, 13]
    assert [index.parent_block(b) for b in (11, 12, 13)] == [10, 11, 12]
    index.check_integrity(always)


def test_insert_errors_change_nothing() -> None:
    index = make()
    assert index.insert([1, 2], [10]) == [10]
    with pytest.raises(ValueError, match="3 tokens do not fill 2 blocks of 2"):
        index.insert([1, 2, 3], [10, 11])
    with pytest.raises(ValueError, match="block 10 is already indexed under another prefix"):
        index.insert([5, 6, 7, 8], [11, 10])
    with pytest.raises(ValueError, match="listed twice"):
        index.insert([5, 6, 7, 8], [12, 12])
    with pytest.raises(ValueError, match="bad block range"):
        index.insert([1, 2, 3, 4], [10, 11], 2, 1)
    with pytest.raises(ValueError, match="block 99 is not in the prefix index"):
        index.insert([1, 2, 3, 4], [99, 11], 1)
    assert sorted(index.block_ids()) == [10]
    assert index.match([5, 6, 7, 8]) == []
    with pytest.raises(ValueError, match="block 7 is not in the prefix index"):
        index.touch(7)
    index.check_integrity(always)


def test_evict_oldest_leaf_first_and_parent_after_children() -> None:
    index = make()
    assert index.insert([1, 2, 3, 4], [0, 1]) == [0, 1]  # t1: 0 and 1
    assert index.insert([7, 8], [3]) == [3]  # t2
    index.touch(1)  # t3: only the leaf; its parent 0 keeps t1, the oldest time
    assert index.evict(1, always) == [3]  # 0 is older but has a child
    assert index.evict(1, always) == [1]
    assert index.evict(1, always) == [0]  # exposed as a leaf by evicting 1
    assert index.evict(1, always) == []
    assert len(index) == 0
    index.check_integrity(always)


def test_match_refreshes_lru_order() -> None:
    index = make()
    assert index.insert([1, 2], [0]) == [0]
    assert index.insert([3, 4], [1]) == [1]
    assert index.insert([5, 6], [2]) == [2]
    assert index.match([1, 2, 9]) == [0]  # 0 becomes the newest
    assert index.evict(2, always) == [1, 2]
    assert index.evict(5, always) == [0]
    index.check_integrity(always)


def test_rejected_leaf_waits_for_touch() -> None:
    index = make()
    assert index.insert([1, 2], [0]) == [0]
    assert index.insert([3, 4], [1]) == [1]
    pinned = {0}

    def unpinned(block_id: int) -> bool:
        return block_id not in pinned

    assert index.evict(2, unpinned) == [1]
    index.check_integrity(unpinned)
    pinned.clear()
    # The owner forgot to touch 0 when it became evictable: the check says so.
    with pytest.raises(AssertionError, match="evictable leaf block 0 has no LRU entry"):
        index.check_integrity(always)
    assert index.evict(1, always) == []
    index.touch(0)
    index.check_integrity(always)
    assert index.evict(1, always) == [0]
    index.check_integrity(always)


def test_delete_removes_only_the_unshared_tail() -> None:
    index = make()
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 3, 4, 7, 8]
    assert index.insert(a, [0, 1, 2]) == [0, 1, 2]
    assert index.insert(b, [0, 1, 3]) == [0, 1, 3]
    assert index.delete(a) == [2]
    assert index.match(a) == [0, 1]
    assert index.delete([1, 2, 3, 4]) == []  # 1 still leads to 3
    assert index.delete([9, 9]) == []
    assert index.delete([*b, 9]) == [3, 1, 0]
    assert len(index) == 0
    assert index.evict(3, always) == []  # stale LRU entries of deleted nodes are ignored
    index.check_integrity(always)


def test_lru_heap_stays_bounded_under_repeated_matches() -> None:
    index = make()
    assert index.insert([1, 2, 3, 4], [0, 1]) == [0, 1]
    for _ in range(1000):
        assert index.match([1, 2, 3, 4]) == [0, 1]
    assert len(index._heap) <= 2 * len(index) + 64 + 1
    assert index.evict(2, always) == [1, 0]
    index.check_integrity(always)


# -- events ------------------------------------------------------------------------------------

NO_EVENTS = CacheEvents(stored=[], removed=[])


def test_events_off_by_default_record_nothing() -> None:
    index = make()
    assert index.insert([1, 2, 3, 4], [0, 1]) == [0, 1]
    assert index.evict(1, always) == [1]
    assert index.take_events() == NO_EVENTS
    assert index._events is None


def test_events_are_the_net_change_per_hash() -> None:
    index = make()
    index.record_events()
    h = block_hashes([1, 2, 3, 4, 5, 6], BS)
    assert index.insert([1, 2, 3, 4, 5, 6], [0, 1, 2]) == [0, 1, 2]
    assert index.evict(1, always) == [2]  # stored, then removed: only removed
    assert index.take_events() == CacheEvents(stored=h[:2], removed=[h[2]])
    assert index.take_events() == NO_EVENTS
    assert index.evict(2, always) == [1, 0]
    assert index.insert([1, 2, 3, 4], [5, 6]) == [5, 6]  # removed, then stored: only stored
    assert index.take_events() == CacheEvents(stored=h[:2], removed=[])
    index.check_integrity(always)


def test_event_order_is_parent_first_when_stored_child_first_when_removed() -> None:
    index = make()
    index.record_events()
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 7, 8]
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert index.insert(b, [0, 3]) == [0, 3]
    assert index.insert(a, [0, 1, 2]) == [0, 1, 2]
    assert index.take_events() == CacheEvents(stored=[*hb, ha[1], ha[2]], removed=[])
    assert index.delete(a) == [2, 1]
    assert index.delete(b) == [3, 0]
    assert index.take_events() == CacheEvents(stored=[], removed=[ha[2], ha[1], hb[1], hb[0]])
    index.check_integrity(always)


def test_turning_events_on_reports_the_index_as_stored() -> None:
    index = make()
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 7, 8]
    assert index.insert(a, [0, 1, 2]) == [0, 1, 2]
    assert index.insert(b, [0, 3]) == [0, 3]
    index.record_events()
    index.check_integrity(always)  # every node now carries its hash
    stored = index.take_events().stored
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert sorted(stored) == sorted([*ha, hb[1]])
    assert stored[0] == ha[0]  # every parent before its children
    assert stored.index(ha[1]) < stored.index(ha[2])
    index.record_events()  # already on: nothing new
    assert index.take_events() == NO_EVENTS
    assert index.evict(1, always) == [2]
    index.record_events(False)  # drops the pending "removed"
    assert index.insert([9, 9], [7]) == [7]
    assert index.take_events() == NO_EVENTS
    index.check_integrity(always)
