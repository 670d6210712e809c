"""RadixAttention prefix cache: a token-level radix tree over cached KV slots.

A node holds a span of tokens (``key``) and the slots holding their KV (``value``).
With ``page_size > 1`` every key length and every split point is a multiple of
``page_size``, so each node owns whole pages. Running requests lock the deepest node
they use; locks propagate to the namespace root. Only unlocked leaves are evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.runtime.eviction import LRU, EvictionPolicy, decayed
from plait.runtime.memory import PageAllocator

if TYPE_CHECKING:
    from plait.runtime.kv_events import KVEventSink


class TreeNode:
    """One span of cached tokens. The namespace root has an empty key and no parent."""

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None = None) -> None:
        self.key = key
        self.value = value  # int64 [len(key)]: slot of each token
        self.parent = parent
        self.children: dict[Hashable, TreeNode] = {}
        self.lock_ref = 0  # running requests whose locked node is this one or a descendant
        self.last_access = 0
        self.start = 0  # tokens before this span in its sequence
        # reuse, for eviction policies (plait.runtime.eviction): admitted requests whose
        # match ran through this node, and that count decayed to ``score_clock``
        self.hits = 0
        self.score = 0.0
        self.score_clock = 0

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, last_access={self.last_access})"


@dataclass
class MatchResult:
    slots: torch.Tensor  # int64 [length]: cached KV slots of the matched prefix
    node: TreeNode  # deepest node covering the match (the namespace root if none)

    @property
    def length(self) -> int:
        return self.slots.numel()


_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixCache:
    """Prefix cache over the pages of ``allocator``, one tree per ``cache_salt``.

    Invariants:
    - every page the tree holds is owned by exactly one node, and node spans are
      page-aligned;
    - ``lock_ref`` of a node >= the sum over its children (locks run to the root), so
      every descendant of an unlocked node is unlocked;
    - ``evictable_pages + locked_pages == cached_pages``;
    - ``allocator.num_free + cached_pages + pages held privately by running requests
      == allocator.total_pages``.

    ``policy`` orders unlocked leaves for eviction (:mod:`plait.runtime.eviction`;
    LRU by default).
    """

    def __init__(
        self,
        allocator: PageAllocator,
        disable: bool = False,
        *,
        policy: EvictionPolicy | None = None,
        on_evict: Callable[[list[int], torch.Tensor, str | None], None] | None = None,
        events: KVEventSink | None = None,
    ) -> None:
        self.allocator = allocator
        self.events = events  # told of pages entering and leaving (plait.runtime.kv_events)
        self.page_size = allocator.page_size
        self.disable = disable
        self.policy = policy if policy is not None else LRU()
        # called with (tokens, slots, salt) of an evicted leaf's whole path before its
        # pages are freed (the host tier keeps them: plait.runtime.hicache)
        self.on_evict = on_evict
        self._roots: dict[str | None, TreeNode] = {None: self._new_root()}
        self._clock = 0
        # bumped whenever a cached prefix appears or goes (not on splits or touches): a
        # match remembered at one version is still exact while the version is unchanged
        self.version = 0
        self._evictable_pages = 0
        self._locked_pages = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_tokens = 0

    # ---- sizes (pages), kept incrementally ----
    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def cached_pages(self) -> int:
        return self._evictable_pages + self._locked_pages

    # ---- public API ----
    def match_prefix(
        self,
        tokens: Sequence[int],
        salt: str | None = None,
        *,
        max_len: int | None = None,
        count: bool = False,
    ) -> MatchResult:
        """Longest cached prefix of ``tokens[:max_len]``, rounded down to whole pages.

        Splits the last node when the match ends inside it, so ``node`` covers exactly
        the match; touches every node on the path. ``count=True`` (once per admitted
        request) adds to ``queried_tokens`` / ``hit_tokens``.
        """
        n = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        n -= n % self.page_size
        node = self._roots[None]
        pieces: list[torch.Tensor] = []
        if not self.disable:
            node, pieces = self._walk(self._lookup_root(salt), tokens, n)
        slots = torch.cat(pieces) if pieces else _EMPTY
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += slots.numel()
        return MatchResult(slots, node)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor, salt: str | None = None) -> torch.Tensor:
        """Cache ``tokens`` -> ``slots`` (truncated to whole pages; the tail is the caller's).

        The tree takes over the slots of positions it did not hold. Returns the slots
        the caller still owns and must free: positions the tree already held with
        DIFFERENT slots. Positions held with the same slots are neither taken nor
        returned. Does not lock anything: re-match and lock to keep using the prefix.
        ``tokens`` are Python ints; ``slots`` live on one device (CPU) throughout.
        """
        if len(tokens) != slots.numel():
            raise ValueError(f"insert: len(tokens)={len(tokens)} != len(slots)={slots.numel()}")
        n = len(tokens) - len(tokens) % self.page_size
        if self.disable:
            return slots[:n]
        node, pieces = self._walk(self._root(salt), tokens, n)
        pos = sum(p.numel() for p in pieces)
        # Pages already cached but computed again by the caller: [pages, page_size] compare.
        ps = self.page_size
        old = torch.cat(pieces).view(-1, ps) if pieces else _EMPTY.view(0, ps)
        new = slots[:pos].reshape(-1, ps)
        differ = (old != new).any(dim=1)
        dup = new[differ].reshape(-1)
        if self.allocator.window is not None and dup.numel():
            # what the caller computed again may restore windowed KV the tree gave back
            self.allocator.window.adopt((old[differ][:, 0] // ps).tolist(), (new[differ][:, 0] // ps).tolist())
        if pos < n:
            leaf = TreeNode(list(tokens[pos:n]), slots[pos:n].clone(), node)
            leaf.last_access = leaf.score_clock = self._clock
            leaf.start = pos
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable_pages += (n - pos) // ps
            self.version += 1
            if self.events is not None:
                self.events.stored(salt, None if node.parent is None else int(node.value[-1]) // ps, leaf.key,
                                   self.allocator.slots_to_pages(leaf.value))
        return dup

    def divergence(self, tokens: Sequence[int], salt: str | None, limit: int) -> int | None:
        """Where ``tokens`` leave a longer cached sequence, token by token (not
        rounded to pages), if that happens within the first ``limit`` tokens; None
        when they do not diverge there (they match beyond it, or the cache holds
        nothing longer on their path)."""
        node, pos = self._roots.get(salt), 0
        while node is not None and pos < min(limit, len(tokens)):
            best, i = None, 0
            for c in node.children.values():  # page-keyed children may share a first token
                k = 0
                while k < len(c.key) and pos + k < len(tokens) and c.key[k] == tokens[pos + k]:
                    k += 1
                if k > i:
                    best, i = c, k
            if best is None:
                return pos if node.children and pos > 0 else None
            if i < len(best.key):
                return pos + i if pos + i < min(limit, len(tokens)) else None
            node, pos = best, pos + i
        return None

    def record_hit(self, node: TreeNode) -> None:
        """An admitted request reuses the prefix ending at ``node``: count it on the
        path to the root (for the eviction policies)."""
        now = self._clock
        while node.parent is not None:
            node.hits += 1
            node.score = decayed(node.score, node.score_clock, now) + 1.0
            node.score_clock = now
            node = node.parent

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors (the namespace root excluded) against eviction."""
        while node.parent is not None:
            if node.lock_ref == 0:
                pages = len(node.key) // self.page_size
                self._evictable_pages -= pages
                self._locked_pages += pages
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``; raises RuntimeError if a count would go negative."""
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                pages = len(node.key) // self.page_size
                self._evictable_pages += pages
                self._locked_pages -= pages
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages by removing unlocked leaves in
        the policy's order (a parent left childless becomes a candidate). Stops
        early when nothing is evictable. Returns the pages freed."""
        if num_pages <= 0:
            return 0
        now = self._clock
        heap = [(self.policy.key(n, now), id(n), n) for n in self._nodes() if self._is_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            freed += self._remove_leaf(leaf)
            if self._is_evictable(parent):
                heapq.heappush(heap, (self.policy.key(parent, now), id(parent), parent))
        # Drop namespaces left empty (the default one stays).
        self._roots = {s: r for s, r in self._roots.items() if s is None or r.children}
        return freed

    def detach_window(self, num_pages: int, protected: set[int]) -> int:
        """Give back the windowed KV (:class:`~plait.runtime.memory.WindowPages`) of at
        least ``num_pages`` cached pages outside ``protected``, nodes in the eviction
        policy's order, each from its first page on (a match ending at a node's end
        reads the pages before the end). Returns the window pages freed."""
        window = self.allocator.window
        if window is None or num_pages <= 0:
            return 0
        now = self._clock
        freed = 0
        for node in sorted(self._nodes(), key=lambda n: (self.policy.key(n, now), id(n))):
            pages = self.allocator.slots_to_pages(node.value)
            pages = [p for p, a in zip(pages, window.attached(pages)) if a and p not in protected]
            freed += window.detach(pages[: num_pages - freed])
            if freed >= num_pages:
                break
        return freed

    def reset(self) -> None:
        """Flush the cache, returning every page to the allocator (counters are kept)."""
        if self._locked_pages:
            raise RuntimeError(f"reset with {self._locked_pages} locked pages")
        for node in self._nodes():
            self.allocator.free(self.allocator.slots_to_pages(node.value))
        self._roots = {None: self._new_root()}
        self._evictable_pages = 0
        self.version += 1
        if self.events is not None:
            self.events.cleared()

    def drop_namespace(self, salt: str) -> int:
        """Drop the tree of ``salt`` (nothing in it may be locked); returns the pages
        freed. Other namespaces are untouched."""
        root = self._roots.get(salt)
        if root is None:
            return 0
        if root.lock_ref or any(c.lock_ref for c in root.children.values()):
            raise RuntimeError(f"drop_namespace({salt!r}) while its prefixes are in use")
        freed = 0
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            freed += self._free_node(node)
        del self._roots[salt]
        return freed

    def pretty_print(self) -> str:
        """The trees as indented text: token span, slot range, lock_ref, last_access."""
        lines: list[str] = []

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                toks = " ".join(map(str, child.key[:8])) + (" ..." if len(child.key) > 8 else "")
                lines.append(
                    f"{'  ' * depth}[{toks}] len={len(child.key)} slots={child.value[0].item()}.."
                    f" lock={child.lock_ref} t={child.last_access}"
                )
                visit(child, depth + 1)

        for salt, root in self._roots.items():
            lines.append(f"[salt={salt!r}]")
            visit(root, 1)
        return "\n".join(lines)

    # ---- internals ----
    def _new_root(self) -> TreeNode:
        return TreeNode([], _EMPTY)

    def _root(self, salt: str | None) -> TreeNode:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = self._new_root()
        return root

    def _lookup_root(self, salt: str | None) -> TreeNode:
        """The root of ``salt`` for a match: a salt with nothing cached gets an empty root
        that is not kept (a lookup must not keep a namespace per distinct salt a client
        sends; :meth:`insert` registers the namespace, :meth:`evict` drops it when empty)."""
        root = self._roots.get(salt)
        return self._new_root() if root is None else root

    def _child_key(self, key: Sequence[int]) -> Hashable:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _walk(self, node: TreeNode, tokens: Sequence[int], n: int) -> tuple[TreeNode, list[torch.Tensor]]:
        """Follow ``tokens[:n]`` (n page-aligned) from ``node``; split the last node if
        the match ends inside it. Returns the deepest matched node and its slot pieces."""
        self._clock += 1
        node.last_access = self._clock
        pieces: list[torch.Tensor] = []
        pos = 0
        while pos < n:
            child = node.children.get(self._child_key(tokens[pos : pos + self.page_size]))
            if child is None:
                break
            key, limit = child.key, min(len(child.key), n - pos)
            i = 0
            while i < limit and key[i] == tokens[pos + i]:
                i += 1
            i -= i % self.page_size  # >= page_size: the first page matched via the dict
            if i < len(key):
                child = self._split(child, i)
            child.last_access = self._clock
            pieces.append(child.value)
            pos += i
            node = child
            if i < limit:
                break  # diverged inside the node
        return node, pieces

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child`` at page-aligned ``at``; the new parent covers ``key[:at]``."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key) and at % self.page_size == 0
        mid = TreeNode(child.key[:at], child.value[:at], parent)
        mid.lock_ref, mid.last_access, mid.start = child.lock_ref, child.last_access, child.start
        mid.hits, mid.score, mid.score_clock = child.hits, child.score, child.score_clock
        child.start += at
        parent.children[self._child_key(mid.key)] = mid
        child.key, child.value, child.parent = child.key[at:], child.value[at:], mid
        mid.children[self._child_key(child.key)] = child
        return mid

    def _is_evictable(self, node: TreeNode) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _remove_leaf(self, leaf: TreeNode) -> int:
        parent = leaf.parent
        assert parent is not None
        if self.on_evict is not None:
            self.on_evict(*self._path(leaf))
        del parent.children[self._child_key(leaf.key)]
        leaf.parent = None
        self.evicted_tokens += len(leaf.key)
        return self._free_node(leaf)

    def _path(self, node: TreeNode) -> tuple[list[int], torch.Tensor, str | None]:
        """Tokens and slots from the namespace root to the end of ``node``, and the salt."""
        keys: list[list[int]] = []
        values: list[torch.Tensor] = []
        while node.parent is not None:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        salt = next(s for s, root in self._roots.items() if root is node)
        return [t for k in reversed(keys) for t in k], torch.cat(values[::-1]), salt

    def _free_node(self, node: TreeNode) -> int:
        """Return an unlocked node's pages to the allocator."""
        pages = self.allocator.slots_to_pages(node.value)
        if self.events is not None:
            self.events.removed(pages)
        self.allocator.free(pages)
        self._evictable_pages -= len(pages)
        self.version += 1
        return len(pages)

    def held_pages(self) -> list[int]:
        """Every page the tree holds (for invariant checks; walks the whole tree)."""
        return [p for node in self._nodes() for p in self.allocator.slots_to_pages(node.value)]

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node of every namespace."""
        out: list[TreeNode] = []
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
