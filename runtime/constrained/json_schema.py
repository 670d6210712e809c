"""JSON Schema -> regex. Every output the regex admits validates against the schema.

The rule: a keyword is either enforced by the regex or rejected with a ``SchemaError``
(a ``ValueError``) that names it and where it is. Nothing that constrains a value is
silently dropped. Annotations (``title``, ``description``, ``default``...) are ignored.

What is enforced and what is refused is listed in docs/constrained.md ("JSON Schema
support"); tests/test_json_schema_coverage.py checks each form against ``jsonschema``.
Where a keyword is enforced on part of its values only (a pattern narrowed to
JSON-safe characters, an ordered ``uniqueItems``, a recursion unrolled), the regex
admits a subset of the valid texts, never more.

Output layout: properties in declared order, optional ones may be left out; no
whitespace between tokens unless ``whitespace`` (a regex over spaces, tabs and
newlines) is given. Torch-free.

Repeated keys: listed properties are written once each, but the keys of a free-form
object (no listed ``properties``: ``{"type": "object"}``, ``additionalProperties``,
``patternProperties``, ``propertyNames``) may repeat in a text. This is a decision, not
an oversight. A regex cannot keep them distinct: "a list of distinct strings" is not a
regular language (an automaton would have to remember every key written so far), and
over a finite set of n keys it is, but with a state per subset written (2**n). It is
sound as it stands: RFC 8259 says names SHOULD be unique and leaves the duplicate's
reading to the parser; Python's ``json`` (and so ``jsonschema``) keeps the last value,
others the first, and every pair of a free-form object is drawn from the same
alternatives, so either reading is the text with the other copies left out, which the
regex admits too and which validates. For the same reason ``maxProperties`` is enforced
there (repeats only lower the count) and ``minProperties`` only up to 1 (a repeat would
count once); a parser that rejects duplicate names may reject such an output.
"""

from __future__ import annotations

import functools
import json
import re
import math
import sys
import time
from decimal import Decimal
from fractions import Fraction
from collections.abc import Callable
from typing import Any

from plait.errors import is_int
from plait.regex import MAX_PATTERN_CHARS, MAX_REPEAT, check_regex
from plait.runtime.constrained.regexes import (
    BOOLEAN,
    INTEGER,
    JSON_CHAR,
    MAX_DIGITS,
    JSON_STRING,
    NULL,
    NUMBER,
    eliminate,
    escape,
    union,
)

ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$schema", "$id", "id", "$comment", "deprecated",
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
    "array": frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains"}),
}
COMBINATORS = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"})
KNOWN = COMBINATORS | frozenset().union(*TYPE_KEYWORDS.values())
# validation keywords handled case by case (enforced in some forms, refused by name in others)
_OTHER_VALIDATION = frozenset({"not", "multipleOf", "patternProperties", "propertyNames", "minProperties",
                               "maxProperties", "dependentRequired", "dependencies"})
# Keywords whose values are subschemas: one schema, a list of them, a map of them
# (``items`` is either one or, before 2020-12, a list)
SUBSCHEMA_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
                 "unevaluatedProperties", "unevaluatedItems", "contentSchema")
SUBSCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
WHY_NOT = {
    "uniqueItems": "a regex cannot keep array items distinct (allowed in the regex when the items are an enum "
                   "or const of scalars, booleans or null, or with maxItems <= 1; over strings and numbers the "
                   "engine keeps them beside the grammar)",
    "multipleOf": "it is enforced as a positive number beside 'type' 'integer' or 'number' (a schema without a "
                  "type admits numbers of every kind)",
    "not": "negated schemas cannot be enforced",
    "if": "conditional schemas cannot be enforced (supported: 'if' on one property with a 'const', an 'enum' or a "
          "condition of this form, or with other values when the schema beside it lists the property's values)",
    "dependentRequired": "dependencies between properties cannot be enforced",
    "dependentSchemas": "dependencies between properties cannot be enforced",
    "dependencies": "dependencies between properties cannot be enforced",
    "contains": "'contains' cannot be enforced (allowed: with 'items' a schema, at most 'minItems': 1, no "
                "'maxItems', 'uniqueItems' or 'maxContains', 'minContains' 1)",
    "minContains": "'minContains' other than 1 cannot be enforced",
    "maxContains": "'maxContains' cannot be enforced",
    "unevaluatedProperties": "which properties are evaluated here depends on which branch validates (beside "
                             "'if', 'dependentSchemas' or dynamic references); allowed beside 'properties', "
                             "'allOf', local '$ref's and one 'anyOf'/'oneOf'",
    "unevaluatedItems": "which items are evaluated here depends on its applicators; allowed beside "
                        "'prefixItems' or 'items' alone (draft 2020-12)",
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
_UT_LITERAL = r"[A-Za-z0-9._~:/?#@!$&()*+,;=-]"  # RFC 6570 literals (a subset)
# a prefix below 1000: the format checker (uri_template) refuses 1000 and more
_UT_VAR = r"[A-Za-z0-9_]{1,16}(?::[1-9][0-9]{0,2}|\*)?"
_JSON_POINTER = r"(?:/(?:[^/~\"\\\x00-\x1f]|~[01]){0,24}){0,8}"  # RFC 6901
FORMATS.update({
    "uri-template": r"(?:" + _UT_LITERAL + r"|\{[+#./;?&]?" + _UT_VAR + r"(?:," + _UT_VAR + r"){0,3}\}){0,40}",
    "json-pointer": _JSON_POINTER,
    # no digit after a 0: jsonschema's checker refuses "100#" (it reads a 0 before a digit as a leading zero)
    "relative-json-pointer": r"(?:0|[1-9]{1,8}0?)(?:#|" + _JSON_POINTER + ")",
    "regex": r"[A-Za-z0-9 _-]{0,40}",  # literal text: a valid regex in every dialect
    # every URI, e-mail address and ASCII host name is also an IRI / IDN one (host labels
    # without hyphens, so none reads as punycode)
    "iri": FORMATS["uri"], "iri-reference": FORMATS["uri-reference"], "idn-email": FORMATS["email"],
    "idn-hostname": r"[A-Za-z0-9]{1,40}(?:\.[A-Za-z0-9]{1,40}){0,5}",
    # draft 3's names
    "ip-address": FORMATS["ipv4"], "host-name": FORMATS["hostname"], "utc-millisec": r"(?:0|[1-9][0-9]{0,12})",
    # OpenAPI's base64 ("byte")
    "byte": r"(?:[A-Za-z0-9+/]{4}){0,16}(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?",
})
# format values some draft defines: those outside FORMATS are refused by name; any
# other value (OpenAPI's "int64", "password", vendors') is an annotation
STANDARD_FORMATS = frozenset(FORMATS) | {"color", "style", "phone"}
ANY_DEPTH = 2  # nesting of a free-form value ({} or true): objects/arrays this deep
# Limits checked before and during translation, so a hostile schema costs little:
MAX_SCHEMA_CHARS = 1 << 20  # the schema's JSON text
MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects/arrays in the schema document
MAX_SCHEMA_EXPANSION = 20_000  # subschemas translated, each $ref use counted again
MAX_REF_DEPTH = 64  # $refs being expanded inside each other
RECURSION_UNROLL = 2  # a recursive $ref is expanded this many times inside itself, then ended
MAX_REGEX_CHARS = 1 << 20  # the translated regex
MAX_TRANSLATE_S = 5.0  # wall time of one translation (checked at every subschema)
OPEN_BOUND_LIMIT = 10**9  # exclusive number bounds: |bound| below this ...
OPEN_BOUND_FRACTION = 6  # ... and at most this many fraction digits (float-safe near the bound)
MAX_MULTIPLE_FORMS = 1000  # multipleOf: multiples listed between bounds, or endings of the last digits
MAX_COUNTED_OPTIONAL = 8  # optional properties under minProperties/maxProperties (2**8 branches)
MAX_UNIQUE_VALUES = 64  # uniqueItems: values of the items' enum
JSON_WHITESPACE = r"[ \t\n\r]*"


class SchemaError(ValueError):
    """A schema plait cannot (or will not) enforce; the message names the keyword."""


def parse_schema_text(text: str) -> dict[str, Any] | bool:
    """A schema's JSON text, parsed (its length checked first): a JSON object or a
    boolean (``true``/``false`` are schemas). Raises ``SchemaError`` saying what else
    the text holds."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise SchemaError(f"json_schema has {len(text)} characters; allowed: at most {MAX_SCHEMA_CHARS}")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise SchemaError(f"json_schema is not valid JSON: {str(e)[:200]}") from None
    return _schema_shape(value)


def load_schema(schema: Any) -> dict[str, Any] | bool:
    """The schema a user gave (a dict, a bool, or its JSON text: parsed here, the one
    time it is) as a JSON object or ``True``. Raises ``SchemaError`` naming json_schema:
    for anything else (a JSON string holding a schema's text too: encoded twice), and
    for ``false``, which no output can satisfy."""
    value = parse_schema_text(schema) if isinstance(schema, str) else _schema_shape(schema)
    if value is False:
        raise SchemaError("json_schema at # is false: no value can satisfy it, so no output would be valid; "
                          "allowed: an object schema, or true for any JSON value")
    return canonical_dialect(value)


def canonical_dialect(value: Any) -> Any:
    """``value`` with its ``$schema`` as ``jsonschema`` names that draft (:func:`_DIALECTS`)."""
    if isinstance(value, dict) and isinstance(value.get("$schema"), str):
        canonical = _DIALECTS().get(_dialect_key(value["$schema"]))
        if canonical is not None and canonical != value["$schema"]:
            value = {**value, "$schema": canonical}
    return value


def boolean_bounds(root: Any) -> bool:
    """Whether any subschema has a boolean ``exclusiveMinimum`` / ``exclusiveMaximum``
    (draft 4's form; OpenAPI 3.0 writes it)."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("exclusiveMinimum"), bool) or isinstance(node.get("exclusiveMaximum"), bool):
                return True
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS and isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _dialect_key(uri: str) -> str:
    return uri.strip().lower().removeprefix("https://").removeprefix("http://").rstrip("#").rstrip("/")


@functools.cache
def _DIALECTS() -> dict[str, str]:  # noqa: N802
    """The metaschema URIs ``jsonschema`` knows, by :func:`_dialect_key`: a document's
    ``$schema`` written with the other scheme (``https://json-schema.org/draft-04/schema#``,
    common in the wild) or without the trailing ``#`` is read as the draft it names (it
    was read as an unknown dialect: 2020-12, with the URI left for a registry to fetch)."""
    import jsonschema

    out = {}
    for cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator, jsonschema.Draft6Validator,
                jsonschema.Draft7Validator, jsonschema.Draft201909Validator, jsonschema.Draft202012Validator):
        uri = cls.ID_OF(cls.META_SCHEMA)
        if uri:
            out[_dialect_key(uri)] = uri
    return out


def _schema_shape(value: Any) -> dict[str, Any] | bool:
    """``value`` if it can be a schema (an object or a boolean); else ``SchemaError``
    saying what it is."""
    if isinstance(value, (dict, bool)):
        return value
    kinds = {str: "a JSON string", list: "a JSON array", tuple: "a JSON array", int: "a JSON number",
             float: "a JSON number", type(None): "null"}
    found = kinds.get(type(value), f"a {type(value).__name__}")
    hint = ""
    if isinstance(value, str):  # a hint only: the string is never taken as the schema
        try:
            inner = json.loads(value)
        except (ValueError, RecursionError):
            inner = None
        if isinstance(inner, (dict, bool)):
            hint = " (it holds a schema's JSON text: the schema was JSON-encoded twice; send it encoded once)"
    raise SchemaError(f"json_schema is {found}, not a schema{hint}; allowed: a JSON object (a schema) or true/false")


def schema_to_regex(schema: Any, whitespace: str | None = None) -> str:
    """The regex of the JSON texts that ``schema`` (a dict, bool or JSON text, as
    :func:`load_schema` takes it) admits, in plait's layout. Raises ``SchemaError``
    naming what is unsupported."""
    schema = load_schema(schema)
    check_schema_size(schema)
    schema = fold_unevaluated(fold_vacuous(rooted_refs(schema)))
    nested = nested_resource_ref(schema)
    if nested is not None:
        raise SchemaError(f"json_schema '$ref' at {nested[0]} is not supported: it is inside a subschema with its own "
                          f"'$id' ({nested[1]!r}), against which it resolves; allowed: references in the root's scope")
    ws = ""
    if whitespace is not None:
        ws = "(?:" + check_whitespace(whitespace) + ")"
    try:
        out = _Translator(schema, ws).value(schema, "#")
    except _Cutoff as e:
        raise SchemaError(str(e)) from None
    except RecursionError:  # a guard: the limits above keep translation shallow
        raise SchemaError(f"json_schema is nested too deeply to translate (its subschemas, or its $refs expanded "
                          f"inside each other); allowed: at most {MAX_SCHEMA_DEPTH} levels") from None
    if len(out) > MAX_REGEX_CHARS:
        raise SchemaError(
            f"json_schema translates to a regex of {len(out)} characters; allowed: at most {MAX_REGEX_CHARS} "
            f"(fewer optional properties, enums or alternatives)"
        )
    return out


def check_schema_size(schema: Any) -> None:
    """Nesting depth and size of the schema document, walked without recursion; and no
    NaN or Infinity in it (Python's JSON parser reads them, but they are not JSON: an
    ``enum`` holding one wrote ``NaN`` as an output, a bound holding one failed inside
    the llguidance translation)."""
    stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    nodes = 0
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"json_schema is nested more than {MAX_SCHEMA_DEPTH} levels deep; allowed: at most "
                              f"{MAX_SCHEMA_DEPTH}")
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            nodes += 1
            if nodes > MAX_SCHEMA_CHARS // 4:
                raise SchemaError(f"json_schema has more than {MAX_SCHEMA_CHARS // 4} values; it is too large")
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, f"{path}/{_pointer_part(key)}"))
            elif isinstance(child, float) and not math.isfinite(child):
                raise SchemaError(f"json_schema holds {child} at {path}/{_pointer_part(key)}; allowed: JSON numbers (NaN and "
                                  "Infinity are not JSON; a number literal past a double's range reads as Infinity)")
            elif isinstance(child, int) and not isinstance(child, bool) and abs(child) > sys.float_info.max:
                # an integer literal is read exactly, and the translators compare it with
                # floats: a bound of 400 digits was an OverflowError inside them (a 400
                # blaming the backend, with a traceback in the log). Its size in powers of
                # ten: str() of an integer past 4300 digits raises.
                raise SchemaError(f"json_schema holds an integer of about 10**{round(math.log10(abs(child)))} "
                                  f"at {path}/{_pointer_part(key)}, past a 64-bit float's range (what JSON Schema "
                                  f"numbers are read as); allowed: numbers of magnitude at most "
                                  f"{sys.float_info.max:.4g}")


def _pointer_part(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def check_whitespace(pattern: Any) -> str:
    """A whitespace pattern must match only JSON whitespace (spaces, tabs, newlines)."""
    import interegular

    from plait.runtime.constrained.fsm_limits import FsmTooLarge, fsm_deadline

    pattern = check_regex(pattern, "whitespace_pattern")
    try:
        with fsm_deadline():  # (a|b)*a(a|b){15}-like patterns have exponential automata
            ok = interegular.parse_pattern(pattern).to_fsm().issubset(
                interegular.parse_pattern(JSON_WHITESPACE).to_fsm())
    except FsmTooLarge as e:
        raise ValueError(f"whitespace_pattern={pattern!r} is too complex to check ({e}); allowed: a simple regex "
                         "matching only spaces, tabs and newlines, e.g. '[ ]?'") from None
    except Exception:
        ok = False
    if not ok:
        raise ValueError(
            f"whitespace_pattern={pattern!r} is invalid; allowed: a regex matching only spaces, tabs and newlines, e.g. '[ ]?'"
        )
    return pattern


def ref_siblings_ignored(root: Any) -> bool:
    """Drafts 3 to 7 (as ``jsonschema`` picks the draft from ``$schema``) ignore the
    keywords beside a ``$ref``; later drafts apply them too."""
    import jsonschema

    if not isinstance(root, dict):
        return False
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    return cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator, jsonschema.Draft6Validator,
                   jsonschema.Draft7Validator)


NOWHERE = object()  # what a JSON pointer into no place gives (pointer_target)


def pointer_target(root: Any, parts: list[str]) -> Any:
    """The value at the JSON-pointer ``parts`` (from :func:`local_pointer`) in ``root``,
    or :data:`NOWHERE`."""
    node: Any = root
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return NOWHERE
    return node


def local_pointer(root: Any, ref: Any) -> list[str] | None:
    """The JSON-pointer parts of ``ref`` (a ``$ref`` value) when it names a place in the
    document ``root``: a fragment (``#/definitions/a``), or a reference that resolves
    (RFC 3986) against the root's ``$id`` (draft-4 ``id``) to the root's own URI
    (``schema.json#/definitions/a`` in ``https://example.com/schema.json``). The fragment
    is percent-decoded, then ``~1`` and ``~0`` read (RFC 6901). None for another
    document or a plain-name fragment (``#anchor``)."""
    from urllib.parse import unquote, urldefrag, urljoin

    if not isinstance(ref, str):
        return None
    if not ref.startswith("#"):
        base = root.get("$id", root.get("id")) if isinstance(root, dict) else None
        if not isinstance(base, str) or not base:
            return None
        doc, _ = urldefrag(base)
        target, _ = urldefrag(urljoin(doc, ref))
        if target != doc:
            return None
    frag = unquote(ref.split("#", 1)[1] if "#" in ref else "")  # decoded first: '%2F' is a separator
    if frag and not frag.startswith("/"):
        return None
    return [p.replace("~1", "/").replace("~0", "~") for p in frag.split("/")[1:]]


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})  # values, not subschemas


def nested_resource_ref(root: Any) -> tuple[str, str] | None:
    """(the location of a ``$ref``, the ``$id``) when a ``$ref`` lies inside a subschema
    whose own ``$id`` (draft 3/4: ``id``, as ``jsonschema`` reads the draft) gives it
    another base URI than the root's: references there resolve against that URI
    (``#/$defs/a`` names that subschema's ``$defs``), not against the root, which is how
    :func:`local_pointer` reads them. None when there is no such ``$ref``."""
    import jsonschema
    from urllib.parse import urldefrag, urljoin

    if not isinstance(root, dict):
        return None
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    key = "id" if cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator) else "$id"
    top = root.get(key) if isinstance(root.get(key), str) else ""
    top = urldefrag(top)[0]
    stack: list[tuple[Any, str, str, str | None]] = [(root, "#", top, None)]  # (node, location, base, nested $id)
    while stack:
        node, where, base, nested = stack.pop()
        if isinstance(node, list):
            stack.extend((x, f"{where}/{i}", base, nested) for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        own = node.get(key)
        if node is not root and isinstance(own, str) and not own.startswith("#"):
            new = urldefrag(urljoin(base, own))[0]
            if new != base:
                base, nested = new, own if new != top else None
        if nested is not None and isinstance(node.get("$ref"), str):
            return where, nested
        stack.extend((v, f"{where}/{k}", base, nested) for k, v in node.items()
                     if k not in _DATA_KEYWORDS and isinstance(v, (dict, list)))
    return None


def rooted_refs(root: Any) -> Any:
    """``root`` (a parsed document, size already checked) with each ``$ref`` that is not
    already a JSON pointer read against the root's own base URI written as one
    (``#/...``): references resolved as ``jsonschema`` resolves them (its ``referencing``
    library, nothing fetched), against the base URI a nested ``$id`` (draft 3/4: ``id``)
    gives the subschemas under it, or naming a plain-name fragment (``$anchor``, a draft
    6/7 ``$id: "#name"``). The nested ``$id``s are dropped then: each reference now
    names its place from the root, as :func:`local_pointer` and the translators read it
    (and ``jsonschema`` reads the copy so too). A reference that does not resolve is
    written resolved against its base URI (the translators then refuse it by name).
    ``root`` itself (not a copy) when nothing needs this."""
    import jsonschema

    if not isinstance(root, dict):
        return root

    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    key = "id" if cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator) else "$id"
    try:
        return _rooted(root, cls, key) if _needs_rooting(root, key) else root
    except SchemaError:
        raise
    except ValueError as e:  # urljoin's: an '$id' or '$ref' that is no URI reference ('http://[bad')
        raise SchemaError(f"json_schema's '{key}' and '$ref' values cannot be read as URIs ({e}); allowed: URI "
                          "references") from None


def _rooted(root: dict[str, Any], cls: Any, key: str) -> dict[str, Any]:
    """:func:`rooted_refs`' copy of ``root`` (``cls``: its draft's validator; ``key``: its
    draft's ``$id``)."""
    import copy
    from urllib.parse import quote, urljoin

    import referencing
    import referencing.exceptions
    import referencing.jsonschema

    spec = referencing.jsonschema.specification_with(cls.ID_OF(cls.META_SCHEMA) or "urn:unknown-dialect",
                                                     default=referencing.Specification.OPAQUE)
    out = copy.deepcopy(root)
    resource = spec.create_resource(out)
    base = resource.id() or ""
    try:
        registry = referencing.Registry().with_resource(base, resource).crawl()
    except Exception as e:  # noqa: BLE001  (an $id that is not a URI reference, or the like)
        raise SchemaError(f"json_schema's '$id's cannot be read ({type(e).__name__}: {str(e)[:120]}); allowed: "
                          "URI references") from None
    places: dict[int, str] = {}  # id(node) -> its JSON pointer from the root ('' for the root)
    refs: list[tuple[dict[str, Any], str, str]] = []  # (node holding a $ref, its location, its base URI)
    stack: list[tuple[Any, str, str]] = [(out, "", base)]
    while stack:
        node, where, uri = stack.pop()
        places.setdefault(id(node), where)
        if isinstance(node, list):
            stack.extend((x, f"{where}/{i}", uri) for i, x in enumerate(node) if isinstance(x, (dict, list)))
            continue
        if node is not out and isinstance(node.get(key), str):
            own = spec.create_resource(node).id()  # None beside a draft-7 $ref, or a '#name' anchor
            if own is not None:
                uri = urljoin(uri, own)
        if isinstance(node.get("$ref"), str):
            refs.append((node, where, uri))
        stack.extend((v, f"{where}/{_pointer_part(k)}", uri) for k, v in node.items()
                     if k not in _DATA_KEYWORDS and isinstance(v, (dict, list)))
    for node, where, uri in refs:
        ref = node["$ref"]
        if uri == base and (ref == "#" or ref.startswith("#/")):
            continue  # already read from the root
        try:
            target = registry.resolver(base_uri=uri).lookup(ref).contents
        except referencing.exceptions.Unresolvable:
            target = None
        place = places.get(id(target)) if isinstance(target, (dict, list)) else None
        node["$ref"] = urljoin(uri, ref) if place is None else "#" + quote(place, safe="/~!$&'()*+,;=:@-._")
    stack = [out]
    while stack:  # every reference is read from the root now: no subschema changes the base URI
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(x for x in node if isinstance(x, (dict, list)))
            continue
        if node is not out and isinstance(node.get(key), str) and not node[key].startswith("#"):
            del node[key]
        stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS and isinstance(v, (dict, list)))
    return out


def _needs_rooting(root: dict[str, Any], key: str) -> bool:
    """Whether a ``$ref`` in ``root`` is not a JSON pointer from the root (another
    document, a plain-name fragment) or lies under a nested ``$id``: what
    :func:`rooted_refs` rewrites."""
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, nested = stack.pop()
        if isinstance(node, list):
            stack.extend((x, nested) for x in node if isinstance(x, (dict, list)))
            continue
        own = node.get(key)
        nested = nested or (node is not root and isinstance(own, str) and not own.startswith("#"))
        ref = node.get("$ref")
        if isinstance(ref, str) and (nested or local_pointer(root, ref) is None):
            return True
        stack.extend((v, nested) for k, v in node.items() if k not in _DATA_KEYWORDS and isinstance(v, (dict, list)))
    return False


# keywords whose annotations depend on which branch validates (or on the instance):
# beside them, which properties/items are "evaluated" is not fixed, so unevaluated* stays
_UNEVALUATED_BLOCKERS = ("anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "dependencies", "$dynamicRef",
                         "$recursiveRef", "$dynamicAnchor", "$recursiveAnchor")


def fold_unevaluated(root: Any) -> Any:
    """A copy of ``root`` (a parsed document, size already checked) in which each
    ``unevaluatedProperties`` / ``unevaluatedItems`` whose reach is fixed is written with
    the keywords every backend reads; others are left (and refused by name).

    - ``unevaluatedProperties: U`` where the properties evaluated do not depend on which
      branch validates (no ``anyOf``/``oneOf``/``if``/``dependentSchemas``/dynamic refs
      beside it, nor in the ``allOf`` branches and local ``$ref`` targets it reaches):
      every one of those must validate for the object to, so the evaluated names are the
      union of their ``properties``/``patternProperties``. Written as those names (``true``
      where only a branch lists them) and ``additionalProperties: U``; dropped when one of
      them has ``additionalProperties`` or ``unevaluatedProperties`` (all evaluated).
      Exact in 2019-09/2020-12; earlier drafts ignore the keyword, and this admits less.
      Beside one ``anyOf``/``oneOf`` of such branches: some branch validates and the
      names it and the rest list are the evaluated ones (:func:`fold_branches`; a subset).
    - ``unevaluatedItems: V`` (2020-12 only) with no applicator or ``contains`` beside it:
      ``items: V`` after ``prefixItems``; dropped beside ``items`` (all evaluated)."""
    import jsonschema

    if not isinstance(root, dict):
        return root
    draft2020 = jsonschema.validators.validator_for(
        root, default=jsonschema.Draft202012Validator) is jsonschema.Draft202012Validator

    budget = [MAX_SCHEMA_EXPANSION]  # subschemas visited, over every fold: $refs reached twice count twice

    def evaluated(s: Any, seen: tuple[int, ...]) -> tuple[set[str], set[str], bool] | None:
        """(names, patterns, all) the subschema ``s`` evaluates when it validates; None
        if that depends on more than the instance's names (or the budget is spent)."""
        budget[0] -= 1
        if budget[0] < 0:
            return None
        if isinstance(s, bool):
            return set(), set(), s is False  # false: nothing validates, so any rewrite is exact
        if not isinstance(s, dict) or any(k in s for k in _UNEVALUATED_BLOCKERS):
            return None
        names = set(s["properties"]) if isinstance(s.get("properties"), dict) else set()
        pats = set(s["patternProperties"]) if isinstance(s.get("patternProperties"), dict) else set()
        every = "additionalProperties" in s or "unevaluatedProperties" in s
        parts = list(s["allOf"]) if isinstance(s.get("allOf"), list) else [] if "allOf" not in s else None
        if parts is None:
            return None
        if "$ref" in s:
            parts_ref = local_pointer(root, s["$ref"])
            target = NOWHERE if parts_ref is None else pointer_target(root, parts_ref)
            if target is NOWHERE or id(target) in seen:
                return None
            parts.append(target)
            seen = (*seen, id(target))
        for p in parts:
            r = evaluated(p, seen)
            if r is None:
                return None
            names |= r[0]
            pats |= r[1]
            every = every or r[2]
        return names, pats, every

    def closed(rest: dict[str, Any], names: set[str], pats: set[str], extra: Any) -> dict[str, Any]:
        """``rest`` listing ``names`` and ``pats`` too (as ``true``), others ``extra``."""
        own = rest.get("properties") if isinstance(rest.get("properties"), dict) else {}
        own_pats = rest.get("patternProperties") if isinstance(rest.get("patternProperties"), dict) else {}
        out = dict(rest)
        if names - set(own):
            out["properties"] = {**own, **{n: True for n in sorted(names - set(own))}}
        if pats - set(own_pats):
            out["patternProperties"] = {**own_pats, **{p: True for p in sorted(pats - set(own_pats))}}
        out["additionalProperties"] = extra
        return out

    def fold_branches(rest: dict[str, Any], extra: Any) -> dict[str, Any] | None:
        """``unevaluatedProperties`` beside one ``anyOf`` or ``oneOf`` (a tagged union):
        some branch that validates, with the names the rest evaluates and its own, and
        ``extra`` for the others. A subset (an object two ``anyOf`` branches cover
        between them is left out); None if the rest or a branch is not fixed."""
        keys = [k for k in ("anyOf", "oneOf") if k in rest]
        if len(keys) != 1 or not isinstance(rest[keys[0]], list) or not rest[keys[0]]:
            return None
        key, branches = keys[0], rest[keys[0]]
        core = evaluated({k: v for k, v in rest.items() if k != key}, ())
        if core is None:
            return None
        cases = []
        for b in branches:
            r = evaluated(b, ())
            if r is None:
                return None
            if core[2] or r[2]:  # this branch (or the rest) evaluates every name
                cases.append(b)
                continue
            cases.append(closed({"allOf": [b]}, core[0] | r[0], core[1] | r[1], extra))
        if key == "anyOf":  # each case implies its branch: the anyOf of the cases
            return {**rest, "anyOf": cases}
        # oneOf: exactly one branch as before, and one of the cases (the branch that validates)
        return {**rest, "allOf": [*rest.get("allOf", []), {"anyOf": cases}]} if isinstance(
            rest.get("allOf", []), list) else None

    def fold(s: dict[str, Any]) -> dict[str, Any]:
        if "unevaluatedProperties" in s:
            rest = {k: v for k, v in s.items() if k != "unevaluatedProperties"}
            r = evaluated(rest, (id(s),))
            if r is not None:
                names, pats, every = r
                s = rest if every else closed(rest, names, pats, s["unevaluatedProperties"])
            else:
                s = fold_branches(rest, s["unevaluatedProperties"]) or s
        if "unevaluatedItems" in s and draft2020 and not any(
                k in s for k in (*_UNEVALUATED_BLOCKERS, "allOf", "$ref", "contains")):
            rest = {k: v for k, v in s.items() if k != "unevaluatedItems"}
            if "items" not in rest:
                rest["items"] = s["unevaluatedItems"]
            if not isinstance(rest["items"], list):  # (a list is draft-2019 'items': left as it was)
                s = rest
        return s

    def walk(s: Any, depth: int) -> Any:
        if not isinstance(s, dict) or depth > MAX_SCHEMA_DEPTH:
            return s
        out = dict(s)
        for k, v in s.items():
            if k in SUBSCHEMA_MAP and isinstance(v, dict):
                out[k] = {n: walk(x, depth + 1) for n, x in v.items()}
            elif (k in SUBSCHEMA_LIST or k == "items") and isinstance(v, list):
                out[k] = [walk(x, depth + 1) for x in v]
            elif (k in SUBSCHEMA_ONE or k == "items") and isinstance(v, dict):
                out[k] = walk(v, depth + 1)
        return fold(out) if "unevaluatedProperties" in out or "unevaluatedItems" in out else out

    if "unevaluated" not in json.dumps(root):
        return root
    return walk(root, 0)


def fold_vacuous(root: Any) -> Any:
    """A copy of ``root`` (a parsed document) with three idioms read as ``jsonschema``
    reads them, for every backend (both translations start here):

    - ``not`` of a schema every value satisfies (``{}``, ``true``, or annotations only:
      zod-to-json-schema's ``z.never()`` / ``z.undefined()`` / ``z.nan()``) makes its
      subschema ``false`` (a property never written, an ``anyOf`` branch left out);
      ``not: false`` constrains nothing and is dropped;
    - ``if`` without ``then`` and ``else`` (and ``then`` / ``else`` without ``if``)
      constrains nothing and is dropped (it was refused as an ``if`` form);
    - a boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` is draft 3/4's form. A
      document whose ``$schema`` names a later draft is read by ``jsonschema`` as
      comparing the value with the boolean as a number (``exclusiveMinimum: true`` is
      ``> 1``): refused with a ``SchemaError`` naming it, where both backends read it as
      draft 4 and admitted values ``jsonschema`` rejects. Without ``$schema`` (OpenAPI
      3.0's form, common in tool parameters) it keeps draft 4's meaning: no later
      draft's metaschema admits a boolean there, so that is the one reading under which
      the document is a schema at all.

    In drafts 3 to 7 the keywords beside a ``$ref`` do nothing and are left alone."""
    import jsonschema

    if not isinstance(root, dict):
        return root
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    draft4 = cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator)
    declared = "$schema" in root  # (without one, a boolean bound is read as draft 4's: see above)
    draft = "draft " + cls.__name__.removeprefix("Draft").removesuffix("Validator")
    draft = {"draft 201909": "draft 2019-09", "draft 202012": "draft 2020-12"}.get(draft, draft)
    ref_alone = ref_siblings_ignored(root)

    def vacuous(sub: Any) -> bool:  # every value satisfies it
        return sub is True or isinstance(sub, dict) and not any(_validates(k) for k in sub)

    # what local references point at or into: a keyword-named member one does is a
    # definition, not a keyword to fold away (buildkite's '#/definitions/common/if')
    pointed = {ref[:i] for ref in _local_refs(root) for i in range(2, len(ref) + 1) if i == len(ref) or ref[i] == "/"}

    def fold(s: dict[str, Any], path: str) -> Any:
        if ref_alone and "$ref" in s:
            return s
        for k in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(s.get(k), bool) and not draft4 and declared:
                bound = "minimum" if k == "exclusiveMinimum" else "maximum"
                raise SchemaError(
                    f"json_schema {k!r} at {path} is {str(s[k]).lower()}: a boolean is draft 4's form (beside "
                    f"{bound!r}), but this document's '$schema' is {draft}, where {k!r} is the bound itself and jsonschema compares "
                    f"with the boolean as {int(s[k])}; allowed: a number ({k!r}: <the {bound}>), or '$schema': "
                    "'http://json-schema.org/draft-04/schema#' for the draft-4 reading")
        if any(f"{path}/{k}" in pointed for k in ("not", "if", "then", "else")):
            return s
        if "not" in s and vacuous(s["not"]):
            return False
        if s.get("not") is False:
            s = {k: v for k, v in s.items() if k != "not"}
        if "if" in s and "then" not in s and "else" not in s or "if" not in s and ("then" in s or "else" in s):
            s = {k: v for k, v in s.items() if k not in ("if", "then", "else")}
        return s

    def walk(s: Any, path: str, depth: int) -> Any:
        if not isinstance(s, dict) or depth > MAX_SCHEMA_DEPTH:
            return s
        out = dict(s)
        for k, v in s.items():
            if (k in SUBSCHEMA_MAP or k == "dependencies") and isinstance(v, dict):
                out[k] = {n: walk(x, f"{path}/{k}/{_pointer_part(n)}", depth + 1) for n, x in v.items()}
            elif (k in SUBSCHEMA_LIST or k == "items") and isinstance(v, list):
                out[k] = [walk(x, f"{path}/{k}/{i}", depth + 1) for i, x in enumerate(v)]
            elif (k in SUBSCHEMA_ONE or k == "items") and isinstance(v, dict):
                out[k] = walk(v, f"{path}/{k}", depth + 1)
        return fold(out, path)

    return walk(root, "#", 0)


def _local_refs(root: Any) -> list[str]:
    """Every ``$ref`` of ``root`` that is a local JSON pointer (``#/...``), as written
    (percent-decoded)."""
    from urllib.parse import unquote

    refs, stack, seen = [], [root], 0
    while stack and seen < 1_000_000:
        node = stack.pop()
        seen += 1
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                refs.append(unquote(ref))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return refs


def plain_schema(schema: Any) -> Any:
    """A copy of ``schema`` (a parsed document) for a backend without ``oneOf`` it
    cannot prove exclusive, ``not``, ``if`` or ``dependentRequired`` (llguidance): each
    of these that plait reads is written with ``anyOf``, ``allOf``, ``required``,
    ``type`` and ``properties: {name: false}``, which every backend reads:

    - ``oneOf``: the ``anyOf`` of the branches as :meth:`_Translator.exclusive` narrows
      them (values two branches admit dropped from both; objects written without a name
      or with one of several names, as below), an equivalent constraint for those;
    - ``not: {required: [...]}`` (and an ``anyOf`` of those): an object lacks one name of
      each set, ``anyOf: [{properties: {a: false}}, ...]`` (exact: ``properties`` does
      not constrain other values); ``not: {type: ...}`` folded into ``type``;
    - ``if``/``then``/``else``: the ``anyOf`` of :meth:`_Translator.conditional`'s cases;
    - ``dependentRequired`` / ``dependencies`` with name lists: for each name, ``anyOf``
      the object lacks it or has the names it needs.

    Anything the translator cannot read, or a narrowing only plait's regex can write
    (a number with a fractional part), leaves that keyword as it is (the backend then
    refuses it by name)."""
    if not isinstance(schema, dict) or nested_resource_ref(schema) is not None:
        return schema  # the rewrites read $refs against the root (llguidance itself follows nested $ids)
    t = _Translator(schema, "", mark_refs=False)  # llguidance's grammar recurses itself
    seen = [0]

    def kept(s: dict[str, Any]) -> dict[str, Any]:  # what a rewritten schema keeps beside its cases
        return {k: v for k, v in s.items() if k in ANNOTATIONS or k in ("$defs", "definitions")}

    def walk(s: Any, depth: int) -> Any:
        seen[0] += 1
        if not isinstance(s, dict) or depth > MAX_SCHEMA_DEPTH or seen[0] > MAX_SCHEMA_EXPANSION:
            return s
        out = {k: walk_value(k, v, depth) for k, v in s.items()}
        for step in (_plain_not, _plain_dependencies, _plain_if, _plain_one_of):
            try:
                new = step(t, out)
                if step in (_plain_not, _plain_if, _plain_one_of) and new is not None:
                    # their cases hold new subschemas ('not: {enum}' of failing, merged $ref targets)
                    new = walk(new, depth + 1)
            except (SchemaError, RecursionError):
                continue
            if new is not None and "\\u0000" not in json.dumps(new):  # no internal mark left
                out = {**kept(out), **new} if new is not out else out
        return out

    def walk_value(k: str, v: Any, depth: int) -> Any:
        if k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                 "dependencies") and isinstance(v, dict):
            return {n: walk(x, depth + 1) for n, x in v.items()}
        if k in ("allOf", "anyOf", "oneOf", "prefixItems", "items") and isinstance(v, list):
            return [walk(x, depth + 1) for x in v]
        if k in ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not",
                 "then", "else") and isinstance(v, dict):
            return walk(v, depth + 1)
        return v  # 'if' is read as written (_plain_if's cases, walked after, hold what it had)

    return walk(schema, 0)


def _public(s: Any) -> Any:
    """``s`` with plait's object marks (``_FORBID``, ``_NEED_ONE_OF``) written as JSON
    Schema (:func:`_with_cases`): for each name set, the object lacks one of the names;
    for each name list, it has one."""
    if not isinstance(s, dict) or (_FORBID not in s and _NEED_ONE_OF not in s):
        return s
    groups = [[(frozenset({n}), frozenset()) for n in names] for names in s.get(_FORBID, [])]
    groups += [[(frozenset(), frozenset({n})) for n in names] for names in s.get(_NEED_ONE_OF, [])]
    return _with_cases({k: v for k, v in s.items() if k not in (_FORBID, _NEED_ONE_OF)}, groups)


def _with_cases(s: dict[str, Any], groups: list[list[tuple[frozenset[str], frozenset[str]]]]) -> dict[str, Any]:
    """``s`` and, for each group, one of its alternatives (names the object lacks, names
    it has): the cases of the product as one ``anyOf`` of ``{properties: {name: false},
    required: [...]}`` (with ``additionalProperties: true``: a case adds no other
    constraint; neither keyword constrains values other than objects), cases that
    cannot hold left out. Beside an ``anyOf`` of its own, the cases go into ``allOf``."""
    own = s.get("required")
    base = frozenset(own) if isinstance(own, list) and all(isinstance(n, str) for n in own) else frozenset()
    cases: list[tuple[frozenset[str], frozenset[str]]] = [(frozenset(), base)]  # (lacks, has)
    for group in groups:
        cases = list(dict.fromkeys((a | ga, r | gr) for a, r in cases for ga, gr in group if not (a | ga) & (r | gr)))
        if len(cases) > MAX_ANY_OF_PRODUCT:
            raise SchemaError(f"json_schema: more than {MAX_ANY_OF_PRODUCT} cases of required/forbidden names")
    if not cases:
        raise _NoValue("json_schema: no object has the names it needs without those it must lack")
    written = [{**({"properties": {n: False for n in sorted(a)}, "additionalProperties": True} if a else {}),
                **({"required": sorted(r - base)} if r - base else {})} for a, r in cases]
    if written == [{}]:
        return s
    if "anyOf" in s:
        return {**s, "allOf": [*s.get("allOf", []), {"anyOf": written}]}
    return {**s, "anyOf": written}


def _plain_one_of(t: _Translator, s: dict[str, Any]) -> dict[str, Any] | None:
    branches = s.get("oneOf")
    if not isinstance(branches, list) or not branches:
        return None
    rest = {k: v for k, v in s.items() if k != "oneOf"}
    merged = []
    for sub in branches:
        try:
            merged.append(t.merge([sub, rest], "#") if set(rest) - ANNOTATIONS else sub)
        except _NoValue:
            continue
    narrowed = t.exclusive(merged, "#") if merged else []
    return {"anyOf": [_public(b) for b in narrowed]} if narrowed else None


def _plain_not(t: _Translator, s: dict[str, Any]) -> dict[str, Any] | None:
    if "not" not in s:
        return None
    if _not_required(s["not"]) is not None:
        return _public(_lift_not(s))
    sub = t.deref(s["not"], "#")
    failing = t.negation(sub, "#")
    if failing is not None:
        rest = {k: v for k, v in s.items() if k != "not"}
        written = {"anyOf": [_public(x) for x in failing]}
        return {**rest, "allOf": [*rest.get("allOf", []), written]} if "anyOf" in rest else {**rest, **written}
    words = _not_values(sub)
    if words and all(isinstance(w, (str, bool)) or w is None for w in words):
        # any value but those strings, booleans or null: another type, a string none of
        # them, the other boolean
        rest = {k: v for k, v in s.items() if k != "not"}
        strings = [w for w in words if isinstance(w, str)]
        hit = {"string"} if strings else set()
        hit |= {"null"} if None in words else set()
        hit |= {"boolean"} if any(isinstance(w, bool) for w in words) else set()
        cases: list[Any] = [{"type": [x for x in TYPE_KEYWORDS if x not in hit and x != "integer"]}]
        if strings:
            cases.append({"type": "string", "pattern": _pattern_except(strings)})
        cases += [{"const": b} for b in (False, True) if "boolean" in hit and not any(w is b for w in words)]
        written = {"anyOf": cases}
        return {**rest, "allOf": [*rest.get("allOf", []), written]} if "anyOf" in rest else {**rest, **written}
    excluded = _type_negation(s["not"])
    return None if excluded is None else t.without_types(s, excluded, "#")


def _plain_if(t: _Translator, s: dict[str, Any]) -> dict[str, Any] | None:
    if "if" not in s:
        return None
    return {"anyOf": [_public(b) for b in t.conditional(s, "#")]}


def _plain_dependencies(t: _Translator, s: dict[str, Any]) -> dict[str, Any] | None:
    lifted = _lift_dependencies(s, public=True)
    deps = _required_deps(lifted)
    if deps is None:
        return None if lifted is s or any(k in lifted for k in ("dependentSchemas", "dependencies")) else lifted
    s = lifted
    out = {k: v for k, v in s.items() if k not in ("dependentRequired", "dependencies")}
    return _with_cases(out, [[(frozenset({name}), frozenset()), (frozenset(), frozenset(needed))]
                             for name, needed in deps.items() if needed])


class _Translator:
    """The regex translation of one schema. ``mark_refs``: :meth:`merge` marks what it
    returns with the ``$ref``s it inlined (:data:`_VIA`), which :meth:`value` counts as
    expanding (the recursion check); the llguidance rewrites (:func:`plain_schema`),
    which write a grammar that recurses itself, leave it off."""

    def __init__(self, root: Any, ws: str, mark_refs: bool = True) -> None:
        self.root = root
        self.ws = ws
        self.mark_refs = mark_refs
        self.refs: list[str] = []  # $refs being expanded (recursion check)
        self.expanded = 0  # subschemas translated so far (MAX_SCHEMA_EXPANSION)
        self.deadline = time.monotonic() + MAX_TRANSLATE_S
        self._validator: Any = None  # jsonschema's validator of the root, made on first use
        self.ref_alone = ref_siblings_ignored(root)  # drafts 3-7: keywords beside a $ref do nothing

    def check_deadline(self) -> None:
        """The wall-time limit, checked wherever the work can grow: each subschema
        translated, each part merged, each listed-value lookup (an allOf of 90
        if/then conditions spent 37 s in merges that never checked it)."""
        if time.monotonic() > self.deadline:
            raise SchemaError(f"json_schema took longer than {MAX_TRANSLATE_S:g} s to translate; allowed: at most "
                              f"{MAX_TRANSLATE_S:g} s (a smaller schema, fewer alternatives)")

    # -- dispatch ---------------------------------------------------------------------
    def value(self, s: Any, path: str) -> str:
        self.expanded += 1
        self.check_deadline()
        if self.expanded > MAX_SCHEMA_EXPANSION:
            raise SchemaError(
                f"json_schema expands to more than {MAX_SCHEMA_EXPANSION} subschemas (each use of a '$ref' counts); "
                f"allowed: at most {MAX_SCHEMA_EXPANSION}"
            )
        if s is True:
            return self.any(ANY_DEPTH, path)
        if s is False:  # (an anyOf branch or a tuple's place left out, an optional property not written)
            raise _NoValue(f"json_schema at {path} is false: no value can satisfy it")
        if not isinstance(s, dict):
            raise SchemaError(f"json_schema at {path} must be an object or a boolean, got {type(s).__name__}")
        if _VIA in s:  # a merge that inlined $ref targets: translated as expanding them
            return self.expanding(s[_VIA], {k: v for k, v in s.items() if k != _VIA}, path)
        if self.ref_alone and "$ref" in s:
            s = {"$ref": s["$ref"]}
        s = _lift_dependencies(s)
        if isinstance(s.get("not"), dict) and "$ref" in s["not"]:
            s = {**s, "not": self.deref(s["not"], path)}
        if self.negation(s.get("not"), path) is not None:  # the values failing a condition: one of these
            rest = {k: v for k, v in s.items() if k != "not"}
            return self.value({**rest, "allOf": [*rest.get("allOf", []),
                                                 {"anyOf": self.negation(s["not"], path)}]}, path)
        self.check_keywords(s, path)
        s = _lift_not(s)
        if "not" in s and _not_values(s["not"]) is not None:
            return self.excluding(s, _not_values(s["not"]), path)
        if "not" in s:  # only `not: {type: ...}` is left (check_keywords refused the rest)
            s = self.without_types(s, _type_negation(s["not"]) or set(), path)
        if "if" in s:
            try:
                return self.value({"anyOf": self.conditional(s, path)}, path)
            except SchemaError as e:
                # a case the rewrite wrote (the values failing 'if' are a 'not' of its
                # const or enum, under an anyOf) is no keyword the client sent: name theirs
                if "keyword 'not'" in str(e) and f"{path}/anyOf/" in str(e) and '"not"' not in json.dumps(s, default=str):
                    raise SchemaError(f"json_schema keyword 'if' at {path} is not supported: {WHY_NOT['if']}; "
                                      f"here its 'else' case, the values failing 'if', cannot be written: "
                                      f"{str(e).split(': ', 1)[-1]}") from None
                raise
        if "then" in s or "else" in s:  # without 'if' they do nothing
            s = {k: v for k, v in s.items() if k not in ("then", "else")}
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
        if types is None and (_FORBID in s or _NEED_ONE_OF in s):
            types = [t for t in TYPE_KEYWORDS if t != "integer"]  # objects are narrowed: each type on its own
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
            if k == "not" and (_type_negation(s[k]) is not None or _not_required(s[k]) is not None
                               or _not_values(s[k]) is not None):
                continue
            if k in ("dependentRequired", "dependencies") and _required_deps(s) is not None:
                continue
            if k == "uniqueItems" and self.unique_domain(s, path) is not None:
                continue
            if k == "contains" and _contains_supported(s) or k == "minContains" and s[k] == 1 and "contains" in s:
                continue
            if k in ("patternProperties", "propertyNames"):  # object(): enforced or refused there
                continue
            if k in ("if", "then", "else"):  # conditional(): enforced or refused there; then/else alone do nothing
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
        parts = local_pointer(self.root, ref)
        if parts is None and isinstance(ref, str) and local_pointer(self.root, ref.split("#")[0] + "#") is not None:
            raise SchemaError(f"json_schema '$ref' at {path} points nowhere: {ref!r} (no '$anchor' in the document "
                              "names it)")
        if parts is None:
            raise SchemaError(f"json_schema '$ref' at {path} is not supported: {ref!r}; allowed: local references ('#/...', "
                              "or the schema's own URI)")
        node = pointer_target(self.root, parts)
        if node is NOWHERE:
            raise SchemaError(f"json_schema '$ref' at {path} points nowhere: {ref!r}")
        return node

    def ref(self, s: dict[str, Any], path: str) -> str:
        ref = s["$ref"]
        target = self.resolve(ref, path)
        rest = {k: v for k, v in s.items() if k != "$ref" and _validates(k)}
        return self.expanding([ref], self.merge([target, rest], path) if rest else target, path)

    def expanding(self, refs: list[str], s: Any, path: str) -> str:
        """``s`` translated while ``refs`` are expanded (their targets are in ``s``): a
        ``$ref`` already expanded ``RECURSION_UNROLL + 1`` times inside itself ends
        there (:class:`_Cutoff`: the optional place holding it is left out)."""
        for ref in refs:
            if self.refs.count(ref) > RECURSION_UNROLL:
                raise _Cutoff(
                    f"json_schema '$ref' at {path} is recursive ({ref!r}) and no value of it ends within "
                    f"{RECURSION_UNROLL + 1} levels: the regex translation unrolls a recursion at most "
                    f"{RECURSION_UNROLL + 1} levels deep, then ends it where the schema lets it end (an optional "
                    "property left out, an empty array, another anyOf/oneOf branch); grammar_backend 'llguidance' "
                    "(or 'auto') writes a grammar that recurses to any depth")
        if len(self.refs) + len(refs) > MAX_REF_DEPTH:
            raise SchemaError(f"json_schema '$ref' at {path} is expanded inside {MAX_REF_DEPTH} others; allowed: at most "
                              f"{MAX_REF_DEPTH}")
        self.refs.extend(refs)
        try:
            return self.value(s, path)
        finally:
            del self.refs[len(self.refs) - len(refs):]

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
        conds: list[dict[str, Any]] = []
        via: list[str] = []  # the $refs inlined here (each once: A and A is A)
        todo = list(subs)
        while todo:
            self.check_deadline()
            sub = todo.pop(0)
            if len(flat) + len(todo) > MAX_SCHEMA_EXPANSION:
                raise SchemaError(f"json_schema 'allOf' at {path} expands to more than {MAX_SCHEMA_EXPANSION} schemas")
            if sub is True:
                continue
            if sub is False:
                raise _NoValue(f"json_schema 'allOf' at {path} contains false: no value can satisfy it")
            if not isinstance(sub, dict):
                raise SchemaError(f"json_schema 'allOf' at {path} contains {sub!r}: no value can satisfy it")
            if "$ref" in sub:  # the target and the keywords beside it (from 2019-09), all of them
                rest = {} if self.ref_alone else {k: v for k, v in sub.items() if k != "$ref"}
                target = [] if sub["$ref"] in via else [self.resolve(sub["$ref"], path)]
                via.append(sub["$ref"])
                todo[:0] = target + ([rest] if any(_validates(k) for k in rest) else [])
            elif "allOf" in sub:
                todo[:0] = self.all_of(sub, path)
            elif "if" in sub:  # applied to the merge of the others, below
                conds.append(sub)
            else:
                flat.append(_lift_not(sub))
        for sub in flat:
            for k, v in sub.items():
                if k in ANNOTATIONS:
                    continue
                if k not in out:
                    out[k] = v
                elif k == "properties":
                    props = dict(out[k])
                    for name, ps in v.items():
                        if name not in props or props[name] == ps:
                            props[name] = ps
                            continue
                        if props[name] is False or ps is False:
                            props[name] = False
                            continue
                        fa, fb = self.finite(props[name], path), self.finite(ps, path)
                        if fa is not None and fb is not None and not _json_common(fa, fb):
                            props[name] = False  # no value satisfies both: the property cannot be present
                        else:
                            props[name] = {"allOf": [props[name], ps]}
                    out[k] = props
                elif k == "required":
                    out[k] = list(dict.fromkeys([*out[k], *v]))
                elif k == "type":
                    a = set(out[k] if isinstance(out[k], list) else [out[k]])
                    b = set(v if isinstance(v, list) else [v])
                    both = (a & b) | ({"integer"} if ("number" in a and "integer" in b) or ("integer" in a and "number" in b) else set())
                    if not both:
                        raise _NoValue(f"json_schema 'allOf' at {path}: types {sorted(a)} and {sorted(b)} exclude each other")
                    out[k] = sorted(both)
                elif k in ("minimum", "minLength", "minItems", "exclusiveMinimum") and _is_num(v) and _is_num(out[k]):
                    out[k] = max(out[k], v)
                elif k in ("maximum", "maxLength", "maxItems", "exclusiveMaximum") and _is_num(v) and _is_num(out[k]):
                    out[k] = min(out[k], v)
                elif k == "enum" and isinstance(v, list):
                    out[k] = _json_common(out[k], v)
                    if not out[k]:
                        raise _NoValue(f"json_schema 'allOf' at {path}: the 'enum' lists have no value in common")
                elif k in (_FORBID, _NEED_ONE_OF):
                    out[k] = [*out[k], *v]
                elif k == _VIA:
                    out[k] = list(dict.fromkeys([*out[k], *v]))
                elif out[k] == v or not _validates(k):
                    continue  # the same value, or an unknown keyword (an annotation: it does not constrain)
                elif k == "const" and not _json_equal(out[k], v):
                    raise _NoValue(f"json_schema 'allOf' at {path}: 'const' {out[k]!r} and {v!r} differ")
                elif k in ("items", "additionalProperties", "additionalItems", "propertyNames") and (
                        isinstance(v, (dict, bool)) and isinstance(out[k], (dict, bool))):
                    # each item (or other key) must satisfy both schemas
                    out[k] = (False if out[k] is False or v is False else v if out[k] is True
                              else out[k] if v is True else {"allOf": [out[k], v]})
                elif k == "not" and _type_negation(v) and _type_negation(out[k]):
                    out[k] = {"type": sorted(_type_negation(v) | _type_negation(out[k]))}
                elif k == "not" and _not_values(v) is not None and _not_values(out[k]) is not None:
                    # none of these values and none of those: none of either (an 'allOf' of
                    # if/then on one property's values gives a 'not' per condition)
                    out[k] = {"enum": _json_unique([*_not_values(out[k]), *_not_values(v)])}
                elif k == "anyOf" and isinstance(v, list) and isinstance(out[k], list):
                    out[k] = self.both_any_of(out[k], v, path)
                else:
                    raise SchemaError(f"json_schema 'allOf' at {path}: conflicting values for {k!r} cannot be merged")
        # a property one part lists is, for a part that does not list it, an additional
        # property: that part's additionalProperties applies to it too
        props = out.get("properties")
        if isinstance(props, dict):
            props = dict(props)
            for sub in flat:
                extra = sub.get("additionalProperties", True)
                if extra is True or not isinstance(sub.get("properties", {}), dict):
                    continue
                for name in props:
                    own = sub.get("properties", {})
                    if name not in own and not any(_search(p, name) for p in sub.get("patternProperties", {})):
                        props[name] = extra if extra is False else {"allOf": [props[name], extra]}
            out["properties"] = props
            required = out.get("required", [])
            for name in required if isinstance(required, list) else []:
                if props.get(name) is False:
                    raise _NoValue(f"json_schema 'allOf' at {path} requires {name!r}, which no value satisfies (another "
                                   "part's additionalProperties: false, or values that conflict)")
        if via and self.mark_refs:
            out[_VIA] = list(dict.fromkeys([*out.get(_VIA, []), *via]))
        if not conds:
            return out
        cases = [out]  # each 'if' splits every case in two: its then-case and its else-case
        for cond in conds:
            split = []
            for case in cases:
                try:
                    split.extend(self.conditional({**cond, "allOf": [case, {k: v for k, v in cond.items()
                                                                          if k not in ("if", "then", "else")}]}, path))
                except _NoValue:
                    continue
            if len(split) > MAX_ANY_OF_PRODUCT:
                raise SchemaError(f"json_schema 'if' at {path}: the conditions of one 'allOf' split into more than "
                                  f"{MAX_ANY_OF_PRODUCT} cases")
            cases = split
        if not cases:
            raise _NoValue(f"json_schema 'allOf' at {path}: no value satisfies its conditions")
        return cases[0] if len(cases) == 1 else {"anyOf": cases}

    def conditional(self, s: dict[str, Any], path: str) -> list[Any]:
        """``if``/``then``/``else`` as alternatives: the values of ``s`` that satisfy
        ``if`` and ``then``, and those that fail ``if`` and satisfy ``else``. Failing
        ``if`` is written out for its common form: one property with listed values
        (``if: {properties: {p: {const: ...}}}``, optionally ``required: [p]`` and
        ``type: object``) where the schema beside it lists ``p``'s values too — the
        others of that list are the ones that fail it (decided by ``jsonschema``; a
        value it cannot decide is left out of both, which is sound)."""
        cond, then, other = s["if"], s.get("then", True), s.get("else", True)
        where = f"{path}/if"
        rest = self.merge([{k: v for k, v in s.items() if k not in ("if", "then", "else")}], where)
        if "anyOf" in rest and "if" not in rest:  # cases of earlier conditions: each split on its own
            others = {k: v for k, v in rest.items() if k != "anyOf"}
            out = []
            for case in rest["anyOf"]:
                try:
                    out.extend(self.conditional({"if": cond, "then": then, "else": other,
                                                 "allOf": [case, others] if others else [case]}, path))
                except _NoValue:
                    continue
            if not out:
                raise _NoValue(f"json_schema 'if' at {path}: no value satisfies either case")
            return out
        if cond is True or cond is False:
            negations: list[Any] = [] if cond is True else [True]
            positive = [] if cond is False else [[cond, then]]
        elif isinstance(cond, dict) and set(cond) - ANNOTATIONS == {"not"}:  # fails exactly where cond['not'] holds
            positive = [[x, then] for x in self.failing(cond["not"], rest, where)]
            negations = [cond["not"]]
        else:
            positive = [[cond, then]]
            negations = self.failing(cond, rest, where)
        branches = []
        for parts in [*positive, *[[n, other] for n in negations]]:
            try:
                branches.append(self.merge([rest, *parts], where))
            except _NoValue:
                continue
        if not branches:
            raise _NoValue(f"json_schema 'if' at {path}: no value satisfies either case")
        return branches

    def negation(self, sub: Any, path: str) -> list[Any] | None:
        """``not: sub`` as schemas whose values are exactly those failing ``sub``, when
        ``sub`` is a condition :meth:`failing` writes out (one property's const, enum
        or nested condition: ``not: {properties: {parallel: {const: true}}}``); else None."""
        if not isinstance(sub, dict) or "properties" not in sub or _not_required(sub) is not None:
            return None
        try:
            return self.failing(sub, {}, f"{path}/not")
        except SchemaError:
            return None

    def failing(self, cond: Any, rest: dict[str, Any], where: str) -> list[Any]:
        """Schemas whose values (within ``rest``) are exactly those failing ``cond``:
        the property present with a value that fails (when ``rest`` lists the
        property's values, those of them that fail; otherwise ``not`` the ``enum`` or
        ``const`` of ``cond``, or, when that is a condition of this form itself, the
        values failing it), absent when ``cond`` requires it, and values other than
        objects when ``cond`` has ``type: object``."""
        refuse = SchemaError(f"json_schema keyword 'if' at {where} is not supported: {WHY_NOT['if']}")
        if not isinstance(cond, dict):
            raise refuse
        keys = set(cond) - ANNOTATIONS
        props = cond.get("properties")
        if not keys <= {"properties", "required", "type"} or not isinstance(props, dict) or len(props) != 1:
            raise refuse
        (name, want), = props.items()
        required = cond.get("required", [])
        if required not in ([], [name]) or cond.get("type", "object") != "object":
            raise refuse
        base = rest.get("properties", {}).get(name) if isinstance(rest.get("properties"), dict) else None
        values = [] if base is False else self.finite(base, where) if base is not None else None
        out: list[Any] = []
        if values is None:  # the property is present with a value 'want' does not list, or (nested) fails
            listed = _not_values(want)
            inner = [{"not": {"enum": listed}}] if listed is not None else self.failing(want, {}, where)
            out += [{"type": "object", "required": [name], "properties": {name: x}} for x in inner]
        elif failing := [x for x in values if self.rejects(want, x)]:
            out.append({"type": "object", "required": [name], "properties": {name: {"enum": failing}}})
        if required:  # an object without the property fails 'if' too
            out.append({"type": "object", _FORBID: [[name]]})
        if "type" in cond:  # values that are not objects fail 'if'
            out.append({"type": [t for t in TYPE_KEYWORDS if t not in ("object", "integer")]})
        return out

    def excluding(self, s: dict[str, Any], excluded: list[Any], path: str) -> str:
        """``s`` with ``not: {enum: excluded}`` (or ``const``): listed values filtered;
        otherwise each type without an excluded value is left as it is, and strings
        without other string keywords are written as any string but the excluded ones;
        any other combination is refused by name."""
        rest = {k: v for k, v in s.items() if k != "not"}
        values = self.finite(rest, path)
        if values is not None:
            drop = {_json_key(x) for x in excluded}
            kept = [v for v in values if _json_key(v) not in drop]
            if not kept:
                raise _NoValue(f"json_schema 'not' at {path} excludes every listed value")
            out = {k: v for k, v in rest.items() if k not in ("enum", "const")}
            return self.value({**out, "enum": kept}, path)
        types = self.types(rest, path) or [t for t in TYPE_KEYWORDS if t != "integer"]
        parts = []
        for t in types:
            hit = [x for x in excluded if _json_type_ok(x, t)]
            if not hit:
                parts.append(self.value({**rest, "type": t}, path))
            elif t == "boolean":
                parts += [self.dump(b) for b in (False, True) if not any(_json_equal(b, x) for x in hit)]
            elif t == "null":
                continue
            elif t == "string" and not TYPE_KEYWORDS["string"] & rest.keys():
                parts.append(_string_except([x for x in hit if isinstance(x, str)], path))
            else:
                raise SchemaError(f"json_schema keyword 'not' at {path} is not supported: excluding listed {t} values "
                                  f"is supported for booleans, null, listed values and strings without other "
                                  f"string keywords")
        if not parts:
            raise _NoValue(f"json_schema 'not' at {path} excludes every value")
        return _alt(parts)

    def both_any_of(self, a: list[Any], b: list[Any], path: str) -> list[Any]:
        """Two ``anyOf`` lists that must both hold: one branch of each, merged (pairs
        that cannot be merged are left out: a subset of the values, still sound)."""
        if len(a) * len(b) > MAX_ANY_OF_PRODUCT:
            raise SchemaError(f"json_schema 'allOf' at {path} combines 'anyOf' lists of {len(a)} and {len(b)} "
                              f"branches; allowed: at most {MAX_ANY_OF_PRODUCT} pairs")
        out = []
        for x in a:
            for y in b:
                try:
                    out.append(self.merge([x, y], path))
                except SchemaError:
                    continue
        if not out:
            raise SchemaError(f"json_schema 'allOf' at {path}: no branch of one 'anyOf' merges with a branch of the other")
        return out

    def alternatives(self, s: dict[str, Any], key: str, path: str) -> str:
        subs = s[key]
        if not isinstance(subs, list) or not subs:
            raise SchemaError(f"json_schema {key!r} at {path} must be a non-empty list")
        # only what constrains: merging a branch's $ref with annotations beside the list
        # (pydantic's 'default': null) would inline its target past the recursion count
        rest = {k: v for k, v in s.items() if k != key and _validates(k)}
        schemas = []
        for i, sub in enumerate(subs):
            try:
                schemas.append(self.merge([sub, rest], f"{path}/{key}/{i}") if rest else sub)
            except _NoValue:  # the branch and the keywords beside it admit no value together
                continue
        if not schemas:
            raise _NoValue(f"json_schema {key!r} at {path}: no branch admits a value with the keywords beside it")
        if key == "oneOf":
            schemas = self.exclusive(schemas, path)
        branches = []
        cutoff: _Cutoff | None = None
        for i, sub in enumerate(schemas):
            try:
                branches.append(self.value(sub, f"{path}/{key}/{i}"))
            except _Cutoff as e:  # a recursion unrolled to its limit: the others remain
                cutoff = e
            except _NoValue:  # no value of this branch fits: the others remain
                continue
        if not branches and cutoff is not None:
            raise cutoff  # every branch recurses on: the optional place holding the list is left out
        if not branches:
            raise _NoValue(f"json_schema {key!r} at {path}: no branch admits a value")
        return _alt(branches)

    def exclusive(self, schemas: list[Any], path: str) -> list[Any]:
        """``oneOf`` means exactly one branch. Each branch is narrowed until no value it
        admits satisfies another branch as written: for each other branch and each kind
        of JSON value both admit (null, boolean, string, number, object, array), either
        a proof that no value of that kind satisfies both (distinct types, finite value
        sets the other branch rejects, a discriminating property, a required name the
        other's closed object forbids), or, for objects, a narrowing that fails the
        other branch (it must lack one of the other's ``required`` names, or carry a
        name the other's closed object does not allow), or the kind is dropped from the
        branch (values of it satisfy both, so ``oneOf`` refuses them, or no proof was
        found: dropping is sound, never admitting a value that matches two branches)."""
        n = len(schemas)
        kinds = [self.kinds(s, path) for s in schemas]
        keep = [set(k) for k in kinds]
        forbid: list[list[list[str]]] = [[] for _ in range(n)]
        need_one_of: list[list[list[str]]] = [[] for _ in range(n)]  # objects need one name of each list
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                for kind in sorted(kinds[i] & kinds[j]):
                    if kind not in keep[i]:
                        continue
                    a, b = self.of_kind(schemas[i], kind, path), self.of_kind(schemas[j], kind, path)
                    if a is None or b is None:
                        keep[i].discard(kind)
                    elif self.disjoint(a, b, path):
                        continue
                    elif kind == "object" and (narrowed := self.fail_object(a, b, path)) is not None:
                        (forbid if narrowed[0] == "forbid" else need_one_of)[i].append(narrowed[1])
                    else:
                        keep[i].discard(kind)
        out: list[Any] = []
        for i, s in enumerate(schemas):
            if not keep[i]:
                continue
            parts: list[Any] = [s]
            if keep[i] != kinds[i]:
                parts.append({"type": sorted({t for k in keep[i] for t in _KIND_TYPES[k]})})
            if forbid[i]:
                parts.append({_FORBID: forbid[i]})
            if need_one_of[i]:
                parts.append({_NEED_ONE_OF: need_one_of[i]})
            out.append(self.merge(parts, path) if len(parts) > 1 else s)
        if not out:
            raise SchemaError(
                f"json_schema 'oneOf' at {path}: no branch could be proved to exclude the others (every kind of value "
                "may match two branches), so 'exactly one' cannot be enforced; use 'anyOf', or make the branches "
                "exclusive (distinct types, a property with distinct 'const' values, or distinct 'required' sets)"
            )
        return out

    def kinds(self, s: Any, path: str) -> set[str]:
        """The type groups (null, boolean, string, number, object, array) ``s`` may admit."""
        atoms = self.atoms(s, path)
        return {k for k, members in _KIND_ATOMS.items() if members & atoms}

    def of_kind(self, s: Any, kind: str, path: str) -> Any:
        """``s`` restricted to one type group, merged into one schema (None: no merge)."""
        if s is True:
            return {"type": list(_KIND_TYPES[kind])}
        try:
            return self.merge([s, {"type": list(_KIND_TYPES[kind])}], path)
        except SchemaError:
            return None

    def fail_object(self, a: dict[str, Any], b: dict[str, Any], path: str) -> tuple[str, list[str]] | None:
        """A narrowing of object schema ``a`` whose objects all fail ``b``: ("forbid",
        names) — they lack one of ``b``'s required names — or ("need", names) — they
        carry one of ``a``'s names that ``b``'s closed object does not allow."""
        req_a = a.get("required", []) if isinstance(a.get("required"), list) else []
        req_b = b.get("required", []) if isinstance(b.get("required"), list) else []
        if req_b and all(isinstance(x, str) for x in req_b) and not set(req_b) <= set(req_a):
            return "forbid", list(req_b)
        names = self.closed_names(b)
        props_a = a.get("properties", {})
        if names is not None and isinstance(props_a, dict) and a.get("additionalProperties", True) is False:
            extra = [k for k in props_a if k not in names and props_a[k] is not False]
            if extra and len(extra) <= MAX_NEED_NAMES:
                return "need", extra
        # an optional discriminator (pydantic's Literal tag with a default, in a model
        # whose fields all have defaults): objects that carry it, with a's values, which
        # b's listed values exclude, fail b
        props_b = b.get("properties", {})
        if isinstance(props_a, dict) and isinstance(props_b, dict):
            for name in props_a:
                if name in props_b and props_a[name] is not False:
                    va, vb = self.finite(props_a[name], path), self.finite(props_b[name], path)
                    if va is not None and vb is not None and not _json_common(va, vb):
                        return "need", [name]
        return None

    @staticmethod
    def closed_names(s: dict[str, Any]) -> set[str] | None:
        """The only names an object of ``s`` may have (None: any name may appear)."""
        props = s.get("properties", {})
        if s.get("additionalProperties", True) is not False or s.get("patternProperties") or not isinstance(props, dict):
            return None
        return {k for k, v in props.items() if v is not False}

    def deref(self, s: Any, path: str) -> Any:
        for _ in range(MAX_REF_DEPTH):
            if not (isinstance(s, dict) and "$ref" in s):
                return s
            rest = {} if self.ref_alone else {k: v for k, v in s.items() if k != "$ref" and k not in ANNOTATIONS}
            target = self.resolve(s["$ref"], path)
            s = {"allOf": [target, rest]} if rest else target
        raise SchemaError(f"json_schema '$ref' at {path} is nested more than {MAX_REF_DEPTH} deep")

    def atoms(self, s: Any, path: str, depth: int = 0) -> frozenset[str]:
        """The kinds of JSON values ``s`` may admit: null, boolean, string, object,
        array, int (a whole number) and frac (a number with a fraction)."""
        every = frozenset({"null", "boolean", "string", "object", "array", "int", "frac"})
        s = self.deref(s, path)
        if s is True or depth > 16:
            return every
        if s is False or not isinstance(s, dict):
            return frozenset()
        out = every
        t = s.get("type")
        if t is not None:
            ts = t if isinstance(t, list) else [t]
            kinds: set[str] = set()
            for x in ts:
                kinds |= {"number": {"int", "frac"}, "integer": {"int"}}.get(x, {x})
            out &= kinds
        if "enum" in s or "const" in s:
            values = [s["const"]] if "const" in s else s["enum"] if isinstance(s["enum"], list) else []
            out &= {_atom(v) for v in values}
        not_types = _type_negation(s.get("not"))
        if not_types:
            out -= {k for x in not_types for k in ({"number": {"int", "frac"}, "integer": {"int"}}.get(x, {x}))}
        for sub in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            out &= self.atoms(sub, path, depth + 1)
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                out &= frozenset().union(*(self.atoms(sub, path, depth + 1) for sub in s[key]))
        return out

    def finite(self, s: Any, path: str) -> list[Any] | None:
        """The values ``s`` allows when it lists them (enum/const), else None."""
        self.check_deadline()
        s = self.deref(s, path)
        if isinstance(s, dict) and ("enum" in s or "const" in s):
            return [s["const"]] if "const" in s else s["enum"] if isinstance(s["enum"], list) else None
        if isinstance(s, dict) and isinstance(s.get("allOf"), list):
            found: list[Any] | None = None  # the values every listing part allows
            for sub in s["allOf"]:
                values = self.finite(sub, path)
                if values is not None:
                    found = values if found is None else _json_common(found, values)
            return found
        return None

    def object_required(self, s: Any, path: str) -> list[str] | None:
        """``required`` of a schema that admits only objects, else None."""
        s = self.deref(s, path)
        if not isinstance(s, dict) or self.atoms(s, path) != {"object"}:
            return None
        req = s.get("required")
        return list(req) if isinstance(req, list) and req and all(isinstance(x, str) for x in req) else None

    def disjoint(self, a: Any, b: Any, path: str) -> bool:
        """No value satisfies both ``a`` and ``b`` (a proof from their keywords)."""
        if not (self.atoms(a, path) & self.atoms(b, path)):
            return True
        fa, fb = self.finite(a, path), self.finite(b, path)
        if fa is not None and fb is not None and not _json_common(fa, fb):
            return True
        for values, other in ((fa, b), (fb, a)):  # every listed value fails the other side
            if values is not None and len(values) <= MAX_UNIQUE_VALUES and all(self.rejects(other, x) for x in values):
                return True
        da, db = self.deref(a, path), self.deref(b, path)
        if not (isinstance(da, dict) and isinstance(db, dict)):
            return False
        if self.atoms(da, path) <= {"object"} and self.atoms(db, path) <= {"object"}:
            pa, pb = da.get("properties", {}), db.get("properties", {})
            req = set(da.get("required", [])) | set(db.get("required", []))
            for name in set(pa) & set(pb) & req if isinstance(pa, dict) and isinstance(pb, dict) else ():
                va, vb = self.finite(pa[name], path), self.finite(pb[name], path)
                if va is not None and vb is not None and not _json_common(va, vb):
                    return True  # a discriminator: the property has distinct values on each side
        return False

    def enum(self, s: dict[str, Any], path: str) -> str:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"json_schema 'enum' at {path} must be a non-empty list")
        values = self.finite_values(s, path)
        if not values:
            raise _NoValue(f"json_schema 'enum' at {path}: no value satisfies the schema")
        return _alt([escape(self.dump(v)) for v in values])

    def finite_values(self, s: dict[str, Any], path: str) -> list[Any]:
        """The values of ``enum``/``const`` that satisfy all of ``s`` (its other
        keywords, whatever they are, checked by ``jsonschema`` itself: a finite set is
        enforced exactly), without repeats."""
        values = [s["const"]] if "const" in s else list(s["enum"])
        if "const" in s and "enum" in s:
            values = [v for v in s["enum"] if _json_equal(v, s["const"])]
        if set(s) - {"enum", "const"} - ANNOTATIONS:
            # the values come from enum/const: jsonschema need not look them up again
            # (it compares each with every listed value: quadratic in a long enum)
            check = self.validator({k: x for k, x in s.items() if k not in ("enum", "const")})
            kept = []
            for v in values:  # each check may match patterns for up to MAX_MATCH_S
                self.check_deadline()
                if check(v):
                    kept.append(v)
            values = kept
        return _json_unique(values)

    def root_validator(self) -> Any:
        """``jsonschema``'s validator of the root document (built once), formats checked;
        its ``pattern`` keywords matched under a time limit (:func:`bounded_search`)."""
        import jsonschema

        if self._validator is None:
            root = self.root if isinstance(self.root, dict) else {}
            cls = _bounded_patterns(jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator))
            self._validator = cls(root, format_checker=cls.FORMAT_CHECKER)
        return self._validator

    def validator(self, s: dict[str, Any]) -> Any:
        """``jsonschema``'s is_valid for the subschema ``s`` of the root (its $refs
        resolve against the root), formats checked."""
        v = self.root_validator().evolve(schema={k: x for k, x in s.items() if not k.startswith(_INTERNAL)})

        def check(value: Any) -> bool:
            try:
                return bool(v.is_valid(value))
            except Exception:  # an unresolvable $ref or the like: not proved valid
                return False

        return check

    def rejects(self, s: Any, value: Any) -> bool:
        """``jsonschema`` says ``value`` fails ``s`` (False when it cannot tell)."""
        if s is True or not isinstance(s, dict):
            return s is False
        s = {k: v for k, v in s.items() if k != _VIA}  # no constraint
        if any(isinstance(k, str) and k.startswith(_INTERNAL) for k in s):
            return False  # narrowed by plait: not what jsonschema reads
        try:
            errors = self.root_validator().evolve(schema=s).iter_errors(value)
            return next(errors, None) is not None
        except Exception:  # an unresolvable $ref, an invalid subschema, a recursion: not proved
            return False

    def dump(self, v: Any) -> str:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))

    # -- scalars ------------------------------------------------------------------------
    def string(self, s: dict[str, Any], path: str) -> str:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if not is_int(lo) or lo < 0 or (hi is not None and (not is_int(hi) or hi < lo)):
            raise SchemaError(f"json_schema 'minLength'/'maxLength' at {path} are invalid: {lo!r}, {hi!r}")
        fmt = s.get("format")
        if fmt is not None and fmt not in FORMATS:
            if fmt in STANDARD_FORMATS:  # defined by a draft, not enforced here
                raise SchemaError(f"json_schema 'format' {fmt!r} at {path} is not supported; allowed: "
                                  f"{', '.join(sorted(FORMATS))} (other values are annotations)")
            fmt = None  # not a format of any draft (OpenAPI's "password", vendors'): an annotation
        lengths = (lo, hi) if "minLength" in s or "maxLength" in s else None
        looks = _leading_lookaheads(s["pattern"], path) if "pattern" in s else None
        if looks is not None:  # (zod v4's z.email(): ^(?!\.)(?!.*\.\.)...; password rules: ^(?=.*[A-Z])...)
            return '"' + _with_format_relaxed(
                lambda rx: _pattern_with_lookaheads(s["pattern"], path, looks, rx, lengths), fmt) + '"'
        if "pattern" in s and fmt is not None:  # (zod v4's z.uuid(), z.iso.datetime() write both)
            return '"' + _with_format_relaxed(lambda rx: _pattern_and_format(s["pattern"], fmt, rx, path, lengths),
                                              fmt) + '"'
        if "pattern" in s:
            return '"' + _json_safe_pattern(s["pattern"], path, lengths) + '"'
        if fmt is not None:
            if lengths is not None:
                wmin, wmax = _pattern_tree(FORMATS[fmt], path).getwidth()
                if wmin < lo or (hi is not None and wmax > hi):
                    raise SchemaError(f"json_schema keywords 'format' {fmt!r} and 'minLength'/'maxLength' at {path} "
                                      f"cannot be combined: the format's values have {wmin} to {wmax} characters")
            return '"(?:' + FORMATS[fmt] + ')"'
        if lo == 0 and hi is None:
            return JSON_STRING
        return '"' + _repeat(JSON_CHAR, lo, hi) + '"'

    def integer(self, s: dict[str, Any], path: str) -> str:
        if s.get("multipleOf", 1) != 1:  # _multiple_of_supported: a positive number
            return self.multiples(s, True, path)
        lo, hi = self.bounds(s, path)
        if lo is None and hi is None:
            return INTEGER
        lo = None if lo is None else (math.floor(lo[0]) + 1 if lo[1] else math.ceil(lo[0]))
        hi = None if hi is None else (math.ceil(hi[0]) - 1 if hi[1] else math.floor(hi[0]))
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(f"json_schema 'minimum'/'maximum' at {path} admit no integer")
        return int_range_regex(lo, hi)

    def number(self, s: dict[str, Any], path: str) -> str:
        """Bounds compare the value as a decimal with each bound as written (see
        :func:`schema_decimal`); :func:`number_range_regex` says why a float parse of an
        admitted text satisfies them too."""
        if s.get(_FRACTIONAL):  # `not: {type: integer}`: a non-zero fractional digit
            if set(s) & TYPE_KEYWORDS["number"] or "multipleOf" in s:
                raise SchemaError(f"json_schema 'not' at {path}: bounds on non-integral numbers are not supported")
            # float-safe: at most 9 + 6 digits, so parsing cannot round it to an integer
            return r"-?(?:0|[1-9][0-9]{0,8})\.[0-9]{0,5}[1-9]"
        if s.get("multipleOf") == 1:  # whole numbers, written as integers
            return self.integer(s, path)
        if "multipleOf" in s:
            return self.multiples(s, False, path)
        lo, hi = self.bounds(s, path)
        if lo is None and hi is None:
            return NUMBER
        for b, key in ((lo, "minimum"), (hi, "maximum")):
            if b is not None and b[0] == int(b[0]) and _float_inexact(int(b[0])):
                # a decimal written next to it (9223372036854775807.0) parses to the float past it
                raise SchemaError(f"json_schema {key!r} at {path} is not supported for 'number' ({b[0]}): a 64-bit "
                                  "float does not hold it, so a value with a fraction next to it parses past it; "
                                  "allowed: bounds a 64-bit float holds (within +-2**53), or type 'integer'")
        a = None if lo is None else schema_decimal(lo[0])
        b = None if hi is None else schema_decimal(hi[0])
        lo_open, hi_open = lo is not None and lo[1], hi is not None and hi[1]
        if a is not None and b is not None and (a > b or (a == b and (lo_open or hi_open))):
            raise SchemaError(f"json_schema 'minimum'/'maximum' at {path} admit no number")
        try:
            return number_range_regex(a, b, lo_open, hi_open)
        except SchemaError as e:
            named = "/".join(repr(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in s)
            raise SchemaError(f"json_schema {named} at {path}: {e}") from None

    def multiples(self, s: dict[str, Any], integer: bool, path: str) -> str:
        """``multipleOf`` (not 1) with the bounds beside it, exactly, or ``SchemaError``
        naming it. The step is the decimal written (:func:`schema_decimal`); a value is
        a multiple when value / step is an integer in exact arithmetic. ``jsonschema``
        divides floats instead (``0.07 / 0.01`` is ``7.000000000000001``: not a
        multiple), so only steps whose multiples a float holds exactly are accepted:
        integers and binary fractions (0.5, 0.25, 2.5, 0.125). For them the two readings
        agree on every text written here. Multiples are written as integers when the step
        is one (``6``, not ``6.0``), else with at most the step's fraction digits."""
        k = s["multipleOf"]
        step = schema_decimal(k)
        if step.denominator & (step.denominator - 1):  # not a power of two
            raise SchemaError(f"json_schema 'multipleOf' {k!r} at {path} is not supported: {k!r} is not a binary "
                              f"fraction, and validators that divide floats (jsonschema among them) reject exact "
                              f"multiples of it{_float_quotient_example(k, step)}; allowed: integers and fractions a "
                              f"float holds exactly (0.5, 0.25, 0.125, 2.5, 0.75)")
        if integer:  # integers that are multiples of p/2**e: the multiples of p
            step = Fraction(step.numerator)
            if step == 1:
                return self.integer({key: v for key, v in s.items() if key != "multipleOf"}, path)
        # the integer digits written: floats hold every multiple exactly below 2**53
        int_digits = MAX_DIGITS if is_int(k) else MAX_DIGITS - 1
        while step.denominator > 1 and 10**int_digits * step.denominator > 2**53:
            int_digits -= 1
        lo, hi = self.bounds(s, path)
        j_lo = j_hi = None  # the multiples written: step * j, j_lo <= j <= j_hi
        if lo is not None and lo[0] > -(10**int_digits):
            q = schema_decimal(lo[0]) / step
            j_lo = math.floor(q) + 1 if lo[1] else math.ceil(q)
        if hi is not None and hi[0] < 10**int_digits:
            q = schema_decimal(hi[0]) / step
            j_hi = math.ceil(q) - 1 if hi[1] else math.floor(q)
        if j_lo is not None and j_hi is not None:
            if j_lo > j_hi:
                raise SchemaError(f"json_schema 'minimum'/'maximum' at {path} admit no multiple of {k!r}")
            if j_hi - j_lo < MAX_MULTIPLE_FORMS:
                return multiples_regex(step, int_digits, j_lo, j_hi)
        if j_lo in (None, 0, 1) and j_hi in (None, 0, -1):  # bounds that only cut at zero
            try:
                return multiples_regex(step, int_digits, j_lo, j_hi)
            except SchemaError as e:
                raise SchemaError(f"json_schema 'multipleOf' {k!r} at {path} is not supported: {e}") from None
        raise SchemaError(f"json_schema 'multipleOf' {k!r} at {path} is not supported with these bounds "
                          f"(multiples {_bound_text(j_lo, step)} to {_bound_text(j_hi, step)}); allowed: bounds at "
                          f"zero (minimum 0, exclusiveMaximum 0...) or bounds enclosing at most "
                          f"{MAX_MULTIPLE_FORMS} multiples")

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
        patterns = s.get("patternProperties", {})
        if not isinstance(props, dict) or not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"json_schema 'properties'/'required' at {path} are invalid")
        if not isinstance(extra, (bool, dict)):
            raise SchemaError(f"json_schema 'additionalProperties' at {path} must be a boolean or a schema")
        if not isinstance(patterns, dict):
            raise SchemaError(f"json_schema 'patternProperties' at {path} must be an object")
        lo, hi = s.get("minProperties", 0), s.get("maxProperties")
        if not is_int(lo) or lo < 0 or (hi is not None and (not is_int(hi) or hi < lo)):
            raise SchemaError(f"json_schema 'minProperties'/'maxProperties' at {path} are invalid: {lo!r}, {hi!r}")
        deps = _required_deps(s) or {}
        forbids = [set(f) for f in s.get(_FORBID, [])]
        needs = [set(x) for x in s.get(_NEED_ONE_OF, [])]
        names_ok = None
        if "propertyNames" in s:  # a listed name the schema of names refuses is never written
            pn = s["propertyNames"]
            names_ok = self.validator(pn) if isinstance(pn, dict) else (lambda name, ok=bool(pn): ok)

        def value_schema(name: str, own: Any) -> Any:
            # a listed or required name: its own schema, and every patternProperties
            # schema whose pattern it contains (as jsonschema reads the pattern)
            import re as _re

            hits = []
            for pat, sub in patterns.items():
                try:
                    if bounded_search(pat, name):
                        hits.append(sub)
                except _re.error:
                    raise SchemaError(f"json_schema 'patternProperties' at {path}: {pat!r} is not a valid pattern") from None
            if own is None:
                own = extra if not hits else True
            return own if not hits else {"allOf": [own, *hits]}

        fields = []
        for name in [*props, *[r for r in required if r not in props]]:
            own = props.get(name)
            if own is None and extra is False and not any(_search(p, name) for p in patterns):
                raise SchemaError(f"json_schema at {path} requires {name!r}, which additionalProperties: false forbids")
            if names_ok is not None and not names_ok(name):
                if name in required:
                    raise SchemaError(f"json_schema at {path} requires {name!r}, which 'propertyNames' forbids")
                continue
            sub = value_schema(name, own)
            if sub is False and name not in required:
                continue  # an optional property no value satisfies: never written
            if sub is False:
                raise _NoValue(f"json_schema at {path} requires {name!r}, which no value satisfies")
            fields.append((name, sub))
        if not fields:
            if needs:
                raise _NoValue(f"json_schema at {path}: no object carries a name an exclusive 'oneOf' branch needs")
            self.check_free_forbids(forbids, patterns, extra, hi, path)
            return self.free_object(s, patterns, extra, lo, hi, path)
        sep = ws + "," + ws
        pairs: list[tuple[str, bool]] = []
        names: list[str] = []
        for name, sub in fields:
            try:
                value = self.value(sub, f"{path}/properties/{name}")
            except _Cutoff:  # a recursion unrolled to its limit: the optional property is left out
                if name in required:
                    raise
                continue
            pairs.append((escape(self.dump(name)) + ws + ":" + ws + value, name in required))
            names.append(name)
        if not pairs:
            if needs:
                raise _NoValue(f"json_schema at {path}: no object carries a name an exclusive 'oneOf' branch needs")
            return self.free_object(s, {}, False, lo, hi, path)
        written = set(names)
        forbids = [f for f in forbids if f <= written]  # a set with an unwritten name never appears whole
        needs = [x & written for x in needs]  # only listed names are written (none of the others appears)
        counting = "minProperties" in s or "maxProperties" in s
        if counting or deps or forbids or needs:
            body = self.counted_fields(pairs, names, lo, hi, deps, forbids, counting, path, needs)
            return r"\{" + ws + body + ws + r"\}"

        # tail[i]: properties i.. after one was written; lead[i]: properties i.. before
        # any was (a leading optional one is written or skipped), built from the end
        n = len(pairs)
        # their lengths first (the strings grow quadratically with the optional properties:
        # 1000 of them spent 4.5 s building 8 MB before the size check refused them)
        tail_n, lead_n = [0] * (n + 1), [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            size, req = len(pairs[i][0]), pairs[i][1]
            tail_n[i] = (len(sep) + size if req else len(sep) + size + 5) + tail_n[i + 1]
            lead_n[i] = size + tail_n[i + 1] + (0 if req else 5 if not lead_n[i + 1] else 5 + lead_n[i + 1])
        self.check_size(lead_n[0], path)
        tail, lead = [""] * (n + 1), [""] * (n + 1)
        for i in range(n - 1, -1, -1):
            pair, req = pairs[i]
            tail[i] = (sep + pair if req else "(?:" + sep + pair + ")?") + tail[i + 1]
            if req:
                lead[i] = pair + tail[i + 1]
            else:
                lead[i] = "(?:" + pair + tail[i + 1] + (")?" if not lead[i + 1] else "|" + lead[i + 1] + ")")
            self.check_size(len(lead[i]) // 8, path)  # a runaway guard; schema_to_regex checks the result
        return r"\{" + ws + lead[0] + ws + r"\}"

    @staticmethod
    def check_free_forbids(forbids: list[set[str]], patterns: dict[str, Any], extra: Any, hi: int | None,
                           path: str) -> None:
        """Free-form keys could spell every name of a forbidden set (an exclusive
        ``oneOf`` branch's narrowing): refused unless the object is always empty."""
        if forbids and hi != 0 and (patterns or extra is not False):
            raise SchemaError(f"json_schema at {path}: objects here must lack one of the names "
                              f"{sorted(sorted(f) for f in forbids)} ('not': {{'required': ...}}, or exclusive 'oneOf' "
                              "branches), which free-form keys (no listed 'properties') cannot be kept from writing")

    def check_size(self, n: int, path: str) -> None:
        """The regex being built stays under MAX_REGEX_CHARS and the wall-time limit."""
        if n > MAX_REGEX_CHARS:
            raise SchemaError(f"json_schema translates to a regex of more than {MAX_REGEX_CHARS} characters at {path}; "
                              "allowed: at most that (fewer optional properties, enums or alternatives)")
        self.check_deadline()

    def free_object(self, s: dict[str, Any], patterns: dict[str, Any], extra: Any, lo: int, hi: int | None,
                    path: str) -> str:
        """An object without listed properties: keys from ``propertyNames``, from the
        patterns of ``patternProperties`` (full matches, each pattern's keys matching no
        other pattern), or any key with the ``additionalProperties`` schema. A key may
        repeat in the text (JSON parsers keep the last one), so ``maxProperties`` bounds
        the pairs written and only ``minProperties`` <= 1 is enforced."""
        ws = self.ws
        if lo > 1:
            raise SchemaError(f"json_schema 'minProperties' at {path} is supported up to 1 on objects without listed "
                              f"'properties' (free-form keys could repeat); got {lo}")
        if patterns:
            if "propertyNames" in s:
                raise SchemaError(f"json_schema 'patternProperties' with 'propertyNames' at {path} is not supported")
            options = []
            for i, (pat, sub) in enumerate(patterns.items()):
                where = f"{path}/patternProperties/{pat}"
                others = [q for q in patterns if q != pat]
                key = '"' + _json_safe_pattern(pat, where) + '"'
                if others:
                    _check_keys_exclusive(key, others, where)
                try:
                    options.append(key + ws + ":" + ws + self.value(sub, where))
                except _Cutoff:
                    continue
            if not options:
                return r"\{" + ws + r"\}"
            pair = _alt(options)
        else:
            if extra is False:
                if lo > 0:
                    raise SchemaError(f"json_schema at {path}: no object satisfies 'minProperties' here")
                return r"\{" + ws + r"\}"
            names = s.get("propertyNames", True)
            if not isinstance(names, (dict, bool)):
                raise SchemaError(f"json_schema 'propertyNames' at {path} must be a schema")
            if names is False:
                return r"\{" + ws + r"\}"
            key = JSON_STRING if names is True else self.value({**names, "type": "string"}, path + "/propertyNames")
            try:
                value = (self.value(extra, path + "/additionalProperties") if isinstance(extra, dict)
                         else self.any(ANY_DEPTH - 1, path))
            except _Cutoff:
                return r"\{" + ws + r"\}"
            pair = key + ws + ":" + ws + value
        if _required_deps(s):
            raise SchemaError(f"json_schema 'dependentRequired' at {path} needs 'properties' to be listed")
        more = _repeat("(?:" + ws + "," + ws + pair + ")", 0, None if hi is None else hi - 1)
        body = pair + more
        if hi == 0:
            return r"\{" + ws + r"\}"
        return r"\{" + ws + (body if lo >= 1 else "(?:" + body + ")?") + ws + r"\}"

    def counted_fields(self, pairs: list[tuple[str, bool]], names: list[str], lo: int, hi: int | None,
                       deps: dict[str, list[str]], forbids: list[set[str]], counting: bool, path: str,
                       needs: list[set[str]] = ()) -> str:
        """The listed properties in order, required ones present, with between ``lo``
        and ``hi`` written in all (min/maxProperties, when ``counting``), every property
        in ``deps`` written only with the ones it depends on (dependentRequired), no
        set of ``forbids`` written whole and a name of each of ``needs``. Each choice of the optional properties these
        involve is its own branch, so at most MAX_COUNTED_OPTIONAL of them."""
        sep = self.ws + "," + self.ws
        involved = (set(deps) | {x for v in deps.values() for x in v} | {x for f in forbids for x in f}
                    | {x for nd in needs for x in nd})
        optional = [i for i, (_, req) in enumerate(pairs) if not req]
        branching = [i for i in optional if counting or names[i] in involved]
        if len(branching) > MAX_COUNTED_OPTIONAL:
            raise SchemaError(
                f"json_schema 'minProperties'/'maxProperties'/'dependentRequired' (or exclusive 'oneOf' branches) at "
                f"{path} are supported with at most {MAX_COUNTED_OPTIONAL} optional properties involved; "
                f"this object has {len(branching)}"
            )
        n_req = len(pairs) - len(optional)
        need_lo, need_hi = lo - n_req, None if hi is None else hi - n_req
        if not counting:
            need_lo, need_hi = 0, None
        left_after = [sum(1 for j in optional if j >= i) for i in range(len(pairs) + 1)]

        def rest(i: int, first: bool, taken: int, present: frozenset[str]) -> str | None:
            # properties i.. given whether one was written already, the optional ones
            # taken and the involved names written so far
            if taken + left_after[i] < need_lo or (need_hi is not None and taken > need_hi):
                return None
            if i == len(pairs):
                ok = (all(set(deps.get(n, ())) <= present for n in present) and not any(f <= present for f in forbids)
                      and all(nd & present for nd in needs))
                return "" if ok else None
            pair, req = pairs[i]
            lead = pair if first else sep + pair
            mark = present | {names[i]} if names[i] in involved else present
            if req:
                tail = rest(i + 1, False, taken, mark)
                return None if tail is None else lead + tail
            if not first and i not in branching:  # free to write or not: same state after
                tail = rest(i + 1, False, taken, present)
                return None if tail is None else "(?:" + lead + ")?" + tail
            take = rest(i + 1, False, taken + 1, mark)
            skip = rest(i + 1, first, taken, present)
            options = ([lead + take] if take is not None else []) + ([skip] if skip is not None else [])
            if not options:
                return None
            if len(options) == 1:
                return options[0]
            self.check_size((len(options[0]) + len(options[1])) // 8, path)
            return "(?:" + options[0] + ")?" if options[1] == "" else "(?:" + options[0] + "|" + options[1] + ")"

        body = rest(0, True, 0, frozenset())
        if body is None:
            raise _NoValue(
                f"json_schema at {path}: no object satisfies 'minProperties'/'maxProperties'/'dependentRequired' "
                "(or the exclusive 'oneOf' branches) here" + (
                    "" if not counting or lo <= len(pairs) else
                    f" (the regex translation writes only the {len(pairs)} listed properties here: other keys could "
                    "repeat in the text); allowed: a 'minProperties' the listed properties reach")
            )
        return body

    def unique_domain(self, s: dict[str, Any], path: str) -> list[Any] | None:
        """For ``uniqueItems``: the distinct values the items may take, when ``items``
        allows finitely many scalars (an enum/const, boolean, null) and there are no
        prefix items; else None."""
        items = s.get("items", True)
        if s.get("uniqueItems") is not True or "prefixItems" in s or not isinstance(items, dict):
            return None
        try:
            items = self.deref(items, path)
            if not isinstance(items, dict):
                return None
            if "enum" in items or "const" in items:
                values = self.finite_values(items, path)
            elif self.atoms(items, path) <= {"boolean", "null"} and "type" in items:
                values = [v for v in (False, True, None) if _atom(v) in self.atoms(items, path)]
            else:
                return None
        except SchemaError:
            return None
        if not all(v is None or isinstance(v, (str, int, float, bool)) for v in values):
            return None
        return values

    def unique_array(self, values: list[Any], lo: int, hi: int | None, path: str) -> str:
        """Arrays of distinct values in the order ``values`` lists them (each set of
        values written one way), with between ``lo`` and ``hi`` items."""
        ws, sep = self.ws, self.ws + "," + self.ws
        texts = [escape(self.dump(v)) for v in values]
        k = len(texts)
        hi = k if hi is None else min(hi, k)
        if lo > hi:
            raise SchemaError(f"json_schema at {path}: 'uniqueItems' with {k} possible values cannot reach 'minItems' {lo}")
        if k > MAX_UNIQUE_VALUES or (lo > 1 or hi < k) and k > MAX_COUNTED_OPTIONAL:
            raise SchemaError(f"json_schema 'uniqueItems' at {path} is supported over at most {MAX_UNIQUE_VALUES} "
                              f"values (at most {MAX_COUNTED_OPTIONAL} with minItems > 1 or a maxItems); got {k}")

        def rest(i: int, first: bool, taken: int) -> str | None:
            # values i.. given whether one was written and how many
            if taken + (k - i) < lo or taken > hi:
                return None
            if i == k:
                return ""
            lead = texts[i] if first else sep + texts[i]
            if not first and lo <= 1 and hi == k:  # counts do not matter past the first
                tail = rest(i + 1, False, taken + 1)
                return "(?:" + lead + ")?" + (tail or "")
            take, skip = rest(i + 1, False, taken + 1), rest(i + 1, first, taken)
            options = ([lead + take] if take is not None else []) + ([skip] if skip is not None else [])
            if not options:
                return None
            if len(options) == 1:
                return options[0]
            return "(?:" + options[0] + ")?" if options[1] == "" else "(?:" + options[0] + "|" + options[1] + ")"

        body = rest(0, True, 0)
        return r"\[" + ws + (body or "") + ws + r"\]"

    def array(self, s: dict[str, Any], path: str) -> str:
        ws = self.ws
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if not is_int(lo) or lo < 0 or (hi is not None and (not is_int(hi) or hi < lo)):
            raise SchemaError(f"json_schema 'minItems'/'maxItems' at {path} are invalid: {lo!r}, {hi!r}")
        if s.get("uniqueItems") is True and not (hi is not None and hi <= 1):
            values = self.unique_domain(s, path)
            if values is None:  # check_keywords let it through only with a domain
                raise SchemaError(f"json_schema keyword 'uniqueItems' at {path} is not supported: {WHY_NOT['uniqueItems']}")
            return self.unique_array(values, lo, hi, path)
        items = s.get("items", True)
        if "contains" in s:
            return self.array_containing(items, s["contains"], path)
        prefix, key = s.get("prefixItems", []), "prefixItems"
        if isinstance(items, list):  # draft 4: items as a list, additionalItems for the rest
            prefix, items, key = items, s.get("additionalItems", True), "items"
        # (beside a single 'items' schema, or none, 'additionalItems' is ignored: drafts 4 to
        # 2019-09 say so, and 2020-12 has no such keyword; jsonschema ignores it alike)
        if not isinstance(prefix, list):
            raise SchemaError(f"json_schema 'prefixItems' at {path} must be a list")
        pre = []
        for i, p in enumerate(prefix):
            try:
                pre.append(self.value(p, f"{path}/{key}/{i}"))
            except _NoValue:  # no item fits here (false, 'not: {}'): arrays end before it
                items = False
                break
        try:
            item = None if items is False else self.value(items, path + "/items")
        except _Cutoff:  # a recursion unrolled to its limit: arrays no longer than the prefix
            if lo > len(pre):
                raise
            item = None
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

    def array_containing(self, items: Any, contains: Any, path: str) -> str:
        """An array of ``items`` with an item that also satisfies ``contains``
        (:func:`_contains_supported`'s form): the first such item, every item before it
        any item, every item after it any item; exact, since each such array has a first
        item satisfying ``contains``."""
        ws, sep = self.ws, self.ws + "," + self.ws
        item = self.value(items, path + "/items")
        try:
            both = self.value(self.merge([items, contains], path + "/contains"), path + "/contains")
        except _NoValue:
            raise SchemaError(f"json_schema at {path}: no item satisfies both 'items' and 'contains'") from None
        return (r"\[" + ws + "(?:" + item + sep + ")*" + both + "(?:" + sep + item + ")*" + ws + r"\]")

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
_INTERNAL = "\x00"  # internal marks start with it (never a key of a user's schema)
_FRACTIONAL = "\x00fractional"  # the number has a non-zero fraction (not: {type: integer})
# the $refs a merge inlined (their targets' keywords are in the merged schema): value()
# translates it as expanding them, so a recursion through allOf, or through an anyOf
# branch merged with the keywords beside the list, is counted like a $ref (it is no
# constraint: jsonschema's reading of the schema is the same without it)
_VIA = "\x00via"


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


def _not_required(sub: Any) -> list[list[str]] | None:
    """The name sets ``not: sub`` forbids an object to have all of, when ``sub`` is
    ``{required: [...]}`` (its listed properties unconstrained) or an ``anyOf`` of such
    (each set forbidden); None for other forms."""
    if not isinstance(sub, dict):
        return None
    keys = set(sub) - ANNOTATIONS
    if keys == {"anyOf"} and isinstance(sub["anyOf"], list) and sub["anyOf"]:
        parts = [_not_required(x) for x in sub["anyOf"]]
        return None if any(p is None for p in parts) else [names for p in parts for names in p]
    req = sub.get("required")
    props = sub.get("properties", {})
    if (keys - {"properties"} != {"required"} or not isinstance(req, list) or not req
            or not all(isinstance(x, str) for x in req) or not isinstance(props, dict)
            or not all(v is True or v == {} for v in props.values())):
        return None
    return [list(req)]


def _not_values(sub: Any) -> list[Any] | None:
    """The values ``not: sub`` excludes when ``sub`` is an ``enum`` or ``const`` alone,
    or beside a ``type`` that every listed value has (the same values)."""
    if not isinstance(sub, dict):
        return None
    keys = set(sub) - ANNOTATIONS
    values = [sub["const"]] if "const" in sub else list(sub["enum"]) if isinstance(sub.get("enum"), list) else None
    if values is None or not (keys == {"const"} or keys == {"enum"} or len(keys) == 2 and "type" in keys):
        return None
    if "type" in keys:
        t = sub["type"]
        ts = t if isinstance(t, list) else [t]
        if not all(isinstance(x, str) for x in ts) or not all(any(_json_type_ok(v, x) for x in ts) for v in values):
            return None
    return values


def _string_except(words: list[str], path: str) -> str:
    """A JSON string (plait's layout) whose value is none of ``words``: along the trie
    of the words, end where no word ends, or write a character no word continues with
    (then anything), or follow a word. Words of plain printable ASCII only (a character
    with two spellings, such as ``/`` or an escape, is refused)."""
    plain = re.compile(r"[ !#-.0-\[\]-~]*")
    for w in words:
        if not plain.fullmatch(w):
            raise SchemaError(f"json_schema keyword 'not' at {path} is not supported: excluding {w!r} (only strings of "
                              "printable ASCII without quotes, backslashes or slashes can be excluded)")
    if len(words) > MAX_UNIQUE_VALUES or any(len(w) > MAX_EXCLUDED_CHARS for w in words):
        raise SchemaError(f"json_schema keyword 'not' at {path} is supported for at most {MAX_UNIQUE_VALUES} excluded "
                          f"strings of at most {MAX_EXCLUDED_CHARS} characters")
    ends, diverged = _trie_exits(
        words, escape, lambda kids: "[^" + r'"\\\x00-\x1f' + "".join("\\" + c if c in "\\]-[^&~" else c for c in kids) + "]"
        + r'|\\["\\/bfnrt]')
    # one shared tail after the divergence (a tail per branch makes outlines-core's
    # index build exponential in the words' length)
    return '"(?:' + "|".join([*ends, "(?:" + "|".join(diverged) + ")" + JSON_CHAR + "*"]) + ')"'


def _pattern_except(words: list[str]) -> str:
    """A ``pattern`` (read as a full match) of the strings that are none of ``words``:
    along the trie of the words, end where no word ends, or write a character no word
    continues with (then anything), as :func:`_string_except` writes the JSON text."""
    ends, diverged = _trie_exits(words, re.escape,
                                 lambda kids: "[^" + "".join(re.escape(c) for c in kids) + "]" if kids else "(?:.|\\n)")
    return "^(?:" + "|".join([*ends, "(?:" + "|".join(diverged) + ")(?:.|\\n)*"]) + ")$"


def _trie_exits(words: list[str], esc: Callable[[str], str], other: Callable[[list[str]], str]) -> tuple[list[str], list[str]]:
    """Where a string leaves the trie of ``words`` (characters spelt by ``esc``): the
    prefixes that end without being a word, and each prefix followed by ``other`` of the
    characters the trie continues it with (a character that leaves the trie there)."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for c in w:
            node = node.setdefault(c, {})
        node[""] = {}  # a word ends here
    ends: list[str] = []
    diverged: list[str] = []
    todo = [(trie, "")]
    while todo:
        node, prefix = todo.pop()
        kids = sorted(c for c in node if c)
        if "" not in node:
            ends.append(prefix)
        diverged.append(prefix + "(?:" + other(kids) + ")")
        todo += [(node[c], prefix + esc(c)) for c in kids]
    return ends, diverged


def _lift_not(s: dict[str, Any]) -> dict[str, Any]:
    """``not: {required: [...]}`` (and an ``anyOf`` of those) as the object's forbidden
    name sets (values other than objects satisfy it; an object must lack a name of each)."""
    forbids = _not_required(s.get("not"))
    if forbids is None:
        return s
    out = {k: v for k, v in s.items() if k != "not"}
    out[_FORBID] = [*out.get(_FORBID, []), *forbids]
    return out


def _lift_dependencies(s: dict[str, Any], *, public: bool = False) -> dict[str, Any]:
    """``s`` with its schema dependencies (``dependentSchemas``, and draft-7
    ``dependencies`` whose value is a schema) as ``allOf`` parts: for each name, the
    object lacks it, or has it and satisfies the schema (exact: neither case constrains
    values other than objects). The lack is plait's mark, or JSON Schema when ``public``.
    Name-list dependencies stay where they are; an empty map does nothing and is dropped."""
    parts: list[Any] = []
    out = dict(s)
    for key in ("dependentSchemas", "dependencies"):
        deps = s.get(key)
        if not isinstance(deps, dict):
            continue
        lists = {n: v for n, v in deps.items() if isinstance(v, list)}
        for name, sub in deps.items():
            if isinstance(sub, (dict, bool)):
                absent = {_FORBID: [[name]]}
                parts.append({"anyOf": [_public(absent) if public else absent,
                                        {"allOf": [{"required": [name]}, sub]}]})
            elif not isinstance(sub, list):
                return s  # neither form: left for the keyword checks to refuse by name
        if lists:
            out[key] = lists
        else:
            del out[key]
    if parts:
        out["allOf"] = [*out.get("allOf", []), *parts]
    return out


def _contains_supported(s: dict[str, Any]) -> bool:
    """``contains`` in the form :meth:`_Translator.array_containing` writes: beside
    ``items`` as one schema (or none), ``minItems`` at most 1, ``minContains`` 1 (or
    absent), and no ``maxItems``, ``prefixItems``, ``additionalItems``, ``maxContains``
    or ``uniqueItems: true``."""
    return (isinstance(s.get("contains"), (dict, bool)) and isinstance(s.get("items", True), (dict, bool))
            and is_int(s.get("minItems", 0)) and s.get("minItems", 0) <= 1 and s.get("minContains", 1) == 1
            and not any(k in s for k in ("maxItems", "prefixItems", "additionalItems", "maxContains"))
            and s.get("uniqueItems", False) is False)


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
    """``multipleOf`` is a positive number and the schema names a numeric type (the
    regex then comes from :meth:`_Translator.multiples`, which refuses by name the forms
    it cannot write). Without a type, any number would be written."""
    k = s.get("multipleOf")
    if not _is_num(k) or k <= 0:
        return False
    t = s.get("type")
    ts = t if isinstance(t, list) else [t]
    return "integer" in ts or "number" in ts


def _float_quotient_example(k: float, step: Fraction) -> str:
    """`` (0.07 / 0.01 is 7.000000000000001)``: the first multiple of ``step`` whose float
    quotient by ``k`` is not an integer, or ""."""
    for j in range(1, 1000):
        v = float(step * j)
        if v / k != int(v / k):
            return f" ({_decimal_text(step * j)} / {k!r} is {v / k!r})"
    return ""


def _bound_text(j: int | None, step: Fraction) -> str:
    return "unbounded" if j is None else _decimal_text(step * j)


_FORBID = "\x00forbid"  # name sets the object must not have all of (exclusive oneOf branches)
_NEED_ONE_OF = "\x00need"  # name lists the object must have one name of (exclusive oneOf branches)
_KIND_ATOMS = {"null": {"null"}, "boolean": {"boolean"}, "string": {"string"}, "number": {"int", "frac"},
               "object": {"object"}, "array": {"array"}}
_KIND_TYPES = {"null": ("null",), "boolean": ("boolean",), "string": ("string",), "number": ("number",),
               "object": ("object",), "array": ("array",)}
MAX_NEED_NAMES = 8  # oneOf narrowing: an object must carry one of at most this many names
MAX_ANY_OF_PRODUCT = 256  # allOf of two anyOf lists: the merged pairs
MAX_EXCLUDED_CHARS = 64  # not: {enum}: characters of an excluded string


def _float_inexact(v: int) -> bool:
    """A 64-bit float does not hold the integer ``v`` exactly."""
    try:
        return int(float(v)) != v
    except OverflowError:
        return True


def _validates(keyword: str) -> bool:
    """``keyword`` is a validation keyword of some draft (else an annotation, ignored)."""
    return keyword in KNOWN or keyword in WHY_NOT or keyword in _OTHER_VALIDATION or keyword.startswith(_INTERNAL)


class _NoValue(SchemaError):
    """No value satisfies this subschema (an alternative holding it is left out)."""


class _Cutoff(Exception):
    """A recursive $ref reached its unrolling limit: the optional place holding it is
    left out (the property, the array's items, the alternative)."""


def _search(pattern: str, name: str) -> bool:
    import re as _re

    try:
        return bounded_search(pattern, name)
    except _re.error:
        return False


MAX_MATCH_S = 1.0  # one pattern against one listed value or name, while translating


def bounded_search(pattern: str, text: str) -> bool:
    """``re.search(pattern, text)`` (how ``jsonschema`` reads ``pattern`` and
    ``patternProperties``), matched by the ``regex`` module under :data:`MAX_MATCH_S`:
    Python's ``re`` backtracks without limit and holds the GIL while it does, so
    ``^(a+)+$`` against a listed 40-character value stalled the whole front. Raises
    ``re.error`` for an invalid pattern and ``SchemaError`` past the limit."""
    import re as _re

    import regex

    try:  # ECMA-262's spellings Python reads otherwise (a \\p{L} as its explicit class)
        pattern = ecma_to_python(pattern)
    except ValueError as e:
        raise _re.error(str(e)) from None
    _re.compile(pattern)  # what re refuses is refused here too
    try:
        compiled = regex.compile(pattern)
    except regex.error:  # re reads it, regex does not: re's own match (a rare syntax corner)
        return _re.search(pattern, text) is not None
    try:
        # concurrent: the GIL is released while it matches (the front's loop goes on)
        return compiled.search(text, timeout=MAX_MATCH_S, concurrent=True) is not None
    except TimeoutError:
        raise SchemaError(f"json_schema pattern {pattern!r} takes longer than {MAX_MATCH_S:g} s to match "
                          f"{text[:40]!r} (catastrophic backtracking); allowed: patterns that match the schema's "
                          "listed values and names in time") from None


def _bounded_patterns(cls: Any) -> Any:
    """``cls`` (a ``jsonschema`` validator class) with ``pattern``, ``patternProperties``
    and ``additionalProperties`` matching through :func:`bounded_search`."""
    from jsonschema.exceptions import ValidationError
    from jsonschema.validators import extend

    def pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Any:
        if validator.is_type(instance, "string") and not bounded_search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Any:
        if not validator.is_type(instance, "object"):
            return
        for patrn, sub in patterns.items():
            for k, v in instance.items():
                if bounded_search(patrn, k):
                    yield from validator.descend(v, sub, path=k, schema_path=patrn)

    def additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Any:
        if not validator.is_type(instance, "object"):
            return
        props, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
        extras = [k for k in instance if k not in props and not any(bounded_search(p, k) for p in patterns)]
        if validator.is_type(extra, "object"):
            for k in extras:
                yield from validator.descend(instance[k], extra, path=k)
        elif not extra and extras:
            yield ValidationError(f"additional properties are not allowed ({sorted(extras)!r})")

    return extend(cls, {"pattern": pattern, "patternProperties": pattern_properties,
                        "additionalProperties": additional_properties})


MAX_INTERSECTION_CHARS = 20_000  # the regex of a pattern and a format together (state elimination may grow it)


def _pattern_and_format(pattern: Any, fmt: str, fmt_regex: str, path: str,
                        lengths: tuple[int, int | None] | None) -> str:
    """The strings both ``pattern`` and ``format`` (and ``lengths``) admit, as a regex
    of a JSON string's content: the automata of the two intersected, written back as a
    regex by state elimination. Every format's characters need no JSON escape, so the
    written text is the value. Raises :class:`SchemaError` when no string satisfies
    both, or the automaton or its regex grows past the limits. ``fmt_regex``: the
    format's regex (``FORMATS[fmt]``, or :func:`_with_format_relaxed`'s)."""
    import interegular

    from plait.runtime.constrained.fsm_limits import FsmTooLarge, fsm_deadline

    both = f"json_schema keywords 'pattern' and 'format' {fmt!r} at {path}"
    content = _json_safe_pattern(pattern, path)
    # a match anywhere, as the schema asks (a full match alone, the stricter choice a
    # pattern on its own takes, would leave "^2024-" and a date no string)
    if not pattern.startswith("^"):
        content = JSON_CHAR + "*" + content
    if not (pattern.endswith("$") and not pattern.endswith("\\$")):
        content += JSON_CHAR + "*"
    try:
        with fsm_deadline():
            fsm = interegular.parse_pattern(content).to_fsm() & interegular.parse_pattern(fmt_regex).to_fsm()
            if lengths is not None:
                lo, hi = lengths
                wmin, wmax = _pattern_tree(fmt_regex, path).getwidth()
                if lo > wmin or (hi is not None and hi < wmax):  # (else every value of the format fits)
                    fsm = fsm & interegular.parse_pattern(f"[^\\x00]{{{lo},{'' if hi is None else hi}}}").to_fsm()
            fsm = fsm.reduce()
    except FsmTooLarge as e:
        raise _TooLarge(f"{both}: their automata are too complex to combine ({e})") from None
    return _fsm_regex(fsm, both)  # (refused there when no string satisfies both)


MAX_INTERSECTION_STATES = 2_000  # the automaton of a pattern and a format together, before elimination


class _TooLarge(SchemaError):
    """An automaton or its regex past the intersection limits (not a schema no string
    satisfies)."""


def _with_format_relaxed(build: Any, fmt: str | None) -> str:
    """``build(fmt)``; where a pattern and a format with counted maxima (email's
    64-character local part, 63-character labels) make too large an automaton or regex
    together, ``build`` again with the format's maxima dropped (its minima and shape
    kept: ajv's email format has no maxima either; jsonschema checks an email for its
    '@'). The format's own regex, without a pattern, keeps them."""
    try:
        return build(None if fmt is None else FORMATS[fmt])
    except _TooLarge:
        relaxed = None if fmt is None else re.sub(r"\{(\d+),\d+\}", r"{\1,}", FORMATS[fmt])
        if relaxed is None or relaxed == FORMATS[fmt]:
            raise
        return build(relaxed)


def _leading_lookaheads(pattern: Any, path: str) -> tuple[list[Any], list[tuple[bool, list[Any]]]] | None:
    """For a pattern anchored at its start whose look-aheads all come right after the
    anchor (``^(?=A)(?!B)rest``): (the parse items of ``^rest``, [(positive, the items
    of A), ...]); else None (a look-ahead elsewhere is refused where it is read)."""
    from re import _constants as C  # type: ignore[attr-defined]

    items = list(_pattern_tree(pattern, path))
    if not items or items[0][0] is not C.AT or items[0][1] not in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
        return None
    i, looks = 1, []
    while i < len(items) and items[i][0] in (C.ASSERT, C.ASSERT_NOT) and items[i][1][0] == 1:
        looks.append((items[i][0] is C.ASSERT, list(items[i][1][1])))
        i += 1
    return ([items[0], *items[i:]], looks) if looks else None


def _pattern_with_lookaheads(pattern: str, path: str, split: tuple[list[Any], list[tuple[bool, list[Any]]]],
                             fmt_regex: str | None, lengths: tuple[int, int | None] | None,
                             json_text: bool = True) -> str:
    """The strings a pattern with look-aheads at its start admits (and a format's
    ``fmt_regex``, and ``lengths``), as a regex of a JSON string's content
    (``json_text``; else of the value, for llguidance, without format and lengths,
    which it reads itself):
    the automaton of the rest of the pattern, intersected with each positive
    look-ahead's (followed by anything) and without each negative one's, written back
    as a regex by state elimination. The same limits as :func:`_pattern_and_format`."""
    import interegular

    from re import _constants as C  # type: ignore[attr-defined]

    from plait.runtime.constrained.fsm_limits import FsmTooLarge, fsm_deadline

    what = f"json_schema 'pattern' at {path} ({pattern[:80]!r}), read with its look-aheads"

    def anchored_end(items: list[Any]) -> bool:
        return bool(items) and items[-1][0] is C.AT and items[-1][1] in (C.AT_END, C.AT_END_STRING)

    rest, looks = split
    anything = JSON_CHAR + "*" if json_text else r"(?:.|\n)*"
    content = _emit_pattern(rest, pattern, path, json_text=json_text) + ("" if anchored_end(rest) else anything)
    parts = [(positive, _emit_pattern(sub, pattern, path, json_text=json_text)
              + ("" if anchored_end(sub) else anything)) for positive, sub in looks]
    try:
        with fsm_deadline():
            fsm = interegular.parse_pattern(content).to_fsm()
            for positive, part in parts:
                other = interegular.parse_pattern(part).to_fsm()
                fsm = fsm & other if positive else fsm.difference(other)
            if fmt_regex is not None:
                fsm = fsm.reduce() & interegular.parse_pattern(fmt_regex).to_fsm()
            if lengths is not None:  # (counted in characters of the value: an escape is one)
                lo, hi = lengths
                fsm = fsm & interegular.parse_pattern(f"(?:{JSON_CHAR}){{{lo},{'' if hi is None else hi}}}").to_fsm()
            fsm = fsm.reduce()
    except FsmTooLarge as e:
        raise _TooLarge(f"{what}: its automaton is too complex ({e})") from None
    except (ValueError, KeyError, NotImplementedError) as e:  # a construct interegular cannot read
        raise SchemaError(f"{what}: it cannot be compiled ({e})") from None
    out = _fsm_regex(fsm, what)
    if json_text:
        check_regex(out, what)
    return out


def _fsm_regex(fsm: Any, what: str) -> str:
    """The regex of an interegular automaton (state elimination, the state with the
    fewest paths through it first); ``what`` names it in the errors."""
    from interegular.fsm import anything_else

    if len(fsm.states) > MAX_INTERSECTION_STATES:
        raise _TooLarge(f"{what}: together they make an automaton of {len(fsm.states)} states; supported: at most "
                          f"{MAX_INTERSECTION_STATES}")
    # each transition's characters; "any other character" (a pattern's '.', a negated class)
    # is every character the automaton does not list, never one JSON text must escape
    listed = sorted({c for chars in fsm.alphabet.by_transition.values() for c in chars if c is not anything_else})
    others = "[^" + _runs_body(listed) + r'"\\\x00-\x1f]'
    classes: dict[Any, list[str]] = {}
    for sym, chars in fsm.alphabet.by_transition.items():
        classes[sym] = sorted(c for c in chars if c is not anything_else)
        if anything_else in chars:
            classes[sym].append(others)
    # the states a final one is reachable from: one backward search (islive per state
    # searched forward from each again)
    back: dict[Any, set[Any]] = {}
    for q, row in fsm.map.items():
        for nxt in row.values():
            back.setdefault(nxt, set()).add(q)
    live, todo = set(fsm.finals), list(fsm.finals)
    while todo:
        for p in back.get(todo.pop(), ()):
            if p not in live:
                live.add(p)
                todo.append(p)
    if fsm.initial not in live:
        raise SchemaError(f"{what}: no string satisfies both")
    start, end = "start", "end"
    edges: dict[tuple[Any, Any], list[str]] = {(start, fsm.initial): [""]}
    for q in live:
        by_target: dict[Any, list[str]] = {}
        for sym, nxt in fsm.map.get(q, {}).items():
            if nxt in live and sym in classes:
                by_target.setdefault(nxt, []).extend(classes[sym])
        for nxt, chars in by_target.items():
            edges[(q, nxt)] = [_char_class(chars)]
        if q in fsm.finals:
            edges[(q, end)] = [""]

    def too_large() -> SchemaError:
        return _TooLarge(f"{what}: together they make a regex past {MAX_INTERSECTION_CHARS} characters; "
                           "supported: a pattern and a format that combine into a smaller one")

    left = eliminate(edges, list(live), max_chars=MAX_INTERSECTION_CHARS, too_large=too_large)
    return union(left.get((start, end), [""]))


def _class_lit(c: str) -> str:
    if " " <= c <= "~":
        return "\\" + c if c in "]\\^-[" else c
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def _char_class(chars: list[str]) -> str:
    """A class of ``chars``, runs of consecutive ones as ranges (``[0-9a-f]``); an
    entry that is already a class (``[^...]``, any other character) joins as an
    alternative."""
    whole = [c for c in chars if len(c) > 1]
    chars = sorted({c for c in chars if len(c) == 1})
    if whole:
        return "(?:" + "|".join(([_char_class(chars)] if chars else []) + whole) + ")"
    if len(chars) == 1:
        return re.escape(chars[0])
    return "[" + _runs_body(chars) + "]"


def _runs_body(chars: list[str]) -> str:
    """The inside of a class of ``chars``: runs of consecutive ones as ranges."""
    runs: list[list[str]] = []
    for c in sorted(set(chars)):
        if runs and ord(c) == ord(runs[-1][-1]) + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    lit = _class_lit
    return "".join(lit(r[0]) + ("-" + lit(r[-1]) if len(r) > 2 else lit(r[-1]) if len(r) == 2 else "") for r in runs)


def _check_keys_exclusive(key: str, others: list[str], path: str) -> None:
    """No key that ``key`` (a JSON string regex) writes contains a match of another
    pattern of ``patternProperties`` (whose schema would then apply too)."""
    import interegular

    from plait.runtime.constrained.fsm_limits import FsmTooLarge, fsm_deadline

    content = key[1:-1]
    try:
        with fsm_deadline():  # a short pattern can have an exponential automaton
            fsm = interegular.parse_pattern(content).to_fsm()
            for q in others:
                q = q[1:] if q.startswith("^") else ".*" + q
                q = q[:-1] if q.endswith("$") and not q.endswith("\\$") else q + ".*"
                if not (fsm & interegular.parse_pattern(q).to_fsm()).empty():
                    raise SchemaError(f"json_schema 'patternProperties' at {path}: keys of this pattern can also "
                                      f"match {q!r}; supported: patterns whose keys are exclusive")
    except SchemaError:
        raise
    except FsmTooLarge as e:
        raise SchemaError(f"json_schema 'patternProperties' at {path}: the patterns are too complex to check that "
                          f"they are exclusive ({e}); allowed: patterns whose automata build within the limit") from None
    except Exception as e:
        raise SchemaError(f"json_schema 'patternProperties' at {path}: could not check the patterns are exclusive "
                          f"({str(e)[:80]})") from None


def _atom(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "int" if float(v).is_integer() else "frac"
    return {str: "string", dict: "object", list: "array"}.get(type(v), "string")


def _json_key(v: Any) -> Any:
    """A hashable key with JSON equality (as :func:`_json_equal`): ``1`` and ``1.0``
    share a key, ``true`` and ``1`` do not. Comparing lists of values through it is
    linear: a 20 000-value ``enum`` compared pairwise took a minute to translate."""
    if isinstance(v, bool) or v is None:
        return ("b", v)
    if isinstance(v, (int, float)):
        return ("n", v)  # Python's int/float equality and hash agree: 1 == 1.0, same hash
    if isinstance(v, list):
        return ("a", tuple(_json_key(x) for x in v))
    if isinstance(v, dict):
        return ("o", frozenset((k, _json_key(x)) for k, x in v.items()))
    return (type(v).__name__, v)


def _json_unique(values: list[Any]) -> list[Any]:
    """``values`` without JSON-equal repeats, first occurrences in order."""
    seen: set[Any] = set()
    out = []
    for v in values:
        k = _json_key(v)
        if k not in seen:
            seen.add(k)
            out.append(v)
    return out


def _json_common(a: list[Any], b: list[Any]) -> list[Any]:
    """The values of ``a`` JSON-equal to some value of ``b``, in ``a``'s order."""
    keys = {_json_key(y) for y in b}
    return [x for x in a if _json_key(x) in keys]


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality (as ``enum`` and ``uniqueItems`` compare): 1 == 1.0, true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _alt(parts: list[str]) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _repeat(x: str, lo: int, hi: int | None) -> str:
    if hi is not None and hi <= 0:
        return ""
    if hi is not None and hi > MAX_REPEAT:
        # (a maxLength / maxItems of 2**40: no output reaches it, and a count past u32 is
        # not a regex the backends read: "a repetition count above 4294967295", a 400)
        hi = None
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


def schema_decimal(v: int | float) -> Fraction:
    """A number from a schema as the decimal it was written as: an integer exactly, a
    float as its shortest decimal that parses back to it (``repr``: 0.1 is 1/10, not the
    binary 0.1000000000000000055...). That is the literal whenever the literal has at
    most 15 significant digits (a float tells those apart); a longer literal was already
    rounded by the JSON parse, and the float's shortest decimal stands for it."""
    return Fraction(v) if isinstance(v, int) else Fraction(Decimal(repr(float(v))))


def _decimal_text(v: Fraction) -> str:
    """A decimal fraction written out plainly (no exponent): 7/100 is '0.07'."""
    d = Decimal(v.numerator) / Decimal(v.denominator)
    return format(d.normalize(), "f")


def number_range_regex(lo: int | Fraction | None, hi: int | Fraction | None, lo_open: bool = False,
                       hi_open: bool = False) -> str:
    """Numbers (no exponent, at most MAX_DIGITS integer digits) between decimal bounds
    (None: unbounded), each inclusive or open (``lo_open``: ``v > lo``), compared
    exactly. Fractions have 1 to MAX_DIGITS digits (trailing zeros included); negative
    zero is not written.

    NOTE: a validator reads the text as the float nearest to it. Beside a closed bound
    that is sound whatever the digits: rounding keeps order, so ``v >= lo`` gives
    ``float(v) >= float(lo)`` (it may reach the bound, which is allowed). Beside an open
    bound it could land on it (0.99999999999999999 parses to 1.0), so there fractions
    have at most OPEN_BOUND_FRACTION digits and the bounds are below OPEN_BOUND_LIMIT in
    magnitude: a text near the bound has at most 15 significant digits, and two such
    decimals parse to different floats, as does such a decimal and a bound whose
    shortest decimal is longer. A text beyond MAX_DIGITS' precision that parses onto a
    closed bound from outside (jsonschema accepts it) is not admitted."""
    if lo_open or hi_open:
        if any(b is not None and abs(b) >= OPEN_BOUND_LIMIT for b in (lo, hi)):
            raise SchemaError(f"exclusive bounds on numbers are supported up to {OPEN_BOUND_LIMIT:.0e} in magnitude")
        digits = OPEN_BOUND_FRACTION
    else:
        digits = MAX_DIGITS
    scale = 10**digits
    top = 10**MAX_DIGITS * scale - 1  # the largest magnitude written, in units of 10**-digits
    # the bounds on the grid of written values, inclusive
    a = None if lo is None else (math.floor(lo * scale) + 1 if lo_open else math.ceil(lo * scale))
    b = None if hi is None else (math.ceil(hi * scale) - 1 if hi_open else math.floor(hi * scale))
    a = None if a is not None and a < -top else a
    b = None if b is not None and b > top else b
    if (a is not None and b is not None and a > b) or (a is not None and a > top) or (b is not None and b < -top):
        raise SchemaError(f"no number of at most {MAX_DIGITS} integer digits lies between "
                          f"{'unbounded' if lo is None else _decimal_text(Fraction(lo))} and "
                          f"{'unbounded' if hi is None else _decimal_text(Fraction(hi))}")
    parts = []
    if a is None or a < 0:  # negative numbers: magnitudes from max(1, -b) up to -a
        parts.append("-" + _grid_range(1 if b is None else max(1, -b), None if a is None else -a, digits))
    if b is None or b >= 0:
        parts.append(_grid_range(0 if a is None else max(a, 0), b, digits))
    return _alt(parts)


def _grid_range(a: int, b: int | None, digits: int) -> str:
    """Texts of the non-negative numbers ``n / 10**digits``, ``a <= n <= b`` (None: up
    to MAX_DIGITS integer digits): a canonical integer part and an optional fraction of
    1 to ``digits`` digits."""
    scale = 10**digits
    ai, af = divmod(a, scale)
    lo_frac = str(af).zfill(digits)
    if b is not None:
        bi, bf = divmod(b, scale)
        hi_frac = str(bf).zfill(digits)
        if ai == bi:
            return str(ai) + _fraction(lo_frac, hi_frac)
    parts = [str(ai) + _fraction(lo_frac, "9" * digits)]
    if b is None or bi - 1 >= ai + 1:  # integer parts strictly between: any fraction
        if len(str(ai + 1)) <= MAX_DIGITS:
            parts.append(_nonneg_range(ai + 1, None if b is None else bi - 1) + _fraction("0" * digits, "9" * digits))
    if b is not None:
        parts.append(str(bi) + _fraction("0" * digits, hi_frac))
    return _alt(parts)


def _fraction(lo: str, hi: str) -> str:
    """An optional ``.digits`` part (1 to ``len(lo)`` digits) whose digits, padded with
    zeros to ``len(lo)``, lie between ``lo`` and ``hi``; no fraction when ``lo`` is 0."""
    body = r"\." + _padded_between(lo, hi)
    return "(?:" + body + ")?" if lo.strip("0") == "" else body


def _padded_between(lo: str, hi: str) -> str:
    """Digit strings of 1 to ``n = len(lo)`` digits that, padded with zeros to ``n``,
    lie between ``lo`` and ``hi`` (n digits each, ``lo <= hi``)."""
    n = len(lo)
    if lo.strip("0") == "" and hi.strip("9") == "":
        return "[0-9]" if n == 1 else "[0-9]{1,%d}" % n
    if lo.strip("0") == "" and hi.strip("0") == "":
        return "0" if n == 1 else "0{1,%d}" % n

    def rest(lo_rest: str, hi_rest: str) -> str:  # what follows the first digit: 0 to n - 1 digits
        if not lo_rest:
            return ""
        body = _padded_between(lo_rest, hi_rest)
        return "(?:" + body + ")?" if lo_rest.strip("0") == "" else body

    if lo[0] == hi[0]:
        return lo[0] + rest(lo[1:], hi[1:])
    parts = [lo[0] + rest(lo[1:], "9" * (n - 1))]
    first, last = int(lo[0]) + 1, int(hi[0]) - 1
    if first <= last:
        cls = str(first) if first == last else f"[{first}-{last}]"
        parts.append(cls + ("" if n == 1 else "[0-9]{0,%d}" % (n - 1)))
    parts.append(hi[0] + rest("0" * (n - 1), hi[1:]))
    return _alt(parts)


def multiples_regex(step: Fraction, int_digits: int, j_lo: int | None, j_hi: int | None) -> str:
    """Texts of ``step * j`` for the integers ``j_lo <= j <= j_hi`` (None: unbounded),
    at most ``int_digits`` integer digits. ``step`` is an integer or a fraction over
    ``2**e``; a multiple is written with 0 to ``e`` fraction digits (``e`` digits write
    any of them exactly: 0.25 -> '0.25'; '1.5', '1.50'), an integral one also without
    a fraction; negative zero is not written. Both bounds given: the multiples are
    listed (at most MAX_MULTIPLE_FORMS). Else ``j_lo`` is None, 0 or 1 and ``j_hi``
    None, 0 or -1 (bounds at zero), and the step's digit pattern repeats: whether a
    value is a multiple is read off its last digits."""
    frac_digits = (step.denominator.bit_length() - 1)  # 1 / 2**e has e fraction digits
    limit = 10**int_digits

    def forms(v: Fraction) -> list[str]:  # v >= 0, a multiple of step
        whole, frac = divmod(v.numerator * 10**frac_digits // v.denominator, 10**frac_digits)
        if frac_digits == 0:
            return [str(whole)]
        f = str(frac).zfill(frac_digits).rstrip("0")
        if not f:
            return [str(whole)] + [f"{whole}." + "0" * z for z in range(1, frac_digits + 1)]
        return [f"{whole}.{f}" + "0" * z for z in range(frac_digits - len(f) + 1)]

    if j_lo is not None and j_hi is not None and j_hi - j_lo < MAX_MULTIPLE_FORMS:
        words = []
        for j in range(j_lo, j_hi + 1):
            v = step * j
            if abs(v) < limit:
                words += [("-" if v < 0 else "") + w for w in forms(abs(v))]
        if not words:
            raise SchemaError(f"no multiple of {_decimal_text(step)} between the bounds has at most {int_digits} "
                              "integer digits")
        return _trie_regex(words)
    # the last `tail` digits of value * 10**frac_digits decide: n = value * 10**frac_digits
    # is a multiple of a = step * 10**frac_digits, and a divides 10**m when its only prime
    # factors are 2 and 5
    a = int(step * 10**frac_digits)
    m, rest = 0, a
    while rest % 10 == 0:
        rest, m = rest // 10, m + 1
    twos = fives = 0
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        raise SchemaError(f"without both 'minimum' and 'maximum' a multiple is recognised by its last digits, "
                          f"which needs a step n or n / 2**e where n has no prime factor but 2 and 5 (2, 4, 25, 100, "
                          f"0.5, 0.25, 2.5); {_decimal_text(step)} has the factor {rest}; with both bounds, at most "
                          f"{MAX_MULTIPLE_FORMS} multiples are listed")
    tail = max(m + max(twos, fives), frac_digits)
    if 10**tail // a > MAX_MULTIPLE_FORMS:
        raise SchemaError(f"the multiples of {_decimal_text(step)} are read off their last {tail} digits: "
                          f"{10**tail // a} endings, more than the {MAX_MULTIPLE_FORMS} allowed")
    int_tail = tail - frac_digits  # integer digits within the tail
    long_tails, short = [], []  # endings after a non-zero prefix; numbers that are only a tail
    for n in range(0, 10**tail, a):
        v = Fraction(n, 10**frac_digits)
        for w in forms(v):
            whole, dot, frac = w.partition(".")
            long_tails.append((whole.zfill(int_tail) if int_tail else "") + dot + frac)
            if v and len(whole) <= int_digits:
                short.append(w)
    zero = _trie_regex(forms(Fraction(0)))
    positive = [_trie_regex(short)] if short else []
    if int_digits > int_tail:
        positive.append("[1-9]" + ("[0-9]{0,%d}" % (int_digits - int_tail - 1) if int_digits - int_tail > 1 else "")
                        + _trie_regex(long_tails))
    parts = []
    if positive and j_lo is None:  # no positive multiple fits (a step of 1e20): zero alone
        parts.append("-" + _alt(positive))
    if (j_lo is None or j_lo <= 0) and (j_hi is None or j_hi >= 0):
        parts.append(zero)
    if positive and j_hi is None:
        parts.append(_alt(positive))
    if not parts:
        raise SchemaError(f"no multiple of {_decimal_text(step)} on this side of zero has at most {int_digits} "
                          "integer digits")
    return _alt(parts)


def _trie_regex(words: list[str]) -> str:
    """A regex matching exactly ``words`` (literal texts), sharing their prefixes;
    characters leading to the same rest are one class."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        by_rest: dict[str, list[str]] = {}
        for ch, child in node.items():
            if ch:
                by_rest.setdefault(emit(child), []).append(ch)
        branches = []
        for rest, chars in by_rest.items():
            if len(chars) == 1:
                head = escape(chars[0])
            else:
                head = "[" + "".join("\\" + c if c in "\\]^-" else c for c in sorted(chars)) + "]"
            branches.append(head + rest)
        if not branches:
            return ""
        body = _alt(branches)
        if "" not in node:
            return body
        return "(?:" + body + ")?" if len(branches) > 1 or len(body) > 1 else body + "?"

    return emit(trie)


_UNSAFE = frozenset('"\\') | frozenset(chr(c) for c in range(0x20))
# the unsafe characters JSON can write with a short escape, as the text that writes them
_SHORT_ESCAPES = {'"': r'\\"', "\\": r"\\\\", "\n": r"\\n", "\t": r"\\t", "\r": r"\\r", "\b": r"\\b", "\f": r"\\f"}


_CLASS_ESCAPES = frozenset("dDwWsS")


# ECMA-262's Unicode property classes (``\\p{L}``, ``\\P{Lu}``, ``\\p{Letter}``,
# ``\\p{gc=Nd}``) by General_Category: JSON Schema's patterns are ECMA-262, and pydantic,
# whose patterns Rust's regex reads, writes them (``constr(pattern=r"^\\p{L}+$")``).
# Python's ``re`` has none, so each becomes the explicit class of its code points
# (Python's Unicode tables; surrogates left out, as no valid text holds one alone).
_CATEGORY_ALIASES = {
    "Letter": "L", "Cased_Letter": "LC", "Uppercase_Letter": "Lu", "Lowercase_Letter": "Ll",
    "Titlecase_Letter": "Lt", "Modifier_Letter": "Lm", "Other_Letter": "Lo", "Mark": "M", "Combining_Mark": "M",
    "Nonspacing_Mark": "Mn", "Spacing_Mark": "Mc", "Enclosing_Mark": "Me", "Number": "N", "Decimal_Number": "Nd",
    "digit": "Nd", "Letter_Number": "Nl", "Other_Number": "No", "Punctuation": "P", "punct": "P",
    "Connector_Punctuation": "Pc", "Dash_Punctuation": "Pd", "Open_Punctuation": "Ps", "Close_Punctuation": "Pe",
    "Initial_Punctuation": "Pi", "Final_Punctuation": "Pf", "Other_Punctuation": "Po", "Symbol": "S",
    "Math_Symbol": "Sm", "Currency_Symbol": "Sc", "Modifier_Symbol": "Sk", "Other_Symbol": "So", "Separator": "Z",
    "Space_Separator": "Zs", "Line_Separator": "Zl", "Paragraph_Separator": "Zp", "Other": "C", "Control": "Cc",
    "cntrl": "Cc", "Format": "Cf", "Private_Use": "Co", "Unassigned": "Cn",
}
_UNICODE_MAX = 0x10FFFF
_PROPERTY = re.compile(r"\\([pP])(?:\{([A-Za-z_=&]+)\}|([A-Z]))")  # \p{Lu}, or \pL as Rust's regex writes it


@functools.lru_cache(maxsize=1)
def _category_ranges() -> dict[str, tuple[tuple[int, int], ...]]:
    """Each two-letter General_Category's code points as ranges (one pass, ~0.3 s, once
    per process)."""
    import unicodedata

    ranges: dict[str, list[list[int]]] = {}
    for cp in range(_UNICODE_MAX + 1):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        rs = ranges.setdefault(unicodedata.category(chr(cp)), [])
        if rs and rs[-1][1] == cp - 1:
            rs[-1][1] = cp
        else:
            rs.append([cp, cp])
    return {k: tuple((a, b) for a, b in v) for k, v in ranges.items()}


@functools.lru_cache(maxsize=64)
def _property_ranges(name: str) -> tuple[tuple[int, int], ...]:
    """The code points of ECMA-262's ``\\p{name}`` as sorted, merged ranges, or
    ``ValueError`` naming what is supported."""
    for prefix in ("gc=", "General_Category="):
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = _CATEGORY_ALIASES.get(name, "LC" if name == "L&" else name)
    if name == "Any":
        return ((0, 0xD7FF), (0xE000, _UNICODE_MAX))
    if name == "ASCII":
        return ((0, 0x7F),)
    table = _category_ranges()
    if name == "LC":
        cats = ["Lu", "Ll", "Lt"]
    elif len(name) == 1 and name in "LMNPSZC":
        cats = [k for k in table if k[0] == name and k != "Cs"]
    elif len(name) == 2 and (name in table or name in ("Cn", "Co")) and name != "Cs":
        cats = [name]
    else:
        raise ValueError(f"\\p{{{name}}} is not supported; allowed: General_Category values (\\p{{L}}, \\p{{Lu}}, "
                         "\\p{N}, \\p{Letter}, \\p{gc=Nd}...), \\p{ASCII} and \\p{Any} (not scripts or other "
                         "properties)")
    merged: list[list[int]] = []
    for a, b in sorted(r for k in cats for r in table.get(k, ())):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def _complement(ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The code points outside ``ranges`` (surrogates left out)."""
    out, at = [], 0
    for a, b in sorted([*ranges, (0xD800, 0xDFFF)]):
        if a > at:
            out.append((at, a - 1))
        at = max(at, b + 1)
    if at <= _UNICODE_MAX:
        out.append((at, _UNICODE_MAX))
    return out


def _class_body(ranges: Any) -> str:
    def esc(cp: int) -> str:
        return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"

    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges)


@functools.lru_cache(maxsize=256)  # bounded_search reads the same pattern for every value it checks
def ecma_to_python(pattern: str) -> str:
    """An ECMA-262 ``pattern`` (the dialect JSON Schema names) in Python's ``re`` syntax,
    for the ECMA-262 spellings Python reads differently or not at all: a named group
    ``(?<name>...)`` becomes ``(?P<name>...)`` (look-behinds ``(?<=``/``(?<!`` stay), a
    ``-`` next to a class escape inside a class (``[\\w-_]``), a literal hyphen in
    ECMA-262, is escaped, and a Unicode property class (``\\p{L}``, ``\\P{Nd}``) becomes
    the explicit class of its code points (``ValueError`` for a property other than a
    General_Category). Everything else is passed through as written."""
    out: list[str] = []
    i, n, in_class, prop_at = 0, len(pattern), False, -1
    while i < n:
        c = pattern[i]
        if c == "\\":
            prop = _PROPERTY.match(pattern, i)
            if prop is not None:
                ranges = _property_ranges(prop.group(2) or prop.group(3))
                if prop.group(1) == "P":
                    ranges = tuple(_complement(ranges))
                if not ranges:
                    raise ValueError(f"{prop.group(0)} matches no character")
                out.append(_class_body(ranges) if in_class else f"[{_class_body(ranges)}]")
                prop_at = len(out)  # a '-' right after it inside a class is a literal
                i = prop.end()
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            elif c == "-" and (_is_class_escape(out[-1]) or _is_class_escape(pattern[i + 1:i + 3])
                               or prop_at == len(out) or pattern[i + 1:i + 3] in ("\\p", "\\P")):
                c = "\\-"
            out.append(c)
        elif c == "[":
            in_class = True
            out.append("[^" if pattern.startswith("[^", i) else "[")
            i += len(out[-1])
            if i < n and pattern[i] == "]":  # a leading ']' is a literal in Python's reading
                out.append("]")
                i += 1
            continue
        elif pattern.startswith("(?<", i) and not pattern.startswith(("(?<=", "(?<!"), i):
            out.append("(?P<")
            i += 3
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _is_class_escape(token: str) -> bool:
    return len(token) == 2 and token[0] == "\\" and token[1] in _CLASS_ESCAPES


def _pattern_tree(pattern: Any, path: str) -> Any:
    """A JSON Schema ``pattern`` parsed by Python's ``re`` (whose reading ``jsonschema``
    validates with; ECMA-262 spellings first rewritten by :func:`ecma_to_python`), or
    ``SchemaError``."""
    from re import _parser  # type: ignore[attr-defined]

    if not isinstance(pattern, str):
        raise SchemaError(f"json_schema 'pattern' at {path} must be a string")
    if len(pattern) > MAX_PATTERN_CHARS:  # before parsing: a 1 MiB alternation took seconds to refuse
        raise SchemaError(f"json_schema 'pattern' at {path} has {len(pattern)} characters; allowed: at most "
                          f"{MAX_PATTERN_CHARS} (the limit of a 'regex')")
    try:
        python = ecma_to_python(pattern)
    except ValueError as e:  # a Unicode property other than a General_Category
        raise SchemaError(f"json_schema 'pattern' at {path} ({pattern[:80]!r}): {e}") from None
    try:
        return _parser.parse(python)
    except Exception as e:
        raise SchemaError(f"json_schema 'pattern' at {path} ({pattern[:80]!r}) cannot be parsed: {e}") from None


def _json_safe_pattern(pattern: Any, path: str, lengths: tuple[int, int | None] | None = None) -> str:
    """A JSON Schema ``pattern`` as the text of a JSON string's content. A match
    anywhere is what the schema asks; a full match is a stricter, valid choice, so
    anchors at the ends are dropped (others are refused). Characters JSON must escape
    are written escaped (a quote as ``\\"``), control characters without a short escape
    are left out, and classes such as ``\\d`` or ``\\S`` are narrowed to ASCII, where
    every regex engine reads them alike: each change only narrows the language.

    ``lengths`` (minLength, maxLength): enforced when every match has such a length,
    or when the pattern is one repeated character class between fixed characters (the
    repeat count is narrowed); otherwise refused by name."""
    tree = _pattern_tree(pattern, path)
    items = list(tree)
    if lengths is not None:
        lo, hi = lengths
        wmin, wmax = tree.getwidth()
        if not (wmin >= lo and (hi is None or wmax <= hi)):
            items = _narrow_repeat(items, lo, hi, pattern, path)
    out = "(?:" + _emit_pattern(items, pattern, path, json_text=True) + ")"
    check_regex(out, f"json_schema 'pattern' at {path}")
    return out


def value_pattern(pattern: Any, path: str) -> str:
    """A JSON Schema ``pattern`` as a regex over the string's value, for an engine with
    Rust's regex syntax that finds a match anywhere (llguidance): ``^(?:...)$`` around
    the reading of :func:`_json_safe_pattern` (anchors at the ends dropped, a full
    match; ``\\d`` ``\\w`` ``\\s`` and their negations narrowed to ASCII, where Python
    and Rust read them alike), but every character written as itself, control
    characters with a short escape, quotes and backslashes included (the engine writes
    the JSON escapes; control characters that need ``\\uXXXX`` are left out, as the
    engine is told to write no such escape). It admits a subset of the strings
    Python's ``re.search`` finds a match in. Look-aheads right after a leading ``^``
    are read as :func:`_pattern_with_lookaheads` reads them."""
    looks = _leading_lookaheads(pattern, path)
    if looks is not None:
        return "^(?:" + _pattern_with_lookaheads(pattern, path, looks, None, None, json_text=False) + ")$"
    items = list(_pattern_tree(pattern, path))
    out = "^(?:" + _emit_pattern(items, pattern, path, json_text=False) + ")$"
    lone = next((c for c in out if 0xD800 <= ord(c) <= 0xDFFF), None)
    if lone is not None:  # Python matches it alone; the engine's JSON reads a pair of them as one character
        raise SchemaError(f"json_schema 'pattern' at {path} ({pattern[:80]!r}) holds a lone surrogate "
                          f"U+{ord(lone):04X}, which no valid Unicode text holds")
    return out


def _emit_pattern(items: list[Any], pattern: str, path: str, *, json_text: bool) -> str:
    try:
        return _Emit(path, pattern, json_text).seq(items, True, True)
    except _Unsupported as e:
        raise SchemaError(f"json_schema 'pattern' at {path} ({pattern[:80]!r}) uses {e}, which constrained decoding "
                          "does not support; allowed: regular expressions without look-around, back-references, "
                          "inline flags or inner anchors") from None


def _narrow_repeat(items: list[Any], lo: int, hi: int | None, pattern: str, path: str) -> list[Any]:
    """``items`` with its one variable repeat of a single character narrowed so that
    the whole has between ``lo`` and ``hi`` characters."""
    from re import _constants as C  # type: ignore[attr-defined]

    body = [it for it in items if it[0] is not C.AT]
    fixed, var = 0, None
    for i, (op, av) in enumerate(body):
        w = _width(op, av)
        if w[0] == w[1]:
            fixed += w[0]
        elif var is None and op in (C.MAX_REPEAT, C.MIN_REPEAT) and [_width(o, a) for o, a in av[2]] == [(1, 1)]:
            var = i
        else:
            var = -1
    if var is None or var < 0:
        raise SchemaError(
            f"json_schema keywords 'pattern' and 'minLength'/'maxLength' at {path} cannot be combined for "
            f"{pattern[:80]!r}: allowed when every match has an allowed length, or when the pattern is one repeated "
            "character (class) between fixed characters"
        )
    op, (rlo, rhi, sub) = body[var]
    top = None if rhi is C.MAXREPEAT else rhi
    nlo, nhi = max(rlo, lo - fixed), top if hi is None else (hi - fixed if top is None else min(top, hi - fixed))
    if nhi is not None and nhi < nlo:
        raise SchemaError(f"json_schema at {path}: no string matches 'pattern' with these 'minLength'/'maxLength'")
    body[var] = (op, (nlo, C.MAXREPEAT if nhi is None else nhi, sub))
    return body


def _width(op: Any, av: Any) -> tuple[int, int]:
    from re import _parser  # type: ignore[attr-defined]

    sub = _parser.SubPattern(_parser.State(), [(op, av)])
    return sub.getwidth()


class _Unsupported(Exception):
    pass


class _Emit:
    """Python ``re`` parse tree -> regex over the JSON text of a string's content
    (``json_text``) or over the string's value."""

    def __init__(self, path: str, pattern: str, json_text: bool) -> None:
        self.path, self.pattern, self.json_text = path, pattern, json_text

    def seq(self, items: list[Any], at_start: bool, at_end: bool) -> str:
        from re import _constants as C  # type: ignore[attr-defined]

        out = []
        for i, (op, av) in enumerate(items):
            lead = at_start and all(o is C.AT for o, _ in items[:i])
            tail = at_end and all(o is C.AT for o, _ in items[i + 1:])
            if op is C.AT:
                ok = (lead and av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING)) or (
                    tail and av in (C.AT_END, C.AT_END_STRING))
                if not ok:
                    raise _Unsupported("an anchor or word boundary inside the pattern")
                continue
            out.append(self.node(op, av, lead, tail))
        return "".join(out)

    def node(self, op: Any, av: Any, lead: bool, tail: bool) -> str:
        from re import _constants as C  # type: ignore[attr-defined]

        if op is C.LITERAL:
            return _emit_chars({chr(av)}, "", self.json_text)
        if op is C.NOT_LITERAL:
            return _emit_class([(C.NEGATE, None), (C.LITERAL, av)], self.json_text)
        if op is C.ANY:
            return _emit_class([(C.NEGATE, None), (C.LITERAL, 10)], self.json_text)
        if op is C.IN:
            return _emit_class(av, self.json_text)
        if op is C.CATEGORY:
            return _emit_class([(C.CATEGORY, av)], self.json_text)
        if op is C.BRANCH:
            return "(?:" + "|".join(self.seq(list(b), lead, tail) for b in av[1]) + ")"
        if op is C.SUBPATTERN:
            _, add, dele, body = av
            if add or dele:
                raise _Unsupported("an inline flag")
            return "(?:" + self.seq(list(body), lead, tail) + ")"
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, body = av
            inner = "(?:" + self.seq(list(body), False, False) + ")"
            if hi is C.MAXREPEAT:
                return inner + ("*" if lo == 0 else "+" if lo == 1 else "{%d,}" % lo)
            return inner + ("{%d}" % lo if lo == hi else "{%d,%d}" % (lo, hi))
        names = {"ASSERT": "a look-ahead", "ASSERT_NOT": "a negative look-ahead", "GROUPREF": "a back-reference",
                 "GROUPREF_EXISTS": "a conditional", "POSSESSIVE_REPEAT": "a possessive repeat",
                 "ATOMIC_GROUP": "an atomic group"}
        raise _Unsupported(names.get(str(op), str(op).lower()))


_CATEGORY_RE = {"CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D", "CATEGORY_SPACE": r"\s",
                "CATEGORY_NOT_SPACE": r"\S", "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W"}


def _class_has(items: list[Any], c: int) -> bool:
    """Whether character ``c`` is in the parsed class ``items`` (Python's reading)."""
    import re as _re
    from re import _constants as C  # type: ignore[attr-defined]

    neg, hit = False, False
    for op, av in items:
        if op is C.NEGATE:
            neg = True
        elif op is C.LITERAL:
            hit |= c == av
        elif op is C.RANGE:
            hit |= av[0] <= c <= av[1]
        elif op is C.CATEGORY:
            hit |= _re.fullmatch(_CATEGORY_RE[str(av)], chr(c)) is not None
        else:
            raise _Unsupported(f"the class item {op}")
    return hit != neg


def _emit_class(items: list[Any], json_text: bool) -> str:
    """One character of the class: its ASCII members (every engine agrees on those),
    escaped when JSON must escape them (``json_text``), plus its non-ASCII members when
    the class reads them the same in Rust and Python (no \\d, \\w, \\s inside)."""
    from re import _constants as C  # type: ignore[attr-defined]

    ascii_members = {chr(c) for c in range(0x80) if _class_has(items, c)}
    has_category = any(op is C.CATEGORY for op, _ in items)
    negated = bool(items) and items[0][0] is C.NEGATE
    extra = ""
    if not has_category:
        if negated:  # every non-ASCII character but the listed ones
            listed = [(op, av) for op, av in items[1:]]
            extra = "[^\\x00-\\x7f" + "".join(_class_item(op, av) for op, av in listed if _item_top(op, av) >= 0x80) + "]"
        else:
            extra = "".join(_class_item(op, av) for op, av in items if _item_top(op, av) >= 0x80)
            extra = "[" + extra + "]" if extra else ""
    return _emit_chars(ascii_members, extra, json_text)


def _item_top(op: Any, av: Any) -> int:
    from re import _constants as C  # type: ignore[attr-defined]

    return av if op is C.LITERAL else av[1] if op is C.RANGE else -1


def _class_item(op: Any, av: Any) -> str:
    """A literal or range of a class, non-ASCII part only (ASCII is listed separately)."""
    from re import _constants as C  # type: ignore[attr-defined]

    if op is C.LITERAL:
        return chr(av)
    lo = max(av[0], 0x80)
    return chr(lo) if lo == av[1] else chr(lo) + "-" + chr(av[1])


def _emit_chars(chars: set[str], extra: str, json_text: bool) -> str:
    """One of ``chars`` (ASCII, or any), plus the class ``extra``: as JSON text
    (``json_text``: quotes, backslashes and short-escape control characters written
    escaped, other control characters left out) or as the characters themselves (those
    JSON writes without ``\\uXXXX``)."""
    if not json_text:
        # control characters without a short escape left out here too: the JSON compiler
        # is told to write no \u escape, so none can be written (and llguidance reads a
        # class holding every control character as "any character": '[^"]' took '\"')
        writable = {c for c in chars if c >= " " or c in _SHORT_ESCAPES}
        parts = [extra] if extra else []
        if writable:
            body = _ranges(sorted(writable))
            parts.insert(0, body if len(writable) == 1 else "[" + body + "]")
        if not parts:
            raise _Unsupported("a character class with only control characters (JSON cannot write them unescaped)"
                               if chars else "a character class no character is in")
        return _alt(parts)
    safe = sorted(c for c in chars if c not in _UNSAFE)
    parts = []
    if safe:
        if len(safe) == 1 and not extra:
            parts.append(escape(safe[0]) if ord(safe[0]) < 0x80 else safe[0])
        else:
            parts.append("[" + _ranges(safe) + "]")
    if extra:
        parts.append(extra)
    parts += [_SHORT_ESCAPES[c] for c in sorted(chars) if c in _SHORT_ESCAPES]
    if not parts:
        raise _Unsupported("a character class with only control characters (JSON cannot write them unescaped)")
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _ranges(chars: list[str]) -> str:
    """A class body for the sorted ASCII ``chars`` (as runs)."""
    out, i = [], 0
    codes = [ord(c) for c in chars]
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        a, b = codes[i], codes[j]
        one = (lambda c: chr(c) if chr(c).isalnum() or c >= 0x80 else "\\x%02x" % c)
        out.append(one(a) if a == b else one(a) + ("-" if b > a + 1 else "") + one(b))
        i = j + 1
    return "".join(out)
