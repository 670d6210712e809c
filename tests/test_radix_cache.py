from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from plait.runtime.eviction import HIT_HALF_LIFE, EvictionPolicy, make_policy
from plait.runtime.memory import PageAllocator
from plait.runtime.radix_cache import RadixCache, TreeNode

PAGE_SIZES = [1, 16]


def make(page_size: int, num_pages: int = 64, disable: bool = False) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc, disable=disable)


def put(cache: RadixCache, tokens: list[int], salt: str | None = None) -> torch.Tensor:
    """Scheduler-style insert: match, lock, alloc the rest, insert, free dups + tail, unlock.
    Returns the slots now cached for the page-aligned part of ``tokens``."""
    alloc, ps = cache.allocator, cache.page_size
    m = cache.match_prefix(tokens, salt)
    cache.lock(m.node)
    pages = alloc.alloc(-(-(len(tokens) - m.length) // ps))
    assert pages is not None
    slots = torch.cat([m.slots, alloc.pages_to_slots(pages)])[: len(tokens)]
    dup = cache.insert(tokens, slots, salt)
    assert dup.numel() == 0
    if len(tokens) % ps:
        alloc.free(pages[-1:])
    cache.unlock(m.node)
    return slots[: len(tokens) - len(tokens) % ps]


def seq(ps: int, *pages: int) -> list[int]:
    """Tokens made of whole pages; page ``k`` is ``ps`` copies of ``k``."""
    return [p for p in pages for _ in range(ps)]


def check_sizes(alloc: PageAllocator, cache: RadixCache, private: int = 0) -> None:
    assert cache.evictable_pages + cache.locked_pages == cache.cached_pages
    assert alloc.num_free + cache.cached_pages + private == alloc.total_pages


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_empty_tree(ps: int) -> None:
    alloc, cache = make(ps)
    m = cache.match_prefix(seq(ps, 1, 2, 3))
    assert m.length == 0 and m.slots.dtype == torch.int64
    assert m.node.parent is None  # the namespace root
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_then_exact_partial_longer(ps: int) -> None:
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2, 3)
    slots = put(cache, toks)
    assert cache.cached_pages == 3
    check_sizes(alloc, cache)
    assert torch.equal(cache.match_prefix(toks).slots, slots)
    assert torch.equal(cache.match_prefix(seq(ps, 1, 2, 9)).slots, slots[: 2 * ps])
    assert torch.equal(cache.match_prefix(toks + seq(ps, 4, 5)).slots, slots)
    assert cache.match_prefix(seq(ps, 7)).length == 0
    # max_len cuts the query, rounded down to a page
    assert cache.match_prefix(toks, max_len=3 * ps - 1).length == 2 * ps
    if ps > 1:  # a mismatch inside a page drops that whole page
        assert cache.match_prefix(toks[: 2 * ps] + [3] * (ps - 1) + [0]).length == 2 * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_partial_match_splits_node(ps: int) -> None:
    alloc, cache = make(ps)
    slots = put(cache, seq(ps, 1, 2, 3, 4))
    m = cache.match_prefix(seq(ps, 1, 2, 8))
    assert m.length == 2 * ps
    assert m.node.key == seq(ps, 1, 2) and torch.equal(m.node.value, slots[: 2 * ps])
    (child,) = m.node.children.values()
    assert child.key == seq(ps, 3, 4) and child.parent is m.node
    assert torch.equal(child.value, slots[2 * ps :])
    assert m.node.parent is not None and m.node.parent.parent is None
    assert cache.cached_pages == 4
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_overlap_returns_exact_duplicates(ps: int) -> None:
    alloc, cache = make(ps)
    a = put(cache, seq(ps, 1, 2, 3))
    # A request that computed [1, 2, 5, 6] itself (it did not reuse the cache).
    pages = alloc.alloc(4)
    assert pages is not None
    mine = alloc.pages_to_slots(pages)
    dup = cache.insert(seq(ps, 1, 2, 5, 6), mine)
    assert torch.equal(dup, mine[: 2 * ps])
    alloc.free(alloc.slots_to_pages(dup))
    assert cache.cached_pages == 5
    check_sizes(alloc, cache)
    m = cache.match_prefix(seq(ps, 1, 2, 5, 6))
    assert torch.equal(m.slots, torch.cat([a[: 2 * ps], mine[2 * ps :]]))
    # The same prefix again with the cached slots: nothing taken, nothing returned.
    assert cache.insert(seq(ps, 1, 2), a[: 2 * ps]).numel() == 0
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_truncates_tail_page(ps: int) -> None:
    alloc, cache = make(ps)
    pages = alloc.alloc(3)
    assert pages is not None
    toks = seq(ps, 1, 2) + [3] * (ps // 2 or 1)
    slots = alloc.pages_to_slots(pages)[: len(toks)]
    dup = cache.insert(toks, slots)
    assert dup.numel() == 0
    cached = 2 if ps > 1 else 3
    assert cache.cached_pages == cached
    assert cache.match_prefix(toks).length == cached * ps
    if ps > 1:
        alloc.free(pages[2:])  # the tail page stays the caller's
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lock_protects_node_and_ancestors(ps: int) -> None:
    alloc, cache = make(ps)
    put(cache, seq(ps, 1, 2, 3))
    put(cache, seq(ps, 1, 2, 4))  # tree: [1,2] -> {[3], [4]}
    m = cache.match_prefix(seq(ps, 1, 2, 3))
    cache.lock(m.node)
    assert cache.locked_pages == 3 and cache.evictable_pages == 1
    assert cache.evict(100) == 1  # only the [4] leaf
    assert cache.match_prefix(seq(ps, 1, 2, 3)).length == 3 * ps
    assert cache.match_prefix(seq(ps, 1, 2, 4)).length == 2 * ps
    check_sizes(alloc, cache)
    cache.unlock(m.node)
    assert cache.locked_pages == 0 and cache.evictable_pages == 3
    assert cache.evict(100) == 3
    assert cache.cached_pages == 0 and alloc.num_free == alloc.total_pages


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lru_order_and_cascade(ps: int) -> None:
    alloc, cache = make(ps)
    put(cache, seq(ps, 1, 2))
    put(cache, seq(ps, 1, 3))
    put(cache, seq(ps, 4))
    cache.match_prefix(seq(ps, 1, 2))  # [1,2] is now most recent, [4] least
    cache.match_prefix(seq(ps, 1, 3))
    cache.match_prefix(seq(ps, 1, 2))
    assert cache.evict(1) == 1
    assert cache.match_prefix(seq(ps, 4)).length == 0
    assert cache.evict(1) == 1  # [1,3] is now the least recent leaf
    assert cache.match_prefix(seq(ps, 1, 3)).length == ps
    assert cache.match_prefix(seq(ps, 1, 2)).length == 2 * ps
    # Removing [2] leaves [1] a leaf; one call cascades to it.
    assert cache.evict(2) == 2
    assert cache.cached_pages == 0 and cache.evicted_tokens == 4 * ps
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_a_policy_is_one_class(ps: int) -> None:
    class LongestFirst(EvictionPolicy):
        name = "longest"

        def key(self, node: TreeNode, now: int) -> int:
            return -len(node.key)

    alloc = PageAllocator(64, ps)
    cache = RadixCache(alloc, policy=LongestFirst())
    put(cache, seq(ps, 1))
    put(cache, seq(ps, 2, 2, 2))
    assert cache.evict(1) == 3
    assert cache.match_prefix(seq(ps, 1)).length == ps


def _reused(cache: RadixCache, tokens: list[int], times: int) -> None:
    for _ in range(times):
        cache.record_hit(cache.match_prefix(tokens).node)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lfu_evicts_the_least_reused_leaf(ps: int) -> None:
    alloc = PageAllocator(64, ps)
    cache = RadixCache(alloc, policy=make_policy("lfu"))
    put(cache, seq(ps, 1, 2))
    put(cache, seq(ps, 3, 4))
    _reused(cache, seq(ps, 1, 2), 3)
    _reused(cache, seq(ps, 3, 4), 1)  # the most recent, but reused less
    assert cache.evict(1) == 2  # the whole leaf [3 4]
    assert cache.match_prefix(seq(ps, 3, 4)).length == 0
    assert cache.match_prefix(seq(ps, 1, 2)).length == 2 * ps
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_cost_policy_weighs_reuse_against_recompute_cost(ps: int) -> None:
    """Equal reuse: the cheaper leaf (fewer tokens, earlier positions) goes first, even
    when it is the least recently used one; more reuse outweighs a higher cost; old hits
    decay (a burst of reuse long ago counts for little)."""
    alloc = PageAllocator(256, ps)
    policy = make_policy("cost")
    cache = RadixCache(alloc, policy=policy)
    long_doc = seq(ps, *range(10, 30))  # 20 pages
    short = seq(ps, 5)  # 1 page
    put(cache, long_doc)
    put(cache, short)
    _reused(cache, long_doc, 1)
    _reused(cache, short, 1)  # most recent, but cheap to recompute
    leaves = {len(n.key) // ps: n for n in cache._nodes() if not n.children}
    assert policy.recompute_cost(leaves[20]) > 20 * policy.recompute_cost(leaves[1])
    assert cache.evict(1) == 1 and cache.match_prefix(short).length == 0
    # reuse beats cost: a short prefix hit often survives a long one never reused
    put(cache, short)
    put(cache, seq(ps, 40, 41, 42))
    _reused(cache, short, 12)
    assert cache.evict(1) == 3 and cache.match_prefix(short).length == ps
    # decay: hits far in the past (many clock ticks ago) fade toward none
    node = cache.match_prefix(short).node
    fresh = policy.key(node, cache._clock)[0]
    stale = policy.key(node, cache._clock + 100 * HIT_HALF_LIFE)[0]
    assert stale < fresh / 5 and stale >= policy.recompute_cost(node)
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_split_nodes_keep_positions_and_reuse(ps: int) -> None:
    alloc, cache = make(ps)
    put(cache, seq(ps, 1, 2, 3))
    _reused(cache, seq(ps, 1, 2, 3), 2)
    cache.match_prefix(seq(ps, 1, 9))  # splits [1 | 2 3]
    (top,) = cache._roots[None].children.values()
    (rest,) = top.children.values()
    assert (top.start, rest.start) == (0, ps) and top.hits == rest.hits == 2


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_salts_isolate(ps: int) -> None:
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2)
    a = put(cache, toks, salt="alice")
    assert cache.match_prefix(toks).length == 0
    assert cache.match_prefix(toks, salt="bob").length == 0
    b = put(cache, toks, salt=None)
    assert cache.cached_pages == 4
    assert torch.equal(cache.match_prefix(toks, salt="alice").slots, a)
    assert torch.equal(cache.match_prefix(toks).slots, b)
    m = cache.match_prefix(toks, salt="alice")
    cache.lock(m.node)
    assert cache.evict(100) == 2  # eviction spans namespaces; the locked one survives
    assert cache.match_prefix(toks, salt="alice").length == 2 * ps
    assert cache.match_prefix(toks).length == 0
    cache.unlock(m.node)
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_counters(ps: int) -> None:
    alloc, cache = make(ps)
    put(cache, seq(ps, 1, 2))  # put() matches with count=False
    assert cache.queried_tokens == cache.hit_tokens == 0
    cache.match_prefix(seq(ps, 1, 2, 3), count=True)
    cache.match_prefix(seq(ps, 1, 5) + [0], count=True)
    cache.match_prefix(seq(ps, 1, 2, 3))
    assert cache.queried_tokens == 5 * ps + 1
    assert cache.hit_tokens == 3 * ps
    cache.evict(100)
    assert cache.evicted_tokens == 2 * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_disabled(ps: int) -> None:
    alloc, cache = make(ps, disable=True)
    pages = alloc.alloc(3)
    assert pages is not None
    slots = alloc.pages_to_slots(pages)[: 2 * ps + 1]
    toks = seq(ps, 1, 2) + [3]
    returned = cache.insert(toks, slots)  # everything page-aligned comes back
    assert torch.equal(returned, slots if ps == 1 else slots[: 2 * ps])
    m = cache.match_prefix(toks, count=True)
    assert m.length == 0 and m.node.parent is None
    cache.lock(m.node)
    cache.unlock(m.node)
    assert cache.cached_pages == 0 and cache.evict(10) == 0
    assert cache.queried_tokens == len(toks) and cache.hit_tokens == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_reset(ps: int) -> None:
    alloc, cache = make(ps)
    put(cache, seq(ps, 1, 2, 3))
    put(cache, seq(ps, 1, 4), salt="s")
    m = cache.match_prefix(seq(ps, 1, 2))
    cache.lock(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert cache.cached_pages == 0 and alloc.num_free == alloc.total_pages
    assert cache.match_prefix(seq(ps, 1, 2, 3)).length == 0
    assert cache.match_prefix(seq(ps, 1, 4), salt="s").length == 0
    put(cache, seq(ps, 1))  # usable after reset
    check_sizes(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_unlock_below_zero_raises(ps: int) -> None:
    alloc, cache = make(ps)
    put(cache, seq(ps, 1, 2))
    m = cache.match_prefix(seq(ps, 1, 2))
    cache.lock(m.node)
    cache.unlock(m.node)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    check_sizes(alloc, cache)
    assert cache.locked_pages == 0


def test_insert_length_mismatch_raises() -> None:
    _, cache = make(1)
    with pytest.raises(ValueError, match="len"):
        cache.insert([1, 2], torch.tensor([5], dtype=torch.int64))


def test_pretty_print() -> None:
    _, cache = make(2)
    put(cache, [1, 2, 3, 4], salt="x")
    out = cache.pretty_print()
    assert "salt='x'" in out and "len=4" in out


# ---------------------------------------------------------------------------
# Property test: random request lifecycles against a reference model.

# A few shared "system prompts" cut at any length plus a random tail, so that prefixes
# collide and matches end inside nodes.
BASES = [[0] * 12, [0, 1] * 6, [1, 2, 0] * 4]
VOCAB = st.builds(
    lambda base, k, tail: base[:k] + tail,
    st.sampled_from(BASES),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=4),
)
SALTS = st.sampled_from([None, "s"])


@dataclass
class Running:
    tokens: list[int]
    salt: str | None
    node: TreeNode  # the locked node
    matched: int  # cached prefix length at admission
    slots: torch.Tensor  # [len(tokens)]: matched prefix slots, then slots of `pages`
    pages: list[int]  # private pages (not in the tree)


class RadixMachine(RuleBasedStateMachine):
    """Drives RadixCache like a scheduler. The reference model maps every cached
    page-aligned prefix (salt, tokens) to the page holding its last page of KV."""

    @initialize(ps=st.sampled_from([1, 2, 4]))
    def setup(self, ps: int) -> None:
        self.ps = ps
        self.alloc = PageAllocator(20, ps)
        self.cache = RadixCache(self.alloc)
        self.ref: dict[tuple[str | None, tuple[int, ...]], int] = {}
        self.running: list[Running] = []

    # ---- reference helpers ----
    def ref_match(self, tokens: list[int], salt: str | None, max_len: int | None) -> int:
        n = len(tokens) if max_len is None else min(max_len, len(tokens))
        k = 0
        while k + self.ps <= n and (salt, tuple(tokens[: k + self.ps])) in self.ref:
            k += self.ps
        return k

    def ref_slots(self, tokens: list[int], salt: str | None, length: int) -> torch.Tensor:
        pages = [self.ref[(salt, tuple(tokens[:k]))] for k in range(self.ps, length + 1, self.ps)]
        return self.alloc.pages_to_slots(pages) if pages else torch.empty(0, dtype=torch.int64)

    def tree_map(self) -> dict[tuple[str | None, tuple[int, ...]], int]:
        out: dict[tuple[str | None, tuple[int, ...]], int] = {}
        for salt, root in self.cache._roots.items():
            stack = [(c, ()) for c in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                pages = self.alloc.slots_to_pages(node.value)
                for i, p in enumerate(pages):
                    out[(salt, prefix + tuple(node.key[: (i + 1) * self.ps]))] = p
                full = prefix + tuple(node.key)
                stack.extend((c, full) for c in node.children.values())
        return out

    # ---- rules ----
    @rule(tokens=VOCAB, salt=SALTS, max_len=st.none() | st.integers(0, 12))
    def start(self, tokens: list[int], salt: str | None, max_len: int | None) -> None:
        """Admit a request: match (count), lock, alloc private pages for the rest.
        A small ``max_len`` makes it recompute cached pages: duplicates on insert."""
        m = self.cache.match_prefix(tokens, salt, max_len=max_len, count=True)
        expect = self.ref_match(tokens, salt, max_len)
        assert m.length == expect
        assert torch.equal(m.slots, self.ref_slots(tokens, salt, expect))
        self.cache.lock(m.node)
        need = -(-(len(tokens) - m.length) // self.ps)
        pages = self.alloc.alloc(need)
        if pages is None:
            self.evict_and_check(need - self.alloc.num_free)
            pages = self.alloc.alloc(need)
        if pages is None:  # would not fit: the scheduler leaves it waiting
            assert self.cache.evictable_pages == 0
            self.cache.unlock(m.node)
            return
        slots = torch.cat([m.slots, self.alloc.pages_to_slots(pages)])[: len(tokens)]
        self.running.append(Running(tokens, salt, m.node, m.length, slots, pages))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        """Insert the request's sequence, free duplicates and the tail page, unlock."""
        req = self.running.pop(i % len(self.running))
        dup = self.cache.insert(req.tokens, req.slots, req.salt)
        dup_pages = self.alloc.slots_to_pages(dup)
        assert set(dup_pages) <= set(req.pages)  # never the prefix it got from the cache
        n = len(req.tokens) - len(req.tokens) % self.ps
        own = self.alloc.slots_to_pages(req.slots[:n])
        for k, p in zip(range(self.ps, n + 1, self.ps), own):
            key = (req.salt, tuple(req.tokens[:k]))
            if key in self.ref:
                assert (self.ref[key] != p) == (p in dup_pages)
            else:
                self.ref[key] = p
                assert p not in dup_pages
        tail = req.pages[len(req.pages) - (1 if len(req.tokens) % self.ps else 0) :]
        self.alloc.free(dup_pages + tail)
        self.cache.unlock(req.node)

    @rule(tokens=VOCAB, salt=SALTS)
    def probe(self, tokens: list[int], salt: str | None) -> None:
        m = self.cache.match_prefix(tokens, salt)
        assert m.length == self.ref_match(tokens, salt, None)
        assert torch.equal(m.slots, self.ref_slots(tokens, salt, m.length))

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        self.evict_and_check(n)

    def evict_and_check(self, n: int) -> None:
        """Evict, check only unlocked cached prefixes went, then sync the reference."""
        before = self.cache.cached_pages
        freed = self.cache.evict(n)
        assert freed == before - self.cache.cached_pages
        assert freed >= n or self.cache.evictable_pages == 0
        tree = self.tree_map()
        assert tree.items() <= self.ref.items()
        self.ref = tree
        for req in self.running:  # locked prefixes survive
            m = self.cache.match_prefix(req.tokens, req.salt, max_len=req.matched)
            assert torch.equal(m.slots, req.slots[: req.matched])

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.ref = {}

    # ---- invariants after every step ----
    @invariant()
    def accounting(self) -> None:
        private = sum(len(r.pages) for r in self.running)
        assert self.cache.evictable_pages + self.cache.locked_pages == self.cache.cached_pages
        assert self.alloc.num_free + self.cache.cached_pages + private == self.alloc.total_pages
        tree = self.tree_map()
        assert tree == self.ref
        held = list(tree.values()) + [p for r in self.running for p in r.pages]
        assert len(held) == len(set(held))  # no page owned twice
        assert not any(self.alloc._is_free[p] for p in held)  # and none also on the free list
        # lock_ref == running requests whose locked node is this node or below it
        users: Counter[int] = Counter()
        for req in self.running:
            node = req.node
            while node.parent is not None:
                users[id(node)] += 1
                node = node.parent
        nodes = self.cache._nodes()
        assert all(n.lock_ref == users[id(n)] for n in nodes)
        assert self.cache.locked_pages == sum(len(n.key) // self.ps for n in nodes if n.lock_ref)


TestRadixProperties = RadixMachine.TestCase
TestRadixProperties.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
