"""An agent on the official ``openai`` client with ``tools``, against a tiny random model
(SmolLM2's template: plait's generic tool prompt, hermes calls): realistic schemas and
many tools forced and validated, the tool loop on both APIs, streamed calls assembled as
a client does, a forced call cut by the length limit or meeting stop strings, an end tag
inside an argument, and malformed tools answered with 400s that leave the server healthy.

A random model rarely calls a tool by itself, so forced choices (constrained decoding)
carry the checks; nothing here depends on which call it writes.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import build_tiny_model

from plait.runtime.server import launch
from plait.tool_parsers import get_tool_parser

MODEL = "tiny"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
FLIGHT = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "maxLength": 4, "description": "IATA code, e.g. \"CDG\" — Paris ✈"},
        "passengers": {"type": "array", "items": {"$ref": "#/$defs/passenger"}, "minItems": 1, "maxItems": 2},
        "cabin": {"enum": ["economy", "business"]},
        "return_date": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
        "prefs": {"type": "object", "properties": {"seat": {"enum": ["aisle", "window"]}, "meal": {"type": ["boolean", "null"]}},
                  "required": ["seat", "meal"], "additionalProperties": False},
    },
    "required": ["origin", "passengers", "cabin", "return_date", "prefs"],
    "additionalProperties": False,
    "$defs": {"passenger": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                            "required": ["name", "age"], "additionalProperties": False}},
}
TAG = {"type": "object", "properties": {"q": {"enum": ["</tool_call>"]}}, "required": ["q"]}
SCHEMAS = {"add": ADD, "book_flight": FLIGHT, "ping": {"type": "object", "maxProperties": 0}, "tag": TAG,
           **{f"tool_{i}": ADD for i in range(32)}}


def _tool(name: str, params: dict | None, desc: str = "") -> dict:
    fn = {"name": name, "description": desc or f"the {name} tool: \"quoted\", ünïcödé 🚀"}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


TOOLS = [_tool("add", ADD), {"type": "function", "function": {**_tool("book_flight", FLIGHT)["function"], "strict": True}},
         _tool("ping", None)]
MANY = [_tool(f"tool_{i}", ADD) for i in range(32)] + [_tool("ping", {})]
ASK = [{"role": "user", "content": "What is 2 + 3? Then book a flight."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    # a long context: 33 tools in the generic tool prompt are ~4000 tokens
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-agents"), tokenizer_dir, "llama",
                              max_position_embeddings=8192)
    with launch(str(folder), num_threads=1, kv_cache_tokens=16384, max_running_requests=8,
                served_model_name=MODEL) as rt:
        yield rt


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _valid(calls: list[tuple[str, str]], name: str | None = None) -> None:
    assert calls
    for n, args in calls:
        assert name is None or n == name
        jsonschema.validate(json.loads(args), SCHEMAS[n])


def _assemble(chunks) -> dict[int, tuple[str | None, list[tuple[str, str]], str | None]]:
    """Per choice: (content, calls, finish_reason), put together from stream chunks as
    agent frameworks do: a call's index, id and name in its first delta, arguments
    concatenated."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            o = out.setdefault(ch.index, {"content": None, "calls": {}, "finish": None})
            if ch.delta.content:
                o["content"] = (o["content"] or "") + ch.delta.content
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in o["calls"] and tc.function.name and tc.type == "function"
                    o["calls"][tc.index] = [tc.function.name, ""]
                o["calls"][tc.index][1] += tc.function.arguments or ""
            o["finish"] = ch.finish_reason or o["finish"]
    return {i: (o["content"], [tuple(o["calls"][k]) for k in sorted(o["calls"])], o["finish"])
            for i, o in out.items()}


def _chat_both(oai, **kw) -> tuple[tuple, tuple]:
    """(non-streamed, streamed) (content, calls, finish_reason) of one greedy request."""
    r = oai.chat.completions.create(model=MODEL, temperature=0, **kw)
    ch = r.choices[0]
    streamed = _assemble(oai.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw))[0]
    return (ch.message.content, _calls(ch.message), ch.finish_reason), streamed


# -- forced calls over realistic schemas ------------------------------------------------------------
@pytest.mark.parametrize("tools,choice,name", [
    (TOOLS, {"type": "function", "function": {"name": "book_flight"}}, "book_flight"),
    (TOOLS, {"type": "function", "function": {"name": "ping"}}, "ping"),
    (MANY, "required", None),
])
def test_forced_calls_validate_and_stream_the_same(oai, tools, choice, name):
    plain, streamed = _chat_both(oai, messages=ASK, tools=tools, tool_choice=choice, parallel_tool_calls=False,
                                 max_tokens=300)
    assert plain == streamed
    content, calls, finish = plain
    assert content is None and finish == "tool_calls" and len(calls) == 1
    _valid(calls, name)


def test_an_end_tag_inside_an_argument_does_not_end_the_call(oai):
    # the schema makes the argument the hermes end tag itself
    plain, streamed = _chat_both(oai, messages=ASK, tools=[_tool("tag", TAG)], tool_choice="required",
                                 max_tokens=60)
    assert plain == streamed == (None, [("tag", '{"q":"</tool_call>"}')], "tool_calls")
    text = '<tool_call>\n{"name": "tag", "arguments": {"q": "a</tool_call>\\n<tool_call>"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = get_tool_parser("hermes").parse(text, [_tool("tag", None), _tool("add", ADD)])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("tag", {"q": "a</tool_call>\n<tool_call>"}), ("add", {"a": 1, "b": 2})]


# -- the length limit and stop strings --------------------------------------------------------------
def test_a_forced_call_cut_by_the_length_limit_is_the_call_so_far(oai):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    full = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=200, **kw)
    [(_, args)] = _calls(full.choices[0].message)
    raw = '<tool_call>\n{"name": "add", "arguments": ' + args + "}\n</tool_call>"  # what the constraint wrote
    n = full.usage.completion_tokens
    seen_calls = 0
    for limit in sorted({1, n // 3, n // 2, n - 3, n - 1}):
        plain, streamed = _chat_both(oai, max_tokens=limit, **kw)
        assert plain == streamed, limit
        content, calls, finish = plain
        assert finish == "length"
        if calls:  # the call began: its arguments as far as written, no raw text as content
            seen_calls += 1
            assert content is None and len(calls) == 1 and calls[0][0] == "add" and args.startswith(calls[0][1])
        else:  # cut before the name was written: markup, not content (it came back as "<tool_")
            assert content is None, content
    assert seen_calls >= 2


def test_a_cut_call_in_the_responses_api_is_an_incomplete_item(oai):
    kw = dict(model=MODEL, input="What is 2 + 3?", tools=[{"type": "function", **TOOLS[0]["function"]}],
              tool_choice="required", parallel_tool_calls=False, temperature=0)  # one call, then the end
    full = oai.responses.create(max_output_tokens=200, **kw)
    [call] = [it for it in full.output if it.type == "function_call"]
    for limit in range(full.usage.output_tokens - 1, 0, -1):  # the longest cut inside the arguments
        r = oai.responses.create(max_output_tokens=limit, **kw)
        if r.output[0].type != "function_call" or r.output[0].arguments != call.arguments:
            break
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [cut] = r.output
    assert cut.type == "function_call" and cut.status == "incomplete" and call.arguments.startswith(cut.arguments)
    assert cut.arguments != call.arguments
    events = list(oai.responses.create(max_output_tokens=limit, stream=True, **kw))
    assert events[-1].type == "response.incomplete"
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.status, done.arguments) == (cut.status, cut.arguments)
    assert [(it.type, it.arguments) for it in events[-1].response.output] == [("function_call", cut.arguments)]


@pytest.mark.parametrize("stop", [["}"], ["\n", ":"], "add"])
def test_a_forced_call_is_not_cut_by_stop_strings(oai, stop):
    plain, streamed = _chat_both(oai, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                 max_tokens=300, stop=stop)
    assert plain == streamed and plain[2] == "tool_calls"
    _valid(plain[1])
    r = oai.responses.create(model=MODEL, input="What is 2 + 3?", tools=[{"type": "function", **TOOLS[0]["function"]}],
                             tool_choice="required", parallel_tool_calls=False, max_output_tokens=100,
                             temperature=0, extra_body={"stop": stop})
    assert r.status == "completed" and [it.type for it in r.output] == ["function_call"]
    _valid([(r.output[0].name, r.output[0].arguments)])


def test_a_forced_call_is_not_cut_by_stop_token_ids(oai, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    # every token a call to add is written with (SGLang's stop_token_ids extra field)
    ids = sorted(set(tok.encode('<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 3}}\n</tool_call>',
                                add_special_tokens=False)) - {tok.eos_token_id})
    plain, streamed = _chat_both(oai, messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                 "function": {"name": "add"}}, max_tokens=300, extra_body={"stop_token_ids": ids})
    assert plain == streamed and plain[2] == "tool_calls"
    _valid(plain[1], "add")


# -- the agent loop -----------------------------------------------------------------------------------
def test_agent_loop_with_tool_results(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                    max_tokens=300)
    msg = r.choices[0].message
    _valid(_calls(msg))
    history = ASK + [msg.model_dump(exclude_none=True)]  # content None is left out, as agents send it
    for i, c in enumerate(msg.tool_calls):
        result = [{"type": "text", "text": "ok"}] if i % 2 else json.dumps({"result": 5, "note": "fine \"quoted\""})
        history.append({"role": "tool", "tool_call_id": c.id, "content": result})
    history.append({"role": "tool", "tool_call_id": "call_unknown", "content": "an answer nobody asked for"})
    for extra in ({"tool_choice": "auto", "max_tokens": 8}, {"tool_choice": "none", "max_tokens": 8},
                  {"tool_choice": {"type": "function", "function": {"name": "add"}}, "max_tokens": 60}):
        plain, streamed = _chat_both(oai, messages=history, tools=TOOLS, **extra)
        assert plain == streamed
        if extra["tool_choice"] not in ("auto", "none"):
            _valid(plain[1], "add")
    # an assistant turn with content "" and the tool results, then the next question
    history[len(ASK)] = {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in msg.tool_calls]}
    r = oai.chat.completions.create(model=MODEL, messages=history + [{"role": "user", "content": "And 4 + 4?"}],
                                    tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300,
                                    parallel_tool_calls=True)
    _valid(_calls(r.choices[0].message))


def test_responses_tool_loop_streams_like_the_response(oai):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kw = dict(model=MODEL, tools=tools, tool_choice={"type": "function", "name": "add"}, temperature=0,
              max_output_tokens=100)
    r1 = oai.responses.create(input="What is 2 + 3?", **kw)
    with oai.responses.stream(input="What is 2 + 3?", **kw) as s:
        for _ in s:
            pass
        s1 = s.get_final_response()
    assert [(it.name, it.arguments) for it in r1.output] == [(it.name, it.arguments) for it in s1.output]
    _valid([(it.name, it.arguments) for it in r1.output], "add")
    r2 = oai.responses.create(previous_response_id=r1.id, input=[
        {"type": "function_call_output", "call_id": r1.output[0].call_id, "output": "5"},
        {"role": "user", "content": "Now book the flight."}], **{**kw, "tool_choice": "required"})
    assert r2.previous_response_id == r1.id
    _valid([(it.name, it.arguments) for it in r2.output if it.type == "function_call"])
    # the items an agent keeps itself, sent back in full (ids and statuses included)
    items = [{"role": "user", "content": "What is 2 + 3?"}, *[it.model_dump() for it in r1.output],
             {"type": "function_call_output", "call_id": r1.output[0].call_id, "output": json.dumps({"sum": 5})}]
    r3 = oai.responses.create(input=items, **{**kw, "tool_choice": "auto", "max_output_tokens": 8})
    assert r3.status in ("completed", "incomplete")


# -- careless and hostile requests -------------------------------------------------------------------
OK_ANYWAY = [
    {"tools": TOOLS, "tool_choice": "required", "n": 2, "temperature": 0.9, "seed": 3, "max_tokens": 300},
    {"tools": TOOLS, "tool_choice": "required", "logprobs": True, "top_logprobs": 2, "max_tokens": 300},
    {"tools": TOOLS, "response_format": {"type": "json_object"}, "max_tokens": 8},
    # one call (the random model, sampling, may start a second where parallel calls are
    # allowed and run out of its 30 tokens: finish_reason "length", rightly)
    {"tools": [_tool("ping", {"type": "object", "properties": {}, "additionalProperties": False})],
     "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 30},
]


@pytest.mark.parametrize("extra", OK_ANYWAY)
def test_unusual_combinations_are_served(oai, extra):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, **extra)
    assert len(r.choices) == extra.get("n", 1)
    for ch in r.choices:
        if extra.get("tool_choice") == "required":
            assert ch.finish_reason == "tool_calls"
            _valid(_calls(ch.message))
        if extra.get("logprobs"):
            assert len(ch.logprobs.content) == r.usage.completion_tokens


BAD = [
    ({"tools": [_tool("f", {"type": "object", "properties": []})]}, "tools[0].function.parameters"),
    ({"tools": [_tool("f", {"type": "object", "properties": {"a": {}}, "required": "a"})]},
     "tools[0].function.parameters"),
    ({"tools": [_tool("f", {"type": "object", "properties": []})], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [_tool("a/b", None)]}, "tools[0].function.name"),  # (a.b is MCP's format: served)
    ({"tools": [_tool("f", None), _tool("f", ADD)]}, "tools[1].function.name"),
    ({"tools": [_tool("f", [ADD])]}, "tools[0].function.parameters"),
    ({"tools": [], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"functions": [ADD], "function_call": "auto"}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "[a-z]+"}, "tool_choice"),
    ({"tools": TOOLS, "stop": 5, "tool_choice": "required"}, "stop"),  # still checked when a forced call drops it
]


def test_malformed_tools_are_400s_and_the_server_stays_healthy(http):
    for extra, param in BAD:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        assert http.get("/health").status_code == 200
    flat = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": []}}]
    r = http.post("/v1/responses", json={"input": "hi", "tools": flat, "max_output_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters", r.text
    assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).status_code == 200


def test_a_named_tool_choice_makes_one_call(oai):
    # with parallel_tool_calls left on (the client's default), the grammar allowed up to 8
    # calls and SmolLM2 repeated the same one until max_tokens; OpenAI and vLLM make one
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, temperature=1.0,
                                      seed=3, n=4, tool_choice={"type": "function", "function": {"name": "add"}})
    for choice in out.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["add"], choice.message
        assert choice.finish_reason == "tool_calls"
    r = oai.responses.create(model=MODEL, input="2 + 3?", tools=[{"type": "function", **TOOLS[0]["function"]}],
                             tool_choice={"type": "function", "name": "add"}, max_output_tokens=300, temperature=0)
    assert [it.type for it in r.output] == ["function_call"] and r.status == "completed"


def test_tools_beside_a_json_format_under_auto_can_still_be_called(oai, tokenizer_dir):
    # the schema's constraint covered the whole reply, so a call could never be written
    # (the OpenAI Agents SDK sends tools and an output type together)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS[:1], response_format=fmt, max_tokens=120, temperature=0)
    lt, brace = tok.convert_tokens_to_ids("<"), tok.convert_tokens_to_ids("{")
    # "<": the call's start (one call: the bias would have it start a second, parallel one)
    call = oai.chat.completions.create(logit_bias={str(lt): 100}, parallel_tool_calls=False, **kw).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None, call
    [c] = call.message.tool_calls
    jsonschema.validate(json.loads(c.function.arguments), ADD)
    answer = oai.chat.completions.create(logit_bias={str(brace): 100}, **kw).choices[0]  # "{": the JSON
    assert not answer.message.tool_calls, answer
    jsonschema.validate(json.loads(answer.message.content), schema)


def test_a_whole_call_before_a_cut_stays_complete_in_the_responses_api(oai, tokenizer_dir):
    # the length limit fell in a second call dropped before its name; the first, whole
    # call was marked incomplete (an agent skipping incomplete calls lost it)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    # a second call's start ("\n<") over the end of the output: the random model ends after one
    bias = {str(tok.convert_tokens_to_ids(t)): 100 for t in ("<", "\u010a")}
    kw = dict(model=MODEL, input="2 + 3?", tools=[{"type": "function", **TOOLS[0]["function"]}],
              tool_choice="required", temperature=0, extra_body={"logit_bias": bias})
    one = oai.responses.create(parallel_tool_calls=False, max_output_tokens=200, **kw)
    n = one.usage.output_tokens
    checked = 0
    for extra in range(1, 6):  # a few tokens past the first call: the next one's start, cut
        r = oai.responses.create(max_output_tokens=n + extra, **kw)
        calls = [it for it in r.output if it.type == "function_call"]
        assert calls and calls[0].arguments == one.output[0].arguments
        if r.status == "incomplete" and len(calls) == 1:
            assert calls[0].status == "completed", r.output
            checked += 1
    assert checked, "the model never started a second call"
