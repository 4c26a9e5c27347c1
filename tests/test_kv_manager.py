"""KVManager: exact block ids and counts for allocation, prefix sharing, eviction and swapping.

Every scenario ends with `check_integrity()`. Block size is 4 throughout; the pool hands out
free blocks FIFO (initially 0, 1, 2, ...), freed blocks go to the back of the free list.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from pdserve.errors import PdserveError
from pdserve.kv import (
    Allocation,
    KVCacheConfig,
    KVManager,
    OutOfBlocksError,
    PrefixMatch,
    RequestStateError,
    SwapPlan,
    UnknownRequestError,
)

BS = 4


def manager(num_blocks: int = 8, num_host_blocks: int = 0, prefix: bool = True) -> KVManager:
    cfg = KVCacheConfig(
        block_size=BS,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        enable_prefix_cache=prefix,
    )
    return KVManager(cfg)


def counts(m: KVManager) -> tuple[int, int, int]:
    """(free, used, cached) device blocks."""
    return m.num_free_blocks, m.num_used_blocks, m.num_cached_blocks


def refs(m: KVManager, *blocks: int) -> list[int]:
    return [m._device.refcount(b) for b in blocks]


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def run(m: KVManager, req: str, tokens: list[int], num_new: int) -> Allocation:
    """Allocate `num_new` tokens for req, then commit them as if the runner computed them."""
    alloc = m.allocate(req, tokens, num_new)
    assert alloc is not None
    m.commit(req, tokens, m.num_computed_tokens(req) + num_new)
    return alloc


# -- allocation and growth --------------------------------------------------------------------


def test_fresh_allocation_and_growth_across_block_boundaries() -> None:
    m = manager()
    prompt = toks(10)
    assert m.allocate("a", prompt, 10) == Allocation(num_cached_tokens=0, num_new_blocks=3)
    assert m.block_table("a") == [0, 1, 2]
    assert m.num_computed_tokens("a") == 0
    assert counts(m) == (5, 3, 0)
    assert m.usage == 3 / 8
    m.commit("a", prompt, 10)
    assert m.num_computed_tokens("a") == 10
    assert sorted(m._device.indexed_blocks()) == [0, 1]
    tokens = [*prompt, 7]
    assert m.allocate("a", tokens, 1) == Allocation(0, 0)  # token 11 fits in block 2
    m.commit("a", tokens, 11)
    tokens = [*tokens, 8]
    assert m.allocate("a", tokens, 1) == Allocation(0, 0)  # token 12 fills block 2
    m.commit("a", tokens, 12)
    assert sorted(m._device.indexed_blocks()) == [0, 1, 2]
    tokens = [*tokens, 9]
    assert m.allocate("a", tokens, 1) == Allocation(0, 1)  # token 13 opens block 3
    assert m.block_table("a") == [0, 1, 2, 3]
    assert counts(m) == (4, 4, 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10, 0)
    m.check_integrity()


def test_block_table_is_a_copy() -> None:
    m = manager()
    assert m.allocate("a", toks(5), 5) == Allocation(0, 2)
    table = m.block_table("a")
    table.append(99)
    assert m.block_table("a") == [0, 1]
    m.check_integrity()


# -- prefix sharing ---------------------------------------------------------------------------


def test_prefix_sharing_between_two_requests() -> None:
    m = manager()
    prompt_a = toks(10)
    run(m, "a", prompt_a, 10)  # [0, 1, 2]; blocks 0 and 1 indexed
    prompt_b = [*prompt_a[:8], 50, 51, 52]
    assert m.match_prefix(prompt_b) == PrefixMatch(num_cached_tokens=8)
    assert m.allocate("b", prompt_b, 3) == Allocation(num_cached_tokens=8, num_new_blocks=1)
    assert m.block_table("b") == [0, 1, 3]
    assert m.num_computed_tokens("b") == 8
    assert refs(m, 0, 1, 2, 3) == [2, 2, 1, 1]
    assert counts(m) == (4, 4, 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10 + 11, 8)
    m.free("a")  # block 2 is partial (never indexed): back to the free list
    assert refs(m, 0, 1, 2) == [1, 1, 0]
    assert counts(m) == (5, 3, 0)
    m.free("b")  # 0 and 1 stay cached, 3 is free
    assert counts(m) == (6, 0, 2)
    assert m.match_prefix(prompt_b) == PrefixMatch(8)
    m.check_integrity()


def test_match_is_capped_to_leave_one_token() -> None:
    m = manager()
    prompt = toks(8)
    run(m, "a", prompt, 8)  # blocks 0 and 1 indexed
    m.free("a")
    assert m.match_prefix(prompt) == PrefixMatch(4)  # whole prompt cached: last block redone
    assert m.match_prefix([*prompt, 1]) == PrefixMatch(8)
    assert m.match_prefix(prompt[:7]) == PrefixMatch(4)
    assert m.match_prefix([]) == PrefixMatch(0)
    assert m.allocate("b", prompt, 4) == Allocation(num_cached_tokens=4, num_new_blocks=1)
    assert m.block_table("b") == [0, 2]
    assert counts(m) == (5, 2, 1)  # block 1 stays cached
    m.check_integrity()


def test_commit_with_duplicate_switches_to_indexed_block() -> None:
    m = manager()
    prompt = toks(9)
    # Both requests are scheduled before either computed its prompt: no sharing yet.
    assert m.allocate("a", prompt, 9) == Allocation(0, 3)
    assert m.allocate("b", prompt, 9) == Allocation(0, 3)
    assert (m.block_table("a"), m.block_table("b")) == ([0, 1, 2], [3, 4, 5])
    m.commit("a", prompt, 9)
    m.commit("b", prompt, 9)  # blocks 3, 4 duplicate indexed 0, 1
    assert m.block_table("b") == [0, 1, 5]
    assert refs(m, 0, 1, 2, 3, 4, 5) == [2, 2, 1, 0, 0, 1]
    assert counts(m) == (4, 4, 0)
    assert m.allocate("c", toks(16, start=500), 16) == Allocation(0, 4)
    assert m.block_table("c") == [6, 7, 3, 4]  # the duplicates went to the back of the list
    m.check_integrity()


def test_commit_only_indexes_new_full_blocks() -> None:
    m = manager()
    prompt = toks(14)
    assert m.allocate("a", prompt, 6) == Allocation(0, 2)
    m.commit("a", prompt, 6)
    assert sorted(m._device.indexed_blocks()) == [0]
    assert m.allocate("a", prompt, 8) == Allocation(0, 2)
    m.commit("a", prompt, 14)
    assert sorted(m._device.indexed_blocks()) == [0, 1, 2]
    assert m._reqs["a"].num_committed == 3
    m.commit("a", prompt, 14)  # repeating a commit is a no-op
    assert m.block_table("a") == [0, 1, 2, 3]
    m.check_integrity()


# -- free, cache and eviction -----------------------------------------------------------------


def test_free_leaves_indexed_blocks_cached() -> None:
    m = manager()
    run(m, "a", toks(9), 9)  # [0, 1, 2]: 0 and 1 indexed, 2 partial
    m.free("a")
    assert counts(m) == (6, 0, 2)
    assert refs(m, 0, 1, 2) == [0, 0, 0]
    assert m.usage == 0.0
    m.check_integrity()


def test_lru_eviction_order_and_parent_after_children() -> None:
    m = manager(num_blocks=6)
    prompt_a = toks(9)
    prompt_b = toks(5, start=200)
    run(m, "b", prompt_b, 5)  # [0, 1]; 0 indexed
    run(m, "a", prompt_a, 9)  # [2, 3, 4]; 2, 3 indexed
    m.free("b")  # 0 cached (older)
    m.free("a")  # 2 <- 3 cached (newer)
    assert counts(m) == (3, 0, 3)
    assert m.match_prefix(prompt_a) == PrefixMatch(8)  # touches 2 and 3: newest
    # Needs 5 blocks: 3 free + 2 evicted. LRU leaf 0 first; then leaf 3 (2 is not a leaf).
    assert m.allocate("c", toks(20, start=300), 20) == Allocation(0, 5)
    assert m.block_table("c") == [5, 1, 4, 0, 3]
    assert counts(m) == (0, 5, 1)
    assert m.match_prefix(prompt_a) == PrefixMatch(4)  # block 2 is still cached
    assert m.allocate("d", toks(3, start=400), 3) == Allocation(0, 1)
    assert m.block_table("d") == [2]
    assert counts(m) == (0, 6, 0)
    assert m.match_prefix(prompt_a) == PrefixMatch(0)
    m.check_integrity()


def test_allocation_failure_leaves_state_unchanged() -> None:
    m = manager(num_blocks=4)
    prompt_a = toks(12)
    run(m, "a", prompt_a, 12)  # [0, 1, 2], all indexed
    prompt_b = prompt_a[:8] + toks(10, start=300)
    assert m.allocate("b", prompt_b, 10) is None  # needs 3 new blocks, 1 free
    assert "b" not in m
    assert counts(m) == (1, 3, 0)
    assert refs(m, 0, 1, 2, 3) == [1, 1, 1, 0]
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (12, 0)
    assert m.allocate("a", [*prompt_a, 1, 2, 3, 4, 5], 5) is None  # growth needs 2, 1 free
    assert m.block_table("a") == [0, 1, 2]
    m.free("a")
    assert counts(m) == (1, 0, 3)
    # Matching 0, 1 revives them, so only block 2 could be evicted: 1 + 1 < 3 new blocks.
    prompt_c = prompt_a[:8] + toks(12, start=500)
    assert m.allocate("c", prompt_c, 12) is None
    assert counts(m) == (1, 0, 3)
    assert m.match_prefix([*prompt_a, 0]) == PrefixMatch(12)  # nothing was evicted
    assert m.allocate("c", prompt_c[:16], 8) == Allocation(num_cached_tokens=8, num_new_blocks=2)
    assert m.block_table("c") == [0, 1, 3, 2]  # block 2 evicted and reused
    assert counts(m) == (0, 4, 0)
    m.check_integrity()


def test_prefix_cache_disabled() -> None:
    m = manager(prefix=False)
    prompt = toks(9)
    run(m, "a", prompt, 9)
    assert m.match_prefix([*prompt, 1]) == PrefixMatch(0)
    assert m.allocate("b", prompt, 9) == Allocation(num_cached_tokens=0, num_new_blocks=3)
    assert m.block_table("b") == [3, 4, 5]
    m.commit("b", prompt, 9)
    assert m.block_table("b") == [3, 4, 5]
    m.free("a")
    assert counts(m) == (5, 3, 0)
    m.free("b")
    assert counts(m) == (8, 0, 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (18, 0)
    m.check_integrity()


# -- swapping ---------------------------------------------------------------------------------


def test_swap_out_and_in_round_trip_with_shared_blocks() -> None:
    m = manager(num_blocks=8, num_host_blocks=4)
    prompt_a = toks(10)
    run(m, "a", prompt_a, 10)  # [0, 1, 2]
    prompt_b = [*prompt_a[:8], 50, 51, 52]
    run(m, "b", prompt_b, 3)  # [0, 1, 3]
    assert m.can_swap_out("a")
    assert m.swap_out("a") == SwapPlan(copies=((0, 0), (1, 1), (2, 2)))
    assert m.is_swapped("a")
    assert m.num_computed_tokens("a") == 10
    assert refs(m, 0, 1, 2, 3) == [1, 1, 0, 1]  # b still holds 0 and 1
    assert counts(m) == (5, 3, 0)
    assert m.num_free_host_blocks == 1
    assert not m.can_swap_out("b")  # 3 computed blocks, 1 host block free
    assert m.can_swap_in("a")
    assert m.swap_in("a") == SwapPlan(copies=((0, 4), (1, 5), (2, 6)))
    assert m.block_table("a") == [4, 5, 6]
    assert m.num_free_host_blocks == 4
    assert counts(m) == (2, 6, 0)
    m.commit("a", prompt_a, 10)  # re-indexing finds 0, 1: a drops its private copies
    assert m.block_table("a") == [0, 1, 6]
    assert refs(m, 0, 1, 4, 5) == [2, 2, 0, 0]
    assert counts(m) == (4, 4, 0)
    m.check_integrity()


def test_swapped_request_survives_eviction_of_its_indexed_blocks() -> None:
    m = manager(num_blocks=8, num_host_blocks=4)
    prompt_a = toks(10)
    run(m, "a", prompt_a, 10)  # [0, 1, 2]; 0 <- 1 indexed
    assert m.swap_out("a") == SwapPlan(((0, 0), (1, 1), (2, 2)))
    assert counts(m) == (6, 0, 2)
    assert m.allocate("c", toks(28, start=300), 28) == Allocation(0, 7)  # evicts leaf 1
    assert m.block_table("c") == [3, 4, 5, 6, 7, 2, 1]
    assert counts(m) == (0, 7, 1)
    assert not m.can_swap_in("a")
    with pytest.raises(OutOfBlocksError, match="needs 3 device blocks, 1 free or evictable"):
        m.swap_in("a")
    assert m.is_swapped("a")
    m.free("c")
    assert counts(m) == (7, 0, 1)
    assert m.swap_in("a") == SwapPlan(((0, 1), (1, 2), (2, 7)))
    m.commit("a", prompt_a, 10)  # block 0 is still indexed (cached): switch to it
    assert m.block_table("a") == [0, 2, 7]  # block 1 was evicted: a's copy 2 is indexed now
    assert counts(m) == (5, 3, 0)
    assert m.match_prefix(prompt_a) == PrefixMatch(8)
    m.check_integrity()


def test_swap_out_drops_blocks_without_computed_kv() -> None:
    m = manager(num_blocks=8, num_host_blocks=4)
    prompt = toks(6)
    run(m, "a", prompt, 6)  # [0, 1]
    assert m.allocate("a", [*prompt, 1, 2, 3, 4, 5], 5) == Allocation(0, 1)  # [0, 1, 2]
    assert m.swap_out("a") == SwapPlan(((0, 0), (1, 1)))  # block 2 holds no KV yet
    assert m.swap_in("a") == SwapPlan(((0, 3), (1, 4)))
    assert m.block_table("a") == [3, 4]
    tokens = [*prompt, 1, 2, 3, 4, 5]
    assert m.allocate("a", tokens, 5) == Allocation(0, 1)
    assert m.block_table("a") == [3, 4, 5]
    m.commit("a", tokens, 11)  # block 0 is still cached: the private copy 3 is dropped
    assert m.block_table("a") == [0, 4, 5]
    assert counts(m) == (5, 3, 0)
    m.check_integrity()


def test_host_tier_full_means_no_swap_out() -> None:
    m = manager(num_blocks=8, num_host_blocks=2)
    run(m, "a", toks(9), 9)  # 3 computed blocks
    assert not m.can_swap_out("a")
    with pytest.raises(OutOfBlocksError, match="needs 3 host blocks, 2 free"):
        m.swap_out("a")
    assert m.block_table("a") == [0, 1, 2]
    assert counts(m) == (5, 3, 0)
    assert m.num_free_host_blocks == 2
    m0 = manager(num_host_blocks=0)
    run(m0, "a", toks(3), 3)
    assert not m0.can_swap_out("a")
    m.check_integrity()
    m0.check_integrity()


def test_free_while_swapped_returns_host_blocks() -> None:
    m = manager(num_blocks=8, num_host_blocks=4)
    run(m, "a", toks(6), 6)
    assert m.swap_out("a") == SwapPlan(((0, 0), (1, 1)))
    assert m.num_free_host_blocks == 2
    m.free("a")
    assert m.num_free_host_blocks == 4
    assert "a" not in m
    assert counts(m) == (7, 0, 1)
    m.check_integrity()


# -- misuse -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, r"KVCacheConfig.num_blocks must be >= 1 \(got 0\)"),
        ({"num_blocks": 4, "block_size": 0}, r"KVCacheConfig.block_size must be >= 1 \(got 0\)"),
        ({"num_blocks": 4, "num_host_blocks": -1}, r"num_host_blocks must be >= 0 \(got -1\)"),
        ({"num_blocks": 2.5}, r"KVCacheConfig.num_blocks must be an int >= 1 \(got 2.5\)"),
        ({"num_blocks": 4, "block_size": True}, r"block_size must be an int >= 1 \(got True\)"),
        ({"num_blocks": 4, "enable_prefix_cache": "yes"}, r"enable_prefix_cache must be a bool"),
    ],
)
def test_bad_config_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(**kwargs)  # type: ignore[arg-type]


def test_config_defaults_and_frozen() -> None:
    cfg = KVCacheConfig(num_blocks=10)
    assert (cfg.block_size, cfg.num_host_blocks, cfg.enable_prefix_cache) == (16, 0, True)
    assert (cfg.num_device_tokens, cfg.num_host_tokens) == (160, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_blocks = 3  # type: ignore[misc]
    m = manager()
    m.check_integrity()


def test_unknown_request_errors() -> None:
    m = manager(num_host_blocks=4)
    for call in (
        lambda: m.free("x"),
        lambda: m.commit("x", [1], 1),
        lambda: m.block_table("x"),
        lambda: m.num_computed_tokens("x"),
        lambda: m.can_swap_out("x"),
        lambda: m.swap_out("x"),
        lambda: m.can_swap_in("x"),
        lambda: m.swap_in("x"),
        lambda: m.is_swapped("x"),
    ):
        with pytest.raises(UnknownRequestError, match="'x'"):
            call()
    run(m, "a", toks(4), 4)
    m.free("a")
    with pytest.raises(UnknownRequestError, match="double free"):
        m.free("a")
    assert issubclass(UnknownRequestError, PdserveError)
    m.check_integrity()


def test_state_and_argument_errors() -> None:
    m = manager(num_host_blocks=4)
    prompt = toks(6)
    run(m, "a", prompt, 5)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        m.allocate("a", prompt, -1)
    with pytest.raises(ValueError, match="4 < 5 already committed"):
        m.commit("a", prompt, 4)
    with pytest.raises(ValueError, match="7 > 6 known tokens"):
        m.commit("a", prompt, 7)
    with pytest.raises(RequestStateError, match="'a' is not swapped out"):
        m.swap_in("a")
    m.swap_out("a")
    for call in (
        lambda: m.allocate("a", prompt, 1),
        lambda: m.commit("a", prompt, 6),
        lambda: m.block_table("a"),
        lambda: m.swap_out("a"),
        lambda: m.can_swap_out("a"),
    ):
        with pytest.raises(RequestStateError, match="'a' is swapped out"):
            call()
    m.swap_in("a")
    with pytest.raises(ValueError, match="9 > 8 tokens allocated"):
        m.commit("a", [*prompt, 1, 2, 3], 9)
    assert m.num_computed_tokens("a") == 5
    m.check_integrity()


# -- randomized property test -----------------------------------------------------------------


# Operation mix of the randomized test (weights by repetition).
_OPS = (*["admit"] * 2, *["schedule"] * 3, *["run"] * 2, "free", "swap_out", "swap_in")


class _Sim:
    """Drives a KVManager like a scheduler + runner would, with fake KV contents.

    Each device/host block slot holds a hash of the token prefix it was computed for, so a
    wrong block table, a bad dedupe switch or a wrong copy pair shows up as a content mismatch.
    """

    def __init__(self, m: KVManager, rng: random.Random) -> None:
        self.m = m
        self.rng = rng
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.pending: dict[str, int] = {}  # allocated, not yet computed
        self.swapped: set[str] = set()
        self.bases = [[rng.randrange(4) for _ in range(16)] for _ in range(3)]
        self.next_id = 0
        self.stats = {"fail": 0, "switch": 0, "evict": 0, "swap_out": 0, "swap_in": 0}

    def running(self) -> list[str]:
        return sorted(r for r in self.tokens if r not in self.swapped)

    def step(self) -> None:
        op = self.rng.choice(_OPS)
        getattr(self, op)()
        self.m.check_integrity()
        self.verify_contents()

    def admit(self) -> None:
        base = self.rng.choice(self.bases)
        prompt = base[: self.rng.randrange(17)] + [
            self.rng.randrange(4) for _ in range(self.rng.randrange(0, 8))
        ]
        if not prompt:
            return
        req = f"r{self.next_id}"
        cached = self.m.match_prefix(prompt).num_cached_tokens
        num_new = self.rng.randint(1, len(prompt) - cached)
        free_before = self.m.num_free_blocks
        alloc = self.m.allocate(req, prompt, num_new)
        if alloc is None:
            self.stats["fail"] += 1
            return
        self.next_id += 1
        assert alloc.num_cached_tokens == cached
        self.stats["evict"] += alloc.num_new_blocks > free_before
        self.tokens[req] = prompt
        self.pending[req] = num_new

    def schedule(self) -> None:
        reqs = [r for r in self.running() if self.pending[r] == 0]
        if not reqs:
            return
        req = self.rng.choice(reqs)
        tokens = self.tokens[req]
        computed = self.m.num_computed_tokens(req)
        if computed == len(tokens):  # decode: the last sampled token is appended
            if len(tokens) >= 40:
                self.m.free(req)
                self.forget(req)
                return
            tokens.append(self.rng.randrange(4))
        num_new = self.rng.randint(1, len(tokens) - computed)
        if self.m.allocate(req, tokens, num_new) is None:
            self.stats["fail"] += 1
            return
        self.pending[req] = num_new

    def run(self) -> None:
        bs = self.m.cfg.block_size
        for req in self.running():
            num_new = self.pending[req]
            if not num_new:
                continue
            tokens = self.tokens[req]
            start = self.m.num_computed_tokens(req)
            table = self.m.block_table(req)
            for pos in range(start, start + num_new):
                block = table[pos // bs]
                assert self.m._device.refcount(block) == 1, "write into a shared block"
                assert not self.m._device.is_indexed(block)
                self.device.setdefault(block, [None] * bs)[pos % bs] = kv(tokens, pos)
            self.m.commit(req, tokens, start + num_new)
            self.pending[req] = 0
            self.stats["switch"] += self.m.block_table(req) != table

    def free(self) -> None:
        if self.tokens:
            req = self.rng.choice(sorted(self.tokens))
            self.m.free(req)
            self.forget(req)

    def swap_out(self) -> None:
        reqs = self.running()
        if not reqs:
            return
        req = self.rng.choice(reqs)
        if not self.m.can_swap_out(req):
            return
        for dev, hst in self.m.swap_out(req).copies:
            self.host[hst] = list(self.device[dev])
        self.swapped.add(req)
        self.pending[req] = 0
        self.stats["swap_out"] += 1

    def swap_in(self) -> None:
        if not self.swapped:
            return
        req = self.rng.choice(sorted(self.swapped))
        if not self.m.can_swap_in(req):
            return
        for hst, dev in self.m.swap_in(req).copies:
            self.device[dev] = list(self.host[hst])
        self.swapped.discard(req)
        self.stats["swap_in"] += 1

    def forget(self, req: str) -> None:
        del self.tokens[req], self.pending[req]
        self.swapped.discard(req)

    def verify_contents(self) -> None:
        bs = self.m.cfg.block_size
        for req, tokens in self.tokens.items():
            computed = self.m.num_computed_tokens(req)
            if req in self.swapped:
                blocks, store = self.m._reqs[req].host_blocks or [], self.host
            else:
                blocks, store = self.m.block_table(req), self.device
            for pos in range(computed):
                got = store[blocks[pos // bs]][pos % bs]
                assert got == kv(tokens, pos), f"{req}: KV of token {pos} is wrong"


def kv(tokens: list[int], pos: int) -> int:
    """Fake KV of token `pos`: depends on the whole prefix, like real attention KV."""
    return hash(tuple(tokens[: pos + 1]))


@pytest.mark.parametrize("prefix", [True, False])
def test_random_operations_keep_integrity(prefix: bool) -> None:
    m = manager(num_blocks=20, num_host_blocks=8, prefix=prefix)
    sim = _Sim(m, random.Random(1234))
    for _ in range(3000):
        sim.step()
    for req in sorted(sim.tokens):
        m.free(req)
    m.check_integrity()
    assert m.num_used_blocks == 0
    assert m.num_free_host_blocks == 8
    assert sim.stats["fail"] > 0 and sim.stats["swap_out"] > 0 and sim.stats["swap_in"] > 0
    if prefix:
        assert sim.stats["switch"] > 0 and sim.stats["evict"] > 0 and m.prefix_cache_hits > 0


def test_hold_pins_the_whole_indexed_prefix_and_takes_fresh_blocks_all_or_nothing() -> None:
    m = manager(num_blocks=8)
    tokens = list(range(4 * BS))  # 4 full blocks
    assert m.allocate("a", tokens, len(tokens)) is not None
    m.commit("a", tokens, len(tokens))
    m.free("a")  # 4 blocks cached
    hits, queries = m.prefix_cache_hits, m.prefix_cache_queries
    # a pin: every full indexed block matches (no token is left to compute)
    assert m.hold("pin", tokens, 0) == 4 * BS
    assert counts(m) == (4, 4, 0)
    # a copy's destination: what is indexed, plus fresh blocks up to 6 blocks of tokens
    assert m.hold("copy", [*tokens, *range(100, 100 + 2 * BS)], 6 * BS) == 4 * BS
    assert counts(m) == (2, 6, 0)
    # no room: nothing taken, nothing evicted
    assert m.hold("big", list(range(500, 500 + 3 * BS)), 3 * BS) is None
    assert "big" not in m and counts(m) == (2, 6, 0)
    with pytest.raises(RequestStateError, match="already has KV state"):
        m.hold("pin", tokens, 0)
    assert (m.prefix_cache_hits, m.prefix_cache_queries) == (hits, queries)  # not counted
    m.free("pin")
    m.free("copy")
    m.check_integrity()
    assert counts(m) == (4, 0, 4)
