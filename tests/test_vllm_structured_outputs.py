"""vLLM's per-request structured outputs on the OpenAI endpoints: the ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extras (with
``guided_decoding_backend`` and ``guided_whitespace_pattern``) and
``structured_outputs`` ({json, regex, choice, grammar, json_object, ...}), which replaced
them in vLLM 0.10. A user trying plait from vLLM's docs sent them and got "400
unrecognized request argument(s): guided_choice". They are now SGLang's raw fields
(``json_schema``, ``regex``, ``ebnf``), and an error names the field the client sent.

Outputs are checked against the constraint itself (the tiny model is random): a choice
is one of the choices, JSON validates against its schema with ``jsonschema``, a regex
matches in full.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from plait.errors import RequestError
from plait.runtime.server import launch
from plait.runtime.server import openai_api as oa

MODEL = "tiny"
HI = [{"role": "user", "content": "Pick one."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                served_model_name=MODEL, echo_logs=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(client, **extra) -> str:
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=60, temperature=0.8, seed=3,
                                         extra_body=extra)
    return out.choices[0].message.content


def complete(client, **extra) -> str:
    out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=60, temperature=0.8, seed=3,
                                    extra_body=extra)
    return out.choices[0].text


@pytest.mark.parametrize("via", ["guided", "structured_outputs"])
def test_choice(client, via):
    choices = ["yes", "no", "maybe (a+b)*"]  # regex metacharacters are literal
    extra = {"guided_choice": choices} if via == "guided" else {"structured_outputs": {"choice": choices}}
    assert chat(client, **extra) in choices
    assert complete(client, **extra) in choices


@pytest.mark.parametrize("via", ["guided", "structured_outputs"])
def test_json(client, via):
    for schema in (PERSON, json.dumps(PERSON)):  # an object, or its JSON text
        extra = {"guided_json": schema} if via == "guided" else {"structured_outputs": {"json": schema}}
        jsonschema.validate(json.loads(chat(client, **extra)), PERSON)
        jsonschema.validate(json.loads(complete(client, **extra)), PERSON)


def test_regex_grammar_json_object(client, tokenizer):
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", chat(client, guided_regex=r"[A-Z]{3}-[0-9]{2}"))
    assert re.fullmatch(r"[a-c]{4}", complete(client, structured_outputs={"regex": "[a-c]{4}"}))
    grammar = 'root ::= "x" ("y" | "z")'
    assert chat(client, guided_grammar=grammar) in ("xy", "xz")
    assert complete(client, structured_outputs={"grammar": grammar}) in ("xy", "xz")
    # json_object bounds no string, and a random model seldom closes one: seeds alone leave
    # the reply cut at max_tokens (which seed ends depends on the CPU's GEMM kernels). So:
    # vLLM's key constrains exactly as OpenAI's response_format does (same seed, same reply),
    # and with '"' and '}' made likely the reply ends as an object.
    def json_object(seed: int, **extra) -> openai.types.chat.chat_completion.Choice:
        return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=200, temperature=0.8, seed=seed,
                                              extra_body=extra).choices[0]

    for seed in range(3):
        out = json_object(seed, structured_outputs={"json_object": True})
        assert out.message.content.lstrip().startswith("{"), out.message.content
        assert out.message.content == json_object(seed, response_format={"type": "json_object"}).message.content
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ('"', "}")]
    out = json_object(0, structured_outputs={"json_object": True}, logit_bias={str(i): 6 for i in ids})
    assert out.finish_reason == "stop" and isinstance(json.loads(out.message.content), dict), out
    # the backend hint: vLLM's names, mapped or left to the server
    for backend in ("xgrammar", "guidance", "outlines", "auto"):
        assert chat(client, guided_choice=["a", "b"], guided_decoding_backend=backend) in ("a", "b")


def test_whitespace_pattern(client):
    out = chat(client, guided_json=PERSON, guided_whitespace_pattern="[ ]?")
    jsonschema.validate(json.loads(out), PERSON)
    assert "\n" not in out


def err(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json={"model": MODEL, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", {"messages": HI}),
                                       ("/v1/completions", {"prompt": "hi"})])
def test_errors_name_the_clients_field(http, path, base):
    e = err(http, path, {**base, "guided_choice": []})
    assert e["param"] == "guided_choice" and "non-empty array" in e["message"]
    e = err(http, path, {**base, "guided_choice": ["a", 3]})
    assert e["param"] == "guided_choice"
    e = err(http, path, {**base, "guided_regex": "(a"})  # checked at the edge: named as sent
    assert e["param"] == "guided_regex" and e["message"].startswith("guided_regex")
    e = err(http, path, {**base, "guided_json": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}})
    assert e["param"] == "guided_json", e
    e = err(http, path, {**base, "guided_json": 5})
    assert e["param"] == "guided_json"
    e = err(http, path, {**base, "guided_grammar": "root ::= ("})
    assert e["param"] == "guided_grammar", e
    e = err(http, path, {**base, "guided_json": PERSON, "guided_regex": "a"})
    assert "both constrain" in e["message"] and "guided_json" in e["message"]
    e = err(http, path, {**base, "guided_regex": "a", "regex": "b"})
    assert "both constrain" in e["message"]
    e = err(http, path, {**base, "structured_outputs": {"choice": ["a"], "regex": "b"}})
    assert "structured_outputs.choice and structured_outputs.regex" in e["message"]
    e = err(http, path, {**base, "structured_outputs": {"jsonn": {}}})
    assert e["param"] == "structured_outputs" and "'jsonn'" in e["message"]
    e = err(http, path, {**base, "structured_outputs": "json"})
    assert e["param"] == "structured_outputs"
    e = err(http, path, {**base, "structured_outputs": {"json": PERSON, "disable_additional_properties": True}})
    assert "not supported" in e["message"]
    e = err(http, path, {**base, "guided_choice": ["a"], "guided_decoding_backend": "tensorrt"})
    assert e["param"] == "guided_decoding_backend" and "xgrammar" in e["message"]
    e = err(http, path, {**base, "guided_whitespace_pattern": " "})  # without a JSON schema
    assert e["param"] == "guided_whitespace_pattern", e


def test_chat_conflicts_with_response_format(http):
    e = err(http, "/v1/chat/completions", {"messages": HI, "guided_json": PERSON,
                                           "response_format": {"type": "json_object"}})
    assert e["param"] == "guided_json" and e["message"].startswith("guided_json and response_format")


def test_translation_leaves_other_bodies_alone():
    body = {"model": "m", "prompt": "p", "regex": "a"}
    assert oa.vllm_structured_outputs(body) == (body, {})
    out, aliases = oa.vllm_structured_outputs({"guided_choice": ["a", "a", "b.c"], "structured_outputs": None})
    assert out == {"regex": r"(?:a|b\.c)"} and aliases == {"regex": "guided_choice"}
    with pytest.raises(RequestError, match="guided_choice"):
        oa.vllm_structured_outputs({"guided_choice": "yes"})
