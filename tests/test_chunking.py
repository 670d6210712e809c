"""chunked_prefill_size='auto': chunk sizes follow measured step times."""

from __future__ import annotations

import pytest

from plait.runtime import Engine, EngineConfig
from plait.runtime.chunking import ChunkSizer, attention_pairs


def _feed(sizer: ChunkSizer, a: float, d: float, p: float, q: float = 0.0) -> None:
    """Steps of a machine whose step time is exactly a + d * decodes + p * tokens + q *
    (query, key) pairs, the chunks continuing prompts at various prefixes."""
    for i in range(40):
        decodes, tokens, prefix = 4 + i % 5, (i * 37) % 300, (i * 211) % 1800
        pairs = attention_pairs([(prefix, tokens)])
        sizer.observe(decodes, tokens, a + d * decodes + p * tokens + q * pairs, pairs)


def test_the_chunk_keeps_a_mixed_step_within_twice_a_decode_step():
    sizer = ChunkSizer()
    # before the fit: small chunks of three sizes in turn (to measure), the whole budget when idle
    explored = []
    for _ in range(3):
        explored.append(sizer.budget(8))
        sizer.observe(8, explored[-1], 0.02 + 0.0001 * explored[-1])
    # no larger than the floor: a 128-token exploration chunk beside 8 streams was 3-5 decode
    # steps on the Intel Xeon and set the p99 inter-token latency by itself
    # (nothing decoding: FIRST_CHUNK until a prefill step of RATE_TOKENS tokens was timed)
    assert explored == [16, 24, 32] and sizer.budget(0) == 512 and sizer.fit is None
    sizer = ChunkSizer()
    _feed(sizer, a=0.010, d=0.001, p=0.0001)
    a, d, p, q = sizer.fit
    assert a == pytest.approx(0.010) and d == pytest.approx(0.001) and p == pytest.approx(0.0001)
    assert q == pytest.approx(0.0, abs=1e-12)
    decode_step = 0.010 + 0.001 * 8
    chunk = sizer.budget(8)
    assert decode_step + p * chunk <= 2 * decode_step + 1e-9 < decode_step + p * (chunk + 1)
    assert sizer.budget(0) == 4096  # nothing decodes: steps of up to a second, max_chunk here


def test_a_chunk_late_in_a_long_prompt_is_smaller_by_its_attention():
    """Chunk steps cost more as the prompt's computed prefix grows (each query attends to
    all of it): the budget keeps the predicted step within the target at every prefix."""
    sizer = ChunkSizer()
    a, d, p, q = 0.010, 0.001, 0.0001, 2e-8
    _feed(sizer, a, d, p, q)
    assert sizer.fit == pytest.approx((a, d, p, q), rel=1e-6)
    decode_step = a + d * 8
    sizes = []
    for prefix in (0, 500, 2000, 8000):
        n = sizer.budget(8, prefix=prefix)
        step = lambda k: decode_step + p * k + q * attention_pairs([(prefix, k)])  # noqa: E731
        assert step(n) <= 2 * decode_step + 1e-9 < step(n + 1), (prefix, n)
        sizes.append(n)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[3]


def _schedule(sizer: ChunkSizer, length: int, start: int, known: bool) -> list[tuple[int, float]]:
    """(chunk, predicted step time) of each step of a prompt of ``length`` tokens, the
    first ``start`` from the cache, beside 8 decodes; ``known``: the budget is told the
    prompt."""
    a, d, p, q = sizer.fit
    steps, prefix = [], start
    while prefix < length:
        n = min(sizer.budget(8, prefix=prefix, prompt=(start, length) if known else None), length - prefix)
        steps.append((n, a + 8 * d + p * n + q * attention_pairs([(prefix, n)])))
        prefix += n
    return steps


def test_where_no_chunk_keeps_the_target_the_prompt_gets_even_steps():
    """The CPU case: a step beside decodes costs about a decode step before its chunk,
    and late in a long prompt even min_chunk tokens pass 2x a decode step. The fixed floor
    made the last steps the slowest (p99); told the prompt, the budget spreads its work
    over as many steps of equal predicted time: larger chunks early, smaller late, the
    slowest step lower, the total (the prompt's TTFT) about the same."""
    sizer = ChunkSizer()
    _feed(sizer, a=0.020, d=0.001, p=0.0007, q=4e-7)  # the Xeon's fit: 28 ms decode step with 8
    floor = _schedule(sizer, 2048, 0, known=False)
    even = _schedule(sizer, 2048, 0, known=True)
    assert min(n for n, _ in floor[:-1]) == floor[-2][0] == 32  # the fixed floor binds late in the prompt
    sizes = [n for n, _ in even]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 32 > sizes[-1] and all(16 <= n <= 48 for n in sizes)
    assert len(even) <= 2048 // 32 + 1  # the floor's number of steps (one more where the first were clamped)
    assert sum(t for _, t in even) <= 1.03 * sum(t for _, t in floor)
    slowest_even, slowest_floor = max(t for _, t in even), max(t for _, t in floor)
    assert slowest_even < 0.9 * slowest_floor
    times = [t for _, t in even[1:-1]]  # (the first at the 48-token cap, the last what is left)
    assert max(times) < 1.1 * min(times)
    # a prompt that came with 1024 tokens from the cache: even over the 1024 it computes
    rest = _schedule(sizer, 2048, 1024, known=True)
    assert abs(len(rest) - 32) <= 2 and max(t for _, t in rest) < max(t for _, t in _schedule(sizer, 2048, 1024, False))


def test_the_even_floor_never_holds_back_a_chunk_the_target_allows():
    """Early in a long prompt on a machine with a cheap per-token cost, the target allows
    more than the even floor: the budget is the larger of the two."""
    sizer = ChunkSizer()
    _feed(sizer, a=0.020, d=0.001, p=0.0002, q=4e-7)
    early = sizer.budget(8, prefix=0)
    assert early > 48 and sizer.budget(8, prefix=0, prompt=(0, 4000)) == early
    # late in it the target allows less than the floor: the even floor, under min_chunk there
    assert sizer.budget(8, prefix=3900) == 32 > sizer.budget(8, prefix=3900, prompt=(0, 4000)) >= 16


def test_where_the_target_holds_to_the_prompts_end_knowing_it_changes_nothing():
    sizer = ChunkSizer()
    _feed(sizer, a=0.010, d=0.001, p=0.0001, q=2e-8)  # chunks within 2x a decode step even at 8000
    for prefix in (0, 500, 2000, 7900):
        assert sizer.budget(8, prefix=prefix, prompt=(0, 8000)) == sizer.budget(8, prefix=prefix)
    short = ChunkSizer()  # a prompt of min_chunk tokens or fewer: nothing to spread
    _feed(short, a=0.020, d=0.001, p=0.0007, q=4e-7)
    assert short.budget(8, prefix=2000, prompt=(2000, 2032)) == short.budget(8, prefix=2000) == 32


def test_steps_that_run_over_the_fit_shrink_the_chunk():
    """A least-squares fit is right on average, so about half the mixed steps run over
    it, and the slow ones are what p99 sees: the budget keeps the prediction times the
    fit's 90th-percentile high-side error (measured / predicted on mixed steps) within
    the target. On an exact machine that error is 1 and nothing changes."""
    a, d, p = 0.010, 0.001, 0.0001
    exact = ChunkSizer()
    _feed(exact, a, d, p)
    noisy = ChunkSizer()
    for i in range(40):  # mixed steps alternately 20 % under and over the machine's time
        decodes, tokens = 4 + i % 5, (i * 37) % 300
        noise = (0.8 if i % 2 else 1.2) if decodes and tokens else 1.0
        noisy.observe(decodes, tokens, (a + d * decodes + p * tokens) * noise)
    fa, fd, fp, _ = noisy.fit
    decode_step = fa + fd * 8
    n = noisy.budget(8)
    predicted = lambda k: decode_step + fp * k  # noqa: E731
    margin = noisy.margin  # the 90th percentile of measured / predicted on mixed steps
    assert 1.1 < margin < 1.5 and exact.margin == pytest.approx(1.0)
    assert predicted(n) * margin <= 2 * decode_step + 1e-9 < predicted(n + 1) * margin
    assert noisy.budget(8) < exact.budget(8)


def test_steps_without_decodes_and_stalls_do_not_move_the_fit():
    """The fit is of steps with decodes beside them (the budget matters only there): a
    server's first step (the streams' own prompts, 0.5 s of one-time set-up) made the
    intercept 95 ms, the predicted decode step 3x its time and the next chunks 150 ms
    steps. A stall of one step (5x its time) is left out of a second fit."""
    a, d, p = 0.010, 0.001, 0.0001
    exact = ChunkSizer()
    _feed(exact, a, d, p)
    sizer = ChunkSizer()
    sizer.observe(0, 256, 0.5)  # the first step: prompts only, set-up
    for tokens, t in ((100, 0.03), (200, 0.05), (50, 0.02)):  # prompts alone: the module path, other costs
        sizer.observe(0, tokens, t)
    for i in range(40):
        decodes, tokens = 4 + i % 5, (i * 37) % 300
        stall = 5.0 if i == 17 else 1.0
        sizer.observe(decodes, tokens, (a + d * decodes + p * tokens) * stall)
    assert sizer.fit == pytest.approx(exact.fit, rel=1e-6, abs=1e-12)
    assert sizer.budget(8) == exact.budget(8)


def test_every_step_with_as_many_decodes_predicts_the_decode_step():
    """8 streams throughout (the benchmark's scenario): the intercept and the per-decode
    cost are one number, their sum at 8 decodes, which the budget uses."""
    sizer = ChunkSizer()
    for i in range(40):
        tokens = (i * 37) % 120
        sizer.observe(8, tokens, 0.028 + 0.0007 * tokens)
    a, d, p, _ = sizer.fit
    assert a >= 0 and d >= 0 and a + 8 * d == pytest.approx(0.028) and p == pytest.approx(0.0007)
    assert sizer.budget(8) == int(0.028 / 0.0007 + 1e-6)  # 40 tokens: the step at 2x 28 ms


def test_an_explicit_target_and_the_bounds():
    sizer = ChunkSizer(itl_target_ms=30.0, min_chunk=32, max_chunk=1000)
    _feed(sizer, a=0.010, d=0.001, p=0.0001)
    assert sizer.budget(8) == int((0.030 - 0.018) / 0.0001)  # 120 tokens
    assert sizer.budget(25) == 32  # the decodes alone exceed the target: the smallest chunk
    fast = ChunkSizer(itl_target_ms=1000.0, max_chunk=1000)
    _feed(fast, a=0.010, d=0.001, p=0.0001)
    assert fast.budget(8) == 1000


def test_auto_is_the_default_and_engines_run_with_it(tiny_model_factory):
    assert EngineConfig().chunked_prefill_size == "auto"
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineConfig(chunked_prefill_size="big")
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=4096, page_size=4) as e:
        prompts = [list(range(10, 10 + 300 + i)) for i in range(3)]
        outs = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 20, "temperature": 0.0,
                                                               "ignore_eos": True})
        assert all(len(o["output_ids"]) == 20 for o in outs)
        assert e.scheduler.chunks is not None
        e.check_invariants()


def test_only_streaming_decodes_limit_the_chunk():
    """A decode whose client streams keeps the chunk bounded; decodes nobody watches
    token by token (Engine.generate, non-streaming requests) leave the whole budget."""
    sizer = ChunkSizer(itl_target_ms=30.0, min_chunk=32, max_chunk=1000)
    _feed(sizer, a=0.010, d=0.001, p=0.0001)
    assert sizer.budget(8, streaming=True) == 120
    assert sizer.budget(8, streaming=False) == 1000


def test_steps_nobody_streams_stay_near_a_second():
    """Nothing decoding, or no decode streaming: no gaps between tokens to protect, but
    a step still holds up the requests beside it and those arriving during it (4,096
    tokens took 15-20 s on one thread, and a 5-token request sent meanwhile 37 s). The
    budget keeps such steps near MAX_STEP_S at the per-token cost of measured prefill
    steps; FIRST_CHUNK before one is measured; max_chunk and min_chunk bound it."""
    from plait.runtime.chunking import FIRST_CHUNK, MAX_STEP_S

    sizer = ChunkSizer(min_chunk=32, max_chunk=4096)
    assert sizer.budget(0) == FIRST_CHUNK == 512 and MAX_STEP_S == 1.0
    sizer.observe(0, 100, 0.5)  # (too small to tell the per-token cost from the step's fixed part)
    assert sizer.budget(0) == 512
    sizer.observe(0, 1024, 4.0)  # a slow machine: ~3.9 ms per prompt token
    assert sizer.budget(0) == sizer.budget(3, streaming=False) == 256
    for _ in range(5):  # the recent median follows a faster rate
        sizer.observe(2, 512, 0.25)
    assert sizer.budget(0) == 2048
    for _ in range(5):  # a fast device: max_chunk
        sizer.observe(0, 4096, 0.05)
    assert sizer.budget(0) == 4096
    for _ in range(5):  # slower than a second for min_chunk tokens: min_chunk
        sizer.observe(0, 300, 30.0)
    assert sizer.budget(0) == 32
    assert ChunkSizer(max_step_s=2.0, max_chunk=4096)._batch_budget() == 512


@pytest.mark.parametrize("stream", [True, False])
def test_a_long_prompt_beside_a_decode_is_chunked_only_when_the_decode_streams(tiny_model_factory, stream):
    from plait.runtime.validation import validate_generate

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=8192, page_size=4, itl_target_ms=0.001) as e:
        params = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
        vocab = e.limits.vocab_size
        (a,) = e.submit(validate_generate("a", list(range(10, 30)), params, e.limits, stream=stream))
        while a.output_len < 2:  # a is decoding
            e.step()
        prompt = [3 + i % (vocab - 3) for i in range(900)]
        (b,) = e.submit(validate_generate("b", prompt, {"max_new_tokens": 2}, e.limits))
        e.step()
        assert a.output_len >= 3  # a decoded in that step
        if stream:  # a tiny target: the chunk is bounded (32-128 before a fit, min_chunk after)
            assert 0 < b.num_computed <= 128
        else:  # FIRST_CHUNK tokens, then (the tiny model's prefill timed) the rest in one step
            assert b.num_computed == 512
            e.step()
            assert b.num_computed == 900
        while e.scheduler.running or e.scheduler.waiting:
            e.step()
        e.check_invariants()


def test_the_scheduler_asks_for_each_chunk_at_the_prefix_it_continues(tiny_model_factory, monkeypatch):
    from plait.runtime.validation import validate_generate

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=8192, page_size=4) as e:
        asked: list[int] = []
        real = e.scheduler.chunks.budget

        prompts: list[tuple[int, int] | None] = []

        def budget(decodes, streaming=True, prefix=0, prompt=None):
            asked.append(prefix)
            prompts.append(prompt)
            return 64 if decodes else real(decodes, streaming, prefix, prompt)

        monkeypatch.setattr(e.scheduler.chunks, "budget", budget)
        params = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        (a,) = e.submit(validate_generate("a", list(range(10, 30)), params, e.limits, stream=True))
        while a.output_len < 2:
            e.step()
        asked.clear()
        prompts.clear()
        (b,) = e.submit(validate_generate("b", [5 + i % 200 for i in range(300)], {"max_new_tokens": 1}, e.limits))
        seen = []
        while b.output_len == 0:
            seen.append(b.num_computed)
            e.step()
        # each step after b's first chunk asked at b's computed tokens then
        assert asked[: len(seen)] == [0] + seen[1:] and seen[1:] == [64 * i for i in range(1, len(seen))]
        # and told the prompt once it runs: b's (tokens computed at admission, length);
        # not while it waits (which waiting prompt goes first, from how much of a cached
        # prefix, is decided at admission)
        assert prompts[: len(seen)] == [None] + [(0, 300)] * (len(seen) - 1)
        # a prompt that shares b's first 200 tokens starts from the cached prefix: its
        # first computed position is that match, not 0
        prompts.clear()
        (c,) = e.submit(validate_generate("c", [5 + i % 200 for i in range(200)] + [7] * 100, {"max_new_tokens": 1},
                                          e.limits))
        e.step()
        assert c.admitted_at >= 192 and c.cached_tokens == c.admitted_at
        while c.output_len == 0:
            e.step()
        assert prompts[0] is None and set(prompts[1:]) == {(c.admitted_at, 300)}, prompts
        while e.scheduler.running or e.scheduler.waiting:
            e.step()
        e.check_invariants()


def test_a_prompt_advances_however_many_drafts_take_the_budget(tiny_model_factory, monkeypatch):
    """Drafts being verified take the chunk budget's tokens first (they cost what prompt
    tokens cost), but a waiting prompt still advances by min_chunk / 4 tokens a step: with
    the budget all drafts (many speculating streams, the even floor late in a prompt at
    16-23 tokens), it was starved until they finished."""
    from plait.runtime.validation import validate_generate

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=8192, page_size=4) as e:
        params = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}
        (a,) = e.submit(validate_generate("a", list(range(10, 30)), params, e.limits, stream=True))
        while a.output_len < 2:
            e.step()
        monkeypatch.setattr(e.scheduler.chunks, "budget", lambda *args, **kw: 0)  # all of it taken
        (b,) = e.submit(validate_generate("b", [5 + i % 200 for i in range(100)], {"max_new_tokens": 1}, e.limits))
        computed = []
        for _ in range(3):  # beside a's decodes, 8 a step (without the guard: 0, a hang at the end)
            e.step()
            computed.append(b.num_computed)
        assert computed == [8, 16, 24] and not a.finished
        monkeypatch.undo()
        while e.scheduler.running or e.scheduler.waiting:
            e.step()
        e.check_invariants()


def test_a_step_that_admits_a_waiting_prompt_beside_a_long_one_is_sized_for_latency(tiny_model_factory,
                                                                                       monkeypatch):
    """Nothing decoding, a long prompt filling: steps take max_chunk tokens for
    throughput; a short prompt that arrives then started only after a whole such step
    more (its first token ~12 s later on 8,000 tokens). The step that admits it is sized
    as a step beside a streaming decode, plus what it needs, and the long prompt takes
    the rest."""
    from plait.runtime.validation import validate_generate

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=8192, page_size=4) as e:
        real = e.scheduler.chunks.budget

        def budget(decodes, streaming=True, prefix=0, prompt=None):
            return 48 if decodes else 256  # (max_chunk stands at 256 here)

        monkeypatch.setattr(e.scheduler.chunks, "budget", budget)
        params = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        (long,) = e.submit(validate_generate("long", [5 + i % 300 for i in range(900)], params, e.limits))
        e.step()
        assert long.num_computed == 256  # throughput: nothing decodes
        (short,) = e.submit(validate_generate("short", [900 + i for i in range(6)], params, e.limits))
        batch = e.scheduler.schedule()
        assert {r.rid: n for r, n in batch.extends} == {"long": 48 + 2 * 6 - 6, "short": 6}
        e.scheduler.process_batch(batch, e.runner.forward(batch))
        assert short.output_len == 1 and long.output_len == 0
        monkeypatch.setattr(e.scheduler.chunks, "budget", real)
        while e.scheduler.running or e.scheduler.waiting:
            e.step()
        e.check_invariants()
