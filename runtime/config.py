"""Engine configuration: one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from plait.errors import is_int
from plait.runtime.eviction import EVICTION_POLICIES

T = TypeVar("T")

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
ATTENTION_BACKENDS = ("torch", "cpu", "triton")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_GEMMS = ("auto", "native", "onednn", "torch")
PREFIX_CACHE_MODES = ("radix", "block_hash")
QUANTIZATIONS = ("none", "int8", "q4")  # plait.runtime.models.quant
SPECULATIVE = ("none", "ngram")


def _require(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of an :class:`~plait.runtime.Engine` (and later the server).

    Memory: ``kv_cache_tokens`` sets the KV pool size in tokens; when None, SGLang's
    ``mem_fraction_static`` rule sizes it: weights plus KV pool take at most that share
    of the device's total memory (CUDA; default 0.85, the rest is for activations and
    CUDA graphs) or of the memory available to the process before it loaded the
    weights (CPU: available RAM now plus the weights; default 0.3, since the box is
    shared with tokenizers and the front).
    """

    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    kv_cache_tokens: int | None = None
    mem_fraction_static: float | None = None  # None: 0.85 on CUDA, 0.3 on CPU
    max_running_requests: int = 256
    # token budget of a step; "auto" (plait.runtime.chunking) sizes prefill chunks from
    # measured steps to keep streaming decodes' inter-token latency within itl_target_ms
    # (None: 2x a decode-only step), and prefills whole prompts up to 4096 tokens when
    # nothing decodes or no running decode streams; -1 (SGLang's value): no chunking, a
    # step takes whole prompts, up to the context length in tokens
    chunked_prefill_size: int | str = "auto"
    itl_target_ms: float | None = None
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    eviction_policy: str = "lru"  # prefix cache: lru, lfu or cost (plait.runtime.eviction)
    # radix: token-level tree (RadixAttention); block_hash: vLLM's hashed full pages
    # (plait.runtime.block_cache), kept to measure the two on one engine
    prefix_cache_mode: str = "radix"
    # Host-memory tier under the radix cache (plait.runtime.hicache; SGLang's names):
    # evicted prefixes go to a host pool of hicache_ratio x the device pool (or
    # hicache_size GiB) and come back by copy instead of recomputation.
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_back"
    # best_effort (SGLang's name for a prefetch that never delays admission): copy a
    # waiting request's host-held prefix to the device while it waits; off: at admission
    hicache_prefetch_policy: str = "best_effort"
    # Sliding-window layers (Gemma 3, Mistral) keep their KV in a pool of their own,
    # swa_full_tokens_ratio x the full layers' tokens (SGLang's name): a request holds
    # only its window there (plait.runtime.memory.WindowPages).
    swa_full_tokens_ratio: float = 0.8
    # KV-cache events (plait.runtime.kv_events): a ZMQ PUB socket publishing pages as
    # they enter and leave the prefix cache, in vLLM's format; None: no events.
    kv_events_endpoint: str | None = None
    context_length: int | None = None
    # CPU threads of each engine process; with tp_size > 1, of each rank (None: torch's
    # default, or with tp_size > 1 on CPU the cores split evenly between the ranks)
    num_threads: int | None = None
    # Tensor parallelism (plait.runtime.tp): the model sharded over tp_size processes
    # (gloo on CPU, NCCL on CUDA), rank 0 being the engine process; with nnodes > 1 each
    # node runs tp_size / nnodes of them, node node_rank > 0 only executing rank 0's steps,
    # all rendezvoused at dist_init_addr (HOST:PORT of node 0; SGLang's names)
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    attention_backend: str = "auto"
    # CPU float32 GEMMs: "onednn" packs the weights once for oneDNN's JIT GEMM
    # (plait.runtime.models.linear), "torch" keeps F.linear (MKL); "auto" is onednn on
    # CPU in float32 where the torch build has it, else torch.
    cpu_gemm: str = "auto"
    # Weight-only quantization (plait.runtime.models.quant; CPU with float32 activations,
    # or CUDA in the model's dtype on the Triton kernel plait.kernels.quant_gemm):
    # "none" keeps float32 weights (the exact path); "int8" keeps projections and LM head
    # in int8 blocks of 32 (a GGUF's Q8_0 blocks as they are), "q4" the projections in
    # 4-bit blocks of 32 (Q4_0/Q4_1/Q4_K blocks as they are) and the LM head in int8.
    quantization: str = "none"
    # On CPU (int8/q4, or float32 on the native GEMM), decode steps of a Llama-family
    # model, and steps with short prompt chunks beside them, run all layers in one native
    # call (plait.runtime.models.fused_decode: the per-operation dispatch is most of a
    # small step outside the GEMMs); True is a request, used where it applies; False keeps
    # every step on the torch modules.
    fused_decode: bool = True
    seed: int = 0
    # Admission reserves ``new_token_ratio * remaining max_new_tokens`` slots for each
    # running request's future decode; the ratio decays while memory is plentiful and
    # resets when a request has to be retracted.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    # Constrained decoding (plait.runtime.constrained): jump-forward writes forced text
    # without a model step; index builds run in a worker under these limits, and built
    # indexes are cached (LRU) by (pattern, tokenizer).
    disable_jump_forward: bool = False
    grammar_compile_timeout: float = 30.0
    grammar_compile_memory_mb: int = 4096
    grammar_cache_size: int = 64
    # Which grammar engine enforces constraints (plait.runtime.constrained.backend):
    # outlines (outlines-core), llguidance, or auto (per constraint; docs/constrained.md).
    # A request's grammar_backend sampling parameter overrides it.
    grammar_backend: str = "auto"
    # Prefixes the language pins for a batch (plait.runtime.pinning) may hold at most
    # this share of the KV pool together, so pins can never starve running requests.
    pin_budget_fraction: float = 0.5
    # CUDA only (triton backend): decode steps of up to cuda_graph_max_bs requests replay
    # CUDA graphs recorded at start-up for bucketed batch sizes (plait.runtime.cuda_graph).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    # Draft-free speculative decoding (plait.runtime.speculative): "ngram" proposes up to
    # speculative_num_draft_tokens tokens that followed the latest earlier occurrence of
    # the longest n-gram (speculative_ngram_min..max tokens) ending the request's context,
    # and verifies them in one forward pass; outputs are those of "none" (greedy: the
    # same tokens; sampled: the same distribution).
    speculative: str = "none"
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 5
    # The chat template rendering chat prompts instead of the model's own (the server's
    # OpenAI chat and Responses APIs, the language's roles; SGLang's and vLLM's
    # --chat-template): a built-in name (chatml), the path of a Jinja template file, or the
    # template text itself (plait.chat_template.load_chat_template); None: the model's.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, "device", self.device, ", ".join(DEVICES))
        _require(self.dtype in DTYPES, "dtype", self.dtype, ", ".join(DTYPES))
        _require(is_int(self.page_size) and 1 <= self.page_size <= 256, "page_size", self.page_size, "an integer in [1, 256]")
        _require(
            self.kv_cache_tokens is None or (is_int(self.kv_cache_tokens) and 1 <= self.kv_cache_tokens <= 2**40),
            "kv_cache_tokens", self.kv_cache_tokens, "None or a positive integer up to 2**40 (the memory it needs is "
            "checked at start-up)",
        )
        _require(self.mem_fraction_static is None or (_is_num(self.mem_fraction_static) and 0 < self.mem_fraction_static <= 0.95),
                 "mem_fraction_static", self.mem_fraction_static, "None or a number in (0, 0.95]")
        _require(is_int(self.max_running_requests) and 1 <= self.max_running_requests <= 4096,
                 "max_running_requests", self.max_running_requests, "an integer in [1, 4096]")
        _require(self.chunked_prefill_size == "auto" or (is_int(self.chunked_prefill_size) and (
                     1 <= self.chunked_prefill_size <= 2**31 - 1 or self.chunked_prefill_size == -1)),
                 "chunked_prefill_size", self.chunked_prefill_size,
                 "auto, a positive integer up to 2**31 - 1 or -1 (no chunking)")
        _require(self.itl_target_ms is None or (_is_num(self.itl_target_ms) and self.itl_target_ms > 0),
                 "itl_target_ms", self.itl_target_ms, "None or a number of milliseconds > 0")
        _require(self.schedule_policy in SCHEDULE_POLICIES, "schedule_policy", self.schedule_policy, ", ".join(SCHEDULE_POLICIES))
        _require(isinstance(self.disable_radix_cache, bool), "disable_radix_cache", self.disable_radix_cache, "True or False")
        _require(isinstance(self.enable_hierarchical_cache, bool), "enable_hierarchical_cache",
                 self.enable_hierarchical_cache, "True or False")
        _require(not self.enable_hierarchical_cache or (self.prefix_cache_mode == "radix" and not self.disable_radix_cache),
                 "enable_hierarchical_cache", self.enable_hierarchical_cache,
                 "True only with prefix_cache_mode='radix' and the radix cache on")
        _require(_is_num(self.hicache_ratio) and 0 < self.hicache_ratio <= 1000, "hicache_ratio", self.hicache_ratio,
                 "a number in (0, 1000] (host pool size / device pool size)")
        _require(_is_num(self.hicache_size) and 0 <= self.hicache_size <= 2**20, "hicache_size", self.hicache_size,
                 "a number of GiB in [0, 2**20] (0: sized by hicache_ratio; the memory is checked at start-up)")
        _require(self.hicache_write_policy in ("write_back", "write_through"), "hicache_write_policy",
                 self.hicache_write_policy, "write_back, write_through")
        _require(self.hicache_prefetch_policy in ("best_effort", "off"), "hicache_prefetch_policy",
                 self.hicache_prefetch_policy, "best_effort, off")
        _require(_is_num(self.swa_full_tokens_ratio) and 0 < self.swa_full_tokens_ratio <= 1, "swa_full_tokens_ratio",
                 self.swa_full_tokens_ratio, "a number in (0, 1] (windowed layers' KV tokens / full layers' tokens)")
        _require(self.prefix_cache_mode in PREFIX_CACHE_MODES, "prefix_cache_mode", self.prefix_cache_mode,
                 ", ".join(PREFIX_CACHE_MODES))
        _require(self.eviction_policy in EVICTION_POLICIES, "eviction_policy", self.eviction_policy,
                 ", ".join(EVICTION_POLICIES))
        _require(self.context_length is None or (is_int(self.context_length) and self.context_length >= 2),
                 "context_length", self.context_length, "None or an integer >= 2")
        _require(self.num_threads is None or (is_int(self.num_threads) and self.num_threads >= 1),
                 "num_threads", self.num_threads, "None or a positive integer")
        _require(is_int(self.tp_size) and 1 <= self.tp_size <= 64, "tp_size", self.tp_size, "an integer in [1, 64]")
        _require(is_int(self.nnodes) and 1 <= self.nnodes <= 64, "nnodes", self.nnodes, "an integer in [1, 64]")
        _require(is_int(self.node_rank) and 0 <= self.node_rank < self.nnodes, "node_rank", self.node_rank,
                 f"an integer in [0, nnodes={self.nnodes})")
        _require(self.tp_size % self.nnodes == 0, "tp_size", self.tp_size,
                 f"a multiple of nnodes={self.nnodes} (each node runs tp_size / nnodes ranks)")
        _require(self.dist_init_addr is None or split_host_port(self.dist_init_addr) is not None, "dist_init_addr",
                 self.dist_init_addr, "None or HOST:PORT (node 0's address and a free port, 1-65535)")
        _require(self.nnodes == 1 or self.dist_init_addr is not None, "dist_init_addr", self.dist_init_addr,
                 f"HOST:PORT of node 0 (where the nodes meet) with nnodes={self.nnodes}")
        _require(self.tp_size == 1 or not self.enable_hierarchical_cache, "enable_hierarchical_cache",
                 self.enable_hierarchical_cache, "False with tp_size > 1 (the host tier copies rank 0's pool only)")
        _require(self.tp_size == 1 or self.quantization == "none", "quantization", self.quantization,
                 "none with tp_size > 1 (quantized projections are not sharded)")
        _require(self.attention_backend in ("auto",) + ATTENTION_BACKENDS, "attention_backend",
                 self.attention_backend, "auto, " + ", ".join(ATTENTION_BACKENDS))
        _require(self.cpu_gemm in CPU_GEMMS, "cpu_gemm", self.cpu_gemm, ", ".join(CPU_GEMMS))
        if self.cpu_gemm == "onednn":
            from plait.runtime.models.linear import onednn_gemm_available

            _require(self.resolved_device() == "cpu" and self.resolved_dtype() == "float32" and onednn_gemm_available(),
                     "cpu_gemm", self.cpu_gemm,
                     "onednn only with device cpu, dtype float32 and a torch build with oneDNN; auto or torch otherwise")
        if self.cpu_gemm == "native":
            from plait.kernels import gemm_cpu

            _require(self.resolved_device() == "cpu" and self.resolved_dtype() == "float32", "cpu_gemm", self.cpu_gemm,
                     "native only with device cpu and dtype float32; auto or torch otherwise")
            if not gemm_cpu.available():
                isa = gemm_cpu.choose_isa()
                why = "this CPU has neither AVX-512F nor AVX2+FMA" if isa is None else gemm_cpu.build_error()
                _require(False, "cpu_gemm", self.cpu_gemm, f"onednn, torch or auto here ({why})")
        _require(self.quantization in QUANTIZATIONS, "quantization", self.quantization, ", ".join(QUANTIZATIONS))
        if self.quantization != "none" and self.resolved_device() == "cpu":
            _require(self.resolved_dtype() == "float32", "quantization", self.quantization,
                     "none in 16-bit dtypes on CPU (the CPU int8 and q4 kernels take float32 activations); int8 "
                     "or q4 with device cpu and dtype float32, or on CUDA in any dtype")
        _require(is_int(self.seed), "seed", self.seed, "an integer")
        _require(_is_num(self.init_new_token_ratio) and 0 <= self.init_new_token_ratio <= 1,
                 "init_new_token_ratio", self.init_new_token_ratio, "a number in [0, 1]")
        _require(_is_num(self.min_new_token_ratio) and 0 <= self.min_new_token_ratio <= self.init_new_token_ratio,
                 "min_new_token_ratio", self.min_new_token_ratio, "a number in [0, init_new_token_ratio]")
        _require(_is_num(self.new_token_ratio_decay) and self.new_token_ratio_decay >= 0,
                 "new_token_ratio_decay", self.new_token_ratio_decay, "a number >= 0")
        _require(isinstance(self.disable_jump_forward, bool), "disable_jump_forward", self.disable_jump_forward, "True or False")
        _require(_is_num(self.grammar_compile_timeout) and self.grammar_compile_timeout > 0,
                 "grammar_compile_timeout", self.grammar_compile_timeout, "a number of seconds > 0")
        _require(is_int(self.grammar_compile_memory_mb) and self.grammar_compile_memory_mb >= 256,
                 "grammar_compile_memory_mb", self.grammar_compile_memory_mb, "an integer >= 256 (MiB)")
        _require(is_int(self.grammar_cache_size) and self.grammar_cache_size >= 1,
                 "grammar_cache_size", self.grammar_cache_size, "a positive integer")
        _require(self.grammar_backend in ("auto", "outlines", "llguidance"),
                 "grammar_backend", self.grammar_backend, "auto, outlines or llguidance")
        _require(isinstance(self.disable_cuda_graph, bool), "disable_cuda_graph", self.disable_cuda_graph, "True or False")
        _require(isinstance(self.fused_decode, bool), "fused_decode", self.fused_decode, "True or False")
        _require(is_int(self.cuda_graph_max_bs) and 1 <= self.cuda_graph_max_bs <= 4096,
                 "cuda_graph_max_bs", self.cuda_graph_max_bs, "an integer in [1, 4096]")
        _require(self.speculative in SPECULATIVE, "speculative", self.speculative, ", ".join(SPECULATIVE))
        _require(is_int(self.speculative_num_draft_tokens) and 1 <= self.speculative_num_draft_tokens <= 64,
                 "speculative_num_draft_tokens", self.speculative_num_draft_tokens, "an integer in [1, 64]")
        _require(is_int(self.speculative_ngram_min) and 1 <= self.speculative_ngram_min <= 64,
                 "speculative_ngram_min", self.speculative_ngram_min, "an integer in [1, 64]")
        _require(is_int(self.speculative_ngram_max) and self.speculative_ngram_min <= self.speculative_ngram_max <= 64,
                 "speculative_ngram_max", self.speculative_ngram_max, "an integer in [speculative_ngram_min, 64]")
        from plait.runtime.kv_events import check_endpoint

        _require(check_endpoint(self.kv_events_endpoint), "kv_events_endpoint", self.kv_events_endpoint,
                 "None, tcp://HOST:PORT (host * binds, another host is connected to), ipc://PATH or inproc://NAME")
        _require(_is_num(self.pin_budget_fraction) and 0 <= self.pin_budget_fraction <= 0.9,
                 "pin_budget_fraction", self.pin_budget_fraction, "a number in [0, 0.9] (0 disables pinning)")
        self.resolved_chat_template()  # a missing file or a template that does not compile: ValueError

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def resolved_chat_template(self) -> str | None:
        """The Jinja source of ``chat_template`` (read from its file, or the built-in
        one), checked to compile; None: the model's own template renders chats."""
        if self.chat_template is None:
            return None
        from plait.chat_template import load_chat_template

        return load_chat_template(self.chat_template)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_num_threads(self) -> int | None:
        """Threads of each rank: ``num_threads``, or with ``tp_size > 1`` on CPU the node's
        cores split evenly between its ranks (None: torch's default)."""
        if self.num_threads is not None or self.tp_size == 1 or self.resolved_device() != "cpu":
            return self.num_threads
        import os

        return max(1, (os.cpu_count() or 1) // self.local_tp_size)

    @property
    def local_tp_size(self) -> int:
        """Tensor-parallel ranks on each node."""
        return self.tp_size // self.nnodes

    def resolved_mem_fraction_static(self) -> float:
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        return 0.85 if self.resolved_device() == "cuda" else 0.3

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.resolved_device() == "cuda":
            return "triton"
        # the native decode kernel is float32-only; the engine falls back to torch when
        # it cannot be built (no C compiler)
        return "cpu" if self.resolved_dtype() == "float32" else "torch"

    def resolved_cpu_gemm(self) -> str:
        """``auto``: on CPU in float32, the native kernel where it builds for this CPU and
        the start-up probe does not find oneDNN far faster (``gemm_cpu.native_preferred``),
        else oneDNN where torch has it, else torch."""
        if self.cpu_gemm != "auto":
            return self.cpu_gemm
        from plait.kernels import gemm_cpu
        from plait.runtime.models.linear import onednn_gemm_available

        if not (self.resolved_device() == "cpu" and self.resolved_dtype() == "float32"):
            return "torch"
        if gemm_cpu.native_preferred():
            return "native"
        return "onednn" if onednn_gemm_available() else "torch"


def build_trusted(cls: type[T], values: dict[str, Any]) -> T:
    """An instance of the frozen dataclass ``cls`` from ``values`` that were validated
    where they came from (the launching process): no ``__post_init__`` runs again.
    Missing fields take their defaults."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            v = values[f.name]
        elif f.default is not dataclasses.MISSING:
            v = f.default
        else:
            v = f.default_factory()  # type: ignore[misc]
        object.__setattr__(obj, f.name, v)
    return obj


def split_host_port(addr: Any) -> tuple[str, int] | None:
    """``("HOST", PORT)`` of ``"HOST:PORT"`` (``[::1]:PORT`` for IPv6), or None when
    ``addr`` is not one (no host, a port outside 1-65535)."""
    if not isinstance(addr, str):
        return None
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return host, int(port)


def _is_num(v: Any) -> bool:
    import math

    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
