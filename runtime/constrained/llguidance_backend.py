"""The llguidance backend: context-free grammars (JSON Schema, Lark/GBNF ``ebnf``,
regex) compiled by llguidance, with per-step masks computed by its Earley parser.

- Edge (torch-free, in the front's worker thread or ``Engine.add_request``):
  :func:`schema_grammar`, :func:`ebnf_grammar`, :func:`regex_grammar` check the size,
  refuse (by name) what llguidance would not enforce soundly, and validate the grammar
  without a tokenizer (``LLMatcher.validate_grammar``, bounded by :func:`parser_limits`).
- :class:`LLGuidanceCompiler`: builds an ``LLMatcher`` over the model's tokenizer in a
  thread (the build drops the GIL), never on the engine loop; a build past ``timeout_s``
  fails its requests (the thread is left to finish: the parser limits bound its work)
  and the result is cached by (tokenizer fingerprint, grammar). A request's matcher is a
  ``deep_copy`` of the cached one.
- :class:`LLGuidanceMatcher`: the per-request state behind :class:`backend.Matcher`.
  Jump-forward uses llguidance's forced bytes, re-tokenized together with the sampled
  token (as the outlines matcher does). Token healing is declined: it needs the
  grammar's state after every token that extends the backed-off prompt token (thousands
  for a trailing space), which llguidance can only find by consuming each one.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from plait.runtime.constrained.backend import GrammarFuture
from plait.runtime.constrained.json_schema import SUBSCHEMA_LIST, SUBSCHEMA_MAP, SUBSCHEMA_ONE, _float_inexact
from plait.runtime.constrained.finite import lark_unending, schema_unending
from plait.runtime.constrained.vocab import TokenVocab

logger = logging.getLogger(__name__)

MAX_GRAMMAR_CHARS = 100_000  # an ebnf text or a JSON schema's JSON text
MAX_INTEGER = 10**16 - 1
# a JSON Schema number without bounds or a step gets both (close_objects): at most 16
# integer digits and 10 fraction digits (llguidance refuses a finer decimal step: the
# float of 1e-12 has too many digits for it)
NUMBER_FRACTION_DIGITS = 10
NUMBER_STEP = 10.0**-NUMBER_FRACTION_DIGITS

# the largest string length llguidance reads (its regexes count repetitions in 32 bits:
# maxLength 2**32 failed to compile, "decimal literal invalid")
MAX_LENGTH = 2**32 - 1
# how deep subschemas may nest with their $refs expanded (check_expanded_depth): llguidance
# recurses per level on the native stack, and a chain of 1000 object levels (2000
# subschemas) overflowed it (a segmentation fault); 500 did not
MAX_EXPANDED_DEPTH = 400

# Draft-3 validation keywords llguidance does not know (it would ignore them).
_DRAFT3 = ("disallow", "divisibleBy", "extends")


def parser_limits() -> Any:
    """Bounds on llguidance's work per grammar build and per step (its defaults, made
    explicit: they are what keeps a build or a mask from running away)."""
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=500_000, initial_lexer_fuel=1_000_000,
                                     step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=250_000,
                                     verbose_errors=False)


# -- edge translation ------------------------------------------------------------------------------
def _check_size(text: str, what: str, limit: int = MAX_GRAMMAR_CHARS) -> None:
    if len(text) > limit:
        raise ValueError(f"{what} has {len(text)} characters; allowed: at most {limit}")


def _validate(grammar: str) -> str:
    from llguidance import LLMatcher

    is_error, messages = _bounded(  # on a deep stack (see DEEP_STACK_BYTES)
        lambda: LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits()), None)
    if is_error:
        raise ValueError(f"it cannot be compiled: {messages[0][:500]}")
    return grammar


# The formats llguidance's JSON compiler enforces itself as ``jsonschema``'s format checker
# reads them. It knows "date", "date-time", "time" and "hostname" too, but admits values
# the checker rejects (year 0000, 29 February of any year, second 60, a 300-character
# host name): those get plait's regex (json_schema.FORMATS) as any other draft format.
_LLG_FORMATS = frozenset({"duration", "email", "ipv4", "ipv6", "uri", "uuid"})


@functools.cache
def _python_class(letter: str) -> str:
    """The class body of Python's ``\\d``/``\\s``/``\\w`` on ``str`` (Unicode decimal
    digits, ``str.isspace``, ``str.isalnum`` and ``_``), as ranges of the characters
    themselves (``\\xNN`` for ASCII punctuation and controls), which Python, Rust's
    regex syntax and interegular read alike."""
    test = {"d": str.isdecimal, "s": str.isspace, "w": lambda c: c.isalnum() or c == "_"}[letter]
    out, start = [], None
    for cp in range(0x110001):
        hit = cp < 0x110000 and not 0xD800 <= cp <= 0xDFFF and test(chr(cp))
        if hit and start is None:
            start = cp
        elif not hit and start is not None:
            out.append(_cp(start) + ("-" + _cp(cp - 1) if cp - 1 > start else ""))
            start = None
    return "".join(out)


def _cp(cp: int) -> str:
    return "\\x%02x" % cp if cp < 0x80 and not chr(cp).isalnum() else chr(cp)


def _exact_classes(pattern: str, where: str) -> str:
    """``pattern`` with each shorthand class written as the set Python reads
    (:func:`_python_class`): the same language for both engines, so a key pattern (which
    decides which schema applies to a key, and cannot be narrowed) keeps its meaning.
    A word boundary, or a negated shorthand inside a class, is refused.

    A negated class also leaves out NUL (``[^"]`` becomes ``[^"\\x00]``): llguidance
    reads a class holding every control character as any string character, escaped
    quote and backslash included (``[^"]`` took ``\\"``). No output holds a control
    character that needs ``\\uXXXX`` (the compiler writes no such escape), so this
    changes no output; a class of another form that holds them all, and not both the
    quote and the backslash, is refused (:func:`_check_control_classes`)."""
    out, i, in_class, negated = [], 0, False, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e in "bB":
                raise ValueError(f"{where}: {pattern!r} uses a word boundary, which the llguidance backend does not read "
                                 "as JSON Schema's (Python's) regexes do")
            if e in "dsw":
                out.append(_python_class(e) if in_class else "[" + _python_class(e) + "]")
            elif e in "DSW" and not in_class:
                out.append("[^" + _python_class(e.lower()) + "]")
            elif e in "DSW":
                raise ValueError(f"{where}: {pattern!r} uses a negated shorthand class inside a class, which the "
                                 "llguidance backend does not support")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class and c == "]" and not (out and out[-1] in ("[", "[^")):
            in_class = False
            if negated:
                out.append("\\x00")
        elif not in_class and c == "[":
            in_class = True
            negated = pattern.startswith("[^", i)
            if negated:
                out.append("[^")
                i += 2
                continue
        out.append(c)
        i += 1
    text = "".join(out)
    _check_control_classes(text, where)
    return text


_UNWRITABLE = [c for c in range(0x20) if chr(c) not in "\b\t\n\f\r"]  # controls JSON writes only as \uXXXX


def _check_control_classes(pattern: str, where: str) -> None:
    """Refuses a class in ``pattern`` (Python's reading) that holds every control
    character but not both the quote and the backslash: llguidance would admit them
    (see :func:`_exact_classes`). A pattern Python cannot parse is left to the others."""
    from re import _constants as C, _parser  # type: ignore[attr-defined]

    from plait.runtime.constrained.json_schema import _class_has

    try:
        todo: list[Any] = [_parser.parse(pattern)]
    except Exception:  # noqa: BLE001  (refused, or not, where patterns are read)
        return
    while todo:
        node = todo.pop()
        if isinstance(node, (list, tuple, _parser.SubPattern)):
            if len(node) == 2 and node[0] is C.IN:
                items = node[1]
                if (all(_class_has(items, c) for c in _UNWRITABLE)
                        and not (_class_has(items, ord('"')) and _class_has(items, ord("\\")))):
                    raise ValueError(f"{where}: {pattern!r} has a character class with every control character but "
                                     "not both '\"' and '\\\\', which the llguidance backend misreads (it admits "
                                     "them); allowed: a class without the control characters U+0000-U+001F")
                continue
            todo.extend(node)


def _check_delete(pattern: str, shown: str, where: str) -> None:
    """Refuses ``pattern`` (Python's reading, as sent to llguidance; the schema wrote
    ``shown``) when a place in it takes U+007F (DELETE) and nothing llguidance can
    write: a literal U+007F, or a class (not negated) of it and control characters JSON
    writes only as ``\\uXXXX``.
    llguidance's JSON strings hold neither (:data:`_UNWRITTEN`), and its reading of such
    a place is not a narrowing: ``a\\x7fb`` admitted ``"ab"`` (which ``jsonschema``
    rejects), ``^\\x7f$`` compiled to a grammar with no output, a ``patternProperties``
    key ``^x\\x7f$`` wrote the key ``"x"``. A class with other characters, ``.`` and a
    negated class only lose U+007F there: the same language over the strings llguidance
    writes. The regex translation writes U+007F raw."""
    from re import _constants as C, _parser  # type: ignore[attr-defined]

    def unwritten(items: list[Any]) -> bool:  # every member of a class is a character llguidance cannot write
        spans = [(av, av) if op is C.LITERAL else av if op is C.RANGE else (0, 0x10FFFF) for op, av in items]
        return all(b - a < 0x80 and all(_UNWRITTEN.match(chr(c)) for c in range(a, b + 1)) for a, b in spans)

    try:
        todo: list[Any] = [_parser.parse(pattern)]
    except Exception:  # noqa: BLE001  (refused, or not, where patterns are read)
        return
    while todo:
        node = todo.pop()
        if not isinstance(node, (list, tuple, _parser.SubPattern)):
            continue
        if len(node) == 2 and node[0] in (C.LITERAL, C.IN):
            items = [node] if node[0] is C.LITERAL else node[1]
            if (not any(op is C.NEGATE for op, _ in items) and unwritten(items)
                    and any(op is C.LITERAL and av == 0x7F or op is C.RANGE and av[0] <= 0x7F <= av[1]
                            for op, av in items)):
                raise ValueError(f"{where}: {shown!r} has a place only U+007F (DELETE) fits, which the llguidance "
                                 "backend does not write in a string (it read 'a\\x7fb' as 'ab'); allowed there: "
                                 "patterns without such a place")
            continue
        todo.extend(node)


def _check_patterns_exclusive(patterns: list[str], where: str) -> None:
    """No string contains a match of two of ``patterns`` (as ``jsonschema`` reads
    ``patternProperties``: a match anywhere in the key)."""
    import interegular

    def searched(p: str) -> Any:
        p = p[1:] if p.startswith("^") else ".*" + p
        p = p[:-1] if p.endswith("$") and not p.endswith("\\$") else p + ".*"
        return interegular.parse_pattern(p).to_fsm()

    from plait.runtime.constrained.fsm_limits import FsmTooLarge, fsm_deadline

    if len(patterns) < 2:
        return
    try:
        with fsm_deadline():  # a short pattern can have an exponential automaton
            fsms = [searched(p) for p in patterns]
            for i in range(len(fsms)):
                for j in range(i + 1, len(fsms)):
                    if not (fsms[i] & fsms[j]).empty():
                        raise ValueError(f"patternProperties at {where}: a key can match both {patterns[i]!r} and "
                                         f"{patterns[j]!r}, which the llguidance backend does not combine")
    except FsmTooLarge as e:
        raise ValueError(f"patternProperties at {where}: the patterns are too complex to check that they are "
                         f"exclusive ({len(patterns)} patterns, {len(patterns) * (len(patterns) - 1) // 2} pairs; {e}); "
                         f"allowed: fewer or simpler patterns, whose pairwise check ends within the limit") from None
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"patternProperties at {where}: could not check the patterns are exclusive "
                         f"({str(e)[:80]})") from None


def _llg_bounds(v: int | float, type_: Any) -> list[int | float] | None:
    """The bounds llguidance's JSON compiler may enforce for a schema's ``v``: it reads
    ``v`` as a 64-bit float, and on integers clamps that to the 64-bit integers (so
    ``minimum: 2**53 + 1`` becomes ``2**53``, ``minimum: 2**64`` becomes ``2**63 - 1``);
    the latter on ``integer`` and the former on ``number`` (the schema's type), else
    either; None past the floats."""
    try:
        f = float(v)
    except OverflowError:
        return None
    if not math.isfinite(f):
        return None
    if not f.is_integer():
        return [f]
    clamped = max(-(2**63), min(2**63 - 1, int(f)))
    return [clamped] if type_ == "integer" else [f] if type_ == "number" else [f, clamped]


_UNWRITTEN = re.compile("[\x00-\x07\x0b\x0e-\x1f\x7f]")  # in a string: what llguidance's JSON cannot write


# llguidance fails to compile an integer range whose lower end it reads as the smallest
# 64-bit integer ("Failed to generate regex for integer range: min=Some(-9223372036854775808)"):
# a schema's int64 minimum, or any lower bound a float reads at or below it (-1e30). Where
# a narrowing is allowed such a bound becomes this one, the float next above it: the
# integers below (1023 of 2**64, and those past int64) are not written.
I64_FLOOR = -(2**63) + 1024


def _numeric_type(types: Any) -> str | None:
    """The numeric type a schema's bounds apply to: its ``type``, or the one numeric type
    of a list (``["integer", "null"]``); None for neither or both."""
    if not isinstance(types, list):
        return types if types in ("integer", "number") else None
    numeric = [t for t in ("integer", "number") if t in types]
    return numeric[0] if len(numeric) == 1 else None


def _i64_floor_keys(schema: dict[str, Any]) -> list[str]:
    """The lower-bound keywords of an integer schema that llguidance reads at or below
    -2**63 (:data:`I64_FLOOR`)."""
    out = []
    for k in ("minimum", "exclusiveMinimum"):
        v = schema.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            got = _llg_bounds(v, "integer")
            if got is not None and got[0] <= -(2**63):
                out.append(k)
    return out


def _unwritable(value: Any) -> str | None:
    """What of a ``const`` / ``enum`` value llguidance would write as another value, or
    None. llguidance writes a listed string without the characters its JSON strings
    cannot hold (control characters but the short escapes, with no ``\\u`` escapes
    allowed; and U+007F), so ``"a\\u0001b"`` became ``"ab"``; and reads numbers as 64-bit
    floats, so ``12345678901234567891`` became ``12345678901234567000``: both admitted
    values ``jsonschema`` rejects."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, str) and (m := _UNWRITTEN.search(v)):
            return f"the control character U+{ord(m.group()):04X} in {v[:40]!r}"
        elif isinstance(v, int) and not isinstance(v, bool) and _float_inexact(v):
            shown = str(v) if abs(v) < 10**40 else f"of {len(str(abs(v)))} digits"
            return f"the integer {shown}, past what a 64-bit float holds exactly"
    return None


def _bound_moved(v: int | float, lower: bool, narrow: bool, type_: Any) -> str | None:
    """How llguidance's reading of bound ``v`` admits a value past it, or None when it
    does not (exact arithmetic: Python compares ints and floats exactly, as
    ``jsonschema`` does): kept are the same bound and, where a narrowing is allowed, a
    lower bound read higher or an upper one read lower."""
    got = _llg_bounds(v, type_)
    if got is None:
        return "this one is past them"
    moved = [g for g in got if not (g == v or narrow and (g > v if lower else g < v))]
    return f"this one as {moved[0]}" if moved else None


_EXACT = ("oneOf", "not", "if", "then", "else")  # a narrower subschema here admits more, not fewer, values


def _children(schema: dict[str, Any]) -> Any:
    """(keyword, index or name or None, subschema, under one of _EXACT) for each
    subschema of ``schema``."""
    for k in SUBSCHEMA_ONE:
        if k in schema:
            yield k, None, schema[k], k in _EXACT
    items = schema.get("items")
    if isinstance(items, list):
        for i, x in enumerate(items):
            yield "items", i, x, False
    elif items is not None:
        yield "items", None, items, False
    for k in SUBSCHEMA_LIST:
        if isinstance(schema.get(k), list):
            for i, x in enumerate(schema[k]):
                yield k, i, x, k in _EXACT
    for k in (*SUBSCHEMA_MAP, "dependencies"):
        if isinstance(schema.get(k), dict):
            for name, x in schema[k].items():
                yield k, name, x, False


def _exact_places(root: Any) -> set[tuple[str, ...]] | None:
    """The places (JSON-pointer parts) of the subschemas a local ``$ref`` reaches from
    under a ``oneOf``/``not``/``if``/``then``/``else`` (directly or through other
    ``$ref``s), which :func:`llguidance_schema` must not narrow; None (narrow nothing)
    when such a ``$ref`` may be read against a nested ``$id``, which this does not track."""
    from plait.runtime.constrained.json_schema import local_pointer, pointer_target

    places: set[tuple[str, ...]] = set()
    todo: list[tuple[Any, bool]] = [(root, False)]
    nested_id = False
    while todo:
        s, exact = todo.pop()
        if not isinstance(s, dict):
            continue
        nested_id |= s is not root and any(isinstance(s.get(k), str) and not s[k].startswith("#")
                                           for k in ("$id", "id"))
        target = local_pointer(root, s.get("$ref")) if exact else None
        if target is not None and tuple(target) not in places:
            places.add(tuple(target))
            todo.append((pointer_target(root, target), True))  # NOWHERE: not a dict, skipped
        todo.extend((x, exact or under) for _, _, x, under in _children(s))
    return None if places and nested_id else places


_URI_SAFE = "~!$&'()*+,;=:@-._"  # what a pointer part keeps unescaped in a URI fragment (RFC 3986)


def hoisted_refs(root: Any) -> tuple[Any, dict[str, str]]:
    """``root`` (refs already read from the root: :func:`json_schema.rooted_refs`) with
    each local ``$ref`` written as a URI llguidance reads, and pointing where
    :func:`llguidance_schema` looks:

    - a target outside the subschema keywords (an OpenAPI document's
      ``#/components/schemas/Pet``, a vendor keyword) is copied into the root's ``$defs``
      and the reference points at the copy: the rewrites and refusals walk subschema
      keywords only, and left the target as llguidance reads it (its own ``date``
      admitted 2021-02-29, a ``const`` lost its control characters); a draft-7 root
      ``$ref`` also dropped ``components`` beside it (the pointer went nowhere);
    - the pointer is percent-encoded (``#/definitions/Record<string,number>``, a
      ``typescript-json-schema`` name, or a non-ASCII one, was "Invalid URI reference").

    Also returns the copies' names in ``$defs`` -> where they were (``#/components/...``),
    for messages (:func:`_shown_places`). ``root`` itself when nothing needs this."""
    import copy
    from urllib.parse import quote

    from plait.runtime.constrained.json_schema import (_DATA_KEYWORDS, MAX_SCHEMA_CHARS, NOWHERE, _pointer_part,
                                                       local_pointer, pointer_target)

    if not isinstance(root, dict) or ("$defs" in root and not isinstance(root["$defs"], dict)):
        return root, {}
    known: set[tuple[str, ...]] = set()
    todo: list[tuple[Any, tuple[str, ...]]] = [(root, ())]
    while todo:  # the places the rewrites reach
        s, parts = todo.pop()
        if isinstance(s, dict) and parts not in known:
            known.add(parts)
            todo.extend((x, (*parts, k) if key is None else (*parts, k, str(key))) for k, key, x, _ in _children(s))

    def refs(doc: dict[str, Any]) -> list[dict[str, Any]]:
        found, stack = [], [doc]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(x for x in node if isinstance(x, (dict, list)))
                continue
            if isinstance(node.get("$ref"), str):
                found.append(node)
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS and isinstance(v, (dict, list)))
        return found

    hoisted: dict[tuple[str, ...], str] = {}
    new: dict[str, str] = {}
    taken = set(root.get("$defs", {}))
    for node in refs(root):
        ref = node["$ref"]
        parts = local_pointer(root, ref)
        if parts is None or pointer_target(root, parts) is NOWHERE:
            continue  # llguidance refuses it by name
        if tuple(parts) not in known and tuple(parts) not in hoisted:
            name = next(n for i in range(len(taken) + 1) if (n := f"plait-ref-{i}") not in taken)
            taken.add(name)
            hoisted[tuple(parts)] = name
        if tuple(parts) in hoisted:
            parts = ["$defs", hoisted[tuple(parts)]]
        new[ref] = "#" + "".join("/" + quote(_pointer_part(p), safe=_URI_SAFE) for p in parts)
    if all(old == ref for old, ref in new.items()):
        return root, {}
    budget = MAX_SCHEMA_CHARS // 4  # the values check_schema_size allows: the copies count too
    for parts in hoisted:
        stack = [pointer_target(root, list(parts))]
        while stack and budget >= 0:
            node = stack.pop()
            budget -= 1
            stack.extend(node.values() if isinstance(node, dict) else node if isinstance(node, list) else ())
        if budget < 0:
            raise ValueError(f"json_schema's $refs to places outside its subschemas (first to "
                             f"#/{'/'.join(map(_pointer_part, next(iter(hoisted))))}) copy more than "
                             f"{MAX_SCHEMA_CHARS // 4} values; the schema is too large")
    out = copy.deepcopy(root)
    for node in refs(out):
        node["$ref"] = new.get(node["$ref"], node["$ref"])
    defs = dict(out.get("$defs", {}))
    for parts, name in hoisted.items():  # copied with their own $refs rewritten
        defs[name] = copy.deepcopy(pointer_target(out, list(parts)))
    if defs:
        out["$defs"] = defs
    return out, {name: "/".join(["#", *parts]) for parts, name in hoisted.items()}


def check_expanded_depth(root: Any, limit: int = MAX_EXPANDED_DEPTH) -> None:
    """Refuses ``root`` when its subschemas, each local ``$ref`` followed to its target
    (a target already being expanded is a recursion: not followed again), nest more than
    ``limit`` deep. llguidance's compiler recurses once per level on the native stack: a
    chain of 1000 ``$defs`` each holding the next as a property crashed the process
    (a segmentation fault, the server with it), where every schema level in the
    document itself stays within ``MAX_SCHEMA_DEPTH``. Each target's depth is counted
    once (memoized), so the walk is linear in the document."""
    from plait.runtime.constrained.json_schema import local_pointer, pointer_target

    def children(s: dict[str, Any], where: str) -> list[tuple[dict[str, Any], str]]:
        out = [(x, f"{where}/{k}" if key is None else f"{where}/{k}/{key}")
               for k, key, x, _ in _children(s) if isinstance(x, dict)]
        parts = local_pointer(root, s.get("$ref"))
        target = pointer_target(root, parts) if parts is not None else None
        if isinstance(target, dict):
            out.append((target, "#" + "".join("/" + p for p in parts)))
        return out

    if not isinstance(root, dict):
        return
    depth: dict[int, int] = {}  # id(subschema) -> how deep it nests (1: no subschema)
    open_ids = {id(root)}
    stack: list[tuple[dict[str, Any], str, Any, int]] = [(root, "#", iter(children(root, "#")), 0)]
    while stack:
        node, where, todo, deepest = stack[-1]
        nxt = next(todo, None)
        if nxt is None:
            stack.pop()
            open_ids.discard(id(node))
            depth[id(node)] = deepest + 1
            if stack:
                p = stack[-1]
                stack[-1] = (p[0], p[1], p[2], max(p[3], deepest + 1))
            continue
        child, at = nxt
        if id(child) in depth:
            known = depth[id(child)]
            stack[-1] = (node, where, todo, max(deepest, known))
            if len(stack) + known <= limit:
                continue
        elif id(child) not in open_ids:  # (one being expanded: a recursion, referred back to)
            open_ids.add(id(child))
            stack.append((child, at, iter(children(child, at)), 0))
            if len(stack) <= limit:
                continue
        else:
            continue
        raise ValueError(f"json_schema nests more than {limit} subschemas deep with its $refs expanded (past the "
                         f"limit at {at}); allowed: at most {limit} levels, which the llguidance backend's compiler "
                         "recurses through (a recursion through $ref counts once)")


def _shown_places(message: str, copied: dict[str, str]) -> str:
    """``message`` with the places in :func:`hoisted_refs`'s copies written where the
    schema has them."""
    return re.sub(r"#/\$defs/(plait-ref-[0-9]+)(?![0-9])", lambda m: copied.get(m.group(1), m.group()), message)


def llguidance_schema(schema: Any) -> Any:
    """A copy of ``schema`` (a parsed document) for llguidance's JSON compiler. Refuses,
    naming the keyword and its location, what llguidance would ignore or enforce
    unsoundly (an admitted instance that ``jsonschema`` rejects):

    - draft 3's ``disallow`` / ``divisibleBy`` / ``extends`` and boolean ``required``
      (llguidance ignores them);
    - ``exclusiveMinimum`` / ``exclusiveMaximum`` unless the type is ``integer``: a
      decimal just past the bound with more digits than a double holds parses onto it
      (``0.99999999999999999999`` is ``1.0``);
    - ``multipleOf`` unless the type is ``integer`` and the value an integer: validators
      divide in floating point (``0.7 / 0.1`` is ``6.999999999999999``, not a multiple);
    - ``patternProperties`` a key can match two of; word boundaries (``\\b``) anywhere;
    - a ``const`` / ``enum`` value llguidance writes as another value (:func:`_unwritable`:
      strings with control characters, integers a 64-bit float does not hold).

    Rewrites, each exact or a narrowing (a subset of the valid values):

    - a ``patternProperties`` key (it decides which schema applies to a key: it cannot
      be narrowed) has its shorthand classes written as Python's exact sets
      (:func:`_exact_classes`; llguidance's ``\\d`` ``\\s`` ``\\w`` are other sets);
    - a ``format`` no draft defines (``int64``, ``password``) is an annotation: dropped;
    - a ``pattern`` becomes :func:`json_schema.value_pattern`'s reading (the narrowing the
      outlines backend writes: ``\\d`` ``\\w`` ``\\s`` and their negations as ASCII
      classes, a full match; ECMA-262 named groups read);
    - a draft ``format`` outside :data:`_LLG_FORMATS` becomes the ``pattern`` of plait's
      sound regex for it (:data:`json_schema.FORMATS`), beside the schema's own
      ``pattern`` through ``allOf``.

    The narrowings are not done under ``oneOf``/``not``/``if``/``then``/``else``, nor in
    what a ``$ref`` there reaches (:func:`_exact_places`): a narrower branch there admits
    more values, not fewer. Patterns there get Python's exact sets as keys do, and draft
    formats outside :data:`_LLG_FORMATS` are refused.
    """
    exact = _exact_places(schema)
    from plait.runtime.constrained.json_schema import ref_siblings_ignored

    return _rewrite(schema, [], exact is not None, exact or set(), ref_siblings_ignored(schema))


def _rewrite(schema: Any, parts: list[str], narrow: bool, exact: set[tuple[str, ...]], legacy_ref: bool) -> Any:
    from plait.runtime.constrained.json_schema import ANNOTATIONS, FORMATS, STANDARD_FORMATS, value_pattern

    if not isinstance(schema, dict):
        return schema
    if legacy_ref and "$ref" in schema:
        # what the draft reads: the $ref alone (llguidance would apply the keywords beside
        # it, and cannot when the $ref is recursive); kept: annotations and the
        # definitions other pointers may reach
        schema = {k: v for k, v in schema.items() if k == "$ref" or k in ANNOTATIONS}
    path = "/".join(["#", *parts])
    narrow = narrow and tuple(parts) not in exact
    for k in _DRAFT3:
        if k in schema:
            raise ValueError(f"{k} (draft 3) at {path} is not supported by the llguidance backend")
    if isinstance(schema.get("required"), bool):
        raise ValueError(f"required: {str(schema['required']).lower()} (draft 3) at {path} is not supported by the "
                         "llguidance backend; allowed: a list of property names")
    integer = schema.get("type") == "integer"
    numeric = _numeric_type(schema.get("type"))
    floored = _i64_floor_keys(schema) if narrow and numeric == "integer" else []
    for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        v = schema.get(k)
        if k in floored:
            continue
        moved = (_bound_moved(v, k.endswith("inimum"), narrow, numeric)
                 if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
        if moved is not None:
            shown = str(v) if abs(v) < 10**24 else f"{'-' if v < 0 else ''}10**{int(math.log10(abs(v)))} or so"
            raise ValueError(f"{k}: {shown} at {path} is not supported by the llguidance backend (it reads bounds as "
                             f"64-bit floats, on integers within the 64-bit integers: {moved}); allowed: bounds "
                             "within +-2**53, or others those read exactly")
    for k in ("exclusiveMinimum", "exclusiveMaximum"):
        v = schema.get(k)
        if v is not None and v is not False and numeric != "integer" and k not in floored:
            raise ValueError(f"{k} at {path} on a non-integer number is not supported by the llguidance backend "
                             "(a bound cannot be kept exclusive through float parsing)")
    patterns = schema.get("patternProperties")
    if patterns:
        # llguidance applies one pattern's schema to a key: sound only when no key can
        # match two patterns (the listed properties get every matching pattern's
        # schema folded in by close_objects)
        if not isinstance(patterns, dict):
            raise ValueError(f"patternProperties at {path} must be an object")
        keys = {}
        for pat in patterns:
            if not isinstance(pat, str):
                raise ValueError(f"patternProperties at {path}: {pat!r} is not a pattern")
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"patternProperties at {path}: {pat!r} is not a valid pattern ({e})") from None
            keys[pat] = _exact_classes(pat, f"{path}/patternProperties/{pat}")
            _check_delete(keys[pat], pat, f"patternProperties at {path}")
        _check_patterns_exclusive(list(keys.values()), f"{path}/patternProperties")
    m = schema.get("multipleOf")
    if m is not None and not (integer and isinstance(m, int) and not isinstance(m, bool)):
        raise ValueError(f"multipleOf: {m} at {path}: the llguidance backend reads multipleOf only as an integer "
                         "on type integer")
    for k in ("const", "enum"):
        bad = _unwritable(schema[k]) if k in schema else None
        if bad is not None:
            raise ValueError(f"{k} at {path} holds {bad}, which the llguidance backend does not write as listed; "
                             "allowed there: strings without control characters other than \\b \\f \\n \\r \\t "
                             "(and without U+007F), integers within +-2**53 or that a 64-bit float holds exactly")
    lo, listed = schema.get("minProperties"), schema.get("required")
    listed = {n for n in listed if isinstance(n, str)} if isinstance(listed, list) else set()
    if (isinstance(lo, int) and not isinstance(lo, bool) and lo - len(listed) > 1 and _free_keys(schema)):
        raise ValueError(f"minProperties: {lo} at {path} is not supported by the llguidance backend beside free-form "
                         f"keys ('additionalProperties' / 'patternProperties'): it counts a key written twice again "
                         f"('{{\"x\":1,\"x\":2}}' has one property as JSON parsers read it); allowed: a "
                         f"'minProperties' at most 1 more than the required names ({len(listed)})")
    out = dict(schema)
    if floored:  # a narrowing: integers below I64_FLOOR are not written
        for k in floored:
            del out[k]
        out.setdefault("minimum", I64_FLOOR)  # (a minimum kept is above it)
    for k in ("minLength", "maxLength"):
        v = schema.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_LENGTH:
            if k == "maxLength" and narrow:  # a narrowing, and no output is that long
                out[k] = MAX_LENGTH
                continue
            raise ValueError(f"{k}: {v:.0f} at {path} is past the lengths the llguidance backend reads"
                             f"{' under oneOf/not/if (where it cannot be narrowed)' if k == 'maxLength' else ''}; "
                             f"allowed: at most {MAX_LENGTH}")
    if schema.get("uniqueItems") is False:
        del out["uniqueItems"]  # constrains nothing (llguidance refuses the keyword whatever its value)
    if isinstance(schema.get("pattern"), str):
        # value_pattern's refusals name the keyword ("'pattern' at #/..."), as the regex
        # translation's do of the same pattern; _exact_classes' begin with where they are
        out["pattern"] = (value_pattern(schema["pattern"], path) if narrow
                          else _exact_classes(schema["pattern"], f"{path}/pattern"))
        _check_delete(out["pattern"], schema["pattern"], f"pattern at {path}")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in _LLG_FORMATS:
        if fmt not in STANDARD_FORMATS:  # no draft defines it: an annotation
            del out["format"]
        elif narrow and fmt in FORMATS:
            del out["format"]
            own = {"pattern": "^(?:" + FORMATS[fmt] + ")$"}
            if "pattern" in out:
                out["allOf"] = [*out.get("allOf", []), own]
            else:
                out.update(own)
        else:
            raise ValueError(f"format {fmt!r} at {path} is not supported by the llguidance backend" +
                             (" under oneOf/not/if (where it cannot be narrowed)" if fmt in FORMATS else ""))
    for k, key, x, under in _children(schema):
        new = _rewrite(x, [*parts, k] if key is None else [*parts, k, str(key)], narrow and not under, exact,
                       legacy_ref)
        if key is None:
            out[k] = new
            continue
        if out[k] is schema[k]:  # copied once, then written in place
            out[k] = list(schema[k]) if isinstance(schema[k], list) else dict(schema[k])
        out[k][key] = new
    if patterns:
        out["patternProperties"] = {keys[pat]: sub for pat, sub in out["patternProperties"].items()}
    return out


def _free_keys(schema: dict[str, Any]) -> bool:
    """Whether an object of ``schema`` may hold keys it does not list, after
    :func:`close_objects` (``patternProperties``, an ``additionalProperties`` not false,
    or neither beside no listed ``properties``)."""
    if schema.get("patternProperties"):
        return True
    if "additionalProperties" in schema or "unevaluatedProperties" in schema:
        return schema.get("additionalProperties", schema.get("unevaluatedProperties")) is not False
    return "properties" not in schema or any(k in schema for k in ("allOf", "$ref"))


def close_objects(schema: Any, *, open_defs: bool, in_all_of: bool = False) -> Any:
    """A copy of ``schema`` whose objects with listed ``properties`` admit no other keys
    unless the schema says so (``additionalProperties`` / ``patternProperties`` /
    ``unevaluatedProperties``): plait's layout (as the outlines backend writes it), a
    subset of the valid instances, and a model cannot wander into made-up keys. Integers
    and numbers without a bound get one at 16 digits, numbers without a ``multipleOf``
    at most 10 fraction digits (a model cannot loop on digits). Not done
    inside ``allOf`` or next to it (another branch may list more properties), nor in
    ``$defs`` when ``open_defs`` (the document has an ``allOf`` that may reference them)."""
    from plait.runtime.constrained.json_schema import bounded_search

    if not isinstance(schema, dict):
        return schema
    if not in_all_of:
        schema = _distribute_any_of(schema)
    schema = _close_all_of(schema) if not in_all_of else schema
    out = dict(schema)
    combined = in_all_of or "allOf" in schema or "$ref" in schema
    if schema.get("type") in ("integer", "number"):  # at most 16 integer digits, as the outlines layout writes them
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -MAX_INTEGER
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = MAX_INTEGER
    if schema.get("type") == "number" and "multipleOf" not in schema:
        # and at most NUMBER_FRACTION_DIGITS after the point: unbounded, a small model
        # wrote a 100-digit number until max_tokens (llguidance reads a decimal step
        # as that many fraction digits; a subset of the valid numbers, as the bounds)
        out["multipleOf"] = NUMBER_STEP
    if ("properties" in schema and not combined
            and not any(k in schema for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))):
        out["additionalProperties"] = False
        listed = schema["properties"] if isinstance(schema["properties"], dict) else {}
        missing = [n for n in schema.get("required", []) or [] if isinstance(n, str) and n not in listed]
        if missing:  # a required name the object does not list may hold any value: listed after the others
            # (closed without it, a satisfiable schema was called unsatisfiable)
            schema = {**schema, "properties": {**listed, **{n: True for n in dict.fromkeys(missing)}}}
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict) and patterns and isinstance(schema.get("properties"), dict):
        # a listed property must also satisfy every pattern its name contains a match of
        folded = {}
        for name, own in schema["properties"].items():
            hits = [sub for pat, sub in patterns.items() if bounded_search(pat, name)]
            folded[name] = {"allOf": [own, *hits]} if hits else own
        schema = {**schema, "properties": folded}

    def sub(s: Any, all_of: bool = False) -> Any:
        return close_objects(s, open_defs=open_defs, in_all_of=in_all_of or all_of)

    for k in SUBSCHEMA_ONE:
        if k in schema and k not in ("not", "if"):  # a stricter negated/conditional schema admits more
            out[k] = sub(schema[k])
    if isinstance(schema.get("items"), list):
        out["items"] = [sub(x) for x in schema["items"]]
    elif "items" in schema:
        out["items"] = sub(schema["items"])
    for k in SUBSCHEMA_LIST:
        if isinstance(schema.get(k), list):
            out[k] = [sub(x, all_of=k == "allOf") for x in schema[k]]
    for k in (*SUBSCHEMA_MAP, "dependencies"):
        if isinstance(schema.get(k), dict):
            defs = k in ("$defs", "definitions")
            out[k] = {n: x if defs and open_defs else sub(x) for n, x in schema[k].items()}
    return out


_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties", "$ref", "allOf", "anyOf", "oneOf")


def _distribute_any_of(schema: dict[str, Any]) -> dict[str, Any]:
    """``{properties: P, anyOf: [A, B]}`` as ``{anyOf: [{properties: P, allOf: [A]}, ...]}``
    (the same values: allOf distributes over anyOf), so that each case is closed as a
    whole by :func:`_close_all_of`: closing P alone refused the names A and B list
    (llguidance then called a satisfiable schema unsatisfiable)."""
    cases = schema.get("anyOf")
    if ("properties" not in schema or not isinstance(cases, list) or not cases or "oneOf" in schema
            or not isinstance(schema.get("allOf", []), list)):
        return schema
    keep = {k: v for k, v in schema.items() if k in ("$defs", "definitions", "$schema", "$id", "id")}
    rest = {k: v for k, v in schema.items() if k != "anyOf" and k not in keep}
    return {**keep, "anyOf": [{**rest, "allOf": [*rest.get("allOf", []), case]} for case in cases]}


def _close_all_of(schema: dict[str, Any]) -> dict[str, Any]:
    """``{properties: P, allOf: [{properties: A}, {properties: B}]}`` closed as a whole:
    each part lists every name of P, A and B (the others' as ``true``) and admits no
    other key, so together they admit exactly the keys some part lists. Left as it is
    unless every part is a plain object schema (no open keyword, ``$ref`` or nesting)."""
    parts = schema.get("allOf")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
        return schema
    head = {k: v for k, v in schema.items() if k != "allOf"}
    every = [head, *parts]
    if any(k in p for p in every for k in _OPEN) or not any("properties" in p for p in every):
        return schema
    if not all(isinstance(p.get("properties", {}), dict) for p in every):
        return schema
    names = [n for p in every for n in p.get("properties", {})]

    def closed(p: dict[str, Any]) -> dict[str, Any]:
        return {**p, "properties": {**{n: True for n in names}, **p.get("properties", {})},
                "additionalProperties": False}

    return {**closed(head), "allOf": [closed(p) for p in parts]}


def schema_grammar(schema: dict[str, Any] | str, whitespace_pattern: str | None) -> str:
    """A JSON Schema (dict or JSON text) as an llguidance grammar, through llguidance's
    own JSON compiler; compact JSON unless ``whitespace_pattern`` is given. Raises
    ``ValueError`` naming the keyword (and its location) at fault."""
    from plait.runtime.constrained.json_schema import check_schema_size, parse_schema_text, rooted_refs

    # a caller's dict too goes through its JSON text: that is what is bounded, and the
    # round trip makes it plain JSON (tuples become lists); its depth is checked first
    # (json.dumps recurses: a schema 500 levels deep failed with a RecursionError)
    if not isinstance(schema, str):
        check_schema_size(schema)
    value = parse_schema_text(schema if isinstance(schema, str) else json.dumps(schema))
    if not isinstance(value, (dict, bool)):
        raise ValueError("it must be a JSON object (or true/false)")
    if value is False:  # (llguidance's options need an object: "Expecting object schema to apply options")
        raise ValueError("json_schema at # is false: no value can satisfy it")
    value = {} if value is True else value  # the same schema: any JSON value
    check_schema_size(value)
    value, copied = hoisted_refs(rooted_refs(value))
    try:
        return _schema_grammar(value, whitespace_pattern)
    except ValueError as e:
        text = json.dumps(value)
        if 'keys: ["not"]' in str(e) and '"not"' not in text and '"if"' in text:
            # the 'not' is the rewrite's (the values failing an 'if': plain_schema), not the
            # client's: name their keyword
            from plait.runtime.constrained.json_schema import WHY_NOT

            raise ValueError(f"json_schema keyword 'if' is not supported: {WHY_NOT['if']}; here its 'else' case, "
                             f"the values failing 'if', cannot be written (a 'not' of its values)") from None
        if not copied:
            raise
        raise ValueError(_shown_places(str(e), copied)) from None


def prepared_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as :func:`schema_grammar` gives it to llguidance's JSON compiler
    (rewritten, objects closed, compact JSON options under ``x-guidance``), for a
    ``%json`` value in a Lark grammar (:mod:`plait.runtime.constrained.holes`).
    ``ValueError`` as :func:`schema_grammar`'s."""
    grammars = json.loads(schema_grammar(schema, None)).get("grammars")
    if not isinstance(grammars, list) or len(grammars) != 1 or not isinstance(grammars[0].get("json_schema"), dict):
        raise ValueError("it compiles to more than one JSON Schema grammar")
    return grammars[0]["json_schema"]


def _schema_grammar(value: dict[str, Any], whitespace_pattern: str | None) -> str:
    """:func:`schema_grammar` of a parsed, checked document (its references read from
    the root, their targets in subschema places)."""
    from llguidance import LLMatcher

    from plait.runtime.constrained.json_schema import check_whitespace, fold_unevaluated, fold_vacuous, plain_schema

    value = fold_vacuous(value)
    if value is False:  # ('not: {}' at the root)
        raise ValueError("json_schema at # is never satisfied ('not' of a schema every value satisfies): no value "
                         "can satisfy it")
    value = plain_schema(fold_unevaluated(value))
    value = llguidance_schema(value)
    unending = schema_unending(value)
    if unending is not None:
        raise ValueError(f"it admits no finite output: {unending}")
    closed = close_objects(value, open_defs='"allOf"' in json.dumps(value))
    check_expanded_depth(closed)
    text = json.dumps(closed)
    # no \uXXXX escapes (as in the outlines layout): llguidance matches a key written with
    # one against neither the listed names nor the patterns, so {"\u0061": 1} would get
    # additionalProperties' schema where jsonschema applies property "a"'s
    options: dict[str, Any] = {"whitespace_flexible": False, "lenient": False, "json_allowed_escapes": '"\\bfnrt'}
    if whitespace_pattern is not None:
        options["whitespace_pattern"] = check_whitespace(whitespace_pattern)
    try:
        return _validate(LLMatcher.grammar_from_json_schema(text, overrides=options))
    except ValueError as e:  # llguidance's message names what, not where: the first place that has it
        where = _place_of(value, str(e))  # in what llguidance was given
        if where is None:
            raise
        raise ValueError(f"{e} (first at {where})") from None


# llguidance's compile errors -> what the subschema at fault has
_AT_FAULT: list[tuple[str, Any]] = [
    (r"Unimplemented keys: (\[[^\]]*\])", lambda s, m: any(k in s for k in json.loads(m.group(1)))),
    (r"min/maxProperties", lambda s, m: "minProperties" in s or "maxProperties" in s),
    (r"required property '(.*)' is unsatisfiable",
     lambda s, m: isinstance(s.get("required"), list) and m.group(1) in s["required"]),
    (r"Pointer '(.*)' does not exist", lambda s, m: isinstance(s.get("$ref"), str) and s["$ref"].endswith("#" + m.group(1))),
    (r"Anchor '(.*)' does not exist", lambda s, m: isinstance(s.get("$ref"), str) and s["$ref"].endswith("#" + m.group(1))),
    (r"Resource '(.*)' is not present in a registry",  # a $ref to another document: never fetched
     lambda s, m: isinstance(s.get("$ref"), str) and bool(s["$ref"].split("#")[0])
     and m.group(1).endswith(s["$ref"].split("#")[0])),
    (r"anyOf is empty", lambda s, m: s.get("enum") == [] or s.get("anyOf") == []),
    (r"incompatible types", lambda s, m: len({json.dumps(p["type"]) for p in [s, *s.get("allOf", [])]
                                              if isinstance(p, dict) and "type" in p}) > 1),
]


def _place_of(schema: Any, message: str) -> str | None:
    """The location (``#/...``) of the first subschema, breadth first, that has what
    llguidance's compile error ``message`` names; None if it names nothing
    :data:`_AT_FAULT` knows or no subschema has it."""
    found = next(((m, has) for pattern, has in _AT_FAULT if (m := re.search(pattern, message))), None)
    if found is None:
        return None
    m, has = found
    todo: deque[tuple[Any, str]] = deque([(schema, "#")])
    while todo:
        s, path = todo.popleft()
        if not isinstance(s, dict):
            continue
        if has(s, m):
            return path
        todo.extend((x, f"{path}/{k}" if key is None else f"{path}/{k}/{key}") for k, key, x, _ in _children(s))
    return None


def ebnf_grammar(text: str) -> str:
    """An ``ebnf`` grammar as llguidance's: Lark syntax (llguidance's dialect, a ``start``
    rule) or GBNF (llama.cpp / XGrammar / SGLang: ``root ::= ...``), told apart by
    llguidance's rule (a ``start:`` rule or ``%llguidance`` line means Lark)."""
    from llguidance import grammar_from

    _check_size(text, "the grammar")
    if not _LARK.search(text):
        text = gbnf_for_llguidance(text)
    try:
        grammar = grammar_from("ebnf", text)
    except ValueError as e:
        raise ValueError(str(e)) from None
    grammar = _validate(grammar)
    unending = lark_unending(grammar)
    if unending is not None:
        raise ValueError(f"it admits no finite output: {unending}")
    return grammar


_GBNF_HEX = {"x": 2, "u": 4, "U": 8}
_GBNF_ANY = "[\\x00-\U0010ffff]"  # GBNF's '.': any character (the conversion's /./ left out newlines)
_RUST_CLASS_OPS = "&~-"  # doubled inside a class, Rust's regex reads a set operation


# Lark, as llguidance tells it from GBNF: a %llguidance line or a start rule; its own
# pattern also took a GBNF rule named start ("start ::= ...") for a Lark rule
_LARK = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:(?!:=))")
_GBNF_NAME = re.compile(r"[A-Za-z0-9_-]+")


def gbnf_for_llguidance(text: str) -> str:
    """GBNF ``text`` written so that llguidance's conversion to Lark reads it as
    llama.cpp does. A rule named ``start`` is renamed (``start-rule``, or with a number
    when that is taken): llguidance took the grammar for Lark, or refused it because
    ``root`` becomes ``start`` in Lark. And the characters of strings and classes are
    written so that the conversion keeps each one, and ``.`` (any character, newlines
    too, in llama.cpp) as a class of every character (the conversion wrote ``/./``,
    which leaves newlines out):

    - ``\\uXXXX`` / ``\\UXXXXXXXX``: the conversion drops their leading zeros, so
      ``\\u00e9`` became ``\\ue9`` (refused as an invalid escape) and
      ``"\\u00410000"`` (``A0000``) became ``"\\u410000"`` (U+4100, then ``00``: a
      wrong string admitted); written as ``\\xHH`` below U+0100 and as the character
      itself above;
    - inside a class, the second of ``&&``, ``~~`` or ``--`` as ``\\xHH``: the class
      goes into a Rust regex as written, which reads them as intersection, symmetric
      difference and difference (``[a&&b]`` admitted nothing; in GBNF it is ``a``,
      ``&`` or ``b``).

    Comments and, but for that rule name and ``.``, everything outside strings and
    classes are left as they are; an escape that is not valid is left for the conversion to refuse."""
    out: list[str] = []
    i, n = 0, len(text)
    context = ""  # '"' in a string, "[" in a class, "" outside
    last = ""  # the class's previous character as written (an escape counts as none)
    renamed = None
    while i < n:
        c = text[i]
        if not context:
            if c == "#":
                j = text.find("\n", i)
                j = n if j < 0 else j
                out.append(text[i:j])
                i = j
                continue
            word = _GBNF_NAME.match(text, i)
            if word:
                if word.group() == "start":
                    if renamed is None:
                        names = {w.replace("-", "_").lower() for w in _GBNF_NAME.findall(text)}
                        renamed = next(f"start-rule{k or ''}" for k in range(len(names) + 1)
                                       if f"start_rule{k or ''}" not in names)
                    out.append(renamed)
                else:
                    out.append(word.group())
                i = word.end()
                continue
            if c in '"[':
                context, last = c, ""
            out.append(_GBNF_ANY if c == "." else c)
            i += 1
            continue
        if c == "\\" and i + 1 < n:
            e = text[i + 1]
            digits = text[i + 2:i + 2 + _GBNF_HEX.get(e, 0)]
            if e in "uU" and len(digits) == _GBNF_HEX[e] and all(d in "0123456789abcdefABCDEF" for d in digits):
                cp = int(digits, 16)
                if cp < 0x100:
                    out.append(f"\\x{cp:02X}")
                elif cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF:
                    out.append(chr(cp))
                else:
                    out.append(text[i:i + 2 + len(digits)])
                i += 2 + len(digits)
            else:
                out.append(text[i:i + 2])
                i += 2
            last = ""
            continue
        if (context == '"' and c == '"') or (context == "[" and c == "]"):
            context = ""
            out.append(c)
        elif context == "[" and c in _RUST_CLASS_OPS and last == c:
            out.append(f"\\x{ord(c):02X}")
            c = ""
        else:
            out.append(c)
        last = c
        i += 1
    return "".join(out)


def regex_grammar(regex: str) -> str:
    from llguidance import LLMatcher

    return _validate(LLMatcher.grammar_from_regex(regex))


# -- the tokenizer ---------------------------------------------------------------------------------
def build_tokenizer(vocab: TokenVocab) -> Any:
    """llguidance's tokenizer over plait's :class:`TokenVocab`: the same bytes per id
    (ids without bytes, specials and EOS, become llguidance special tokens), the same EOS
    ids (a model without EOS gets one past its logits, as for outlines), and the HF
    tokenizer's ``encode`` for re-tokenizing forced text. The mask rows have
    ``vocab.mask_words`` words."""
    import llguidance

    tokens = [b if b is not None else b"\xff[%d]" % i for i, b in enumerate(vocab.token_bytes)]
    eos = list(vocab.eos_ids)
    if not eos:
        eos = [len(tokens)]
        tokens.append(b"\xff[eos]")
    encode = vocab.encode

    class _Wrapped:
        eos_token_id = eos[0]
        bos_token_id = None
        special_token_ids = [i for i, b in enumerate(tokens) if b.startswith(b"\xff")]

        def __call__(self, text: str | bytes) -> list[int]:
            if encode is None:
                raise ValueError("no tokenizer")
            return encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)

    _Wrapped.tokens = tokens  # type: ignore[attr-defined]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()), n_vocab=len(tokens), eos_token=eos)


# -- compiling -------------------------------------------------------------------------------------
# An ebnf request's mask or forced text that llguidance has not computed after this long
# is given up: the request ends (its next token is refused), the engine goes on.
MASK_TIMEOUT_S = 2.0


# llguidance checks and builds a grammar recursively, a stack frame or more per level of
# nesting (rule references, parentheses): a Lark grammar of 3000 rules each calling the
# next (67 KB, under the size limit), or 1000 with 20 parentheses each, overflowed a
# thread's default 8 MB stack and killed the process (segmentation fault) in the
# front's check and in the engine's build. Those run on threads with this much stack
# (address space, not memory, until used): 32x the default, past any grammar the size
# limits admit. Masks and advancing do not recurse so (the same grammars' masks run
# on an ordinary thread).
DEEP_STACK_BYTES = 256 << 20
_STACK_LOCK = threading.Lock()


def _bounded(fn: Any, seconds: float | None) -> Any:
    """``fn()`` in a daemon thread with a :data:`DEEP_STACK_BYTES` stack, waited for at
    most ``seconds`` (None: until it ends); ``TimeoutError`` past them. The thread is
    left running (llguidance cannot be interrupted; it runs without the GIL, so the
    caller goes on).

    NOTE: llguidance 1.9.1 computes some masks forever: a greedy terminal followed by
    one it can continue (``start: A A``, ``A: /a+/``; GBNF ``root ::= a a``, ``a ::=
    "x"+``), past every parser limit. Without a bound, the first mask held a compile
    thread for good (two such grammars and no llguidance compile ran again), and a
    later mask or forced text held the engine loop (every request stopped)."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box.append((False, e))

    t = threading.Thread(target=run, daemon=True, name="plait-llguidance-bounded")
    with _STACK_LOCK:  # the stack size is the process's setting for threads started next
        old = threading.stack_size(DEEP_STACK_BYTES)
        try:
            t.start()
        finally:
            threading.stack_size(old)
    t.join(seconds)
    if not box:
        raise TimeoutError(f"llguidance did not finish within {seconds:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


class CompiledLLGuidance:
    """A built ``LLMatcher`` (never advanced: requests take a ``deep_copy``) and what
    masks need: the EOS bits to clear from llguidance's rows (EOS is the matcher's
    business, as for outlines)."""

    def __init__(self, matcher: Any, vocab: TokenVocab, tokenizer: Any) -> None:
        self.matcher = matcher
        self.vocab = vocab
        self.tokenizer = tokenizer
        self.words = vocab.mask_words
        # a computation on one of its copies never ended (:func:`_bounded`); the copies
        # share the lexer's state, so every call on another copy may wait on it forever
        self.stuck = False
        eos = np.zeros(self.words, dtype=np.uint32)
        for e in tokenizer.eos_tokens:
            if e < self.words * 32:
                eos[e >> 5] |= np.uint32(1 << (e & 31))
        self.eos_bits = eos
        self.model_eos = np.zeros(self.words, dtype=np.uint32)
        for e in vocab.eos_ids:
            if e < self.words * 32:
                self.model_eos[e >> 5] |= np.uint32(1 << (e & 31))


class LLGuidanceCompiler:
    """The llguidance backend's compiler: builds in a small thread pool, caches by
    (tokenizer fingerprint, grammar), fails a build past ``timeout_s``."""

    def __init__(self, vocab: TokenVocab, *, timeout_s: float = 30.0, cache_size: int = 64, threads: int = 2) -> None:
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="plait-llguidance")
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], GrammarFuture] = OrderedDict()
        self._inflight: deque[tuple[GrammarFuture, Future]] = deque()
        self._done = threading.Event()
        self.build_times: dict[str, float] = {}
        self.cache_hits = 0

    def tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = build_tokenizer(self.vocab)
            return self._tokenizer

    def _build(self, grammar: str) -> CompiledLLGuidance:
        """In a pool thread: the tokenizer (first build only, ~0.1 s) and the matcher."""
        import llguidance

        tok = self.tokenizer()
        m = _bounded(lambda: llguidance.LLMatcher(tok, grammar, log_level=0, limits=parser_limits()), None)
        if m.is_error():
            raise ValueError(m.get_error())
        # NOTE: llguidance builds a grammar that admits no text at all (a $ref cycle with
        # nothing else in it, an empty character class) without an error; computing the
        # first mask (on a copy: the compiled matcher is never advanced) reports it. (Nor
        # does it refuse one whose every text goes on forever: finite.py, at the edge.)
        probe = m.deep_copy()
        try:
            _bounded(probe.compute_bitmask, self.timeout_s)
        except TimeoutError:
            raise ValueError(f"its first mask took longer than the {self.timeout_s:g} s limit "
                             "(grammar_compile_timeout): llguidance may never finish it") from None
        if probe.is_error():
            raise ValueError(f"it admits no output ({probe.get_error().splitlines()[0]}): no text satisfies it")
        return CompiledLLGuidance(m, self.vocab, tok)

    def _run(self, fut: GrammarFuture) -> CompiledLLGuidance:
        fut.started = time.monotonic()  # the time limit counts from here, not from the queue
        try:
            return self._build(fut.source)
        finally:
            self._done.set()

    # -- the compiler interface ---------------------------------------------------------------
    def request(self, grammar: str) -> GrammarFuture:
        key = (self.vocab.fingerprint, grammar)
        fut = self._cache.get(key)
        if fut is not None and not fut.stale:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return fut
        fut = GrammarFuture(key, grammar)
        self._cache[key] = fut
        self._inflight.append((fut, self._pool.submit(self._run, fut)))
        self._evict()
        return fut

    def poll(self) -> None:
        """Collect finished builds; fail those past the time limit."""
        now = time.monotonic()
        left: deque[tuple[GrammarFuture, Future]] = deque()
        for fut, job in self._inflight:
            if fut.done:
                continue
            if job.done():
                try:
                    fut.grammar = job.result()
                    self.build_times[fut.source] = now - fut.started
                except Exception as e:  # noqa: BLE001 - llguidance's message is the client's answer
                    fut.error = f"it cannot be compiled: {e}"
            elif fut.started is not None and now - fut.started > self.timeout_s:
                fut.timed_out(f"compiling it took longer than the {self.timeout_s:g} s limit (grammar_compile_timeout)")
            else:
                left.append((fut, job))
        self._inflight = left

    def wait(self, timeout: float) -> None:
        if self._inflight:
            self._done.clear()
            if not any(job.done() for _, job in self._inflight):
                self._done.wait(timeout)
        self.poll()

    def abandon(self, fut: GrammarFuture) -> None:
        """Drop ``fut`` if its build has not started in the pool (no request waits for
        it): out of the queue and the cache. A running build cannot be stopped."""
        for i, (f, job) in enumerate(self._inflight):
            if f is fut and not fut.done and job.cancel():
                del self._inflight[i]
                if self._cache.get(fut.key) is fut:
                    del self._cache[fut.key]
                fut.error = "no request waits for it"
                return

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    def close(self) -> None:
        for fut, _ in self._inflight:
            if not fut.done:
                fut.error = "the engine shut down"
        self._inflight.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _evict(self) -> None:
        while len(self._cache) > self.cache_size:
            for key, fut in self._cache.items():
                if fut.done:
                    del self._cache[key]
                    break
            else:
                return


# -- one request -----------------------------------------------------------------------------------
class LLGuidanceMatcher:
    """Per-request state: a ``deep_copy`` of the compiled ``LLMatcher``, advanced token by
    token (see :class:`backend.Matcher`)."""

    def __init__(self, future: GrammarFuture, kind: str = "json_schema", *, jump_forward: bool = True) -> None:
        self.future = future
        self.kind = kind
        self.use_jump_forward = jump_forward
        self.g: CompiledLLGuidance | None = None
        self.m: Any = None
        self.started = False
        self.rejected: int | None = None
        self.healed_text = ""
        self.num_advanced = 0
        self._stuck = False  # a computation past MASK_TIMEOUT_S: ``m`` is left to its thread

    @property
    def ready(self) -> bool:
        return self.future.grammar is not None

    @property
    def stuck(self) -> bool:
        """No call may touch ``m`` any more: a computation on it, or on another copy of
        its grammar, never ended."""
        return self._stuck or (self.g is not None and self.g.stuck)

    def _llg(self, fn: Any) -> Any:
        """``fn()``, a mask or forced-text computation: bounded for ``ebnf`` grammars
        (:func:`_bounded`; JSON Schemas and regexes compile to grammars without greedy
        terminals side by side, and keep the direct call). ``TimeoutError`` sets
        ``stuck``: the request's next token is then refused and it ends."""
        if self.kind != "ebnf":
            return fn()
        try:
            return _bounded(fn, MASK_TIMEOUT_S)
        except TimeoutError:
            self._stuck = self.g.stuck = True
            logger.warning("an ebnf grammar's mask took longer than %g s in llguidance; ending its request",
                           MASK_TIMEOUT_S)
            raise

    def _forced(self, fn: Any) -> Any:
        """``fn()``, llguidance's forced text (``compute_ff_bytes`` / ``_tokens``). These
        hold the GIL, so no thread can bound them: for ``ebnf`` grammars a bounded mask
        at the same state comes first (both run the lexer from here; the hanging
        grammars found hang in both). ``TimeoutError`` as :meth:`_llg`."""
        if self.kind == "ebnf":
            self._llg(self.m.compute_bitmask)
        return fn()

    @property
    def error(self) -> str | None:
        return self.future.error

    def start(self, prompt_ids: list[int]) -> int:
        """Begin at the grammar's start; never heals (see the module docstring)."""
        g = self.future.grammar
        assert g is not None, "start() before the grammar is ready"
        self.g = g
        self.m = None if g.stuck else g.matcher.deep_copy()
        self.started = True
        return 0

    def jump_start(self, budget: int) -> list[int]:
        """The forced opening tokens (``{"`` of an object), at most ``budget``."""
        if not self.use_jump_forward or budget < 1 or self.stuck:
            return []
        try:
            tokens = self._forced(self.m.compute_ff_tokens)[:budget]
        except TimeoutError:
            return []
        if not tokens or not self.m.consume_tokens(tokens):
            return []
        self.num_advanced += len(tokens)
        return tokens

    # -- masks --------------------------------------------------------------------------------
    @property
    def is_final(self) -> bool:
        return self.started and not self.stuck and self.m.is_accepting()

    @property
    def terminated(self) -> bool:
        """Final with nothing more to write."""
        return self.is_final and not self.stuck and self.m.is_stopped()

    def allowed(self, eos_ok: bool) -> np.ndarray:
        """Packed allowed-token bits (``int32 [vocab.mask_words]``); EOS ids in final
        states when ``eos_ok``."""
        g = self.g
        out = np.zeros(g.words, dtype=np.uint32)
        if self.stuck:
            return out.view(np.int32)  # nothing allowed: the next token is refused
        try:
            row = np.frombuffer(self._llg(self.m.compute_bitmask), dtype=np.uint32)
        except TimeoutError:
            return out.view(np.int32)
        n = min(len(row), g.words)
        out[:n] = row[:n]
        out &= ~g.eos_bits
        if eos_ok and self.is_final:
            out |= g.model_eos
        return out.view(np.int32)

    def draft_masks(self, drafts: list[int], eos_ok: bool) -> list[np.ndarray]:
        """Speculative decoding: the :meth:`allowed` rows for the next token and after
        each of ``drafts`` in turn, up to the first draft the grammar refuses (``1 +``
        the number of drafts it takes). The drafts are consumed and rolled back: the
        matcher ends where it began."""
        masks = [self.allowed(eos_ok)]
        taken = 0
        for t in drafts:
            if self.stuck or self.m.try_consume_tokens([t]) != 1:
                break
            taken += 1
            masks.append(self.allowed(eos_ok))
        if taken and not self.stuck:
            self.m.rollback(taken)
        return masks

    @property
    def parser_error(self) -> str | None:
        """llguidance's own account of why the matcher cannot go on (a lexer limit reached
        while computing a mask: ``a{1000000}`` passes validation and the first mask, then
        fails), or None."""
        m = self.m
        if m is None or not m.is_error():
            return None
        return "llguidance stopped: " + (m.get_error().strip().splitlines() or ["unknown error"])[0]

    # -- advancing ----------------------------------------------------------------------------
    def advance(self, token: int) -> bool:
        """Take ``token``; False (and ``rejected`` set) if the grammar does not allow it."""
        if self.stuck or self.m.try_consume_tokens([token]) != 1:
            self.rejected = token
            return False
        self.num_advanced += 1
        return True

    def jump_forward(self, last: int, budget: int) -> list[int] | None:
        """After ``advance(last)``: ``last``'s bytes plus the forced bytes, tokenized as the
        tokenizer writes them, to put in place of ``last`` (at most ``budget`` tokens);
        None when nothing is forced. The last re-tokenized token is held back when a
        longer token could continue from it (the model writes across that boundary)."""
        g, m = self.g, self.m
        if not self.use_jump_forward or budget < 2 or g.vocab.encode is None or self.stuck:
            return None
        try:
            forced = self._forced(m.compute_ff_bytes)
        except TimeoutError:
            return None
        if not forced:
            return None
        head = g.vocab.token_bytes[last] or b""
        data = head + forced
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        tokens = g.vocab.encode(text)
        if g.vocab.join(tokens) != data:
            return None  # the tokenizer would not write these bytes back
        m.rollback(1)  # back before ``last``: the tokens replace it
        taken = m.try_consume_tokens(tokens)
        if taken < len(tokens):
            m.rollback(taken)
            m.consume_token(last)  # where advance() left it
            return None
        keep = len(tokens)
        if keep > 1 and not m.is_stopped():
            m.rollback(1)
            if self._can_extend(tokens[-1]):
                keep -= 1
            else:
                m.consume_token(tokens[-1])
        if keep > budget:
            m.rollback(keep - budget)
            keep = budget
        if len(g.vocab.join(tokens[:keep]) or b"") <= len(head):
            m.rollback(keep)
            m.consume_token(last)
            return None
        self.num_advanced += keep - 1
        return tokens[:keep]

    def _can_extend(self, token: int) -> bool:
        """Could a longer token starting with ``token``'s bytes be taken here?"""
        longer = self.g.vocab.tokens_with_prefix(self.g.vocab.token_bytes[token] or b"")
        if not longer:
            return False
        try:
            row = np.frombuffer(self._llg(self.m.compute_bitmask), dtype=np.uint32)
        except TimeoutError:
            return False
        ids = np.asarray(longer, dtype=np.int64)
        ids = ids[ids < len(row) * 32]
        return bool(((row[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).any())
