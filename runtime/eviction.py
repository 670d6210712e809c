"""Eviction policies of the prefix cache: which unlocked leaf goes first.

A policy is one class with ``key(node, now)``; the cache evicts the leaf with the
smallest key. Nodes carry what the policies read: ``last_access`` (the cache's clock
at the last match through the node), ``hits`` (admitted requests that reused the
node) and a recency-decayed hit score (:meth:`TreeNode.record_hit`), and ``start``
(tokens before the node in its sequence).

- ``lru``: least recently matched first (SGLang's and vLLM's default).
- ``lfu``: fewest reuses first, least recent among equals.
- ``cost``: lowest expected saving first: the decayed hit score (a prefix reused
  often and lately) times the cost of recomputing the node's tokens, which grows with
  their position, since each token's attention reads everything before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.runtime.radix_cache import TreeNode


HIT_HALF_LIFE = 512.0  # clock ticks (matches) for a hit to count half


def decayed(score: float, since: int, now: int) -> float:
    """A hit score recorded at clock ``since``, seen at ``now``."""
    return score * 0.5 ** ((now - since) / HIT_HALF_LIFE)


class EvictionPolicy:
    """Orders unlocked leaves for eviction: smallest ``key`` first."""

    name = ""

    def key(self, node: TreeNode, now: int) -> Any:
        raise NotImplementedError


class LRU(EvictionPolicy):
    name = "lru"

    def key(self, node: TreeNode, now: int) -> Any:
        return node.last_access


class LFU(EvictionPolicy):
    name = "lfu"

    def key(self, node: TreeNode, now: int) -> Any:
        return (node.hits, node.last_access)


class CostAware(EvictionPolicy):
    """``decayed hits * recompute cost``; a node never reused still counts one use (its
    own insertion), so among cold nodes the cheapest to recompute goes first.

    ``attention_tokens``: the context length at which a token's attention costs as much
    as its share of the model's linear layers (about params / (2 * layers * hidden):
    ~4k for small models).
    """

    name = "cost"

    def __init__(self, attention_tokens: int = 4096) -> None:
        self.attention_tokens = attention_tokens

    def recompute_cost(self, node: TreeNode) -> float:
        n = len(node.key)
        return n * (1.0 + (node.start + n / 2) / self.attention_tokens)

    def key(self, node: TreeNode, now: int) -> Any:
        return ((1.0 + decayed(node.score, node.score_clock, now)) * self.recompute_cost(node), node.last_access)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU, CostAware)}


def make_policy(name: str) -> EvictionPolicy:
    if name not in EVICTION_POLICIES:
        raise ValueError(f"eviction_policy={name!r} is invalid; allowed: {', '.join(EVICTION_POLICIES)}")
    return EVICTION_POLICIES[name]()
