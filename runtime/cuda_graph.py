"""CUDA graphs for decode steps.

A decode step of B requests launches a few hundred small kernels (per layer: norms,
GEMMs, rotary, KV store, attention, activation); at small B the GPU waits on the CPU that
launches them. :class:`DecodeGraphRunner` records the whole decode forward (model and
LM head) once per *bucket* of batch sizes and replays it: a step of B requests runs the
graph of the smallest bucket >= B, with the rows past B padded.

Everything a graph reads lives in static buffers, refilled before each replay:
token ids, positions, KV slots, page-table rows and context lengths. Padded rows read
one token of row 0's context and write their K/V to slot 0, the pool's reserved
padding page, which no request ever owns; their logits are dropped. This needs an
attention backend whose decode kernels read their metadata from tensors, with a launch
shape that depends only on the batch size: the ``triton`` backend
(:meth:`~plait.runtime.attention.triton_backend.TritonAttentionBackend.decode_metadata`).

``mode="eager"`` runs the same padded, static-buffer path without recording a graph:
it is how the CPU tests check the bucketing and padding that the CUDA graphs replay.
"""

from __future__ import annotations

import dataclasses

import bisect
import logging

import torch

from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.memory import ReqToToken
from plait.runtime.models.llama import CausalLM
from plait.runtime.staging import Staging

logger = logging.getLogger(__name__)

# Batch sizes a graph is recorded for (up to the engine's limit, which is always added).
# Dense where decode batches are small and graphs matter most.
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_buckets(max_bs: int) -> list[int]:
    """The recorded batch sizes for a limit of ``max_bs`` requests."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    out = [b for b in BUCKETS if b < max_bs]
    return out + [max_bs]


class DecodeGraphRunner:
    """Records and replays decode steps for bucketed batch sizes.

    ``attn`` must offer ``decode_metadata(req_to_token, req_rows, seq_lens)``. After
    :meth:`capture`, :meth:`run` takes a decode-only :class:`ForwardBatch` and returns
    the logits ``[B, vocab]`` (float32) of its rows. ``window_table``: where windowed
    layers have a KV pool of their own, the page table in its slots that the runner
    refills before each step (``ForwardBatch.windowed`` reads it; the graphs record it).
    """

    def __init__(
        self,
        model: CausalLM,
        attn: object,
        req_to_token: ReqToToken,
        max_bs: int,
        device: torch.device,
        mode: str = "cuda",
        window_table: torch.Tensor | None = None,
    ) -> None:
        if mode not in ("cuda", "eager"):
            raise ValueError(f"mode must be 'cuda' or 'eager', got {mode!r}")
        if mode == "cuda" and device.type != "cuda":
            raise ValueError("CUDA graphs need device='cuda'")
        from plait.runtime.attention.triton_backend import TritonAttentionBackend

        if not isinstance(attn, TritonAttentionBackend):
            raise ValueError(f"{type(attn).__name__} cannot run under CUDA graphs; the triton backend can")
        self.model, self.attn, self.req_to_token = model, attn, req_to_token
        self.device, self.mode = device, mode
        self.buckets = graph_buckets(min(max_bs, req_to_token.table.shape[0]))
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.out_slots = torch.zeros(n, dtype=torch.long, device=device)
        self.req_rows = torch.zeros(n, dtype=torch.long, device=device)
        self.window_table = window_table
        self.window_out_slots = torch.zeros(n, dtype=torch.long, device=device) if window_table is not None else None
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served by a graph (or its eager stand-in)
        self._staging = Staging(device, torch.int32)

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def bucket(self, bs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, bs)]

    def _forward_batch(self, bs: int) -> ForwardBatch:
        fb = ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            req_rows=self.req_rows[:bs],
            req_to_token=self.req_to_token.table,
            num_extends=0,
            extend_prefix_lens=[],
            extend_seq_lens=[],
            decode_seq_lens=[1] * bs,  # placeholders: the kernels read self.seq_lens
            attn_metadata=self.attn.decode_metadata(self.req_to_token.table, self.req_rows[:bs], self.seq_lens[:bs]),
        )
        if self.window_table is not None:
            fb.windowed = dataclasses.replace(fb, out_slots=self.window_out_slots[:bs], req_to_token=self.window_table)
        return fb

    @torch.inference_mode()
    def _step(self, bs: int) -> torch.Tensor:
        fb = self._forward_batch(bs)
        return self.model.compute_logits(self.model(fb, self.attn))

    def capture(self) -> None:
        """Record one graph per bucket, largest first (the others reuse its memory)."""
        self._pad(0)
        if self.mode == "eager":
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    self._step(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._logits[bs] = self._step(bs)
                self._graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _pad(self, start: int) -> None:
        self.input_ids[start:].zero_()
        self.positions[start:].zero_()
        self.out_slots[start:].zero_()  # slot 0: the reserved padding page
        if self.window_out_slots is not None:
            self.window_out_slots[start:].zero_()  # (the window pool's sink)
        self.req_rows[start:].zero_()
        self.seq_lens[start:].fill_(1)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits of the decode-only step ``fb``, from the graph of its bucket."""
        bs = fb.num_decodes
        if fb.num_extends or not 1 <= bs <= self.max_bs:
            raise ValueError(
                f"a graph replays decode-only steps of 1..{self.max_bs} requests; got {fb.num_extends} extends "
                f"and {bs} decodes"
            )
        g = self.bucket(bs)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_slots[:bs].copy_(fb.out_slots)
        if self.window_out_slots is not None:
            self.window_out_slots[:bs].copy_(fb.windowed.out_slots)
        self.req_rows[:bs].copy_(fb.req_rows)
        (lens,) = self._staging.to_device(fb.decode_seq_lens)
        self.seq_lens[:bs].copy_(lens)
        if g > bs:
            self._pad(bs)
        self.replays += 1
        if self.mode == "eager":
            return self._step(g)[:bs]
        self._graphs[g].replay()
        return self._logits[g][:bs]
