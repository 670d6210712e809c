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


def sample(logits: torch.Tensor, reqs: Sequence[Req], eos_ids: Sequence[int]) -> list[int]:
    """logits: [B, V] raw float32 (modified in place). Returns one token id per request."""
    apply_penalties(logits, reqs)
    mask_min_tokens(logits, reqs, eos_ids)
    out = logits.argmax(-1).tolist()  # greedy for everyone; overwritten for samplers
    for i, r in enumerate(reqs):
        p = r.params
        if p.is_greedy:
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
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
