"""Sampling parameters of one request, validated loudly."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256


@dataclass
class SamplingParams:
    """What to generate and how. ``temperature == 0`` means greedy.

    ``top_k`` of -1 (or 0) disables top-k; ``stop`` strings end generation and are
    trimmed from the returned text; ``stop_token_ids`` end it too (the token stays in
    ``output_ids``, as EOS does). Penalties follow OpenAI (frequency, presence: over the
    output so far) and Hugging Face (repetition: over prompt and output).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    # Constraints (at most one): the output fully matches ``regex``, or is JSON that
    # validates against ``json_schema`` (a dict or JSON text), written compactly unless
    # ``whitespace_pattern`` (a regex over spaces/tabs/newlines, e.g. "[ ]?") is given.
    regex: str | None = None
    json_schema: dict[str, Any] | str | None = None
    whitespace_pattern: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | "SamplingParams" | None) -> "SamplingParams":
        """Build from a user dict; raise ``ValueError`` naming any bad field."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            out = dataclasses.replace(d)
            if "_constraint" in d.__dict__:  # the translated constraint (checked against the fields)
                out.__dict__["_constraint"] = d.__dict__["_constraint"]
            return out
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in d if k not in names)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(names)}"
            )
        kwargs = dict(d)
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        if kwargs.get("stop") is None:
            kwargs.pop("stop", None)
        if kwargs.get("stop_token_ids") is None:
            kwargs.pop("stop_token_ids", None)
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        _int(self.max_new_tokens, "max_new_tokens", 0, None)
        _int(self.min_new_tokens, "min_new_tokens", 0, None)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} is invalid; allowed: at most max_new_tokens ({self.max_new_tokens})"
            )
        _num(self.temperature, "temperature", 0.0, 100.0, "a number in [0, 100]")
        _num(self.top_p, "top_p", 0.0, 1.0, "a number in (0, 1]")
        if self.top_p <= 0.0:
            raise ValueError(f"top_p={self.top_p!r} is invalid; allowed: a number in (0, 1]")
        _int(self.top_k, "top_k", -1, None)
        _num(self.min_p, "min_p", 0.0, 1.0, "a number in [0, 1]")
        _num(self.frequency_penalty, "frequency_penalty", -2.0, 2.0, "a number in [-2, 2]")
        _num(self.presence_penalty, "presence_penalty", -2.0, 2.0, "a number in [-2, 2]")
        _num(self.repetition_penalty, "repetition_penalty", 0.0, 2.0, "a number in (0, 2]")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} is invalid; allowed: a number in (0, 2]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} is invalid; allowed: a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_LEN for s in self.stop):
            raise ValueError(
                f"stop is invalid: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_LEN} characters are allowed"
            )
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} is invalid; allowed: a list of non-negative token ids")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; allowed: true or false")
        if self.seed is not None:
            _int(self.seed, "seed", 0, 2**63 - 1)
        _int(self.n, "n", 1, MAX_N)
        self._check_constraint()

    def _check_constraint(self) -> None:
        if self.regex is not None and self.json_schema is not None:
            raise ValueError("regex and json_schema are both set; allowed: at most one constraint per request")
        if self.whitespace_pattern is not None and self.json_schema is None:
            raise ValueError("whitespace_pattern is set without json_schema; it only applies to JSON output")
        if self.regex is not None or self.json_schema is not None:
            _ = self.constraint_regex

    @property
    def constraint_regex(self) -> str | None:
        """The regex every output must fully match (``json_schema`` translated), or
        None. Raises ``ValueError`` naming the field or schema keyword at fault."""
        from plait.runtime.constrained.json_schema import schema_to_regex
        from plait.runtime.constrained.regexes import check_regex

        key = (self.regex, repr(self.json_schema), self.whitespace_pattern)
        cached = self.__dict__.get("_constraint")
        if cached is not None and cached[0] == key:
            return cached[1]
        if self.regex is not None:
            out: str | None = check_regex(self.regex, "regex")
        elif self.json_schema is not None:
            if not isinstance(self.json_schema, (dict, str)):
                raise ValueError(
                    f"json_schema={self.json_schema!r} is invalid; allowed: a JSON Schema object or its JSON text"
                )
            out = schema_to_regex(self.json_schema, self.whitespace_pattern)
        else:
            out = None
        self.__dict__["_constraint"] = (key, out)
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any, name: str, lo: int, hi: int | None) -> None:
    allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}={v!r} is invalid; allowed: {allowed}")


def _num(v: Any, name: str, lo: float, hi: float, allowed: str) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < lo or v > hi:
        raise ValueError(f"{name}={v!r} is invalid; allowed: {allowed}")
