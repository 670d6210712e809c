"""``uniqueItems`` over small domains: the guard looks ahead through the item being
written. It used to look one token ahead only, so with few possible values (strings of
``^[ab]{1,2}$``, integers 0..12) a model could begin an item every completion of which
repeats an earlier one (``"a`` after ``"a"``, ``"aa"`` and ``"ab"``), and the request
ended with the "every token ... would repeat" error although values were left (two of
three seeds of a sampled run). Now a token that leaves the output inside a guarded
array without completing a new item is taken only if some way on, under the grammar,
completes a new item or closes the array (:meth:`UniqueGuard._doomed`).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from plait.errors import RequestError
from plait.runtime.constrained.unique_items import LOOKAHEAD_TOKENS

from test_unique_items import engines, oracle_generate  # noqa: F401  (pytest fixture)

AB = {"type": "array", "items": {"type": "string", "pattern": "^[ab]{1,2}$"}, "minItems": 5, "maxItems": 6,
      "uniqueItems": True}
SMALL_INTS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 12}, "minItems": 6,
              "maxItems": 13, "uniqueItems": True}


def validate(schema, text: str):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_an_item_whose_every_completion_repeats_is_not_begun(engines, backend):
    e, _ = engines
    # the model wants a fourth item that begins with "a": "a", "aa" and "ab" are taken
    out = oracle_generate(e, "Codes:", '["a","aa","ab","a","b"]',
                          {"json_schema": AB, "grammar_backend": backend, "max_new_tokens": 60})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    value = validate(AB, out["text"])
    assert value[:3] == ["a", "aa", "ab"]
    assert not value[3].startswith("a")


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_a_number_whose_every_continuation_repeats_is_not_begun(engines, backend):
    e, _ = engines
    # 1, 10, 11 and 12 are taken: a fifth item "1" can only become one of them
    out = oracle_generate(e, "Ints:", "[1,10,11,12,1,3]",
                          {"json_schema": SMALL_INTS, "grammar_backend": backend, "max_new_tokens": 60})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    value = validate(SMALL_INTS, out["text"])
    assert value[:4] == [1, 10, 11, 12]
    assert value[4] != 1 and len(value) >= 6


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
@pytest.mark.parametrize("schema", [AB, SMALL_INTS], ids=["ab", "ints"])
def test_sampled_small_domains_always_finish(engines, schema, backend):
    e, _ = engines
    for seed in (1, 2, 3):
        outs = e.generate(["List:", "Values"], {"json_schema": schema, "grammar_backend": backend, "temperature": 1.0,
                                                "seed": seed, "n": 4, "max_new_tokens": 120})
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "stop", o
            validate(schema, o["text"])
    e.check_invariants()


def test_a_domain_used_up_still_ends_with_the_error(engines):
    e, _ = engines
    # three possible items, four required: no look-ahead can help
    schema = {"type": "array", "items": {"type": "string", "pattern": "^[xyz]$"}, "minItems": 4, "uniqueItems": True}
    with pytest.raises(RequestError, match=r"'uniqueItems' at #/3: every token the schema allows next would repeat"):
        e.generate("XYZ:", {"json_schema": schema, "temperature": 0.0, "max_new_tokens": 30})
    e.check_invariants()


def test_large_domains_are_not_searched(engines):
    e, _ = engines
    # a free string: far more than LOOKAHEAD_TOKENS tokens may continue it, so no search
    # runs (and none is needed); the guard still refuses the duplicate itself
    assert LOOKAHEAD_TOKENS < e.tokenizer.vocab_size
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3, "uniqueItems": True}
    out = oracle_generate(e, "Tags:", '["x","y","x"]', {"json_schema": schema, "max_new_tokens": 40})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    value = validate(schema, out["text"])
    assert value[:2] == ["x", "y"]


def test_a_large_domain_in_small_masks_is_searched_within_a_bound(engines, monkeypatch):
    """Strings of format uuid: ~20 hex tokens a mask (under LOOKAHEAD_TOKENS), a domain
    that never runs out. Every search went on to LOOKAHEAD_NODES masks, ~24,000 tokens
    tried a step (155 ms a token on SmolLM2 against 21 ms without uniqueItems, slowing
    the whole batch); now at most LOOKAHEAD_TRIES a step, and the output still holds no
    duplicate."""
    from plait.runtime.constrained import unique_items as ui

    e, _ = engines
    copies, per_step = [0], []
    real_copy, real_allowed = ui.OutputTracker.copy, ui.UniqueGuard.allowed

    def copy(self):
        copies[0] += 1
        return real_copy(self)

    def allowed(self, eos_ok):
        copies[0] = 0
        out = real_allowed(self, eos_ok)
        per_step.append(copies[0])
        return out

    monkeypatch.setattr(ui.OutputTracker, "copy", copy)
    monkeypatch.setattr(ui.UniqueGuard, "allowed", allowed)
    schema = {"type": "array", "items": {"type": "string", "format": "uuid"}, "minItems": 2, "maxItems": 2,
              "uniqueItems": True}
    same = '"12345678-1234-5678-1234-567812345678"'
    out = oracle_generate(e, "Ids:", f"[{same},{same}]", {"json_schema": schema, "max_new_tokens": 60})
    assert ui.LOOKAHEAD_TRIES == 512 and per_step and max(per_step) <= 520, max(per_step)
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        value = validate(schema, out["text"])
        assert value[0] != value[1]
