"""Careless and hostile clients, sixth round (after test_server_hostile5.py): the official
``openai`` client's less common parameters, message and tool shapes agent libraries
send, Responses API chains with tools. What the probe found, each now fixed:

- A Responses continuation (``previous_response_id``) dropped every system message of
  the stored conversation, meaning to drop the earlier request's ``instructions`` (which
  are not carried over): the ``developer`` and ``system`` messages an agent sends as
  ``input`` items vanished after one turn, so the second turn ran without its system
  prompt (25 prompt tokens where replaying the same conversation gave 40). The stored
  conversation now leaves out the instructions alone.
- An integer past a 64-bit float's range in a tool's ``parameters`` (``"minimum":
  999...9`` of 400 digits, or ``maximum``, ``multipleOf``) was an ``OverflowError`` where
  a forced call's grammar (or tools beside a JSON format) was built: a 500. In a
  response format it was a 400 reading "cannot be compiled (OverflowError ...)". Both
  are now a 400 naming the tool's ``parameters`` (``response_format``, ``text.format``)
  and where in the schema the number is.
- A replayed call's ``arguments`` nested ~1000 arrays deep was a RecursionError where
  a template that shows arguments as an object had them parsed: a 500. Arguments nested
  past 256 levels are now a 400 naming the call (brackets inside strings are text).

Found and not fixed (in lang/, outside the server): the tool parsers catch ValueError
only, so a call the model writes nested ~1000 deep (possible under a raw ``regex``
beside tools, or on a long context) raises RecursionError when parsed: a 500, or a
stream that dies.

Found and not changed: a ``maxLength``/``maxItems`` past 2**32 - 1 in a forced tool's
schema is a 400 naming ``tool_choice`` whose message shows the translated regex ("a
repetition count above 4294967295"): served or named better only by the schema
translation (runtime/constrained), which reads such a bound as a count.

Probed and served as they should be (not repeated here when an earlier file checks
them): ``parallel_tool_calls=false`` and a named ``tool_choice`` streamed like the
non-streamed response on both APIs; ``stream_options.include_usage`` with ``n`` > 1 and
forced calls; logprobs of every token of streamed forced calls; ``logit_bias`` keys that
are no token id's decimal text; ``stop`` of 5 entries, or empty; ``seed``, ``user``,
``metadata``, ``store``, ``service_tier``, ``modalities``; ``audio`` and ``prediction``
(400s naming them); ``max_tokens`` beside ``max_completion_tokens``; content parts of
unknown types, ``image_url``, ``input_audio``, ``file``, ``refusal``; ``name`` fields;
``developer`` messages anywhere; tool messages with part lists; duplicate, ``strict`` and
unenforceable tools; NaN and Infinity in schemas.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from plait.runtime.constrained.json_schema import SchemaError, check_schema_size
from plait.runtime.server import launch
from plait.runtime.server import openai_api as oa

from http_helpers import wait_idle

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
BIG = int("9" * 400)  # past a double's range (~1.8e308)


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                served_model_name=MODEL, echo_logs=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _replayed(items: list[Any]) -> list[dict[str, Any]]:
    """Output items as a client sends them back (``model_dump``, nulls dropped)."""
    return [it.model_dump(exclude_none=True) for it in items]


# -- Responses continuations keep the system messages of earlier inputs ---------------------------
def test_a_continuation_keeps_earlier_developer_messages_but_not_instructions(oai):
    # greedy, each in its own cache namespace: the prompt's token count is what was rendered
    kw: dict[str, Any] = {"model": MODEL, "max_output_tokens": 3, "temperature": 0}
    first_input = [{"role": "developer", "content": "Always answer in French, in one word."},
                   {"role": "system", "content": "Never use digits."}, {"role": "user", "content": "hi"}]
    r1 = oai.responses.create(input=first_input, **kw)
    chained = oai.responses.create(previous_response_id=r1.id, input="again", **kw)
    replay = first_input + _replayed(r1.output) + [{"role": "user", "content": "again"}]
    stateless = oai.responses.create(input=replay, **kw)
    assert chained.usage.input_tokens == stateless.usage.input_tokens, (chained.usage, stateless.usage)
    # a third turn still has them (the chain's stored conversation carries them on)
    third = oai.responses.create(previous_response_id=chained.id, input="more", **kw)
    replay3 = replay + _replayed(chained.output) + [{"role": "user", "content": "more"}]
    assert third.usage.input_tokens == oai.responses.create(input=replay3, **kw).usage.input_tokens
    # the instructions are not carried over: the continuation's own replace them
    told = oai.responses.create(instructions="Be brief.", input="hi", **kw)
    again = oai.responses.create(previous_response_id=told.id, input="again", instructions="Be long.", **kw)
    replay = [{"role": "user", "content": "hi"}] + _replayed(told.output) + [{"role": "user", "content": "again"}]
    expected = oai.responses.create(instructions="Be long.", input=replay, **kw)
    assert again.usage.input_tokens == expected.usage.input_tokens and again.instructions == "Be long."
    bare = oai.responses.create(previous_response_id=told.id, input="again", **kw)
    assert bare.usage.input_tokens == oai.responses.create(input=replay, **kw).usage.input_tokens
    # the input items list what the model was given: the developer message included
    items = oai.responses.input_items.list(chained.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items][:3] == [("message", "developer"),
                                                                       ("message", "system"), ("message", "user")]


def test_a_tool_loop_continuation_keeps_the_developer_prompt(oai):
    tools = [{"type": "function", "name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}]
    kw: dict[str, Any] = {"model": MODEL, "temperature": 0, "tools": tools}
    first_input = [{"role": "developer", "content": "Use the add tool."}, {"role": "user", "content": "2 + 3?"}]
    r1 = oai.responses.create(input=first_input, tool_choice="required", parallel_tool_calls=False,
                              max_output_tokens=60, **kw)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed" and len(calls) == 1 and json.loads(calls[0].arguments).keys() == {"a", "b"}, r1
    outputs = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}]
    r2 = oai.responses.create(previous_response_id=r1.id, input=outputs, max_output_tokens=3, **kw)
    stateless = oai.responses.create(input=first_input + _replayed(r1.output) + outputs, max_output_tokens=3, **kw)
    assert r2.usage.input_tokens == stateless.usage.input_tokens
    assert [o.model_dump()["content"] for o in r2.output] == [o.model_dump()["content"] for o in stateless.output]


# -- numbers past a double in a schema ------------------------------------------------------------
def _schema(**x: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": x}, "required": ["x"]}


@pytest.mark.parametrize("prop,where", [
    ({"type": "integer", "minimum": BIG}, "#/properties/x/minimum"),
    ({"type": "number", "maximum": -BIG}, "#/properties/x/maximum"),
    ({"type": "integer", "multipleOf": BIG}, "#/properties/x/multipleOf"),
    ({"enum": [1, BIG]}, "#/properties/x/enum/1"),
], ids=["minimum", "maximum", "multipleOf", "enum"])
def test_an_integer_past_a_double_in_a_tool_schema_is_a_400_naming_the_tool(oai, http, prop, where):
    good = {"type": "function", "function": {"name": "ok", "parameters": _schema(type="integer")}}
    bad = {"type": "function", "function": {"name": "f", "parameters": _schema(**prop)}}
    param = "tools[1].function.parameters"
    for extra in ({"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}},
                  {"response_format": {"type": "json_object"}}, {}):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=HI, tools=[good, bad], max_completion_tokens=20, **extra)
        assert e.value.body["param"] == param and where in e.value.body["message"], (extra, e.value.body)
        assert "10**400" in e.value.body["message"]
    flat = [{"type": "function", **good["function"]}, {"type": "function", **bad["function"]}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", tools=flat, tool_choice="required", max_output_tokens=20)
    assert e.value.body["param"] == "tools[1].parameters" and where in e.value.body["message"], e.value.body
    assert http.get("/health").status_code == 200


def test_an_integer_past_a_double_in_a_response_format_is_a_400_naming_it(oai, http):
    schema = _schema(type="integer", maximum=BIG)
    tools = [{"type": "function", "function": {"name": "ok", "parameters": _schema(type="integer")}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for extra in ({}, {"tools": tools}):  # (beside tools under auto, the front built the grammar: a 500)
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=HI, response_format=fmt, max_completion_tokens=20,
                                        **extra)
        assert e.value.body["param"] == "response_format", e.value.body
        assert "#/properties/x/maximum" in e.value.body["message"] and "OverflowError" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", text={"format": {"type": "json_schema", "name": "x",
                                                                         "schema": schema}}, max_output_tokens=20)
    assert e.value.body["param"] == "text.format", e.value.body
    # an integer within a double's range is served; one of 4000 digits (past what a 400's
    # message could write with str()) is measured in powers of ten
    fine = _schema(type="integer", minimum=-(10 ** 300), maximum=10 ** 300)
    r = oai.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=30, temperature=0,
                                    response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                            "schema": fine}})
    assert r.choices[0].finish_reason in ("stop", "length"), r
    raw = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 5, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "examples": ["BIG"]}}}]})
    r = http.post("/v1/chat/completions", content=raw.replace('"BIG"', "7" * 4000))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text[:300]
    assert "10**4000" in r.json()["error"]["message"]
    wait_idle(http)


def test_the_schema_walk_names_the_integer_and_never_recurses():
    """Every path (tools' parameters, response formats, /generate) refuses an integer
    past a double in ``check_schema_size``, the walk each runs first: iterative, so
    nesting deeper than Python's recursion limit is a depth error, not a RecursionError."""
    near: Any = BIG
    for _ in range(3):
        near = [near]
    with pytest.raises(SchemaError) as e:
        check_schema_size({"a/b": {"c~d": near}})
    assert "#/a~1b/c~0d/0/0/0," in str(e.value) and "10**400" in str(e.value)
    deep: Any = BIG
    for _ in range(50_000):  # (nesting the request's JSON parser could never give)
        deep = [deep]
    with pytest.raises(SchemaError, match="nested more than"):
        check_schema_size({"a": deep})
    check_schema_size({"maximum": 10 ** 308, "minimum": -1.5e308, "x": [True, None, "9" * 400]})


# -- replayed calls whose arguments nest too deep -----------------------------------------------
def test_replayed_arguments_nested_too_deep_are_a_400_naming_the_call(oai, http):
    """A template that shows arguments as an object has them parsed (plait's chat-template
    helpers): arguments nested ~1000 deep were a RecursionError there, a 500."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    deep = '{"a": ' + "[" * 3000 + "]" * 3000 + "}"
    messages = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_completion_tokens=3)
    assert e.value.body["param"] == "messages" and "messages[1].tool_calls[0].function.arguments nests 3001" in \
        e.value.body["message"], e.value.body
    items = [{"role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c1", "name": "add", "arguments": deep},
             {"type": "function_call_output", "call_id": "c1", "output": "3"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=items, tools=[{"type": "function", **tools[0]["function"]}],
                             max_output_tokens=3)
    assert e.value.body["param"] == "input" and "nests 3001" in e.value.body["message"], e.value.body
    # brackets inside strings are text, and arguments that are no JSON are served as given
    for args in ('{"a": "' + "[" * 300 + '"}', "not json [", "[" * 200 + "]" * 200):
        messages[1]["tool_calls"][0]["function"]["arguments"] = args
        r = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_completion_tokens=3)
        assert r.choices[0].finish_reason == "length", r
    assert oa.json_depth('{"a": [1, {"b": "]]}\\"[["}], "c": {}}') == 3
    wait_idle(http)


def test_the_server_answers_an_unreadable_head_with_json_and_serves_a_long_query(server, http):
    """The server runs runtime/server/http_protocol.py's protocol (tests/test_http_protocol.py
    checks its deadlines): a head that is no HTTP is a JSON 400 (uvicorn's was plain
    text), and a 60 KB query string, past uvicorn's 16 KB, reaches the routes."""
    import json
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["type"] == "invalid_request_error"
    r = http.get("/health", params={"x": "a" * 60_000})
    assert r.status_code == 200
