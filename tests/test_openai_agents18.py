"""Agent trial, round 2 (after test_openai_agents_trial.py): the requests public agent
libraries send, reproduced with the official ``openai`` client against a tiny random
model with Qwen3's own template (hermes calls, ``<think>`` reasoning, ``--reasoning-parser
qwen3``). The gaps found, each now served:

- ``tools: []``: the OpenAI Agents SDK's Responses model sends it for every agent without
  tools (``tools=converted_tools.tools``), and OpenAI serves it; it was a 400 on both APIs.
  It is now no tools; a call forced with it is a 400 naming ``tools``.
- A forced ``tool_choice`` beside a JSON ``response_format`` / ``text.format``: the Agents
  SDK sends an agent's ``output_type`` with ``ModelSettings(tool_choice="required")``
  (reset to auto after the call), as OpenAI serves; it was a 400. The forced turn writes
  the calls; the format shapes a later text reply.
- Reasoning given back: an assistant message's ``reasoning_content`` (what this server
  returns, and what ``message.model_dump()`` sends back; vLLM's ``reasoning`` too) and
  the Responses API's ``reasoning`` items (replayed, or the stored conversation of
  ``previous_response_id``) were dropped, so Qwen3's template never showed the thinking
  of a tool loop's turns, which it renders after the last user message.
- An assistant message with ``tool_calls: []`` (openai-node's ``parse`` helper wrote one
  into every message it returned; agents send it back) was a 400; it is no calls.

A random model rarely calls a tool by itself, so forced choices (constrained decoding)
carry the call checks; reasoning is checked by the prompt's token count, which is what
the template rendered.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from conftest import with_chat_template

from plait.runtime.server import launch

MODEL = "tiny"
TEMPLATE = Path(__file__).parent / "data" / "templates17" / "qwen3.jinja"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two digits.", "parameters": ADD,
                                           "strict": True}}]
FLAT = [{"type": "function", "name": "add", "description": "Add two digits.", "parameters": ADD, "strict": True}]
OUTPUT = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
THOUGHT = "The user wants a sum, so I should call add with both digits first."
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5"}]}
# a short thinking section, then the constrained answer (qwen3: the section is optional)
BOUNDED = {"max_reasoning_chars": 16}


@pytest.fixture(scope="module")
def oai(tiny_model_factory, tmp_path_factory):
    folder = with_chat_template(tiny_model_factory("llama"), tmp_path_factory.mktemp("qwen3-agents18"),
                                TEMPLATE.read_text())
    with launch(str(folder), num_threads=1, kv_cache_tokens=8192, max_running_requests=8, served_model_name=MODEL,
                reasoning_parser="qwen3") as rt:
        yield openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _prompt_tokens(oai: openai.OpenAI, messages: list[dict]) -> int:
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_completion_tokens=1)
    return r.usage.prompt_tokens


def test_an_empty_tools_array_is_no_tools(oai):
    # the Agents SDK's Responses request for an agent without tools
    r = oai.responses.create(model=MODEL, input="hi", instructions="Be brief.", tools=[], include=[],
                             max_output_tokens=3, store=True)
    assert r.status in ("completed", "incomplete") and r.tools == []
    assert all(item.type != "function_call" for item in r.output)
    c = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[], max_completion_tokens=3)
    assert c.choices[0].message.tool_calls is None
    for choice in ("auto", "none"):
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=[], tool_choice=choice, max_completion_tokens=1)
    for call in (lambda: oai.chat.completions.create(model=MODEL, messages=ASK, tools=[], tool_choice="required",
                                                     max_completion_tokens=3),
                 lambda: oai.responses.create(model=MODEL, input="hi", tools=[], tool_choice="required",
                                              max_output_tokens=3)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "tools" and "tool_choice" in e.value.body["message"]


def test_output_type_beside_a_forced_call(oai):
    # Agents SDK, chat path: tools + response_format from output_type + tool_choice "required"
    fmt = {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True, "schema": OUTPUT}}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, response_format=fmt,
                                        parallel_tool_calls=False, max_completion_tokens=120, extra_body=BOUNDED)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), ADD)
    # Responses path: text.format + tool_choice, streamed as the SDK's Runner.run_streamed does
    text = {"format": {"type": "json_schema", "name": "final_output", "strict": True, "schema": OUTPUT}}
    with oai.responses.stream(model=MODEL, input="What is 2 + 3?", tools=FLAT, tool_choice="required", text=text,
                              parallel_tool_calls=False, max_output_tokens=120, extra_body=BOUNDED) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert final.status == "completed" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), ADD)
    # a raw whole-output constraint still conflicts with a forced call
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_completion_tokens=8, extra_body={"regex": "[a-z]+"})
    assert e.value.body["param"] == "tool_choice"


def test_chat_reasoning_given_back_reaches_the_template(oai):
    plain = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    without = _prompt_tokens(oai, ASK + [plain, RESULT])
    with_thought = _prompt_tokens(oai, ASK + [{**plain, "reasoning_content": THOUGHT}, RESULT])
    assert with_thought > without  # Qwen3's template shows the tool loop's thinking
    assert _prompt_tokens(oai, ASK + [{**plain, "reasoning": THOUGHT}, RESULT]) == with_thought  # vLLM's name
    # a reply given back as the client holds it (model_dump: reasoning_content rides along)
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_completion_tokens=120,
                                    extra_body={"max_reasoning_chars": 40})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    turn = msg.model_dump()
    answer = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"}
    bare = {k: v for k, v in turn.items() if k != "reasoning_content"}
    extra = 1 if getattr(msg, "reasoning_content", None) else 0
    assert (_prompt_tokens(oai, ASK + [turn, answer]) > _prompt_tokens(oai, ASK + [bare, answer])) == bool(extra)
    with pytest.raises(openai.BadRequestError) as e:
        _prompt_tokens(oai, ASK + [{**plain, "reasoning_content": {"text": THOUGHT}}, RESULT])
    assert e.value.body["param"] == "messages" and "reasoning_content" in e.value.body["message"]


def test_responses_reasoning_items_reach_the_template(oai):
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{\"a\": 2, \"b\": 3}",
            "id": "fc_1", "status": "completed"}
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None,
               "content": [{"type": "reasoning_text", "text": THOUGHT}]}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "5"}

    def input_tokens(items: list[dict]) -> int:
        r = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "What is 2 + 3?"}, *items],
                                 tools=FLAT, max_output_tokens=1, store=False)
        return r.usage.input_tokens

    assert input_tokens([thought, call, output]) > input_tokens([call, output])
    summary = {**thought, "content": None, "summary": [{"type": "summary_text", "text": THOUGHT}]}
    assert input_tokens([summary, call, output]) == input_tokens([thought, call, output])
    # previous_response_id continues the stored conversation as a replay of its items does
    first = oai.responses.create(model=MODEL, input="What is 2 + 3?", tools=FLAT, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120, extra_body={"max_reasoning_chars": 40})
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    answer = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}
    chained = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[answer], tools=FLAT,
                                   max_output_tokens=1)
    replayed = [item.model_dump(exclude_none=True) for item in first.output]
    assert chained.usage.input_tokens == input_tokens([*replayed, answer])


def test_an_empty_tool_calls_array_is_no_calls(oai):
    said = {"role": "assistant", "content": "Let me think."}
    follow = {"role": "user", "content": "Go on."}
    assert _prompt_tokens(oai, ASK + [{**said, "tool_calls": []}, follow]) == _prompt_tokens(oai, ASK + [said, follow])
    with pytest.raises(openai.BadRequestError) as e:
        _prompt_tokens(oai, ASK + [{**said, "tool_calls": {"id": "x"}}, follow])
    assert e.value.body["param"] == "messages" and "tool_calls" in e.value.body["message"]


def test_sglang_stop_regex_passes_through_the_openai_api(oai):
    # SGLang's OpenAI API takes stop_regex (and spaces_between_special_tokens) as extra body fields
    free = oai.completions.create(model=MODEL, prompt="Count: 1 2 3", max_tokens=24, temperature=0.0)
    text = free.choices[0].text
    cut = next((i for i, c in enumerate(text) if c.isalpha()), None)
    assert cut is not None and cut > 0, text  # (the tiny model writes letters soon after the start)
    r = oai.completions.create(model=MODEL, prompt="Count: 1 2 3", max_tokens=24, temperature=0.0,
                               extra_body={"stop_regex": ["[A-Za-z]"], "spaces_between_special_tokens": False})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:cut]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=3,
                                    extra_body={"stop_regex": ["(a"]})
    assert e.value.body["param"] == "stop_regex"


def test_a_strict_tool_under_auto_behind_qwen3s_optional_section(tiny_model_factory, tmp_path_factory):
    """Qwen3's thinking section is optional, and the free text a strict tool's reply may
    hold under auto can itself begin '<think>': outlines-core's automaton held both
    readings at once (one small tool: 30 s, past the compile limit, a 400 that called
    the regex invalid; 2-4 s without the section), so on a server whose grammar backend
    is auto such a constraint goes to llguidance, which follows it lazily (0.6 s).
    Under a 5 s compile limit the request is served and a call in it parsed."""
    folder = with_chat_template(tiny_model_factory("llama"), tmp_path_factory.mktemp("qwen3-strict-auto"),
                                TEMPLATE.read_text())
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": city, "strict": True}}]
    with launch(str(folder), num_threads=1, kv_cache_tokens=4096, max_running_requests=4, served_model_name=MODEL,
                reasoning_parser="qwen3", grammar_compile_timeout=5.0) as rt:
        client = openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=tools, max_tokens=24, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # the call the constraint keeps to its schema, written by hand and parsed from the reply
        done = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools, max_tokens=40,
            temperature=0, extra_body={"continue_final_message": False})
        for call in done.choices[0].message.tool_calls or []:
            assert len(json.loads(call.function.arguments)["city"]) <= 8
