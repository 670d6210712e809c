"""Reasoning sections in model output (``<think>...</think>``): split from the answer,
streamed, and skipped by constraints.

Parsers (``--reasoning-parser``):

- ``deepseek-r1``: the output starts inside the reasoning (DeepSeek-R1's template
  opens ``<think>`` in the prompt); an opening ``<think>`` in the output is allowed.
  Without ``</think>`` all the output is reasoning.
- ``qwen3``: the output has a reasoning section only if it starts with ``<think>``
  (Qwen3 with thinking on); otherwise all of it is the answer.

A constraint (``response_format``, required tools) applies to the answer only: its
regex is prefixed by :meth:`ReasoningParser.constraint_prefix`, "any text without
``</think>``, then ``</think>``" (for ``qwen3`` the whole section is optional and must
open with ``<think>``). The reasoning is unbounded in characters unless
``max_chars`` is given; ``max_tokens`` bounds both parts together.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
MAX_REASONING_CHARS = 256  # the most a constrained request may bound its reasoning to (regex size)


def _not_containing_end() -> str:
    """A regex of the texts that do not contain ``</think>`` (whose only ``<`` is its
    first character): split at each ``<``; no piece after a ``<`` may start with
    ``/think>``."""
    w = END[1:]

    def piece(rest: str) -> str:  # '<'-free text that does not start with ``rest``
        c = "\\" + rest[0] if rest[0] in "\\]^-[" else rest[0]
        if len(rest) == 1:
            return f"(?:[^{c}<][^<]*)?"
        return f"(?:[^{c}<][^<]*|{rest[0]}{piece(rest[1:])})?"

    return "[^<]*(?:<" + piece(w) + ")*"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    forced: bool  # the output begins inside the reasoning section

    def parse(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)``: reasoning is None when the output has none."""
        s = text.lstrip()
        if s.startswith(START):
            body = s[len(START):]
        elif self.forced:
            body = text
        else:
            return None, text
        k = body.find(END)
        if k < 0:
            return body.strip(), ""
        return body[:k].strip(), body[k + len(END):].lstrip()

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def constraint_prefix(self, max_chars: int | None = None) -> str:
        """The regex of a reasoning section, to put before a constraint's regex. With
        ``max_chars``, the reasoning has at most that many characters and no ``<``
        (a bounded automaton stays small that way)."""
        body = _not_containing_end() if max_chars is None else "[^<]{0,%d}" % max_chars
        section = "<think>" + body + "</think>\\n{0,2}"
        if self.forced:
            return "(?:<think>)?" + body + "</think>\\n{0,2}" if max_chars is not None else body + "</think>\\n{0,2}"
        return "(?:" + section + ")?"


class ReasoningStream:
    """``feed(delta) -> (reasoning delta, content delta)``; ``finish()`` flushes what was
    held back (a partial ``</think>``, trailing whitespace). The concatenated deltas
    equal :meth:`ReasoningParser.parse` of the whole text (None reasoning as "")."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.buf = ""  # text not yet handed out
        self.mode = "start"  # start -> reasoning -> content, or start -> content
        self.lead = True  # still skipping leading whitespace of the current part

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        return self._advance(False)

    def finish(self) -> tuple[str, str]:
        return self._advance(True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self.mode == "start":
            s = self.buf.lstrip()
            if s.startswith(START):
                self.buf, self.mode = s[len(START):], "reasoning"
            elif START.startswith(s) and not final:
                return "", ""  # could still open a section
            elif self.parser.forced:
                self.mode = "reasoning"
            else:  # no reasoning section: the text as it is, leading whitespace too (parse's)
                self.mode, self.lead = "content", False
        if self.mode == "reasoning":
            k = self.buf.find(END)
            if k >= 0:
                reasoning = self._lead(self.buf[:k]).rstrip()
                self.buf, self.mode, self.lead = self.buf[k + len(END):], "content", True
            elif final:
                reasoning, self.buf = self._lead(self.buf).rstrip(), ""
            else:  # hold back a partial </think> and trailing whitespace
                body = self.buf[:len(self.buf) - _partial_suffix(self.buf, END)].rstrip()
                reasoning, self.buf = self._lead(body), self.buf[len(body):]
        if self.mode == "content":
            content, self.buf = self._lead(self.buf), ""
        return reasoning, content

    def _lead(self, part: str) -> str:
        """``part`` without the leading whitespace of the current section."""
        if self.lead:
            part = part.lstrip()
            self.lead = not part
        return part


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek-r1": ReasoningParser("deepseek-r1", forced=True),
    "qwen3": ReasoningParser("qwen3", forced=False),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    p = REASONING_PARSERS.get(name)
    if p is None:
        raise ValueError(f"reasoning_parser={name!r} is unknown; allowed: {', '.join(REASONING_PARSERS)}")
    return p
