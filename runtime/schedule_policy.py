"""Order of the waiting queue: prefix-aware (``lpm``, ``dfs-weight``) or ``fcfs``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from plait.runtime.radix_cache import RadixCache
from plait.runtime.request import Req

# Past this many waiting requests, probing the tree for each costs more than the
# order gains; fall back to arrival order (as SGLang does).
MAX_PREFIX_AWARE_QUEUE = 256


def order_waiting(policy: str, waiting: list[Req], cache: RadixCache) -> list[Req]:
    """Return ``waiting`` in admission order. Stable: ties keep arrival order."""
    if policy == "fcfs" or cache.disable or len(waiting) > MAX_PREFIX_AWARE_QUEUE:
        return list(waiting)
    matches = {id(r): cache.match_prefix(r.token_ids, r.kv_namespace, max_len=r.max_prefix_len()) for r in waiting}
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -matches[id(r)].length)
    if policy == "dfs-weight":
        return _dfs_weight(waiting, {id(r): matches[id(r)].node for r in waiting})
    raise ValueError(f"schedule_policy must be one of lpm, dfs-weight, fcfs; got {policy!r}")


def _dfs_weight(waiting: list[Req], nodes: dict[int, Any]) -> list[Req]:
    """Walk the radix tree depth-first, heavier subtrees (more waiting requests under
    them) first, so requests that share a prefix are admitted together."""
    weight: dict[int, int] = defaultdict(int)
    by_node: dict[int, list[Req]] = defaultdict(list)
    children: dict[int, list[Any]] = defaultdict(list)
    roots: list[Any] = []
    seen: set[int] = set()
    for r in waiting:
        node = nodes[id(r)]
        by_node[id(node)].append(r)
        while node is not None:
            weight[id(node)] += 1
            if id(node) not in seen:
                seen.add(id(node))
                if node.parent is None:
                    roots.append(node)
                else:
                    children[id(node.parent)].append(node)
            node = node.parent
    # post-order: heavier children first, a node's own requests after its subtree, so
    # the longest matches go first and siblings that share a prefix stay adjacent
    out: list[Req] = []
    stack: list[tuple[Any, bool]] = [(n, False) for n in sorted(roots, key=lambda n: weight[id(n)])]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(by_node[id(node)])
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in sorted(children[id(node)], key=lambda n: weight[id(n)]))
    return out
