"""The regex dialect of constraints, and the one check of it (``gen(regex=...)``, the
runtime's ``regex`` sampling parameter, JSON Schema ``pattern`` and
``whitespace_pattern``).

The engine compiles a constraint with outlines-core: Rust's ``regex`` syntax, built
into a DFA that is walked from an anchored start state. :func:`check_regex` accepts a
subset of that dialect that it always builds, so a pattern accepted at submit time
fails later only for what no syntax check can see: a ``\\p{..}`` property name
outlines-core does not know, a pattern that matches nothing the vocabulary can write,
or the compile limits (time, memory). Accepted:

- literals; ``.``; ``\\d \\D \\s \\S \\w \\W``; ``\\pL`` and ``\\p{Name}`` (``\\P`` negated);
  ``\\t \\n \\r \\f \\v \\a``; ``\\xHH \\uHHHH \\UHHHHHHHH`` and ``\\x{H..}`` (also
  ``\\u{..}``, ``\\U{..}``); a backslash before ASCII punctuation or whitespace (as
  ``re.escape`` writes them);
- classes ``[...]``, ``[^...]`` of those and of ranges ``a-z`` (a ``]`` first is
  literal; ``[``, ``&&``, ``--`` and ``~~`` inside a class must be escaped);
- groups ``(...)``, ``(?:...)``, ``(?P<name>...)``, ``(?<name>...)``; flags
  ``(?i)``, ``(?i-s:...)`` of ``i``, ``m``, ``s``, ``U``;
- repetitions ``* + ? {n} {n,} {n,m}``, each optionally lazy (``*?``); a ``+`` right
  after a repetition is refused (``a*+``, ``\\d++``: possessive in PCRE, Java and Python,
  where Rust would nest it, so ``a*+a`` would admit ``a``; group it, ``(a*)+``, to
  repeat a repetition).

``^`` at the start and ``$`` at the end (of the pattern or of a top-level
alternative) are dropped: the whole output always matches the pattern, and SGLang's
default backend (xgrammar) ignores them alike. Rejected with the reason: other anchors
and word boundaries (outlines-core cannot start a DFA that looks behind), look-around,
backreferences, conditionals, atomic groups, comments, other flags, octal escapes, and
what Rust's parser refuses (``a{`` and ``{,n}``, ``{5,2}``, ``[b-a]``, ``\\Z``...).
Pure Python, linear time, no imports beyond the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MAX_PATTERN_CHARS = 100_000
# Rust's parser refuses an AST nested deeper than 250 (groups, alternations,
# concatenations, repetitions and classes each count); this stays below it.
MAX_NESTING = 200
MAX_REPEAT = 2**32 - 1  # a repetition count must fit Rust's u32

_COUNTED = re.compile(r"\{([0-9]+)(?:(,)([0-9]*))?\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEX = re.compile(r"[0-9A-Fa-f]+")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PERL_CLASSES = set("dDsSwW")
_CONTROL = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
# ASCII punctuation and whitespace (re.escape writes a backslash before a newline), not < >
_ESCAPABLE = set("!\"#$%&'()*+,-./:;=?@[\\]^_`{|}~ \t\n\r\v\f")
_FLAGS = set("imsU")
_CATEGORIES = set("CLMNPSZ")  # one-letter general categories (\pL)

_ANCHOR = ("'^' only at the pattern's start and '$' only at its end (or at those of a top-level alternative): "
           "the whole output always matches the pattern")
_NO_LOOK = "regular expressions without look-around, backreferences or conditionals"


class RegexError(ValueError, re.error):
    """A pattern that is not a valid regular expression: a ``ValueError`` as plait's
    other refusals, and a ``re.error`` as SGLang's ``gen()`` raises (it compiles the
    pattern with ``re``), so either ``except`` catches it. ``pos``: where it fails."""

    def __init__(self, message: str, pattern: str | None = None, pos: int | None = None) -> None:
        re.error.__init__(self, message)  # (without pos: the message names the position already)
        self.pattern, self.pos = pattern, pos

    def __reduce__(self) -> tuple[Any, ...]:  # (a worker process's error comes back whole)
        return (RegexError, (self.msg, self.pattern, self.pos))


class _Invalid(Exception):
    """A pattern is refused: ``feature`` is None for a syntax error, else what it uses."""

    def __init__(self, message: str, pos: int, feature: str | None = None, allowed: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.pos = pos
        self.feature = feature
        self.allowed = allowed


def check_regex(pattern: object, name: str = "regex") -> str:
    """Return ``pattern`` if the engine can compile it, without a ``^`` at its start and
    a ``$`` at its end (those of a top-level alternative too), which say nothing where
    the whole output always matches (SGLang's default backend, xgrammar, ignores them
    alike); else raise ``ValueError`` naming ``name`` (the parameter or schema
    location), the position and what is allowed. The dialect is in this module's
    docstring."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{name}={pattern!r} is invalid; allowed: a non-empty regular expression string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{name} is invalid: {len(pattern)} characters; allowed: at most {MAX_PATTERN_CHARS}")
    parser = _Parser(pattern)
    try:
        parser.parse()
    except _Invalid as e:
        if e.feature is None:
            raise RegexError(
                f"{name}={_short(pattern)} is not a valid regular expression at position {e.pos}: {e.message}",
                pattern, e.pos,
            ) from None
        raise ValueError(
            f"{name}={_short(pattern)} uses {e.feature} at position {e.pos}, which constrained decoding does "
            f"not support; allowed: {e.allowed}"
        ) from None
    if parser.end_anchors:
        drop = set(parser.end_anchors)
        pattern = "".join(c for i, c in enumerate(pattern) if i not in drop)
        if not pattern:
            raise ValueError(f"{name}={_short(parser.p)} matches only the empty output; allowed: a regular expression "
                             "that writes something")
    return pattern


# \d \w \s as ASCII, as SGLang's grammar backends (xgrammar, outlines' interegular) and
# Python's re.ASCII read them; Rust's regex, which outlines-core and llguidance use,
# reads them as Unicode classes (\d admits '٣', '𝟦', ...). Outside a class: a class;
# inside one: its members, and a negation as its complement's ranges (exact inside a
# negated class too: [^\D] is [0-9]).
_ASCII_CLASS = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t-\\r "}  # \t-\r: tab, newline, \v, \f, return
_ASCII_COMPLEMENT = {
    "d": "\\x00-/:-\\x{10FFFF}",
    "w": "\\x00-/:-@\\[-\\^`\\{-\\x{10FFFF}",
    "s": "\\x00-\\x08\\x0E-\\x1F!-\\x{10FFFF}",
}
# Under (?i), Rust folds k and s to U+212A KELVIN SIGN and U+017F LONG S: a \W inside a
# class (whose complement ranges hold both, and would fold them back to k and s) leaves
# them out
_ASCII_COMPLEMENT_FOLDED_W = "\\x00-/:-@\\[-\\^`\\{-\\x{17E}\\x{180}-\\x{2129}\\x{212B}-\\x{10FFFF}"


def ascii_classes(pattern: str) -> str:
    """``pattern`` (accepted by :func:`check_regex`) with ``\\d \\w \\s`` and their
    negations narrowed to ASCII: ``[0-9]``, ``[0-9A-Za-z_]``, ``[\\t-\\r ]`` and their
    complements; inside a class, their members or the complement's ranges. Case
    folding (``(?i)``) keeps them ASCII outside a class (``(?-i:...)``) and keeps a
    ``\\W`` inside one from admitting ``k`` and ``s``; a ``\\w`` inside a class under
    ``(?i)`` also admits U+212A and U+017F (a class cannot turn folding off). What the
    engine compiles for a user's ``regex`` (both backends)."""
    parser = _Parser(pattern)
    parser.parse()
    if not parser.perl:
        return pattern
    out, last = [], 0
    for i, in_class in parser.perl:
        e = pattern[i + 1]
        base, negated = e.lower(), e.isupper()
        if in_class:
            if not negated:
                text = _ASCII_CLASS[base]
            elif base == "w" and parser.case_insensitive:
                text = _ASCII_COMPLEMENT_FOLDED_W
            else:
                text = _ASCII_COMPLEMENT[base]
        else:
            text = "[" + ("^" if negated else "") + _ASCII_CLASS[base] + "]"
            if base == "w" and parser.case_insensitive:
                text = "(?-i:" + text + ")"
        out += [pattern[last:i], text]
        last = i + 2
    out.append(pattern[last:])
    return "".join(out)


def _short(s: str, n: int = 80) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


@dataclass
class _Frame:
    """A group being parsed. Depths follow Rust's nesting count."""

    start: int  # position of its '(' (-1: the whole pattern)
    branches: int = 1
    depth: int = 0  # deepest finished branch
    items: int = 0  # in the current branch
    item_depth: int = 0  # deepest item of the current branch
    last: int | None = None  # depth of the last item; None when there is nothing to repeat
    repeated: bool = False  # the last item is a repetition
    flag_items: int = 0  # flag groups in the current branch

    def add(self, depth: int | None) -> None:
        """An item; ``depth`` None for one that cannot be repeated (a flag group)."""
        self.items += 1
        self.flag_items += depth is None
        self.last = depth
        self.repeated = False
        self.item_depth = max(self.item_depth, depth or 0)

    def end_branch(self) -> None:
        self.depth = max(self.depth, (1 if self.items > 1 else 0) + self.item_depth)
        self.items, self.item_depth, self.last, self.flag_items = 0, 0, None, 0

    def close(self) -> int:
        """Depth of the finished group's content."""
        self.end_branch()
        return (1 if self.branches > 1 else 0) + self.depth


class _Parser:
    """One left-to-right pass; groups on an explicit stack (no recursion)."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.names: set[str] = set()
        self.perl: list[tuple[int, bool]] = []  # each \\d \\w \\s (or negation): (its '\\', inside a class)
        self.case_insensitive = False  # some flag group turns on 'i'
        self.end_anchors: list[int] = []  # '^' / '$' at a top-level branch's start / end (no-ops)

    def parse(self) -> None:
        p, n = self.p, len(self.p)
        bad = _SURROGATE.search(p)
        if bad:
            raise _Invalid(f"a lone surrogate U+{ord(bad.group()):04X} (not valid Unicode text)", bad.start())
        stack = [_Frame(-1)]
        i = 0
        while i < n:
            c, top = p[i], stack[-1]
            if c == "(":
                start = i
                i, opened = self._group(i)
                if not opened:
                    top.add(None)
                elif len(stack) > MAX_NESTING:
                    raise _Invalid(f"groups nested deeper than {MAX_NESTING}", start)
                else:
                    stack.append(_Frame(start))
                continue
            if c == ")":
                if len(stack) == 1:
                    raise _Invalid("an unbalanced ')'", i)
                depth = stack.pop().close()
                stack[-1].add(1 + depth)
                i += 1
            elif c == "|":
                top.end_branch()
                top.branches += 1
                i += 1
            elif c in "*+?":
                i = self._repeat(top, i, i + 1)
            elif c == "{":
                m = _COUNTED.match(p, i)
                if m is None:
                    raise _Invalid("a literal '{' must be escaped as '\\{' (a repetition is {n}, {n,} or {n,m})", i)
                lo, hi = self._count(m.group(1), m.start(1)), m.group(3)
                if hi and lo > self._count(hi, m.start(3)):
                    raise _Invalid(f"the repetition bounds {m.group()} are out of order (allowed: {{n,m}} with n <= m)", i)
                i = self._repeat(top, i, m.end())
            elif c == "[":
                i = self._class(i)
                top.add(2)  # a bracketed class and its item union
            elif c == "\\":
                i, _ = self._escape(i, in_class=False)
                top.add(0)
            elif c == "^" and len(stack) == 1 and top.items == top.flag_items:
                self.end_anchors.append(i)  # a top-level branch's start: the whole output always matches
                i += 1
            elif c == "$" and len(stack) == 1 and (i + 1 == n or p[i + 1] == "|"):
                self.end_anchors.append(i)  # a top-level branch's end
                i += 1
            elif c in "^$":
                raise _Invalid("", i, f"an anchor ('{c}') inside the pattern", _ANCHOR)
            else:
                top.add(0)
                i += 1
        if len(stack) > 1:
            raise _Invalid("a '(' that is never closed", stack[-1].start)
        if stack[0].close() > MAX_NESTING:
            raise _Invalid(f"an expression nested deeper than {MAX_NESTING}", 0)

    # -- pieces ------------------------------------------------------------------------------
    def _repeat(self, top: _Frame, start: int, end: int) -> int:
        if top.last is None:
            raise _Invalid(f"'{self.p[start:end]}' has nothing to repeat", start)
        if top.repeated and self.p[start] == "+":
            # possessive in PCRE, Java and Python, a nested repeat in Rust: 'a*+a' would admit
            # 'a', which they all refuse (other repeats of a repeat mean the same in each)
            raise _Invalid("", start, "a possessive quantifier ('+' right after a repetition)",
                           "repetitions without '+' after them, optionally lazy ('*?'); to repeat a repetition, "
                           "group it: '(a*)+'")
        top.repeated = True
        top.last += 1
        top.item_depth = max(top.item_depth, top.last)
        if end < len(self.p) and self.p[end] == "?":  # lazy
            end += 1
        return end

    @staticmethod
    def _count(digits: str, pos: int) -> int:
        if len(digits) > 10 or int(digits) > MAX_REPEAT:
            raise _Invalid(f"a repetition count above {MAX_REPEAT}", pos)
        return int(digits)

    def _group(self, i: int) -> tuple[int, bool]:
        """Parse a group opening at ``i``: (position after it, True if it opens a group
        that ')' closes; False for a flag group ``(?i)``, which is complete)."""
        p, n = self.p, len(self.p)
        if not p.startswith("(?", i):
            return i + 1, True
        j = i + 2
        rest = p[j:j + 3]
        if rest.startswith(":"):
            return j + 1, True
        if rest.startswith(("=", "!", "<=", "<!")):
            kind = "a negative lookaround" if "!" in rest[:2] else "a lookaround"
            raise _Invalid("", i, kind, _NO_LOOK)
        if rest.startswith("P="):
            raise _Invalid("", i, "a backreference", _NO_LOOK)
        if rest.startswith("("):
            raise _Invalid("", i, "a conditional group", _NO_LOOK)
        if rest.startswith(">"):
            raise _Invalid("", i, "an atomic group", "plain groups (...) or (?:...)")
        if rest.startswith("#"):
            raise _Invalid("", i, "a comment group", "no comments in the pattern")
        if rest.startswith(("P<", "<")):
            k = j + (2 if rest.startswith("P<") else 1)
            end = p.find(">", k)
            if end < 0:
                raise _Invalid("a group name without its closing '>'", i)
            name = p[k:end]
            if not _NAME.fullmatch(name):
                raise _Invalid(f"the group name {name!r} is invalid (allowed: ASCII letters, digits and '_', "
                               "not starting with a digit)", k)
            if name in self.names:
                raise _Invalid(f"the group name {name!r} is used twice", k)
            self.names.add(name)
            return end + 1, True
        if rest.startswith("P"):
            raise _Invalid("'(?P' must be followed by '<name>'", i)
        k = j  # flags: (?i) or (?i-s:...)
        seen: set[str] = set()
        negated = False
        while k < n and p[k] not in ":)":
            f = p[k]
            if f == "-":
                if negated:
                    raise _Invalid("a second '-' in a flag group", k)
                negated = True
            elif f not in _FLAGS:
                if f.isalpha():
                    raise _Invalid("", k, f"the flag '{f}'", "the flags i, m, s and U")
                raise _Invalid(f"'(?{f}' is not a group this dialect knows", i)
            elif f in seen:
                raise _Invalid(f"the flag '{f}' is repeated", k)
            else:
                seen.add(f)
                self.case_insensitive |= f == "i" and not negated
            k += 1
        if k >= n:
            raise _Invalid("a '(' that is never closed", i)
        if not seen or p[k - 1] == "-":
            raise _Invalid("a flag group needs a flag (after '-' too)", i)
        return k + 1, p[k] == ":"

    def _escape(self, i: int, in_class: bool) -> tuple[int, int | None]:
        """Parse ``\\...`` at ``i``: (position after it, the character's code point, or
        None for a class such as ``\\d`` or ``\\pL``)."""
        p, n = self.p, len(self.p)
        if i + 1 >= n:
            raise _Invalid("a trailing '\\' escapes nothing", i)
        e = p[i + 1]
        if e in _PERL_CLASSES:
            self.perl.append((i, in_class))
            return i + 2, None
        if e in "pP":
            return self._property(i), None
        if e in _CONTROL:
            return i + 2, ord(_CONTROL[e])
        if e in _HEX_DIGITS:
            return self._hex(i)
        if e in "bB<>AzZG":
            if in_class:
                raise _Invalid(f"'\\{e}' is not allowed inside a class" + (" (write \\x08 for a backspace)"
                                                                            if e == "b" else ""), i)
            what = "a word boundary" if e in "bB<>" else "an anchor"
            raise _Invalid("", i, f"{what} ('\\{e}')", _ANCHOR if e in "AzZG" else
                           "no word boundaries (\\b, \\B, \\<, \\>)")
        if e in "123456789":
            raise _Invalid("", i, "a backreference", _NO_LOOK)
        if e == "0":
            raise _Invalid("octal escapes are not supported (write \\x00)", i)
        if e in _ESCAPABLE:
            return i + 2, ord(e)
        raise _Invalid(f"the escape '\\{e}' is unknown", i)

    def _hex(self, i: int) -> tuple[int, int]:
        p, e = self.p, self.p[i + 1]
        if p.startswith("{", i + 2):
            end = p.find("}", i + 3)
            digits = p[i + 3:end] if end > 0 else ""
            after = end + 1
        else:
            digits = p[i + 2:i + 2 + _HEX_DIGITS[e]]
            after = i + 2 + _HEX_DIGITS[e]
            if len(digits) < _HEX_DIGITS[e]:
                digits = ""
        if not _HEX.fullmatch(digits):
            raise _Invalid(f"'\\{e}' needs {_HEX_DIGITS[e]} hex digits or {{hex digits}}", i)
        code = int(digits, 16) if len(digits.lstrip("0")) <= 8 else 0x110000
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            raise _Invalid(f"'{p[i:after]}' is not a Unicode scalar value", i)
        return after, code

    def _property(self, i: int) -> int:
        p = self.p
        if p.startswith("{", i + 2):
            end = p.find("}", i + 3)
            if end < 0:
                raise _Invalid(f"'\\{p[i + 1]}{{' without its closing '}}'", i)
            if end == i + 3 or any(c in "{\\" for c in p[i + 3:end]):
                raise _Invalid(f"'{p[i:end + 1]}' does not name a Unicode property", i)
            return end + 1  # the name itself is judged by outlines-core
        if i + 2 < len(p) and p[i + 2] in _CATEGORIES:
            return i + 3
        raise _Invalid(f"'\\{p[i + 1]}' needs a general category letter ({''.join(sorted(_CATEGORIES))}) "
                       "or {Name}", i)

    def _class(self, i: int) -> int:
        """Parse ``[...]`` at ``i``; the position after it."""
        p, n = self.p, len(self.p)
        j = i + 1
        if j < n and p[j] == "^":
            j += 1
        first = True
        while True:
            if j >= n:
                raise _Invalid("a '[' that is never closed", i)
            if p[j] == "]" and not first:
                return j + 1
            start = j
            j, lo = self._class_atom(j)
            first = False
            if j + 1 < n and p[j] == "-" and p[j + 1] != "]":
                if p[j + 1] == "-":
                    raise _Invalid("'--' inside a class (set operations are not supported; escape '-' as '\\-')", j)
                j, hi = self._class_atom(j + 1)
                if lo is None or hi is None:
                    raise _Invalid(f"the range {p[start:j]!r} has a class such as \\d as a bound", start)
                if lo > hi:
                    raise _Invalid(f"the range {p[start:j]!r} is out of order", start)

    def _class_atom(self, j: int) -> tuple[int, int | None]:
        """One class member at ``j``: (position after it, its code point or None)."""
        p, n = self.p, len(self.p)
        c = p[j]
        if c == "[":
            raise _Invalid("a literal '[' inside a class must be escaped as '\\[' (nested classes and [:name:] "
                           "are not supported)", j)
        if c in "&~-" and j + 1 < n and p[j + 1] == c:
            raise _Invalid(f"'{c}{c}' inside a class (set operations are not supported; escape '{c}' as '\\{c}')",
                           j)
        if c == "\\":
            return self._escape(j, in_class=True)
        return j + 1, ord(c)

