"""Logit processing, sampling and logprobs for a batch of requests.

Logprobs are those of the model's own distribution (``log_softmax`` of the raw
logits, before penalties and temperature), as vLLM returns them by default, so
they can be compared with any reference implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.runtime.request import Req
from plait.runtime.staging import Staging

NEG_INF = float("-inf")
# Logits are kept finite (penalties and a small temperature can overflow float32): +inf
# becomes this, NaN becomes -inf. Half of float32's max, so the softmax's max-shift
# of two such values cannot overflow.
FINITE_MAX = torch.finfo(torch.float32).max / 2


class PenaltyCounts:
    """Penalty state of the running requests, on the logits' device, one row per
    page-table row: ``counts[row]`` the output token counts (frequency/presence) and
    ``seen[row]`` the tokens of prompt + output (repetition).

    Row ``row`` holds the tokens ``token_ids[:counted[row]]`` of the request
    ``owner[row]`` (rid and prompt length); each call adds the tokens appended since (sampled or jump-forward,
    by one scatter for the whole batch) and rebuilds a row a different request now
    holds (rows are reused after a finish or a retraction). Allocated with the first
    penalised request."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.device = device
        self.counts: torch.Tensor | None = None  # float32 [num_rows, V]
        self.seen: torch.Tensor | None = None  # bool [num_rows, V]
        self.owner: list[tuple[str, int] | None] = [None] * num_rows  # (rid, prompt_len)
        self.counted = [0] * num_rows
        self._staging = Staging(device, torch.long)
        self._floats = Staging(device, torch.float32)

    def update(self, reqs: Sequence[Req], vocab: int) -> list[int]:
        """Bring the rows of ``reqs`` up to date; returns their rows."""
        if self.counts is None or self.counts.shape[1] != vocab:
            self.counts = torch.zeros(self.num_rows, vocab, dtype=torch.float32, device=self.device)
            self.seen = torch.zeros(self.num_rows, vocab, dtype=torch.bool, device=self.device)
            self.owner = [None] * self.num_rows
        assert self.seen is not None
        rows, reset, seen_rows, seen_ids, out_rows, out_ids = [], [], [], [], [], []
        for r in reqs:
            row = r.row
            assert row is not None, "a sampled request holds a page-table row"
            owner = (r.rid, r.prompt_len)  # token healing may shorten a prompt
            if self.owner[row] != owner or self.counted[row] > len(r.token_ids):
                reset.append(row)
                self.owner[row], self.counted[row] = owner, 0
            start = self.counted[row]
            new = r.token_ids[start:]
            seen_rows += [row] * len(new)
            seen_ids += new
            first_out = max(start, r.prompt_len)
            out_rows += [row] * (len(r.token_ids) - first_out)
            out_ids += r.token_ids[first_out:]
            self.counted[row] = len(r.token_ids)
            rows.append(row)
        reset_t, srow, sid, orow, oid = self._staging.to_device(reset, seen_rows, seen_ids, out_rows, out_ids)
        if reset:
            self.counts[reset_t] = 0.0
            self.seen[reset_t] = False
        self.seen[srow, sid] = True
        self.counts.index_put_((orow, oid), torch.ones(len(out_ids), device=self.device), accumulate=True)
        return rows

    def apply(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        """In place. frequency/presence (OpenAI) count the output so far; repetition (HF)
        divides positive / multiplies negative logits of every token seen in
        prompt + output. Batched over the penalised rows."""
        which = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not which:
            return
        pen = [reqs[i] for i in which]
        rows = self.update(pen, logits.shape[1])
        assert self.counts is not None and self.seen is not None
        idx, row_t = self._staging.to_device(which, rows)
        rep, freq, pres = (t.unsqueeze(1) for t in self._floats.to_device(
            [r.params.repetition_penalty for r in pen], [r.params.frequency_penalty for r in pen],
            [r.params.presence_penalty for r in pen]))
        sub = logits[idx]
        sub = torch.where(self.seen[row_t], torch.where(sub > 0, sub / rep, sub * rep), sub)
        counts = self.counts[row_t]
        logits[idx] = sub - counts * freq - (counts > 0).to(sub.dtype) * pres


def apply_logit_bias(logits: torch.Tensor, reqs: Sequence[Req], ints: Staging, floats: Staging) -> None:
    """In place: add each request's ``logit_bias`` to its row (one index_put for the
    batch; rows of one request, speculative verification's, all get it). After the
    penalties, before temperature, as OpenAI and vLLM apply it; a token a grammar
    masked stays masked (-inf plus a bias)."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, r in enumerate(reqs):
        bias = r.params.logit_bias
        if bias:
            rows += [i] * len(bias)
            cols += bias.keys()
            vals += bias.values()
    if rows:
        row_t, col_t = ints.to_device(rows, cols)
        (val_t,) = floats.to_device(vals)
        logits.index_put_((row_t, col_t), val_t, accumulate=True)


def mask_min_tokens(logits: torch.Tensor, reqs: Sequence[Req], eos_ids: Sequence[int], staging: Staging,
                    ahead: Sequence[int] | None = None) -> None:
    """In place: forbid EOS and stop ids until ``min_new_tokens`` are generated (one
    scatter for the batch). ``ahead[i]``: row ``i`` comes that many (drafted) tokens
    after the request's output so far."""
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(reqs):
        if r.output_len + (ahead[i] if ahead is not None else 0) < r.params.min_new_tokens:
            banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(eos_ids))
            rows += [i] * len(banned)
            cols += banned
    if rows:
        row_t, col_t = staging.to_device(rows, cols)
        logits[row_t, col_t] = NEG_INF


# top-p on CPU looks for the nucleus among this many highest tokens first (a partial
# top-k instead of a sort of the whole vocabulary: ~0.3 ms against ~12 ms for 8 rows of
# 49152 on the 2-core machine); a row whose nucleus is wider sorts everything.
NUCLEUS_CANDIDATES = 256
# the devices that take that partial top-k first (it ends in a host check of whether
# every nucleus fits; benchmarks/bench_sampler.py times both ways on a device)
PARTIAL_TOP_P_DEVICES = {"cpu"}


def _filter(rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
            k_max: int, any_top_p: bool, any_min_p: bool) -> torch.Tensor:
    """top-k, then top-p, then min-p on temperature-scaled logits ``rows`` [S, V], one
    setting per row (``top_k`` int64 [S] in [1, V], V: none; ``top_p``, ``min_p`` float
    [S]), as batched tensor ops. ``k_max`` (the largest ``top_k`` below V, 0 if none),
    ``any_top_p`` (a row with ``top_p < 1``) and ``any_min_p`` (a row with ``min_p > 0``)
    say which filters any row uses: a filter no row uses costs nothing (the common
    ``temperature``-only request sorts nothing), top-k alone takes a partial top-k."""
    if any_top_p:
        rows = _top_k_top_p(rows, top_k, top_p, k_max)
    elif k_max:
        kth = rows.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))
        rows = rows.masked_fill((top_k < rows.shape[1]).unsqueeze(1) & (rows < kth), NEG_INF)  # ties with the k-th kept
    if any_min_p:
        probs = rows.softmax(-1)
        rows = rows.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), NEG_INF)
    return rows


def _top_k_top_p(rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k_max: int) -> torch.Tensor:
    """top-k then top-p: a token is dropped when the mass of the tokens ranked before it
    (after top-k) already exceeds ``top_p`` (the first always stays). On CPU the ranking
    is a partial top-k of :data:`NUCLEUS_CANDIDATES` tokens (at least ``k_max``) where
    every row's nucleus ends inside it; otherwise one sort of all rows."""
    vocab = rows.shape[1]
    width = max(k_max, NUCLEUS_CANDIDATES)
    if rows.device.type in PARTIAL_TOP_P_DEVICES and width < vocab:
        vals, order = rows.topk(width, dim=-1)  # sorted, descending
        limited_k = (top_k < vocab).unsqueeze(1)
        kth = vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))  # ties with the k-th are kept
        masked = rows.masked_fill(limited_k & (rows < kth), NEG_INF)
        probs = masked.softmax(-1).gather(1, order)
        cum = probs.cumsum(-1)
        limited_p = top_p < 1.0
        # every row's nucleus ends among the candidates (the token after the last one has
        # more than top_p before it), or the row has no top-p: nothing past them is kept
        if bool(((cum[:, -1] > top_p) | ~limited_p).all()):
            keep = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, order, cum - probs <= top_p.unsqueeze(1))
            return masked.masked_fill(limited_p.unsqueeze(1) & ~keep, NEG_INF)
    sorted_rows, order = rows.sort(dim=-1, descending=True)
    kth = sorted_rows.gather(1, (top_k - 1).unsqueeze(1))  # ties with the k-th are kept
    rows = rows.masked_fill(rows < kth, NEG_INF)
    sorted_rows = sorted_rows.masked_fill(sorted_rows < kth, NEG_INF)  # still in order
    probs = sorted_rows.softmax(-1)
    drop = (probs.cumsum(-1) - probs > top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    return rows.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), NEG_INF)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """In place: +inf -> FINITE_MAX, NaN -> -inf (-inf stays: it is a ban)."""
    return torch.nan_to_num_(logits, nan=NEG_INF, posinf=FINITE_MAX, neginf=NEG_INF)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, width: int) -> torch.Tensor:
    """Uniforms in (0, 1) ``[S, width]`` float32, a pure function of (seed, step, column):
    a splitmix64 hash of the three (int64 arithmetic wraps), its top 24 bits. One chain
    of element-wise ops for the whole batch, where a generator per request would launch
    one kernel per row."""
    cols = torch.arange(width, dtype=torch.int64, device=seeds.device)
    x = seeds.unsqueeze(1) * _GOLDEN + steps.unsqueeze(1) * _MIX1 + cols
    for shift, mul in ((30, _MIX1), (27, _MIX2)):
        x = (x ^ _shr(x, shift)) * mul
    x = x ^ _shr(x, 31)
    return (_shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs`` [S, V] (non-negative, any total) from ``u`` [S]
    uniforms in (0, 1): the first token whose cumulative mass passes ``u`` x the row's
    total. A token of mass 0 is never drawn (its cumulative mass equals the one before
    it); where rounding puts the target at the total, the row's most likely token."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return torch.where(idx < probs.shape[1], idx, probs.argmax(-1))


_U64 = (1 << 64) - 1


def generator_seed(seed: int) -> int:
    """The seed given to a request's CPU ``torch.Generator`` for its ``seed``: a
    64-bit mix (splitmix64's finaliser) of it. torch's CPU generator keeps only the
    seed's low 32 bits, so seeds that differ by a multiple of 2**32 (0 and 2**32, -2**63
    and 0) drew the same samples; mixed, every bit of the seed moves those 32."""
    x = (seed + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN, _MIX1, _MIX2 = (_signed(v) for v in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_UNIFORM_SALT = 0x5BD1E9955BD1E995  # seeds the acceptance draws of verification apart from the token draws


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` is arithmetic on signed values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


class Sampler:
    """Penalties, filters and the draw for one row per request, as batched tensor ops
    with one transfer of results to the host per call.

    Temperature, top-k, top-p and min-p are batched over the sampled rows (a filter no
    row uses is skipped: no sort of the vocabulary for a temperature-only request); the
    draw is :func:`inverse_cdf` of one uniform per row that depends only on the
    request's seed and output position, so ``seed`` is reproducible whatever else is in
    the batch: on CUDA :func:`counter_uniform` for all rows at once; on CPU (where a
    launch costs nothing) each request's own ``torch.Generator``. One uniform, not a
    noise value per token as in the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``,
    which this replaced): on CPU the race's 49152 exponentials per row took ~0.9 ms, a
    cumulative sum and a binary search take ~0.02 ms. Numerically safe for every
    accepted parameter: values kept finite after penalties and after temperature; a
    row with every token banned (say ``min_new_tokens`` bans EOS while a constraint
    allows only EOS) takes its greedy token (a constraint then refuses it and ends the
    request with an ``abort``) instead of failing the step."""

    def __init__(self, num_rows: int, device: torch.device, eos_ids: Sequence[int],
                 counter_rng: bool | None = None) -> None:
        self.device = device
        self.eos_ids = list(eos_ids)
        self.penalties = PenaltyCounts(num_rows, device)
        self.counter_rng = device.type == "cuda" if counter_rng is None else counter_rng
        self._ints = Staging(device, torch.long)
        self._floats = Staging(device, torch.float32)

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> list[int]:
        """logits: [B, V] raw float32 (modified in place). One token id per request."""
        self.penalties.apply(logits, reqs)
        apply_logit_bias(logits, reqs, self._ints, self._floats)
        mask_min_tokens(logits, reqs, self.eos_ids, self._ints)
        _finite(logits)
        out = logits.argmax(-1)  # greedy for everyone; sampled rows overwritten below
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if sampled:
            idx, probs, ok = self._probs(logits, reqs, sampled)
            draw = inverse_cdf(probs.nan_to_num(nan=0.0), self._uniform(reqs, sampled, [0] * len(sampled)))
            out[idx] = torch.where(ok, draw, out[idx])  # a row with nothing allowed keeps its greedy token
        return out.tolist()

    def verify(self, logits: torch.Tensor, reqs: Sequence[Req], drafts: Sequence[list[int]]) -> list[list[int]]:
        """Speculative verification (see :mod:`plait.runtime.speculative`). logits:
        ``[sum(1 + len(d)), V]`` raw float32 (modified in place), request by request,
        row ``j`` of a request the position after its first ``j`` drafts (grammar masks
        already applied). Per request: the drafts accepted, then one more token (the
        greedy or residual draw of the first rejected row, or the draw of the last).
        Requests with penalties never draft, so none are applied here."""
        sizes = [1 + len(d) for d in drafts]
        rows = [r for r, n in zip(reqs, sizes) for _ in range(n)]
        ahead = [j for n in sizes for j in range(n)]
        # the draft each row verifies; -1 in a request's last row (nothing to verify)
        proposed = [t for d in drafts for t in [*d, -1]]
        apply_logit_bias(logits, rows, self._ints, self._floats)
        mask_min_tokens(logits, rows, self.eos_ids, self._ints, ahead)
        _finite(logits)
        final = logits.argmax(-1)  # greedy for every row; sampled rows overwritten below
        accept: dict[int, bool] = {}  # sampled rows: the draft passed the test (greedy: it is the argmax)
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled:
            steps = [ahead[i] for i in sampled]
            idx, probs, ok = self._probs(logits, rows, sampled)
            (prop,) = self._ints.to_device([proposed[i] for i in sampled])
            has = prop >= 0
            col = prop.clamp(min=0).unsqueeze(1)
            p_draft = probs.gather(1, col).squeeze(1)
            # the residual: p without the draft (renormalising is implicit in the race)
            rest = probs.scatter(1, col, torch.where(has, 0.0, p_draft).unsqueeze(1))
            u = self._uniform(rows, sampled, steps, salt=_UNIFORM_SALT)
            take = has & ok & ((u < p_draft) | (rest.sum(-1) <= 0))  # nothing else left: the draft
            draw = inverse_cdf(rest.nan_to_num(nan=0.0), self._uniform(rows, sampled, steps))
            final[idx] = torch.where(ok, draw, final[idx])
            accept = dict(zip(sampled, take.tolist()))
        final_l = final.tolist()
        out, at = [], 0
        for r, d in zip(reqs, drafts):
            toks = []
            for j, x in enumerate(d):
                if not (final_l[at + j] == x if r.params.is_greedy else accept[at + j]):
                    break
                toks.append(x)
            toks.append(final_l[at + len(toks)])
            out.append(toks)
            at += 1 + len(d)
        return out

    def _probs(self, logits: torch.Tensor, reqs: Sequence[Req],
               sampled: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row indices, the sampling distribution of rows ``sampled`` after temperature,
        top-k, top-p and min-p, whether any token is allowed in each)."""
        vocab = logits.shape[1]
        params = [reqs[i].params for i in sampled]
        idx, top_k = self._ints.to_device(sampled, [p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        temps, top_p, min_p = self._floats.to_device(
            [p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params])
        k_max = max((p.top_k for p in params if 0 < p.top_k < vocab), default=0)
        rows = _filter(_finite(logits[idx] / temps.unsqueeze(1)), top_k, top_p, min_p, k_max,
                       any(p.top_p < 1.0 for p in params), any(p.min_p > 0.0 for p in params))
        return idx, rows.softmax(-1), torch.isfinite(rows).any(-1)

    def _uniform(self, reqs: Sequence[Req], sampled: list[int], ahead: list[int], salt: int = 0) -> torch.Tensor:
        """One uniform in (0, 1) per sampled row: on CUDA a hash of (seed ^ salt, output
        position), on CPU drawn from each request's generator in row order."""
        if self.counter_rng:
            seeds, steps = self._ints.to_device([_signed((reqs[i].seed ^ salt) & _U64) for i in sampled],
                                                [reqs[i].output_len + a for i, a in zip(sampled, ahead)])
            return counter_uniform(seeds, steps, 1)[:, 0]
        return torch.cat([torch.rand(1, generator=reqs[i].generator, device=self.device) for i in sampled])


def token_logprobs(
    logprobs: torch.Tensor, token_ids: Sequence[int], top_n: int
) -> tuple[list[float], list[list[list]] | None]:
    """logprobs: [N, V] log-softmaxed rows. Chosen-token logprobs and, if top_n > 0,
    the top-n ``[logprob, id]`` lists per row."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    if top_n <= 0:
        return chosen, None
    vals, idx = logprobs.topk(top_n, dim=-1)
    top = [[[v, t] for v, t in zip(vr, ir)] for vr, ir in zip(vals.tolist(), idx.tolist())]
    return chosen, top
