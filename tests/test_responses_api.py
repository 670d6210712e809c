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
        ]:
            r = http.post("/v1/responses", json={"model": MODEL, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        r = http.post("/v1/responses", json={"model": "gpt-4o", "input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


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
