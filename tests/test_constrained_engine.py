"""Constrained decoding in the engine: every output matches its regex or validates
against its schema (greedy and sampled), constrained and free requests share batches
(with chunked prefill and prefix-cache hits), jump-forward on and off, token-boundary
healing with the real tokenizer, finish reasons, and bad input."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from plait.runtime import Engine

from constrained_cases import REGEXES, SCHEMAS

JSON_SCHEMAS = {k: SCHEMAS[k] for k in ("nested", "arrays_enums", "numbers", "refs_and_combinators")}
FREE = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 10}


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    # a small prefill budget so that long prompts are chunked
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=8192, max_running_requests=16,
                chunked_prefill_size=48, page_size=4) as e:
        yield e
        e.check_invariants()


def validate(schema, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_outputs_match_greedy_and_sampled(engine, name):
    rx = REGEXES[name]
    outs = engine.generate(
        ["Write one value:", "Value"],
        [{"regex": rx, "temperature": 0.0, "max_new_tokens": 64},
         {"regex": rx, "temperature": 1.0, "seed": 3, "n": 3, "max_new_tokens": 64}],
    )
    assert len(outs) == 4
    for o in outs:
        assert re.fullmatch(rx, o["text"]), (name, o["text"])
        assert o["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("name", sorted(JSON_SCHEMAS))
def test_json_outputs_validate_greedy_and_sampled(engine, name):
    schema = JSON_SCHEMAS[name]
    outs = engine.generate(
        ["Return a JSON record:", "JSON"],
        [{"json_schema": schema, "temperature": 0.0, "max_new_tokens": 400},
         {"json_schema": json.dumps(schema), "temperature": 0.9, "seed": 1, "n": 2, "max_new_tokens": 400}],
    )
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        validate(schema, o["text"])


def test_mixed_batches_leave_free_requests_unchanged(engine):
    long = "The quick brown fox jumps over the lazy dog while the band plays on. " * 4
    prompts = [long + "Free one", long + "Constrained", "Short free", long + "JSON please"]
    alone = engine.generate([prompts[0], prompts[2]], FREE)
    schema = JSON_SCHEMAS["nested"]
    params = [FREE, {"regex": REGEXES["date"], "temperature": 0.0}, FREE,
              {"json_schema": schema, "temperature": 0.7, "seed": 5, "max_new_tokens": 300}]
    for round_ in range(2):  # the second round hits the prefix cache
        outs = engine.generate(prompts, params)
        assert outs[0]["output_ids"] == alone[0]["output_ids"]
        assert outs[2]["output_ids"] == alone[1]["output_ids"]
        assert re.fullmatch(REGEXES["date"], outs[1]["text"])
        validate(schema, outs[3]["text"])
        if round_ == 1:
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in (outs[0], outs[1], outs[3]))
    engine.check_invariants()


def test_reaching_max_tokens_inside_json_ends_with_length(engine):
    schema = JSON_SCHEMAS["nested"]
    out = engine.generate("JSON:", {"json_schema": schema, "temperature": 0.0, "max_new_tokens": 3})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert len(out["output_ids"]) == 3 and out["text"].startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out["text"])


def test_bad_constraints_are_rejected_and_the_engine_keeps_serving(engine):
    with pytest.raises(ValueError, match="regex"):
        engine.generate("x", {"regex": "(unclosed"})
    with pytest.raises(ValueError, match="uniqueItems"):
        engine.generate("x", {"json_schema": {"type": "array", "uniqueItems": True}})
    with pytest.raises(ValueError, match="at most one constraint"):
        engine.generate("x", {"regex": "a", "json_schema": {"type": "integer"}})
    with pytest.raises(ValueError, match="out of order"):
        engine.generate("x", {"regex": "[0-9]{5,2}"})
    # a regex only the index builder refuses (an unknown Unicode property): the error
    # comes back from generate()
    with pytest.raises(ValueError, match="regex is invalid: it cannot be compiled"):
        engine.generate("x", {"regex": r"\p{NoSuchProperty}"})
    out = engine.generate("Still serving?", {"regex": "(yes|no)", "temperature": 0.0})
    assert out["text"] in ("yes", "no")
    assert engine.generate("Hello", FREE)["meta_info"]["completion_tokens"] == 10


SLOW = r'"[^"\\]{0,800}"'  # an index of ~800 states x the vocabulary: many seconds to build


def test_slow_index_builds_fail_cleanly_while_others_decode(tiny_model_factory):
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, max_running_requests=4,
                grammar_compile_timeout=3.0, grammar_backend="outlines") as e:
        slow = e.add_request(e.tokenizer.encode("Name:", add_special_tokens=False), {"regex": SLOW, "max_new_tokens": 8})[0]
        free = e.add_request(e.tokenizer.encode("Hello", add_special_tokens=False), FREE)[0]
        order = []
        while not (slow.finished and free.finished):
            order += [o.rid for o in e.step() if o.finished]
        assert order == [free.rid, slow.rid]  # the free request decoded while the index was building
        assert slow.finish_reason.type == "abort" and slow.finish_reason.error.status == 400
        assert slow.finish_reason.error.param == "regex"
        assert "grammar_compile_timeout" in slow.finish_reason.message
        assert free.output_len == 10
        with pytest.raises(ValueError, match="grammar_compile_timeout"):
            e.generate("Name:", {"regex": SLOW})  # the failure is cached: immediate
        assert e.generate("Ok?", {"regex": "(yes|no)"})["text"] in ("yes", "no")
        e.check_invariants()


def test_auto_builds_a_regex_on_llguidance_when_outlines_runs_past_its_limit(tiny_model_factory):
    """grammar_backend auto sends a regex to outlines-core; a build past its time (or
    memory) is then built on llguidance, which follows the regex lazily, instead of
    failing the request (a forced tool call's 2083-character URL field took 30 s)."""
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, max_running_requests=4,
                grammar_compile_timeout=3.0) as e:
        out = e.generate("Name:", {"regex": SLOW, "max_new_tokens": 12, "temperature": 0})
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert re.fullmatch(r'"[^"\\]*', out["text"]), out["text"]  # a prefix of the pattern's strings
        assert "grammar_compile_timeout" in e.grammar_compiler.compiler("outlines").cached(SLOW).error
        e.check_invariants()


def test_auto_gives_outlines_a_short_budget_before_llguidance_takes_the_regex_over(tiny_model_factory):
    """auto's outlines-core try gets AUTO_OUTLINES_BUDGET_S, not the whole
    grammar_compile_timeout: a forced strict tool call whose arguments outlines-core
    builds slowly (ten format-typed fields) waited the full 30 s before llguidance took
    it over, and every outlines-core build queued behind it. An explicit
    grammar_backend=outlines keeps the whole limit."""
    from plait.runtime.constrained.backend import AUTO_OUTLINES_BUDGET_S

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, max_running_requests=4,
                grammar_compile_timeout=120.0) as e:
        out = e.generate("Name:", {"regex": SLOW, "max_new_tokens": 12, "temperature": 0})
        assert re.fullmatch(r'"[^"\\]*"?', out["text"]), out["text"]
        fut = e.grammar_compiler.compiler("outlines").cached(SLOW)
        assert fut.budget_s == AUTO_OUTLINES_BUDGET_S < 120
        assert f"{AUTO_OUTLINES_BUDGET_S:g} s budget" in fut.error and "(grammar_compile_timeout)" in fut.error
        other = e.add_request(e.tokenizer.encode("Name:", add_special_tokens=False),
                              {"regex": SLOW + "x", "max_new_tokens": 1, "grammar_backend": "outlines"})[0]
        assert e.grammar_compiler.compiler("outlines").cached(SLOW + "x").budget_s is None  # the whole limit
        e.abort(other.rid)
        while e.has_work():
            e.step()
        e.check_invariants()


def test_auto_builds_a_schemas_regex_on_llguidance_when_outlines_runs_past_its_limit(tiny_model_factory):
    """A JSON Schema llguidance refuses as given (uniqueItems) goes to outlines-core as
    plait's regex translation; when that build runs past its time, llguidance follows the
    same regex instead of the request failing (WordPress' block.json: a 400 after the
    limit). The output keeps the translation, uniqueItems over the enum included."""
    import regex

    from plait.runtime.constrained.json_schema import schema_to_regex

    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
        "name": {"type": "string", "maxLength": 800}}, "required": ["tags", "name"], "additionalProperties": False}
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, max_running_requests=4,
                grammar_compile_timeout=3.0) as e:
        out = e.generate("Name:", {"json_schema": json.dumps(schema), "max_new_tokens": 24, "temperature": 0})
        translated = schema_to_regex(schema)
        assert "grammar_compile_timeout" in e.grammar_compiler.compiler("outlines").cached(translated).error
        assert any("lark_grammar" in source for source in e.grammar_compiler.build_times)  # built on llguidance
        if out["meta_info"]["finish_reason"]["type"] == "stop":  # the object closed: valid
            jsonschema.validate(json.loads(out["text"]), schema)
        else:
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            assert regex.fullmatch(translated, out["text"], partial=True), out["text"]  # a prefix of the schema's
        e.check_invariants()


# -- an oracle model: writes a target text in its canonical tokens --------------------------------
class Oracle:
    """Replaces the model's logits: the next token of ``tokenizer(prompt + target)``
    wins by a wide margin. It stands for a model whose own tokens are the canonical
    ones, which is where jump-forward's re-tokenization makes outputs comparable."""

    def __init__(self, engine: Engine, text: str) -> None:
        self.engine = engine
        self.full = engine.tokenizer.encode(text, add_special_tokens=False)
        self.steps = 0
        engine.runner.model.compute_logits = self  # instance attribute shadows the method

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        (r,) = self.engine.scheduler.running
        ids = r.token_ids
        logits = torch.zeros(hidden.shape[0], self.engine.model_config.vocab_size)
        if len(ids) < len(self.full) and self.full[: len(ids)] == ids:
            logits[:, self.full[len(ids)]] = 50.0
        return logits

    def close(self) -> None:
        del self.engine.runner.model.compute_logits


@pytest.fixture(scope="module")
def engines_jf(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    with Engine(path, kv_cache_tokens=2048, max_running_requests=4) as on, \
            Engine(path, kv_cache_tokens=2048, max_running_requests=4, disable_jump_forward=True) as off:
        yield on, off


KEY_HEAVY = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string"}, "last_name": {"type": "string"},
        "occupation": {"type": "string"}, "birth_year": {"type": "integer"},
        "nationality": {"enum": ["British", "French", "Italian"]},
        "known_for": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["first_name", "last_name", "occupation", "birth_year", "nationality", "known_for"],
}
TARGET = ('{"first_name":"Ada","last_name":"Lovelace","occupation":"mathematician","birth_year":1815,'
          '"nationality":"British","known_for":["the first computer program","notes on the analytical engine"]}')


def run_oracle(e: Engine, prompt: str, target: str, params: dict):
    oracle = Oracle(e, prompt + target)
    try:
        out = e.generate(prompt, {"temperature": 0.0, "max_new_tokens": 200, **params})
    finally:
        oracle.close()
    return out, oracle.steps


def test_jump_forward_gives_the_same_greedy_output_in_fewer_steps(engines_jf):
    on, off = engines_jf
    prompt = "Describe Ada Lovelace as JSON.\n"
    out_off, steps_off = run_oracle(off, prompt, TARGET, {"json_schema": KEY_HEAVY})
    out_on, steps_on = run_oracle(on, prompt, TARGET, {"json_schema": KEY_HEAVY})
    assert out_off["text"] == TARGET and out_on["text"] == TARGET
    assert out_on["output_ids"] == out_off["output_ids"]  # canonical tokens either way
    assert steps_on <= 0.7 * steps_off, (steps_on, steps_off)  # keys and punctuation cost no model step
    assert on.scheduler.jump_forward_tokens > 0 and off.scheduler.jump_forward_tokens == 0


def test_jump_forward_on_and_off_both_valid_with_a_real_model(engines_jf):
    on, off = engines_jf
    for e in engines_jf:
        outs = e.generate(["Person:", "Someone"], [{"json_schema": KEY_HEAVY | {"properties": {
            **KEY_HEAVY["properties"], "first_name": {"type": "string", "maxLength": 6},
            "last_name": {"type": "string", "maxLength": 6}, "occupation": {"type": "string", "maxLength": 6},
            "known_for": {"type": "array", "items": {"enum": ["math", "poetry"]}, "maxItems": 2}}},
            "temperature": t, "seed": 2, "max_new_tokens": 300} for t in (0.0, 1.0)])
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "stop"
            jsonschema.validate(json.loads(o["text"]), KEY_HEAVY)
    assert on.scheduler.jump_forward_tokens > 0


def test_healing_at_the_prompt_boundary(engines_jf):
    on, _ = engines_jf
    tok = on.tokenizer
    prompt = "Is the sky blue? Answer: "
    assert tok.convert_ids_to_tokens(tok.encode(prompt, add_special_tokens=False))[-1] == "\u0120"
    # the model's own token after 'Answer:' is ' yes'; the prompt ends in a lone space,
    # which is backed off and written as part of ' yes'
    oracle = Oracle(on, prompt.rstrip(" ") + " yes")
    try:
        healed = on.generate(prompt, {"regex": "(yes|no)", "temperature": 0.0})
    finally:
        oracle.close()
    assert healed["text"] == "yes"
    assert healed["output_ids"] == tok.encode(" yes", add_special_tokens=False)
    assert healed["meta_info"]["finish_reason"]["type"] == "stop"


def test_retracted_constrained_requests_resume_valid(tiny_model_factory):
    schema = JSON_SCHEMAS["arrays_enums"]
    words = ["apple", "river", "stone", "cloud", "piano", "tiger", "lemon", "ocean"]
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=128, page_size=4, max_running_requests=8,
                init_new_token_ratio=0.0, min_new_token_ratio=0.0) as e:  # admit eagerly: decode runs out
        outs = e.generate([f"A {w} record, in JSON:" for w in words],
                          {"json_schema": schema, "temperature": 1.0, "seed": 9, "max_new_tokens": 120})
        assert e.scheduler.num_retractions > 0  # KV ran out: requests were freed and recomputed
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "stop", o["meta_info"]
            validate(schema, o["text"])
        e.check_invariants()


def test_healing_does_not_take_a_token_of_the_budget(engines_jf):
    """The backed-off prompt token is written again as the first output token: it is not
    one of max_new_tokens. A prompt ending in a space with a one-token integer gen writes
    a digit (it ended on the space alone, with finish 'length' and empty text), and a
    regex of 8 one-character tokens fits max_new_tokens 8 (its last digit was cut)."""
    for e in engines_jf:
        tok = e.tokenizer
        prompt = "Phone number: "
        assert tok.convert_ids_to_tokens(tok.encode(prompt, add_special_tokens=False))[-1] == "\u0120"
        # (' -' is a token: the space can be written again with a sign, so it is healed)
        one = e.generate(prompt, {"regex": r"-?[0-9]+", "temperature": 0.0, "max_new_tokens": 1})
        assert re.fullmatch(r"-?[0-9]+", one["text"]), one
        full = e.generate(prompt, {"regex": r"-?[0-9]{3}-[0-9]{4}", "temperature": 0.0, "max_new_tokens": 8})
        assert re.fullmatch(r"-?[0-9]{3}-[0-9]{4}", full["text"]), full
        assert full["meta_info"]["finish_reason"]["type"] == "stop", full["meta_info"]
        # one output token more than max_new_tokens only where the prompt lost its last
        # token; it counts with the prompt (prompt_tokens as sent, completion_tokens
        # within max_new_tokens, as OpenAI clients expect of usage)
        for text in (prompt, "Phone number", "Phone number:"):
            out = e.generate(text, {"regex": r"-?[0-9]{3}-[0-9]{4}", "temperature": 0.0, "max_new_tokens": 8})
            meta = out["meta_info"]
            assert meta["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False)), meta
            healed = len(out["output_ids"]) - meta["completion_tokens"]
            assert healed in (0, 1) and meta["completion_tokens"] <= 8, meta
        healed_once = e.generate(prompt, {"regex": r"-?[0-9]+", "temperature": 0.0, "max_new_tokens": 3,
                                          "ignore_eos": True})
        meta = healed_once["meta_info"]
        assert len(healed_once["output_ids"]) == 4, healed_once  # healed, then cut by the length limit
        assert meta["completion_tokens"] == 3 and meta["finish_reason"] == {"type": "length", "length": 3}, meta
        e.check_invariants()
