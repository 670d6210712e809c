"""SGLang's (and vLLM's) server option names, accepted by ``launch()``,
``plait.Runtime``, ``plait.Engine`` and ``plait serve``: one table for keywords and flags.

- :data:`ALIASES`: SGLang's or vLLM's name of a plait option with the same meaning
  (``max_total_tokens`` is ``kv_cache_tokens``, vLLM's ``max_num_seqs`` is
  ``max_running_requests``). Options whose names are the same in both
  (``context_length``, ``mem_fraction_static``, ``max_running_requests`` ...) need no
  entry.
- :data:`NEGATED`: a switch whose value is the negation of a plait switch (vLLM's
  ``enable_prefix_caching=False`` is ``disable_radix_cache=True``).
- :data:`GPU_ONLY`: an option that is a plait option on CUDA and means nothing on CPU
  (vLLM's ``gpu_memory_utilization``): dropped there.
- :data:`VALUE_ALIASES`: SGLang's or vLLM's spelling of a value plait spells otherwise
  (``dtype="half"``, ``tool_call_parser="qwen25"``).
- :data:`UNAVAILABLE`: values of plait options that name something plait lacks
  (``grammar_backend="xgrammar"``), refused with what to use instead.
- :data:`FOREIGN`: SGLang / vLLM options plait has no counterpart for. Each is accepted
  at a value that changes nothing here (``tp_size=1``) and refused at any other, by name,
  with what plait offers instead.

Torch-free: the command line and the language import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALIASES: dict[str, str] = {
    "model_path": "model",
    "max_total_tokens": "kv_cache_tokens",
    "random_seed": "seed",
    "data_parallel_size": "dp_size",
    "dp": "dp_size",
    "tp": "tp_size",
    "tensor_parallel_size": "tp_size",
    "speculative_algorithm": "speculative",
    "speculative_ngram_min_match_window_size": "speculative_ngram_min",
    "speculative_ngram_max_match_window_size": "speculative_ngram_max",
    # vLLM's names
    "max_model_len": "context_length",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "chunked_prefill_size",  # the token budget of one step
    "block_size": "page_size",
    "enforce_eager": "disable_cuda_graph",
    "scheduling_policy": "schedule_policy",
    "guided_decoding_backend": "grammar_backend",
    "uvicorn_log_level": "log_level_http",
}

# the command line's one-dash spellings (vLLM's ``-tp 2``)
SHORT_FLAGS: dict[str, tuple[str, ...]] = {"tp_size": ("-tp",), "dp_size": ("-dp",)}

NEGATED: dict[str, str] = {"enable_prefix_caching": "disable_radix_cache"}

# vLLM's share of GPU memory is SGLang's mem_fraction_static on CUDA; on CPU vLLM does not
# read it, and plait drops it there too (mem_fraction_static sizes the CPU's RAM share)
GPU_ONLY: dict[str, str] = {"gpu_memory_utilization": "mem_fraction_static"}

VALUE_ALIASES: dict[str, dict[str, str]] = {
    "dtype": {"half": "float16", "float": "float32"},
    "attention_backend": {"torch_native": "torch"},
    # SGLang's draft-free algorithm (LOOKAHEAD before it was renamed); EAGLE & co. need a
    # draft model plait does not run: refused by speculative's check
    "speculative": {"NGRAM": "ngram", "LOOKAHEAD": "ngram"},
    # SGLang's qwen / qwen25 parse <tool_call>{...}</tool_call> blocks (the Hermes format),
    # its llama3 the JSON form of Llama 3.1-3.3; vLLM's llama4_pythonic is the pythonic list;
    # SGLang's deepseekv3 / deepseekv31 are vLLM's (and plait's) deepseek_v3 / deepseek_v31
    "tool_call_parser": {"qwen": "hermes", "qwen25": "hermes", "llama3": "llama3_json",
                         "llama4_pythonic": "pythonic", "deepseekv3": "deepseek_v3", "deepseekv31": "deepseek_v31"},
    "reasoning_parser": {"deepseek_r1": "deepseek-r1"},  # vLLM's spelling
    "grammar_backend": {"guidance": "llguidance"},  # vLLM's name of llguidance
}

_GRAMMAR_INSTEAD = ("use auto (the default: llguidance for ebnf, which takes XGrammar's GBNF, and JSON Schema; "
                    "outlines-core for regex), llguidance or outlines")

UNAVAILABLE: dict[str, dict[str, str]] = {
    "grammar_backend": {
        "xgrammar": "plait has no XGrammar backend; " + _GRAMMAR_INSTEAD,
        "lm-format-enforcer": "plait has no lm-format-enforcer backend; " + _GRAMMAR_INSTEAD,
        "none": "constrained decoding cannot be turned off (a request without a constraint does not use it); "
                + _GRAMMAR_INSTEAD,
    },
}


@dataclass(frozen=True)
class Foreign:
    """An SGLang option plait does not have. ``accepts(value, model)``: the values that
    change nothing in plait; ``instead``: what plait offers; ``type``: its type on the
    command line (``bool``: a switch); ``flags``: SGLang's other spellings there."""

    accepts: Callable[[Any, str | None], bool]
    instead: str
    type: type = str
    flags: tuple[str, ...] = ()


def _only(*values: Any) -> Callable[[Any, str | None], bool]:
    return lambda v, model: any(v == x and isinstance(v, bool) == isinstance(x, bool) for x in values)


def _always(v: Any, model: str | None) -> bool:
    return True


_ONE_DEVICE = "a plait server runs one model on one device; for more throughput run one server per device behind a router"

FOREIGN: dict[str, Foreign] = {
    "pp_size": Foreign(_only(1), "pipeline parallelism is not implemented; " + _ONE_DEVICE, int,
                       ("--pipeline-parallel-size", "-pp")),
    "ep_size": Foreign(_only(1), "expert parallelism is not implemented; " + _ONE_DEVICE, int,
                       ("--expert-parallel-size",)),
    "base_gpu_id": Foreign(_only(0), "choose the GPU with CUDA_VISIBLE_DEVICES (device=cuda uses the first visible one)",
                           int),
    # plait runs its own model implementations and never executes code from a
    # checkpoint, so there is nothing to trust: any value is accepted and ignored
    "trust_remote_code": Foreign(_always, "accepted and ignored: plait never runs code from a checkpoint", bool),
    "tokenizer_path": Foreign(lambda v, model: v is None or v == model,
                              "the tokenizer is read from the model folder or .gguf file; put its files next to the "
                              "weights", str, ("--tokenizer",)),
    "tokenizer_mode": Foreign(_only("auto"), "plait uses the fast (Rust) tokenizer of the model folder or GGUF file"),
    "skip_tokenizer_init": Foreign(_only(False), "send input_ids instead of text to skip tokenizing a prompt", bool),
    "load_format": Foreign(_only("auto"), "the format follows the files: a folder with config.json and "
                                          "*.safetensors / pytorch_model*.bin, or a .gguf file"),
    "kv_cache_dtype": Foreign(_only("auto"), "the KV cache has the model's dtype (set with dtype)"),
    "revision": Foreign(_only(None), "download that revision and pass its folder as the model"),
    "download_dir": Foreign(_only(None), "set HF_HOME to choose where hub models are cached"),
    "is_embedding": Foreign(_only(False), "plait serves generation models only", bool),
    "lora_paths": Foreign(_only(None), "LoRA adapters are not supported; merge the adapter into the weights first"),
    "enable_torch_compile": Foreign(_only(False), "torch.compile is not used; on CUDA, decode steps replay CUDA graphs "
                                                  "(disable_cuda_graph, cuda_graph_max_bs)", bool),
    "max_prefill_tokens": Foreign(_only(None), "chunked_prefill_size is the token budget of one step (prefill chunks "
                                               "and decodes together)", int),
    "schedule_conservativeness": Foreign(_only(1.0), "admission reserves init_new_token_ratio of each running "
                                                     "request's remaining tokens (decaying to min_new_token_ratio)",
                                         float),
    "stream_interval": Foreign(_only(1), "streams carry every new piece of text as soon as it is safe to send", int),
    "sampling_backend": Foreign(_only(None, "pytorch"), "sampling is done with torch ops"),
    "cpu_offload_gb": Foreign(_only(0), "the weights stay on the device", int),
    # what these turn on or off is how plait always works
    "disable_overlap_schedule": Foreign(_always, "accepted; plait's scheduler does not overlap steps", bool),
    "enable_mixed_chunk": Foreign(_always, "accepted; decodes always run in the same step as prefill chunks", bool),
    "enable_metrics": Foreign(_always, "accepted; /metrics is always served", bool),
    "enable_cache_report": Foreign(_always, "accepted; usage always reports prompt_tokens_details.cached_tokens",
                                   bool),
    "skip_server_warmup": Foreign(_always, "accepted; the server sends no warm-up request", bool),
    # vLLM's
    "enable_auto_tool_choice": Foreign(_always, "accepted; tool_choice auto needs no switch: tool calls are parsed "
                                                "with --tool-call-parser or the format detected from the chat "
                                                "template", bool),
    "disable_log_requests": Foreign(_always, "accepted; requests are not logged", bool),
    "disable_log_stats": Foreign(_always, "accepted; no statistics are logged (they are on /metrics)", bool),
    "enable_chunked_prefill": Foreign(_only(True), "prompts are always prefilled in chunks of chunked_prefill_size "
                                                   "tokens; chunked_prefill_size=-1 prefills whole prompts", bool),
}

def translate(options: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    """``options`` with SGLang's and vLLM's names and values turned into plait's.
    Options plait does not have are dropped where their value changes nothing and
    refused otherwise (``ValueError`` naming the option, its value and what plait
    offers), as are values naming what plait lacks (:data:`UNAVAILABLE`); an option
    given under two names is refused too, as is ``model_path`` beside a ``model``
    argument (the positional model of ``launch`` / ``Engine``)."""
    given = model
    model = options.get("model_path", options.get("model", model))  # tokenizer_path may repeat it
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}  # plait option -> the name it was given under
    for name, value in options.items():
        foreign = FOREIGN.get(name)
        if foreign is not None:
            if not foreign.accepts(value, model):
                raise ValueError(f"{name}={value!r} is not supported by plait: {foreign.instead}")
            continue
        target = ALIASES.get(name) or NEGATED.get(name) or GPU_ONLY.get(name) or name
        if target in seen:
            raise ValueError(f"{seen[target]} and {name} were both given; they name the same option; give one")
        seen[target] = name
        if name in NEGATED:
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is invalid; allowed: True or False")
            value = not value
        if isinstance(value, str):
            value = VALUE_ALIASES.get(target, {}).get(value, value)
            why = UNAVAILABLE.get(target, {}).get(value)
            if why is not None:
                raise ValueError(f"{name}={value!r} is not available in plait: {why}")
        if name in GPU_ONLY and not _on_cuda(options.get("device", "auto")):
            continue
        out[target] = value
    if given is not None and "model" in out:
        raise ValueError("model and model_path were both given; they name the same option; give one")
    return out


def _on_cuda(device: Any) -> bool:
    from plait.runtime.config import EngineConfig  # torch only to resolve device=auto

    return EngineConfig(device=device).resolved_device() == "cuda"


def flag(name: str) -> str:
    """The command-line spelling of an option name."""
    return "--" + name.replace("_", "-")


def alias_flags(name: str) -> list[str]:
    """SGLang's and vLLM's flags for plait option ``name`` (``--model-path`` for
    ``model``, ``--tp`` and ``-tp`` for ``tp_size``)."""
    return [flag(k) for k, v in ALIASES.items() if v == name] + list(SHORT_FLAGS.get(name, ()))
