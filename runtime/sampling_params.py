"""Sampling parameters of one request, validated loudly."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from plait.errors import RequestError, is_int
from plait.runtime.constrained.backend import AUTO, GRAMMAR_BACKENDS, LLGUIDANCE, OUTLINES
from plait.runtime.stop_regex import MAX_STOP_REGEXES, StopRegex, compile_stop_regex

logger = logging.getLogger(__name__)

MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256
GREEDY_TEMPERATURE = 1e-5
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf")


@dataclass
class SamplingParams:
    """What to generate and how. ``temperature == 0`` means greedy.

    ``top_k`` of -1 (or 0) disables top-k; ``stop`` strings end generation and are
    trimmed from the returned text; ``stop_regex`` (Python regexes) end it at the first
    match in the output text, trimmed as a stop string is (:mod:`plait.runtime.stop_regex`);
    ``stop_token_ids`` end it too (the token stays in ``output_ids``, as EOS does).
    Penalties follow OpenAI (frequency, presence: over the output so far) and Hugging
    Face (repetition: over prompt and output).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    # SGLang's: generation ends when the output text holds a match of one of these (a
    # search after each token; the finish reason's ``matched`` is the pattern)
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    # SGLang's and vLLM's: with skip_special_tokens false, whether decoding puts spaces
    # around special tokens. Passed to the tokenizer's decode: a slow (Python) Hugging Face
    # tokenizer honours it; a fast one, what plait loads, decodes special tokens as
    # written either way (HF's, vLLM's and SGLang's behaviour with fast tokenizers)
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # SGLang's: the stop string that ended the output stays in its text
    # token id (an int, or its decimal text as JSON keys write it) -> a number in
    # [-100, 100] added to that token's logit before sampling (OpenAI's logit_bias; -100
    # bans a token, 100 all but forces it); logprobs stay the model's own
    logit_bias: dict[Any, float] | None = None
    # Constraints (at most one): the output fully matches ``regex``, or is JSON that
    # validates against ``json_schema`` (a dict, a bool or JSON text), written compactly unless
    # ``whitespace_pattern`` (a regex over spaces/tabs/newlines, e.g. "[ ]?") is given.
    # ``ebnf``: a grammar (GBNF ``root ::= ...`` as in SGLang/llama.cpp, or Lark with a
    # ``start`` rule) the output must match. ``grammar_backend`` picks the engine that
    # enforces the constraint: outlines, llguidance, or auto (None: the engine's option).
    regex: str | None = None
    json_schema: dict[str, Any] | bool | str | None = None
    ebnf: str | None = None
    # SGLang's ``structural_tag`` (its JSON text, or the object): xgrammar's ``format`` tree
    # of elements, or the legacy free text in which each trigger begins a structure
    # (constrained as a regex: plait.runtime.constrained.structural_tag)
    structural_tag: str | dict[str, Any] | None = None
    whitespace_pattern: str | None = None
    grammar_backend: str | None = None
    # With ``regex`` (plait's; how forced tool calls keep their parameters' ``uniqueItems``
    # over strings and numbers, which no regex can): ``[[text, [path, ...]], ...]``, each
    # JSON value the output writes right after ``text`` ("" = at its start) keeps the
    # arrays at those instance paths (keys, indices, "*" any one step, "**" any depth)
    # free of repeated items (plait.runtime.constrained.unique_items)
    unique_items: list[Any] | None = None
    # False: this request never drafts when the engine decodes speculatively (its
    # output is the same either way; under sampling, a fixed seed then reproduces the
    # tokens of a non-speculative engine, not only their distribution)
    speculative: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any] | "SamplingParams" | None) -> "SamplingParams":
        """Build from a user dict; raise ``ValueError`` naming any bad field."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return dataclasses.replace(d)
        if not isinstance(d, dict):
            raise RequestError(f"sampling_params must be a dict, got {type(d).__name__}", "sampling_params")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in d if k not in names)
        if unknown:
            raise RequestError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(names)}",
                "sampling_params",
            )
        kwargs = dict(d)
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        if kwargs.get("stop") is None:
            kwargs.pop("stop", None)
        if isinstance(kwargs.get("stop_regex"), str):
            kwargs["stop_regex"] = [kwargs["stop_regex"]]
        if kwargs.get("stop_regex") is None:
            kwargs.pop("stop_regex", None)
        if kwargs.get("stop_token_ids") is None:
            kwargs.pop("stop_token_ids", None)
        params = cls(**kwargs)
        params.validate()
        return params

    def to_dict(self) -> dict[str, Any]:
        """Every field (what the front sends the engine, which rebuilds it unchecked)."""
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise :class:`RequestError` naming the first bad field. The constraint's
        fields are type-checked here and translated by :meth:`constraint`."""
        _int(self.max_new_tokens, "max_new_tokens", 0, None)
        _int(self.min_new_tokens, "min_new_tokens", 0, None)
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                f"min_new_tokens={self.min_new_tokens} is invalid; allowed: at most max_new_tokens ({self.max_new_tokens})",
                "min_new_tokens",
            )
        _num(self.temperature, "temperature", 0.0, 100.0, "a number in [0, 100]")
        _num(self.top_p, "top_p", 0.0, 1.0, "a number in (0, 1]")
        if self.top_p <= 0.0:
            raise RequestError(f"top_p={self.top_p!r} is invalid; allowed: a number in (0, 1]", "top_p")
        _int(self.top_k, "top_k", -1, None)
        _num(self.min_p, "min_p", 0.0, 1.0, "a number in [0, 1]")
        _num(self.frequency_penalty, "frequency_penalty", -2.0, 2.0, "a number in [-2, 2]")
        _num(self.presence_penalty, "presence_penalty", -2.0, 2.0, "a number in [-2, 2]")
        _num(self.repetition_penalty, "repetition_penalty", 0.0, 2.0, "a number in (0, 2]")
        if self.repetition_penalty <= 0.0:
            raise RequestError(
                f"repetition_penalty={self.repetition_penalty!r} is invalid; allowed: a number in (0, 2]",
                "repetition_penalty",
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError(
                f"stop={self.stop!r} is invalid; allowed: a non-empty string or a list of non-empty strings", "stop"
            )
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_LEN for s in self.stop):
            raise RequestError(
                f"stop is invalid: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_LEN} characters are allowed",
                "stop",
            )
        for s in self.stop:
            _check_unicode(s, "stop")
        self.stop_regex_program()
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise RequestError(
                f"stop_token_ids={self.stop_token_ids!r} is invalid; allowed: a list of non-negative token ids",
                "stop_token_ids",
            )
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "speculative",
                     "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name}={getattr(self, name)!r} is invalid; allowed: true or false", name)
        if self.seed is not None:
            _int(self.seed, "seed", -(2**63), 2**63 - 1)  # a signed 64-bit integer, as vLLM and OpenAI take it
        _int(self.n, "n", 1, MAX_N)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias) or None
        given = [k for k in (*CONSTRAINT_FIELDS, "structural_tag") if getattr(self, k) is not None]
        if len(given) > 1:
            raise RequestError(
                f"{' and '.join(given)} are {'both' if len(given) == 2 else 'all'} set; allowed: at most one constraint per request ({', '.join(CONSTRAINT_FIELDS)}, structural_tag)",
                given[0],
            )
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise RequestError(f"structural_tag={self.structural_tag!r} is invalid; allowed: an object with "
                               f"format (or the legacy structures and triggers), or its JSON text", "structural_tag")
        if self.ebnf is not None and not isinstance(self.ebnf, str):
            raise RequestError(f"ebnf={self.ebnf!r} is invalid; allowed: a grammar as a string", "ebnf")
        if self.grammar_backend is not None and self.grammar_backend not in GRAMMAR_BACKENDS:
            raise RequestError(
                f"grammar_backend={self.grammar_backend!r} is invalid; allowed: {', '.join(GRAMMAR_BACKENDS)}",
                "grammar_backend",
            )
        if self.whitespace_pattern is not None and self.json_schema is None:
            raise RequestError(
                "whitespace_pattern is set without json_schema; it only applies to JSON output", "whitespace_pattern"
            )
        if self.whitespace_pattern is not None:
            from plait.runtime.constrained.json_schema import check_whitespace

            try:  # here, by its own name (the translators would report it under json_schema, once per backend)
                check_whitespace(self.whitespace_pattern)
            except ValueError as e:
                raise RequestError(str(e), "whitespace_pattern") from None
        if self.regex is not None and not isinstance(self.regex, str):
            raise RequestError(f"regex={self.regex!r} is invalid; allowed: a string", "regex")
        if self.unique_items is not None:
            _check_unique_items(self.unique_items, self.regex is not None or self.ebnf is not None)
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool, str)):
            raise RequestError(
                f"json_schema={self.json_schema!r} is invalid; allowed: a JSON Schema (an object, or true/false) "
                "or its JSON text",
                "json_schema",
            )

    def constraint(self, default_backend: str = AUTO) -> Constraint | None:
        """The constraint translated for its grammar backend, or None. The backend is
        ``grammar_backend`` or else ``default_backend`` (the engine's option); ``auto``
        picks per constraint (:func:`choose_backend`). Raises :class:`RequestError`
        naming the field (and schema keyword) at fault. Done once per request, where
        the request enters."""
        kind = next((k for k in CONSTRAINT_FIELDS if getattr(self, k) is not None), None)
        tagged = None
        unique: str | None = None  # uniqueItems kept beside a regex (Constraint.unique)
        if self.structural_tag is not None:  # enforced as its regex
            from plait.runtime.constrained.structural_tag import structural_tag_constraint

            try:
                spec = json.loads(self.structural_tag) if isinstance(self.structural_tag, str) else self.structural_tag
                if not isinstance(spec, dict):
                    raise ValueError("structural_tag is invalid; allowed: an object with format (or the legacy "
                                     "structures and triggers)")
                kind = "regex"
                tagged, groups = structural_tag_constraint(spec, "structural_tag")
                from plait.runtime.constrained.holes import backend_refusal, has_holes, holes_to_lark

                if has_holes(tagged):  # a schema only llguidance's JSON compiler follows: Lark with %json
                    why = backend_refusal(self.grammar_backend, "this structural_tag")
                    if why is not None:
                        raise RequestError(why, "grammar_backend")
                    kind, tagged, default_backend = "ebnf", holes_to_lark(tagged), LLGUIDANCE
                if groups:
                    from plait.runtime.constrained.unique_items import groups_text

                    unique = groups_text(groups)
            except json.JSONDecodeError as e:
                raise RequestError(f"structural_tag is not valid JSON: {e}", "structural_tag") from None
            except ValueError as e:
                raise RequestError(str(e), "structural_tag") from None
        if kind is None:
            return None
        backend = self.grammar_backend or default_backend
        if kind == "ebnf" and backend == OUTLINES:
            raise RequestError("grammar_backend='outlines' cannot enforce an ebnf grammar; allowed: llguidance or auto",
                               "grammar_backend")
        value = tagged if tagged is not None else getattr(self, kind)
        if kind == "json_schema":  # its text parsed here, once: the translators get the object
            # (or True); then depth and size, walked without recursion: the UTF-8 check below
            # (json.dumps) recursed into a 600-level schema, a RecursionError and a 500
            from plait.runtime.constrained.json_schema import check_schema_size, load_schema

            try:
                value = load_schema(value)
                check_schema_size(value)
            except ValueError as e:
                raise RequestError(str(e), kind) from None
        if kind == "regex":  # the dialect, once: every backend reads the same one (a surrogate by position);
            # then \d \w \s as ASCII, as SGLang's grammar backends read them (Rust's are Unicode)
            from plait.runtime.constrained.regexes import ascii_classes, check_regex

            try:
                value = check_regex(value, "regex")  # without end anchors
            except ValueError as e:
                raise RequestError(str(e), kind) from None
            value = ascii_classes(value)
        _check_unicode(value, kind)
        order = choose_backend(kind) if backend == AUTO else [backend]
        errors = []
        if unique is None and self.unique_items:
            from plait.runtime.constrained.unique_items import groups_text

            unique = groups_text([(a, sites) for a, sites in self.unique_items])
        for b in order:
            try:
                return Constraint(kind, _translate(b, kind, value, self.whitespace_pattern), b, unique or "",
                                  backend == AUTO)
            except ValueError as e:  # the translators' messages name the keyword and its location
                errors.append(f"{e} (llguidance backend)" if b == LLGUIDANCE and len(order) > 1 else str(e))
            except Exception as e:  # noqa: BLE001  (a translator's bug on a value it did not expect)
                # the request's own fault or not, it fails alone and by name, not as a 500
                logger.warning("the %s translator failed on a %s", b, kind, exc_info=True)
                errors.append(f"{kind} cannot be compiled ({type(e).__name__}: {e}) ({b} backend)")
        if kind == "json_schema" and any("uniqueItems" in e for e in errors):
            guarded = _with_unique_guard(kind, value, order, self.whitespace_pattern)
            if isinstance(guarded, Constraint):
                return guarded
            if guarded is not None:  # why the guard cannot keep it either (items that may be objects)
                errors = [guarded]
        message = "; ".join(_distinct(reversed(errors) if len(order) > 1 and order[0] == LLGUIDANCE else errors))
        raise RequestError(message if message.startswith(kind) else f"{kind} is invalid: {message}", kind)

    def stop_regex_program(self) -> StopRegex | None:
        """``stop_regex`` compiled (cached per pattern list: the front's check and the
        engine's output processor share one compile per process), or None; raises
        :class:`RequestError` naming ``stop_regex``."""
        if not self.stop_regex:
            if not isinstance(self.stop_regex, list):
                raise RequestError(f"stop_regex={self.stop_regex!r} is invalid; allowed: a regular expression or a "
                                   "list of them", "stop_regex")
            return None
        if not isinstance(self.stop_regex, list) or not all(isinstance(s, str) for s in self.stop_regex):
            raise RequestError(f"stop_regex={self.stop_regex!r:.120} is invalid; allowed: a regular expression or a "
                               f"list of at most {MAX_STOP_REGEXES} of them", "stop_regex")
        for s in self.stop_regex:
            _check_unicode(s, "stop_regex")
        try:
            return compile_stop_regex(tuple(self.stop_regex))
        except ValueError as e:
            raise RequestError(str(e), "stop_regex") from None

    @property
    def is_greedy(self) -> bool:
        """Temperature below :data:`GREEDY_TEMPERATURE` samples greedily, as in SGLang and
        vLLM: dividing logits by a subnormal temperature would overflow."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


MAX_UNIQUE_ANCHORS = 64  # unique_items' [text, paths] pairs
MAX_UNIQUE_ANCHOR_CHARS = 256
MAX_UNIQUE_PATH_STEPS = 64


def _check_unique_items(groups: Any, with_regex: bool) -> None:
    """``unique_items``: a list of [text, [path, ...]] pairs beside a ``regex`` (or an
    ``ebnf`` grammar: forced calls with JSON holes, :mod:`plait.runtime.constrained.holes`)."""
    from plait.runtime.constrained.unique_items import MAX_SITES

    allowed = (f"a list of at most {MAX_UNIQUE_ANCHORS} [text, paths] pairs: text a string of at most "
               f"{MAX_UNIQUE_ANCHOR_CHARS} characters, paths a list of instance paths (lists of keys, indices, \"*\" "
               f"or \"**\", at most {MAX_UNIQUE_PATH_STEPS} steps), at most {MAX_SITES} paths in all")
    if not with_regex:
        raise RequestError("unique_items is given without regex or ebnf; allowed: unique_items beside a regex or "
                           "ebnf constraint", "unique_items")
    ok = isinstance(groups, list) and len(groups) <= MAX_UNIQUE_ANCHORS
    total = 0
    for g in groups if ok else ():
        if not (isinstance(g, (list, tuple)) and len(g) == 2 and isinstance(g[0], str)
                and len(g[0]) <= MAX_UNIQUE_ANCHOR_CHARS and isinstance(g[1], list)):
            ok = False
            break
        total += len(g[1])
        ok = all(isinstance(p, list) and len(p) <= MAX_UNIQUE_PATH_STEPS
                 and all(isinstance(x, str) or is_int(x) and 0 <= x < 2**31 for x in p) for p in g[1])
        if not ok:
            break
    if not ok or total > MAX_SITES:
        raise RequestError(f"unique_items={_short_json(groups)} is invalid; allowed: {allowed}", "unique_items")
    _check_unicode(groups, "unique_items")


def _short_json(v: Any) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 80 else s[:80] + "..."


def _check_unicode(value: Any, kind: str) -> None:
    """Refuse a constraint holding a lone surrogate (a JSON ``\\ud800`` escape, in a
    pattern, a schema's keys or values): its translation cannot be encoded as UTF-8, so
    it would fail as an internal error when sent to the engine."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{kind} is not valid UTF-8 (it contains a lone surrogate)", kind) from None


@dataclass(frozen=True)
class Constraint:
    """A request's constraint after translation: ``kind`` is the field it came from
    (``regex``, ``json_schema`` or ``ebnf``: what an error names), ``grammar`` what
    ``backend`` compiles (a regex the output must fully match for ``outlines``; an
    llguidance grammar for ``llguidance``)."""

    kind: str
    grammar: str
    backend: str = OUTLINES
    # JSON Schema ``uniqueItems`` the grammar does not enforce: the instance paths of the
    # arrays the matcher keeps distinct (plait.runtime.constrained.unique_items), as JSON
    unique: str = ""
    # grammar_backend ``auto`` chose ``backend``: a regex (or a JSON Schema's regex
    # translation) on outlines-core whose build runs past its time or memory is then built
    # on llguidance instead (Engine)
    auto: bool = False

    @property
    def llguidance_fallback(self) -> bool:
        """Auto's regex (or a JSON Schema's regex translation) on outlines-core: built on
        llguidance instead when its build runs past its time (a short budget:
        ``AUTO_OUTLINES_BUDGET_S``) or memory."""
        return self.auto and self.kind in ("regex", "json_schema") and self.backend == OUTLINES


def _distinct(errors: Any) -> list[str]:
    """The backends' refusals, each reason once: plait checks a pattern alike for both,
    and the same long explanation was said twice (a pydantic model's look-ahead); the
    first is kept."""
    out: list[str] = []
    seen: set[str] = set()
    for e in errors:
        key = e.removesuffix(" (llguidance backend)")
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def choose_backend(kind: str) -> list[str]:
    """``auto``'s rule: the backends to try for a constraint of ``kind``, in order (the
    first that accepts the constraint enforces it). ``ebnf`` needs llguidance; a regex
    goes to outlines-core (cached per-state masks, token healing), and to llguidance
    when outlines-core would write out too many copies of a counted repetition
    (``a{100000}``: llguidance does not expand it); a JSON Schema to
    llguidance first (compiles in about a millisecond, recursive schemas, fast masks)
    and to plait's schema -> regex translation when llguidance refuses it (``uniqueItems``,
    disjoint ``oneOf``, ``not``, float-safe number bounds...). See docs/constrained.md."""
    if kind == "ebnf":
        return [LLGUIDANCE]
    if kind == "regex":
        return [OUTLINES, LLGUIDANCE]
    return [LLGUIDANCE, OUTLINES]


def _with_unique_guard(kind: str, value: Any, order: list[str], whitespace: str | None) -> Constraint | str | None:
    """A JSON Schema the translators refused for its ``uniqueItems``, compiled without
    the ones the matcher keeps instead (arrays of strings, numbers, booleans, null:
    :mod:`plait.runtime.constrained.unique_items`); or why those cannot be kept (a
    message); or None when it does not compile without them either (the first refusal
    stands)."""
    from plait.runtime.constrained.unique_items import has_unique, plan, sites_text

    if not has_unique(value):
        return None
    try:
        stripped, sites = plan(value)
    except ValueError as e:
        return str(e)
    for b in order:
        try:
            return Constraint(kind, _translate(b, kind, stripped, whitespace), b, sites_text(sites))
        except Exception:  # noqa: BLE001 - the refusal of the schema as given is the answer
            continue
    return None


def _translate(backend: str, kind: str, value: Any, whitespace: str | None) -> str:
    """What ``backend`` compiles for one constraint field (a regex already checked by
    :meth:`SamplingParams.constraint`), or ``ValueError``."""
    if backend == OUTLINES:
        from plait.runtime.constrained.json_schema import schema_to_regex
        from plait.runtime.constrained.worker import counted_repetition_too_large

        regex = value if kind == "regex" else schema_to_regex(value, whitespace)  # a regex's dialect: checked once
        too_large = counted_repetition_too_large(regex)  # the worker would refuse it after admission
        if too_large is not None:
            raise ValueError(f"{kind} is invalid: {too_large}")
        return regex
    from plait.runtime.constrained import llguidance_backend as llg

    if kind == "regex":
        return llg.regex_grammar(value)
    if kind == "ebnf":
        return llg.ebnf_grammar(value)
    return llg.schema_grammar(value, whitespace)


MAX_LOGIT_BIAS = 1024  # tokens one request may bias


def _logit_bias(bias: Any) -> dict[int, float]:
    """``logit_bias`` with int keys, checked: token ids (ints or decimal strings, the
    vocabulary bound is the engine's check) to finite numbers in [-100, 100]."""
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias={bias!r:.80} is invalid; allowed: an object of token id -> number in "
                           "[-100, 100]", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(bias)} tokens; allowed: at most {MAX_LOGIT_BIAS}", "logit_bias")
    out: dict[int, float] = {}
    for k, v in bias.items():
        tid = k if is_int(k) else int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 12 else None
        if tid is None or tid < 0:
            raise RequestError(f"logit_bias key {k!r:.40} is invalid; allowed: a token id (a non-negative integer, "
                               "or its decimal text)", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
            raise RequestError(f"logit_bias[{k!r:.40}]={v!r:.40} is invalid; allowed: a number in [-100, 100]",
                               "logit_bias")
        out[tid] = out.get(tid, 0.0) + float(v)
    return out


def _int(v: Any, name: str, lo: int, hi: int | None) -> None:
    allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        raise RequestError(f"{name}={v!r} is invalid; allowed: {allowed}", name)


def _num(v: Any, name: str, lo: float, hi: float, allowed: str) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < lo or v > hi:
        raise RequestError(f"{name}={v!r} is invalid; allowed: {allowed}", name)
