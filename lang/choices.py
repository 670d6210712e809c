"""How ``select`` picks a choice from per-token logprobs of each choice.

A method is called with keyword arguments (the interface SGLang programs use, so
custom methods port unchanged):

- ``choices``: the choice strings;
- ``normalized_prompt_logprobs``: per choice, the mean logprob of its tokens;
- ``input_token_logprobs``: per choice, ``[logprob, token_id]`` of each of its tokens
  (from the first token that carries choice text, so a token merging the end of
  the context with the start of the choice counts as the choice's);
- ``output_token_logprobs``: per choice, an empty list (nothing is generated);
- ``unconditional_token_logprobs``: per choice, the same tokens scored without the
  context (first entry ``None``), when ``requires_unconditional_logprobs``.

It returns a :class:`ChoicesDecision`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


class ChoicesSamplingMethod(ABC):
    """Base of the choice methods. ``scores`` (optional) gives one number per choice,
    higher is better; ``select(temperature > 0)`` samples from their softmax."""

    requires_unconditional_logprobs: bool = False

    @abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[Any]], output_token_logprobs: list[list[Any]],
                 unconditional_token_logprobs: list[list[Any]] | None = None) -> ChoicesDecision:
        """Pick one of ``choices`` from their logprobs."""

    def scores(self, **kwargs: Any) -> list[float] | None:
        return None


def _best(values: list[float]) -> int:
    """Index of the largest value; the first one on ties."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _logprobs(entries: list[Any]) -> list[float]:
    return [e[0] for e in entries if e[0] is not None]


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (the default)."""

    def scores(self, *, normalized_prompt_logprobs: list[float], **_: Any) -> list[float]:
        return list(normalized_prompt_logprobs)

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        i = _best(normalized_prompt_logprobs)
        return ChoicesDecision(choices[i], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        })


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Walk the choices token by token, keeping only those whose logprob at that
    position is the highest; a choice that has run out of tokens competes with its
    mean logprob. The first survivor wins."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = [_logprobs(c) for c in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        alive = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == top]
            if len(alive) == 1:
                break
        return ChoicesDecision(choices[alive[0]], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": matrix,
        })


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most from the context: the mean over its
    tokens of (logprob with context - logprob without). The first token has no
    unconditional logprob; it counts as 0."""

    requires_unconditional_logprobs = True

    def scores(self, *, input_token_logprobs, unconditional_token_logprobs=None, **_: Any) -> list[float]:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        out = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional token logprobs differ in length")
            diffs = [(c[0] or 0.0) - (u[0] or 0.0) for c, u in zip(cond, uncond)]
            out.append(_mean(diffs))
        return out

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        norm = self.scores(input_token_logprobs=input_token_logprobs,
                           unconditional_token_logprobs=unconditional_token_logprobs)
        return ChoicesDecision(choices[_best(norm)], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": norm,
        })


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def softmax_sample(scores: list[float], temperature: float, u: float) -> int:
    """Index drawn from softmax(scores / temperature) with a uniform ``u`` in [0, 1)."""
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    total = sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w / total
        if u < acc:
            return i
    return len(scores) - 1
