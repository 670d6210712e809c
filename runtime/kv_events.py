"""KV-cache events in vLLM's format, for routers that route on exact cache contents
(SMG's event-driven mode, Dynamo, llm-d).

A prefix cache (:class:`~plait.runtime.radix_cache.RadixCache` and
:class:`~plait.runtime.block_cache.BlockHashCache`) reports the pages that enter and
leave it to a :class:`KVEventSink` (its ``events`` attribute; None: no events). The
sink turns them into vLLM's events:

- ``BlockStored``: one per page that entered the cache, its hash chained to the page
  before it (``parent_block_hash``; None for a sequence's first page), with the page's
  token ids;
- ``BlockRemoved``: the hashes of pages that left (eviction, a namespace dropped);
- ``AllBlocksCleared``: the whole cache was flushed.

``medium`` names the tier holding the page (:func:`tier_media`): the device pool, or
the host-memory tier (:mod:`plait.runtime.hicache`), whose tree reports its pages to a
sink of its own, so a page both tiers hold is stored twice, once per medium.

A page's hash is ``h(parent hash, page tokens)``, the first page's parent being the
request's ``cache_salt``, so two tenants' identical prompts never share a hash. Hashes
are non-negative 63-bit integers (they fit the signed and unsigned 64-bit integers
subscribers decode them as). A radix node holding several pages gives one event per
page; splitting a node changes nothing (the pages are the same).

:class:`KVEventPublisher` sends the events of each engine step as one
``KVEventBatch(ts, events, data_parallel_rank)`` on a ZMQ PUB socket, framed as vLLM's
publisher does: ``[topic, sequence number (8 bytes, big-endian), msgpack payload]``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any, Union

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the cache events (tagged by class name on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(EventBatch):
    events: list[KVEvent]


_HASH_MASK = (1 << 63) - 1


def tier_media(device_type: str) -> tuple[str, str]:
    """The ``medium`` of the device pool's events and of the host tier's: vLLM's
    ``GPU`` and ``CPU`` (its name for KV offloaded to host memory) on CUDA; on a CPU
    engine the device pool is ``CPU`` and the host tier ``CPU_HOST``, so a subscriber
    keeping blocks by (medium, hash) tells the two tiers apart."""
    return ("GPU", "CPU") if device_type == "cuda" else ("CPU", "CPU_HOST")


def page_hash(parent: int | None, tokens: Sequence[int], salt: str | None = None) -> int:
    """The hash of one page: chained to ``parent`` (the page before it), or to ``salt``
    for a sequence's first page (``parent`` None)."""
    if parent is not None:
        seed = parent.to_bytes(8, "little")
    else:
        seed = b"\x00" if salt is None else b"\x01" + salt.encode()
    body = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.blake2b(seed + body, digest_size=8).digest(), "little") & _HASH_MASK


def prefix_hashes(tokens: Sequence[int], page_size: int, salt: str | None = None) -> list[int]:
    """The chained hashes of the whole pages of ``tokens`` (what a router computes for a
    prompt to look it up)."""
    out: list[int] = []
    parent = None
    for pos in range(0, len(tokens) - len(tokens) % page_size, page_size):
        parent = page_hash(parent, tokens[pos : pos + page_size], salt)
        out.append(parent)
    return out


class KVEventSink:
    """Where a prefix cache reports pages entering and leaving it. Keeps the hash of
    every cached page (by page id) and the events not yet taken.

    Invariant: ``hashes`` holds exactly the pages the cache holds."""

    def __init__(self, page_size: int, medium: str) -> None:
        self.page_size = page_size
        self.medium = medium
        self.hashes: dict[int, int] = {}  # page id -> its hash
        self.pending: list[KVEvent] = []

    def stored(self, salt: str | None, parent_page: int | None, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """``pages`` (holding ``tokens``, ``page_size`` each) entered the cache after
        ``parent_page`` (None: at the start of a sequence of namespace ``salt``)."""
        ps = self.page_size
        parent = None if parent_page is None else self.hashes[parent_page]
        for i, page in enumerate(pages):
            page_tokens = list(tokens[i * ps : (i + 1) * ps])
            h = page_hash(parent, page_tokens, salt)
            self.hashes[page] = h
            self.pending.append(BlockStored([h], parent, page_tokens, ps, None, self.medium))
            parent = h

    def removed(self, pages: Sequence[int]) -> None:
        """``pages`` left the cache."""
        hashes = [self.hashes.pop(p) for p in pages]
        if hashes:
            self.pending.append(BlockRemoved(hashes, self.medium))

    def cleared(self) -> None:
        """Every page left the cache."""
        self.hashes.clear()
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call, in order."""
        events, self.pending = self.pending, []
        return events


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel replica ``rank``: the TCP port plus ``rank``
    (``tcp://*:5557`` -> ``tcp://*:5558`` for rank 1), or ``_dp{rank}`` appended to an
    ipc/inproc path; rank 0 keeps ``endpoint``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def check_endpoint(endpoint: str | None) -> bool:
    """True for None or a ZMQ endpoint a publisher can use (``tcp://HOST:PORT``,
    ``ipc://PATH``, ``inproc://NAME``)."""
    if endpoint is None:
        return True
    if not isinstance(endpoint, str):
        return False
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        return bool(host) and port.isdigit() and 0 < int(port) < 65536
    return endpoint.startswith(("ipc://", "inproc://")) and len(endpoint) > len("ipc://")


class KVEventPublisher:
    """A ZMQ PUB socket sending :class:`KVEventBatch` messages as
    ``[topic, seq (8 bytes big-endian), payload]``. As vLLM's publisher, it binds an
    endpoint with a wildcard host (``tcp://*:5557``) or an ipc/inproc path, and
    connects to any other (``tcp://router-host:5557``, a subscriber that binds)."""

    def __init__(self, endpoint: str, data_parallel_rank: int = 0, topic: str = "") -> None:
        self.endpoint = offset_endpoint(endpoint, data_parallel_rank)
        self.rank = data_parallel_rank
        self.topic = topic.encode()
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 1000)
        if "*" in self.endpoint or "::" in self.endpoint or not self.endpoint.startswith("tcp://"):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        """Send ``events`` as one batch (nothing when empty); a subscriber that reads too
        slowly loses batches (it sees the gap in the sequence numbers)."""
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self.rank))
        try:
            self._pub.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            pass  # over the high-water mark: dropped, as PUB sockets do
        self._seq += 1

    @property
    def sent(self) -> int:
        """Batches published so far (the next batch's sequence number)."""
        return self._seq

    def close(self) -> None:
        self._pub.close()
        self._ctx.term()


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published payload as a :class:`KVEventBatch` (for subscribers and tests)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
