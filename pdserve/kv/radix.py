"""`RadixPrefixIndex`: a radix tree over full KV blocks, for prefix caching.

Every edge is one *full* block of token ids (a tuple of `block_size` ints) and every node holds
the id of the device block whose KV those tokens produced, under exactly that prefix. Partially
filled blocks are never indexed. The index knows nothing about reference counts: the owner (the
KV manager) passes an `evictable` predicate to `evict` and keeps the pool consistent with what
`insert`, `evict` and `delete` report.

Contract, per method (all O(blocks walked); nothing scans the whole tree except
`check_integrity` and an occasional, amortised heap rebuild):

- `match(tokens, max_blocks)`  mutates only LRU times of the matched path.
- `insert(tokens, block_ids, start, end)`  adds nodes; where a node for the same prefix already
  exists, *its* block id is returned and the caller must release its own duplicate block.
- `evict(n, evictable)`  removes up to `n` leaves, least recently used first, and returns their
  block ids; the caller returns them to the free list. Removing a leaf may make its parent a
  leaf, which then competes by its own last-access time.
- `touch(block_id)`  marks a node used now. The owner MUST call it when an indexed block's
  refcount drops to 0: `evict` forgets leaves that `evictable` rejects (so it never rescans
  blocks that running requests hold), and `touch` is what offers such a leaf again.
- `delete(tokens)`  removes the part of `tokens`' path that no other prefix shares.
- `record_events(on)` / `take_events()`  while on, every node knows its prefix's chained hash
  h (`kv/block_hash.py`, computed when the node is added), every node added is recorded as
  "stored h" and every node removed (evict, delete) as "removed h"; `take_events` returns the
  *net* change since the previous take (per hash only its last event counts) and clears it.
  Turning it on hashes and records every node already indexed as stored (O(tree), once), so the
  first take is a complete picture. Off by default, and then nothing is hashed or recorded: a
  lone engine pays nothing (hashing costs ~0.35 us per added node) and, never draining, grows
  nothing. The front end's global prompt tree replays these events (`cluster/prompt_tree.py`).

Additions to kv/SPEC.md: `match(..., max_blocks)`, `insert(..., start, end)` (O(new blocks)
commits), `touch`, `parent_block` (for integrity checks), and the event recording.

LRU bookkeeping is a heap of (last_access, seq, node) with lazy invalidation: an entry is live
only if its node is still in the tree, is a leaf, and was not touched since the push.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from pdserve.kv.block_hash import ROOT_HASH, chain_hash
from pdserve.kv.block_pool import integrity_check

_ROOT_BLOCK = -1
# Rebuild the heap once stale entries outnumber live nodes by this factor (+ slack).
_HEAP_SLACK_FACTOR = 2
_HEAP_SLACK_MIN = 64


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple[int, ...]
    block_id: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_access: int = 0
    alive: bool = True
    hash: int | None = None  # chained hash of the prefix ending here; set while recording


_HeapEntry = tuple[int, int, _Node]


@dataclass(frozen=True, slots=True)
class CacheEvents:
    """Net change of a prefix index since the previous take: chained block hashes now indexed
    (`stored`) and no longer indexed (`removed`), each in the order of its hash's last event
    (so a stored parent precedes its stored children, a removed child its removed parent).
    A hash is in at most one of the two lists."""

    stored: list[int]
    removed: list[int]


class RadixPrefixIndex:
    """Block-granular radix tree mapping token prefixes to device block ids. Not thread-safe."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        self._block_size = block_size
        self._root = _Node(key=(), block_id=_ROOT_BLOCK, parent=None, hash=ROOT_HASH)
        self._nodes: dict[int, _Node] = {}
        self._heap: list[_HeapEntry] = []
        self._clock = 0
        self._seq = itertools.count()
        # hash -> stored (True) / removed (False), in the order of each hash's last event;
        # None while recording is off.
        self._events: dict[int, bool] | None = None

    @property
    def block_size(self) -> int:
        return self._block_size

    def __len__(self) -> int:
        """Number of indexed blocks."""
        return len(self._nodes)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._nodes

    def block_ids(self) -> Iterator[int]:
        """Indexed block ids, in no particular order."""
        return iter(self._nodes)

    def parent_block(self, block_id: int) -> int | None:
        """Block id of the parent node of an indexed block; None if it hangs off the root."""
        parent = self._node(block_id).parent
        return None if parent is None or parent is self._root else parent.block_id

    def match(self, tokens: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """Block ids of the longest indexed full-block prefix of `tokens` (at most `max_blocks`).

        Touches the matched path (LRU). Does not take references: the caller must incref the
        returned blocks before anything can evict them.
        """
        limit = len(tokens) // self._block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        path = self._walk(tokens, self._root, 0, limit)
        self._stamp(path)
        return [node.block_id for node in path]

    def insert(
        self,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        start: int = 0,
        end: int | None = None,
    ) -> list[int]:
        """Index blocks `block_ids[start:end]` (block i holds tokens[i*bs:(i+1)*bs]).

        Returns, for each of those blocks, the block id the index holds for it afterwards: the
        caller's block if it was new, or the block already indexed under the same prefix (the
        existing block wins; the caller must switch to it and release its duplicate). With
        `start > 0`, `block_ids[start - 1]` must already be the indexed node of block
        `start - 1` of `tokens` (not re-verified), so the walk costs O(end - start), not
        O(end). All or nothing: raises ValueError, changing nothing, if `tokens` is too short
        or a block that would be added is already indexed (or listed twice).
        """
        end = len(block_ids) if end is None else end
        if not 0 <= start <= end <= len(block_ids):
            raise ValueError(f"bad block range [{start}, {end}) of {len(block_ids)} blocks")
        if end * self._block_size > len(tokens):
            raise ValueError(f"{len(tokens)} tokens do not fill {end} blocks of {self._block_size}")
        node = self._root if start == 0 else self._node(block_ids[start - 1])
        path = self._walk(tokens, node, start, end)
        first_new = start + len(path)
        self._check_new_blocks(block_ids[first_new:end])
        node = path[-1] if path else node
        for i in range(first_new, end):
            node = self._add_child(node, i, self._key(tokens, i), block_ids[i])
            path.append(node)
        self._stamp(path)
        return [node.block_id for node in path]

    def touch(self, block_id: int) -> None:
        """Mark an indexed block as used now; if it is a leaf, make it an eviction candidate."""
        node = self._node(block_id)
        node.last_access = self._tick()
        self._offer(node)

    def evict(self, n: int, evictable: Callable[[int], bool]) -> list[int]:
        """Remove up to `n` leaves whose block passes `evictable`, least recently used first.

        Returns the removed block ids in eviction order; the caller frees them. A leaf rejected
        by `evictable` is dropped from the candidates until the next `touch` of its block.
        """
        evicted: list[int] = []
        while len(evicted) < n and self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if not self._is_live(node, last_access) or not evictable(node.block_id):
                continue
            self._remove_leaf(node)
            evicted.append(node.block_id)
        return evicted

    def delete(self, tokens: Sequence[int]) -> list[int]:
        """Remove the nodes of `tokens`' indexed path that no other indexed prefix goes through.

        Walks the longest indexed full-block prefix of `tokens`, then removes nodes from its end
        towards the root while they are leaves. Returns the removed block ids, deepest first;
        the caller frees those nobody references. Does not check references.
        """
        path = self._walk(tokens, self._root, 0, len(tokens) // self._block_size)
        node = path[-1] if path else self._root
        removed: list[int] = []
        while node is not self._root and not node.children:
            parent = node.parent
            self._remove_leaf(node)
            removed.append(node.block_id)
            assert parent is not None  # only the root has no parent
            node = parent
        return removed

    def record_events(self, on: bool = True) -> None:
        """Start (hashing and recording every node already indexed as stored) or stop
        recording; stopping drops what was not taken. Starting while on changes nothing."""
        if not on:
            self._events = None
        elif self._events is None:
            self._events = dict.fromkeys(self._hash_all(), True)

    def take_events(self) -> CacheEvents:
        """The net events since the previous take (empty while off), and clear them."""
        events = self._events
        if not events:
            return CacheEvents(stored=[], removed=[])
        self._events = {}
        return CacheEvents(
            stored=[h for h, stored in events.items() if stored],
            removed=[h for h, stored in events.items() if not stored],
        )

    def check_integrity(self, evictable: Callable[[int], bool] | None = None) -> None:
        """Raise AssertionError unless the tree, the block map and the LRU heap agree.

        With `evictable`, also checks that every leaf it accepts is a live eviction candidate
        (the invariant that `touch` maintains).
        """
        seen = self._check_tree()
        integrity_check(
            seen == len(self._nodes), f"{seen} nodes in tree, {len(self._nodes)} in block map"
        )
        if evictable is None:
            return
        live = {id(node) for t, _, node in self._heap if self._is_live(node, t)}
        for node in self._nodes.values():
            if not node.children and evictable(node.block_id):
                integrity_check(
                    id(node) in live, f"evictable leaf block {node.block_id} has no LRU entry"
                )

    # -- internals ---------------------------------------------------------------------------

    def _key(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        bs = self._block_size
        return tuple(tokens[i * bs : (i + 1) * bs])

    def _walk(self, tokens: Sequence[int], node: _Node, first: int, stop: int) -> list[_Node]:
        """Existing nodes of blocks first..stop-1 of `tokens` below `node`, up to the first miss."""
        path: list[_Node] = []
        for i in range(first, stop):
            child = node.children.get(self._key(tokens, i))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _stamp(self, path: list[_Node]) -> None:
        """Mark a downward path used now (one tick); only its last node can be a leaf."""
        if not path:
            return
        now = self._tick()
        for node in path:
            node.last_access = now
        self._offer(path[-1])

    def _check_new_blocks(self, block_ids: Sequence[int]) -> None:
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids listed twice in {list(block_ids)}")
        for block_id in block_ids:
            if block_id in self._nodes:
                raise ValueError(f"block {block_id} is already indexed under another prefix")

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _node(self, block_id: int) -> _Node:
        node = self._nodes.get(block_id)
        if node is None:
            raise ValueError(f"block {block_id} is not in the prefix index")
        return node

    def _add_child(
        self, parent: _Node, position: int, key: tuple[int, ...], block_id: int
    ) -> _Node:
        """Add block number `position` (0-based) below `parent`."""
        child = _Node(key=key, block_id=block_id, parent=parent)
        parent.children[key] = child
        self._nodes[block_id] = child
        if self._events is not None:
            child.hash = self._chain(parent, position, key)
            self._record(child.hash, True)
        return child

    def _remove_leaf(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key]
        del self._nodes[node.block_id]
        node.alive = False
        if self._events is not None:
            assert node.hash is not None  # every node is hashed while recording
            self._record(node.hash, False)
        self._offer(parent)

    def _record(self, block_hash: int, stored: bool) -> None:
        """Note a node added (stored) or removed; only called while recording."""
        assert self._events is not None
        # Re-insert so that the dict's order is the order of each hash's last event.
        self._events.pop(block_hash, None)
        self._events[block_hash] = stored

    def _hash_all(self) -> Iterator[int]:
        """Set every node's hash; yields them, every parent's before its children's."""
        stack = [(child, 0) for child in self._root.children.values()]
        while stack:
            node, position = stack.pop()
            assert node.parent is not None
            node.hash = self._chain(node.parent, position, node.key)
            yield node.hash
            stack.extend((child, position + 1) for child in node.children.values())

    @staticmethod
    def _chain(parent: _Node, position: int, key: tuple[int, ...]) -> int:
        assert parent.hash is not None  # the root's is ROOT_HASH, the others' set in preorder
        return chain_hash(parent.hash, position, key)

    def _is_live(self, node: _Node, last_access: int) -> bool:
        return node.alive and not node.children and node.last_access == last_access

    def _offer(self, node: _Node) -> None:
        """Push an LRU entry for `node` if it is a (non-root) leaf."""
        if node is self._root or node.children:
            return
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > _HEAP_SLACK_FACTOR * len(self._nodes) + _HEAP_SLACK_MIN:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries: one fresh entry per current leaf (amortised O(1) per push)."""
        self._heap = [
            (node.last_access, next(self._seq), node)
            for node in self._nodes.values()
            if not node.children
        ]
        heapq.heapify(self._heap)

    def _check_hash(self, parent: _Node, child: _Node, position: int) -> None:
        """A node's hash, where known, chains from its parent's; while recording it is known."""
        if child.hash is None:
            integrity_check(self._events is None, f"block {child.block_id}: recording, no hash")
        else:
            integrity_check(
                parent.hash is not None
                and child.hash == chain_hash(parent.hash, position, child.key),
                f"block {child.block_id}: hash does not chain from its parent's",
            )

    def _check_tree(self) -> int:
        """Walk the tree checking links; returns the number of non-root nodes."""
        count = 0
        stack = [(self._root, 0)]  # (node, position of its children's blocks)
        while stack:
            node, position = stack.pop()
            for key, child in node.children.items():
                integrity_check(child.parent is node, f"block {child.block_id}: bad parent link")
                integrity_check(child.key == key, f"block {child.block_id}: key mismatch")
                integrity_check(len(key) == self._block_size, "edge is not one full block")
                integrity_check(child.alive, f"block {child.block_id}: dead node in tree")
                self._check_hash(node, child, position)
                integrity_check(
                    self._nodes.get(child.block_id) is child,
                    f"block {child.block_id}: block map disagrees with tree",
                )
                count += 1
                stack.append((child, position + 1))
        return count
