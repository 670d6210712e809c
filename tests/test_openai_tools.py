"""Tool calling, reasoning and model names on ``/v1/chat/completions``, through the
official ``openai`` client (non-stream and stream).

Two tiny random models: one with SmolLM2's template (no tool support: plait's generic
tool prompt, hermes calls) and one whose template renders tools and opens ``<think>``
(served with ``--reasoning-parser deepseek-r1``). A random model's free output rarely
calls a tool, so ``required``/named choices (forced by constrained decoding) carry the
server checks of calls, and ``auto`` is checked against the parse of the same output.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from conftest import with_chat_template

from plait.chat_template import messages_for_tool_template, messages_without_tool_support
from plait.reasoning import get_reasoning_parser
from plait.runtime.server import launch
from plait.tool_parsers import get_tool_parser

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 400}

THINK_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""


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
def think_dir(model_dir, tmp_path_factory):
    return with_chat_template(model_dir, tmp_path_factory.mktemp("tiny-think"), THINK_TEMPLATE)


@pytest.fixture(scope="module")
def think(think_dir):
    with launch(str(think_dir), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                served_model_name=MODEL, reasoning_parser="deepseek-r1") as rt:
        yield rt, openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _fns() -> list[dict]:
    return [t["function"] for t in TOOLS]


def _check_calls(message, choice: str | None = None, most: int = 1) -> list[tuple[str, dict]]:
    assert message.content is None
    calls = message.tool_calls
    assert 1 <= len(calls) <= most
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert choice is None or c.function.name == choice
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    assert len({c.id for c in calls}) == len(calls)
    return out


# -- tool_choice ----------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_parse_and_validate(oai, tokenizer, choice):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                    parallel_tool_calls=False, **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message, None if choice == "required" else "add")
    # the template knows no tools: the prompt is plait's generic tool prompt in its system message
    want = tokenizer.apply_chat_template(messages_without_tool_support(ASK, _fns()), tokenize=False,
                                         add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(want, add_special_tokens=False))


def test_a_forced_call_cut_by_max_tokens_comes_back_as_the_call_so_far(oai):
    """Every cut of a forced call: once its name is written (and the next key begun) it is
    a call whose arguments are a prefix of the whole call's, streamed and not; a cut
    before that is no call and no content. A cut between the name and the arguments
    came back empty (no call, no content: the output was lost)."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              parallel_tool_calls=False, temperature=0.0)
    whole = oai.chat.completions.create(**kw, max_tokens=400)
    full_args = whole.choices[0].message.tool_calls[0].function.arguments
    named = 0
    for mt in range(1, whole.usage.completion_tokens):
        r = oai.chat.completions.create(**kw, max_tokens=mt, logprobs=True)
        text = "".join(t.token for t in r.choices[0].logprobs.content)
        message, calls = r.choices[0].message, r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "length" and message.content is None, (mt, text)
        if re.search(r'"name"\s*:\s*"add"\s*,', text):
            named += 1
            assert [c.function.name for c in calls] == ["add"], (mt, text)
            assert full_args.startswith(calls[0].function.arguments), (mt, text)
            streamed = {}
            # (with logprobs, as above: a request with them never jumps forward, so it writes the same tokens)
            for chunk in oai.chat.completions.create(**kw, max_tokens=mt, stream=True, logprobs=True):
                for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    e = streamed.setdefault(d.index, ["", ""])
                    e[0] += d.function.name or ""
                    e[1] += d.function.arguments or ""
            assert streamed == {0: ["add", calls[0].function.arguments]}, (mt, text)
        else:
            assert not calls, (mt, text)
    assert named >= 3  # cuts right after the name, inside the arguments key, inside the arguments


def test_allowed_tools_choice(oai, server, tokenizer):
    """OpenAI's ``allowed_tools`` choice: every tool stays in the prompt, and the calls
    are to the allowed ones only (``required``: forced, as one call or several)."""
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required",
                                                           "tools": [{"type": "function", "function": {"name": "add"}}]}}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=allowed,
                                    parallel_tool_calls=True, **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls"
    assert {name for name, _ in _check_calls(r.choices[0].message, "add", most=8)} == {"add"}
    want = tokenizer.apply_chat_template(messages_without_tool_support(ASK, _fns()), tokenize=False,
                                         add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(want, add_special_tokens=False))  # both tools shown
    # mode auto: free output, in which only the allowed tools' calls are calls
    auto = {"type": "allowed_tools", "allowed_tools": {**allowed["allowed_tools"], "mode": "auto"}}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=auto, max_tokens=24,
                                    temperature=0.0)
    assert all(c.function.name == "add" for c in r.choices[0].message.tool_calls or [])
    # the Responses API's flat shape
    flat = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    rtools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "model": MODEL, "input": ASK[0]["content"], "tools": rtools, "tool_choice": flat, "temperature": 0.0,
        "max_output_tokens": 200, "parallel_tool_calls": False})
    assert resp.status_code == 200, resp.text
    calls = [o for o in resp.json()["output"] if o["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    # an unknown choice: the message shows each API's own shapes
    bad = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": "hi", "tools": rtools, "tool_choice": {"type": "any"}, "max_output_tokens": 4})
    assert bad.status_code == 400 and '{"type": "function", "name": ...}' in bad.json()["error"]["message"], bad.text
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, tool_choice={"type": "any"})
    assert '{"type": "function", "function": {"name": ...}}' in e.value.body["message"], e.value.body
    # malformed choices: a 400 naming tool_choice and the part at fault
    spec = allowed["allowed_tools"]
    for bad, part in ((dict(spec, mode="sometimes"), "mode"), (dict(spec, tools=[]), "tools"),
                      (dict(spec, tools=[{"type": "web_search"}]), "tools[0]"),
                      (dict(spec, tools=[{"type": "function", "function": {"name": "nope"}}]), "'nope'")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                        tool_choice={"type": "allowed_tools", "allowed_tools": bad})
        assert e.value.body["param"] == "tool_choice" and part in e.value.body["message"], e.value.body


def test_parallel_calls_stream_like_the_response(oai):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, **GREEDY)
    r = oai.chat.completions.create(**kw)
    calls = _check_calls(r.choices[0].message, most=8)
    with oai.chat.completions.stream(**kw) as s:
        events = list(s)
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert _check_calls(final.choices[0].message, most=8) == calls
    # OpenAI's delta shape: per call, id, type and name first, then argument fragments
    deltas = [tc for e in events if e.type == "chunk" for ch in e.chunk.choices for tc in ch.delta.tool_calls or []]
    firsts = [d for d in deltas if d.id is not None]
    assert [d.index for d in firsts] == list(range(len(calls)))
    assert all(d.type == "function" and d.function.name and not d.function.arguments for d in firsts)
    for i, (_, args) in enumerate(calls):
        text = "".join(d.function.arguments or "" for d in deltas if d.index == i)
        assert json.loads(text) == args
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [a for _, a in calls]


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory, tokenizer_dir):
    """A tiny model whose tokenizer has ``<tool_call>`` and ``</tool_call>`` as added
    (not special) tokens, as Qwen2.5's has: one token writes the call trigger."""
    from transformers import AutoTokenizer

    from conftest import TINY_VOCAB, build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("qwen-like"), tokenizer_dir, "llama", vocab_size=TINY_VOCAB + 2)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.save_pretrained(folder)
    with launch(str(folder), num_threads=1, kv_cache_tokens=4096, max_running_requests=4,
                served_model_name=MODEL) as rt:
        yield rt, openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120), tok


def test_strict_tools_under_auto_are_called_by_their_schema(qwen_like):
    """OpenAI's ``strict: true`` under ``tool_choice="auto"``: the model may answer in
    text, but a call it starts follows the function's schema. A logit bias makes the
    random model write the ``<tool_call>`` token whenever it may (and else stop): with
    strict, what follows it is a valid call, and a second trigger, which could only
    start text between calls, is refused; without strict the same bias writes triggers
    until max_tokens and no call."""
    server, oai, tok = qwen_like
    strict_add = {**ADD, "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "add", "strict": True, "parameters": strict_add}}]
    bias = {str(tok.convert_tokens_to_ids("<tool_call>")): 100, str(tok.eos_token_id): 50}
    kw = dict(model=MODEL, messages=ASK, tool_choice="auto", logit_bias=bias, temperature=0.0, max_tokens=80,
              parallel_tool_calls=False)
    r = oai.chat.completions.create(tools=tools, **kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1, r
    assert calls[0].function.name == "add"
    jsonschema.validate(json.loads(calls[0].function.arguments), strict_add)
    with oai.chat.completions.stream(tools=tools, **kw) as s:
        final = s.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]
    loose = [{"type": "function", "function": {"name": "add", "strict": False, "parameters": strict_add}}]
    r = oai.chat.completions.create(tools=loose, **kw)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls, r
    # the Responses API's flat tools carry strict on the tool
    resp = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "model": MODEL, "input": ASK[0]["content"], "temperature": 0.0, "max_output_tokens": 80,
        "tools": [{"type": "function", "name": "add", "strict": True, "parameters": strict_add}],
        "parallel_tool_calls": False, "logit_bias": bias})
    assert resp.status_code == 200, resp.text
    out = [o for o in resp.json()["output"] if o["type"] == "function_call"]
    assert len(out) == 1 and out[0]["name"] == "add", resp.json()
    jsonschema.validate(json.loads(out[0]["arguments"]), strict_add)


def test_auto_is_the_parse_of_the_free_output_and_none_does_not_parse(oai):
    raw = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24,
                                      temperature=0)
    text = raw.choices[0].message.content
    assert raw.choices[0].message.tool_calls is None and raw.choices[0].finish_reason in ("stop", "length")
    auto = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    content, calls = get_tool_parser("hermes").parse(text, TOOLS)
    msg = auto.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == \
        [(c.name, c.arguments) for c in calls]
    assert msg.content == (content if content or not calls else None)


def test_history_with_tool_results(oai, tokenizer):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "5"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, **GREEDY)
    _check_calls(r.choices[0].message)
    checked = [{"role": m["role"], "content": m["content"] or "", **{k: m[k] for k in ("tool_calls", "tool_call_id")
                                                                     if k in m}} for m in history]
    want = tokenizer.apply_chat_template(messages_without_tool_support(checked, _fns()), tokenize=False,
                                         add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in want and '"arguments": {"a": 2, "b": 3}' in want
    assert r.usage.prompt_tokens == len(tokenizer.encode(want, add_special_tokens=False))


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "[a-z]+"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"max_reasoning_chars": 5}, "max_reasoning_chars"),  # this server has no reasoning parser
    ({"response_format": {"type": "json_object"}, "regex": "[ab]"}, "regex"),  # two constraints
]


def test_bad_tool_requests_are_400s_naming_the_field(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for extra, param in BAD:
            r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.text)
        assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).status_code == 200


def test_model_names(server, oai):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body in ({}, {"model": ""}, {"model": "default"}, {"model": MODEL}):
            r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})
            assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "gpt-4o"})
        assert r.status_code == 404
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                     "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
    assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message


# -- a template with tools and <think>, --reasoning-parser deepseek-r1 ---------------------------------
def test_reasoning_is_split_from_the_content(think, think_dir):
    rt, oai = think
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(think_dir)
    prompt = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    with httpx.Client(base_url=rt.url, timeout=60) as http:
        raw = http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 16,
                                                                              "temperature": 0}}).json()["text"]
    reasoning, content = get_reasoning_parser("deepseek-r1").parse(raw)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == (reasoning, content)
    with oai.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=16, temperature=0) as s:
        chunks = [e.chunk for e in s if e.type == "chunk"]
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == reasoning
    # bounded reasoning without another constraint: the answer after it is free
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                    extra_body={"max_reasoning_chars": 4})
    assert len(r.choices[0].message.reasoning_content) <= 4 and r.choices[0].finish_reason in ("stop", "length")


def test_forced_call_after_bounded_reasoning(think, think_dir):
    rt, oai = think
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              extra_body={"max_reasoning_chars": 12}, **GREEDY)
    r = oai.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.reasoning_content) <= 12
    calls = _check_calls(msg, "add")
    # the template renders the tools itself (no generic prompt)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(think_dir)
    want = tok.apply_chat_template(messages_for_tool_template(ASK), tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert "<tools>" in want and r.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))
    with oai.chat.completions.stream(**kw) as s:
        chunks = [e.chunk for e in s if e.type == "chunk"]
        final = s.get_final_completion()
    assert _check_calls(final.choices[0].message, "add") == calls
    kinds = [k for c in chunks for ch in c.choices for k in ("reasoning_content", "tool_calls")
             if getattr(ch.delta, k, None)]
    assert kinds[-1] == "tool_calls" and "reasoning_content" not in kinds[kinds.index("tool_calls"):]


def test_response_format_applies_after_the_reasoning(think):
    _, oai = think
    r = oai.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
        extra_body={"max_reasoning_chars": 8}, **GREEDY)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and len(msg.reasoning_content) <= 8
    jsonschema.validate(json.loads(msg.content), WEATHER)


def test_parallel_tool_calls_false_keeps_only_the_first_call_a_model_writes():
    """Under tool_choice auto the model writes what it writes; with
    parallel_tool_calls=false the answer carries its first call only, streamed or not."""
    from plait.runtime.server.openai_api import ChatOutput

    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    for max_calls, names in ((None, ["get_weather", "add"]), (1, ["get_weather"])):
        out = ChatOutput(None, get_tool_parser("hermes"), TOOLS, max_calls)
        msg, has_calls = out.message(text)
        assert has_calls and [c["function"]["name"] for c in msg["tool_calls"]] == names
        stream = out.stream()
        deltas = [d for i in range(0, len(text), 7) for d in stream.feed(text[i:i + 7])] + stream.finish()
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert [tc["function"]["name"] for tc in calls if "id" in tc] == names
        assert {tc["index"] for tc in calls} == set(range(len(names)))
        assert not any(d.get("content", "").strip() for d in deltas)


def test_free_text_around_strict_calls_goes_to_llguidance(monkeypatch):
    """A strict tool under auto (and a structural tag) constrains free text around the
    calls: outlines-core built that whole automaton before the first token (7-12 s for one
    5-field tool on the default model, on a 2-core machine); on a server whose grammar
    backend is auto it goes to llguidance, which follows the same regex lazily. A server
    or request naming a backend keeps it; a forced call stays on auto's own choice."""
    from types import SimpleNamespace

    from plait.runtime.server import openai_api as oa
    from plait.runtime.validation import ModelLimits

    monkeypatch.setattr(oa, "render_chat", lambda *args, **kwargs: "prompt")
    monkeypatch.setattr(oa, "server_tool_parser", lambda front: "hermes")
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    strict = [{"type": "function", "function": {"name": "weather", "parameters": params, "strict": True}}]

    def constraint(backend: str, **body: Any) -> dict[str, Any]:
        front = SimpleNamespace(args=SimpleNamespace(reasoning_parser=None), limits=ModelLimits(100, 1000, backend),
                                encode=lambda text, param, bos=True: [1, 2], token_bytes=lambda t: b"",
                                turn_end=None)
        return oa.chat_request(front, body, [{"role": "user", "content": "hi"}], None, "response_format").constraint

    auto = constraint("auto", tools=strict)
    assert auto["grammar_backend"] == "llguidance" and "weather" in auto["regex"]
    assert "grammar_backend" not in constraint("outlines", tools=strict)
    assert constraint("auto", tools=strict, grammar_backend="outlines").get("grammar_backend") is None
    assert "grammar_backend" not in constraint("auto", tools=strict, tool_choice="required")
    loose = [{"type": "function", "function": {"name": "weather", "parameters": params}}]
    assert constraint("auto", tools=loose) == {}  # not strict: the reply is free


def test_the_eos_that_ends_a_reply_is_not_its_content_with_special_tokens_kept(oai, tokenizer):
    """Parsers whose markers are special tokens (mistral, granite, deepseek_v3) decode
    with skip_special_tokens=false; the EOS that ended the reply came back as the end of
    every message's content ('Hello.<|im_end|>'), streamed and not."""
    eos = tokenizer.eos_token_id
    eos_text = tokenizer.convert_ids_to_tokens(eos)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
              logit_bias={str(eos): 100}, extra_body={"min_tokens": 2, "skip_special_tokens": False})
    r = oai.chat.completions.create(**kw)
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    assert content and eos_text not in content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == content
