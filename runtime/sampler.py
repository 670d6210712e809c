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
            banned = [t for t in banned if 0 <= t < logits.shape[1]]  # ids past the LM head never appear
            if banned:
                logits[i, banned] = NEG_INF


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """top-k, top-p and min-p on one row of temperature-scaled logits [V]."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop tokens whose preceding mass already exceeds top_p (the first always stays)
        drop = probs.cumsum(-1) - probs > top_p
        logits = logits.clone()
        logits[order[drop]] = NEG_INF
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), NEG_INF)
    return logits


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """In place: +inf -> FINITE_MAX, NaN -> -inf (-inf stays: it is a ban)."""
    return torch.nan_to_num_(logits, nan=NEG_INF, posinf=FINITE_MAX, neginf=NEG_INF)


def sample(logits: torch.Tensor, reqs: Sequence[Req], eos_ids: Sequence[int]) -> list[int]:
    """logits: [B, V] raw float32 (modified in place). Returns one token id per request.

    Numerically safe for every accepted parameter: values kept finite after penalties
    and after temperature; a row with every token banned (say ``min_new_tokens`` bans
    EOS while a constraint allows only EOS) is sampled greedily, never passed to
    ``torch.multinomial``; its token is then refused by the constraint and the request
    ends with an ``abort`` instead of failing the step."""
    apply_penalties(logits, reqs)
    mask_min_tokens(logits, reqs, eos_ids)
    _finite(logits)
    out = logits.argmax(-1).tolist()  # greedy for everyone; overwritten for samplers
    for i, r in enumerate(reqs):
        p = r.params
        if p.is_greedy:
            continue
        row = _finite(logits[i] / p.temperature)
        if not bool(torch.isfinite(row).any()):
            continue
        row = _filter(row, p.top_k, p.top_p, p.min_p)
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=r.generator).item())
    return out


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
