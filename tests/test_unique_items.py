"""``uniqueItems`` over strings and numbers, kept by the matcher beside the grammar
(plait.runtime.constrained.unique_items): where the places are found in a schema, JSON
equality as jsonschema has it, and in the engine — an oracle model that wants to repeat
an item is turned aside, sampled outputs on both grammar backends validate against the
original schema (uniqueItems included), speculative decoding and jump-forward keep it,
and what stays refused says why."""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest
import torch

from plait.errors import RequestError
from plait.runtime import Engine
from plait.runtime.constrained.unique_items import DEEP, Duplicate, JsonTracker, UniqueGuard, plan
from plait.runtime.sampling_params import SamplingParams

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"]}


def feed_all(sites, text: str) -> JsonTracker:
    t = JsonTracker(sites)
    t.feed(text.encode())
    return t


def repeats(sites, text: str) -> bool:
    try:
        feed_all(sites, text)
    except Duplicate:
        return True
    return False


# -- where the arrays are ---------------------------------------------------------------------------
def test_plan_finds_arrays_through_properties_refs_combinators_and_items():
    schema = {
        "$defs": {"Names": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/Names"},
            "b": {"type": "array", "items": {"$ref": "#/$defs/Names"}},
            "c": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}]},
            "d": {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "number"},
                  "uniqueItems": True},
        },
        "additionalProperties": {"type": "array", "items": {"enum": [1, "x", None]}, "uniqueItems": True},
    }
    stripped, sites = plan(schema)
    assert sorted(map(json.dumps, sites)) == sorted(map(json.dumps, [["a"], ["b", "*"], ["c"], ["d"], ["*"]]))
    assert "uniqueItems" not in json.dumps(stripped)
    assert "uniqueItems" in json.dumps(schema)  # the caller's schema is not touched


def test_plan_marks_every_depth_below_a_recursive_ref():
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "labels": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    _, sites = plan(tree)
    assert ["labels"] in sites and ["children", "*", DEEP] in sites
    t = feed_all(sites, '{"labels":["x"],"children":[{"labels":["y","z"],"children":[{"labels":["q"')
    with pytest.raises(Duplicate):
        t.feed(b',"q"')


@pytest.mark.parametrize("items", [{"type": "object"}, {"type": "array"}, {}, {"anyOf": [{"type": "string"}, {}]}])
def test_items_that_may_be_containers_stay_refused_by_name(items):
    schema = {"type": "array", "items": items, "uniqueItems": True}
    with pytest.raises(RequestError, match="uniqueItems.*objects or arrays") as e:
        SamplingParams(json_schema=schema).constraint()
    assert e.value.param == "json_schema"
    with pytest.raises(ValueError):
        plan({"type": "array", "uniqueItems": True})  # no items: anything


def test_an_enum_domain_keeps_the_exact_regex_and_needs_no_guard():
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}
    c = SamplingParams(json_schema=schema).constraint()
    assert c.unique == "" and c.backend == "outlines"
    c = SamplingParams(json_schema=TAGS).constraint()
    assert json.loads(c.unique) == [["tags"]] and c.backend == "llguidance"
    c = SamplingParams(json_schema=TAGS, grammar_backend="outlines").constraint()
    assert json.loads(c.unique) == [["tags"]] and c.backend == "outlines"


def test_pydantic_sets_compile():
    class Order(pydantic.BaseModel):
        skus: set[str]
        quantities: frozenset[int]
        note: str | None = None

    c = SamplingParams(json_schema=Order.model_json_schema()).constraint()
    assert sorted(json.loads(c.unique)) == [["quantities"], ["skus"]]


# -- JSON equality --------------------------------------------------------------------------------
@pytest.mark.parametrize("text,dup", [
    ('["a","b","a"]', True),
    ('["a","\\u0061"]', True),  # the same string, escaped
    ('["a","A"]', False),
    ('[1, 1.0]', True),  # jsonschema: 1 == 1.0
    ('[1e2, 100]', True),
    ('[1e400, 2e400]', True),  # both inf as Python (and jsonschema) reads them
    ('[0.1, 0.10000000000000000001]', True),
    ('[1, true]', False),  # a boolean is not a number
    ('[0, -0]', True),
    ('[true, false, null, true]', True),
    ('["1", 1]', False),
    ('[{"k":"a"},{"k":"a"}]', False),  # containers are not compared (their items' places are not guarded)
    ('["é","\\u00e9"]', True),
])
def test_json_equality(text, dup):
    assert repeats([[]], text) is dup


def test_only_guarded_places_and_not_keys_are_compared():
    sites = [["tags"]]
    assert repeats(sites, '{"tags":["x","x"]}')
    assert not repeats(sites, '{"other":["x","x"],"tags":["x"]}')
    assert not repeats(sites, '{"tags":["x"],"nested":{"tags":["x","x"]}}')
    assert repeats([["*", "tags"]], '[{"tags":["a"]},{"tags":["b","b"]}]')
    assert not repeats(sites, '{"tags":["tags","x"]}')  # a key is not an item


# -- the guard in the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    with Engine(path, kv_cache_tokens=4096, max_running_requests=16) as e, \
            Engine(path, kv_cache_tokens=4096, max_running_requests=4, speculative="ngram") as spec:
        yield e, spec
        e.check_invariants()
        spec.check_invariants()


class Oracle:
    """The next token of ``tokenizer(prompt + target)`` wins by a wide margin; once
    off that path, the tokens that close things (a quote, brackets) lead, then the
    digit 5, then the first allowed token."""

    def __init__(self, engine: Engine, text: str) -> None:
        self.engine = engine
        self.full = engine.tokenizer.encode(text, add_special_tokens=False)
        first = [engine.tokenizer.convert_tokens_to_ids(engine.tokenizer.tokenize(c))[0] for c in '"]}5']
        self.closers, self.digit = first[:3], first[3]
        engine.runner.model.compute_logits = self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.engine.model_config.vocab_size)
        for row, r in enumerate(self.engine.scheduler.running[: hidden.shape[0]]):
            ids = r.token_ids
            if len(ids) < len(self.full) and self.full[: len(ids)] == ids:
                logits[row, self.full[len(ids)]] = 50.0
            else:
                logits[row, self.closers] = 10.0
                logits[row, self.digit] = 5.0
        return logits

    def close(self) -> None:
        del self.engine.runner.model.compute_logits


def oracle_generate(e: Engine, prompt: str, target: str, params: dict) -> dict:
    """Greedy output of ``e`` with the :class:`Oracle` steering it to ``target``."""
    oracle = Oracle(e, prompt + target)
    try:
        return e.generate(prompt, {"temperature": 0.0, **params})
    finally:
        oracle.close()


def validate(schema, text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_a_model_that_repeats_an_item_is_turned_aside(engines, backend):
    e, _ = engines
    prompt = "Tags:"
    target = '{"tags":["red","blue","red","green"]}'
    out = oracle_generate(e, prompt, target, {"json_schema": TAGS, "grammar_backend": backend, "max_new_tokens": 60})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    value = validate(TAGS, out["text"])
    assert value["tags"][:2] == ["red", "blue"]
    assert len(value["tags"]) >= 3  # the third item was written, as something other than "red"
    # the same oracle without uniqueItems writes the duplicate: the guard made the difference
    plain = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}}
    free = oracle_generate(e, prompt, target, {"json_schema": plain, "grammar_backend": backend, "max_new_tokens": 60})
    assert json.loads(free["text"])["tags"] == ["red", "blue", "red", "green"]


def test_numbers_are_compared_as_numbers(engines):
    e, _ = engines
    schema = {"type": "array", "items": {"type": "number"}, "uniqueItems": True, "minItems": 3}
    prompt = "Numbers:"
    out = oracle_generate(e, prompt, "[10,25,10.0,7]", {"json_schema": schema, "max_new_tokens": 40})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    value = validate(schema, out["text"])
    assert value[:2] == [10, 25] and len(value) >= 3


SAMPLED = {
    "words": {"type": "array", "items": {"type": "string", "pattern": "^[a-e]{1,3}$"}, "minItems": 4, "maxItems": 8,
              "uniqueItems": True},
    "ints": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 4,
             "maxItems": 8, "uniqueItems": True},
    "record": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "aliases": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 3, "maxItems": 6,
                    "uniqueItems": True},
        "scores": {"type": "array", "items": {"type": ["number", "null"]}, "minItems": 2, "maxItems": 5,
                   "uniqueItems": True}},
        "required": ["name", "aliases", "scores"], "additionalProperties": False},
}


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_outputs_validate_with_unique_items(engines, name, backend):
    e, _ = engines
    schema = SAMPLED[name]
    outs = e.generate(["List:", "Values"], {"json_schema": schema, "grammar_backend": backend, "temperature": 1.0,
                                            "seed": 11, "n": 6, "max_new_tokens": 300})
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        validate(schema, o["text"])


def test_speculative_drafts_keep_items_distinct(engines):
    e, spec = engines
    # greedy: the same output with and without drafting (drafts are checked against the
    # guarded masks); a looping random model and a prompt of repeats make drafts
    prompt = 'Repeat: ["ab","cd","ab","cd","ab","cd","ab","cd"] -> '
    schema = {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 3, "maxItems": 12,
              "uniqueItems": True}
    before = spec.stats()["spec_draft_tokens"]
    params = {"json_schema": schema, "temperature": 0.0, "max_new_tokens": 120}
    out, plain = spec.generate(prompt, params), e.generate(prompt, params)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert out["text"] == plain["text"]
    validate(schema, out["text"])
    assert spec.stats()["spec_draft_tokens"] > before


def test_a_domain_with_nothing_left_ends_with_an_error_naming_unique_items(engines):
    e, _ = engines
    # two possible items, three required: every third item repeats one
    schema = {"type": "array", "items": {"type": "string", "pattern": "^[xy]$"}, "minItems": 3, "uniqueItems": True}
    with pytest.raises(RequestError, match=r"'uniqueItems' at #/2: every token the schema allows next would repeat") \
            as err:
        e.generate("XY:", {"json_schema": schema, "temperature": 0.0, "max_new_tokens": 30})
    assert err.value.param == "json_schema"
    e.check_invariants()


def test_guard_passes_the_inner_matcher_through():
    class Inner:
        kind, started, healed_text, ready, error, is_final, terminated, rejected = (
            "json_schema", True, "", True, None, False, False, None)
        num_advanced = 7

    g = UniqueGuard(Inner(), [[]], [b"a"])
    assert g.kind == "json_schema" and g.num_advanced == 7 and g.rejected is None and g.parser_error is None


# -- over HTTP: the kept places travel with the request to the engine process -------------------------
def test_openai_response_format_with_a_set_field(tiny_model_factory):
    import openai

    from plait.runtime.server import launch

    schema = {"type": "object", "properties": {
        "codes": {"type": "array", "items": {"type": "string", "pattern": "^[a-c]{2}$"}, "minItems": 4, "maxItems": 4,
                  "uniqueItems": True}}, "required": ["codes"], "additionalProperties": False}
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=4096, max_running_requests=8) as rt:
        client = openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Four codes."}],
            response_format={"type": "json_schema", "json_schema": {"name": "codes", "schema": schema}},
            max_tokens=80, temperature=1.0, seed=5, n=6)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            value = json.loads(choice.message.content)
            jsonschema.validate(value, schema)
            assert len(set(value["codes"])) == 4
        # items that may be objects: a 400 naming the keyword and the place
        bad = {"type": "object", "properties": {"rows": {"type": "array", "items": {"type": "object"},
                                                         "uniqueItems": True}}}
        with pytest.raises(openai.BadRequestError, match=r"uniqueItems.*#/properties/rows.*objects or arrays"):
            client.chat.completions.create(
                model=client.models.list().data[0].id, messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_schema", "json_schema": {"name": "rows", "schema": bad}}, max_tokens=8)
