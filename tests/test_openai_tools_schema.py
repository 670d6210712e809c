"""Tool schemas and stop strings on ``/v1/chat/completions``.

A broken ``parameters`` schema (not a JSON Schema, or a ``$ref`` that points nowhere)
is a 400 naming the function under every ``tool_choice``; a valid schema that
constrained decoding cannot enforce is served under ``auto``/``none`` (only shown to
the model) and a 400 only when a call is forced. A stop string that cuts a call the
model is writing under ``auto`` gives the call so far with finish_reason ``stop``, the
same streamed or not (a random model rarely calls a tool by itself, so that part drives
the real response and stream formatting with the output text and finish reason the
engine would send).
"""

from __future__ import annotations

import json

import httpx
import pytest

from plait import protocol as P
from plait.errors import RequestError
from plait.runtime.server import launch
from plait.runtime.server import openai_api as oa
from plait.tool_parsers import check_tools, get_tool_parser

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
BROKEN = [  # (parameters, what the message says)
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "points nowhere: '#/$defs/Missing'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}},
      "$defs": {"b": {"type": "array", "items": {"$ref": "#/$defs/gone"}}}}, "'$ref' at #/$defs/b/items"),
    ({"type": "object", "properties": {"a": 5}}, "at #/properties/a: 5 is not of type"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "at #/properties/a/type"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}}, "at #/properties/a/minLength"),
]
# valid JSON Schema that plait's translation refuses (a reference to another document)
UNENFORCEABLE = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "bad"}}]


def _tools(params: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "add", "parameters": ADD}},
            {"type": "function", "function": {"name": "bad", "description": "x", "parameters": params}}]


@pytest.mark.parametrize("params,says", BROKEN)
def test_a_broken_schema_names_the_function_and_the_problem(params, says):
    with pytest.raises(RequestError) as e:
        check_tools(_tools(params))
    assert e.value.param == "tools[1].function.parameters"
    assert "function 'bad'" in e.value.message and says in e.value.message, e.value.message
    flat = [{"type": "function", **t["function"]} for t in _tools(params)]  # the Responses API's shape
    with pytest.raises(RequestError) as e:
        check_tools(flat, nested=False)
    assert e.value.param == "tools[1].parameters" and says in e.value.message


@pytest.mark.parametrize("params", [
    ADD, UNENFORCEABLE,
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}, "$defs": {"b": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # the root itself
    {"type": "object", "properties": {"a": {"enum": [{"$ref": "#/nowhere"}]}}},  # a value, not a reference
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^\\p{L}+$"}}},  # ECMA-262, not Python re
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
     "properties": {"a": {"$ref": "#/definitions/b"}}, "definitions": {"b": {}}},
])
def test_valid_schemas_pass(params):
    assert [fn["name"] for fn in check_tools(_tools(params))] == ["add", "bad"]


@pytest.fixture(scope="module")
def http(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=4096, max_running_requests=4,
                served_model_name="tiny") as rt, httpx.Client(base_url=rt.url, timeout=120) as c:
        yield c


def _chat(http: httpx.Client, tools: list[dict], choice, **extra) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools, "tool_choice": choice,
        **extra})


def test_a_broken_schema_is_a_400_under_every_tool_choice(http):
    for params, says in BROKEN[:3]:
        for choice in CHOICES:
            for stream in (False, True):
                r = _chat(http, _tools(params), choice, stream=stream)
                err = r.json()["error"] if r.status_code == 400 else {}
                assert err.get("param") == "tools[1].function.parameters", (params, choice, r.text)
                assert "function 'bad'" in err["message"] and says in err["message"], err
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "tools": [
        {"type": "function", "name": "bad", "parameters": BROKEN[0][0]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters", r.text
    assert http.get("/health").status_code == 200


def test_an_unenforceable_schema_is_served_unless_a_call_is_forced(http):
    for choice in ("auto", "none"):
        r = _chat(http, _tools(UNENFORCEABLE), choice)
        assert r.status_code == 200, (choice, r.text)
    for choice in CHOICES[2:]:
        r = _chat(http, _tools(UNENFORCEABLE), choice)
        err = r.json()["error"] if r.status_code == 400 else {}
        assert err.get("param") == "tools[1].function.parameters", (choice, r.text)
        assert "function 'bad'" in err["message"] and "cannot be enforced" in err["message"], err
    r = _chat(http, _tools(UNENFORCEABLE), {"type": "function", "function": {"name": "add"}})
    assert r.status_code == 200, r.text  # forcing another function does not enforce this one
    # strict: true enforces the schema under auto too (OpenAI's promise): a 400 that says so
    strict = _tools(UNENFORCEABLE)
    strict[1]["function"]["strict"] = True
    r = _chat(http, strict, "auto")
    err = r.json()["error"] if r.status_code == 400 else {}
    assert err.get("param") == "tools[1].function.parameters", r.text
    assert "cannot be enforced" in err["message"] and "strict: false" in err["message"], err
    # SGLang's raw regex beside them shapes the output as before (strict adds nothing there)
    r = _chat(http, strict, "auto", regex="[a-z]+")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].isalpha(), r.text
    strict[1]["function"]["strict"] = False
    assert _chat(http, strict, "auto").status_code == 200


# -- stop strings under auto ------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
HERMES = get_tool_parser("hermes")
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _job(stream: bool, parallel: bool = True) -> oa.Job:
    output = oa.ChatOutput(None, HERMES, TOOLS, None if parallel else 1)
    return oa.Job(True, "chatcmpl-x", "tiny", 0, [], 1, stream, output=output)


def _both(text: str, finish: dict) -> tuple[tuple, tuple]:
    """(finish_reason, content, calls) of ``text`` ended by ``finish`` as the response
    and as the stream assembled (deltas fed in 3-character pieces)."""
    meta = {"finish_reason": finish, "completion_tokens": 1}
    result = P.GenerateResult(rid="x", text=text, meta_info=meta)
    choice = oa.response(None, _job(False), {(0, 0): result})["choices"][0]
    msg = choice["message"]
    whole = (choice["finish_reason"], msg["content"] or "",
             [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])])
    job = _job(True)
    cs = job.output.stream()
    chunks = [c for i in range(0, len(text), 3) for c in oa.chat_chunks(job, cs, 0, text[i:i + 3], role=i == 0)]
    chunks += oa.chat_chunks(job, cs, 0, None, role=False, meta=meta)
    content, calls, fr = "", {}, None
    for ch in chunks:
        c = ch["choices"][0]
        content += c["delta"].get("content") or ""
        for tc in c["delta"].get("tool_calls", []):
            name, args = calls.get(tc["index"], ("", ""))
            calls[tc["index"]] = (name + (tc["function"].get("name") or ""), args + tc["function"].get("arguments", ""))
        fr = c["finish_reason"] or fr
        if c["finish_reason"] is not None:
            assert c["matched_stop"] == finish.get("matched")
    return whole, (fr, content.strip(), [calls[k] for k in sorted(calls)])


ZOD = {"type": "object", "properties": {  # zod v4 (z.uuid(), z.iso.datetime()) as the OpenAI Agents SDK sends it
    "id": {"type": "string", "format": "uuid", "pattern": r"^([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-8][0-9a-fA-F]{3}-"
           r"[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}|00000000-0000-0000-0000-000000000000|"
           r"ffffffff-ffff-ffff-ffff-ffffffffffff)$"},
    "at": {"type": "string", "format": "date-time", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$"}},
    "required": ["id", "at"], "additionalProperties": False}


def test_a_pattern_beside_a_format_is_enforced_in_forced_and_strict_calls(http):
    # served in response_format (llguidance) but a 400 in tools ("'pattern' and 'format'
    # cannot be combined"): the forcing regex now holds the strings both admit
    import re

    tools = [{"type": "function", "function": {"name": "book", "parameters": ZOD, "strict": True}}]
    rx = get_tool_parser("hermes").constraint(tools, None, False).regex
    call = '<tool_call>\n{"name": "book", "arguments": {"id":"%s","at":"%s"}}\n</tool_call>'
    assert re.fullmatch(rx, call % ("123e4567-e89b-42d3-a456-426614174000", "2024-02-28T12:30:00Z"))
    assert not re.fullmatch(rx, call % ("123e4567-e89b-02d3-a456-426614174000", "2024-02-28T12:30:00Z"))  # version 0
    assert not re.fullmatch(rx, call % ("123e4567-e89b-42d3-a456-426614174000", "2024-02-30T12:30:00Z"))  # no such day
    for choice in ("required", {"type": "function", "function": {"name": "book"}}, "auto"):
        r = _chat(http, tools, choice)
        assert r.status_code == 200, (choice, r.text)


ZOD_ACCOUNT = {"type": "object", "properties": {
    "email": {"type": "string", "format": "email", "pattern": r"^(?!\.)(?!.*\.\.)([A-Za-z0-9_'+\-\.]*)[A-Za-z0-9_+-]@"
              r"([A-Za-z0-9][A-Za-z0-9\-]*\.)+[A-Za-z]{2,}$"},
    "password": {"type": "string", "pattern": r"^(?=.*[A-Z])(?=.*\d)[A-Za-z\d]{8,}$"}},
    "required": ["email", "password"], "additionalProperties": False}


def test_look_aheads_at_a_patterns_start_are_enforced_in_calls_and_response_format(http):
    """zod v4's z.email() writes format email beside a pattern with two look-aheads, and
    password rules are look-aheads too: a 400 on every path ("look-ahead"). The forcing
    regex now holds what the pattern (and the format) admit; llguidance reads the same
    pattern without its look-aheads."""
    import re

    tools = [{"type": "function", "function": {"name": "signup", "parameters": ZOD_ACCOUNT, "strict": True}}]
    rx = get_tool_parser("hermes").constraint(tools, None, False).regex
    call = '<tool_call>\n{"name": "signup", "arguments": {"email":"%s","password":"%s"}}\n</tool_call>'
    assert re.fullmatch(rx, call % ("ada.l@example.org", "Abcdefg1"))
    for email, password in [(".ada@example.org", "Abcdefg1"), ("ada..l@example.org", "Abcdefg1"),
                            ("ada@example.org", "abcdefg1"), ("ada@example.org", "Abcdefgh")]:
        assert not re.fullmatch(rx, call % (email, password)), (email, password)
    for choice in ("required", {"type": "function", "function": {"name": "signup"}}):
        r = _chat(http, tools, choice)
        assert r.status_code == 200, (choice, r.text)
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Sign up Ada."}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ZOD_ACCOUNT, "strict": True}}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stop", ["}", ", ", "\n</tool_call>"])
def test_a_stop_string_inside_a_call_gives_the_call_so_far(stop):
    text = CALL[:CALL.index(stop, len('<tool_call>\n{"name": "add", "arguments": {'))]
    whole, streamed = _both(text, {"type": "stop", "matched": stop})
    assert whole == streamed, (whole, streamed)
    fr, content, calls = whole
    assert content == "" and [name for name, _ in calls] == ["add"], whole
    args = calls[0][1]
    assert '{"a": 1, "b": 2}'.startswith(args) and args.startswith('{"a": 1')
    if stop == "\n</tool_call>":  # the call object is closed: a whole call
        assert fr == "tool_calls" and json.loads(args) == {"a": 1, "b": 2}
    else:  # a cut call: finish_reason says the stop string ended it
        assert fr == "stop"
        with pytest.raises(ValueError):
            json.loads(args)


def test_a_stop_string_after_the_calls_keeps_them_whole():
    whole, streamed = _both(CALL + "\nThe answer", {"type": "stop", "matched": " is"})
    assert whole == streamed == ("tool_calls", "The answer", [("add", '{"a": 1, "b": 2}')])


def test_eos_inside_a_call_leaves_it_content():
    """The model's own end (EOS, matched by token id) inside a call: not a call."""
    text = CALL[:40]
    choice = oa.response(None, _job(False), {(0, 0): P.GenerateResult(
        rid="x", text=text, meta_info={"finish_reason": {"type": "stop", "matched": 2}})})["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text
    assert "tool_calls" not in choice["message"]


def test_a_cut_call_past_the_first_is_dropped_without_parallel_calls():
    text = CALL + "\n" + CALL[:45]
    meta = {"finish_reason": {"type": "stop", "matched": "}"}}
    job = _job(False, parallel=False)
    msg = oa.response(None, job, {(0, 0): P.GenerateResult(rid="x", text=text, meta_info=meta)})["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and len(msg["message"]["tool_calls"]) == 1
    cs = _job(True, parallel=False).output.stream()
    cs.feed(text)
    cs.finish(True)
    assert cs.has_calls


def test_a_stop_string_inside_a_call_in_the_responses_api_is_an_incomplete_item():
    """The Responses API reads the same cut: the call so far, as an ``incomplete`` item
    (the response is ``completed``: a stop string is a normal end, unlike the length limit)."""
    import asyncio

    from plait.runtime.server import responses_api as ra

    text = CALL[:CALL.index("}")]
    meta = {"finish_reason": {"type": "stop", "matched": "}"}, "completion_tokens": 1}
    out = ra.response(ra.ResponseStore(), ra.ResponseJob(_job(False), [], {}, False, [], None),
                      P.GenerateResult(rid="x", text=text, meta_info=meta))
    assert out["status"] == "completed"
    [item] = out["output"]
    assert item["type"] == "function_call" and item["name"] == "add" and item["status"] == "incomplete"
    assert item["arguments"].startswith('{"a": 1') and '{"a": 1, "b": 2}'.startswith(item["arguments"])

    async def events():
        for i in range(0, len(text), 3):
            yield P.StreamChunk(rid="x", text=text[i:i + 3])
        yield P.GenerateResult(rid="x", text=text, meta_info=meta)

    async def run():
        return [e async for e in ra.stream(ra.ResponseStore(), ra.ResponseJob(_job(True), [], {}, False, [], None), events())]

    done = asyncio.run(run())[-1]
    assert done["type"] == "response.completed"
    assert [(i["type"], i["status"], i["arguments"]) for i in done["response"]["output"]] == \
        [("function_call", "incomplete", item["arguments"])]


def test_a_prompt_too_long_for_its_tools_says_the_tools_count(http):
    """A tool whose description does not fit the context: the 400 blamed 'messages', which
    were two words; it names the prompt rendered from the messages with the tools."""
    tools = [{"type": "function", "function": {"name": "f", "description": "word " * 3000,
                                               "parameters": {"type": "object", "properties": {}}}}]
    r = _chat(http, tools, "auto")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "rendered from messages (with tools" in err["message"], err


def test_a_tool_constraint_too_large_names_the_tools_not_a_regex(http):
    """A forced call's constraint is a regex built from the tools' parameters; a refusal
    of it said 'regex is invalid: ... characters', though the client sent no regex."""
    # a short schema whose regex is long: four levels of four copies of a 40-word enum
    defs = {"d0": {"enum": [f"w{i:02d}-" + "x" * 12 for i in range(40)]}}
    for level in range(1, 5):
        defs[f"d{level}"] = {"type": "object", "required": list("abcd"), "additionalProperties": False,
                             "properties": {k: {"$ref": f"#/$defs/d{level - 1}"} for k in "abcd"}}
    params = {"$defs": defs, "type": "object", "properties": {"pick": {"$ref": "#/$defs/d4"}}, "required": ["pick"]}
    r = _chat(http, _tools(params), "required")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice", err
    assert err["message"].startswith("the constraint built from the tools' parameters"), err
    assert "regex is invalid" not in err["message"]
