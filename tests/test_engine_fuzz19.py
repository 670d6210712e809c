"""A seeded robustness probe of the engine: mixed batches of random but *valid*
requests thrown at one :class:`Engine` under many engine options, checked after every
round. The rule: a request the validator accepts never hurts another request or the
engine.

Each round submits a noisy batch (prompts of 1 token up to the context limit, ``n > 1``,
sampling filters, penalties, ``min_new_tokens``, ``max_new_tokens`` 0 and 1, stop strings
/ ids / regexes, ``ignore_eos``, ``logit_bias``, logprobs, regex / json_schema / ebnf
constraints, cache salts, identical prompts) with late arrivals and aborts in flight,
on engines with small KV pools (retraction and eviction), small prefill chunks,
speculative decoding, the host tier, other eviction policies and the block-hash cache.
After each round:

- ``check_invariants()`` holds (also after every step) and nothing stays locked;
- every request finished, with a sane finish reason for what it asked;
- a greedy "witness" request inside the noisy batch yields exactly the tokens it yields
  alone. The project's guarantee (tests/test_engine_exactness.py) is token equality with
  Hugging Face under batching, chunking, prefix hits and retraction on the tiny model
  (whose distributions are peaked), and prompt logprobs within 1e-4; the witness's
  logprobs are held to that (and a relative 1e-5: the loopy model used here, from
  tests/test_speculative.py so that n-gram drafts get accepted, has logprobs near -150);
- constrained outputs match their constraint (fully when finished by it, as a prefix
  when cut by the length limit);
- the only exceptions are :class:`RequestError` s of the request at fault.

``PLAIT_FUZZ19_ROUNDS`` / ``PLAIT_FUZZ19_SEED`` run a longer search locally; the default
is short (a few dozen seconds on two cores).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
import regex as regex_mod
import torch

from plait.errors import RequestError
from plait.runtime import Engine
from plait.runtime.output_processor import RequestOutput
from plait.runtime.request import ReqKind
from test_speculative import loopy  # noqa: F401  (the tiny model that falls into loops n-gram drafts predict)

ROUNDS = int(os.environ.get("PLAIT_FUZZ19_ROUNDS", "8"))
SEED = int(os.environ.get("PLAIT_FUZZ19_SEED", "19"))
CONTEXT = 96
# fp32, differences from summation order only: tests/test_engine_exactness.py's 1e-4, plus a
# relative 1e-5 for the loopy model's logprobs far below zero (-150: a few ulps of fp32 is 1e-5)
LOGPROB_ATOL, LOGPROB_RTOL = 1e-4, 1e-5
MAX_STEPS = 2000

WITNESS_NEW = 10
WITNESS_PARAMS = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": WITNESS_NEW}

# engine options per round (cycled); every pool holds one request at full context
BASE = {"context_length": CONTEXT, "num_threads": 1}
CONFIGS: list[dict[str, Any]] = [
    {"kv_cache_tokens": 2048, "page_size": 16, "chunked_prefill_size": 64},
    {"kv_cache_tokens": 160, "page_size": 4, "chunked_prefill_size": 24, "init_new_token_ratio": 0.0,
     "min_new_token_ratio": 0.0},
    {"kv_cache_tokens": 256, "page_size": 1, "chunked_prefill_size": 7, "speculative": "ngram",
     "schedule_policy": "dfs-weight", "init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0},
    {"kv_cache_tokens": 192, "page_size": 8, "enable_hierarchical_cache": True, "hicache_ratio": 2.0,
     "eviction_policy": "lfu", "chunked_prefill_size": 32, "init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0},
    {"kv_cache_tokens": 224, "page_size": 4, "prefix_cache_mode": "block_hash", "schedule_policy": "fcfs",
     "chunked_prefill_size": 16},
    {"kv_cache_tokens": 176, "page_size": 2, "eviction_policy": "cost", "speculative": "ngram",
     "speculative_num_draft_tokens": 3, "chunked_prefill_size": -1, "max_running_requests": 6},
    {"kv_cache_tokens": 200, "page_size": 4, "disable_radix_cache": True, "chunked_prefill_size": 20,
     "init_new_token_ratio": 0.05, "min_new_token_ratio": 0.0},
    {"kv_cache_tokens": 192, "page_size": 4, "enable_hierarchical_cache": True, "hicache_ratio": 1.0,
     "hicache_write_policy": "write_through", "hicache_prefetch_policy": "off", "speculative": "ngram",
     "chunked_prefill_size": "auto", "init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0},
]

REGEXES = [r"(yes|no)", r"[0-9]{1,4}", r"-?[0-9]+\.[0-9]{2}", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)",
           r"(red|green|blue)( (red|green|blue)){0,3}"]
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "enum": ["x", "yy"]}, "maxItems": 3},
    {"type": "string", "maxLength": 6},
]
EBNFS = [('root ::= "yes" | "no" | "maybe"', r"(yes|no|maybe)"),
         ('root ::= [0-9] [0-9]? "-" [a-c]+', r"[0-9][0-9]?-[a-c]+")]
STOPS = ["e", "a", " the", "\n", "ing", "x", ".", "s"]
# prompts as text, whose last token a constraint may heal (back off and write again)
PHRASES = ["The answer is", "Number: 1", "Name: Jo", "x = {", "Reply yes or no:", "JSON: {\"a\": 1"]
STOP_REGEXES = [r"[0-9]", r"[A-Z]{2}", r"e\b", r"\s\s"]


@dataclass
class Spec:
    """One client request of a round and what it is checked against."""

    rid: str
    ids: list[int]
    params: dict[str, Any]
    kwargs: dict[str, Any]
    arrive: int = 0  # the step it is submitted before
    abort_at: int | None = None  # the step before which it is aborted
    witness: bool = False
    reqs: list[Any] = field(default_factory=list)
    aborted: bool = False


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 40000) for _ in range(n)]


def random_params(rng: random.Random, prompt_len: int, eos: int) -> tuple[dict[str, Any], str | None]:
    """Random accepted sampling params; returns them and which constraint kind they have."""
    p: dict[str, Any] = {}
    greedy = rng.random() < 0.4
    p["temperature"] = 0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.5, 100.0, 1e-5])
    if not greedy:
        if rng.random() < 0.4:
            p["top_p"] = rng.choice([0.05, 0.5, 0.9, 1.0])
        if rng.random() < 0.4:
            p["top_k"] = rng.choice([-1, 0, 1, 5, 50, 10**6])
        if rng.random() < 0.3:
            p["min_p"] = rng.choice([0.0, 0.05, 0.5, 1.0])
        if rng.random() < 0.5:
            p["seed"] = rng.randrange(0, 2**63)
    if rng.random() < 0.25:
        p["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.25:
        p["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.25:
        p["repetition_penalty"] = rng.choice([0.5, 1.0, 1.3, 2.0])
    p["max_new_tokens"] = rng.choice([0, 1, 1, 2, 5, 12, 20, 40, 60, 90])
    if rng.random() < 0.3:
        p["min_new_tokens"] = rng.randint(0, p["max_new_tokens"])
    if rng.random() < 0.3:
        p["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.2:
        p["stop_regex"] = rng.sample(STOP_REGEXES, rng.randint(1, 2))
    if rng.random() < 0.3:
        p["stop_token_ids"] = [rng.randrange(0, 49152) for _ in range(rng.randint(1, 3))] + [eos] * rng.randint(0, 1)
    p["ignore_eos"] = rng.random() < 0.5
    if rng.random() < 0.2:
        p["logit_bias"] = {str(rng.randrange(3, 49152)): rng.choice([-100.0, -5.0, 5.0, 100.0])
                           for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.3:
        p["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        p["speculative"] = False
    if rng.random() < 0.15:
        p["no_stop_trim"] = True
    kind = None
    roll = rng.random()
    if roll < 0.17:
        kind, p["regex"] = "regex", rng.choice(REGEXES)
    elif roll < 0.27:
        kind, p["json_schema"] = "json_schema", rng.choice(SCHEMAS)
    elif roll < 0.33:
        kind, p["ebnf"] = "ebnf", rng.choice(EBNFS)[0]
    if kind is not None and p["max_new_tokens"] > 0:
        p["max_new_tokens"] = max(p["max_new_tokens"], rng.choice([1, 8, 30, 60]))
    # (with a constraint, a bias or min_new_tokens may ban the only tokens it allows: a
    # dead end, reported as a RequestError naming the constraint's field)
    return p, kind


def random_spec(rng: random.Random, rid: str, shared: list[list[int]], cycle: list[int], phrases: list[list[int]],
                eos: int) -> Spec:
    roll = rng.random()
    if roll < 0.1:
        ids = rand_ids(rng, 1)
    elif roll < 0.2:
        ids = rand_ids(rng, rng.randint(CONTEXT - 6, CONTEXT - 1))  # near the context limit
    elif roll < 0.35:  # tokens of the model's loops (n-gram drafts predict its output) and a repeating pattern
        ids = [rng.choice(cycle) for _ in range(rng.randint(1, 4))] + rand_ids(rng, rng.randint(0, 3))
        ids = (ids * 40)[: rng.randint(len(ids), 50)] + [rng.choice(cycle)]
    elif roll < 0.45:
        ids = list(rng.choice(phrases))
    elif roll < 0.7 and shared:
        base = rng.choice(shared)  # shares a prefix (or all) with others
        ids = base[: rng.randint(1, len(base))] + rand_ids(rng, rng.choice([0, 0, 1, 5, 20]))
        ids = ids[: CONTEXT - 1]
    else:
        ids = rand_ids(rng, rng.randint(2, 60))
    params, kind = random_params(rng, len(ids), eos)
    kwargs: dict[str, Any] = {}
    if rng.random() < 0.3:
        kwargs["return_logprob"] = True
        kwargs["logprob_start_len"] = rng.choice([-1, 0, len(ids) - 1, rng.randrange(len(ids))])
        kwargs["top_logprobs_num"] = rng.choice([0, 1, 3])
    if rng.random() < 0.2:
        kwargs["cache_salt"] = rng.choice(["alice", "bob", ""])
    return Spec(rid, ids, params, kwargs)


# -- checks ---------------------------------------------------------------------------------
def partial_match(pattern: str, text: str) -> bool:
    return regex_mod.fullmatch(pattern, text, partial=True) is not None


def check_logprobs(spec: Spec, out: dict[str, Any]) -> None:
    meta, kw = out["meta_info"], spec.kwargs
    aborted = meta["finish_reason"]["type"] == "abort"  # (this sequence: an n > 1 copy may have finished first)
    if not kw.get("return_logprob"):
        assert "output_token_logprobs" not in meta
        return
    out_lp = meta["output_token_logprobs"]
    assert [t for _, t in out_lp] == out["output_ids"], spec.rid
    assert all(math.isfinite(lp) and lp <= 1e-5 for lp, _ in out_lp), (spec.rid, out_lp)
    start, top_n = kw["logprob_start_len"], kw["top_logprobs_num"]
    inp = meta["input_token_logprobs"]
    if start < 0:
        assert inp == []
    else:
        want = spec.ids[start:]
        got = [t for _, t in inp]
        assert got == (want[: len(got)] if aborted else want), spec.rid  # (an abort may cut them)
        if start == 0 and got:
            assert inp[0][0] is None
        assert all(lp is None or (math.isfinite(lp) and lp <= 1e-5) for lp, _ in inp)
    if top_n:
        tops = meta["output_top_logprobs"]
        if spec.params.get("max_new_tokens") == 0 and not aborted:
            # nothing sampled: the next token's top logprobs (SGLang's max_new_tokens=0)
            assert len(tops) == 1 and not out_lp, spec.rid
            tops = []
        assert len(tops) == len(out_lp), spec.rid
        for (lp, tok), row in zip(out_lp, tops):
            assert len(row) == top_n
            vals = [v for v, _ in row]
            assert vals == sorted(vals, reverse=True)
            assert lp <= vals[0] + 1e-5
            if tok in {t for _, t in row}:
                assert any(abs(v - lp) <= 1e-5 for v, t in row if t == tok)


def check_finish(spec: Spec, r: Any, out: RequestOutput, eos_ids: frozenset[int]) -> None:
    """The final output of one sequence against what its request asked for."""
    p, reason = spec.params, out.finish_reason
    assert reason is not None
    if out.error is not None:
        # the only accepted failure: a constraint the model's vocabulary could not follow
        kind = next((k for k in ("regex", "json_schema", "ebnf") if k in p), None)
        assert kind is not None and isinstance(out.error, RequestError) and out.error.param == kind, \
            (spec.rid, out.error)
        return
    res = out.result
    assert res is not None, spec.rid
    meta, ids, text = res["meta_info"], res["output_ids"], res["text"]
    fin = meta["finish_reason"]
    assert fin == reason.to_dict()
    max_new = min(p.get("max_new_tokens", 128), CONTEXT - len(spec.ids))
    assert meta["completion_tokens"] <= max_new, (spec.rid, meta, max_new)
    assert meta["prompt_tokens"] == len(spec.ids), spec.rid
    assert 0 <= meta["cached_tokens"] <= len(spec.ids), spec.rid
    assert all(0 <= t < 49152 for t in ids)
    stop_ids = set(p.get("stop_token_ids", []))
    ends = stop_ids | (set() if p.get("ignore_eos") else set(eos_ids))
    constrained = any(k in p for k in ("regex", "json_schema", "ebnf"))
    if fin["type"] == "abort":
        assert spec.aborted, (spec.rid, fin)  # only the client aborts: every request fits the pool
    elif fin["type"] == "length":
        assert fin["length"] == meta["completion_tokens"]
        assert meta["completion_tokens"] == max_new or len(spec.ids) + len(ids) >= CONTEXT, (spec.rid, meta, max_new)
    else:
        m = fin["matched"]
        if isinstance(m, int):
            assert ids and ids[-1] == m and m in ends, (spec.rid, m, ids)
            assert meta["completion_tokens"] >= p.get("min_new_tokens", 0), (spec.rid, meta)
        elif isinstance(m, str):
            assert m in p.get("stop", []) or m in p.get("stop_regex", []), (spec.rid, m)
        else:
            assert m is None and constrained, (spec.rid, fin)
    if not constrained and ids:
        # nothing ends an output but its last token
        assert not (set(ids[:-1]) & ends), (spec.rid, ids, ends)
    if fin["type"] == "stop" and isinstance(fin["matched"], str) and not p.get("no_stop_trim"):
        if fin["matched"] in p.get("stop", []):
            assert fin["matched"] not in text, (spec.rid, text)
    if p.get("max_new_tokens") == 0:
        assert ids == [] and text == "", (spec.rid, ids, text)  # (no healed token written again either)
    check_logprobs(spec, res)
    check_constraint(spec, text, fin)


def check_constraint(spec: Spec, text: str, fin: dict[str, Any]) -> None:
    p = spec.params
    done = fin["type"] == "stop" and fin.get("matched") is None
    if fin["type"] == "stop" and fin.get("matched") is not None:
        return  # a stop string / id cut it: what came before is a prefix of a match
    if "regex" in p:
        pattern = p["regex"]
    elif "ebnf" in p:
        pattern = dict(EBNFS)[p["ebnf"]]
    elif "json_schema" in p:
        if done:
            jsonschema.validate(json.loads(text), p["json_schema"])
        return
    else:
        return
    if done:
        assert regex_mod.fullmatch(pattern, text), (spec.rid, pattern, text)
    elif fin["type"] != "abort":
        assert partial_match(pattern, text), (spec.rid, pattern, text)


# -- driving --------------------------------------------------------------------------------
def drive(engine: Engine, specs: list[Spec], rng: random.Random, docs: list[list[int]]) -> dict[str, list[RequestOutput]]:
    """Submit ``specs`` at their arrival steps, abort at their abort steps, pin and unpin
    prefixes and flush namespaces in flight, step until all finished; check the
    invariants after every step. Returns each sequence's outputs."""
    streams: dict[str, list[RequestOutput]] = defaultdict(list)
    todo = sorted(specs, key=lambda s: s.arrive)
    pins: list[str] = []
    step = 0
    while todo or engine.has_work():
        if rng.random() < 0.05:
            doc = rng.choice(docs)
            try:
                pins.append(engine.pin_prefix(doc[: rng.randint(1, len(doc))], ttl_s=rng.choice([1e-4, 600.0]),
                                              cache_salt=rng.choice([None, "alice"])))
            except RequestError as e:
                assert "pin budget" in e.message
        if pins and rng.random() < 0.05:
            engine.unpin(pins.pop(rng.randrange(len(pins))))
        while todo and todo[0].arrive <= step:
            s = todo.pop(0)
            s.reqs = engine.add_request(s.ids, s.params, rid=s.rid, **s.kwargs)
        for s in specs:
            if s.abort_at == step and s.reqs and not all(r.finished for r in s.reqs):
                s.aborted = engine.abort(s.rid) or s.aborted
        if rng.random() < 0.03:  # a namespace flush in flight: refused while that salt runs
            salt = rng.choice(["alice", "bob", ""])
            # (a pin's prefill is not a user of the namespace: the flush releases the pin)
            running = any(r.cache_salt == salt and r.kind is ReqKind.GENERATE for r in engine.scheduler.running)
            assert engine.flush_cache(salt) is not running
        for o in engine.step():
            streams[o.rid].append(o)
        engine.check_invariants()
        step += 1
        assert step < MAX_STEPS, "the engine does not make progress"
    for pin_id in pins:
        info = engine.pin_info(pin_id)
        assert info is None or info["state"] in ("active", "failed", "pending"), info
        engine.unpin(pin_id)
    return streams


def check_round(engine: Engine, specs: list[Spec], streams: dict[str, list[RequestOutput]],
                twins: list[tuple[Spec, Spec]]) -> None:
    eos_ids = engine.eos_ids
    for s in specs:
        n = s.params.get("n", 1)
        assert len(s.reqs) == n
        for r in s.reqs:
            assert r.finished, r
            outs = streams[r.rid]
            assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1]), (s.rid, outs)
            final = outs[-1]
            check_finish(s, r, final, eos_ids)
            if final.error is None:
                res = final.result
                assert "".join(o.text for o in outs) == res["text"], (s.rid, [o.text for o in outs], res["text"])
                assert [t for o in outs for t in o.token_ids] == res["output_ids"], s.rid
                engine.pop_result(r)
    for a, b in twins:  # identical requests: identical outputs where the draws are reproducible
        fa, fb = streams[a.reqs[0].rid][-1], streams[b.reqs[0].rid][-1]
        if a.aborted or b.aborted or fa.error is not None or fb.error is not None:
            continue
        greedy = a.params.get("temperature") == 0.0
        seeded = "seed" in a.params and (engine.config.speculative == "none" or not a.params.get("speculative", True))
        if greedy or seeded:
            assert fa.result["output_ids"] == fb.result["output_ids"], (a.rid, b.rid)
            assert fa.result["text"] == fb.result["text"]
    assert not engine.has_work() and not engine.live_rids()
    engine.check_invariants()
    assert engine.pool_usage()["locked"] == 0


def witness_alone(engine: Engine, ids: list[int]) -> dict[str, Any]:
    return engine.generate(input_ids=ids, sampling_params=WITNESS_PARAMS, return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=2)


def assert_same_as_alone(got: dict[str, Any], alone: dict[str, Any], where: str) -> None:
    assert got["output_ids"] == alone["output_ids"], f"{where}: witness {got['output_ids']} != alone {alone['output_ids']}"
    for key in ("output_token_logprobs", "input_token_logprobs"):
        a = [x for x, _ in got["meta_info"][key] if x is not None]
        b = [x for x, _ in alone["meta_info"][key] if x is not None]
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL,
                                   msg=lambda m: f"{where}: {key}: {m}")


def run_round(engine: Engine, rng: random.Random, rnd: int, alone: dict[str, Any], witness_ids: list[int],
              docs: list[list[int]], cycle: list[int]) -> None:
    """One noisy batch; ``docs`` are prefixes shared across rounds (evicted, reloaded)."""
    eos = min(engine.eos_ids)
    shared = docs + [rand_ids(rng, rng.randint(20, 70)), witness_ids]
    phrases = [engine.tokenizer.encode(t, add_special_tokens=False) for t in PHRASES]
    specs = [random_spec(rng, f"r{rnd}-{i}", shared, cycle, phrases, eos) for i in range(rng.randint(5, 10))]
    for s in specs:
        s.arrive = rng.choice([0, 0, 0, 1, 2, 4, 8])
        if rng.random() < 0.15:
            s.abort_at = s.arrive + rng.randint(0, 6)
    twins = []
    if rng.random() < 0.4:  # an identical copy of one of them
        a = rng.choice(specs)
        b = Spec(f"r{rnd}-twin", list(a.ids), dict(a.params), dict(a.kwargs), arrive=rng.choice([a.arrive, a.arrive + 2]))
        specs.append(b)
        twins.append((a, b))
    w = Spec(f"r{rnd}-witness", witness_ids, dict(WITNESS_PARAMS),
             {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2},
             arrive=rng.choice([0, 1, 3]), witness=True)
    specs.append(w)
    streams = drive(engine, specs, rng, docs)
    got = engine.result(w.reqs[0])
    check_round(engine, specs, streams, twins)
    assert_same_as_alone(got, alone, f"round {rnd}")
    if rng.random() < 0.2:
        assert engine.flush_cache(rng.choice([None, "alice"]))
        engine.check_invariants()


@pytest.fixture(scope="module")
def folder(loopy) -> str:  # noqa: F811
    return loopy[0]


@pytest.fixture(scope="module")
def cycle(loopy) -> list[int]:  # noqa: F811
    return loopy[1]


@pytest.fixture(scope="module")
def witness(folder, cycle):
    """The witness prompt and its output alone on a roomy engine (the reference)."""
    rng = random.Random(SEED * 7 + 1)
    ids = rand_ids(rng, 20) + [rng.choice(cycle) for _ in range(3)]
    with Engine(folder, **BASE, kv_cache_tokens=2048) as e:
        return ids, witness_alone(e, ids)


@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_random_valid_batches_never_hurt_each_other_or_the_engine(folder, cycle, witness, config):
    ids, reference = witness
    rng = random.Random(SEED * 1000 + config)
    with Engine(folder, **BASE, **CONFIGS[config]) as engine:
        alone = witness_alone(engine, ids)
        # options change where KV lives and how steps are cut, never greedy tokens
        assert_same_as_alone(alone, reference, f"config {config}")
        docs = [rand_ids(rng, rng.randint(30, 90)) for _ in range(4)]
        for rnd in range(ROUNDS):
            run_round(engine, rng, rnd, alone, ids, docs, cycle)


# -- regressions found by the probe ----------------------------------------------------------
def test_a_constrained_request_with_max_new_tokens_0_writes_nothing(tiny_model_factory):
    """Token healing backed off the prompt's last token and raised max_new_tokens by one to
    write it again: with max_new_tokens=0 the request then generated that token, and
    with it text past the prompt ('The answer is' + regex ' ?[a-z]+' returned 'sues',
    the rest of ' issues'). A request that generates nothing keeps its prompt as sent."""
    with Engine(str(tiny_model_factory("llama")), **BASE, kv_cache_tokens=512) as engine:
        ids = engine.tokenizer.encode("The answer is", add_special_tokens=False)
        healed = engine.generate(input_ids=ids, sampling_params={"regex": " ?[a-z]+", "temperature": 0.0,
                                                                  "max_new_tokens": 1})
        # the boundary is healed here: the backed-off token is written again, beside the one asked for
        assert len(healed["output_ids"]) == 2 and healed["meta_info"]["completion_tokens"] == 1
        outs = engine.generate(input_ids=[ids, ids], sampling_params=[
            {"regex": " ?[a-z]+", "temperature": 0.0, "max_new_tokens": 0},
            {"json_schema": {"type": "string"}, "max_new_tokens": 0, "n": 2}])
        for out in outs:
            assert out["output_ids"] == [] and out["text"] == ""
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
            assert out["meta_info"]["prompt_tokens"] == len(ids) and out["meta_info"]["completion_tokens"] == 0
        assert not engine.has_work()
        engine.check_invariants()


@pytest.mark.parametrize("prompt_len", [5, 90])  # decodes into the pinned half / a prompt longer than the rest
def test_pins_give_way_to_a_request_that_fits_the_pool(tiny_model_factory, prompt_len):
    """A pin may hold half the pool (pin_budget_fraction); a request that fits the pool
    but not beside the pin was aborted 'request does not fit in the KV cache' (mid-decode,
    or at admission). Pins are hints: they are released instead, and the request runs as
    it does without them."""
    rng = random.Random(prompt_len)
    with Engine(str(tiny_model_factory("llama")), **BASE, kv_cache_tokens=160, page_size=4) as engine:
        prompt = rand_ids(rng, prompt_len)
        params = {**WITNESS_PARAMS, "max_new_tokens": CONTEXT - 1 - prompt_len}
        alone = engine.generate(input_ids=prompt, sampling_params=params)
        engine.flush_cache()
        pin_id = engine.pin_prefix(rand_ids(rng, 80), ttl_s=600)
        while engine.has_work():
            engine.step()
        assert engine.pin_info(pin_id)["state"] == "active" and engine.pool_usage()["locked"] == 20
        out = engine.generate(input_ids=prompt, sampling_params=params)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": CONTEXT - 1 - prompt_len}
        assert out["output_ids"] == alone["output_ids"]
        assert engine.pin_info(pin_id) is None  # released
        engine.check_invariants()
        assert engine.pool_usage()["locked"] == 0
