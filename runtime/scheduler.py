"""Continuous batching with chunked prefill and prefix-aware admission.

Each step: every decoding request advances one token; prefill chunks (requests still
catching up, then newly admitted ones in policy order) fill the rest of the
``chunked_prefill_size`` token budget. Memory: admission reserves room for future
decode growth; when a decode still finds no page, the request that loses least is
retracted (KV released to the cache, requeued, recomputed later).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from plait.errors import RequestError
from plait.runtime.chunking import AUTO, ChunkSizer
from plait.runtime.config import EngineConfig
from plait.runtime.hicache import HostLoader, HostTier
from plait.runtime.memory import PageAllocator, ReqToToken
from plait.runtime.radix_cache import MatchResult, RadixCache
from plait.runtime.request import NO_SLOTS, FinishReason, Req, ReqKind, ReqStatus
from plait.runtime.schedule_policy import order_waiting
from plait.runtime.speculative import NONE, Draft, propose

# A waiting request that shares this many more tokens with a request prefilled in
# the same step than it finds in the cache waits one step, to reuse that KV.
IN_BATCH_PREFIX_DEFER = 32
# waiting prompts a step's budget is partly kept for while others are being filled (the first few)
WAITING_RESERVE_LOOKAHEAD = 8


@dataclass
class ScheduleBatch:
    """What one step runs: prefill chunks ``(req, num_tokens)``, decoding requests that
    verify speculative drafts ``(req, draft)`` (an extend of their last token and the
    drafts), and decode requests (one token each)."""

    extends: list[tuple[Req, int]] = field(default_factory=list)
    decodes: list[Req] = field(default_factory=list)
    new_pages: list[int] = field(default_factory=list)  # allocated for this step
    verifies: list[tuple[Req, Draft]] = field(default_factory=list)

    @property
    def reqs(self) -> list[Req]:
        """Extends, then verifies, then decodes: the order of the forward's rows."""
        return [r for r, _ in self.extends] + [r for r, _ in self.verifies] + self.decodes

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d.tokens) for _, d in self.verifies)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.extends) + len(self.verifies) + self.num_draft_tokens + len(self.decodes)


# a prompt that leaves a cached prefix this early lost (almost) all reuse
EARLY_DIVERGENCE_TOKENS = 64

class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        allocator: PageAllocator,
        req_to_token: ReqToToken,
        cache: RadixCache,
        context_len: int,
        eos_ids: frozenset[int] = frozenset(),
        tier: HostTier | None = None,
        long_rope_limit: int | None = None,
        release_pins: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        # drops the pinned prefixes' locks (plait.runtime.pinning; True if one was held):
        # pins are hints, so they give way before a request is refused for lack of memory
        self.release_pins = release_pins
        # longrope (Phi-3): a sequence longer than this is computed with the long factors
        # throughout, as transformers computes it (plait.runtime.models.llama.cos_sin_cache)
        self.long_rope_limit = long_rope_limit
        self.allocator = allocator
        # the windowed layers' pool (plait.runtime.memory.WindowPages), or None
        self.window = allocator.window
        self.req_to_token = req_to_token
        self.cache = cache
        self.tier = tier  # host-memory tier under the cache (plait.runtime.hicache), or None
        # copies host-held prefixes of waiting requests in, at admission and (prefetch) before
        self.host = (HostLoader(tier, cache, allocator, config.hicache_prefetch_policy == "best_effort")
                     if tier is not None and not cache.disable else None)
        self.chunks = ChunkSizer(config.itl_target_ms) if config.chunked_prefill_size == AUTO else None
        self.page_size = allocator.page_size
        self.context_len = context_len
        self.eos_ids = eos_ids
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = config.init_new_token_ratio
        self.num_retractions = 0
        self.jump_forward_tokens = 0  # tokens written by jump-forward without a model step
        # long prompts that left a longer cached prefix within their first tokens: the
        # symptom of a per-request value (a timestamp) early in a shared prompt
        self.early_divergences = 0
        # counters (exported as metrics): tokens fed as prefill/extend vs as decode
        self.prefill_tokens_computed = 0
        self.decode_tokens_computed = 0
        # speculative decoding: steps that verified drafts (one per request), drafts
        # verified, drafts kept as output
        self.spec_verify_steps = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        # requests finished outside process_batch (aborted, never fit) since take_finished
        self._finished_outside: list[Req] = []

    # -- queue ----------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        req.long_rope = self._outgrew_short_rope(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Requests waiting or running."""
        return bool(self.waiting or self.running)

    def has_finished(self) -> bool:
        """Requests finished outside a step, not yet taken with :meth:`take_finished`."""
        return bool(self._finished_outside)

    def abort(self, r: Req, reason: FinishReason | str = "aborted by request") -> bool:
        """Abort ``r`` if it is waiting or running (its KV returns to the pool/cache);
        it is reported by the next :meth:`take_finished`. False if it had finished."""
        if r.finished:
            return False
        if isinstance(reason, str):
            reason = FinishReason.abort(reason)
        self.finish(r, reason)
        self._finished_outside.append(r)
        return True

    def finish(self, r: Req, reason: FinishReason, keep: int | None = None) -> None:
        """End ``r`` with ``reason`` (the output processor ends a request whose stop
        string matched); a request that had already finished this step gets the new
        reason (a stop string outranks the length limit and a constraint's end).
        ``keep``: the output ends after its first ``keep`` tokens of ``token_ids`` (a
        stop string completed before the last of several tokens a step appended)."""
        if keep is not None and keep < r.seq_len:
            if r.logprobs is not None:
                r.logprobs.drop_output(r.seq_len - keep)
            del r.token_ids[keep:]
            r.num_computed = min(r.num_computed, keep)
        if not r.finished:
            if r in self.running:
                self.running.remove(r)
                self._release(r)
            elif r in self.waiting:
                self.waiting.remove(r)
                if self.host is not None:
                    self.host.forget(r)
        r.status = ReqStatus.FINISHED
        r.finish_reason = reason

    def take_finished(self) -> list[Req]:
        """Requests that finished outside :meth:`process_batch` since the last call."""
        out, self._finished_outside = self._finished_outside, []
        return out

    # -- one step -------------------------------------------------------------------
    def schedule(self) -> ScheduleBatch | None:
        """Pick this step's work; allocates KV slots for every token it schedules."""
        batch = self._schedule_once()
        while batch is None and self.running:
            # prefills are waiting for memory that no running request will free:
            # retract one (or abort a lone request that can never fit) and try again
            self._retract_one()
            batch = self._schedule_once()
        if self.host is not None and self.waiting:
            self.host.prefetch(self.waiting, -(-self._reserved_tokens() // self.page_size))
        return batch

    def _schedule_once(self) -> ScheduleBatch | None:
        batch = ScheduleBatch()
        batch.decodes = self._schedule_decodes(batch)
        decoding = len(batch.decodes) + len(batch.verifies)
        if self.chunks is not None:
            streaming = any(r.stream for r in batch.decodes) or any(r.stream for r, _ in batch.verifies)
            # the chunk that continues a prompt attends to all of its computed tokens (only a
            # budget that protects streaming decodes reads it)
            # and that prompt's (tokens computed at admission, length): a prompt not yet
            # admitted is sized as before (which waiting one goes first, and from how much
            # of a cached prefix, is decided in _admit)
            prefix, prompt = 0, None
            filling = [r for r in self.running if not r.is_decoding and r.num_pending > 0]
            lead = max(filling, key=lambda r: r.num_computed) if filling else None
            if decoding and streaming and lead is not None:
                prefix, prompt = lead.num_computed, (lead.admitted_at, lead.seq_len)
            budget = self.chunks.budget(decoding, streaming, prefix, prompt) - batch.num_draft_tokens
            if not decoding and lead is not None and self.waiting:
                # prompts about to start beside a long one: the step that admits them ends
                # with their first tokens, so it is sized as a step beside a streaming decode
                # (plus what they need), not for throughput (4,096 tokens: ~12 s here)
                wanted = self._reserve_for_waiting(budget, filling)
                if wanted > 0:
                    budget = min(budget, self.chunks.budget(1, True, lead.num_computed,
                                                            (lead.admitted_at, lead.seq_len)) + 2 * wanted)
            if filling or self.waiting:
                # drafts being verified take the budget's tokens first, but never all of
                # it: a prompt still advances beside many verifying streams
                budget = max(budget, self.chunks.min_chunk // 4)
        else:
            size = self.config.chunked_prefill_size
            # -1: no chunking, any prompt the context holds is prefilled in one step
            budget = self.context_len if size == -1 else size - decoding - batch.num_draft_tokens
        budget = max(budget, 0)
        reserve = self._reserve_for_waiting(budget)
        self._admit(batch, self._continue_prefills(batch, budget - reserve) + reserve)
        if not batch.extends and not decoding:
            return None
        if decoding:
            self.new_token_ratio = max(
                self.new_token_ratio - self.config.new_token_ratio_decay, self.config.min_new_token_ratio
            )
        return batch

    def _schedule_decodes(self, batch: ScheduleBatch) -> list[Req]:
        while True:
            decodes = [r for r in self.running if r.is_decoding]
            if self._can_take(sum(self._pages_needed(r, 1) for r in decodes)):
                break
            self._retract_one()
        for r in decodes:
            self._grow(r, 1, batch)
        if self.config.speculative == NONE:
            return decodes
        return self._draft(decodes, batch)

    def _draft(self, decodes: list[Req], batch: ScheduleBatch) -> list[Req]:
        """Propose drafts for decoding requests; those that get some verify them this
        step (``batch.verifies``, slots allocated), the others are returned to decode
        one token. Drafts never exceed what the request may still generate, and take
        new pages only from the free list (never evicting cached prefixes for them)."""
        cfg = self.config
        rest = []
        for r in decodes:
            # the last verified position must leave room for one more token
            room = min(cfg.speculative_num_draft_tokens, r.remaining_new_tokens - 1, self.context_len - r.seq_len - 1)
            if self.long_rope_limit is not None and not r.long_rope:
                room = min(room, self.long_rope_limit - r.seq_len)  # verified contexts stay within the short factors
            draft = propose(r, room, cfg.speculative_ngram_min, cfg.speculative_ngram_max)
            if draft is not None and self._pages_needed(r, 1 + len(draft.tokens)) > self._free_now():
                draft = draft.cut(r.capacity(self.page_size) - r.num_computed - 1)  # what r's pages hold
            if draft is None or not draft.tokens:
                rest.append(r)
                continue
            self._grow(r, 1 + len(draft.tokens), batch)
            batch.verifies.append((r, draft))
        return rest

    def _reserve_for_waiting(self, budget: int, filling: list[Req] | None = None) -> int:
        """Tokens of this step's budget kept from prompts being filled for the prompts
        waiting to start (at most half of it, and what the first few need): a prompt
        being filled took the whole budget first, so a 5-token request that arrived
        during an 8,000-token prompt waited for all of it (24 s here, something decoding
        or not). A waiting prompt that shares tokens a filling one has yet to compute
        (n > 1 siblings, a shared system prompt) gets none: it waits to reuse them.
        ``filling``: the prompts being filled, when the caller has them."""
        if not self.waiting or budget < 2:
            return 0
        if filling is None:
            filling = [r for r in self.running if not r.is_decoding and r.num_pending > 0]
        if not filling:
            return 0
        # each one's tokens and how many of them it shares at most with a prompt that can
        # start now: its computed tokens, page-aligned (what the cache holds), plus one
        held = [(f.token_ids, f.num_computed // self.page_size * self.page_size + 1) for f in filling]
        need, cap = 0, budget // 2
        for r in list(self.waiting)[:WAITING_RESERVE_LOOKAHEAD]:
            if r.grammar is not None and not r.grammar.started:
                continue
            if any(r.token_ids[:k] == ids[:k] for ids, k in held):
                continue  # (it shares tokens a filling one has yet to compute: better wait for them)
            need += r.seq_len
            if need >= cap:
                break
        return min(need, cap)

    def _continue_prefills(self, batch: ScheduleBatch, budget: int) -> int:
        for r in self.running:
            if r.is_decoding or budget <= 0:
                continue
            n = self._window_room(r, min(r.num_pending, budget))
            if n <= 0 or not self._can_take(self._pages_needed(r, n)):
                continue  # wait for memory; decodes keep running and finishing
            self._grow(r, n, batch)
            batch.extends.append((r, n))
            budget -= n
        return budget

    def _admit(self, batch: ScheduleBatch, budget: int) -> None:
        if self.host is not None:
            self.host.release_all()  # admission sees the device tree as without prefetch
        if not self.waiting or budget <= 0:
            return
        in_batch = [r for r, _ in batch.extends]
        reserved = self._reserved_tokens()
        for r in order_waiting(self.config.schedule_policy, list(self.waiting), self.cache):
            if budget <= 0 or self.req_to_token.num_free_rows == 0:
                break
            if r.grammar is not None and not r.grammar.started:
                continue  # its index is still being built; the others go on
            match = self._load_from_host(r, self.cache.match_prefix(r.token_ids, r.kv_namespace,
                                                                     max_len=r.max_prefix_len()))
            match = self._window_usable(r, match)
            if not self.cache.disable and any(
                _common_prefix_len(r.token_ids, o.token_ids) - match.length >= IN_BATCH_PREFIX_DEFER for o in in_batch
            ):
                continue  # wait one step: its shared prefix is being prefilled now
            extend = r.seq_len - match.length
            need_tokens = extend + math.ceil(self.new_token_ratio * self._future_tokens(r))
            # pages this request's match takes out of the evictable set once locked
            available = (self.allocator.num_free + self.cache.evictable_pages) * self.page_size
            if need_tokens + reserved > available - self._evictable_in(match):
                if self.running or batch.extends:
                    break  # wait for memory to come back
                if extend + 1 > available - self._evictable_in(match) and self._release_pins():
                    available = (self.allocator.num_free + self.cache.evictable_pages) * self.page_size
                if extend + 1 > available - self._evictable_in(match):
                    # nothing running (nor pinned) and it still does not fit: it never will
                    self.abort(r, "request does not fit in the KV cache")
                    continue
            n = self._window_room_for(match, min(extend, budget))  # this step's chunk
            if n <= 0:
                if self.running or batch.extends:
                    break  # windowed KV comes back as running requests move on or finish
                self.abort(r, "request does not fit in the windowed layers' KV pool")
                continue
            self.waiting.remove(r)
            self._start(r, match)
            if self.host is not None:
                self.host.forget(r)  # after _start locked the prefix its prefetch held
            self._grow(r, n, batch)
            batch.extends.append((r, n))
            in_batch.append(r)
            budget -= n
            reserved += need_tokens

    # -- results --------------------------------------------------------------------
    def process_batch(self, batch: ScheduleBatch, next_ids: dict[str, list[int]]) -> list[Req]:
        """Advance counters after the forward pass; append the step's tokens (one
        sampled token, or verified drafts and one more); finish. Returns the requests
        that caught up this step (new tokens, or finished): the ones whose outputs
        changed."""
        for r, n in batch.extends:
            r.num_computed += n
        for r in batch.decodes:
            r.num_computed += 1
        for r, _ in batch.verifies:
            r.num_computed += 1  # its last token; accepted drafts count as they are taken
        prefill = sum(n for _, n in batch.extends)
        self.prefill_tokens_computed += prefill
        self.decode_tokens_computed += batch.num_tokens - prefill
        drafted = {r.rid: len(d.tokens) for r, d in batch.verifies}
        advanced = []
        for r in batch.reqs:
            if r.num_pending == 0:
                tokens = next_ids.get(r.rid, [])
                taken = self._take(r, tokens)
                if taken < len(tokens) and r.logprobs is not None:
                    r.logprobs.drop_output(len(tokens) - taken)  # recorded by the runner, not kept
                if r.rid in drafted:
                    self.spec_verify_steps += 1
                    self.spec_draft_tokens += drafted[r.rid]
                    self.spec_accepted_tokens += min(taken, len(tokens) - 1)  # the drafts among the kept
                advanced.append(r)
        # share freshly prefilled KV with requests admitted from the next step on
        if not self.cache.disable:
            for r, _ in batch.extends:
                if not r.finished:
                    self._cache_unfinished(r)
        if self.window is not None:  # (cached pages keep theirs: see _drop_window)
            for r in batch.reqs:
                if not r.finished:
                    self._drop_window(r)
        for r in advanced:
            if not r.finished and self._outgrew_short_rope(r):
                self._recompute_with_long_rope(r)
        return advanced

    def _take(self, r: Req, tokens: list[int]) -> int:
        """Append ``tokens`` (one sampled token; after a verification the accepted
        drafts, whose KV is computed, then one more) one at a time, as steps of one
        token would: stop at a finish or a jump-forward. Returns how many were taken."""
        for j, tok in enumerate(tokens):
            if j:
                r.num_computed += 1  # the token before was a draft: its KV is in the pool
            r.append_token(tok)
            jumped = r.grammar is not None and self._advance_grammar(r)
            reason = self.check_finish(r)
            if reason is not None:
                self.finish(r, reason)
            if reason is not None or jumped:
                return j + 1
        if not tokens:  # a prompt that generates nothing
            reason = self.check_finish(r)
            if reason is not None:
                self.finish(r, reason)
        return len(tokens)

    def _advance_grammar(self, r: Req) -> bool:
        """Move ``r``'s grammar over its newest token; then jump forward: put the
        forced text after it (re-tokenized with it) in place of it, without a model
        step. Jumped tokens are fed as a prefill chunk next step. True if it jumped."""
        tok = r.last_token
        if tok in r.params.stop_token_ids or (tok in self.eos_ids and not r.params.ignore_eos):
            return False
        if not r.grammar.advance(tok) or self.config.disable_jump_forward:
            return False
        budget = min(r.params.max_new_tokens - r.output_len + 1, self.context_len - r.seq_len)
        jumped = r.grammar.jump_forward(tok, budget)
        if jumped:
            r.replace_last_token(jumped)
            self.jump_forward_tokens += len(jumped) - 1
        return bool(jumped)

    def check_finish(self, r: Req) -> FinishReason | None:
        """Finish reason for ``r`` after its newest token, or None. Stop strings are
        matched on text by the output processor, which may still end the request or
        replace this reason (see :meth:`finish`)."""
        p = r.params
        if r.output_len == 0:
            return FinishReason.of_length(0) if p.max_new_tokens == 0 else None
        last = r.last_token
        if last in p.stop_token_ids or (not p.ignore_eos and last in self.eos_ids):
            return FinishReason.stop(last)
        if r.grammar is not None:
            if r.grammar.rejected is not None:
                return constraint_dead_end(r)
            if r.grammar.terminated:
                return FinishReason.stop(None)  # the constrained output is complete
        if r.output_len >= p.max_new_tokens or r.seq_len >= self.context_len:
            return FinishReason.of_length(r.completion_len)
        return None

    # -- KV bookkeeping ------------------------------------------------------------------
    def _pages_needed(self, r: Req, n: int) -> int:
        short = r.num_computed + n - r.capacity(self.page_size)
        return max(0, -(-short // self.page_size))

    def _alloc_pages(self, n: int) -> list[int]:
        if n > self.allocator.num_free:
            self.cache.evict(n - self.allocator.num_free)
        if self.window is not None:
            self._window_free(n, ())
        pages = self.allocator.alloc(n)
        if pages is None:
            raise RuntimeError(f"KV pool exhausted: needed {n} pages, {self.allocator.num_free} free")
        if self.window is not None:
            self.window.attach(pages)
        return pages

    def _grow(self, r: Req, n: int, batch: ScheduleBatch) -> None:
        """Give ``r`` slots for ``n`` more tokens and write them into its page-table
        row; the new pages are recorded in ``batch`` (the runner zeroes them)."""
        k = self._pages_needed(r, n)
        if k == 0:
            return
        start = r.capacity(self.page_size)
        pages = self._alloc_pages(k)
        batch.new_pages.extend(pages)
        r.private_pages.extend(pages)
        self.req_to_token.write(r.row, start, self.allocator.pages_to_slots(pages))

    def _load_from_host(self, r: Req, match: MatchResult) -> MatchResult:
        """Where the host tier holds more of ``r``'s prompt than the device cache, copy
        that part in (whatever a prefetch has not copied yet) and cache it there: a
        longer match, for a copy instead of a prefill. Without pages to spare, the
        device match as it is."""
        return match if self.host is None else self.host.load(r, match)

    def release_prefetches(self) -> None:
        """Drop the locks prefetches hold (before a namespace is flushed)."""
        if self.host is not None:
            self.host.release_all()

    def _start(self, r: Req, match: MatchResult) -> None:
        if not r.admitted_once:
            # the cache's hit statistics count each request once, at first admission
            self.cache.queried_tokens += r.seq_len
            self.cache.hit_tokens += match.length
            if match.length:
                self.cache.record_hit(match.node)
            if (not self.cache.disable and match.length < EARLY_DIVERGENCE_TOKENS <= r.prompt_len // 2
                    and self.cache.divergence(r.token_ids, r.kv_namespace, EARLY_DIVERGENCE_TOKENS) is not None):
                self.early_divergences += 1
            # (a constraint's forced opening text is output written before admission: a
            # match reaching into it is not prompt served from the cache)
            r.cached_tokens = min(match.length, r.prompt_len)
            r.admitted_once = True
        r.row = self.req_to_token.alloc_row()
        self.cache.lock(match.node)
        r.last_node = match.node
        r.prefix_slots = match.slots
        r.cache_len = r.num_computed = r.admitted_at = match.length
        self.req_to_token.write(r.row, 0, match.slots)
        r.status = ReqStatus.RUNNING
        self.running.append(r)

    def _cache_unfinished(self, r: Req) -> None:
        """Insert the computed, page-aligned prefix into the tree so that others can
        share it while ``r`` is still prefilling; ``r`` then holds the tree's nodes."""
        aligned = r.num_computed // self.page_size * self.page_size
        if aligned <= r.cache_len:
            return
        self._insert(r, aligned)
        match = self.cache.match_prefix(r.token_ids[:aligned], r.kv_namespace)
        self.cache.lock(match.node)
        self.cache.unlock(r.last_node)
        r.last_node = match.node
        r.prefix_slots = match.slots
        self.req_to_token.write(r.row, 0, match.slots)
        taken = (aligned - r.cache_len) // self.page_size
        r.private_pages = r.private_pages[taken:]
        r.cache_len = aligned

    def _insert(self, r: Req, length: int) -> None:
        """Hand positions ``[cache_len, length)`` (page aligned) to the tree; free the
        pages it already had."""
        # NOTE: slots handed to the cache live on the host, always: built from what the
        # scheduler holds (the locked prefix's slots and the private pages), never read
        # back from the page table, which lives on the device
        own = self.allocator.pages_to_slots(r.private_pages)
        slots = torch.cat([r.prefix_slots[: r.cache_len], own])[:length]
        dup = self.cache.insert(r.token_ids[:length], slots, r.kv_namespace)
        self.allocator.free(self.allocator.slots_to_pages(dup))
        if self.tier is not None and self.tier.write_through:
            self.tier.save(r.token_ids[:length], slots, r.kv_namespace)

    def _release(self, r: Req) -> None:
        """Return all of ``r``'s KV: computed full pages to the cache, the rest freed."""
        if self.cache.disable:
            self.allocator.free(r.private_pages)
        else:
            aligned = r.num_computed // self.page_size * self.page_size
            if aligned > r.cache_len:
                self._insert(r, aligned)
                taken = (aligned - r.cache_len) // self.page_size
                r.private_pages = r.private_pages[taken:]
            self.allocator.free(r.private_pages)
        r.private_pages = []
        r.window_floor = 0
        self.cache.unlock(r.last_node)
        r.last_node = None
        r.prefix_slots = NO_SLOTS
        self.req_to_token.free_row(r.row)
        r.row = None
        r.cache_len = r.num_computed = 0

    def _outgrew_short_rope(self, r: Req) -> bool:
        """``r`` (not a pin's prefill, whose prefix serves the short-factor requests)
        is now longer than the model's original context but computed with the short
        longrope factors."""
        limit = self.long_rope_limit
        return (limit is not None and not r.long_rope and r.seq_len > limit
                and r.kind is not ReqKind.PIN_PREFILL)

    def _recompute_with_long_rope(self, r: Req) -> None:
        """``r`` grew past the original context: like transformers' Phi-3, compute the
        whole sequence again with the long factors (its short-factor KV stays cached
        for others; its new KV goes to the long-rope namespace). Requeued first."""
        self._requeue(r)
        r.long_rope = True

    def _requeue(self, r: Req) -> None:
        """Take running ``r`` back to the head of the queue, its KV returned (what it
        computed stays cached): it is computed again when admitted again."""
        self.running.remove(r)
        self._release(r)
        r.status = ReqStatus.WAITING
        self.waiting.appendleft(r)

    def _retract_one(self) -> None:
        """Free the running request that loses least (fewest generated tokens, then the
        longest prompt, whose prefix most likely stays cached) and requeue it. A lone
        request that still does not fit never will: it is aborted instead, once pinned
        prefixes no longer hold memory."""
        if len(self.running) == 1:
            if not self._release_pins():  # (else their pages are evictable now: try again)
                self.abort(self.running[0], "request does not fit in the KV cache")
            return
        victim = min(self.running, key=lambda r: (r.output_len, -r.prompt_len))
        self._requeue(victim)
        victim.num_retractions += 1
        self.num_retractions += 1
        self.new_token_ratio = self.config.init_new_token_ratio

    def _release_pins(self) -> bool:
        """Drop the pins' locks; True if one was held (memory may have come back)."""
        return self.release_pins is not None and self.release_pins()

    def _can_take(self, pages: int) -> bool:
        """``pages`` can be had from the free list or by eviction (and as many window
        pages, where windowed layers have a pool of their own); prefetch locks are
        given up first if that is what it takes."""
        if self.window is not None and pages > self._window_free(pages, ()):
            return False
        if pages <= self.allocator.num_free + self.cache.evictable_pages:
            return True
        released = self.host is not None and self.host.release_all()
        return released and pages <= self.allocator.num_free + self.cache.evictable_pages

    def _reserved_tokens(self) -> int:
        """Slots running requests are still expected to take (rest of prompt, plus a
        ratio of their remaining output)."""
        total = 0
        for r in self.running:
            pending_prompt = max(r.seq_len - r.num_computed - 1, 0)
            total += pending_prompt + math.ceil(self.new_token_ratio * self._future_tokens(r))
        return total

    def _future_tokens(self, r: Req) -> int:
        """Tokens ``r`` may still generate: ``max_new_tokens`` capped by the context."""
        return max(min(r.remaining_new_tokens, self.context_len - r.seq_len), 0)

    def _evictable_in(self, match: MatchResult) -> int:
        """Evictable tokens that locking ``match`` would pin (an upper bound)."""
        return match.length if match.node is not None and match.node.lock_ref == 0 else 0

    def _free_now(self) -> int:
        """Pages to be had without evicting or detaching anything."""
        free = self.allocator.num_free
        return free if self.window is None else min(free, self.window.num_free)

    # -- windowed KV (a pool of its own: plait.runtime.memory.WindowPages) ------------
    # A request's next query (position num_computed) reads the windowed KV of positions
    # num_computed - W + 1 on: pages wholly before that are past its window. Its own
    # pages give their windowed KV back at once; cached pages keep theirs (a later
    # request whose match ends near them needs it) until window pages run short, then
    # those no running request's window covers give it back, least valuable first.
    # A match is cut to where the window before its end is still whole.
    def _window_start_page(self, r: Req) -> int:
        return max(0, r.num_computed - self.window.window + 1) // self.page_size

    def _drop_window(self, r: Req) -> None:
        """Give back the windowed KV of ``r``'s own pages that its window has passed."""
        dead = self._window_start_page(r)
        first_own = r.cache_len // self.page_size
        lo = max(r.window_floor, first_own)
        if dead > lo:
            self.window.detach(r.private_pages[lo - first_own : dead - first_own])
            r.window_floor = dead

    def _window_pages_of(self, r: Req) -> list[int]:
        """The cached (tree) pages inside ``r``'s window."""
        start, cached = self._window_start_page(r), r.cache_len // self.page_size
        if start >= cached:
            return []
        return self.allocator.slots_to_pages(r.prefix_slots[start * self.page_size : cached * self.page_size])

    def _window_protected(self, extra: Sequence[int]) -> set[int]:
        """Cached pages whose windowed KV a running request still reads, and ``extra``."""
        out = set(extra)
        for r in self.running:
            out.update(self._window_pages_of(r))
        return out

    def _window_free(self, pages: int, extra: Sequence[int]) -> int:
        """Free window pages, after giving back cached windowed KV outside every running
        request's window and ``extra`` when fewer than ``pages`` are free: up to a
        watermark (1/8 of the pool) at once, so that the tree is walked only now and
        then, not on every check of a full pool."""
        w = self.window
        if w.num_free < pages:
            self.cache.detach_window(max(pages, w.total_pages // 8) - w.num_free, self._window_protected(extra))
        return w.num_free

    def _window_room(self, r: Req, tokens: int) -> int:
        """Of ``tokens`` more for ``r`` next step, how many window pages allow (all
        without a window pool): what its last page still holds, and whole pages."""
        if self.window is None:
            return tokens
        spare = r.capacity(self.page_size) - r.num_computed
        return min(tokens, spare + self._window_free(-(-(tokens - spare) // self.page_size), ()) * self.page_size)

    def _window_room_for(self, match: MatchResult, tokens: int) -> int:
        """As :meth:`_window_room` for a request about to start on ``match`` (page
        aligned), whose window's cached pages become protected."""
        if self.window is None:
            return tokens
        pages = self.allocator.slots_to_pages(match.slots)
        start = max(0, match.length - self.window.window + 1) // self.page_size
        return min(tokens, self._window_free(-(-tokens // self.page_size), pages[start:]) * self.page_size)

    def _window_usable(self, r: Req, match: MatchResult) -> MatchResult:
        """``match`` cut to its longest part whose end has its whole window attached:
        ``r``'s first computed position reads the windowed KV of the W - 1 before it."""
        if self.window is None or match.length == 0:
            return match
        ps, w = self.page_size, self.window.window
        attached = self.window.attached(self.allocator.slots_to_pages(match.slots))
        k = len(attached)
        while k > 0:
            first = max(0, k * ps - w + 1) // ps
            holes = [j for j in range(first, k) if not attached[j]]
            if not holes:
                break
            k = holes[-1]  # an end after a hole has it in its window: end before it
        if k == len(attached):
            return match
        return self.cache.match_prefix(r.token_ids, r.kv_namespace, max_len=k * ps)

    # -- accounting -----------------------------------------------------------------
    def pool_usage(self) -> dict[str, int]:
        """Pages by state; ``free + evictable + locked == total`` always holds."""
        private = sum(len(r.private_pages) for r in self.running)
        return {
            "total": self.allocator.total_pages,
            "free": self.allocator.num_free,
            "evictable": self.cache.evictable_pages,
            "locked": self.cache.locked_pages + private,
        }

    def check_invariants(self) -> None:
        """``free + evictable + locked == total``, and every page has exactly one owner
        (the free list, one tree node, or one running request). Walks everything."""
        u = self.pool_usage()
        if u["free"] + u["evictable"] + u["locked"] != u["total"]:
            raise AssertionError(f"KV pool accounting broken: {u}")
        owners = self.allocator.free_pages() + self.cache.held_pages()
        for r in self.running:
            owners += r.private_pages
        if len(owners) != len(set(owners)) or set(owners) != set(range(1, self.allocator.num_pages)):
            dup = len(owners) - len(set(owners))
            raise AssertionError(f"KV page ownership broken: {dup} pages owned twice, "
                                 f"{self.allocator.total_pages - len(set(owners))} pages owned by nobody")
        if self.window is not None:
            self.window.check(set(range(1, self.allocator.num_pages)) - set(self.allocator.free_pages()))
        if self.tier is not None:
            self.tier.check_invariants()
        if self.host is not None:
            self.host.check_invariants(self.waiting)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def constraint_dead_end(r: Req) -> FinishReason:
    """The end of a request whose constraint allowed no token of the vocabulary (the
    sampler then takes a masked-out one, which the matcher refuses): a client error
    naming the constraint's field, as a constraint that fails to compile is, not a
    result that reads as a success. It happens when no sequence of this tokenizer's
    ordinary tokens writes what the constraint requires next, or when llguidance took
    past its time limit to compute the next mask."""
    g = r.grammar
    kind = getattr(g, "kind", None) or "constraint"
    error = getattr(g, "parser_error", None)  # (``error`` is the build's, which never reaches here)
    if error:
        why = error  # the matcher's own account, naming what stopped it
    elif getattr(g, "stuck", False):
        why = "computing its next allowed tokens took longer than the engine waits (an ebnf grammar too costly to follow)"
    else:
        why = ("no token of this model's vocabulary continues it (the text it requires next cannot be written with the "
               "tokenizer's ordinary tokens)")
    n = max(r.output_len - 1, 0)  # the refused token is the last one
    least = r.params.min_new_tokens
    if not error and not getattr(g, "stuck", False) and getattr(g, "is_final", False) and n < least:
        # complete, and only the end may follow: what refused it is min_new_tokens
        message = (f"min_new_tokens={least} cannot be met: {kind} is complete after {n} output "
                   f"token{'' if n == 1 else 's'} and allows nothing more, and the output may not end before "
                   f"{least} tokens")
        return FinishReason.abort(message, RequestError(message, "min_new_tokens"))
    message = f"{kind} cannot be followed after {n} output token{'' if n == 1 else 's'}: {why}"
    return FinishReason.abort(message, RequestError(message, kind))
