"""Agents with tools against the OpenAI API (after test_probe_openai*.py): a streamed
tool call's parsing must stay linear in the output (it runs on the front's event loop,
where every other client waits), and response_format's json_schema fields are typed as
OpenAI types them."""

from __future__ import annotations

import json
from typing import Any

import pytest

import plait.tool_parsers as tp
from test_server_hostile import http, server  # noqa: F401  (the same server, one per module)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"s": {"type": "string"}}}}}]


class _Counting:
    """A compiled pattern that adds up the characters its searches read."""

    def __init__(self, pattern: Any) -> None:
        self.pattern = pattern
        self.read = 0

    def search(self, text: str, pos: int = 0, endpos: int | None = None) -> Any:
        m = self.pattern.search(text, pos, len(text) if endpos is None else endpos)
        self.read += (m.end() if m else (len(text) if endpos is None else endpos)) - pos
        return m


def _stream(parser: str, text: str, step: int) -> list[dict[str, Any]]:
    st = tp.get_tool_parser(parser).stream(TOOLS)
    out = []
    for i in range(0, len(text), step):
        out += st.feed(text[i:i + step])
    return out + st.finish()


def _assembled(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], ["", ""])
            entry[0] += c["function"].get("name", "")
            entry[1] += c["function"].get("arguments", "")
    return [(n, a) for _, (n, a) in sorted(calls.items())]


LONG_ARGUMENT = {  # one call whose string argument streams as 6,000 deltas
    "hermes": ('<tool_call>\n{"name": "f", "arguments": {"s": "', '"}}\n</tool_call>'),
    "llama3_json": ('{"name": "f", "parameters": {"s": "', '"}}'),
    "mistral": ('[TOOL_CALLS][{"name": "f", "arguments": {"s": "', '"}}]'),
}


@pytest.mark.parametrize("parser", sorted(LONG_ARGUMENT))
def test_a_long_streamed_argument_is_scanned_once_not_once_per_delta(monkeypatch, parser):
    """Every delta rescanned the call from its start (a Python loop per character): a
    4,000-token argument cost ~5 s of the event loop, 8,000 ~20 s. The scan now resumes
    where the last one stopped, and skips the characters that change nothing."""
    inside, outside = _Counting(tp._INSIDE), _Counting(tp._OUTSIDE)
    monkeypatch.setattr(tp, "_INSIDE", inside)
    monkeypatch.setattr(tp, "_OUTSIDE", outside)
    head, tail = LONG_ARGUMENT[parser]
    text = head + 'a \\"quoted\\" {word} ' * 1500 + tail
    deltas = _stream(parser, text, 5)
    _, calls = tp.get_tool_parser(parser).parse(text, TOOLS)
    assert _assembled(deltas) == [("f", calls[0].arguments)]
    assert json.loads(calls[0].arguments)["s"].startswith('a "quoted" {word}')
    # the text is 31,000 characters in 6,200 deltas; a rescan per delta reads ~100 M
    assert inside.read + outside.read < 10 * len(text), (inside.read, outside.read, len(text))


@pytest.mark.parametrize("parser,call", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"s": "hi"}}\n</tool_call>\n'),
    ("llama3_json", '{"name": "f", "parameters": {"s": "hi"}}; '),
])
def test_a_model_looping_on_calls_is_not_rescanned_call_by_call(monkeypatch, parser, call):
    """A small model under tool_choice auto repeats a call until max_tokens; each delta
    re-read every call so far (300 calls: 17 s of the event loop). Calls whose text is
    closed are settled: a scan resumes after them."""
    seen = {"n": 0}
    real = tp._object_call

    def counting(*a: Any, **k: Any) -> Any:
        seen["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(tp, "_object_call", counting)
    text = call * 200
    deltas = _stream(parser, text, 4)
    feeds = len(text) // 4 + 2
    assert _assembled(deltas) == [("f", '{"s": "hi"}')] * 200
    assert seen["n"] < 3 * feeds, (seen["n"], feeds)  # a rescan per delta: ~100 calls per feed


def test_the_memo_never_changes_a_scan():
    """json_end resumed from a memo gives what a fresh scan gives, for texts that grow
    and for prefixes of them (a stream's scans read ``text[:stop]`` too)."""
    import random

    rnd = random.Random(7)
    for _ in range(300):
        full = "".join(rnd.choice('{}[]"\\ab,:') for _ in range(rnd.randint(300, 900)))
        memo = tp._Memo()
        token = tp._MEMO.set(memo)
        try:
            for k in range(0, len(full) + 1, rnd.randint(5, 40)):
                stop = rnd.randint(0, k)
                got = tp.json_end(full[:k], 0, stop), tp.json_end(full[:k], 0)
                tp._MEMO.set(None)
                want = tp.json_end(full[:stop], 0), tp.json_end(full[:k], 0)
                tp._MEMO.set(memo)
                assert got == want, (full[:k], stop)
        finally:
            tp._MEMO.reset(token)


# -- over HTTP ------------------------------------------------------------------------------------------


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("path,fmt,param,says", [
    ("/v1/chat/completions", {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
     "response_format", "response_format.json_schema.strict='yes'"),
    ("/v1/chat/completions", {"type": "json_schema", "json_schema": {"name": 5, "schema": SCHEMA}},
     "response_format", "response_format.json_schema.name=5"),
    ("/v1/responses", {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": 1}, "text.format",
     "text.format.strict=1"),
])
def test_a_mistyped_json_schema_field_is_a_400_naming_it(http, path, fmt, param, says):
    """``strict: "yes"`` was taken (and ignored) where OpenAI answers a 400: the client
    believed its output was held to the schema's strict mode."""
    body = ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": fmt}
            if path.endswith("completions") else {"input": "hi", "max_output_tokens": 4, "text": {"format": fmt}})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_well_typed_json_schema_fields_are_served(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": SCHEMA, "strict": True}}
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                                                "temperature": 0, "response_format": fmt})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"])["a"], int)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                "response_format": {"type": "json_schema",
                                                                    "json_schema": {"schema": SCHEMA, "strict": None}}})
    assert r.status_code == 200, r.text
