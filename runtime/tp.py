"""Tensor-parallel execution on ``torch.distributed`` (c10d): gloo on CPU, NCCL on CUDA.

Rank 0 is the :class:`~plait.runtime.Engine` process: it owns the scheduler, the page
allocator, the prefix cache and sampling. Ranks ``1 .. tp_size - 1`` are worker processes
it spawns (``python -m plait.runtime.tp``), each holding one shard of the model
(:mod:`plait.runtime.models.parallel`) and a KV pool of its KV heads with the same page
layout as rank 0's, so rank 0's page ids and page-table rows are valid on every rank.

All ranks are one process group, rendezvoused through a TCP store that rank 0 serves on
``dist_init_addr`` (a free loopback port when none is given).

Multi-node (``nnodes > 1``, SGLang's names): node ``n`` holds ranks
``n * k .. n * k + k - 1`` (``k = tp_size / nnodes``). Node 0's engine process is rank 0
and spawns ranks ``1 .. k - 1``; on every other node :func:`follow` (what ``plait serve
--node-rank n`` runs instead of a server) joins the store, checks that its options are
node 0's, spawns its ``k`` ranks and waits for them. Those nodes run no scheduler and no
front: they only execute the steps rank 0 broadcasts.

Per step rank 0 broadcasts what the workers need, as int64 tensors (no Python
objects):

- ``FORWARD``: the :class:`~plait.runtime.forward_batch.ForwardBatch` tensors
  (input ids, positions, KV slots, page-table rows), its per-request lengths and the
  page-table rows the batch reads, ``[requests, longest context]``; every rank runs the
  same forward over its shard (the row-parallel all-reduces keep the hidden state
  identical on all ranks);
- ``LOGITS``: the hidden rows rank 0 wants logits for; every rank computes its
  vocabulary shard and the shards are all-gathered (rank 0 samples; nothing else comes
  back);
- ``STOP``.

A worker that dies (or a collective that fails) raises :class:`TPError` on rank 0, which
the engine lets through: the engine stops (in a server its process exits, and the front
fails its requests and restarts it), and :meth:`TPWorkers.close` kills the remaining
workers. Workers die with their parent (parent-death signal and a watcher thread); a
worker on another node whose group broke exits, and its node's :func:`follow` returns 1
after killing the others there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import torch

from plait.runtime.attention.base import AttentionBackend
from plait.runtime.config import ATTENTION_BACKENDS, EngineConfig, build_trusted, split_host_port
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.models.parallel import TPGroup

logger = logging.getLogger(__name__)

OP_FORWARD, OP_LOGITS, OP_STOP = 1, 2, 3
HEADER = 6  # op, tokens, requests, extends, decodes, page-table width
# NOTE: no collective timeout: workers wait in a broadcast for rank 0's next step however
# long the server idles. A dead rank is found by its closed connections and by polling
# its process; a rank that hangs alive hangs the group.
_NO_TIMEOUT = datetime.timedelta(days=365)
START_TIMEOUT_S = 300.0
GROUP_KEY = "group"  # rank 0's options, which every node must share (see _group_options)
# options a node may set for itself: the rest must be node 0's
PER_NODE_OPTIONS = ("node_rank", "num_threads")


class TPError(RuntimeError):
    """A rank of the tensor-parallel group died or a collective failed: the engine
    cannot go on (its KV pools may now disagree)."""


def backend_name(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _process_group(store: Any, rank: int, size: int, device: torch.device) -> Any:
    import torch.distributed as dist

    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, _NO_TIMEOUT)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the rank ``local_rank`` of its node: its own GPU on CUDA
    (``cuda:local_rank``), the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def rendezvous(cfg: EngineConfig) -> tuple[str, int]:
    """Where the ranks meet: ``dist_init_addr``, or a free loopback port (0) on one node."""
    return split_host_port(cfg.dist_init_addr) or ("127.0.0.1", 0)


def _group_options(cfg: EngineConfig, device: torch.device) -> dict[str, Any]:
    """What every node of a group must agree on: the engine options but the per-node ones,
    and the device type (which decides gloo or NCCL), as JSON values."""
    values = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_NODE_OPTIONS}
    return json.loads(json.dumps({**values, "device": device.type}))


def _spawn(model: str | None, cfg: EngineConfig, rank: int, local_rank: int, host: str, port: int,
           device: torch.device) -> subprocess.Popen:
    """Start worker ``rank`` (``local_rank`` of this node), joining the store at ``host:port``."""
    spec = {"model": model, "engine": dataclasses.asdict(cfg), "rank": rank, "local_rank": local_rank,
            "host": host, "port": port, "device": device.type, "parent_pid": os.getpid()}
    return subprocess.Popen([sys.executable, "-m", "plait.runtime.tp", json.dumps(spec)])


class TPWorkers:
    """Rank 0's side of the group: the worker processes, the process group and the
    per-step broadcasts. ``start`` spawns the workers and joins the group; the engine
    builds its shard with :attr:`group`, then calls :meth:`serve` with the KV pool's
    geometry once it sized the pool."""

    def __init__(self, group: TPGroup, procs: list[subprocess.Popen], store: Any, device: torch.device,
                 nnodes: int = 1) -> None:
        self.group = group
        self.procs = procs  # this node's workers: ranks 1 .. len(procs)
        self.store = store  # kept alive: the workers' rendezvous server
        self.device = device
        self.nnodes = nnodes
        self.dead = False
        self.serving = False  # the workers took the pool geometry and wait for steps (serve)

    @classmethod
    def start(cls, model: str | None, cfg: EngineConfig, device: torch.device) -> TPWorkers:
        import torch.distributed as dist

        if cfg.node_rank != 0:
            raise ValueError(f"node_rank={cfg.node_rank} is invalid for an engine; allowed: 0 (node "
                             f"{cfg.node_rank} runs no engine, only its ranks: start it with `plait serve "
                             f"--node-rank {cfg.node_rank} ...` or plait.runtime.tp.follow)")
        size = cfg.tp_size
        host, port = rendezvous(cfg)
        try:
            store = dist.TCPStore(host, port, size, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                                  wait_for_workers=False)
        except RuntimeError as e:  # torch's DistNetworkError: the port is taken
            raise TPError(f"cannot listen for the tensor-parallel ranks at dist_init_addr={cfg.dist_init_addr!r}: "
                          f"{e}") from None
        store.set(GROUP_KEY, json.dumps(_group_options(cfg, device)))
        procs = [_spawn(model, cfg, rank, rank, host, store.port, device) for rank in range(1, cfg.local_tp_size)]
        workers = cls(TPGroup(0, size, None), procs, store, device, cfg.nnodes)
        try:
            workers._wait_joined()
            group = TPGroup(0, size, _process_group(store, 0, size, device))
        except BaseException:
            workers.close()
            raise
        workers.group = group
        return workers

    def _wait_joined(self) -> None:
        """Wait until every worker announced itself in the store (polling the processes,
        so a worker that fails to start is an error now, not a rendezvous timeout)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        keys = [f"joined/{rank}" for rank in range(1, self.group.size)]
        while not self.store.check(keys):
            self.check_alive()
            for node in range(1, self.nnodes):
                if self.store.check([f"refused/{node}"]):
                    raise TPError(f"node {node} did not join the tensor-parallel group: "
                                  f"{self.store.get(f'refused/{node}').decode()}")
            if time.monotonic() > deadline:
                missing = [rank for rank in range(1, self.group.size) if not self.store.check([f"joined/{rank}"])]
                hint = " (are the other nodes started with the same --dist-init-addr?)" if self.nnodes > 1 else ""
                raise TPError(f"tensor-parallel ranks {missing} did not join within {START_TIMEOUT_S:.0f} s{hint}")
            time.sleep(0.05)

    def check_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                self.dead = True
                raise TPError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {code}")

    def _collective(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` (a step of the group); any failure of a rank is a TPError."""
        if self.dead:
            raise TPError("a tensor-parallel rank died earlier; the engine must be restarted")
        self.check_alive()
        try:
            return fn(*args)
        except TPError:
            raise
        except RuntimeError as e:
            time.sleep(0.2)  # let a dying worker's exit code land
            try:
                self.check_alive()
            finally:
                self.dead = True
            where = " (a rank on another node died or cannot be reached)" if self.nnodes > 1 else ""
            raise TPError(f"a tensor-parallel collective failed{where}: {e}") from e

    def serve(self, num_slots: int, context_len: int, attn: AttentionBackend) -> None:
        """Tell the workers the KV pool's geometry and attention backend (theirs match
        rank 0's), after which they run steps."""
        name = type(attn).__name__.removesuffix("AttentionBackend").lower()
        geometry = torch.tensor([num_slots, context_len, ATTENTION_BACKENDS.index(name)], dtype=torch.long)
        self._collective(self._bcast, geometry)
        self.serving = True

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        dev = rank_device(self.device, 0)
        if t.device != dev:
            t = t.to(dev)
        return self.group.broadcast(t)

    def model(self, model: torch.nn.Module) -> TPModel:
        """The handle the model runner calls instead of rank 0's shard."""
        return TPModel(model, self)

    def close(self) -> None:
        """Stop the workers (asking first when the group is healthy and serving), then kill
        what is left; idempotent. NOTE: before :meth:`serve` the workers wait in the
        geometry broadcast, where a STOP header (another size) aborts them in gloo: they
        are killed instead."""
        healthy = not self.dead and self.group.pg is not None and all(p.poll() is None for p in self.procs)
        if healthy and self.serving:
            try:
                self._bcast(_header(OP_STOP))
            except RuntimeError:
                pass
        self.dead = True
        deadline = time.monotonic() + (5.0 if self.serving else 0.0)
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _header(op: int, *fields: int) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.long)
    h[0] = op
    h[1 : 1 + len(fields)] = torch.tensor(fields, dtype=torch.long)
    return h


class TPModel:
    """Rank 0's model handle (what :class:`~plait.runtime.model_runner.ModelRunner`
    calls): each call first broadcasts the step to the workers, then runs rank 0's shard
    as one rank of the group."""

    def __init__(self, model: torch.nn.Module, workers: TPWorkers) -> None:
        self.shard = model
        self.workers = workers

    def __call__(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        w = self.workers
        lens = fb.extend_prefix_lens + fb.extend_seq_lens + fb.decode_seq_lens
        seq_lens = [p + n for p, n in zip(fb.extend_prefix_lens, fb.extend_seq_lens)] + fb.decode_seq_lens
        width = max(seq_lens, default=0)
        # the page-table rows this step reads, up to its longest context
        table = fb.req_to_token[fb.req_rows, :width].long().reshape(-1)
        payload = torch.cat([fb.input_ids, fb.positions, fb.out_slots, fb.req_rows,
                             torch.tensor(lens, dtype=torch.long, device=fb.input_ids.device), table])
        w._collective(w._bcast, _header(OP_FORWARD, fb.num_tokens, len(seq_lens), fb.num_extends, fb.num_decodes,
                                        width))
        w._collective(w._bcast, payload)
        return w._collective(self.shard, fb, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.workers
        w._collective(w._bcast, _header(OP_LOGITS, hidden.shape[0]))
        w._collective(w._bcast, hidden.contiguous())
        return w._collective(self.shard.compute_logits, hidden)


# -- worker ----------------------------------------------------------------------------
def _worker_batch(h: list[int], payload: torch.Tensor, table: torch.Tensor) -> ForwardBatch:
    """The ForwardBatch rank 0 broadcast, over this worker's page table (whose rows the
    step reads are written first)."""
    _, t, b, e, d, width = h
    sizes = [t, t, t, b, e, e, d, b * width]
    ids, pos, slots, rows, prefix, ext, dec, rows_table = payload.split(sizes)
    if width:
        table[rows, :width] = rows_table.view(b, width).to(table.dtype)
    return ForwardBatch(ids, pos, slots, rows, table, e, prefix.tolist(), ext.tolist(), dec.tolist())


def worker_main(spec: dict[str, Any]) -> int:
    from plait.runtime.attention.base import create_attention_backend
    from plait.runtime.memory import KVPool, ReqToToken
    from plait.runtime.model_loader import resolve_model
    from plait.runtime.models.registry import model_class
    from plait.runtime.process import exit_when_parent_is_gone, set_parent_death_signal

    import torch.distributed as dist

    set_parent_death_signal()
    exit_when_parent_is_gone(spec["parent_pid"])
    rank = spec["rank"]
    cfg = build_trusted(EngineConfig, spec["engine"])  # validated by the process that spawned this one
    size = cfg.tp_size
    threads = cfg.resolved_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    device = rank_device(torch.device(spec["device"]), spec["local_rank"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, cfg.resolved_dtype())
    torch.manual_seed(cfg.seed)
    store = dist.TCPStore(spec["host"], spec["port"], size, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    group = TPGroup(rank, size, _process_group(store, rank, size, device))

    def bcast(t: torch.Tensor) -> torch.Tensor:
        return group.broadcast(t.to(device))

    source = resolve_model(spec["model"])
    mc = source.load_config()
    triton_ops = cfg.resolved_attention_backend() == "triton"
    context_len = min(cfg.context_length or mc.context_length, mc.context_length)
    with torch.device("meta"):
        model = model_class(mc)(mc, max_pos=context_len, triton_ops=triton_ops, tp=group)
    model = model.materialize(device, dtype)
    model.load_weights(source.iter_weights())
    if cfg.resolved_cpu_gemm() in ("onednn", "native"):
        model.pack_for_cpu(cfg.resolved_cpu_gemm())
    model.eval()
    num_slots, context_len, backend = bcast(torch.zeros(3, dtype=torch.long)).tolist()
    shard = model.config
    ps = cfg.page_size
    pool = KVPool(num_slots, shard.num_layers, shard.num_kv_heads, shard.head_dim, dtype, device, page_size=ps)
    # rank 0's allocator decides which pages are used: all zeroed (a no-op on CPU, where
    # the pool comes zeroed from the OS and untouched pages stay uncommitted)
    pool.zero_pages(list(range(num_slots // ps)))
    req_to_token = ReqToToken(cfg.max_running_requests, context_len, device)
    attn = create_attention_backend(ATTENTION_BACKENDS[backend], pool, shard.num_heads, shard.attention_scale,
                                    tuple(w for w in shard.layer_windows if w))
    with torch.inference_mode():
        while True:
            h = bcast(torch.zeros(HEADER, dtype=torch.long)).tolist()
            if h[0] == OP_STOP:
                return 0
            if h[0] == OP_FORWARD:
                _, t, b, e, d, width = h
                payload = bcast(torch.empty(3 * t + b + 2 * e + d + b * width, dtype=torch.long))
                fb = _worker_batch(h, payload, req_to_token.table)
                model(fb.with_attn_metadata(attn.init_forward(fb)), attn)
            elif h[0] == OP_LOGITS:
                hidden = bcast(torch.empty(h[1], shard.hidden_size, dtype=dtype))
                model.compute_logits(hidden)
            else:
                raise RuntimeError(f"unknown tensor-parallel op {h[0]}")


# -- the other nodes -----------------------------------------------------------------------
def follow(model: str | None, cfg: EngineConfig, announce: bool = False) -> int:
    """Run node ``cfg.node_rank > 0`` of a multi-node group until the group ends: join
    node 0's store at ``dist_init_addr`` (waiting up to :data:`START_TIMEOUT_S` for node
    0 to listen), refuse to join when this node's options differ from node 0's (but the
    :data:`PER_NODE_OPTIONS`) or its ``node_rank`` is taken, then start this node's ranks
    and wait for them. ``model`` is this node's path to the same checkpoint.

    Returns 0 when node 0 stopped the group, 1 when it broke (a rank here exited with an
    error, or node 0 or another node went away: the ranks here then fail their next
    collective), 2 when the join was refused; the ranks left here are killed first."""
    import torch.distributed as dist

    node = cfg.node_rank
    if node == 0:
        raise ValueError("node_rank=0 is invalid for follow(); allowed: 1 .. nnodes - 1 (node 0 runs the engine)")
    host, port = rendezvous(cfg)
    try:
        store = dist.TCPStore(host, port, cfg.tp_size, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    except RuntimeError as e:
        logger.error("cannot reach node 0 at dist_init_addr=%r within %.0f s: %s", cfg.dist_init_addr,
                     START_TIMEOUT_S, e)
        return 2
    device = torch.device(cfg.resolved_device())
    refusal = None
    if store.add(f"node/{node}", 1) != 1:
        refusal = f"node_rank={node} was given to two nodes; give each node its own --node-rank"
    else:
        theirs, ours = json.loads(store.get(GROUP_KEY)), _group_options(cfg, device)
        differ = [k for k in ours if ours[k] != theirs.get(k)]
        if differ:
            refusal = ("its options differ from node 0's: " + ", ".join(f"{k}={ours[k]!r} (node 0: {theirs.get(k)!r})"
                                                                        for k in differ)
                       + "; run the same command on every node, only --node-rank (and --num-threads) differing")
    if refusal is not None:
        store.set(f"refused/{node}", refusal)
        logger.error("node %d cannot join the tensor-parallel group at %s: %s", node, cfg.dist_init_addr, refusal)
        return 2
    first = node * cfg.local_tp_size
    ranks = range(first, first + cfg.local_tp_size)
    procs = [_spawn(model, cfg, rank, rank - first, host, port, device) for rank in ranks]
    if announce:
        print(f"plait node {node} of {cfg.nnodes}: tensor-parallel ranks {ranks[0]}..{ranks[-1]} started, "
              f"following node 0 at {cfg.dist_init_addr}", flush=True)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, code) for rank, code in zip(ranks, codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                logger.error("tensor-parallel rank %d exited with code %d; node %d leaves the group", rank, code, node)
                with contextlib.suppress(RuntimeError):  # tells a node 0 still waiting for the ranks to join
                    store.set(f"refused/{node}", f"rank {rank} exited with code {code} (see node {node}'s log)")
                return 1
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-worker[%(process)d] %(levelname)s: %(message)s")
    sys.exit(worker_main(json.loads(sys.argv[1])))
