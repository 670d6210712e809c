"""``/v1/responses`` through the official ``openai`` client: a two-turn tool loop with
``previous_response_id`` (non-stream and stream), JSON output with ``text.format``,
input items, and the errors; the bounded response store on its own."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from plait.chat_template import messages_without_tool_support
from plait.runtime.server import launch
from plait.runtime.server.responses_api import ResponseStore

MODEL = "tiny"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD}]
FN = [{"name": "add", "description": "Add two numbers", "parameters": ADD}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    with launch(str(model_dir), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                served_model_name=MODEL) as rt:
        yield rt


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _prompt_tokens(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages_without_tool_support(messages, FN), tokenize=False,
                                         add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _first_turn(oai, **kw):
    return oai.responses.create(model=MODEL, instructions="Use the tools.", input="What is 2 + 3?", tools=TOOLS,
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                temperature=0, **kw)


def test_two_turn_tool_loop(oai, tokenizer):
    r1 = _first_turn(oai)
    assert r1.status == "completed" and r1.object == "response" and r1.id.startswith("resp_")
    calls = [it for it in r1.output if it.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and calls[0].call_id.startswith("call_")
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, ADD)
    first = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2 + 3?"}]
    assert r1.usage.input_tokens == _prompt_tokens(tokenizer, first)
    # turn 2: the call's result, continuing from the stored response (instructions are not carried over)
    r2 = oai.responses.create(model=MODEL, previous_response_id=r1.id, tools=TOOLS, max_output_tokens=6,
                              temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                     "output": str(args["a"] + args["b"])}])
    assert r2.previous_response_id == r1.id and r2.status in ("completed", "incomplete")
    assert isinstance(r2.output_text, str)
    conversation = first[1:] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": calls[0].call_id, "type": "function", "function": {"name": "add", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": str(args["a"] + args["b"])},
    ]
    assert r2.usage.input_tokens == _prompt_tokens(tokenizer, conversation)
    # the same turn with the history sent as items instead of previous_response_id
    r3 = oai.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "add", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": str(args["a"] + args["b"])},
    ])
    assert r3.usage.input_tokens == r2.usage.input_tokens and r3.output_text == r2.output_text


def test_stream_events_build_the_same_response(oai):
    want = _first_turn(oai)
    with _first_turn(oai, stream=True) as events:
        events = list(events)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.index("response.output_item.added") < types.index("response.function_call_arguments.delta") \
        < types.index("response.function_call_arguments.done") < types.index("response.output_item.done")
    done = events[-1].response
    # the client's own types, strictly (ResponseUsage requires cache_write_tokens)
    from openai.types.responses import Response

    Response.model_validate(done.model_dump(exclude_unset=True), strict=True)
    assert done.usage.input_tokens_details.cache_write_tokens == \
        done.usage.input_tokens - done.usage.input_tokens_details.cached_tokens
    call = [it for it in done.output if it.type == "function_call"][0]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments == [it for it in want.output if it.type == "function_call"][0].arguments
    # the SDK's stream helper accumulates the same events into the final response
    with oai.responses.stream(model=MODEL, input="What is 2 + 3?", tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=200, temperature=0,
                              instructions="Use the tools.") as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert [it.arguments for it in final.output if it.type == "function_call"] == [call.arguments]
    # a streamed response is stored too: it can be continued
    nxt = oai.responses.create(model=MODEL, previous_response_id=done.id, max_output_tokens=2, temperature=0,
                               input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert nxt.previous_response_id == done.id


def test_text_format_json_schema(oai):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer"]}
    r = oai.responses.create(model=MODEL, input="Answer as JSON.", max_output_tokens=40, temperature=0,
                             text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    msg = [it for it in r.output if it.type == "message"][0]
    assert msg.role == "assistant" and msg.content[0].type == "output_text"


def test_errors_name_the_field(oai, server):
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_unknown", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param in [
            ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
            ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
            ({"input": [{"type": "computer_call"}]}, "input"),
            ({"input": []}, "input"),
            ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "array",
                                                                                  "uniqueItems": True}}}},
             "text.format"),
            ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
            ({"input": "hi", "bogus": 1}, "bogus"),
            ({"input": "hi", "background": True}, "background"),  # was run in the foreground, as if false
            ({"input": "hi", "background": "yes"}, "background"),
            # chat completions' nested shape: said "tools[0].name=None is invalid"
            ({"input": "hi", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
             "tools[0].name"),
        ]:
            r = http.post("/v1/responses", json={"model": MODEL, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
            if "'function': {" in str(body.get("tools")):
                assert "the Responses API's tools are flat" in r.json()["error"]["message"], r.text
        # a format without its schema: the shape shown is the Responses API's flat one, not chat's
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                             "text": {"format": {"type": "json_schema", "name": "x"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
        assert '"name": str, "schema": {...}}' in r.json()["error"]["message"], r.text
        assert '"json_schema": {' not in r.json()["error"]["message"], r.text
        r = http.post("/v1/responses", json={"model": "gpt-4o", "input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # reasoning items alone: it said "got an empty array" of an array of one item
        r = http.post("/v1/responses", json={"model": MODEL, "input": [{"type": "reasoning", "summary": []}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "only reasoning items (1)" in r.json()["error"]["message"], r.text
        # an empty stop string is named as the client sent it (it read stop=[''] for "")
        for stop, shown in (("", "stop=''"), (["a", ""], "stop=['a', '']")):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                        "stop": stop, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(shown + " is invalid"), r.text


def test_response_store_is_a_bounded_lru():
    store = ResponseStore(capacity=2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [{"role": "user", "content": "2"}])
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", [{"role": "user", "content": "3"}])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_retrieve_and_delete_a_stored_response(oai, server):
    """``responses.retrieve`` returns what ``create`` returned (streamed or not);
    ``responses.delete`` forgets it, after which retrieving it or continuing from it is
    a 404 naming the id; a ``store=False`` response is never held."""
    first = oai.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0)
    got = oai.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    with oai.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0, stream=True) as s:
        done = [e for e in s if e.type in ("response.completed", "response.incomplete")][-1].response
    assert oai.responses.retrieve(done.id).output_text == done.output_text
    assert oai.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError, match=first.id):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        oai.responses.create(model=MODEL, input="Again.", previous_response_id=first.id, max_output_tokens=4)
    unstored = oai.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    r = httpx.get(f"{server.url}/v1/responses/{done.id}", params={"stream": "true"})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


# -- logprobs -----------------------------------------------------------------------------------
LOGPROBS = ["message.output_text.logprobs"]


def _text_part(response):
    return [it for it in response.output if it.type == "message"][0].content[0]


def _lp_view(entries) -> list[tuple]:
    """Logprob entries without their values (compared approximately, apart)."""
    return [(t.token, t.bytes, [(a.token, a.bytes) for a in t.top_logprobs]) for t in entries]


def test_output_text_logprobs_are_the_chat_completions_ones(oai):
    """``include: ["message.output_text.logprobs"]`` was ignored and ``top_logprobs``
    refused: the message's output_text now carries the logprobs chat completions gives
    for the same conversation; streamed, the text deltas carry them as they are written."""
    ask = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 8, "temperature": 0}
    r = oai.responses.create(include=LOGPROBS, top_logprobs=2, **ask)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2)
    part, want = _text_part(r), chat.choices[0].logprobs.content
    assert part.text == chat.choices[0].message.content and want
    assert _lp_view(part.logprobs) == _lp_view(want) and all(len(t.top_logprobs) == 2 for t in want)
    assert [t.logprob for t in part.logprobs] == pytest.approx([t.logprob for t in want], abs=1e-4)
    assert _text_part(oai.responses.create(**ask)).logprobs == []  # not included: none
    with oai.responses.create(include=LOGPROBS, top_logprobs=2, stream=True, **ask) as s:
        events = list(s)
    tokens = [t.token for t in part.logprobs]
    streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert streamed and streamed == tokens[:len(streamed)]  # (a last token that writes no text: on the part only)
    text_done = [e for e in events if e.type == "response.output_text.done"][0]
    assert [t.token for t in text_done.logprobs] == tokens
    final = _text_part(events[-1].response)
    assert final.text == part.text and _lp_view(final.logprobs) == _lp_view(part.logprobs)
    assert [t.logprob for t in final.logprobs] == pytest.approx([t.logprob for t in part.logprobs], abs=1e-4)


def test_include_top_logprobs_and_reasoning_effort_are_checked(oai, server):
    """Any ``include`` value and any reasoning effort were accepted (and ``top_logprobs``
    refused as unknown): an unknown one is a 400 naming the field and the value."""
    efforts = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, param, value in [
            ("/v1/responses", {"input": "hi", "include": [LOGPROBS[0], "bogus.value"]}, "include", "bogus.value"),
            ("/v1/responses", {"input": "hi", "include": LOGPROBS, "top_logprobs": 21}, "top_logprobs", "21"),
            ("/v1/responses", {"input": "hi", "top_logprobs": 2}, "top_logprobs", LOGPROBS[0]),
            ("/v1/responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "extreme"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"},
             "reasoning_effort", "extreme"),
        ]:
            r = http.post(path, json={"model": MODEL, "max_tokens" if "messages" in body else "max_output_tokens": 1,
                                      **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert value in r.json()["error"]["message"], r.text
            if param.endswith("effort"):
                assert all(repr(e) in r.json()["error"]["message"] for e in efforts), r.text
    for effort in (None, "minimal", "high"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                    reasoning_effort=effort)
        resp = oai.responses.create(model=MODEL, input="hi", max_output_tokens=1, reasoning={"effort": effort},
                                    include=["reasoning.encrypted_content"])  # (harmless: reasoning is in clear)
        assert resp.reasoning is not None and resp.reasoning.effort == effort  # repeated, as OpenAI does
    assert oai.responses.create(model=MODEL, input="hi", max_output_tokens=1).reasoning is None


def test_completion_text_offsets_of_split_characters(server):
    """A token that is only part of a character counted as one character of its own
    (its text is U+FFFD) in the non-streamed ``text_offset``, so every later offset was
    past the text; streamed, the text a chunk wrote resynchronized it. Both are now the
    index of the character each token's first byte is part of."""
    text = "😀🎉é!"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 16, "temperature": 0, "logprobs": 0, "regex": text}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    assert whole["text"] == text
    tokens, offsets = whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"]
    assert "\ufffd" in tokens  # the emoji's tokens are pieces of it
    assert offsets == sorted(offsets) and offsets[0] == 0
    for tok, off in zip(tokens, offsets):
        if off < len(text) and tok != "\ufffd":  # a whole-character token is where the text has it
            assert text[off:off + len(tok)] == tok, (tokens, offsets)
    assert text.index("!") in offsets and offsets[-1] <= len(text)
    streamed = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert streamed == offsets


def test_streamed_text_offsets_count_the_text_a_stop_string_held_back(server):
    """Streamed, a choice's offsets advanced by the text each chunk sent: a chunk whose
    text a stop string held back ("\\n" may begin "\\n\\n") advanced them by nothing, so
    every later token's offset was too small ("b" of "a\\nb" at 1, not 2). They are now
    counted from the tokens, as the non-streamed ``text_offset`` is."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "temperature": 0, "logprobs": 0, "regex": "a\nb",
            "stop": ["\n\n"]}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    tokens, offsets = whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"]
    assert whole["text"] == "a\nb" and "".join(tokens) == "a\nb"
    assert offsets == [whole["text"].index(t) for t in tokens]
    sent = [c for c in chunks if c["logprobs"]]
    assert any(c["text"] != "".join(c["logprobs"]["tokens"]) for c in sent)  # some text was held back
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [o for c in sent for o in c["logprobs"]["text_offset"]] == offsets


# -- input items --------------------------------------------------------------------------------
def test_input_items_list_the_stored_input_in_openais_shapes():
    """``GET /v1/responses/{id}/input_items`` was missing: a stored response's input
    items, after those of the response it continued (its input and output), paged as
    OpenAI's list object (newest first by default), each as the client's types have
    it; an id not held is a 404 naming it."""
    from pydantic import TypeAdapter
    from starlette.datastructures import QueryParams

    from openai.pagination import SyncCursorPage
    from openai.types.responses import ResponseItem
    from plait.errors import RequestError
    from plait.runtime.server.responses_api import input_items_page, stored_input_items

    store = ResponseStore()
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": "{}",
            "status": "completed"}
    first = stored_input_items(store, None, "What is 2 + 3?")
    store.put("resp_1", [], {"output": [call]}, first)
    second = stored_input_items(store, "resp_1", [
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "5"}]},
        {"id": "msg_mine", "role": "developer", "content": "Be brief."},
    ])
    store.put("resp_2", [], {"output": []}, second)

    page = input_items_page(store, "resp_2", QueryParams("order=asc"))
    typed = SyncCursorPage[ResponseItem].model_validate(page)
    assert page["object"] == "list" and not typed.has_more
    assert [type(it).__name__ for it in typed.data] == [
        "ResponseInputMessageItem", "ResponseFunctionToolCallItem", "ResponseFunctionToolCallOutputItem",
        "ResponseOutputMessage", "ResponseInputMessageItem"]
    TypeAdapter(list[ResponseItem]).validate_python(page["data"])  # strictly: every field the types require
    assert typed.data[0].content[0].text == "What is 2 + 3?" and typed.data[1].id == "fc_1"
    assert typed.data[2].output == "5" and typed.data[-1].id == "msg_mine"
    ids = [it["id"] for it in page["data"]]
    assert len(set(ids)) == len(ids) and (page["first_id"], page["last_id"]) == (ids[0], ids[-1])
    # newest first, paged after an id
    newest = input_items_page(store, "resp_2", QueryParams("limit=2"))
    assert [it["id"] for it in newest["data"]] == ids[::-1][:2] and newest["has_more"]
    rest = input_items_page(store, "resp_2", QueryParams(f"limit=2&after={newest['last_id']}&include=" + LOGPROBS[0]))
    assert [it["id"] for it in rest["data"]] == ids[::-1][2:4] and rest["has_more"]
    assert input_items_page(store, "resp_1", QueryParams(""))["data"] == first
    for query, param in [("", "response_id"), ("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                         ("after=nope", "after"), ("include=bogus", "include")]:
        with pytest.raises(RequestError) as e:
            input_items_page(store, "resp_9" if param == "response_id" else "resp_2", QueryParams(query))
        assert e.value.param == param and e.value.status == (404 if param == "response_id" else 400)
        assert ("resp_9" if param == "response_id" else query.split("=")[1]) in e.value.message


def test_input_items_are_served_to_the_client(oai):
    """``responses.input_items.list`` had no route (a 404 for every id): a stored
    response's input items, newest first unless asked otherwise; an id not held is a
    404 naming it."""
    asked = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"},
             {"role": "user", "content": "And 3 + 4?"}]
    r = oai.responses.create(model=MODEL, instructions="Be brief.", input=asked, max_output_tokens=1, temperature=0,
                             store=True)
    items = oai.responses.input_items.list(r.id, order="asc")
    assert [(it.type, it.role, it.content[0].text) for it in items.data] == [
        ("message", m["role"], m["content"]) for m in asked]  # (the instructions are not an item)
    assert not items.has_more and items.first_id == items.data[0].id
    newest = oai.responses.input_items.list(r.id, limit=2)
    assert [it.id for it in newest.data] == [it.id for it in items.data][::-1][:2] and newest.has_more
    with pytest.raises(openai.NotFoundError, match="resp_unknown") as e:
        oai.responses.input_items.list("resp_unknown")
    assert e.value.body["param"] == "response_id"  # (not the router's 404 for a path it lacks)
