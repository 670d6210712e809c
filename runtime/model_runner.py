"""Builds the batch tensors for a scheduled step, runs the model, samples."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

import torch

from plait.runtime.attention.base import AttentionBackend
from plait.runtime.constrained.mask import apply_grammar_masks, apply_packed_masks
from plait.runtime.cuda_graph import DecodeGraphRunner
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.memory import ReqToToken
from plait.runtime.models.llama import CausalLM
from plait.runtime.request import Req
from plait.runtime.sampler import Sampler, token_logprobs
from plait.runtime.scheduler import ScheduleBatch
from plait.runtime.speculative import Draft
from plait.runtime.models.fused_decode import FusedDecoder
from plait.runtime.staging import Staging


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        req_to_token: ReqToToken,
        device: torch.device,
        eos_ids: Sequence[int],
        graphs: DecodeGraphRunner | None = None,
        long_rope_offset: int = 0,
        window_table: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        # longrope: long-rope requests' rotary rows start here (models.llama.long_rope_offset)
        self.long_rope_offset = long_rope_offset
        self.attn = attn
        self.req_to_token = req_to_token
        self.device = device
        self.mask_time_s = 0.0  # grammar masking, for benchmarks
        self.mask_steps = 0
        self.graphs = graphs  # decode CUDA graphs (CUDA + triton backend), or None
        self.mixed_graph_steps = 0  # steps whose decode rows replayed a graph beside extends
        self.staging = Staging(device, torch.long)  # the step's index lists, one transfer
        self.sampler = Sampler(req_to_token.table.shape[0], device, eos_ids)
        # the page table in the windowed layers' pool (plait.runtime.memory.WindowPages),
        # like req_to_token: each step's rows translated into it; None without that pool
        self._window_table = window_table
        # decode-only steps of a quantized CPU model in one native call
        # (plait.runtime.models.fused_decode), or None; the engine sets it
        self.fused: FusedDecoder | None = None

    def build_forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        """Verifying requests are extends of their last token and their drafts."""
        ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []  # the page-table row of each token
        spans = list(batch.extends) + [(r, 1 + len(d.tokens)) for r, d in batch.verifies]
        for r, n in batch.extends:
            start = r.num_computed
            ids.extend(r.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            token_rows.extend([r.row] * n)
        for r, d in batch.verifies:
            ids.extend(r.token_ids[r.num_computed :] + d.tokens)
            positions.extend(range(r.num_computed, r.num_computed + 1 + len(d.tokens)))
            token_rows.extend([r.row] * (1 + len(d.tokens)))
        for r in batch.decodes:
            ids.append(r.last_token)
            positions.append(r.num_computed)
            token_rows.append(r.row)
        table = self.req_to_token.table
        input_ids, pos, rows, req_rows = self.staging.to_device(ids, positions, token_rows, [r.row for r in batch.reqs])
        rope_pos = pos
        if self.long_rope_offset and any(r.long_rope for r in batch.reqs):
            # each token's rotary rows by its page-table row: long-rope requests' start later
            by_row = torch.zeros(table.shape[0], dtype=torch.long)
            by_row[[r.row for r in batch.reqs if r.long_rope]] = self.long_rope_offset
            rope_pos = pos + by_row.to(pos.device)[rows]
        fb = ForwardBatch(
            input_ids=input_ids,
            positions=rope_pos,
            out_slots=table[rows, pos].long(),  # one gather: the slot of every token
            req_rows=req_rows,
            req_to_token=table,
            num_extends=len(spans),
            extend_prefix_lens=[r.num_computed for r, _ in spans],
            extend_seq_lens=[n for _, n in spans],
            decode_seq_lens=[r.num_computed + 1 for r in batch.decodes],
        )
        if self._window_table is not None:
            slot_map = self.attn.pool.window.slot_map
            width = max(positions) + 1
            self._window_table[req_rows, :width] = slot_map[table[req_rows, :width].long()].to(table.dtype)
            fb.windowed = dataclasses.replace(fb, out_slots=slot_map[fb.out_slots], req_to_token=self._window_table)
        return fb

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch) -> dict[str, list[int]]:
        """Run one step. Records logprobs on the requests; returns the tokens of every
        request that catches up this step (keyed by request id): the sampled one, or
        for a request verifying drafts the accepted drafts and one more."""
        if batch.new_pages:
            self.attn.pool.zero_pages(batch.new_pages)
        fb = self.build_forward_batch(batch)
        # decode rows replay a CUDA graph; in a mixed step the extend rows run eagerly
        # beside them (one more pass over the weights, but no per-kernel launches for
        # the decodes, which is what dominates a mixed step at small decode batches)
        graph_logits = None
        if self.graphs is not None and 1 <= fb.num_decodes <= self.graphs.max_bs:
            if not batch.extends and not batch.verifies:
                return self._sample(self.graphs.run(fb), list(batch.decodes))
            fb, decode_fb = fb.split()
            graph_logits = self.graphs.run(decode_fb)
            self.mixed_graph_steps += 1
        if self.fused is not None and not batch.verifies and self.fused.applies(fb):
            hidden = self.fused.forward(fb)
        else:
            fb = fb.with_attn_metadata(self.attn.init_forward(fb))
            hidden = self.model(fb, self.attn)

        # rows of `hidden` that need logits: input-logprob rows, then sampling rows
        lp_rows: list[int] = []
        lp_spans: list[tuple[Req, int, int]] = []  # (req, first token position, count)
        sample_rows: list[int] = []
        sample_reqs: list[Req] = []
        next_rows: list[int] = []  # prompts that end here and sample nothing
        next_reqs: list[Req] = []
        offset = 0
        for r, n in batch.extends:
            start = r.num_computed
            lp = r.logprobs
            if lp is not None and not lp.input_done:
                if start == 0 and lp.start_len == 0 and not lp.input_token:
                    # the first prompt token has no context to be predicted from
                    lp.input_token.append([None, r.token_ids[0]])
                    lp.input_top.append(None)
                # hidden at position p predicts token p + 1; tokens from logprob_start_len
                # (>= 1) to the end of the prompt
                lo = max(start, lp.input_pos - 1)
                hi = min(start + n, r.prompt_len - 1)
                if hi > lo:
                    lp_rows.extend(range(offset + lo - start, offset + hi - start))
                    lp_spans.append((r, lo + 1, hi - lo))
                if start + n >= r.prompt_len:
                    lp.input_done = True
            if start + n == r.seq_len and r.params.max_new_tokens > 0:
                sample_rows.append(offset + n - 1)
                sample_reqs.append(r)
            elif start + n == r.seq_len and lp is not None and lp.top_n > 0:
                # max_new_tokens=0: the next token's top logprobs, nothing sampled (SGLang)
                next_rows.append(offset + n - 1)
                next_reqs.append(r)
            offset += n
        verify_rows = list(range(offset, offset + batch.num_draft_tokens + len(batch.verifies)))
        offset += len(verify_rows)  # every position of a verifying request gets logits
        if graph_logits is None:
            sample_rows.extend(offset + i for i in range(len(batch.decodes)))
        sample_reqs.extend(batch.decodes)  # decodes always sample (max_new_tokens > 0)

        rows = lp_rows + next_rows + verify_rows + sample_rows
        if not rows and graph_logits is None:
            return {}
        if rows == list(range(hidden.shape[0])):  # every row, in order (a decode-only step): no gather
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        if graph_logits is not None:  # the decode rows come last
            logits = torch.cat([logits, graph_logits])
        if lp_rows:
            self._record_input_logprobs(logits[: len(lp_rows)], lp_spans)
        skip = len(lp_rows) + len(next_rows)
        if next_rows:
            self._record_next_top(logits[len(lp_rows) : skip], next_reqs)
        out = self._verify(logits[skip : skip + len(verify_rows)], batch.verifies) if verify_rows else {}
        out.update(self._sample(logits[skip + len(verify_rows) :], sample_reqs))
        return out

    def _verify(self, logits: torch.Tensor, verifies: list[tuple[Req, Draft]]) -> dict[str, list[int]]:
        """Grammar masks, verification and output logprobs for requests with drafts:
        ``logits`` has ``1 + len(draft)`` rows per request, in order."""
        starts, at = [], 0
        for _, d in verifies:
            starts.append(at)
            at += 1 + len(d.tokens)
        want_lp = [i for i, (r, _) in enumerate(verifies) if r.return_logprob]
        lp_rows = [starts[i] + j for i in want_lp for j in range(1 + len(verifies[i][1].tokens))]
        raw_lp = logits[lp_rows].log_softmax(-1) if want_lp else None
        masked = [(starts[i] + j, m) for i, (_, d) in enumerate(verifies) if d.masks is not None
                  for j, m in enumerate(d.masks)]
        if masked:
            t0 = time.perf_counter()
            apply_packed_masks(logits, [m for _, m in masked], [row for row, _ in masked])
            self.mask_time_s += time.perf_counter() - t0
            self.mask_steps += 1
        reqs = [r for r, _ in verifies]
        accepted = self.sampler.verify(logits, reqs, [d.tokens for _, d in verifies])
        if raw_lp is not None:
            # entries for every token of the step, from its own row (as a one-token step would)
            first = dict(zip(want_lp, itertools.accumulate([0] + [1 + len(verifies[i][1].tokens) for i in want_lp])))
            pick = [first[i] + j for i in want_lp for j in range(len(accepted[i]))]
            toks = [t for i in want_lp for t in accepted[i]]
            top_n = max(reqs[i].logprobs.top_n for i in want_lp)
            chosen, top = token_logprobs(raw_lp[pick], toks, top_n)
            k = 0
            for i in want_lp:
                lp = reqs[i].logprobs
                for t in accepted[i]:
                    lp.output_token.append([chosen[k], t])
                    if lp.top_n > 0:
                        lp.output_top.append(top[k][: lp.top_n])
                    k += 1
        return {r.rid: toks for r, toks in zip(reqs, accepted)}

    def _sample(self, sample_logits: torch.Tensor, sample_reqs: list[Req]) -> dict[str, list[int]]:
        """Grammar masks, sampling and output logprobs for one row per request."""
        want_lp = [i for i, r in enumerate(sample_reqs) if r.return_logprob]
        raw_lp = sample_logits[want_lp].log_softmax(-1) if want_lp else None
        if any(r.grammar is not None for r in sample_reqs):
            t0 = time.perf_counter()
            apply_grammar_masks(sample_logits, sample_reqs)
            self.mask_time_s += time.perf_counter() - t0
            self.mask_steps += 1
        next_ids = self.sampler.sample(sample_logits, sample_reqs)
        if raw_lp is not None:
            states = [sample_reqs[i].logprobs for i in want_lp]
            top_n = max(lp.top_n for lp in states)
            chosen, top = token_logprobs(raw_lp, [next_ids[i] for i in want_lp], top_n)
            for j, (i, lp) in enumerate(zip(want_lp, states)):
                lp.output_token.append([chosen[j], next_ids[i]])
                if lp.top_n > 0:
                    lp.output_top.append(top[j][: lp.top_n])
        return {r.rid: [t] for r, t in zip(sample_reqs, next_ids)}

    def _record_next_top(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """One ``output_top`` row per request: the top logprobs of the token after its
        prompt, for requests that generate nothing (``output_token`` stays empty)."""
        lp = logits.log_softmax(-1)
        top_n = max(r.logprobs.top_n for r in reqs)
        _, top = token_logprobs(lp, [0] * len(reqs), top_n)  # no token is chosen
        for r, row in zip(reqs, top):
            r.logprobs.output_top.append(row[: r.logprobs.top_n])

    def _record_input_logprobs(self, logits: torch.Tensor, spans: list[tuple[Req, int, int]]) -> None:
        lp = logits.log_softmax(-1)
        off = 0
        for r, first, count in spans:
            state = r.logprobs
            toks = r.token_ids[first : first + count]
            chosen, top = token_logprobs(lp[off : off + count], toks, state.top_n)
            state.input_token.extend([c, t] for c, t in zip(chosen, toks))
            if top is not None:
                state.input_top.extend(top)
            state.input_pos = first + count
            off += count
