"""JSON holes in a regex: a constraint written as a regex with some JSON values left to
llguidance's JSON Schema compiler, given to llguidance as a Lark grammar.

A forced or strict tool call is one regex: the format's fixed text around each call's
arguments, which plait's schema -> regex translation writes. Some schemas that
``response_format`` serves through llguidance's JSON compiler have no such regex (a
``pattern`` beside ``minLength`` / ``maxLength``, as package.json's ``name``; a ``not``
of an ``enum`` beside ``maxLength``); such a call's arguments (or a structural tag's
schema) become a *hole*
(:func:`json_hole`): the schema, prepared as ``response_format`` prepares it for
llguidance, between two private-use characters no regex of plait's writes. A regex
with holes (:func:`has_holes`) is turned into Lark (:func:`holes_to_lark`): the groups
holding holes become rules, the holes ``%json`` values, and the text between them
terminals.

llguidance's lexer is greedy: a terminal that can go on (free text) does, past a
terminal meant to follow it (free text then ``<tool_call>``: the free text ran into
the trigger, which it cannot hold, and the call was refused at its ``>``). So the
text between two holes is one terminal wherever the structure allows (a concatenation
distributes over a group's alternatives), and a terminal something follows is lazy:
it ends where it first can. The regexes given here end their terminals in fixed text
(a format's markers) where anything follows, which makes the two readings agree; a
terminal that ends a repeated or inner group must be fixed text (:func:`holes_to_lark`
refuses others).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import product
from typing import Any, Union

HOLE_OPEN, HOLE_CLOSE = "\ue000", "\ue001"
MAX_ALTERNATIVES = 256  # a concatenation's alternatives distributed before groups become rules


def json_hole(schema: dict[str, Any]) -> str:
    """A hole for a JSON value of ``schema`` (a JSON Schema as llguidance's compiler
    takes it: :func:`plait.runtime.constrained.llguidance_backend.prepared_schema`)."""
    return HOLE_OPEN + json.dumps(schema, ensure_ascii=True, separators=(",", ":")) + HOLE_CLOSE


def has_holes(regex: str) -> bool:
    return HOLE_OPEN in regex


def backend_refusal(grammar_backend: Any, what: str) -> str | None:
    """Why ``grammar_backend`` cannot enforce ``what`` (a constraint with JSON holes:
    llguidance only), or None where it can (llguidance, auto or unset)."""
    if grammar_backend in (None, "auto", "llguidance"):
        return None
    return (f"grammar_backend={grammar_backend!r} cannot enforce {what}: a schema in it has no regex (llguidance's "
            f"JSON compiler follows it, as in response_format); allowed: llguidance or auto")


def masked(regex: str) -> str:
    """``regex`` with each hole as the fixed text ``{}``: what a regex check reads (a
    hole's JSON is not regex text)."""
    out, i = [], 0
    while (j := regex.find(HOLE_OPEN, i)) >= 0:
        k = regex.index(HOLE_CLOSE, j)
        out += [regex[i:j], r"\{\}"]
        i = k + 1
    return "".join(out) + regex[i:]


def regex_or_hole(schema: Any) -> tuple[str, list[list[Any]]]:
    """(the regex of ``schema``, its ``uniqueItems`` sites) as
    :func:`plait.runtime.constrained.unique_items.guarded_regex` gives them, or, where
    that refuses and llguidance's JSON compiler follows the schema, a hole for it and no
    sites. ``ValueError``: the translation's, where neither takes it."""
    from plait.runtime.constrained.unique_items import guarded_regex

    try:
        return guarded_regex(schema)
    except ValueError as e:
        if not isinstance(schema, dict):
            raise
        try:
            from plait.runtime.constrained.llguidance_backend import prepared_schema

            return json_hole(prepared_schema(schema)), []
        except (ImportError, ValueError):
            raise e from None


# -- the regex's structure, as far as the holes need it ------------------------------------------------
@dataclass(frozen=True)
class _Raw:
    text: str  # regex text without holes


@dataclass(frozen=True)
class _Hole:
    schema: str


@dataclass(frozen=True)
class _Seq:
    items: tuple[Any, ...]


@dataclass(frozen=True)
class _Alt:
    options: tuple[Any, ...]


@dataclass(frozen=True)
class _Rep:
    node: Any
    low: int
    high: int | None


_Node = Union[_Raw, _Hole, _Seq, _Alt, _Rep]


class _Parser:
    """Regex text -> nodes, structure kept only where a hole is inside: a group without
    one stays text (with its quantifier)."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def alternation(self, flags: str) -> _Node:
        options = [self.sequence(flags)]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            options.append(self.sequence(flags))
        if len(options) == 1:
            return options[0]
        if not any(_holes_in(o) for o in options):
            return _Raw("|".join(o.text for o in options))  # (only inside a group: its text is rejoined)
        return _Alt(tuple(options))

    def sequence(self, flags: str) -> _Node:
        items: list[_Node] = []
        while self.i < len(self.s) and self.s[self.i] not in "|)":
            start = self.i
            atom = self.atom(flags)
            quantified = self.quantifier(atom, start)
            if isinstance(quantified, _Raw) and items and isinstance(items[-1], _Raw):
                items[-1] = _Raw(items[-1].text + quantified.text)
            else:
                items.append(quantified)
        if len(items) == 1:
            return items[0]
        return _Seq(tuple(items)) if items else _Raw("")

    def atom(self, flags: str) -> _Node:
        s, i = self.s, self.i
        c = s[i]
        if c == HOLE_OPEN:
            end = s.index(HOLE_CLOSE, i)
            self.i = end + 1
            return _Hole(s[i + 1:end])
        if c == "\\":
            self.i = i + 2
            return _Raw(_flagged(s[i:i + 2], flags))
        if c == "[":
            self.i = _class_end(s, i)
            return _Raw(_flagged(s[i:self.i], flags))
        if c == "(":
            j = i + 1
            inner_flags = flags
            if s.startswith("?", j):
                k = j + 1
                while k < len(s) and s[k] not in ":)":
                    k += 1
                head = s[j + 1:k]
                if k >= len(s) or s[k] != ":" or not all(ch.isalpha() or ch == "-" for ch in head):
                    raise ValueError(f"group {s[i:k + 1]!r} in a regex with JSON holes")
                inner_flags = flags + head
                j = k + 1
            self.i = j
            inner = self.alternation(inner_flags)
            if self.i >= len(s) or s[self.i] != ")":
                raise ValueError("unbalanced parenthesis in a regex with JSON holes")
            self.i += 1
            if not _holes_in(inner):
                return _Raw(_flagged(s[i:self.i], flags))
            return inner
        self.i = i + 1
        return _Raw(_flagged(c, flags))

    def quantifier(self, atom: _Node, start: int) -> _Node:
        s, i = self.s, self.i
        if i >= len(s) or s[i] not in "?*+{":
            return atom
        if s[i] == "{":
            end = s.find("}", i)
            body = s[i + 1:end] if end > 0 else ""
            low_text, comma, high_text = body.partition(",")
            if not low_text.isdigit() or (high_text and not high_text.isdigit()):
                return atom  # a literal brace
            low, high = int(low_text), (int(high_text) if high_text else None) if comma else int(low_text)
            self.i = end + 1
        else:
            low, high = {"?": (0, 1), "*": (0, None), "+": (1, None)}[s[i]]
            self.i = i + 1
        if self.i < len(s) and s[self.i] in "?+":  # lazy / possessive: the same language
            self.i += 1
        if not _holes_in(atom):
            return _Raw(_grouped(atom.text) + s[i:self.i])  # type: ignore[union-attr]
        return _Rep(atom, low, high)


def _grouped(text: str) -> str:
    return text if len(text) == 1 or text.startswith("(") and text.endswith(")") else f"(?:{text})"


def _flagged(text: str, flags: str) -> str:
    return f"(?{flags}:{text})" if flags else text


def _class_end(s: str, i: int) -> int:
    """The index past the class opening at ``s[i]`` (nested classes, escapes, a ``]``
    first in it)."""
    depth, j = 0, i
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == "[":
            depth += 1
            j += 1
            if s.startswith("^", j):
                j += 1
            if s.startswith("]", j):
                j += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise ValueError("unterminated class in a regex with JSON holes")


def _holes_in(node: _Node) -> bool:
    if isinstance(node, _Raw):
        return False
    if isinstance(node, _Hole):
        return True
    if isinstance(node, _Seq):
        return any(_holes_in(n) for n in node.items)
    if isinstance(node, _Alt):
        return any(_holes_in(n) for n in node.options)
    return _holes_in(node.node)


# -- Lark --------------------------------------------------------------------------------------------
# a lowered node: its alternatives, each a list of symbols: ("t", regex), ("h", schema) or ("r", rule)
_Lowered = list[list[tuple[str, str]]]


class _Writer:
    def __init__(self) -> None:
        self.rules: list[tuple[str, _Lowered]] = []

    def lower(self, node: _Node) -> _Lowered:
        if isinstance(node, _Raw):
            return [[("t", node.text)]]
        if isinstance(node, _Hole):
            return [[("h", node.schema)]]
        if isinstance(node, _Alt):
            return [alt for option in node.options for alt in self.lower(option)]
        if isinstance(node, _Rep):
            if node.low == 0 and node.high == 1:  # optional: distributed, as a concatenation's group
                return [[], *self.lower(node.node)]
            body = self.rule(self.lower(node.node))
            high = "" if node.high is None else str(node.high)
            return [[("r", f"{body}{{{node.low},{high}}}")]]
        out: _Lowered = [[]]
        for item in node.items:
            parts = self.lower(item)
            if len(out) * len(parts) > MAX_ALTERNATIVES:
                parts = [[("r", self.rule(parts))]]
            out = [_joined(a, b) for a, b in product(out, parts)]
        return out

    def rule(self, alts: _Lowered) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append((name, alts))
        return name


def _joined(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> list[tuple[str, str]]:
    if a and b and a[-1][0] == "t" and b[0][0] == "t":
        return [*a[:-1], ("t", a[-1][1] + b[0][1]), *b[1:]]
    return [*a, *b]


def _ends_fixed(regex: str) -> bool:
    """Whether ``regex`` ends in a fixed character (plain or escaped punctuation, not
    quantified, not in a group or class): a format's closing marker. A terminal that
    ends an inner or repeated group is read greedily and followed by other text; ending
    so, it cannot run on into it (the terminals here end in a call's closing marker)."""
    if not regex:
        return False
    if _escaped_last(regex):
        return not regex[-1].isalnum() or regex[-1] in "nrt"
    return regex[-1] not in ".+*?()|[]{}^$\\"


def _escaped_last(regex: str) -> bool:
    """Whether the last character of ``regex`` follows an unescaped backslash."""
    k = len(regex) - 2
    while k >= 0 and regex[k] == "\\":
        k -= 1
    return (len(regex) - 2 - k) % 2 == 1


def _lark_regex(regex: str) -> str:
    """``regex`` as a Lark ``/.../`` terminal: ``/`` escaped, control characters as
    escapes (a raw newline would end the line of the rule)."""
    out, i = [], 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            out.append(f"\\x{{{ord(nxt):x}}}" if ord(nxt) < 0x20 or nxt == "\x7f" else "\\" + nxt)
            i += 2
            continue
        out.append("\\/" if c == "/" else f"\\x{{{ord(c):x}}}" if ord(c) < 0x20 or c == "\x7f" else c)
        i += 1
    return "/" + "".join(out) + "/"


def holes_to_lark(regex: str) -> str:
    """The Lark grammar (llguidance's dialect) of ``regex`` with its JSON holes as
    ``%json`` values. ``ValueError`` where the structure around the holes is past what
    is written here (a non-fixed terminal ending a repeated or inner group)."""
    parser = _Parser(regex)
    root = parser.alternation("")
    if parser.i != len(regex):
        raise ValueError("unbalanced parenthesis in a regex with JSON holes")
    writer = _Writer()
    start = writer.lower(root)
    terminals: dict[tuple[str, bool], str] = {}
    lines: list[str] = []

    def symbol(kind: str, value: str, lazy: bool) -> str:
        if kind == "h":
            return "%json " + value
        if kind == "r":
            return value
        key = (value, lazy)
        if key not in terminals:
            terminals[key] = name = f"t{len(terminals)}"
            lines.append(f"{name}{'[lazy]' if lazy else ''}: {_lark_regex(value)}")
        return terminals[key]

    def body(alts: _Lowered, top: bool) -> str:
        written = []
        for alt in alts:
            syms = []
            for k, (kind, value) in enumerate(alt):
                last = k == len(alt) - 1
                if kind == "t" and last and not top and not _ends_fixed(value):
                    raise ValueError("a regex with JSON holes whose repeated or inner group ends in text that is "
                                     "not a fixed character")
                if kind == "t" and value == "":
                    continue
                syms.append(symbol(kind, value, lazy=not last))
            written.append(" ".join(syms) if syms else '""')
        return " | ".join(written)

    rules = [f"start: {body(start, True)}"]
    rules += [f"{name}: {body(alts, False)}" for name, alts in writer.rules]
    return "\n".join(rules + lines) + "\n"
