"""Draft-free speculative decoding: n-gram (prompt lookup) drafts, verified in one pass.

A decoding request whose context (prompt + output) ends in an n-gram that occurred
earlier in it is likely to continue as it did then: JSON that copies fields of the
prompt, code edited in place, a quoted passage. ``propose_ngram`` takes the longest
such suffix (``speculative_ngram_max`` down to ``speculative_ngram_min`` tokens),
finds its latest earlier occurrence and proposes the (up to ``k``) tokens that
followed it. No draft model: the proposal costs a few ``bytes.rfind`` calls.

Verification (:meth:`plait.runtime.sampler.Sampler.verify`): the request runs as an
extend of ``1 + d`` tokens (its last token and the ``d`` drafts, on top of the
``num_computed`` tokens in the KV pool), which gives the logits of every position at
once. Row ``j`` is exactly the distribution a non-speculative step would sample after
the first ``j`` drafts, so:

- greedy: drafts are accepted while each equals the argmax of its row; the argmax of
  the first row that differs (or of the last row) is the one more token. The output is
  the non-speculative one, token for token.
- sampled: draft ``x`` of row ``j`` is accepted with probability ``p_j(x)`` (``p_j``
  the row's distribution after temperature, top-k/top-p/min-p and masks); the first
  rejected row draws from ``p_j`` with ``x`` removed and renormalised; when every
  draft is accepted the last row draws the next token from ``p_d``. This is the
  speculative-sampling rule (Leviathan et al., Chen et al., 2023) for a deterministic
  draft (``q = δ_x``): the token of row ``j`` is ``x`` with probability ``p_j(x)`` and
  any ``y != x`` with probability ``(1 - p_j(x)) p_j(y) / (1 - p_j(x)) = p_j(y)``, so
  each token has exactly the non-speculative distribution given the ones before it
  (the random draws differ, so a fixed seed gives other tokens).

Rejected drafts' KV is left where it was written and overwritten later (``num_computed``
counts only what was kept; the pages stay with the request). The scheduler takes the
verified tokens one at a time as single steps would (:meth:`Scheduler.process_batch`),
so EOS, stop ids, ``max_new_tokens``, the context limit, a constraint's end and
jump-forward end the step where a non-speculative run would; the output processor
cuts an output at the token that completes a stop string.

Who drafts (:func:`propose`): decoding requests of an engine with ``speculative="ngram"``
whose sampling params keep ``speculative=True`` and have no penalties (their counts
would change within the drafted span); a constrained request's drafts are cut at the
first token its grammar refuses and carry the grammar mask of every verified position
(:meth:`draft_masks` of either backend: outlines walks index states, llguidance
consumes and rolls back). A request whose previous step jumped forward is a prefill
chunk, not a decode, so it never drafts in that step. Drafting rows run through the
eager extend path (CUDA graphs replay one-token decodes only).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plait.runtime.request import Req

NONE = "none"
NGRAM = "ngram"


@dataclass
class Draft:
    """Tokens proposed for one decoding request. ``masks``: for a constrained request,
    the packed grammar rows of its ``1 + len(tokens)`` verified positions (None when
    unconstrained)."""

    tokens: list[int]
    masks: list[np.ndarray] | None = None

    def cut(self, n: int) -> Draft:
        """The first ``n`` drafts (with their masks)."""
        return Draft(self.tokens[:n], None if self.masks is None else self.masks[: n + 1])


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` with ``n_min`` to ``n_max`` tokens; ``[]`` when none occurred
    before. Text that repeats with a period shorter than ``k`` is continued for all
    ``k`` tokens (the tokens after the occurrence, then the proposal itself: the
    context predicted to go on as it went on from there). Pure."""
    size = len(tokens)
    if k < 1 or size < n_min + 1:
        return []
    data = array("i", tokens).tobytes()  # token ids fit int32; rfind runs over bytes
    w = 4
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = data[(size - n) * w :]
        end = (size - 1) * w  # an occurrence ending before the last token has a follower
        while True:
            i = data.rfind(pattern, 0, end)
            if i < 0:
                break
            if i % w == 0:  # aligned on a token
                start = i // w + n
                out = list(tokens[start : start + k])
                while len(out) < k:  # past the end the context repeats what was just proposed
                    out.append(out[start + len(out) - size])
                return out
            end = i + len(pattern) - 1  # a match across token boundaries: look before it
    return []


def propose(r: Req, room: int, n_min: int, n_max: int) -> Draft | None:
    """The draft of decoding request ``r`` for this step, at most ``room`` tokens, or
    None (no drafting for it, or nothing to propose)."""
    p = r.params
    if room < 1 or not p.speculative or p.has_penalties:
        return None
    tokens = propose_ngram(r.token_ids, room, n_min, n_max)
    if not tokens:
        return None
    if r.grammar is None:
        return Draft(tokens)
    masks = r.grammar.draft_masks(tokens, eos_ok=not p.ignore_eos)
    tokens = tokens[: len(masks) - 1]
    return Draft(tokens, masks) if tokens else None
