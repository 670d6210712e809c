"""Logit processing, sampling and logprobs for a batch of requests.

Logprobs are those of the model's own distribution (``log_softmax`` of the raw
logits, before penalties and temperature), as vLLM returns them by default, so
they can be compared with any reference implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.runtime.request import Req

NEG_INF = float("-inf")
# Logits are kept finite (penalties and a small temperature can overflow float32): +inf
# becomes this, NaN becomes -inf. Half of float32's max, so the softmax's max-shift
# of two such values cannot overflow.
FINITE_MAX = torch.finfo(torch.float32).max / 2


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> None:
    """In place. frequency/presence (OpenAI) count the output so far; repetition (HF)
    divides positive / multiplies negative logits of every token seen in prompt+output."""
    for i, r in enumerate(reqs):
        p = r.params
        if not p.has_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if r.output_len and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(r.token_ids[r.prompt_len :], dtype=torch.long, device=row.device)
            counts = torch.zeros_like(row).index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
            row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty


def mask_min_tokens(logits: torch.Tensor, reqs: Sequence[Req], eos_ids: Sequence[int]) -> None:
    """In place: forbid EOS and stop ids until ``min_new_tokens`` are generated."""
    for i, r in enumerate(reqs):
        if r.output_len < r.params.min_new_tokens:
            banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(eos_ids))
            if banned:
                logits[i, banned] = NEG_INF


def _filter(rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """top-k, then top-p, then min-p on temperature-scaled logits ``rows`` [S, V], one
    setting per row (``top_k`` int64 [S] in [1, V]; ``top_p``, ``min_p`` float [S]),
    as batched tensor ops: one sort for all rows, no host round trip."""
    sorted_rows, order = rows.sort(dim=-1, descending=True)
    kth = sorted_rows.gather(1, (top_k - 1).unsqueeze(1))  # ties with the k-th are kept
    rows = rows.masked_fill(rows < kth, NEG_INF)
    sorted_rows = sorted_rows.masked_fill(sorted_rows < kth, NEG_INF)  # still in order
    probs = sorted_rows.softmax(-1)
    # drop tokens whose preceding mass already exceeds top_p (the first always stays)
    drop = (probs.cumsum(-1) - probs > top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    rows = rows.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), NEG_INF)
    probs = rows.softmax(-1)
    return rows.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), NEG_INF)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """In place: +inf -> FINITE_MAX, NaN -> -inf (-inf stays: it is a ban)."""
    return torch.nan_to_num_(logits, nan=NEG_INF, posinf=FINITE_MAX, neginf=NEG_INF)


def sample(logits: torch.Tensor, reqs: Sequence[Req], eos_ids: Sequence[int]) -> list[int]:
    """logits: [B, V] raw float32 (modified in place). Returns one token id per request,
    with one transfer of results to the host per call.

    Temperature, top-k, top-p and min-p are batched over the sampled rows; each row
    draws with its request's own generator (the exponential race: ``argmax(p / q)``
    with ``q ~ Exp(1)`` is a draw from ``p``), so ``seed`` stays reproducible whatever
    else is in the batch. Numerically safe for every accepted parameter: values kept
    finite after penalties and after temperature; a row with every token banned (say
    ``min_new_tokens`` bans EOS while a constraint allows only EOS) takes its greedy
    token (a constraint then refuses it and ends the request with an ``abort``)
    instead of failing the step."""
    apply_penalties(logits, reqs)
    mask_min_tokens(logits, reqs, eos_ids)
    _finite(logits)
    out = logits.argmax(-1)  # greedy for everyone; sampled rows overwritten below
    sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
    if sampled:
        device, vocab = logits.device, logits.shape[1]
        params = [reqs[i].params for i in sampled]
        idx = torch.tensor(sampled, dtype=torch.long, device=device)
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
        rows = _filter(_finite(logits[idx] / temps.unsqueeze(1)), top_k, top_p, min_p)
        probs = rows.softmax(-1)
        noise = torch.stack([
            torch.empty(vocab, dtype=probs.dtype, device=device).exponential_(generator=reqs[i].generator)
            for i in sampled
        ])
        draw = (probs / noise).nan_to_num_(nan=-1.0).argmax(-1)
        ok = torch.isfinite(rows).any(-1)  # a row with nothing allowed keeps its greedy token
        out[idx] = torch.where(ok, draw, out[idx])
    return out.tolist()


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
