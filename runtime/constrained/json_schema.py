"""JSON Schema -> regex. Every output the regex admits validates against the schema.

The rule: a keyword is either enforced by the regex or rejected with a ``SchemaError``
(a ``ValueError``) that names it and where it is. Nothing that constrains a value is
silently dropped. Annotations (``title``, ``description``, ``default``...) are ignored.

Enforced: ``type`` (one or a list), ``enum``, ``const``, ``properties``, ``required``,
``additionalProperties`` (false, true or a schema), ``items``, ``prefixItems``
(and draft-4 list ``items`` / ``additionalItems``), ``minItems``, ``maxItems``,
``minLength``, ``maxLength``, ``pattern`` (when it cannot produce characters JSON must
escape), ``format`` (date, time, date-time, uuid, email, ipv4, uri), ``minimum`` /
``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (integers; integral inclusive
bounds for numbers), ``anyOf``, ``oneOf`` (when interegular proves the branches
disjoint), ``allOf`` (merged into one schema), local ``$ref`` (not recursive),
``uniqueItems`` when ``maxItems <= 1``.

Output layout: properties in declared order, optional ones may be left out; no
whitespace between tokens unless ``whitespace`` (a regex over spaces, tabs and
newlines) is given. Torch-free.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from plait.errors import is_int
from plait.regex import check_regex
from plait.runtime.constrained.regexes import (
    BOOLEAN,
    INTEGER,
    JSON_CHAR,
    MAX_DIGITS,
    JSON_STRING,
    NULL,
    NUMBER,
    escape,
)

ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$anchor", "contentMediaType", "contentEncoding", "$defs", "definitions",
})
TYPE_KEYWORDS: dict[str, frozenset[str]] = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "boolean": frozenset(),
    "null": frozenset(),
    "object": frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties",
                         "dependentRequired"}),
    "array": frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"}),
}
COMBINATORS = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"})
KNOWN = COMBINATORS | frozenset().union(*TYPE_KEYWORDS.values())
WHY_NOT = {
    "uniqueItems": "a regex cannot keep array items distinct (allowed only with maxItems <= 1)",
    "patternProperties": "keys matched by a pattern cannot be enforced; list the keys in 'properties'",
    "multipleOf": "divisibility cannot be enforced by the regex",
    "not": "negated schemas cannot be enforced",
    "if": "conditional schemas cannot be enforced",
    "then": "conditional schemas cannot be enforced",
    "else": "conditional schemas cannot be enforced",
    "dependentRequired": "dependencies between properties cannot be enforced",
    "dependentSchemas": "dependencies between properties cannot be enforced",
    "dependencies": "dependencies between properties cannot be enforced",
    "propertyNames": "key patterns cannot be enforced; list the keys in 'properties'",
    "contains": "'contains' cannot be enforced",
    "minContains": "'contains' cannot be enforced",
    "maxContains": "'contains' cannot be enforced",
    "unevaluatedProperties": "unevaluated* keywords cannot be enforced",
    "unevaluatedItems": "unevaluated* keywords cannot be enforced",
    "$dynamicRef": "dynamic references are not supported",
    "$recursiveRef": "recursive references are not supported",
    # draft 3's validation keywords (no later draft has them, so they are not unknown)
    "disallow": "draft 3's 'disallow' cannot be enforced",
    "divisibleBy": "divisibility cannot be enforced by the regex",
    "extends": "draft 3's 'extends' is not supported; use 'allOf'",
}
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38}[A-Za-z0-9])?"
_N = r"[0-9]{1,9}"
_DUR_TIME = r"T(?:" + _N + "H(?:" + _N + "M(?:" + _N + "S)?)?|" + _N + "M(?:" + _N + "S)?|" + _N + "S)"
_PCHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"  # RFC 3986, percent-escapes well formed
_PATH = r"(?:/" + _PCHAR + r"{0,24}){0,5}"
_QUERY = r"(?:" + _PCHAR + r"|[/?]){0,24}"
_HOST = r"[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,8}"
FORMATS = {
    # real calendar dates (29 February is left out rather than checking leap years)
    "date": r"[1-9][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
            r"|02-(?:0[1-9]|1[0-9]|2[0-8]))",
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "email": r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,4}\.[A-Za-z]{2,24}",
    "ipv4": r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "ipv6": "|".join([  # RFC 4291 text forms (Python's ipaddress accepts each)
        r"(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}",
        r"(?:[0-9a-fA-F]{1,4}:){1,7}:",
        r"(?:[0-9a-fA-F]{1,4}:){1,6}:[0-9a-fA-F]{1,4}",
        r"(?:[0-9a-fA-F]{1,4}:){1,5}(?::[0-9a-fA-F]{1,4}){1,2}",
        r"(?:[0-9a-fA-F]{1,4}:){1,4}(?::[0-9a-fA-F]{1,4}){1,3}",
        r"(?:[0-9a-fA-F]{1,4}:){1,3}(?::[0-9a-fA-F]{1,4}){1,4}",
        r"(?:[0-9a-fA-F]{1,4}:){1,2}(?::[0-9a-fA-F]{1,4}){1,5}",
        r"[0-9a-fA-F]{1,4}:(?::[0-9a-fA-F]{1,4}){1,6}",
        r":(?::[0-9a-fA-F]{1,4}){1,7}",
        r"::",
    ]),
    # RFC 1123 labels; at most 6 of at most 40 characters keep the name under 253
    "hostname": _LABEL + r"(?:\." + _LABEL + r"){0,5}",
    # RFC 3339 appendix A (ISO 8601 durations)
    "duration": r"P(?:(?:" + _N + "D|" + _N + "M(?:" + _N + "D)?|" + _N + "Y(?:" + _N + "M(?:" + _N + "D)?)?)"
                r"(?:" + _DUR_TIME + ")?|" + _DUR_TIME + "|" + _N + "W)",
    "uri": r"https?://" + _HOST + _PATH,
    # an absolute URI as above or an absolute-path reference ("/a/b"; the two start with
    # different characters, which keeps the automaton small), then ?query and #fragment
    "uri-reference": r"(?:https?://" + _HOST + _PATH + r"|/" + r"(?:" + _PCHAR + r"{1,24}" + _PATH + r")?)?"
                     r"(?:\?" + _QUERY + r")?(?:#" + _QUERY + r")?",
}
FORMATS["date-time"] = FORMATS["date"] + "T" + FORMATS["time"]
ANY_DEPTH = 2  # nesting of a free-form value ({} or true): objects/arrays this deep
# Limits checked before and during translation, so a hostile schema costs little:
MAX_SCHEMA_CHARS = 1 << 20  # the schema's JSON text
MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects/arrays in the schema document
MAX_SCHEMA_EXPANSION = 20_000  # subschemas translated, each $ref use counted again
MAX_REF_DEPTH = 64  # $refs being expanded inside each other
MAX_REGEX_CHARS = 1 << 20  # the translated regex
MAX_TRANSLATE_S = 5.0  # wall time of one translation (checked at every subschema)
OPEN_BOUND_LIMIT = 10**9  # exclusive number bounds: |bound| below this ...
OPEN_BOUND_FRACTION = 6  # ... and at most this many fraction digits (float-safe near the bound)
MAX_COUNTED_OPTIONAL = 8  # optional properties under minProperties/maxProperties (2**8 branches)
JSON_WHITESPACE = r"[ \t\n\r]*"


class SchemaError(ValueError):
    """A schema plait cannot (or will not) enforce; the message names the keyword."""


def schema_to_regex(schema: Any, whitespace: str | None = None) -> str:
    """The regex of the JSON texts that ``schema`` (a dict, bool or JSON string)
    admits, in plait's layout. Raises ``SchemaError`` naming what is unsupported."""
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise SchemaError(f"json_schema has {len(schema)} characters; allowed: at most {MAX_SCHEMA_CHARS}")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise SchemaError(f"json_schema is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"json_schema must be a JSON object (or true), got {type(schema).__name__}")
    check_schema_size(schema)
    ws = ""
    if whitespace is not None:
        ws = "(?:" + check_whitespace(whitespace) + ")"
    try:
        out = _Translator(schema, ws).value(schema, "#")
    except RecursionError:  # a guard: the limits above keep translation shallow
        raise SchemaError(f"json_schema is nested too deeply; allowed: at most {MAX_SCHEMA_DEPTH} levels") from None
    if len(out) > MAX_REGEX_CHARS:
        raise SchemaError(
            f"json_schema translates to a regex of {len(out)} characters; allowed: at most {MAX_REGEX_CHARS} "
            f"(fewer optional properties, enums or alternatives)"
        )
    return out


def check_schema_size(schema: Any) -> None:
    """Nesting depth and size of the schema document, walked without recursion."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"json_schema is nested more than {MAX_SCHEMA_DEPTH} levels deep; allowed: at most "
                              f"{MAX_SCHEMA_DEPTH}")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            nodes += 1
            if nodes > MAX_SCHEMA_CHARS // 4:
                raise SchemaError(f"json_schema has more than {MAX_SCHEMA_CHARS // 4} values; it is too large")
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))


def check_whitespace(pattern: Any) -> str:
    """A whitespace pattern must match only JSON whitespace (spaces, tabs, newlines)."""
    import interegular

    check_regex(pattern, "whitespace_pattern")
    try:
        ok = interegular.parse_pattern(pattern).to_fsm().issubset(interegular.parse_pattern(JSON_WHITESPACE).to_fsm())
    except Exception:
        ok = False
    if not ok:
        raise ValueError(
            f"whitespace_pattern={pattern!r} is invalid; allowed: a regex matching only spaces, tabs and newlines, e.g. '[ ]?'"
        )
    return pattern


class _Translator:
    def __init__(self, root: Any, ws: str) -> None:
        self.root = root
        self.ws = ws
        self.refs: list[str] = []  # $refs being expanded (recursion check)
        self.expanded = 0  # subschemas translated so far (MAX_SCHEMA_EXPANSION)
        self.deadline = time.monotonic() + MAX_TRANSLATE_S

    # -- dispatch ---------------------------------------------------------------------
    def value(self, s: Any, path: str) -> str:
        self.expanded += 1
        if time.monotonic() > self.deadline:
            raise SchemaError(f"json_schema took longer than {MAX_TRANSLATE_S:g} s to translate; allowed: at most "
                              f"{MAX_TRANSLATE_S:g} s (a smaller schema, fewer alternatives)")
        if self.expanded > MAX_SCHEMA_EXPANSION:
            raise SchemaError(
                f"json_schema expands to more than {MAX_SCHEMA_EXPANSION} subschemas (each use of a '$ref' counts); "
                f"allowed: at most {MAX_SCHEMA_EXPANSION}"
            )
        if s is True:
            return self.any(ANY_DEPTH, path)
        if s is False:
            raise SchemaError(f"json_schema at {path} is false: no value can satisfy it")
        if not isinstance(s, dict):
            raise SchemaError(f"json_schema at {path} must be an object or a boolean, got {type(s).__name__}")
        self.check_keywords(s, path)
        if "not" in s:  # only `not: {type: ...}` passes check_keywords
            s = self.without_types(s, _type_negation(s["not"]) or set(), path)
        if "$ref" in s:
            return self.ref(s, path)
        if "allOf" in s:
            return self.value(self.merge(self.all_of(s, path), path + "/allOf"), path)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.alternatives(s, key, path)
        if "enum" in s or "const" in s:
            return self.enum(s, path)
        types = self.types(s, path)
        if types is None:
            return self.any(ANY_DEPTH, path)
        return _alt([self.typed(s, t, path) for t in types])

    def check_keywords(self, s: dict[str, Any], path: str) -> None:
        for k in s:
            if k in ANNOTATIONS or k.startswith("x-"):
                continue
            if k == "uniqueItems" and (s[k] is False or is_int(s.get("maxItems")) and s["maxItems"] <= 1):
                continue
            if k == "multipleOf" and _multiple_of_supported(s):
                continue
            if k == "not" and _type_negation(s[k]) is not None:
                continue
            if k in ("dependentRequired", "dependencies") and _required_deps(s) is not None:
                continue
            if k in WHY_NOT:
                raise SchemaError(f"json_schema keyword {k!r} at {path} is not supported: {WHY_NOT[k]}")
            # any other keyword (draft-4 "id", OpenAPI's "nullable" or "example", vendor
            # keys such as "javaType") does not constrain: the JSON Schema specification
            # says unknown keywords are ignored, and jsonschema ignores them too

    def without_types(self, s: dict[str, Any], excluded: set[str], path: str) -> dict[str, Any]:
        """``s`` with ``not: {type: excluded}`` folded into its ``type``. Excluding
        ``integer`` but not ``number`` leaves the numbers with a fractional part."""
        rest = {k: v for k, v in s.items() if k != "not"}
        base = self.types(rest, path) or list(TYPE_KEYWORDS)
        if "number" in base and "integer" not in base:
            base = [*base, "integer"]  # "number" includes the integers
        allowed = [t for t in base if t not in excluded and not (t == "integer" and "number" in excluded)]
        if "number" in allowed and "integer" in excluded:
            rest[_FRACTIONAL] = True
        if not allowed:
            raise SchemaError(f"json_schema 'not' at {path} excludes every type the schema allows")
        return {**rest, "type": allowed}

    def types(self, s: dict[str, Any], path: str) -> list[str] | None:
        t = s.get("type")
        if t is None:  # infer from the keywords present; None: any value
            found = [name for name, keys in TYPE_KEYWORDS.items() if keys & s.keys() and name != "integer"]
            return found or None
        ts = t if isinstance(t, list) else [t]
        if not ts or not all(isinstance(x, str) and x in TYPE_KEYWORDS for x in ts):
            raise SchemaError(f"json_schema 'type' at {path} is invalid: {t!r}; allowed: {', '.join(TYPE_KEYWORDS)}")
        if "integer" in ts and "number" in ts:
            ts = [x for x in ts if x != "integer"]
        return ts

    def typed(self, s: dict[str, Any], t: str, path: str) -> str:
        return {
            "string": self.string, "integer": self.integer, "number": self.number,
            "boolean": lambda s, p: BOOLEAN, "null": lambda s, p: NULL,
            "object": self.object, "array": self.array,
        }[t](s, path)

    # -- combinators --------------------------------------------------------------------
    def resolve(self, ref: Any, path: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"json_schema '$ref' at {path} is not supported: {ref!r}; allowed: local references ('#/...')")
        node: Any = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaError(f"json_schema '$ref' at {path} points nowhere: {ref!r}")
        return node

    def ref(self, s: dict[str, Any], path: str) -> str:
        ref = s["$ref"]
        if ref in self.refs:
            raise SchemaError(f"json_schema '$ref' at {path} is recursive ({ref!r}): recursive schemas cannot be a regex")
        if len(self.refs) >= MAX_REF_DEPTH:
            raise SchemaError(f"json_schema '$ref' at {path} is expanded inside {MAX_REF_DEPTH} others; allowed: at most "
                              f"{MAX_REF_DEPTH}")
        target = self.resolve(ref, path)
        rest = {k: v for k, v in s.items() if k != "$ref" and k not in ANNOTATIONS}
        self.refs.append(ref)
        try:
            return self.value(self.merge([target, rest], path) if rest else target, path)
        finally:
            self.refs.pop()

    def all_of(self, s: dict[str, Any], path: str) -> list[Any]:
        subs = s["allOf"]
        if not isinstance(subs, list) or not subs:
            raise SchemaError(f"json_schema 'allOf' at {path} must be a non-empty list")
        rest = {k: v for k, v in s.items() if k != "allOf"}
        return list(subs) + ([rest] if rest else [])

    def merge(self, subs: list[Any], path: str) -> Any:
        """One schema equivalent to all of ``subs`` (allOf), or ``SchemaError``."""
        out: dict[str, Any] = {}
        flat: list[Any] = []
        for sub in subs:
            while isinstance(sub, dict) and "$ref" in sub and set(sub) - ANNOTATIONS == {"$ref"}:
                sub = self.resolve(sub["$ref"], path)
            if sub is True:
                continue
            if sub is False or not isinstance(sub, dict):
                raise SchemaError(f"json_schema 'allOf' at {path} contains {sub!r}: no value can satisfy it")
            if "allOf" in sub:
                flat.extend(self.all_of(sub, path))
            else:
                flat.append(sub)
        for sub in flat:
            for k, v in sub.items():
                if k in ANNOTATIONS:
                    continue
                if k not in out:
                    out[k] = v
                elif k == "properties":
                    props = dict(out[k])
                    for name, ps in v.items():
                        props[name] = ps if name not in props or props[name] == ps else {"allOf": [props[name], ps]}
                    out[k] = props
                elif k == "required":
                    out[k] = list(dict.fromkeys([*out[k], *v]))
                elif k == "type":
                    a = set(out[k] if isinstance(out[k], list) else [out[k]])
                    b = set(v if isinstance(v, list) else [v])
                    both = (a & b) | ({"integer"} if ("number" in a and "integer" in b) or ("integer" in a and "number" in b) else set())
                    if not both:
                        raise SchemaError(f"json_schema 'allOf' at {path}: types {sorted(a)} and {sorted(b)} exclude each other")
                    out[k] = sorted(both)
                elif k in ("minimum", "minLength", "minItems", "exclusiveMinimum") and _is_num(v) and _is_num(out[k]):
                    out[k] = max(out[k], v)
                elif k in ("maximum", "maxLength", "maxItems", "exclusiveMaximum") and _is_num(v) and _is_num(out[k]):
                    out[k] = min(out[k], v)
                elif k == "enum" and isinstance(v, list):
                    out[k] = [x for x in out[k] if x in v]
                elif out[k] != v:
                    raise SchemaError(f"json_schema 'allOf' at {path}: conflicting values for {k!r} cannot be merged")
        return out

    def alternatives(self, s: dict[str, Any], key: str, path: str) -> str:
        subs = s[key]
        if not isinstance(subs, list) or not subs:
            raise SchemaError(f"json_schema {key!r} at {path} must be a non-empty list")
        rest = {k: v for k, v in s.items() if k != key}
        branches = [
            self.value(self.merge([sub, rest], f"{path}/{key}/{i}") if rest else sub, f"{path}/{key}/{i}")
            for i, sub in enumerate(subs)
        ]
        if key == "oneOf":
            _check_disjoint(branches, path)
        return _alt(branches)

    def enum(self, s: dict[str, Any], path: str) -> str:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"json_schema 'enum' at {path} must be a non-empty list")
        if "const" in s and "enum" in s:
            values = [v for v in s["enum"] if v == s["const"]]
        extra = [k for k in s if k not in ANNOTATIONS and k not in ("enum", "const", "type")]
        if extra:
            raise SchemaError(f"json_schema keyword {extra[0]!r} at {path} cannot be combined with 'enum'/'const'")
        types = self.types(s, path) if "type" in s else None
        if types is not None:
            values = [v for v in values if any(_json_type_ok(v, t) for t in types)]
        if not values:
            raise SchemaError(f"json_schema 'enum' at {path}: no value satisfies the schema")
        return _alt([escape(self.dump(v)) for v in values])

    def dump(self, v: Any) -> str:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))

    # -- scalars ------------------------------------------------------------------------
    def string(self, s: dict[str, Any], path: str) -> str:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if not is_int(lo) or lo < 0 or (hi is not None and (not is_int(hi) or hi < lo)):
            raise SchemaError(f"json_schema 'minLength'/'maxLength' at {path} are invalid: {lo!r}, {hi!r}")
        present = [k for k in ("pattern", "format") if k in s]
        lengths = "minLength" in s or "maxLength" in s
        if len(present) > 1 or (present and lengths):
            what = present + (["minLength/maxLength"] if lengths else [])
            raise SchemaError(f"json_schema keywords {' and '.join(map(repr, what))} at {path} cannot be combined")
        if "pattern" in s:
            return '"' + _json_safe_pattern(s["pattern"], path) + '"'
        if "format" in s:
            fmt = s["format"]
            if fmt not in FORMATS:
                raise SchemaError(
                    f"json_schema 'format' {fmt!r} at {path} is not supported; allowed: {', '.join(sorted(FORMATS))}"
                )
            return '"(?:' + FORMATS[fmt] + ')"'
        if lo == 0 and hi is None:
            return JSON_STRING
        return '"' + _repeat(JSON_CHAR, lo, hi) + '"'

    def integer(self, s: dict[str, Any], path: str) -> str:
        k = s.get("multipleOf", 1)
        if k != 1:  # _multiple_of_supported: 2, 5 or a power of ten, without bounds
            return _multiples_regex(int(k))
        lo, hi = self.bounds(s, path)
        if lo is None and hi is None:
            return INTEGER
        lo = None if lo is None else (math.floor(lo[0]) + 1 if lo[1] else math.ceil(lo[0]))
        hi = None if hi is None else (math.ceil(hi[0]) - 1 if hi[1] else math.floor(hi[0]))
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(f"json_schema 'minimum'/'maximum' at {path} admit no integer")
        return int_range_regex(lo, hi)

    def number(self, s: dict[str, Any], path: str) -> str:
        if s.get(_FRACTIONAL):  # `not: {type: integer}`: a non-zero fractional digit
            if set(s) & TYPE_KEYWORDS["number"] or "multipleOf" in s:
                raise SchemaError(f"json_schema 'not' at {path}: bounds on non-integral numbers are not supported")
            # float-safe: at most 9 + 6 digits, so parsing cannot round it to an integer
            return r"-?(?:0|[1-9][0-9]{0,8})\.[0-9]{0,5}[1-9]"
        if s.get("multipleOf") == 1:  # whole numbers, written as integers
            return self.integer(s, path)
        lo, hi = self.bounds(s, path)
        if lo is None and hi is None:
            return NUMBER
        for b, key in ((lo, "minimum"), (hi, "maximum")):
            if b is not None and b[0] != int(b[0]):
                kw = ("exclusiveMinimum" if key == "minimum" else "exclusiveMaximum") if b[1] else key
                raise SchemaError(
                    f"json_schema {kw!r} at {path} is not supported for 'number' ({b[0]!r}); allowed: "
                    f"integral bounds, inclusive or exclusive (or type 'integer')"
                )
        a = None if lo is None else int(lo[0])
        b = None if hi is None else int(hi[0])
        if a is not None and b is not None and (a > b or (a == b and (lo[1] or hi[1]))):
            raise SchemaError(f"json_schema 'minimum'/'maximum' at {path} admit no number")
        return number_range_regex(a, b, lo is not None and lo[1], hi is not None and hi[1])

    def bounds(self, s: dict[str, Any], path: str) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
        """(value, exclusive) lower and upper bounds, the tighter of inclusive and
        exclusive; draft-4 boolean exclusiveMinimum/Maximum are understood."""
        out: list[tuple[float, bool] | None] = []
        for inc, exc, pick in (("minimum", "exclusiveMinimum", max), ("maximum", "exclusiveMaximum", min)):
            cands: list[tuple[float, bool]] = []
            if inc in s:
                if not _is_num(s[inc]):
                    raise SchemaError(f"json_schema {inc!r} at {path} must be a number, got {s[inc]!r}")
                cands.append((s[inc], s.get(exc) is True))
            if exc in s and not isinstance(s[exc], bool):
                if not _is_num(s[exc]):
                    raise SchemaError(f"json_schema {exc!r} at {path} must be a number, got {s[exc]!r}")
                cands.append((s[exc], True))
            if not cands:
                out.append(None)
            elif pick is max:
                out.append(max(cands, key=lambda c: (c[0], c[1])))
            else:
                out.append(min(cands, key=lambda c: (c[0], not c[1])))
        return out[0], out[1]

    # -- containers ---------------------------------------------------------------------
    def object(self, s: dict[str, Any], path: str) -> str:
        ws = self.ws
        props = s.get("properties", {})
        required = s.get("required", [])
        extra = s.get("additionalProperties", True)
        if not isinstance(props, dict) or not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"json_schema 'properties'/'required' at {path} are invalid")
        if not isinstance(extra, (bool, dict)):
            raise SchemaError(f"json_schema 'additionalProperties' at {path} must be a boolean or a schema")
        lo, hi = s.get("minProperties", 0), s.get("maxProperties")
        if not is_int(lo) or lo < 0 or (hi is not None and (not is_int(hi) or hi < lo)):
            raise SchemaError(f"json_schema 'minProperties'/'maxProperties' at {path} are invalid: {lo!r}, {hi!r}")
        deps = _required_deps(s) or {}
        counted = "minProperties" in s or "maxProperties" in s or bool(deps)
        fields = [(name, sub) for name, sub in props.items()]
        for name in required:
            if name not in props:
                if extra is False:
                    raise SchemaError(
                        f"json_schema at {path} requires {name!r}, which additionalProperties: false forbids"
                    )
                fields.append((name, extra))
        if not fields:
            if extra is False:
                if lo > 0:
                    raise SchemaError(f"json_schema at {path}: no object satisfies 'minProperties' here")
                return r"\{" + ws + r"\}"
            value = self.value(extra, path + "/additionalProperties") if isinstance(extra, dict) else self.any(ANY_DEPTH - 1, path)
            pair = JSON_STRING + ws + ":" + ws + value
            if counted:  # NOTE: keys may repeat in the text; JSON parsers keep the last one
                raise SchemaError(f"json_schema 'minProperties'/'maxProperties'/'dependentRequired' at {path} need "
                                  f"'properties' to be listed (free-form keys could repeat)")
            return r"\{" + ws + "(?:" + pair + "(?:" + ws + "," + ws + pair + ")*)?" + ws + r"\}"
        sep = ws + "," + ws
        pairs = [
            (escape(self.dump(name)) + ws + ":" + ws + self.value(sub, f"{path}/properties/{name}"), name in required)
            for name, sub in fields
        ]

        if counted:
            names = [name for name, _ in fields]
            return r"\{" + ws + self.counted_fields(pairs, names, lo, hi, deps, path) + ws + r"\}"

        def rest(i: int, first: bool) -> str:
            # properties i.. given whether one was written already
            if i == len(pairs):
                return ""
            pair, req = pairs[i]
            if not first:
                return (sep + pair if req else "(?:" + sep + pair + ")?") + rest(i + 1, False)
            if req:
                return pair + rest(i + 1, False)
            alt = rest(i + 1, True)
            return "(?:" + pair + rest(i + 1, False) + (")?" if not alt else "|" + alt + ")")

        return r"\{" + ws + rest(0, True) + ws + r"\}"

    def counted_fields(self, pairs: list[tuple[str, bool]], names: list[str], lo: int, hi: int | None,
                       deps: dict[str, list[str]], path: str) -> str:
        """The listed properties in order, required ones present, with between ``lo``
        and ``hi`` written in all (min/maxProperties), and every property in ``deps``
        written only with the ones it depends on (dependentRequired). Each choice of
        optional properties is its own branch, so at most MAX_COUNTED_OPTIONAL optional
        ones."""
        sep = self.ws + "," + self.ws
        optional = [i for i, (_, req) in enumerate(pairs) if not req]
        if len(optional) > MAX_COUNTED_OPTIONAL:
            raise SchemaError(
                f"json_schema 'minProperties'/'maxProperties' at {path} are supported with at most "
                f"{MAX_COUNTED_OPTIONAL} optional properties; this object has {len(optional)}"
            )
        n_req = len(pairs) - len(optional)
        need_lo, need_hi = lo - n_req, None if hi is None else hi - n_req
        left_after = [sum(1 for j in optional if j >= i) for i in range(len(pairs) + 1)]

        def rest(i: int, first: bool, taken: int, present: frozenset[str]) -> str | None:
            # properties i.. given whether one was written already, the optional ones
            # taken and the names written so far
            if taken + left_after[i] < need_lo or (need_hi is not None and taken > need_hi):
                return None
            if i == len(pairs):
                return "" if all(set(deps.get(n, ())) <= present for n in present) else None
            pair, req = pairs[i]
            lead = pair if first else sep + pair
            if req:
                tail = rest(i + 1, False, taken, present | {names[i]})
                return None if tail is None else lead + tail
            take = rest(i + 1, False, taken + 1, present | {names[i]})
            skip = rest(i + 1, first, taken, present)
            options = ([lead + take] if take is not None else []) + ([skip] if skip is not None else [])
            if not options:
                return None
            if len(options) == 1:
                return options[0]
            return "(?:" + options[0] + ")?" if options[1] == "" else "(?:" + options[0] + "|" + options[1] + ")"

        body = rest(0, True, 0, frozenset())
        if body is None:
            raise SchemaError(
                f"json_schema at {path}: no object satisfies 'minProperties'/'maxProperties'/'dependentRequired' here"
            )
        return body

    def array(self, s: dict[str, Any], path: str) -> str:
        ws = self.ws
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if not is_int(lo) or lo < 0 or (hi is not None and (not is_int(hi) or hi < lo)):
            raise SchemaError(f"json_schema 'minItems'/'maxItems' at {path} are invalid: {lo!r}, {hi!r}")
        items = s.get("items", True)
        prefix = s.get("prefixItems", [])
        if isinstance(items, list):  # draft 4: items as a list, additionalItems for the rest
            prefix, items = items, s.get("additionalItems", True)
        elif "additionalItems" in s:
            raise SchemaError(f"json_schema 'additionalItems' at {path} needs 'items' to be a list")
        if not isinstance(prefix, list):
            raise SchemaError(f"json_schema 'prefixItems' at {path} must be a list")
        pre = [self.value(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
        item = None if items is False else self.value(items, path + "/items")
        sep = ws + "," + ws
        k = len(pre)
        options = []
        for n in range(lo, min(k, hi if hi is not None else k) + 1):  # arrays no longer than the prefix
            options.append(sep.join(pre[:n]))
        if item is not None and (hi is None or hi > k):
            jlo, jhi = max(lo - k, 1), (None if hi is None else hi - k)
            if k:
                options.append(sep.join(pre) + _repeat("(?:" + sep + item + ")", jlo, jhi))
            else:
                options.append(item + _repeat("(?:" + sep + item + ")", jlo - 1, None if jhi is None else jhi - 1))
        if not options:
            raise SchemaError(f"json_schema at {path}: no array satisfies 'minItems'/'maxItems' with these items")
        body = _alt(options) if len(options) > 1 or options[0] else ""
        if "" in options and len(options) > 1:
            body = "(?:" + _alt([o for o in options if o]) + ")?"
        return r"\[" + ws + body + ws + r"\]"

    def any(self, depth: int, path: str) -> str:
        """Any JSON value, objects and arrays nested at most ``depth`` deep."""
        scalar = _alt([JSON_STRING, NUMBER, BOOLEAN, NULL])
        if depth <= 0:
            return scalar
        inner = self.any(depth - 1, path)
        ws, sep = self.ws, self.ws + "," + self.ws
        arr = r"\[" + ws + "(?:" + inner + "(?:" + sep + inner + ")*)?" + ws + r"\]"
        pair = JSON_STRING + ws + ":" + ws + inner
        obj = r"\{" + ws + "(?:" + pair + "(?:" + sep + pair + ")*)?" + ws + r"\}"
        return _alt([scalar, arr, obj])


# -- helpers ------------------------------------------------------------------------------
_FRACTIONAL = "\x00fractional"  # internal mark (never a key of a user's schema)


def _type_negation(sub: Any) -> set[str] | None:
    """The types ``not: sub`` excludes when ``sub`` is only a ``type`` (plus
    annotations), else None."""
    if not isinstance(sub, dict) or "type" not in sub or set(sub) - ANNOTATIONS - {"type"}:
        return None
    t = sub["type"]
    ts = t if isinstance(t, list) else [t]
    if not ts or not all(isinstance(x, str) and x in TYPE_KEYWORDS for x in ts):
        return None
    return set(ts)


def _required_deps(s: dict[str, Any]) -> dict[str, list[str]] | None:
    """``dependentRequired`` (and draft-7 ``dependencies`` whose values are all name
    lists) as one mapping, or None when absent or in another form."""
    out: dict[str, list[str]] = {}
    for key in ("dependentRequired", "dependencies"):
        d = s.get(key)
        if d is None:
            continue
        if not isinstance(d, dict) or not all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in d.values()
        ):
            return None
        for name, needed in d.items():
            out.setdefault(name, []).extend(needed)
    return out or None


def _multiple_of_supported(s: dict[str, Any]) -> bool:
    """``multipleOf`` forms a regex enforces exactly: 1 (whole numbers, any bounds), and
    2, 5 or a power of ten for ``type: integer`` without bounds (the last digits)."""
    k = s.get("multipleOf")
    if not _is_num(k) or isinstance(k, bool) or k <= 0:
        return False
    if k == 1:
        return True
    bounded = any(b in s for b in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
    power_of_ten = is_int(k) and str(k).rstrip("0") == "1" and len(str(k)) < MAX_DIGITS
    return s.get("type") == "integer" and not bounded and is_int(k) and (k in (2, 5) or power_of_ten)


def _multiples_regex(k: int) -> str:
    """JSON integers divisible by ``k`` (2, 5 or 10**d), at most MAX_DIGITS digits."""
    if k in (2, 5):
        last = "[02468]" if k == 2 else "[05]"
        single = "[2468]" if k == 2 else "5"
        return r"(?:0|-?" + single + "|-?[1-9][0-9]{0,%d}" % (MAX_DIGITS - 2) + last + ")"
    zeros = len(str(k)) - 1
    return r"(?:0|-?[1-9][0-9]{0,%d}" % (MAX_DIGITS - zeros - 1) + "0" * zeros + ")"


def _alt(parts: list[str]) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _repeat(x: str, lo: int, hi: int | None) -> str:
    if hi is not None and hi <= 0:
        return ""
    if hi is None:
        return {0: "(?:" + x + ")*", 1: "(?:" + x + ")+"}.get(lo, "(?:" + x + "){%d,}" % lo)
    if lo == hi:
        return x if lo == 1 else "(?:" + x + "){%d}" % lo
    return "(?:" + x + "){%d,%d}" % (lo, hi)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _json_type_ok(v: Any, t: str) -> bool:
    return {
        "string": isinstance(v, str), "integer": is_int(v) or (isinstance(v, float) and v.is_integer()),
        "number": _is_num(v), "boolean": isinstance(v, bool), "null": v is None,
        "object": isinstance(v, dict), "array": isinstance(v, list),
    }[t]


def _same_length_range(lo: str, hi: str) -> str:
    """Decimal strings of equal length from ``lo`` to ``hi`` (inclusive)."""
    n = len(lo)
    if lo == hi:
        return lo
    if n == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return lo[0] + _same_length_range(lo[1:], hi[1:])
    if lo[1:] == "0" * (n - 1) and hi[1:] == "9" * (n - 1):
        return f"[{lo[0]}-{hi[0]}][0-9]{{{n - 1}}}"
    parts = [lo[0] + _same_length_range(lo[1:], "9" * (n - 1))]
    a, b = int(lo[0]) + 1, int(hi[0]) - 1
    if a <= b:
        parts.append((str(a) if a == b else f"[{a}-{b}]") + f"[0-9]{{{n - 1}}}")
    parts.append(hi[0] + _same_length_range("0" * (n - 1), hi[1:]))
    return _alt(parts)


def _nonneg_range(a: int, b: int | None) -> str:
    """Canonical decimals of the integers in ``[a, b]``, a >= 0 (``b`` None: up to
    ``MAX_DIGITS`` digits)."""
    parts = []
    top = len(str(b)) if b is not None else len(str(a))
    for n in range(len(str(a)), top + 1):
        first = 0 if n == 1 else 10 ** (n - 1)
        lo, hi = max(a, first), (10**n - 1 if b is None else min(b, 10**n - 1))
        if lo <= hi:
            parts.append(_same_length_range(str(lo), str(hi)))
    if b is None and len(str(a)) < MAX_DIGITS:
        parts.append("[1-9][0-9]{%d,%d}" % (len(str(a)), MAX_DIGITS - 1))
    return _alt(parts)


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """Integers in ``[lo, hi]`` (None: unbounded) as JSON writes them."""
    parts = []
    if lo is None or lo < 0:  # negatives -x with x in [max(1, -hi), -lo]
        x_lo = 1 if hi is None or hi >= 0 else -hi
        parts.append("-" + _nonneg_range(x_lo, None if lo is None else -lo))
    if hi is None or hi >= 0:
        parts.append(_nonneg_range(max(lo or 0, 0), hi))
    return _alt(parts)


def number_range_regex(lo: int | None, hi: int | None, lo_open: bool = False, hi_open: bool = False) -> str:
    """Numbers (no exponent) between integral bounds (None: unbounded), each bound
    inclusive or open (``lo_open``: ``v > lo``).

    NOTE: with an open bound, fractions have at most OPEN_BOUND_FRACTION digits and the
    bounds are below OPEN_BOUND_LIMIT in magnitude, so that a value parsed as a float
    (as validators do) cannot round onto the bound it must not reach."""
    if lo_open or hi_open:
        if any(b is not None and abs(b) >= OPEN_BOUND_LIMIT for b in (lo, hi)):
            raise SchemaError(f"exclusive bounds on numbers are supported up to {OPEN_BOUND_LIMIT:.0e} in magnitude")
        frac = r"(?:\.[0-9]{1,%d})?" % OPEN_BOUND_FRACTION
        nonzero_frac = r"\.[0-9]{0,%d}[1-9]" % (OPEN_BOUND_FRACTION - 1)  # a fraction that is not zero
    else:
        frac, nonzero_frac = r"(?:\.[0-9]{1,16})?", ""
    zeros = r"(?:\.0{1,16})?"

    def magnitude(a: int, b: int | None, a_open: bool, b_open: bool) -> str | None:
        # |v| between a and b: integer part a (with a non-zero fraction when a is open),
        # integer parts strictly between with any fraction, b with a zero fraction
        if b is not None and (b < a or (b == a and (a_open or b_open))):
            return None
        if b == a:
            return str(a) + zeros
        parts = [str(a) + (nonzero_frac if a_open else frac)]
        if b is None or b - 1 >= a + 1:
            parts.append(_nonneg_range(a + 1, None if b is None else b - 1) + frac)
        if b is not None and not b_open:
            parts.append(str(b) + zeros)
        return _alt(parts)

    parts = []
    if lo is None or lo < 0:  # negative numbers: magnitudes from max(-hi, 0) up to -lo
        if hi is None or hi > 0:
            low, low_open = 0, False
        else:
            low, low_open = -hi, hi_open
        neg = magnitude(low, None if lo is None else -lo, low_open, lo_open)
        if neg is not None:
            parts.append("-" + neg)
    if hi is None or hi > 0 or (hi == 0 and not hi_open):  # zero and positive numbers
        low, low_open = (0, False) if lo is None or lo < 0 else (lo, lo_open)
        pos = magnitude(low, hi, low_open, hi_open)
        if pos is not None:
            parts.append(pos)
    if not parts:
        raise SchemaError(f"no number lies between {lo} and {hi} with these bounds")
    return _alt(parts)


_UNSAFE = frozenset('"\\') | frozenset(chr(c) for c in range(0x20))


def _json_safe_pattern(pattern: Any, path: str) -> str:
    """A JSON Schema ``pattern`` as the full content of a JSON string. A match anywhere
    is what the schema asks; a full match is a stricter, valid choice. Patterns that
    could produce a quote, a backslash or a control character are rejected. The check
    reads the parsed pattern's character classes (linear time, no automaton)."""
    import interegular

    if not isinstance(pattern, str):
        raise SchemaError(f"json_schema 'pattern' at {path} must be a string")
    p = pattern[1:] if pattern.startswith("^") else pattern
    if p.endswith("$") and not p.endswith("\\$"):
        p = p[:-1]
    check_regex(p, f"json_schema 'pattern' at {path}")
    try:
        safe = _chars_are_safe(interegular.parse_pattern(p))
    except Exception as e:
        raise SchemaError(f"json_schema 'pattern' at {path} uses syntax plait cannot check: {e}") from None
    if not safe:
        raise SchemaError(
            f"json_schema 'pattern' at {path} ({pattern!r}) can produce a quote, backslash or control character, "
            "which a JSON string must escape; exclude them from its character classes (e.g. [^\"\\\\] instead of .)"
        )
    return "(?:" + p + ")"


def _chars_are_safe(node: Any) -> bool:
    """No character class in the parsed pattern can produce a character of ``_UNSAFE``."""
    import dataclasses

    from interegular import patterns

    if isinstance(node, patterns._CharGroup):
        return _UNSAFE <= node.chars if node.negated else not (_UNSAFE & node.chars)
    if node is patterns._DOT or type(node).__name__.endswith("DotCls"):
        return False  # '.' produces quotes and backslashes
    if not dataclasses.is_dataclass(node):
        return True
    for f in dataclasses.fields(node):
        v = getattr(node, f.name)
        children = v if isinstance(v, (tuple, list, frozenset)) else (v,)
        for c in children:
            if isinstance(c, patterns._BasePattern) and not _chars_are_safe(c):
                return False
    return True


# oneOf is checked on the branches' automata (pure Python): only for branches this small
MAX_ONEOF_CHECK_CHARS = 4000
MAX_ONEOF_CHECK_REPEAT = 64


def _check_disjoint(branches: list[str], path: str) -> None:
    """oneOf means exactly one branch: enforced when no text matches two branches."""
    import interegular
    import re

    bounds = [int(x) for b in branches for pair in re.findall(r"\{(\d+)(?:,(\d*))?\}", b) for x in pair if x]
    if sum(map(len, branches)) > MAX_ONEOF_CHECK_CHARS or any(n > MAX_ONEOF_CHECK_REPEAT for n in bounds):
        raise SchemaError(
            f"json_schema 'oneOf' at {path}: the branches are too large to prove exclusive; use 'anyOf'"
        )
    try:
        fsms = [interegular.parse_pattern(b).to_fsm() for b in branches]
        for i in range(len(fsms)):
            for j in range(i + 1, len(fsms)):
                if not (fsms[i] & fsms[j]).empty():
                    raise SchemaError(
                        f"json_schema 'oneOf' at {path}: branches {i} and {j} can match the same value, so "
                        "'exactly one' cannot be enforced; use 'anyOf' or make the branches exclusive"
                    )
    except SchemaError:
        raise
    except Exception as e:
        raise SchemaError(f"json_schema 'oneOf' at {path}: could not check that the branches are exclusive ({e})") from None
