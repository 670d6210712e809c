"""The batched sampler: penalties kept on the device, counter-based noise, staging."""

from __future__ import annotations

import math

import pytest
import torch

from plait.runtime.request import Req
from plait.runtime.sampler import PenaltyCounts, Sampler, counter_uniform
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.staging import Staging

CPU = torch.device("cpu")


def _req(rid: str, prompt: list[int], output: list[int], row: int, seed: int = 0, **params) -> Req:
    r = Req(rid, prompt, SamplingParams(**params), seed=seed)
    r.set_output(output)
    r.row = row
    return r


def test_penalties_follow_their_definitions():
    pen = PenaltyCounts(4, CPU)
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    reqs = [
        _req("a", [0], [3], row=2, repetition_penalty=2.0),
        _req("b", [0], [3, 3, 1], row=0, frequency_penalty=0.5, presence_penalty=0.25),
        _req("c", [0], [1], row=1),  # no penalties: untouched
    ]
    pen.apply(logits, reqs)
    assert logits[0].tolist() == [1.0, -1.0, 0.5, 1.5]  # seen ids 0 and 3: positive / 2
    assert logits[1].tolist() == [2.0, -1.75, 0.5, 3.0 - 1.0 - 0.25]
    assert logits[2].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_penalty_rows_follow_new_tokens_and_new_owners():
    """Tokens appended between calls (sampled or jump-forward) are counted once; a row
    taken over by another request is rebuilt from that request's tokens."""
    pen = PenaltyCounts(2, CPU)
    r = _req("a", [5, 6], [1], row=1, frequency_penalty=1.0)
    pen.apply(torch.zeros(1, 8), [r])
    r.set_output([1, 2, 2, 1])  # three more tokens since the last call
    logits = torch.zeros(1, 8)
    pen.apply(logits, [r])
    assert logits[0].tolist() == [0, -2, -2, 0, 0, 0, 0, 0]  # prompt ids 5, 6 not counted
    other = _req("b", [7], [4], row=1, frequency_penalty=1.0, repetition_penalty=2.0)
    logits = torch.ones(1, 8)
    pen.apply(logits, [other])
    assert logits[0].tolist() == [1, 1, 1, 1, -0.5, 1, 1, 0.5]  # a's tokens are gone


def test_counter_uniform_is_uniform_and_a_function_of_seed_and_step():
    seeds = torch.tensor([1, 1, 2, -(2**63)])
    steps = torch.tensor([0, 1, 0, 5])
    a = counter_uniform(seeds, steps, 250_000)
    assert torch.equal(a, counter_uniform(seeds, steps, 250_000))
    assert all(not torch.equal(a[i], a[j]) for i in range(4) for j in range(i))
    assert bool((a > 0).all()) and bool((a < 1).all())
    u = a.flatten().double()
    assert abs(u.mean().item() - 0.5) < 0.002 and abs(u.var().item() - 1 / 12) < 0.001
    hist = torch.histc(u, bins=10, min=0.0, max=1.0) / u.numel()
    assert bool(((hist - 0.1).abs() < 0.002).all()), hist


@pytest.mark.parametrize("counter_rng", [False, True])
def test_sampled_frequencies_match_the_distribution(counter_rng):
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampler = Sampler(1, CPU, eos_ids=[], counter_rng=counter_rng)
    r = _req("a", [0], [], row=0, seed=11, temperature=1.0)
    r.generator = torch.Generator().manual_seed(11)
    draws = []
    for step in range(4000):
        r.set_output([0] * step)  # the output position moves the counter-based noise on
        draws += sampler.sample(p.log().unsqueeze(0).clone(), [r])
    freq = torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)
    assert torch.allclose(freq, p.double(), atol=0.03), freq


def test_a_seeded_draw_does_not_depend_on_the_batch():
    sampler = Sampler(3, CPU, eos_ids=[], counter_rng=True)
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    alone = sampler.sample(logits.clone(), [_req("a", [0], [1, 2], row=0, seed=42, temperature=1.0)])
    others = [_req("b", [0], [], row=1, seed=7, temperature=0.5), _req("c", [0], [3], row=2)]
    batch = torch.cat([torch.randn(1, 1000), logits, torch.randn(1, 1000)])
    mixed = sampler.sample(batch, [others[0], _req("a2", [0], [1, 2], row=0, seed=42, temperature=1.0), others[1]])
    assert mixed[1] == alone[0]


def test_all_banned_rows_fall_back_to_a_valid_id():
    sampler = Sampler(2, CPU, eos_ids=[2], counter_rng=True)
    logits = torch.full((2, 4), -math.inf)
    logits[1, 2] = 0.0  # only EOS allowed, and min_new_tokens bans it
    reqs = [_req("a", [0], [], row=0, temperature=0.7), _req("b", [0], [], row=1, temperature=0.7, min_new_tokens=3)]
    out = sampler.sample(logits, reqs)
    assert all(0 <= t < 4 for t in out)


def test_staging_packs_lists_into_one_tensor_per_call():
    ints = Staging(CPU, torch.long)
    a, b, c = ints.to_device([1, 2, 3], [], [4])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [] and c.tolist() == [4] and a.dtype == torch.long
    (f,) = Staging(CPU, torch.float32).to_device([0.5, 2])
    assert f.tolist() == [0.5, 2.0] and f.dtype == torch.float32


def _reference_filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row, the definitions written out: keep the top_k highest (ties with the k-th
    kept), then the tokens with at most top_p of the (renormalised) mass before them in
    rank order, then those with at least min_p x the highest probability."""
    row = row.clone()
    kth = row.sort(descending=True).values[top_k - 1]
    row[row < kth] = -math.inf
    if top_p < 1.0:
        order = row.argsort(descending=True, stable=True)
        probs = row.softmax(-1)[order].double()
        before = probs.cumsum(0) - probs
        row[order[before > top_p]] = -math.inf
    if min_p > 0.0:
        probs = row.softmax(-1)
        row[probs < min_p * probs.max()] = -math.inf
    return row


@pytest.mark.parametrize("settings,sorts", [
    ([(0, 1.0, 0.0), (0, 1.0, 0.0)], False),  # temperature only: nothing filtered
    ([(5, 1.0, 0.0), (0, 1.0, 0.0), (300, 1.0, 0.0)], False),  # top-k alone (partial top-k)
    ([(0, 0.9, 0.0), (40, 0.95, 0.0), (0, 1.0, 0.0)], False),  # nucleus among the candidates
    ([(0, 0.999, 0.0), (0, 0.5, 0.0)], True),  # a flat row's nucleus is wider: the full sort
    ([(1000, 0.9, 0.0), (0, 0.9, 0.0)], False),  # a top-k of 1000: that many candidates
    ([(20, 0.8, 0.1), (0, 1.0, 0.05)], False),  # all three
])
def test_filters_keep_what_their_definitions_keep(settings, sorts, monkeypatch):
    """The sampler's filters (partial top-k, the nucleus among the highest tokens, a
    filter no row uses skipped) keep exactly the tokens the definitions keep, and sort
    the vocabulary only where a nucleus is wider than the candidates."""
    from plait.runtime.sampler import _filter

    vocab, g = 5000, torch.Generator().manual_seed(3)
    rows = []
    for i in range(len(settings)):
        scale = 0.05 if settings[i][1] == 0.999 else 3.0  # a nearly flat row, or a peaked one
        row = torch.randn(vocab, generator=g) * scale
        row[7] = row[8] = row[9] = row.max() + 1  # ties at the top
        row[100:110] = -math.inf  # banned tokens
        rows.append(row)
    logits = torch.stack(rows)
    top_k = torch.tensor([k if 0 < k < vocab else vocab for k, _, _ in settings])
    top_p = torch.tensor([p for _, p, _ in settings])
    min_p = torch.tensor([m for _, _, m in settings])
    calls = []
    sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **kw: calls.append(1) or sort(self, *a, **kw))
    k_max = max((k for k, _, _ in settings if 0 < k < vocab), default=0)
    out = _filter(logits.clone(), top_k, top_p, min_p, k_max, bool((top_p < 1).any()), bool((min_p > 0).any()))
    monkeypatch.undo()
    assert bool(calls) == sorts
    for i, (k, p, m) in enumerate(settings):
        want = _reference_filter(logits[i], int(top_k[i]), p, m)
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(want)), (i, settings[i])
        kept = torch.isfinite(want)
        assert torch.equal(out[i][kept], logits[i][kept])
        if p < 1.0 or k:
            assert 0 < int(kept.sum()) < vocab - 10  # the case filters something


def test_inverse_cdf_draws_only_tokens_with_mass():
    from plait.runtime.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0, 0.5]])
    for u in (1e-7, 0.2, 0.2000001, 0.5, 0.9999999, 1.0 - 2**-25):
        got = inverse_cdf(probs, torch.full((3,), u)).tolist()
        assert probs[0, got[0]] > 0 and got[1] == 4 and probs[2, got[2]] > 0, (u, got)
    assert inverse_cdf(probs, torch.tensor([0.1, 0.5, 0.49])).tolist() == [1, 4, 0]
    assert inverse_cdf(probs, torch.tensor([0.3, 0.5, 0.51])).tolist() == [3, 4, 4]


def test_bench_sampler_runs_on_cpu(capsys):
    """benchmarks/bench_sampler.py stays runnable: every setting's parts are timed (the
    penalties only cost where a penalty is set) and the profiler table prints."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_sampler.py"
    spec = importlib.util.spec_from_file_location("bench_sampler", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    for name in bench.SETTINGS:
        row = bench.bench(CPU, 2, name, iters=1)
        assert row["sample"] > 0 and row["penalties"] >= 0
        assert ("filters" in row) == (name != "greedy")
    bench.profile(CPU, 2, "top-k+top-p+penalty")
    assert "aten::" in capsys.readouterr().out
