"""Real-world JSON Schema idioms against the format checker and string escapes: pydantic 2
``model_json_schema()`` models with dates, times and host names, MCP-style tool inputs
whose file-name patterns exclude quotes and backslashes, and the draft formats plait
writes as regexes. What this probe found, one test each: llguidance's own ``date`` /
``date-time`` / ``time`` / ``hostname`` admitted values ``jsonschema``'s format checker
rejects; llguidance read a character class holding every control character as any
string character (``[^"]`` admitted ``\\"``); a pattern's lone surrogates became one
character there; two format regexes admitted values the checker's libraries reject."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from plait.errors import RequestError
from plait.runtime.constrained.json_schema import FORMATS
from plait.runtime.sampling_params import SamplingParams
from regex_sampling import sample
from test_llguidance import admits, compiled, grammars, random_output, tokenizer, vocab  # noqa: F401 (fixtures)


def constraint(schema: object, backend: str):
    return SamplingParams.from_dict({"json_schema": schema, "grammar_backend": backend}).constraint()


def validator(schema: object):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def admitted(grammars, vocab, schema: object, backend: str, text: str) -> bool:  # noqa: F811
    """Whether ``backend``'s constraint for ``schema`` admits ``text`` in full."""
    c = constraint(schema, backend)
    if c.backend == "outlines":
        return re.fullmatch(c.grammar, text) is not None
    _, fut = compiled(grammars, {"json_schema": schema, "grammar_backend": backend})
    m = grammars.matcher(fut, c, jump_forward=False, heal=False)
    m.start([1])
    return admits(m, vocab, text)


def walks(grammars, vocab, schema: object, backend: str, n: int) -> list[str]:  # noqa: F811
    """Up to ``n`` outputs the constraint admits (regex samples, or llguidance walks)."""
    c = constraint(schema, backend)
    if c.backend == "outlines":
        return sample(c.grammar, n, seed=7)
    _, fut = compiled(grammars, {"json_schema": schema, "grammar_backend": backend})
    out = []
    for seed in range(n):
        m = grammars.matcher(fut, c, jump_forward=False, heal=False)
        m.start([1])
        text = random_output(m, vocab, seed, cap=24, limit=120)
        if text is not None:
            out.append(text.decode())
    return out


# -- realistic schemas ------------------------------------------------------------------------------
class Meeting(BaseModel):
    """A calendar tool's arguments (pydantic 2: date/datetime/time become draft formats)."""

    title: Annotated[str, Field(max_length=20)]
    day: dt.date
    starts: dt.datetime
    reminder: dt.time | None = None
    host: Annotated[str, Field(json_schema_extra={"format": "hostname"})]
    kind: Literal["call", "visit"] = "call"


# an MCP filesystem-style tool input: a file name without the characters Windows forbids
SAVE_FILE = {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
    "properties": {"filename": {"type": "string", "pattern": "^[^\\\\/:*?\"<>|]+$", "maxLength": 12},
                   "content": {"type": "string", "maxLength": 12}},
    "required": ["filename", "content"],
}
# free-form labels whose keys hold no quote (a patternProperties key is matched exactly)
LABELS = {"type": "object", "patternProperties": {"^[^\"]+$": {"type": "integer"}}, "additionalProperties": False}

REAL = {"meeting": Meeting.model_json_schema(), "save_file": SAVE_FILE, "labels": LABELS}


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_schemas_generate_only_checker_valid_values(grammars, vocab, name, backend):  # noqa: F811
    schema = REAL[name]
    v = validator(schema)
    texts = walks(grammars, vocab, schema, backend, 6)
    assert texts
    for text in texts:
        assert v.is_valid(json.loads(text)), text


# -- llguidance's own date/time/hostname formats ------------------------------------------------------
# each rejected by jsonschema's format checker (date: datetime.date.fromisoformat;
# date-time/time: rfc3339-validator; hostname: fqdn, at most 253 characters)
BAD_FORMATS = [
    ("date", "0000-01-01"), ("date", "2021-02-29"),
    ("date-time", "2021-02-29T10:00:00Z"), ("date-time", "0000-01-01T00:00:00Z"),
    ("time", "23:59:60Z"),
    ("hostname", ".".join(["a" * 63] * 5)),
]


@pytest.mark.parametrize("fmt, value", BAD_FORMATS)
def test_llguidance_refuses_dates_times_and_hosts_the_checker_rejects(grammars, vocab, fmt, value):  # noqa: F811
    schema = {"type": "string", "format": fmt}
    assert not admitted(grammars, vocab, schema, "llguidance", json.dumps(value))
    c = constraint(schema, "llguidance")
    assert '"format"' not in c.grammar  # plait's regex for it, as a pattern


def test_valid_dates_and_times_still_compile_on_llguidance(grammars, vocab):  # noqa: F811
    schema = Meeting.model_json_schema()
    c = constraint(schema, "auto")
    assert c.backend == "llguidance"
    good = '{"title":"sync","day":"2024-03-01","starts":"2024-03-01T09:30:00Z","reminder":"09:00:00Z","host":"example.com"}'
    assert validator(schema).is_valid(json.loads(good))
    assert admitted(grammars, vocab, schema, "llguidance", good)
    leap = good.replace('"day":"2024-03-01"', '"day":"2023-02-29"')
    assert not admitted(grammars, vocab, schema, "llguidance", leap)


# -- character classes holding every control character on llguidance ---------------------------------
@pytest.mark.parametrize("pattern, bad, good", [
    ('^[^"]*$', '"\\""', '"ab"'),
    ("^[^\\\\]*$", '"a\\\\"', '"a/"'),
    ("^[^\\\\/:*?\"<>|]+$", '"x\\"y"', '"notes.txt"'),
])
def test_llguidance_negated_class_does_not_admit_the_excluded_escapes(grammars, vocab, pattern, bad, good):  # noqa: F811
    schema = {"type": "string", "pattern": pattern}
    v = validator(schema)
    assert not v.is_valid(json.loads(bad)) and v.is_valid(json.loads(good))
    for backend in ("llguidance", "outlines"):
        assert not admitted(grammars, vocab, schema, backend, bad), backend
        assert admitted(grammars, vocab, schema, backend, good), backend


def test_llguidance_key_pattern_does_not_admit_an_escaped_quote(grammars, vocab):  # noqa: F811
    # a key pattern is matched exactly (never narrowed): NUL is left out of its negated classes
    assert "\\\\x00" in constraint(LABELS, "llguidance").grammar
    assert not validator(LABELS).is_valid({'"': 1})
    assert not admitted(grammars, vocab, LABELS, "llguidance", '{"\\"":1}')
    assert admitted(grammars, vocab, LABELS, "llguidance", '{"env":1}')


def test_llguidance_refuses_an_exact_class_of_every_control_character_by_place():
    schema = {"type": "object", "patternProperties": {"^[\\u0000-\\u001f]$": {"type": "integer"}},
              "additionalProperties": False}
    with pytest.raises(RequestError, match=r"#/patternProperties/.*every control character"):
        constraint(schema, "llguidance")
    assert constraint(schema, "auto").backend == "outlines"


def test_a_pattern_of_lone_surrogates_is_refused_on_every_backend():
    # Python's re matches the two halves as two characters; llguidance's JSON read them
    # as one pair and admitted "😀", which jsonschema rejects
    schema = {"type": "string", "pattern": "^\\ud83d\\ude00$"}
    assert not validator(schema).is_valid("😀")
    with pytest.raises(RequestError, match=r"'pattern' at #.*lone surrogate U\+D83D"):
        constraint(schema, "llguidance")
    with pytest.raises(RequestError, match=r"surrogate"):
        constraint(schema, "auto")


def test_a_class_of_control_characters_only_is_refused_by_name_on_llguidance():
    with pytest.raises(RequestError, match=r"'pattern' at #.*only control characters"):
        constraint({"type": "string", "pattern": "^[\\x01-\\x07]$"}, "llguidance")


# -- format regexes the checker's libraries read more strictly --------------------------------------
def test_relative_json_pointer_has_no_digit_after_a_zero():
    # jsonschema's checker reads any 0 before a digit as a leading zero ("100#" is refused)
    rx = FORMATS["relative-json-pointer"]
    assert all(re.fullmatch(rx, t) for t in ("0#", "10#", "1/a", "990/b~0", "0"))
    assert not any(re.fullmatch(rx, t) for t in ("100#", "101", "01#", "1001/a"))
    for text in sample(rx, 300, seed=1, mean_repeat=3):
        digits = re.match(r"[0-9]+", text).group()
        assert not re.search(r"0[0-9]", digits), text


def test_uri_template_prefixes_stay_below_a_thousand():
    # the checker's uri_template refuses a prefix modifier of 1000 or more ("{a:5064}")
    rx = FORMATS["uri-template"]
    assert re.fullmatch(rx, "/users/{id:999}{?q,page}") and re.fullmatch(rx, "{+path*}")
    assert not re.fullmatch(rx, "{a:1000}") and not re.fullmatch(rx, "{a:5064}")
    for text in sample(rx, 300, seed=2, mean_repeat=3):
        assert all(int(n) < 1000 for n in re.findall(r":([0-9]+)", text)), text
