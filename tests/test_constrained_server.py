"""Constraints over HTTP: OpenAI ``response_format`` through the ``openai`` client, the
native ``/generate`` with ``regex`` / ``json_schema``, and 400s for bad constraints
(the server keeps serving)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from plait.runtime.server import launch

API_KEY = "sk-plait-test"
MODEL = "tiny"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"],
}


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                api_key=API_KEY, served_model_name=MODEL) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_openai_response_format_json_schema(oai):
    for temperature in (0.0, 1.0):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            max_tokens=200, temperature=temperature, seed=4,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_native_generate_with_regex_and_schema(http):
    rx = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r = http.post("/generate", json={"text": "Date:", "sampling_params": {"regex": rx, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(rx, r.json()["text"])
    r = http.post("/generate", json={"text": "Person:", "sampling_params": {
        "json_schema": json.dumps(PERSON), "temperature": 0.0, "max_new_tokens": 200}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text"]), PERSON)


def test_bad_constraints_get_400_and_the_server_keeps_serving(oai, http):
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "array", "uniqueItems": True}}},
        )
    r = http.post("/generate", json={"text": "x", "sampling_params": {"regex": "(unclosed"}})
    assert r.status_code == 400 and "regex" in r.text
    r = http.post("/generate", json={"text": "Ok?", "sampling_params": {"regex": "(yes|no)", "temperature": 0.0}})
    assert r.status_code == 200 and r.json()["text"] in ("yes", "no")


def test_a_schema_without_any_output_is_refused_before_admission(http):
    """A $ref cycle with nothing else in it admits no value: a 400 at the front naming
    the client's field, for a stream too (no stream is opened)."""
    loop = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": loop}},
            "grammar_backend": "llguidance"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        r = http.post("/v1/responses", json={
            "model": MODEL, "input": "x", "max_output_tokens": 4, "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": loop}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


def test_index_build_over_its_time_limit_is_a_400(tiny_model_factory):
    slow = r'"[^"\\]{0,800}"'  # an index too large to build within the limit below
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=2048, grammar_backend="outlines",
                grammar_compile_timeout=1.0) as rt, httpx.Client(base_url=rt.url, timeout=120) as c:
        r = c.post("/generate", json={"text": "Name:", "sampling_params": {"regex": slow, "max_new_tokens": 4}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "grammar_compile_timeout" in err["message"] and err["param"] == "regex"
        ok = c.post("/generate", json={"text": "Ok?", "sampling_params": {"regex": "(yes|no)", "temperature": 0.0}})
        assert ok.status_code == 200 and ok.json()["text"] in ("yes", "no")
        # A refusal after admission (the engine's compile, here its time limit) names the
        # client's own field (response_format, text.format), not the engine's json_schema,
        # on every path, and is a 400 on streams too: a stream's head (response.created)
        # waits for the engine's first piece, so a refused constraint never opens a 200
        long_string = {"type": "string", "maxLength": 800}  # the same index, from a schema
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={
                "model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": stream,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": long_string}},
                "grammar_backend": "outlines"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
            r = c.post("/v1/responses", json={
                "model": "default", "input": "x", "max_output_tokens": 4, "stream": stream,
                "text": {"format": {"type": "json_schema", "name": "s", "schema": long_string}}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
            assert "grammar_compile_timeout" in r.json()["error"]["message"], r.text
        info = c.get("/server_info").json()
        assert info["invariant_ok"], info["invariant_error"]
        assert info["pool"]["locked"] == 0
