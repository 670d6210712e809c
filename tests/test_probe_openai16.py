"""Clients on the official OpenAI client's newer parameters, and tool-call parsing of
model output that goes wrong (after test_probe_openai15.py): every field the client can
send is known to the server (served, or a 400 naming it); ``stream_options`` keys are
checked and vLLM's ``continuous_usage_stats`` puts usage on every chunk; a refusal the
assistant said is replayed; a length cut after a block that is no call keeps the text;
a call that streamed, then turned out no call, does not end the turn as ``tool_calls``."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import openai
import pytest

import plait.tool_parsers as tp
from plait.runtime.server import openai_api as oa
from plait.runtime.server import responses_api as ra
from test_server_hostile import http, server  # noqa: F401  (the same server, one per module)

MESSAGES = [{"role": "user", "content": "hi"}]
FN = [{"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string"}}}},
      {"name": "g-h", "parameters": {"type": "object"}}]


def _typed_keys(td: type) -> set[str]:
    return {k for c in td.__mro__ for k in getattr(c, "__annotations__", {})}


def test_every_field_the_openai_client_sends_is_known():
    """A field of the installed client's create() params that the server calls
    "unrecognized" fails every client that sets it (``moderation``,
    ``prompt_cache_retention``, the Responses API's ``conversation`` and ``prompt``
    were): each is now served, accepted as a hint, or refused by name at a value."""
    from openai.types import completion_create_params as cp
    from openai.types.chat import completion_create_params as ccp
    from openai.types.responses import response_create_params as rcp

    ignored = set(oa._IGNORED)
    assert _typed_keys(ccp.CompletionCreateParamsBase) - oa.CHAT_FIELDS - ignored == set()
    assert _typed_keys(cp.CompletionCreateParamsBase) - oa.COMPLETION_FIELDS - ignored == set()
    assert _typed_keys(rcp.ResponseCreateParamsBase) - ra.FIELDS - ignored == set()


def _post(http: httpx.Client, path: str, **body: Any) -> httpx.Response:
    defaults = {"/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 3},
                "/v1/responses": {"input": "hi", "max_output_tokens": 3},
                "/v1/completions": {"prompt": "hi", "max_tokens": 3}}[path]
    return http.post(path, json={**defaults, **body})


REFUSED = [  # (path, body, the param the 400 names, a word its message says)
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usge": True}}, "stream_options",
     "include_usge"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "true or false"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "include_usage"),
    ("/v1/completions", {"stream": True, "stream_options": {"usage": True}}, "stream_options", "usage"),
    ("/v1/responses", {"stream": True, "stream_options": {"include_usage": True}}, "stream_options",
     "include_obfuscation"),
    ("/v1/responses", {"stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
    ("/v1/chat/completions", {"moderation": {"model": "omni-moderation-latest"}}, "moderation", "not supported"),
    ("/v1/chat/completions", {"prompt_cache_retention": "forever"}, "prompt_cache_retention", "24h"),
    ("/v1/chat/completions", {"prompt_cache_options": "30m"}, "prompt_cache_options", "object"),
    ("/v1/responses", {"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ("/v1/responses", {"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ("/v1/responses", {"context_management": [{"type": "compaction"}]}, "context_management", "not supported"),
    ("/v1/responses", {"text": {"formt": {"type": "text"}}}, "text", "formt"),
    ("/v1/responses", {"text": {"verbosity": "loud"}}, "text.verbosity", "'low'"),
    ("/v1/chat/completions", {"messages": MESSAGES + [{"role": "assistant", "content": None, "refusal": 5}]},
     "messages", "refusal"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "refusal": "no"}]}, "messages",
     "refusal"),
]


@pytest.mark.parametrize("path,body,param,says", REFUSED, ids=[f"{p}-{n}" for n, (p, *_) in enumerate(REFUSED)])
def test_newer_client_fields_are_refused_by_name(http, path, body, param, says):
    r = _post(http, path, **body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
                              "moderation": None, "prompt_cache_key": "k"}),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_obfuscation": False}}),
    ("/v1/responses", {"conversation": None, "prompt": None, "context_management": None, "moderation": None,
                       "prompt_cache_retention": "in_memory", "text": {"verbosity": "low"}}),
    ("/v1/responses", {"stream": True, "stream_options": {"include_obfuscation": True}}),
])
def test_those_fields_at_accepted_values_are_served(http, path, body):
    r = _post(http, path, **body)
    assert r.status_code == 200, r.text[:300]


def _chunks(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"n": 2, "max_tokens": 5}),
    ("/v1/completions", {"prompt": ["a", "b c d"], "max_tokens": 4, "echo": True}),
])
def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(http, path, body):
    """vLLM's ``continuous_usage_stats`` was accepted and dropped: every chunk said
    ``usage: null``. Each chunk now carries its prompt's tokens and the tokens its
    choice has written so far; the last chunk's usage is still the whole request's."""
    r = _post(http, path, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
              ignore_eos=True, **body)
    assert r.status_code == 200, r.text[:300]
    chunks = _chunks(r)
    so_far: dict[int, int] = {}
    prompts: dict[int, int] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        u = c["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
        assert u["completion_tokens"] >= so_far.get(choice["index"], 0), (c, so_far)
        so_far[choice["index"]] = u["completion_tokens"]
        prompts[choice["index"]] = u["prompt_tokens"]
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == sum(so_far.values())
    assert so_far == {i: (5 if "n" in body else 4) for i in range(2)}
    if "prompt" in body:  # each choice counts its own prompt's tokens
        assert prompts[0] < prompts[1] and final["usage"]["prompt_tokens"] == prompts[0] + prompts[1]


def test_continuous_usage_stats_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="default", messages=MESSAGES, max_completion_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    usages = [(bool(ch.choices), ch.usage.completion_tokens) for ch in stream if ch.usage is not None]
    assert usages and all(u is not None for u in usages)
    assert usages[-1] == (False, 3) and usages[0][0]


def test_a_refusal_the_assistant_said_is_replayed_as_its_text(http):
    """An assistant message with ``content: null`` and ``refusal`` (as OpenAI's own
    messages come back) lost the refusal: the model saw an empty turn."""
    said = [{"role": "assistant", "content": "I cannot help with that request."}, {"role": "user", "content": "ok"}]
    refused = [{"role": "assistant", "content": None, "refusal": "I cannot help with that request."},
               {"role": "user", "content": "ok"}]
    empty = [{"role": "assistant", "content": None}, {"role": "user", "content": "ok"}]
    tokens = {}
    for name, turn in (("said", said), ("refused", refused), ("empty", empty)):
        r = _post(http, "/v1/chat/completions", messages=MESSAGES + turn, max_tokens=1)
        assert r.status_code == 200, r.text[:300]
        tokens[name] = r.json()["usage"]["prompt_tokens"]
    assert tokens["refused"] == tokens["said"] > tokens["empty"], tokens


def test_a_refusal_part_replayed_into_the_responses_api_is_served_and_listed(http):
    """An assistant output replayed as input (store=false agents send the output items
    back) with a ``refusal`` part was a 400; it is the refusal's text, as in chat."""
    r = _post(http, "/v1/responses", input=[
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"role": "user", "content": "fine"}])
    assert r.status_code == 200, r.text[:300]
    items = http.get(f"/v1/responses/{r.json()['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert items[0]["role"] == "assistant" and items[0]["content"] == [{"type": "refusal", "refusal": "I cannot."}]
    bad = _post(http, "/v1/responses", input=[{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


# -- tool-call parsing of output that goes wrong ----------------------------------------------------
def _stream(parser: str, text: str, cut: bool, step: int = 3) -> tuple[tp.ToolStream, list[dict[str, Any]]]:
    st = tp.get_tool_parser(parser).stream(FN)
    out = []
    for i in range(0, len(text), step):
        out += st.feed(text[i:i + step])
    return st, out + st.finish(cut)


def _content(deltas: list[dict[str, Any]]) -> str:
    return "".join(d.get("content", "") for d in deltas)


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\nSo I will answer: the sky is'),
    ("mistral", '[TOOL_CALLS][{"name": "nope", "arguments": {}}] So I will answer: the sky is'),
])
def test_a_length_cut_after_a_block_that_is_no_call_keeps_the_text(parser, text):
    """A model that wrote a call to an unknown function, then an answer, and ran into
    max_tokens got an empty message: the whole text was taken for a call cut off
    before its name. Only a call cut before its name is markup."""
    content, calls = tp.get_tool_parser(parser).parse(text, FN, cut=True)
    assert (content, calls) == (text, [])
    st, deltas = _stream(parser, text, cut=True)
    assert _content(deltas) == text and not st.calls
    # a call cut before its name is still markup, not content
    assert tp.get_tool_parser(parser).parse("Let me look. " + text[:7], FN, cut=True) == ("Let me look.", [])


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments'),
    ("mistral", '[TOOL_CALLS][{"name": "f", '),
    ("llama3_json", '{"name": "f", "parameters": '),
])
def test_a_call_cut_after_its_name_is_the_call_so_far(parser, text):
    """Cut by the length limit between a known name and its arguments: a call with empty
    arguments, streamed and not (it was no call and no content: the output was lost);
    cut inside the name, markup."""
    p = tp.get_tool_parser(parser)
    content, calls = p.parse(text, FN, cut=True)
    assert content == "" and [(c.name, c.arguments, c.cut) for c in calls] == [("f", "", True)]
    st, deltas = _stream(parser, text, cut=True)
    assert _content(deltas) == "" and [(c.name, c.arguments, c.cut) for c in st.calls] == [("f", "", True)]
    if text.startswith(p.markers):  # (llama3_json's bare object has no marker: cut in its name, it is text)
        assert p.parse(text[:text.index('"f"') + 2], FN, cut=True) == ("", [])


@pytest.mark.parametrize("tail", ['}}}\n</tool_call>', '}, null}\n</tool_call>'])
def test_a_streamed_call_that_turns_out_no_call_does_not_end_the_turn_as_tool_calls(tail):
    """The call's name and arguments streamed while they read as a call; the text after
    them (a stray brace) made the block no call, so the non-streamed reply is content
    with finish_reason "stop", but the stream ended with finish_reason "tool_calls"
    and arguments that are not JSON. The call is now marked not whole."""
    text = '<tool_call>\n{"name": "f", "arguments": {"s": "x"' + tail
    out = oa.ChatOutput(None, tp.get_tool_parser("hermes"), FN)
    message, whole = out.message(text)
    assert not whole and "tool_calls" not in message
    cs = out.stream()
    for i in range(0, len(text), 4):
        cs.feed(text[i:i + 4])
    cs.finish()
    meta = {"finish_reason": {"type": "stop", "matched": 2}}
    assert cs.cut_calls == [0] and not cs.has_calls
    assert oa.chat_finish_reason(meta, cs.has_calls) == oa.chat_finish_reason(meta, whole) == "stop"


@pytest.mark.parametrize("parser,text", [
    ("hermes", 'Checking now <tool_call>\n{"name": "f", "arguments": {"s": "x"}}\n</tool_call> then done'),
    ("llama3_json", 'Checking now {"name": "f", "parameters": {"s": "x"}}; then done'),
])
def test_text_either_side_of_a_call_reads_the_same_streamed_or_not(parser, text):
    """The parse glued the words either side of a call ("nowthen"), the stream put a
    line break between them."""
    content, calls = tp.get_tool_parser(parser).parse(text, FN)
    _, deltas = _stream(parser, text, cut=False)
    assert content == _content(deltas) == "Checking now\nthen done"
    assert [c.arguments for c in calls] == ['{"s": "x"}']


PIECES = {
    "hermes": ['<tool_call>', '</tool_call>', '\n', '{"name": "f", "arguments": {"s": "x"}}',
               '{"name": "g-h", "arguments": {}}', '{"name": "zz", "arguments": {}}', '{"name": "f", "arguments": ',
               '"', '\\', '{', '}', ']', 'text ', '<tool_', 'é', '😀', '{"name": "f", "arguments": "{}"}', 'null'],
    "llama3_json": ['<|python_tag|>', '{"name": "f", "parameters": {"s": "x"}}', '; ',
                    '{"name": "g-h", "parameters": {}}', '{"name": "zz", "parameters": {}}', '"', '\\', '{', '}',
                    'text ', 'é', '\n'],
    "mistral": ['[TOOL_CALLS]', '[{"name": "f", "arguments": {"s": "x"}}]', '[', ']', ',',
                '{"name": "g-h", "arguments": {}}', 'f[ARGS]{"s": "y"}', '[ARGS]', '"', '\\', '{', '}', 'text ',
                'g-h[ARGS]{}'],
    "pythonic": ['[', ']', 'f(s="x")', 'g-h()', ', ', '(', ')', '"', "'", '<|python_start|>', '<|python_end|>',
                 'text', ' ', 'zz()', '\n', 'f(s=[1, {"a": None}])'],
}


@pytest.mark.parametrize("parser", sorted(PIECES))
def test_streamed_and_parsed_calls_agree_on_arbitrary_output(parser):
    """Model output made of call fragments, cut or not, in random deltas: the stream
    never fails, its whole calls (those not marked cut) are the parse's, every whole
    call's arguments are a JSON object, and, when no call streamed and then fell
    through, its content is the parse's (up to surrounding whitespace)."""
    rng = random.Random(16)
    p = tp.get_tool_parser(parser)
    for _ in range(400):
        text = "".join(rng.choice(PIECES[parser]) for _ in range(rng.randint(1, 10)))
        cut = rng.random() < 0.3
        content, calls = p.parse(text, FN, cut)
        st, deltas = _stream(parser, text, cut, rng.randint(1, 6))
        whole = [(c.name, c.arguments) for c in calls if not c.cut]
        streamed: dict[int, list[str]] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                entry = streamed.setdefault(c["index"], ["", ""])
                entry[0] += c["function"].get("name", "")
                entry[1] += c["function"].get("arguments", "")
        assert [tuple(streamed[k]) for k, c in enumerate(st.calls) if not c.cut] == whole, (text, cut)
        for _, args in whole:
            assert isinstance(json.loads(args), dict), (text, args)
        if not any(c.cut for c in st.calls):
            assert _content(deltas).strip() == (content or "").strip(), (text, cut)
