"""KV-cache events: a subscriber that replays what the engine publishes rebuilds exactly
the set of page prefixes the prefix cache holds — across inserts, evictions, flushes
(whole and per salt) and salted requests; in process and over a launched server; with
the host-memory tier, per medium: the device pool's and the host tier's."""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from plait.runtime import Engine
from plait.runtime.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, offset_endpoint, page_hash, prefix_hashes, tier_media,
)
from plait.runtime.radix_cache import RadixCache, TreeNode
from plait.runtime.server import launch

PAGE = 4
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 3}


class Replayer:
    """A SUB socket and the cache contents its events describe: hash -> (parent, tokens),
    of the stores and removals of one ``medium`` (None: any)."""

    def __init__(self, endpoint: str, medium: str | None = None) -> None:
        self.medium = medium
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.last_seq = -1
        self.ranks: set[int | None] = set()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()

    def _apply(self, frames: list[bytes]) -> list[Any]:
        topic, seq, payload = frames
        assert topic == b""
        seq_no = int.from_bytes(seq, "big")
        if self.last_seq >= 0:
            assert seq_no == self.last_seq + 1, "a batch was lost"
        self.last_seq = seq_no
        batch = decode_batch(payload)
        self.ranks.add(batch.data_parallel_rank)
        for e in batch.events:
            if isinstance(e, (BlockStored, BlockRemoved)) and self.medium is not None and e.medium != self.medium:
                continue
            if isinstance(e, BlockStored):
                assert len(e.block_hashes) == 1 and e.block_size == PAGE and len(e.token_ids) == PAGE
                assert e.block_hashes[0] not in self.blocks
                assert e.parent_block_hash is None or e.parent_block_hash in self.blocks
                self.blocks[e.block_hashes[0]] = (e.parent_block_hash, tuple(e.token_ids))
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    del self.blocks[h]
            else:
                assert isinstance(e, AllBlocksCleared)
                self.blocks.clear()
        return batch.events

    def sync(self, flush: Any) -> None:
        """Flush until a subscriber sees the AllBlocksCleared (PUB drops messages sent
        before the subscription reached it); from then on it has every batch."""
        for _ in range(400):
            flush()
            if self.sub.poll(50) and any(isinstance(e, AllBlocksCleared) for e in self._apply(self.sub.recv_multipart())):
                while self.sub.poll(50):  # what the other flushes of this loop sent
                    self._apply(self.sub.recv_multipart())
                return
        raise AssertionError("no events reached the subscriber")

    def catch_up(self, published: int) -> None:
        """Read until the batch numbered ``published - 1`` (the publisher's count)."""
        while self.last_seq < published - 1:
            assert self.sub.poll(30_000), f"batch {self.last_seq + 1} of {published} never came"
            self._apply(self.sub.recv_multipart())

    def prefixes(self) -> set[tuple[int, tuple[int, ...]]]:
        """(hash, every token from the sequence start to the page's end) of each page."""
        out = set()
        for h in self.blocks:
            tokens: list[tuple[int, ...]] = []
            node: int | None = h
            while node is not None:
                parent, toks = self.blocks[node]
                tokens.append(toks)
                node = parent
            out.add((h, tuple(t for toks in reversed(tokens) for t in toks)))
        return out


def cache_prefixes(tree: RadixCache) -> set[tuple[int, tuple[int, ...]]]:
    """The same set from a walk of a radix tree (hashes computed from the tokens, so a
    wrong parent, salt or token in an event shows up)."""
    out = set()

    def visit(node: TreeNode, prefix: list[int], salt: str | None) -> None:
        for child in node.children.values():
            full = prefix + child.key
            hashes = prefix_hashes(full, PAGE, salt)
            for i in range(len(prefix) // PAGE, len(full) // PAGE):
                out.add((hashes[i], tuple(full[: (i + 1) * PAGE])))
            visit(child, full, salt)

    for salt, root in tree._roots.items():
        visit(root, [], salt)
    return out


def test_page_hashes_chain_and_fold_the_salt_in():
    a = prefix_hashes(list(range(12)), PAGE)
    assert len(a) == 3 and a[1] == page_hash(a[0], [4, 5, 6, 7])
    assert prefix_hashes(list(range(8)), PAGE) == a[:2]  # a prefix's pages are the same pages
    salted = prefix_hashes(list(range(12)), PAGE, "tenant-a")
    assert not set(salted) & set(a) and not set(salted) & set(prefix_hashes(list(range(12)), PAGE, "tenant-b"))
    assert all(0 <= h < 2**63 for h in a + salted)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("ipc:///x", 0) == "ipc:///x"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_wire_format_is_vllms_array_like_tagged_structs():
    """What a vLLM subscriber decodes: [ts, [[tag, fields...]...], rank]."""
    from plait.runtime.kv_events import KVEventBatch

    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(
        1.5, [BlockStored([7], None, [1, 2, 3, 4], 4, None, "CPU"), BlockRemoved([7], "CPU"), AllBlocksCleared()], 0)))
    assert raw == [1.5, [["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "CPU"], ["BlockRemoved", [7], "CPU"],
                         ["AllBlocksCleared"]], 0]


@pytest.mark.parametrize("mode", ["radix", "block_hash"])
def test_replayed_events_rebuild_the_cache(tiny_model_factory, tmp_path, mode):
    endpoint = f"ipc://{tmp_path}/kv.sock"
    engine = Engine(str(tiny_model_factory("llama")), num_threads=1, page_size=PAGE, kv_cache_tokens=160,
                    max_running_requests=4, kv_events_endpoint=endpoint, prefix_cache_mode=mode)
    sub = Replayer(endpoint)
    try:
        sub.sync(engine.flush_cache)

        def check() -> None:
            sub.catch_up(engine._kv_publisher.sent)
            engine.check_invariants()
            cached = engine.cache.cached_pages
            assert len(sub.blocks) == cached
            if mode == "radix":
                assert sub.prefixes() == cache_prefixes(engine.cache)
            else:  # block_hash: interior blocks may go first; every held block is one event's
                assert sorted(t for _, t in sub.blocks.values()) == sorted(tuple(b.key) for b in engine.cache._nodes())

        shared = list(range(100, 120))
        prompts = [shared + [200 + i, 300 + i, 7, 8, 9] for i in range(3)]
        for p in prompts:
            engine.generate(input_ids=p, sampling_params=GREEDY)
        check()
        assert len(sub.blocks) > 0
        # the same prompt in two namespaces: same tokens, other hashes
        for salt in ("tenant-a", "tenant-b"):
            engine.generate(input_ids=prompts[0], sampling_params=GREEDY, cache_salt=salt)
        check()
        first = {h for h, _ in sub.prefixes()} if mode == "radix" else set(sub.blocks)
        assert prefix_hashes(prompts[0], PAGE, "tenant-a")[0] in first
        assert prefix_hashes(prompts[0], PAGE, "tenant-b")[0] in first
        # enough distinct prompts that the 40-page pool evicts
        evicted = engine.cache.evicted_tokens
        for i in range(8):
            engine.generate(input_ids=[1000 + 31 * i + j for j in range(24)], sampling_params=GREEDY)
        assert engine.cache.evicted_tokens > evicted
        check()
        # one namespace dropped, the other kept
        engine.generate(input_ids=prompts[1], sampling_params=GREEDY, cache_salt="tenant-a")
        engine.generate(input_ids=prompts[2], sampling_params=GREEDY, cache_salt="tenant-b")
        check()
        assert engine.flush_cache("tenant-a")
        check()
        assert prefix_hashes(prompts[2], PAGE, "tenant-b")[0] in sub.blocks
        assert engine.flush_cache()
        check()
        assert not sub.blocks
        assert sub.ranks == {0}
    finally:
        sub.close()
        engine.shutdown()


def test_host_tier_events_carry_their_medium(tiny_model_factory, tmp_path):
    """With the host-memory tier, pages written to the host are stored, and pages the host
    evicts removed, under the host tier's medium: a subscriber per medium rebuilds each
    tier's page prefixes, through write-back evictions, copies back, host evictions and
    flushes."""
    endpoint = f"ipc://{tmp_path}/kv.sock"
    engine = Engine(str(tiny_model_factory("llama")), num_threads=1, page_size=PAGE, kv_cache_tokens=96,
                    max_running_requests=2, kv_events_endpoint=endpoint, enable_hierarchical_cache=True,
                    hicache_ratio=2.0)
    device_medium, host_medium = tier_media("cpu")
    assert device_medium != host_medium and tier_media("cuda") == ("GPU", "CPU")
    subs = {device_medium: Replayer(endpoint, device_medium), host_medium: Replayer(endpoint, host_medium)}
    try:
        for sub in subs.values():
            sub.sync(engine.flush_cache)

        def check() -> None:
            for medium, tree in ((device_medium, engine.cache), (host_medium, engine.tier.tree)):
                subs[medium].catch_up(engine._kv_publisher.sent)
                assert subs[medium].prefixes() == cache_prefixes(tree)
                assert len(subs[medium].blocks) == tree.cached_pages
            engine.check_invariants()

        # 8 prompts of 40 tokens through a 24-page pool: the first ones are written back to
        # the host, and the host (46 pages) evicts some in turn
        prompts = [[1000 + 53 * i + j for j in range(40)] for i in range(8)]
        for p in prompts:
            engine.generate(input_ids=p, sampling_params=GREEDY)
        check()
        assert engine.tier.tree.evicted_tokens > 0
        host_hashes = set(subs[host_medium].blocks)
        assert prefix_hashes(prompts[-3], PAGE)[0] in host_hashes  # the same hash the device had
        # the latest ones again: copied back from the host, stored on the device again
        loaded = engine.tier.loaded_tokens
        for p in prompts[-3:]:
            engine.generate(input_ids=p, sampling_params=GREEDY)
        assert engine.tier.loaded_tokens > loaded
        check()
        assert set(subs[device_medium].blocks) & set(subs[host_medium].blocks)  # pages in both tiers
        # a salted namespace in both tiers, flushed from both
        engine.generate(input_ids=prompts[0], sampling_params=GREEDY, cache_salt="tenant-a")
        for p in prompts[4:]:  # pushes tenant-a's prompt to the host
            engine.generate(input_ids=p, sampling_params=GREEDY)
        check()
        salted = prefix_hashes(prompts[0], PAGE, "tenant-a")[0]
        assert salted in subs[host_medium].blocks
        assert engine.flush_cache("tenant-a")
        check()
        assert salted not in subs[host_medium].blocks and salted not in subs[device_medium].blocks
        assert engine.flush_cache()
        check()
        assert not subs[device_medium].blocks and not subs[host_medium].blocks
    finally:
        for sub in subs.values():
            sub.close()
        engine.shutdown()


def test_events_from_a_launched_server(tiny_model_factory, tmp_path):
    """Over a real server: a client that subscribes holds exactly the cached pages
    (count from /server_info), the prompts' page hashes, then nothing after a flush."""
    endpoint = f"ipc://{tmp_path}/kv.sock"
    with launch(str(tiny_model_factory("llama")), num_threads=1, page_size=PAGE, kv_cache_tokens=4096,
                kv_events_endpoint=endpoint, echo_logs=False) as rt, httpx.Client(base_url=rt.url, timeout=60) as http:
        sub = Replayer(endpoint)
        try:
            sub.sync(lambda: http.post("/flush_cache"))
            prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14 + i] for i in range(3)]
            for i, p in enumerate(prompts):
                salt = "tenant-a" if i == 2 else None
                r = http.post("/generate", json={"input_ids": p, "sampling_params": GREEDY,
                                                 **({"cache_salt": salt} if salt else {})})
                assert r.status_code == 200, r.text
            info = _idle_info(http)
            sub.catch_up(info["kv_events_published"])
            assert len(sub.blocks) == info["pool"]["evictable"] + info["pool"]["locked"]
            hashes = {h for h, _ in sub.prefixes()}
            for i, p in enumerate(prompts):
                assert set(prefix_hashes(p, PAGE, "tenant-a" if i == 2 else None)) <= hashes
            assert http.post("/flush_cache").status_code == 200
            sub.catch_up(http.get("/server_info").json()["kv_events_published"])
            assert not sub.blocks
        finally:
            sub.close()


def _idle_info(http: httpx.Client) -> dict[str, Any]:
    for _ in range(400):
        info = http.get("/server_info").json()
        if info["running"] == 0 and info["waiting"] == 0 and info["in_flight"] == 0:
            return info
        time.sleep(0.025)
    raise AssertionError(f"server did not become idle: {info}")
