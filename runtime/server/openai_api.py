"""OpenAI-compatible request parsing and response shapes (completions and chat).

Parsing turns a JSON body into :class:`Job` (the engine requests plus what the
response needs); every rejection is a :class:`RequestError` naming the OpenAI field.
Formatting turns engine outputs into OpenAI's objects and stream chunks.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plait import protocol as P
from plait.chat_template import (
    has_tool_history, messages_for_tool_template, messages_without_tool_support, template_uses_tools,
)
from plait.errors import RequestError, is_int
from plait.reasoning import END as REASONING_END
from plait.reasoning import MAX_REASONING_CHARS, ReasoningParser, ReasoningStream, get_reasoning_parser
from plait.runtime.constrained.holes import backend_refusal, has_holes, holes_to_lark
from plait.runtime.sampling_params import AUTO, CONSTRAINT_FIELDS, LLGUIDANCE, MAX_N, MAX_STOP_STRINGS
from plait.runtime.server.front import Front
from plait.runtime.validation import check_text
from plait.tool_parsers import (
    ToolParser, ToolStream, check_tools, detect_tool_parser, get_tool_parser, strict_names,
)

MAX_TOP_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # JSON has no -inf
# OpenAI's reasoning efforts (the openai client's ReasoningEffort): chat's reasoning_effort, the
# Responses API's reasoning.effort
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

# Fields accepted and ignored (they change nothing here), with the kind each must have
# (a mistyped one is a 400, as on OpenAI's API: a client's bug is not silently dropped).
# (prompt caching is automatic here: OpenAI's cache hints have nothing to change)
_IGNORED = {"user": "str", "store": "bool", "metadata": "dict", "service_tier": "str", "stream_options": "dict",
            "prompt_cache_key": "str", "safety_identifier": "str", "prompt_cache_retention": "str",
            "prompt_cache_options": "dict"}
PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
# Extensions passed to the sampler under the same name (vLLM / SGLang extras).
_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                    "no_stop_trim", "stop_regex", "spaces_between_special_tokens")
_COMMON = {"model", "n", "stop", "stream", "temperature", "top_p", "seed", "frequency_penalty", "presence_penalty",
           "max_tokens", "min_tokens", "logit_bias", "cache_salt", "rid", "regex", "json_schema", "ebnf",
           "grammar_backend", "whitespace_pattern", "include_stop_str_in_output", *_SAMPLING_EXTRAS}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "reasoning_effort",
                         "modalities", "max_reasoning_chars", "add_generation_prompt", "continue_final_message",
                         "chat_template_kwargs", "verbosity", "audio", "prediction", "web_search_options",
                         "moderation"}
# chat fields the official client sends that name features this server lacks: accepted as null
_NULL_ONLY = {"audio": "it writes text only", "prediction": "no predicted outputs",
              "web_search_options": "no web search", "moderation": "no moderation"}
# engine name -> OpenAI name, for messages from SamplingParams' validation
_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@dataclass
class Job:
    """One OpenAI request: ``len(reqs)`` prompts times ``n`` choices each."""

    chat: bool
    id: str
    model: str
    created: int
    reqs: list[P.GenerateRequest]
    n: int
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk (stream_options.continuous_usage_stats)
    echo_texts: list[str] = field(default_factory=list)  # completions with echo=True
    logprobs: int | None = None  # number of top logprobs (0: chosen token only); None: off
    prompt_tokens: list[int] = field(default_factory=list)
    constraint_field: str | None = None  # the client's field its regex/json_schema came from (response_format...)
    # raw field -> the vLLM field the client sent it as (guided_json...: vllm_structured_outputs)
    field_aliases: dict[str, str] = field(default_factory=dict)
    output: ChatOutput | None = None  # chat: how the text becomes a message (reasoning, tool calls)


# -- field checks ---------------------------------------------------------------------------
def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def get_field(body: dict[str, Any], name: str, kind: str, default: Any = None, lo: float | None = None,
              hi: float | None = None) -> Any:
    """``body[name]`` checked to be of ``kind`` (bool, int, number, str, dict, list) and
    within ``[lo, hi]``; ``default`` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    ok = {
        "bool": isinstance(v, bool),
        "int": isinstance(v, int) and not isinstance(v, bool),
        "number": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        "str": isinstance(v, str),
        "dict": isinstance(v, dict),
        "list": isinstance(v, list),
    }[kind]
    if ok and lo is not None and v < lo:
        ok = False
    if ok and hi is not None and v > hi:
        ok = False
    if not ok:
        what = {"bool": "true or false", "int": "an integer", "number": "a finite number", "str": "a string",
                "dict": "an object", "list": "an array"}[kind]
        if lo is not None or hi is not None:
            what += f" in [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise RequestError(f"{name}={_short(v)} is invalid; allowed: {what}", name)
    if kind == "str":
        check_text(v, name)
    return v


def check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(k for k in body if k not in allowed and k not in _IGNORED)
    if unknown:
        # (a name that is no identifier, "" or "max tokens", is quoted: it must be seen to be read)
        names = ", ".join(k if k.isidentifier() else repr(k) for k in unknown)
        raise RequestError(f"unrecognized request argument(s): {names}", unknown[0])
    for name, kind in _IGNORED.items():
        get_field(body, name, kind)
    check_metadata(body.get("metadata"))
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in PROMPT_CACHE_RETENTIONS:
        raise RequestError(f"prompt_cache_retention={_short(retention)} is invalid; allowed: null or one of "
                           f"{', '.join(repr(r) for r in PROMPT_CACHE_RETENTIONS)}", "prompt_cache_retention")
    tier = body.get("service_tier")  # OpenAI's processing tiers: checked, not used (one tier here)
    if tier is not None and tier not in SERVICE_TIERS:
        raise RequestError(f"service_tier={_short(tier)} is invalid; allowed: null or one of "
                           f"{', '.join(repr(t) for t in SERVICE_TIERS)}", "service_tier")


SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


def check_metadata(metadata: Any, param: str = "metadata") -> None:
    """``metadata`` as OpenAI defines it: at most 16 pairs of strings, keys of at most 64
    characters, values of at most 512 (null: none). The Responses API echoes it back, so a
    value JSON cannot write (``1e400`` read as inf, a lone surrogate) must stop here."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise RequestError(f"{param}={_short(metadata)} is invalid; allowed: an object of string values", param)
    if len(metadata) > MAX_METADATA_PAIRS:
        raise RequestError(f"{param} has {len(metadata)} pairs; allowed: at most {MAX_METADATA_PAIRS}", param)
    for k, v in metadata.items():
        check_text(k, param)
        if len(k) > MAX_METADATA_KEY:
            raise RequestError(f"{param} key {_short(k)} is longer than {MAX_METADATA_KEY} characters", param)
        if not isinstance(v, str):
            raise RequestError(f"{param}[{k!r}]={_short(v)} is invalid; allowed: a string (of at most "
                               f"{MAX_METADATA_VALUE} characters)", param)
        check_text(v, param)
        if len(v) > MAX_METADATA_VALUE:
            raise RequestError(f"{param}[{k!r}] is longer than {MAX_METADATA_VALUE} characters", param)


def check_echoable(value: Any, param: str) -> None:
    """A request value a response repeats back (the Responses API's ``tools`` and
    ``text.format``): every number finite and every string valid Unicode, or encoding
    the response would fail after the generation (a 500, and a stored response that
    could never be read again)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise RequestError(f"{param} holds the number {v!r}, which JSON cannot carry (a literal past a 64-bit "
                               "float, NaN or Infinity)", param)
        if isinstance(v, str):
            check_text(v, param)
        elif isinstance(v, dict):
            for k, x in v.items():
                check_text(k, param)
                stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)


def check_verbosity(body: dict[str, Any], param: str) -> None:
    """``body["verbosity"]`` (chat's, or the Responses API's ``text.verbosity``): null,
    ``low``, ``medium`` or ``high``. A hint to OpenAI's models: checked, not used."""
    try:
        verbosity = get_field(body, "verbosity", "str")
    except RequestError as e:
        raise e.with_param(param, param + e.message[len("verbosity"):]) from None
    if verbosity not in (None, "low", "medium", "high"):
        raise RequestError(f"{param}={_short(verbosity)} is invalid; allowed: null, 'low', 'medium' or 'high'", param)


def check_null_only(body: dict[str, Any], features: dict[str, str]) -> None:
    """Fields naming OpenAI features this server does not have (name -> why): null is
    their absence, any other value a 400 saying so."""
    for name, what in features.items():
        if body.get(name) is not None:
            raise RequestError(f"{name} is not supported by this server ({what}); allowed: null", name)


def check_reasoning_effort(value: Any, param: str) -> None:
    """A reasoning effort: null or one of :data:`REASONING_EFFORTS`. Only checked: it is a
    hint, and the chat template decides how a model reasons."""
    if value is not None and value not in REASONING_EFFORTS:
        raise RequestError(f"{param}={_short(value)} is invalid; allowed: null or one of "
                           f"{', '.join(repr(e) for e in REASONING_EFFORTS)}", param)


def check_model(front: Front, body: dict[str, Any]) -> str:
    """The served name (the first of several); ``model`` may be absent, empty,
    ``"default"`` or any served name (as in SGLang and vLLM). Another name is OpenAI's 404
    ``model_not_found``."""
    model = get_field(body, "model", "str")
    served = front.args.model_names
    names = {*served, "", "default"}
    if front.args.model is not None:
        names.add(front.args.model)
    if model is not None and model not in names:
        raise RequestError(
            f"The model {_short(model)} does not exist on this server; allowed: "
            f"{', '.join(repr(n) for n in served)}, 'default' or no name (see GET /v1/models)", "model", 404,
            "invalid_request_error", "model_not_found",
        )
    return front.args.model_name


def sampling_params(front: Front, body: dict[str, Any], prompt_len: int, default_max: int | None,
                    max_name: str = "max_tokens", least: int = 0) -> dict[str, Any]:
    """The engine's sampling params from OpenAI's fields (shape-checked here; the
    values are validated by :meth:`Front.submit`, errors renamed by :func:`openai_error`).
    ``least``: the smallest output length allowed (chat: 1, as OpenAI and vLLM; a
    completion may ask for 0 tokens to score its echoed prompt)."""
    sp: dict[str, Any] = {}
    max_tokens = get_field(body, max_name, "int", None, least)
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else front.context_len - prompt_len
    elif prompt_len + max_tokens > front.context_len and prompt_len < front.context_len:
        # (a prompt over the context is Front.submit's error, naming the prompt)
        raise RequestError(
            f"{max_name}={max_tokens} is too large: the prompt has {prompt_len} tokens and this model's context "
            f"length is {front.context_len}, so at most {front.context_len - prompt_len} tokens can be generated",
            max_name,
        )
    sp["max_new_tokens"] = max_tokens
    min_tokens = get_field(body, "min_tokens", "int", None, 0)
    if min_tokens is not None:
        sp["min_new_tokens"] = min_tokens
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "n", *_SAMPLING_EXTRAS):
        if body.get(name) is not None:
            sp[name] = body[name]
    if get_field(body, "include_stop_str_in_output", "bool", False):  # vLLM's name for no_stop_trim
        sp["no_stop_trim"] = True
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):  # (named as sent)
            raise RequestError(f"stop={_short(body['stop'])} is invalid; allowed: a non-empty string or an array "
                               f"of non-empty strings", "stop")
        for s in stop:
            check_text(s, "stop")
        sp["stop"] = stop
    bias = get_field(body, "logit_bias", "dict")
    if bias:  # OpenAI's token id (decimal text) -> bias in [-100, 100]; checked with the sampling params
        sp["logit_bias"] = bias
    # constrained decoding (SGLang's extra fields; whitespace_pattern: vLLM's, for JSON)
    for name in ("regex", "json_schema", "ebnf", "grammar_backend", "whitespace_pattern"):
        if body.get(name) is not None:
            sp[name] = body[name]
    return sp  # validated once, with the rest of the request, by Front.submit


def openai_error(e: RequestError, job: Job | None = None) -> RequestError:
    """A validation error under OpenAI's field names (``max_new_tokens`` is
    ``max_tokens`` here; a chat's constraint came from ``response_format`` or the tools)."""
    if job is not None and (e.param or "") in job.field_aliases:  # vLLM's spelling of the field
        return _aliased(e, job.field_aliases)
    if job is not None and job.constraint_field is not None and e.param in CONSTRAINT_FIELDS:
        message = e.message
        if job.constraint_field in ("tools", "tool_choice") and e.param and message.startswith(e.param + " "):
            # the client sent no regex: say what the constraint was built from
            message = ("the constraint built from the tools' parameters (a call's arguments follow its function's "
                       "JSON Schema)" + message[len(e.param):])
        return e.with_param(job.constraint_field, message)
    if (e.param or "") not in _RENAMES:
        return e
    e = _aliased(e, _RENAMES)
    message = e.message
    for engine_name, name in _RENAMES.items():  # "at most max_new_tokens (16)" names the client's field too
        message = message.replace(engine_name, name)
    return e.with_param(e.param, message)


# stream_options keys: OpenAI's (include_obfuscation: accepted, the chunks carry no
# obfuscation padding here) and vLLM's continuous_usage_stats; the Responses API has only
# include_obfuscation
STREAM_OPTIONS = ("include_usage", "include_obfuscation", "continuous_usage_stats")


def stream_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> tuple[bool, dict[str, bool]]:
    """``stream``, and ``stream_options`` as {key: bool} (only with ``stream`` true): each
    key one of ``allowed`` (a misspelt ``include_usage`` was dropped without a word, and
    the usage never came)."""
    stream = get_field(body, "stream", "bool", False)
    opts = get_field(body, "stream_options", "dict")
    if opts is None:
        return stream, {}
    if not stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    out = {}
    for key in opts:
        if key not in allowed:
            raise RequestError(f"stream_options has the key {_short(key)}, which is not a stream option; allowed: "
                               f"{', '.join(allowed)}", "stream_options")
        try:
            out[key] = get_field(opts, key, "bool", False)
        except RequestError as e:
            raise e.with_param(f"stream_options.{key}", "stream_options." + e.message) from None
    return stream, out


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """``stream``, and whether the stream reports usage at its end (``include_usage``)
    and on every chunk too (vLLM's ``continuous_usage_stats``, with ``include_usage``)."""
    stream, o = stream_fields(body, STREAM_OPTIONS)
    usage, continuous = o.get("include_usage", False), o.get("continuous_usage_stats", False)
    if continuous and not usage:
        raise RequestError("stream_options.continuous_usage_stats needs stream_options.include_usage true (the "
                           "usage it adds to every chunk)", "stream_options.continuous_usage_stats")
    return stream, usage, continuous


MAX_BATCH_PROMPTS = 2048  # prompts in one request (a batch), and sequences (prompts times n)


def check_batch_size(count: int, param: str) -> None:
    """A batch of at most :data:`MAX_BATCH_PROMPTS` prompts, checked before any is
    tokenized: the engine admits requests in order, so 20,000 one-token prompts in one
    body (accepted before) held every later client's request for ~a minute here; the
    limit bounds what one request can put ahead of others (OpenAI's own embeddings limit
    of 2048 inputs per request)."""
    if count > MAX_BATCH_PROMPTS:
        raise RequestError(f"{param} holds {count} prompts; allowed: at most {MAX_BATCH_PROMPTS} in one request "
                           "(send larger batches as several requests)", param)


def check_sequences(prompts: int, ns: list[Any], param: str = "n") -> None:
    """At most :data:`MAX_BATCH_PROMPTS` sequences in one request: ``prompts`` prompts
    with ``n`` each (``ns``: one n per prompt, or one for all; a value that is not a
    whole number is left to the sampling parameters' own check). 2048 prompts with
    n=128 queued 262,144 sequences ahead of every later client (~30 min here)."""
    per = [v if is_int(v) and 0 < v <= MAX_N else 1 for v in ns]  # (others: the n check's own error)
    total = sum(per) if len(per) == prompts else prompts * (per[0] if per else 1)
    if total > MAX_BATCH_PROMPTS:
        raise RequestError(f"{param}: {prompts} prompt(s) with n={max(per)} ask for {total} sequences; allowed: at "
                           f"most {MAX_BATCH_PROMPTS} in one request (send fewer prompts or a smaller n per request)",
                           param)


def _rid_base(front: Front, body: dict[str, Any], prefix: str) -> str:
    rid = get_field(body, "rid", "str")
    return rid if rid is not None else front.new_rid(prefix)


# -- vLLM's structured outputs -------------------------------------------------------------------
# vLLM's per-request constraint fields (the guided_* extras, and structured_outputs, which
# replaced them in vLLM 0.10) -> SGLang's raw fields, which this server reads
# (structured_outputs' keys are the kinds; the guided_* fields name the same kinds)
_STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "choice": "regex",
               "json_object": "json_schema"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}
# vLLM's backend names -> this server's (None: the server's own choice; xgrammar and
# lm-format-enforcer are not here, and the constraint means the same on either engine)
_VLLM_BACKENDS = {"auto": None, "xgrammar": None, "lm-format-enforcer": None, "guidance": "llguidance",
                  "llguidance": "llguidance", "outlines": "outlines"}


def _guided_value(name: str, kind: str, value: Any) -> Any:
    """One vLLM constraint value of ``kind`` (a key of :data:`_STRUCTURED`) as its raw
    field's, checked; ``name``: the field as the client sent it."""
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > 4096
                or not all(isinstance(c, str) and c for c in value)):
            raise RequestError(f"{name}={_short(value)} is invalid; allowed: a non-empty array of (at most 4096) "
                               f"non-empty strings", name)
        from plait.runtime.constrained.regexes import escape

        for c in value:
            check_text(c, name)
        return "(?:" + "|".join(escape(c) for c in dict.fromkeys(value)) + ")"
    if kind == "json_object":
        if value is not True:
            raise RequestError(f"{name}={_short(value)} is invalid; allowed: true (any JSON object)", name)
        return {"type": "object"}
    if kind == "json":
        if not isinstance(value, (dict, bool, str)):
            raise RequestError(f"{name}={_short(value)} is invalid; allowed: a JSON Schema (an object, true/false, "
                               f"or its JSON text)", name)
        return value
    if not isinstance(value, str):
        what = "a regular expression" if kind == "regex" else "a grammar (GBNF or Lark) as a string"
        raise RequestError(f"{name}={_short(value)} is invalid; allowed: {what}", name)
    return value


def vllm_structured_outputs(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``body`` with vLLM's structured-output fields as SGLang's raw ones (``guided_json``
    -> ``json_schema``, ``guided_regex`` -> ``regex``, ``guided_grammar`` -> ``ebnf``,
    ``guided_choice`` -> a regex of the choices; ``structured_outputs`` {json, regex,
    grammar, choice, json_object, whitespace_pattern, ...} alike; ``guided_decoding_backend``
    -> ``grammar_backend``; ``guided_whitespace_pattern`` -> ``whitespace_pattern``), and
    {raw field: the client's name} so that an error names what the client sent. At most
    one constraint, from either spelling (400 otherwise)."""
    fields = [k for k in (*_GUIDED, "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern")
              if k in body]
    if not fields:
        return body, {}
    body = dict(body)
    found: list[tuple[str, str, Any]] = []  # (the client's name, its kind, its value)
    aliases: dict[str, str] = {}
    for name, kind in _GUIDED.items():
        value = body.pop(name, None)
        if value is not None:
            found.append((name, kind, value))
    so = body.pop("structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError(f"structured_outputs={_short(so)} is invalid; allowed: an object with one of "
                               f"{', '.join(_STRUCTURED)}", "structured_outputs")
        for key, value in so.items():
            name = f"structured_outputs.{key}"
            if key in _STRUCTURED:
                if value is not None and not (key == "json_object" and value is False):
                    found.append((name, key, value))
            elif key in ("disable_fallback", "disable_any_whitespace"):
                # no fallback between engines here; JSON is written without free whitespace already
                if value is not None and not isinstance(value, bool):
                    raise RequestError(f"{name}={_short(value)} is invalid; allowed: a boolean", "structured_outputs")
            elif key == "whitespace_pattern":
                if value is not None:
                    body["whitespace_pattern"] = value
                    aliases["whitespace_pattern"] = name
            elif key == "disable_additional_properties":
                if value not in (None, False):
                    raise RequestError(f"{name}={_short(value)} is not supported; allowed: false (write "
                                       f"\"additionalProperties\": false into the schema)", "structured_outputs")
            elif key == "structural_tag":
                if value is not None:
                    raise RequestError(f"{name} is not supported here; send response_format "
                                       f"{{\"type\": \"structural_tag\", ...}} instead", "structured_outputs")
            elif key != "_backend":
                raise RequestError(f"structured_outputs has an unknown key {key!r}; allowed: "
                                   f"{', '.join([*_STRUCTURED, 'whitespace_pattern', 'disable_fallback'])}",
                                   "structured_outputs")
    given = [k for k in CONSTRAINT_FIELDS if body.get(k) is not None]
    if len(found) + len(given) > 1:
        names = [name for name, _, _ in found] + given
        raise RequestError(f"{names[0]} and {names[1]} both constrain the output; give one of them", names[1])
    for name, kind, value in found:
        body[_STRUCTURED[kind]] = _guided_value(name, kind, value)
        aliases[_STRUCTURED[kind]] = name
    backend = body.pop("guided_decoding_backend", None)
    if backend is not None:
        if not isinstance(backend, str) or backend.split(":")[0] not in _VLLM_BACKENDS:
            raise RequestError(f"guided_decoding_backend={_short(backend)} is invalid; allowed: "
                               f"{', '.join(_VLLM_BACKENDS)}", "guided_decoding_backend")
        mapped = _VLLM_BACKENDS[backend.split(":")[0]]
        if mapped is not None and body.get("grammar_backend") is None:
            body["grammar_backend"] = mapped
            aliases["grammar_backend"] = "guided_decoding_backend"
    pattern = body.pop("guided_whitespace_pattern", None)
    if pattern is not None:
        body["whitespace_pattern"] = pattern
        aliases["whitespace_pattern"] = "guided_whitespace_pattern"
    return body, aliases


def _aliased(e: RequestError, aliases: dict[str, str]) -> RequestError:
    """``e`` naming the client's field where it names a raw one translated from it."""
    name = aliases.get(e.param or "")
    if name is None:
        return e
    message = name + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return e.with_param(name, message)


def _with_vllm_fields(parse: Callable[[Front, dict[str, Any]], Job]) -> Callable[[Front, dict[str, Any]], Job]:
    def wrapped(front: Front, body: dict[str, Any]) -> Job:
        body, aliases = vllm_structured_outputs(body)
        if not aliases:
            return parse(front, body)
        try:
            job = parse(front, body)
        except RequestError as e:
            raise _aliased(e, aliases) from None
        job.field_aliases = aliases  # the engine's errors name the client's field too
        return job

    wrapped.__name__, wrapped.__doc__ = parse.__name__, parse.__doc__
    return wrapped


# -- completions ----------------------------------------------------------------------------
@_with_vllm_fields
def parse_completion(front: Front, body: dict[str, Any]) -> Job:
    check_fields(body, COMPLETION_FIELDS)
    model = check_model(front, body)
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt is required", "prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(
        isinstance(p, list) and all(is_int(t) for t in p) for p in prompt
    ):
        prompts = prompt
    else:
        raise RequestError(
            "prompt is invalid; allowed: a string, an array of strings, an array of token ids, "
            "or an array of arrays of token ids (non-empty)", "prompt",
        )
    check_batch_size(len(prompts), "prompt")
    suffix = get_field(body, "suffix", "str")
    if suffix:
        raise RequestError(f"suffix={_short(suffix)} is not supported by this server (no fill-in-the-middle); "
                           f"allowed: null or ''", "suffix")
    n = get_field(body, "n", "int", 1)
    check_sequences(len(prompts), [n])
    best_of = get_field(body, "best_of", "int")
    if best_of is not None and best_of != n:
        raise RequestError(f"best_of={best_of} is not supported; allowed: equal to n ({n})", "best_of")
    stream, include_usage, continuous = _stream_fields(body)
    echo = get_field(body, "echo", "bool", False)
    logprobs = get_field(body, "logprobs", "int", None, 0, MAX_TOP_LOGPROBS)
    salt = get_field(body, "cache_salt", "str")
    base = _rid_base(front, body, "cmpl")
    job = Job(False, base, model, int(time.time()), [], 1, stream, include_usage, continuous, logprobs=logprobs)
    for i, p in enumerate(prompts):
        ids = front.encode(p, "prompt") if isinstance(p, str) else list(p)
        sp = sampling_params(front, body, len(ids), 16)
        job.n = sp.get("n", 1)
        job.prompt_tokens.append(len(ids))
        if echo:
            job.echo_texts.append(p if isinstance(p, str) else front.tokenizer.decode(ids))
        job.reqs.append(P.GenerateRequest(
            rid=base if len(prompts) == 1 else f"{base}-{i}", input_ids=ids, sampling_params=sp, stream=stream,
            return_logprob=logprobs is not None, top_logprobs_num=logprobs or 0,
            logprob_start_len=0 if echo and logprobs is not None else -1, cache_salt=salt,
        ))
    return job


# -- chat -----------------------------------------------------------------------------------
_ROLES = ("system", "developer", "user", "assistant", "tool")


_TEXT_PARTS = ("text", "input_text", "output_text")


def _text_content(content: Any, where: str, role: str = "user") -> str:
    """A message's content as text: a string, or an array of text parts (and, in an
    assistant message, OpenAI's ``refusal`` parts, whose text it said). Other parts
    (``image_url``, ``input_audio``, ``file``) are a 400 naming the part and its type."""
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            key = "refusal" if kind == "refusal" and role == "assistant" else "text"
            if kind not in _TEXT_PARTS and key == "text":
                what = f"a {_short(kind)} part" if isinstance(kind, str) else _short(part)
                raise RequestError(f"{where}.content[{k}] is {what}, which is not supported (this server reads text "
                                   f"only); allowed: {{\"type\": \"text\", \"text\": str}} parts", "messages")
            if not isinstance(part.get(key), str):
                raise RequestError(f"{where}.content[{k}].{key} must be a string", "messages")
            parts.append(part[key])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or an array of text parts", "messages")
    check_text(content, "messages")
    return content


MAX_ARGUMENT_DEPTH = 256  # a replayed call's arguments: parsed where a template shows them as an object
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON ``text`` (brackets outside strings; the
    text need not be valid JSON). Python's parser raises RecursionError past ~1000
    levels, which the chat-template helpers that parse a call's arguments did not catch:
    a 500."""
    level = deepest = 0
    for c in _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        level += 1 if c in "[{" else -1
        deepest = max(deepest, level)
    return deepest


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked (OpenAI's shape). An empty array is
    no calls (as vLLM reads it; openai-node's ``parse`` helper wrote one into every
    message it returned, which agents then sent back)."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be an array of calls", "messages")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str) \
                or not isinstance(c.get("id", ""), str) or c.get("type", "function") != "function":
            raise RequestError(f"{at} must be {{\"id\": str, \"type\": \"function\", \"function\": {{\"name\": str, "
                               f"\"arguments\": str}}}}", "messages")
        check_text(fn["arguments"], "messages")
        depth = json_depth(fn["arguments"])
        if depth > MAX_ARGUMENT_DEPTH:  # (templates that show arguments as an object parse them)
            raise RequestError(f"{at}.function.arguments nests {depth} arrays or objects deep; allowed: at most "
                               f"{MAX_ARGUMENT_DEPTH}", "messages")
        out.append({"id": c.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _replayed_reasoning(m: dict[str, Any], where: str) -> str | None:
    """The reasoning an assistant message replays: ``reasoning_content`` (what this
    server's responses carry, and what a client's ``message.model_dump()`` sends back)
    or vLLM's newer ``reasoning``. Templates that show a tool loop's thinking (Qwen3's,
    after the last user message) read it as ``message.reasoning_content``; others ignore it."""
    for key in ("reasoning_content", "reasoning"):
        v = m.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            raise RequestError(f"{where}.{key}={_short(v)} is invalid; allowed: a string (the reasoning the "
                               f"assistant wrote) or null", "messages")
        check_text(v, "messages")
        return v
    return None


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages is required: a non-empty array of {role, content} objects", "messages")
    if not isinstance(messages, list) or not messages:
        kinds = {str: "a string", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}
        got = "an empty array" if isinstance(messages, list) else kinds.get(type(messages), type(messages).__name__)
        raise RequestError(f"messages must be a non-empty array of {{role, content}} objects, got {got}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with role and content", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(f"{where}.role={_short(role)} is invalid; allowed: {', '.join(_ROLES)}", "messages")
        content = m.get("content")
        refusal = m.get("refusal")
        if refusal is not None and (role != "assistant" or not isinstance(refusal, str)):
            raise RequestError(f"{where}.refusal={_short(refusal)} is invalid; allowed: a string, in an assistant "
                               f"message", "messages")
        if content is None and role == "assistant":
            content = refusal or ""  # a refusal it said is what it said (as a refusal part is replayed)
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text_content(content, where, role)}
        if m.get("function_call") is not None:  # (null, as the client's model_dump() writes it, is fine)
            raise RequestError(f"{where}.function_call (the deprecated form) is not supported; give the call as "
                               f"tool_calls", "messages")
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise RequestError(f"{where}.name={_short(m['name'])} is invalid; allowed: a string", "messages")
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = _tool_calls(m["tool_calls"], where)
            if calls:
                msg["tool_calls"] = calls
        if role == "assistant":
            reasoning = _replayed_reasoning(m, where)
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                what = " is required" if m.get("tool_call_id") is None else f"={_short(m['tool_call_id'])} is invalid"
                raise RequestError(f"{where}.tool_call_id{what} for a tool message: the id (a string) of the call "
                                   f"it answers", "messages")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return _results_in_call_order(out)


def _results_in_call_order(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each run of tool results put in the order of the calls they
    answer (by ``tool_call_id``; results that answer none of them follow, as given).
    Agents run a turn's calls concurrently and may send the results as they finished;
    OpenAI matches them by id, but most templates (Qwen's, Hermes', plait's generic
    tool prompt) show results without ids, in order, so a model read each result as the
    answer to the call in its place. Calls without distinct ids are left as given."""
    out = list(messages)
    i = 0
    while i < len(out):
        j = i + 1
        while j < len(out) and out[j]["role"] == "tool":
            j += 1
        ids = [c["id"] for c in out[i].get("tool_calls", [])]
        if j - i > 2 and all(ids) and len(set(ids)) == len(ids):
            place = {cid: k for k, cid in enumerate(ids)}
            out[i + 1:j] = sorted(out[i + 1:j], key=lambda m: place.get(m["tool_call_id"], len(ids)))
        i = j
    return out


@dataclass
class ChatOutput:
    """How a chat's completion text becomes a message: the reasoning section split off
    (``--reasoning-parser``), then tool calls parsed from the rest (when the request
    offers tools and ``tool_choice`` is not ``none``)."""

    reasoning: ReasoningParser | None = None
    tool_parser: ToolParser | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_calls: int | None = None  # 1 with parallel_tool_calls false: later calls are dropped
    token_bytes: Callable[[int], bytes] | None = None  # (Front.token_bytes: counts the reasoning's tokens)

    def reasoning_tokens(self, ids: list[int]) -> int:
        """How many of the output tokens ``ids`` wrote the reasoning section (its
        markers included): those up to the one that completes ``</think>``, all of them
        when the section never closed, none when the output has no section (usage's
        ``reasoning_tokens``). Counted over the tokens' bytes: ``</think>`` is ASCII, so
        it never starts inside a character."""
        if self.reasoning is None or self.token_bytes is None or not ids:
            return 0
        data = [self.token_bytes(t) for t in ids]
        joined = b"".join(data)
        if self.reasoning.parse(joined.decode("utf-8", "replace"))[0] is None:
            return 0
        end = joined.find(REASONING_END.encode())
        if end < 0:
            return len(ids)
        end += len(REASONING_END)
        count = written = 0
        while written < end:
            written += len(data[count])
            count += 1
        return count

    def message(self, text: str, cut: bool = False) -> tuple[dict[str, Any], bool]:
        """The assistant message and whether it ends in whole tool calls (none cut off:
        finish_reason ``tool_calls``); ``cut`` (:func:`output_cut`): the text ended
        before the model ended it, so a call it cut off is a call, as far as written
        (as streamed)."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        calls = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.parse(content, self.tools, cut)
            calls = calls[: self.max_calls]
        # null, not "", when calls (or a call cut off before its name: markup) took all the text
        markup_only = self.tool_parser is not None and bool(text.strip())
        msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls or markup_only else "")}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg, bool(calls) and not any(c.cut for c in calls)

    def stream(self) -> ChatStream:
        return ChatStream(self.reasoning.stream() if self.reasoning else None,
                          self.tool_parser.stream(self.tools) if self.tool_parser else None, self.max_calls)


class ChatStream:
    """One streamed choice: text deltas in, OpenAI chat deltas out (``reasoning_content``,
    ``content``, ``tool_calls``)."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStream | None,
                 max_calls: int | None = None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls

    @property
    def has_calls(self) -> bool:
        """The output made tool calls and none was cut off (as :meth:`ChatOutput.message`)."""
        return bool(self.tools is not None and self.tools.calls) and not self.cut_calls

    @property
    def cut_calls(self) -> list[int]:
        """The stream indexes of the calls that did not end whole: cut off, or streamed
        before their text turned out no call (:class:`~plait.tool_parsers.ToolStream`)."""
        calls = self.tools.calls[: self.max_calls] if self.tools is not None else []
        return [k for k, c in enumerate(calls) if c.cut]

    def _kept(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``deltas`` without those of calls past ``max_calls``."""
        if self.max_calls is None:
            return deltas
        return [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] < self.max_calls]

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._step(text, False)

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """The last deltas; ``cut``: :func:`output_cut`."""
        return self._step("", True, cut)

    def _step(self, text: str, final: bool, cut: bool = False) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.reasoning is not None:
            r, text = self.reasoning.finish() if final else self.reasoning.feed(text)
            if r:
                out.append({"reasoning_content": r})
        if self.tools is None:
            if text:
                out.append({"content": text})
            return out
        if text:
            out += self._kept(self.tools.feed(text))
        if final:
            out += self._kept(self.tools.finish(cut))
        return out


def output_cut(meta: dict[str, Any]) -> bool:
    """The output ended before the model ended it: the length limit, or a stop string
    of the request (matched inside a tool call, it cuts the call: the call so far is
    reported, with finish_reason ``stop`` and ``matched_stop``, as a length cut is with
    ``length``). EOS and stop tokens are the model's own end (a call they leave open is
    not a call)."""
    fr = meta.get("finish_reason") or {}
    return fr.get("type") == "length" or (fr.get("type") == "stop" and isinstance(fr.get("matched"), str))


def chat_finish_reason(meta: dict[str, Any], has_calls: bool) -> str | None:
    """OpenAI's finish_reason; ``has_calls``: the output ends in whole tool calls."""
    fr = finish_reason(meta)
    return "tool_calls" if has_calls and fr == "stop" else fr


def chat_chunks(job: Job, cs: ChatStream, index: int, text: str | None, *, role: bool, logprobs: Any = None,
                meta: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The stream chunks of one engine chunk (``text``) or of the end (``meta``, the
    result's meta info): deltas first (role and logprobs on the first), then the finish."""
    deltas = cs.feed(text) if meta is None else cs.finish(output_cut(meta))
    if not deltas and (role or logprobs is not None) and meta is None:
        deltas = [{}]
    out = []
    for k, d in enumerate(deltas):
        out.append(stream_chunk(job, index, None, None, role=role and k == 0, logprobs=logprobs if k == 0 else None,
                                delta=d))
    if meta is not None:
        out.append(stream_chunk(job, index, None, chat_finish_reason(meta, cs.has_calls), role=role and not deltas,
                                matched_stop=(meta.get("finish_reason") or {}).get("matched")))
    return out


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None,
                 nested: bool = True) -> tuple[str, set[str] | None]:
    """``tool_choice`` as (``"auto"``, ``"none"``, ``"required"`` or a function name, the
    names an ``allowed_tools`` choice allows, else None). ``nested``: chat completions'
    shapes in messages (the Responses API's are flat)."""
    tc = body.get("tool_choice")
    allowed: set[str] | None = None
    if tc is None:
        return ("auto" if tools else "none"), None
    if isinstance(tc, str) and tc in ("auto", "none", "required"):
        choice = tc
    elif isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict) \
            and isinstance(tc["function"].get("name"), str):
        choice = tc["function"]["name"]
    elif isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        choice = tc["name"]  # the Responses API's shape
    elif isinstance(tc, dict) and tc.get("type") == "allowed_tools":
        choice, allowed = _allowed_tools(tc)
    else:
        shapes = ('{"type": "function", "function": {"name": ...}} or '
                  '{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}' if nested else
                  '{"type": "function", "name": ...} or {"type": "allowed_tools", "mode": ..., "tools": [...]}')
        raise RequestError(f"tool_choice={_short(tc)} is invalid; allowed: \"auto\", \"none\", \"required\", "
                           f"{shapes}", "tool_choice")
    if choice != "none" and not tools:
        raise RequestError(f"tool_choice={_short(tc)} needs tools; none were given", "tool_choice")
    names = {fn["name"] for fn in tools or []}
    named = sorted(allowed) if allowed is not None else [] if choice in ("auto", "none", "required") else [choice]
    for name in named:
        if name not in names:
            raise RequestError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return choice, allowed


def _allowed_tools(tc: dict[str, Any]) -> tuple[str, set[str]]:
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`` (the
    Responses API has ``mode`` and ``tools`` beside ``type``): (the mode, the names)."""
    nested = "allowed_tools" in tc
    spec = tc.get("allowed_tools") if nested else tc
    where = "tool_choice.allowed_tools" if nested else "tool_choice"
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required"):
        mode = spec.get("mode") if isinstance(spec, dict) else spec
        raise RequestError(f"{where}.mode={_short(mode)} is invalid; allowed: \"auto\" or \"required\"", "tool_choice")
    listed = spec.get("tools")
    if not isinstance(listed, list) or not listed:
        raise RequestError(f"{where}.tools={_short(listed)} is invalid; allowed: a non-empty list of "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tool_choice")
    names = set()
    for i, t in enumerate(listed):
        name = _tool_name(t)
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(name, str):
            raise RequestError(f"{where}.tools[{i}]={_short(t)} is invalid; allowed: {{\"type\": \"function\", "
                               f"\"function\": {{\"name\": ...}}}} (function tools only)", "tool_choice")
        names.add(name)
    return spec["mode"], names


def _tool_name(tool: Any) -> Any:
    """A request's tool's function name, in the chat shape or the Responses API's flat one."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) else tool.get("name") if isinstance(tool, dict) else None


def server_tool_parser(front: Front) -> str:
    """``--tool-call-parser``, else the format the chat template shows, else ``hermes``
    (the generic tool prompt's format)."""
    template = getattr(front.tokenizer, "chat_template", None)
    return front.args.tool_call_parser or detect_tool_parser(template if isinstance(template, str) else None) \
        or "hermes"


def render_chat(front: Front, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                parser: str, turn: dict[str, Any] | None = None) -> str:
    """The prompt text of a chat: the model's template with ``tools=`` when it reads
    them; else plait's generic tool prompt and tool history as text. ``turn``: how the
    prompt ends (:func:`chat_turn`; default: a new assistant turn)."""
    template = getattr(front.tokenizer, "chat_template", None)
    if not template:
        raise RequestError("this model has no chat template; use /v1/completions", "messages")
    kwargs: dict[str, Any] = {}
    if template_uses_tools(template if isinstance(template, str) else None):
        messages = messages_for_tool_template(messages, parser)
        if tools:
            kwargs["tools"] = [{"type": "function", "function": fn} for fn in tools]
    elif tools or has_tool_history(messages):
        messages = messages_without_tool_support(messages, tools, parser)
    try:
        return front.tokenizer.apply_chat_template(messages, tokenize=False,
                                                   **(turn or {"add_generation_prompt": True}), **kwargs)
    except Exception as e:  # noqa: BLE001  (a template may reject a message order)
        raise RequestError(f"the chat template rejected the messages: {e}", "messages") from None


# apply_chat_template's own parameters and what plait passes itself: not template variables
_TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
                                "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs"})


def chat_turn(body: dict[str, Any]) -> dict[str, Any]:
    """How the rendered chat ends (vLLM's extras): a new assistant turn
    (``add_generation_prompt``, the default), or the last message left open for the
    model to continue (``continue_final_message``: an assistant prefill); plus the
    template variables of ``chat_template_kwargs`` (vLLM's and SGLang's extra, e.g.
    ``{"enable_thinking": false}`` for Qwen3), which may not name the renderer's own
    parameters."""
    cont = get_field(body, "continue_final_message", "bool", False)
    add = get_field(body, "add_generation_prompt", "bool", not cont)
    if cont and add:
        raise RequestError("continue_final_message=true continues the last message, so it cannot be combined with "
                           "add_generation_prompt=true (a new assistant turn); allowed: one of them",
                           "continue_final_message")
    extra = get_field(body, "chat_template_kwargs", "dict", {})
    for k in extra:
        if not k.isidentifier() or k in _TEMPLATE_RESERVED:
            raise RequestError(f"chat_template_kwargs key {_short(k)} is invalid; allowed: template variable names "
                               f"other than {', '.join(sorted(_TEMPLATE_RESERVED))}", "chat_template_kwargs")
    check_echoable(extra, "chat_template_kwargs")
    return {**extra, "add_generation_prompt": add, "continue_final_message": cont}


@dataclass(frozen=True)
class StructuralTag:
    """A ``structural_tag`` response format (SGLang's and vLLM's), as its regex and the
    ``uniqueItems`` its schemas keep beside it (sampling param ``unique_items``)."""

    regex: str
    unique: list[tuple[str, list[list[Any]]]]


def response_format_schema(fmt: dict[str, Any] | None, param: str = "response_format") -> Any:
    """The JSON Schema of a ``response_format`` (None for text; a :class:`StructuralTag`
    for SGLang's ``structural_tag``)."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "structural_tag":
        from plait.runtime.constrained.structural_tag import structural_tag_constraint

        try:
            return StructuralTag(*structural_tag_constraint(fmt, param))
        except ValueError as e:
            raise RequestError(str(e), param) from None
    spec = fmt.get("json_schema") if fmt.get("type") == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    where = f"{param}.json_schema" if isinstance(spec, dict) else param  # (the Responses API's text.format is flat)
    for key, kind, what in (("name", str, "a string"), ("description", str, "a string"),
                            ("strict", bool, "true, false or null")):
        v = (spec if isinstance(spec, dict) else fmt if fmt.get("type") == "json_schema" else {}).get(key)
        if v is not None and not isinstance(v, kind):  # (OpenAI refuses these too: a client's typo is not dropped)
            raise RequestError(f"{where}.{key}={_short(v)} is invalid; allowed: {what}", param)
    if fmt.get("type") == "json_schema" and schema is None and isinstance(fmt.get("schema"), (dict, bool)):
        schema = fmt["schema"]  # the Responses API's text.format
    if fmt.get("type") == "json_object":
        schema = {"type": "object"}
    if not isinstance(schema, (dict, bool)):
        # the Responses API's text.format is flat: name and schema beside the type
        shape = ('{"type": "json_schema", "name": str, "schema": {...}}' if param == "text.format"
                 else '{"type": "json_schema", "json_schema": {"name": str, "schema": {...}}}')
        raise RequestError(
            f"{param}={_short(fmt)} is invalid; allowed: {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}}, "
            f"{shape} or {{\"type\": \"structural_tag\", \"format\": {{...}}}} (or the legacy \"structures\": "
            f"[...], \"triggers\": [...])",
            param,
        )
    return schema


@dataclass
class ChatRequest:
    """A chat turn in engine terms, shared by chat completions and the Responses API."""

    ids: list[int]
    constraint: dict[str, Any]  # {"regex": ...} or {"json_schema": ...} or {}
    constraint_field: str | None
    output: ChatOutput
    extra_sp: dict[str, Any]
    forced: bool  # tool_choice "required" or a named function: the output is the calls
    turn_end: str | None = None  # a given chat template's end-of-turn text (Front.turn_end)

    @property
    def open_ended(self) -> bool:
        """The constraint leaves the text free (strict tools under auto, :func:`_strict_auto`):
        it does not end the output."""
        return self.constraint_field == "tools"

    def sampling(self, sp: dict[str, Any]) -> dict[str, Any]:
        """The engine's sampling params: the request's ``sp`` with this turn's constraint.
        A forced call ignores ``stop`` and ``stop_token_ids``: the constraint ends the
        output after the calls, and a stop string or token inside a call's arguments
        would cut the call (agent frameworks such as smolagents send stop sequences with
        ``tool_choice="required"``). A chat template given to the server adds its
        end-of-turn text to the stop strings (beside the client's, within their limit)
        of unconstrained turns and of :attr:`open_ended` ones only: a constraint ends its
        own output, which may hold that text (a schema's ``const``), and a stop string
        there would cut it; free text around strict calls is the model's to end."""
        out = {**sp, **self.extra_sp, **self.constraint}
        if self.forced:
            out.pop("stop", None)
            out.pop("stop_regex", None)
            out.pop("stop_token_ids", None)
        elif self.turn_end is not None and (self.open_ended or not any(k in out for k in CONSTRAINT_FIELDS)):
            stop = out.get("stop")
            stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list) else []
            if self.turn_end not in stops and len(stops) < MAX_STOP_STRINGS:
                out["stop"] = stops + [self.turn_end]
        return out


def _strict_auto(parser: Any, offered: list[dict[str, Any]], callable_tools: list[dict[str, Any]],
                 allowed: Any, parallel: bool) -> tuple[str | None, list[Any], str | None]:
    """(regex, uniqueItems groups, the field it came from) that keep ``strict`` tools'
    calls to their schemas under ``tool_choice="auto"`` (:meth:`ToolParser.auto_constraint`),
    or (None, [], None) where no callable tool is strict or the format has no trigger
    (pythonic): then the output stays free, as without strict."""
    strict = strict_names(offered) & {fn["name"] for fn in callable_tools}
    if not strict:
        return None, [], None
    try:
        lazy = parser.auto_constraint(offered, allowed, parallel, strict)
    except RequestError as e:
        raise RequestError(f"{e.message}; strict: true enforces a function's parameters under tool_choice 'auto' "
                           f"too (strict: false calls it unconstrained)", e.param) from None
    if lazy is None:
        return None, [], None
    return lazy.regex, list(lazy.unique), "tools"


def chat_request(front: Front, body: dict[str, Any], messages: list[dict[str, Any]], schema: Any,
                 schema_field: str, nested_tools: bool = True) -> ChatRequest:
    """Render, tokenize and constrain one chat turn: ``tools`` (OpenAI's chat shape, or
    the Responses API's flat one) and ``tool_choice`` from ``body``, ``schema`` (from
    ``schema_field``) for JSON output."""
    offered = body.get("tools")
    # an empty list is no tools (the Responses API's default, which the OpenAI Agents SDK
    # sends for an agent without tools; vLLM reads it so on chat too): a call forced
    # then has nothing to call, a 400 naming tools
    tools = check_tools(offered, "tools", nested_tools) if offered not in (None, []) else None
    if offered == [] and body.get("tool_choice") not in (None, "auto", "none"):
        raise RequestError(f"tools is an empty array, so tool_choice={_short(body['tool_choice'])} has no function to "
                           f"call; allowed: at least one function tool, or tool_choice 'auto' or 'none'", "tools")
    if tools:  # rendered into the prompt: a lone surrogate would be blamed on the messages
        check_text(json.dumps(body["tools"], ensure_ascii=False), "tools")
    choice, allowed = ("none", None) if offered == [] else _tool_choice(body, tools, nested_tools)
    # an allowed_tools choice: every tool is in the prompt (as OpenAI keeps them: the
    # prefix stays cached), the allowed ones alone are constrained to and parsed as calls
    # (the request's whole list, so that an error names a tool by its place in it)
    callable_tools = tools if allowed is None else [fn for fn in tools or [] if fn["name"] in allowed]
    parallel = get_field(body, "parallel_tool_calls", "bool", True)
    max_reasoning = get_field(body, "max_reasoning_chars", "int", None, 0, MAX_REASONING_CHARS)
    parser_name = server_tool_parser(front)
    parser = get_tool_parser(parser_name)
    reasoning = get_reasoning_parser(front.args.reasoning_parser) if front.args.reasoning_parser else None
    if max_reasoning is not None and reasoning is None:
        raise RequestError("max_reasoning_chars needs a server started with --reasoning-parser", "max_reasoning_chars")
    text = render_chat(front, messages, tools, parser_name, chat_turn(body))
    ids = front.encode(text, "messages", bos=False)  # the template writes what it needs
    regex: str | None = None
    unique: list[tuple[str, list[list[Any]]]] = []  # uniqueItems kept beside the regex (unique_items)
    field_name: str | None = None
    if choice not in ("auto", "none"):
        # a JSON response_format (text.format) shapes the text reply, which a forced turn
        # does not write: it waits for a later turn (the OpenAI Agents SDK sends an agent's
        # output_type with tool_choice "required", as OpenAI serves). A raw constraint of the
        # whole output, or a structural tag (itself a way to write calls), conflicts.
        others = [schema_field] if isinstance(schema, StructuralTag) else []
        others += [other for other in ("regex", "json_schema", "ebnf") if body.get(other) is not None]
        if others:
            raise RequestError(f"tool_choice={choice!r} forces a tool call, which {others[0]} cannot constrain too; "
                               f"give one of them", "tool_choice")
        assert tools is not None
        # a named function is called once (as OpenAI and vLLM do; with parallel calls a
        # small model repeated the same call until max_tokens); "required" may make several
        parallel = parallel and choice == "required"
        forced = parser.constraint(offered, allowed if choice == "required" else choice, parallel)
        regex, unique = forced.regex, forced.unique
        field_name = "tool_choice"
    elif choice == "auto" and schema is None and tools and all(body.get(o) is None
                                                               for o in ("regex", "json_schema", "ebnf")):
        # strict tools (OpenAI's strict: true, what the OpenAI Agents SDK sends): a call's
        # arguments follow its schema once the model starts a call; it still may answer
        # (a raw constraint of SGLang's, given as well, is the output's shape instead, as before)
        regex, unique, field_name = _strict_auto(parser, offered, callable_tools, allowed, parallel)
    free_text = field_name == "tools"  # strict tools under auto: the reply may be text before any call
    constraint: dict[str, Any] = {}
    if regex is None and isinstance(schema, StructuralTag):
        # free text between the structures: tool calls in it are parsed under auto
        field_name, regex, unique = schema_field, schema.regex, schema.unique
        free_text = True
    elif regex is None and schema is not None:
        field_name = schema_field
        # tools under "auto" beside a JSON format (the OpenAI Agents SDK's tools + output
        # type): the reply is the JSON or calls; the schema alone left calls impossible
        calls = bool(tools) and choice == "auto"
        if reasoning is None and not calls:
            constraint["json_schema"] = json.dumps(schema)
        else:
            from plait.runtime.constrained.unique_items import guarded_regex

            try:
                regex, sites = guarded_regex(schema)
            except ValueError as e:
                if reasoning is not None:
                    raise RequestError(str(e), schema_field) from None
                # a schema only llguidance's JSON grammar follows: the reply is the JSON alone
                constraint["json_schema"] = json.dumps(schema)
            else:
                unique = [("", sites)] if sites else []  # (the JSON is the output, from its start)
                if calls:
                    either = parser.constraint(offered, allowed, parallel)
                    regex, unique = f"(?:{regex})|(?:{either.regex})", unique + either.unique
    if reasoning is not None and (regex is not None or max_reasoning is not None):
        # the constraint starts after the reasoning section (plait.reasoning)
        regex = reasoning.constraint_prefix(max_reasoning) + (regex if regex is not None else "(?s:.*)")
        field_name = field_name or "max_reasoning_chars"
        # a JSON kept from the output's start may come after the section instead
        unique = unique + [(REASONING_END, sites) for a, sites in unique if a == ""]
    if free_text and regex is not None and body.get("grammar_backend") is None and front.limits.grammar_backend == AUTO:
        # free text around the structures (strict tools under auto, structural tags):
        # outlines-core builds the automaton of free text and every call whole before the
        # first token (7-12 s for one strict tool of 5 fields on the default model; with
        # Qwen3's optional '<think>' section in front, 30 s, past the compile limit);
        # llguidance follows the same regex lazily (the same request in 2-4 s, tokens included)
        constraint["grammar_backend"] = LLGUIDANCE
    if regex is not None and has_holes(regex):
        # a function's arguments only llguidance's JSON compiler follows (plait.runtime.
        # constrained.holes): the calls' regex becomes a Lark grammar with them as %json
        why = backend_refusal(body.get("grammar_backend"), field_name)
        if why is not None:
            raise RequestError(why, "grammar_backend")
        try:
            constraint["ebnf"] = holes_to_lark(regex)
        except ValueError as e:
            raise RequestError(f"{field_name} cannot be enforced: {e}", field_name) from None
        constraint["grammar_backend"] = LLGUIDANCE
    elif regex is not None:
        constraint["regex"] = regex
    if regex is not None and unique:
        constraint["unique_items"] = [[a, sites] for a, sites in unique]
    for other in ("regex", "json_schema", "ebnf"):  # SGLang's raw constraint fields
        if constraint and body.get(other) is not None:
            raise RequestError(f"{other} and {field_name} both constrain the output; give one of them", other)
    extra_sp: dict[str, Any] = {}
    if parser.special_marker and choice != "none" and body.get("skip_special_tokens") is None:
        extra_sp["skip_special_tokens"] = False  # [TOOL_CALLS] (<|tool_call|>) is a special token
    output = ChatOutput(reasoning, parser if choice != "none" else None, callable_tools or [], None if parallel else 1,
                        front.token_bytes)
    return ChatRequest(ids, constraint, field_name, output, extra_sp, choice not in ("auto", "none"),
                       front.turn_end)


@_with_vllm_fields
def parse_chat(front: Front, body: dict[str, Any]) -> Job:
    check_fields(body, CHAT_FIELDS)
    model = check_model(front, body)
    messages = _messages(body)
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise RequestError(f"{name} (the deprecated form) is not supported; use tools and tool_choice", name)
    modalities = get_field(body, "modalities", "list")
    if modalities is not None and any(m != "text" for m in modalities):
        raise RequestError(f"modalities={_short(modalities)} is invalid; allowed: [\"text\"] (this server writes "
                           f"text only)", "modalities")
    check_reasoning_effort(body.get("reasoning_effort"), "reasoning_effort")
    check_verbosity(body, "verbosity")
    check_null_only(body, _NULL_ONLY)
    schema = response_format_schema(get_field(body, "response_format", "dict"))
    chat = chat_request(front, body, messages, schema, "response_format")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    get_field(body, "max_tokens", "int", None, 1)  # checked when max_completion_tokens, which wins, is given too
    sp = chat.sampling(sampling_params(front, body, len(chat.ids), None, max_name, least=1))
    want_lp = get_field(body, "logprobs", "bool", False)
    top = get_field(body, "top_logprobs", "int", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want_lp:
        raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    stream, include_usage, continuous = _stream_fields(body)
    base = _rid_base(front, body, "chatcmpl")
    req = P.GenerateRequest(
        rid=base, input_ids=chat.ids, sampling_params=sp, stream=stream, return_logprob=want_lp,
        top_logprobs_num=top or 0, cache_salt=get_field(body, "cache_salt", "str"),
    )
    return Job(True, base, model, int(time.time()), [req], sp.get("n", 1), stream, include_usage, continuous,
               logprobs=(top or 0) if want_lp else None, prompt_tokens=[len(chat.ids)],
               constraint_field=chat.constraint_field, output=chat.output)


# -- responses ------------------------------------------------------------------------------
def finish_reason(meta: dict[str, Any]) -> str | None:
    fr = meta.get("finish_reason")
    return None if fr is None else fr.get("type")


def _lp(v: float | None) -> float:
    return LOGPROB_FLOOR if v is None or not math.isfinite(v) else max(v, LOGPROB_FLOOR)


# a lead byte that makes the next k continuation bytes one character (k = 1, 2, 3)
_LEADS = {1: b"\xc2", 2: b"\xe1", 3: b"\xf1"}


class LogprobFormatter:
    """Turns the engine's ``[logprob, token_id]`` lists into OpenAI's shapes."""

    def __init__(self, front: Front) -> None:
        self.front = front

    def text_offsets(self, ids: list[int], offset: int) -> list[int]:
        """Each token's ``text_offset``: the index, in characters of the text the tokens
        wrote (``offset`` characters before the first), of the character its first byte is
        part of, as decoding writes it (a token inside a multi-byte character points at
        that character; invalid bytes are one U+FFFD each). Tokens that start inside a
        character begun before them (a stream chunk after one that ended mid-character,
        whose text held it back) point at ``offset``, that character's index."""
        data = [self.front.token_bytes(t) for t in ids]
        joined = b"".join(data)
        carried = len(joined) - len(joined.lstrip(bytes(range(0x80, 0xC0))))
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        dec.decode(_LEADS.get(min(carried, 3), b""))  # (nothing written: it waits for its continuation bytes)
        out = []
        for b in data:
            out.append(offset)
            offset += len(dec.decode(b))
        return out

    def completion(self, pairs: list[list[Any]], tops: list[Any] | None, offset: int) -> dict[str, Any]:
        """Completions' ``logprobs``; ``offset``: characters of the choice's text before
        the first token (the echo, or the text streamed so far)."""
        tokens, lps, top_out = [], [], []
        for i, (lp, tid, *_) in enumerate(pairs):
            tokens.append(self.front.token_text(tid))
            lps.append(None if lp is None else _lp(lp))
            row = tops[i] if tops is not None and i < len(tops) else None
            top_out.append(None if row is None else {self.front.token_text(t): _lp(v) for v, t, *_ in row})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out if tops is not None else None,
                "text_offset": self.text_offsets([p[1] for p in pairs], offset)}

    def chat(self, pairs: list[list[Any]], tops: list[Any] | None) -> list[dict[str, Any]]:
        out = []
        for i, (lp, tid, *_) in enumerate(pairs):
            tok = self.front.token_text(tid)
            row = tops[i] if tops is not None and i < len(tops) else None
            out.append({
                "token": tok, "logprob": _lp(lp), "bytes": list(self.front.token_bytes(tid)),
                "top_logprobs": [
                    {"token": self.front.token_text(t), "logprob": _lp(v), "bytes": list(self.front.token_bytes(t))}
                    for v, t, *_ in (row or [])
                ],
            })
        return out

    def output(self, meta: dict[str, Any], top: int) -> list[dict[str, Any]]:
        """The output tokens of ``meta`` (a result's, or a stream chunk's: its new ones)
        as chat's ``logprobs.content``, which is the Responses API's
        ``output_text.logprobs`` too; ``top``: the alternatives asked for."""
        return self.chat(meta.get("output_token_logprobs", []), meta.get("output_top_logprobs") if top else None)


def usage(job: Job, completion_tokens: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    """A response's usage; ``reasoning``: the output tokens of reasoning sections
    (:meth:`ChatOutput.reasoning_tokens`), reported when the server splits them."""
    prompt = sum(job.prompt_tokens)
    out = {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if job.output is not None and job.output.reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def chunk_usage(job: Job, prompt_i: int, completion_tokens: int) -> dict[str, Any]:
    """A chunk's usage under ``continuous_usage_stats`` (as vLLM writes it): its
    prompt's tokens and the tokens its choice has written so far."""
    prompt = job.prompt_tokens[prompt_i]
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def choice_index(job: Job, prompt_i: int, index: int) -> int:
    return prompt_i * job.n + index


def response(front: Front, job: Job, results: dict[tuple[int, int], P.GenerateResult]) -> dict[str, Any]:
    """The non-streaming response of ``job`` from its results keyed by (prompt, index)."""
    fmt = LogprobFormatter(front)
    choices = []
    completion = cached = reasoning = 0
    for (pi, idx), r in sorted(results.items()):
        meta = r.meta_info
        completion += meta.get("completion_tokens", 0)
        if job.output is not None:
            reasoning += job.output.reasoning_tokens(r.output_ids)
        if idx == 0:
            cached += meta.get("cached_tokens", 0)
        choice: dict[str, Any] = {"index": choice_index(job, pi, idx), "finish_reason": finish_reason(meta),
                                  "matched_stop": (meta.get("finish_reason") or {}).get("matched")}
        if job.chat:
            message, has_calls = (job.output or ChatOutput()).message(r.text, output_cut(meta))
            choice["message"] = message
            choice["finish_reason"] = chat_finish_reason(meta, has_calls)
            choice["logprobs"] = None if job.logprobs is None else {"content": fmt.output(meta, job.logprobs)}
        else:
            pairs = meta.get("output_token_logprobs", [])
            tops = meta.get("output_top_logprobs") if job.logprobs else None
            text = r.text
            lp = None
            if job.logprobs is not None:
                if job.echo_texts:
                    ipairs = meta.get("input_token_logprobs", [])
                    itops = meta.get("input_top_logprobs") if job.logprobs else None
                    if itops is not None and tops is not None:
                        tops = list(itops) + list(tops)
                    pairs = list(ipairs) + list(pairs)
                lp = fmt.completion(pairs, tops, 0)
            if job.echo_texts:
                text = job.echo_texts[pi] + text
            choice["text"] = text
            choice["logprobs"] = lp
        choices.append(choice)
    return {
        "id": job.id,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage(job, completion, cached, reasoning),
    }


def stream_chunk(job: Job, index: int, text: str | None, finish: str | None, *, role: bool = False,
                 logprobs: Any = None, matched_stop: Any = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stream chunk: a chat's ``delta`` (or ``text`` as its content), a
    completion's ``text``."""
    if job.chat:
        delta = {"role": "assistant", **(delta or {})} if role else dict(delta or {})
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        choice["matched_stop"] = matched_stop
    out = {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": job.created,
           "model": job.model, "choices": [choice]}
    if job.include_usage:
        out["usage"] = None
    return out


def usage_chunk(job: Job, completion_tokens: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    return {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": job.created, "model": job.model, "choices": [],
            "usage": usage(job, completion_tokens, cached, reasoning)}
