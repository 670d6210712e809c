"""Block-hash prefix caching (vLLM semantics) beside the radix tree."""

from __future__ import annotations

import random

import pytest
import torch

from plait.runtime.block_cache import BlockHashCache, block_digest
from plait.runtime.eviction import EvictionPolicy
from plait.runtime.memory import PageAllocator
from plait.runtime.radix_cache import RadixCache, TreeNode


def put(cache: RadixCache, tokens: list[int], salt: str | None = None) -> torch.Tensor:
    """Scheduler-style: match, lock, alloc the rest, insert, free dups and the tail."""
    alloc, ps = cache.allocator, cache.page_size
    m = cache.match_prefix(tokens, salt)
    cache.lock(m.node)
    pages = alloc.alloc(-(-(len(tokens) - m.length) // ps))
    assert pages is not None
    slots = torch.cat([m.slots, alloc.pages_to_slots(pages)])[: len(tokens)]
    dup = cache.insert(tokens, slots, salt)
    alloc.free(alloc.slots_to_pages(dup))
    if len(tokens) % ps:
        alloc.free(pages[-1:])
    cache.unlock(m.node)
    return slots[: len(tokens) - len(tokens) % ps]


def check(alloc: PageAllocator, cache: RadixCache, private: int = 0) -> None:
    held = cache.held_pages()
    assert len(held) == len(set(held)) == cache.cached_pages
    assert cache.evictable_pages + cache.locked_pages == cache.cached_pages
    assert alloc.num_free + cache.cached_pages + private == alloc.total_pages


def test_full_pages_only_and_chained():
    alloc = PageAllocator(32, 4)
    cache = BlockHashCache(alloc)
    put(cache, [1, 2, 3, 4, 5, 6])  # one full page, the tail is not cached
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).length == 4
    assert cache.match_prefix([1, 2, 3]).length == 0
    put(cache, [9, 9, 9, 9, 1, 2, 3, 4])
    # the page [1 2 3 4] after another page is another block (its chain differs)
    assert cache.match_prefix([9, 9, 9, 9, 1, 2, 3, 4]).length == 8
    assert cache.match_prefix([8, 8, 8, 8, 1, 2, 3, 4]).length == 0
    assert cache.match_prefix([1, 2, 3, 4], salt="other").length == 0
    assert block_digest(b"", [1, 2]) != block_digest(b"", [2, 1])
    check(alloc, cache)


def test_radix_reuses_partial_pages_block_hash_does_not():
    """Token-level radix (page 1) against 4-token blocks on a partial overlap."""
    shared = list(range(10, 20))  # 10 shared tokens
    a, b = shared + [1, 2, 3], shared + [7, 8, 9]
    radix = RadixCache(PageAllocator(64, 1))
    blocks = BlockHashCache(PageAllocator(64, 4))
    for cache in (radix, blocks):
        put(cache, a)
    assert radix.match_prefix(b).length == 10
    assert blocks.match_prefix(b).length == 8


class ByFirstToken(EvictionPolicy):
    name = "first-token"

    def key(self, node: TreeNode, now: int) -> int:
        return node.key[0]


def test_interior_eviction_keeps_later_blocks_until_relinked():
    alloc = PageAllocator(32, 2)
    cache = BlockHashCache(alloc, policy=ByFirstToken())
    put(cache, [5, 5, 1, 1, 7, 7])  # blocks [5 5] -> [1 1] -> [7 7]
    assert cache.evict(1) == 1  # the interior block [1 1] (smallest first token)
    assert cache.cached_pages == 2
    assert cache.match_prefix([5, 5, 1, 1, 7, 7]).length == 2  # [7 7] is unreachable
    check(alloc, cache)
    slots = put(cache, [5, 5, 1, 1])  # computed again: [7 7] is linked back
    assert cache.match_prefix([5, 5, 1, 1, 7, 7]).length == 6
    m = cache.match_prefix([5, 5, 1, 1, 7, 7])
    assert torch.equal(m.slots[:4], slots)
    cache.lock(m.node)  # locks run through the relinked chain
    assert cache.locked_pages == 3 and cache.evict(10) == 0
    cache.unlock(m.node)
    check(alloc, cache)
    assert cache.evict(1) == 1  # an orphan's own eviction works too
    cache.reset()
    assert alloc.num_free == alloc.total_pages


@pytest.mark.parametrize("seed", range(3))
def test_random_lifecycles_keep_the_invariants(seed: int):
    """Admit (match, lock, alloc), finish (insert, unlock), evict at random; matches
    follow the chain rule over the blocks held, and the accounting always adds up."""
    rng = random.Random(seed)
    ps = 2
    alloc = PageAllocator(24, ps)
    cache = BlockHashCache(alloc)
    running: list[tuple[list[int], str | None, TreeNode, torch.Tensor, list[int]]] = []
    bases = [[0] * 8, [0, 1] * 4, [1, 2, 0, 1] * 2]
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            tokens = rng.choice(bases)[: rng.randint(0, 8)] + [rng.randint(0, 2) for _ in range(rng.randint(0, 4))]
            salt = rng.choice([None, "s"])
            m = cache.match_prefix(tokens, salt)
            expect, digest = 0, BlockHashCache._salt_digest(salt)
            while expect + ps <= len(tokens):  # the chain rule; orphans have no parent
                digest = block_digest(digest, tokens[expect : expect + ps])
                block = cache._blocks.get(digest)
                if block is None or block.parent is None:
                    break
                expect += ps
            assert m.length == expect
            cache.lock(m.node)
            need = -(-(len(tokens) - m.length) // ps)
            if need > alloc.num_free:
                cache.evict(need - alloc.num_free)
            pages = alloc.alloc(need)
            if pages is None:
                cache.unlock(m.node)
                continue
            slots = torch.cat([m.slots, alloc.pages_to_slots(pages)])[: len(tokens)]
            running.append((tokens, salt, m.node, slots, pages))
        elif op < 0.85 and running:
            tokens, salt, node, slots, pages = running.pop(rng.randrange(len(running)))
            dup = set(alloc.slots_to_pages(cache.insert(tokens, slots, salt)))
            taken = set(cache.held_pages())
            alloc.free([p for p in pages if p in dup or p not in taken])  # the rest is the cache's now
            cache.unlock(node)
        else:
            cache.evict(rng.randint(1, 4))
        check(alloc, cache, private=sum(len(r[4]) for r in running))


def test_engine_in_block_hash_mode_matches_radix(tiny_model_factory):
    from plait.runtime import Engine

    folder = str(tiny_model_factory("llama"))
    shared = list(range(100, 130))  # 30 tokens: 7 full pages of 4
    prompts = [shared + [5, 6], shared + [7, 8, 9]]
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    outs, cached = {}, {}
    for mode in ("radix", "block_hash"):
        with Engine(folder, kv_cache_tokens=512, page_size=4, prefix_cache_mode=mode) as e:
            first = e.generate(input_ids=prompts[0], sampling_params=params)
            second = e.generate(input_ids=prompts[1], sampling_params=params)
            e.check_invariants()
            outs[mode] = [first["output_ids"], second["output_ids"]]
            cached[mode] = second["meta_info"]["cached_tokens"]
    assert outs["radix"] == outs["block_hash"]
    assert cached["block_hash"] == 28 and cached["radix"] == 28  # both whole pages at page size 4


@pytest.mark.parametrize("cls", [RadixCache, BlockHashCache])
def test_lookups_keep_no_namespace_per_salt(cls):
    # every distinct salt a client sends was kept as an empty namespace (with its string)
    # until an eviction: a lookup must not hold memory; an insert registers the namespace
    alloc = PageAllocator(32, 2)
    cache = cls(alloc)
    for i in range(500):
        m = cache.match_prefix([1, 1, 2, 2], salt=f"tenant-{i}" * 100)
        cache.lock(m.node)
        cache.unlock(m.node)
        assert m.length == 0
    assert set(cache._roots) == {None}
    put(cache, [1, 1, 2, 2, 3], salt="a")
    assert set(cache._roots) == {None, "a"} and cache.match_prefix([1, 1, 2, 2], salt="a").length == 4
    check(alloc, cache)


@pytest.mark.parametrize("cls", [RadixCache, BlockHashCache])
def test_drop_namespace_frees_exactly_that_salt(cls):
    alloc = PageAllocator(32, 2)
    cache = cls(alloc)
    for salt in (None, "a", "b"):
        put(cache, [1, 1, 2, 2, 3], salt=salt)
    assert cache.drop_namespace("a") == 2
    assert cache.match_prefix([1, 1, 2, 2], salt="a").length == 0
    assert cache.match_prefix([1, 1, 2, 2], salt="b").length == 4
    assert cache.match_prefix([1, 1, 2, 2]).length == 4
    assert cache.drop_namespace("never-used") == 0
    m = cache.match_prefix([1, 1], salt="b")
    cache.lock(m.node)
    with pytest.raises(RuntimeError, match="in use"):
        cache.drop_namespace("b")
    cache.unlock(m.node)
    check(alloc, cache)


def test_engine_flush_of_a_salt_waits_for_its_running_requests(tiny_model_factory):
    from plait.runtime import Engine

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=512, page_size=4) as e:
        params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        prompt = list(range(50, 70))
        e.generate(input_ids=prompt, sampling_params=params, cache_salt="a")
        running = e.add_request(prompt, params, cache_salt="a")[0]
        e.step()
        assert e.flush_cache("a") is False and e.flush_cache("b") is True
        while e.has_work():
            e.step()
        assert e.pop_result(running)["meta_info"]["cached_tokens"] == 16  # whole pages of the first 19
        assert e.flush_cache("a") is True
        again = e.generate(input_ids=prompt, sampling_params=params, cache_salt="a")
        assert again["meta_info"]["cached_tokens"] == 0
        e.check_invariants()
