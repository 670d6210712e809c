"""Regexes and JSON Schemas shared by the constrained-decoding tests."""

from __future__ import annotations

REGEXES = {
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z0-9._]{1,12}@[a-z]{1,10}\.(com|org|net)",
    "alternation": r"(red|green|blue) (cat|dog)s?",
    "unicode": r"(café|naïve|日本語|Ωμέγα) [αβγ]{2}",
}


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
        },
        "required": ["name", "address"],
    },
    "arrays_enums": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
            "point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False, "minItems": 2},
            "mode": {"const": "fast"},
            "ok": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 5},
        },
        "required": ["tags", "point", "mode"],
    },
    "numbers": {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0}, "score": {"type": "number", "minimum": -1, "maximum": 1},
                       "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 50}, "x": {"type": "number"}},
        "required": ["price", "score", "count", "x"],
    },
    "refs_and_combinators": {
        "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}, "kind": {"enum": ["a", "b"]}},
                           "required": ["id", "kind"], "additionalProperties": False}},
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 3},
            "either": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
            "one": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
            "both": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                               {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
        },
        "required": ["items", "either", "one", "both"],
    },
    "formats": {
        "type": "object",
        "properties": {k: {"type": "string", "format": k} for k in ("date", "date-time", "uuid", "email", "ipv4")},
        "required": ["date", "date-time", "uuid", "email", "ipv4"],
    },
    "free_form": {"type": "object", "properties": {"meta": {}, "extra": {"type": "object"}}, "required": ["meta", "extra"]},
}
