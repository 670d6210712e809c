"""Block-hash prefix caching (vLLM's automatic prefix caching), for comparison with
the radix tree on one engine (``prefix_cache_mode="block_hash"``).

Each full page is one block, addressed by a chained hash: ``h(parent's hash, the
page's tokens)``, the first block's parent being the namespace (``cache_salt``). A
prompt hits the blocks whose hash chain it reproduces, block by block from its start;
partial pages are never shared. What differs from the radix tree
(:class:`~plait.runtime.radix_cache.RadixCache`, which shares the same lock, unlock
and accounting code):

- blocks are looked up by hash, one page at a time, never split;
- eviction takes any unlocked block, interior ones included (vLLM's free-block queue);
  the blocks after it stay cached but unreachable until the evicted block is computed
  and inserted again, when they are linked back (content addressing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from plait.runtime.eviction import EvictionPolicy
from plait.runtime.memory import PageAllocator
from plait.runtime.radix_cache import MatchResult, RadixCache, TreeNode

if TYPE_CHECKING:
    from plait.runtime.kv_events import KVEventSink

_EMPTY = torch.empty(0, dtype=torch.int64)


class Block(TreeNode):
    """One cached page: its tokens (``key``), slots (``value``) and chained ``digest``."""

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode, digest: bytes,
                 parent_digest: bytes, salt: str | None) -> None:
        super().__init__(key, value, parent)
        self.digest = digest
        self.parent_digest = parent_digest
        self.salt = salt


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens),
                           digest_size=16).digest()


class BlockHashCache(RadixCache):
    """Prefix cache of hashed full-page blocks over ``allocator``.

    Invariants (as the radix tree's): every page the cache holds belongs to exactly one
    block; ``lock_ref`` counts run from a locked block to its namespace root, so every
    block after an unlocked one is unlocked; ``evictable_pages + locked_pages ==
    cached_pages``; ``allocator.num_free + cached_pages + private pages == total``.
    ``_blocks`` holds every cached block; ``_orphans[d]`` those of them whose parent
    (digest ``d``) was evicted (``parent`` None, unreachable by a match).
    """

    def __init__(self, allocator: PageAllocator, disable: bool = False, *,
                 policy: EvictionPolicy | None = None, events: KVEventSink | None = None) -> None:
        super().__init__(allocator, disable, policy=policy, events=events)
        self._blocks: dict[bytes, Block] = {}
        self._orphans: dict[bytes, list[Block]] = {}

    def match_prefix(self, tokens: Sequence[int], salt: str | None = None, *, max_len: int | None = None,
                     count: bool = False) -> MatchResult:
        n = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        n -= n % self.page_size
        node: TreeNode = self._roots[None]
        pieces: list[torch.Tensor] = []
        if not self.disable:
            node = self._lookup_root(salt)
            self._clock += 1
            digest = self._salt_digest(salt)
            for pos in range(0, n, self.page_size):
                digest = block_digest(digest, tokens[pos : pos + self.page_size])
                block = self._blocks.get(digest)
                if block is None:
                    break
                block.last_access = self._clock
                pieces.append(block.value)
                node = block
        slots = torch.cat(pieces) if pieces else _EMPTY
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += slots.numel()
        return MatchResult(slots, node)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor, salt: str | None = None) -> torch.Tensor:
        if len(tokens) != slots.numel():
            raise ValueError(f"insert: len(tokens)={len(tokens)} != len(slots)={slots.numel()}")
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        if self.disable:
            return slots[:n]
        self._clock += 1
        parent: TreeNode = self._root(salt)
        digest = self._salt_digest(salt)
        dup: list[torch.Tensor] = []
        for pos in range(0, n, ps):
            page = list(tokens[pos : pos + ps])
            parent_digest, digest = digest, block_digest(digest, page)
            block = self._blocks.get(digest)
            if block is None:
                block = Block(page, slots[pos : pos + ps].clone(), parent, digest, parent_digest, salt)
                block.start = pos
                block.last_access = block.score_clock = self._clock
                parent.children[digest] = block
                self._blocks[digest] = block
                self._evictable_pages += 1
                if self.events is not None:
                    self.events.stored(salt, int(parent.value[0]) // ps if isinstance(parent, Block) else None, page,
                                       [int(block.value[0]) // ps])
                for orphan in self._orphans.pop(digest, []):  # computed again: relink
                    orphan.parent = block
                    block.children[orphan.digest] = orphan
            elif not torch.equal(block.value, slots[pos : pos + ps]):
                dup.append(slots[pos : pos + ps])
            parent = block
        return torch.cat(dup) if dup else _EMPTY

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages, unlocked blocks in the policy's order,
        later blocks of a sequence first among equals (as vLLM frees a sequence's blocks
        tail first)."""
        if num_pages <= 0:
            return 0
        now = self._clock
        free = [b for b in self._blocks.values() if b.lock_ref == 0]
        free.sort(key=lambda b: (self.policy.key(b, now), -b.start))
        freed = 0
        for block in free:
            if freed >= num_pages:
                break
            freed += self._remove_block(block)
        self._roots = {s: r for s, r in self._roots.items() if s is None or r.children}
        return freed

    def reset(self) -> None:
        super().reset()
        self._blocks.clear()
        self._orphans.clear()

    def drop_namespace(self, salt: str) -> int:
        blocks = [b for b in self._blocks.values() if b.salt == salt]
        if any(b.lock_ref for b in blocks):
            raise RuntimeError(f"drop_namespace({salt!r}) while its prefixes are in use")
        for b in blocks:
            del self._blocks[b.digest]
            self._free_node(b)
        self._orphans = {d: kept for d, group in self._orphans.items()
                         if (kept := [b for b in group if b.salt != salt])}
        self._roots.pop(salt, None)
        return len(blocks)

    def pretty_print(self) -> str:
        return "\n".join(f"{b.digest.hex()[:8]} start={b.start} lock={b.lock_ref} t={b.last_access}"
                         for b in self._blocks.values())

    # ---- internals ----
    @staticmethod
    def _salt_digest(salt: str | None) -> bytes:
        return b"" if salt is None else hashlib.blake2b(salt.encode(), digest_size=16).digest()

    def _remove_block(self, block: Block) -> int:
        if block.parent is None:  # an orphan
            self._orphans[block.parent_digest].remove(block)
            if not self._orphans[block.parent_digest]:
                del self._orphans[block.parent_digest]
        else:
            del block.parent.children[block.digest]
        del self._blocks[block.digest]
        self.evicted_tokens += len(block.key)
        if block.children:  # they stay cached, unreachable until this block is back
            self._orphans.setdefault(block.digest, []).extend(block.children.values())
            for child in block.children.values():
                child.parent = None
            block.children = {}
        block.parent = None
        return self._free_node(block)

    def _nodes(self) -> list[TreeNode]:
        return list(self._blocks.values())  # orphans included
