"""``stop_regex``: generation ends when the output text holds a match of a regex.

SGLang's semantics, with Python ``re``'s syntax: after each token, a search (not a
full match) over the output so far; the request ends at the token that completes the
first match, its finish reason is ``{"type": "stop", "matched": <the pattern>}``. The
match is trimmed from the text as a ``stop`` string is (``no_stop_trim``: the match
stays, what follows it in that token is cut). SGLang's detokenizer trims the text at
``matched`` found literally, so there a regex's match stays in the text unless the
pattern is plain text; plait trims the match itself (what SGLang's ``no_stop_trim``
documents: the stop stays only with it), and a stream never sends text a later match
trims (text that may still begin one is held back, :attr:`StopRegexScan.held_from`).

Why not ``re.search``: Python's engine backtracks, and a pattern such as ``(a+)+b``
takes exponential time on ``aaaa...``; a request would stall the engine loop for
every sequence. Bounding the window searched does not help (30 characters suffice).
So patterns are parsed by Python's own parser (``re._parser``: the syntax and its
errors are ``re``'s) and run here as a Thompson NFA, one character at a time
(a Pike VM): linear in the output, the work per character bounded by the program
size (:data:`MAX_PROGRAM`), and incremental: each step reads only the new text, so
nothing is searched twice. Threads keep the position their match began at, the
earliest for each instruction, so the scan knows where the first match starts (what
is trimmed) and which text may still become part of a match (what a stream holds
back).

Differences from ``re`` (all refused by name, as a 400): look-around, backreferences,
conditionals, atomic groups and possessive repeats (a backtracking engine's features),
patterns that can match the empty string (they would end every request at once), and
programs past :data:`MAX_PROGRAM` instructions (counted repeats are written out:
``x{1000}`` is 1000 copies). ``^`` and ``\\A`` are the start of the output, ``$``,
``\\Z`` and ``\\b`` at the end of the text so far read it as the end of the string (as
a search over each prefix does); ``\\d \\w \\s`` are Unicode unless ``(?a)``, as in
``re``; ``(?i)`` compares a character's lower and upper case forms. Torch-free.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from re import _constants as C  # type: ignore[attr-defined]  (the parse tree's opcodes)
from re import _parser  # type: ignore[attr-defined]  (re's own parser: its syntax and errors)

MAX_STOP_REGEXES = 16
MAX_STOP_REGEX_LEN = 256
MAX_PROGRAM = 2048  # NFA instructions for all of a request's patterns together

_CHAR, _SPLIT, _JMP, _ASSERT, _MATCH = range(5)
_UNSUPPORTED = {"ASSERT": "a look-around", "ASSERT_NOT": "a negative look-around", "GROUPREF": "a backreference",
                "GROUPREF_EXISTS": "a conditional group", "ATOMIC_GROUP": "an atomic group",
                "POSSESSIVE_REPEAT": "a possessive repeat"}
_ALLOWED = ("Python regular expressions without look-around, backreferences, conditionals, atomic groups or "
            "possessive repeats, that cannot match the empty string")

Pred = Callable[[str], bool]


@dataclass(frozen=True)
class StopRegexMatch:
    """The first match in a scanned text: ``pattern`` (the one that matched), and its
    span ``[start, end)`` in the text fed so far."""

    pattern: str
    start: int
    end: int


@dataclass(frozen=True)
class StopRegex:
    """A request's compiled stop regexes: one NFA program. Immutable and shared (it is
    cached per pattern list); each sequence scans with its own :meth:`scanner`."""

    patterns: tuple[str, ...]
    # program: (op, a, b) per instruction. _CHAR: a = predicate, next = pc + 1;
    # _SPLIT: a, b = the two next pcs; _JMP: a; _ASSERT: a = test(prev, next, pos), next = pc + 1;
    # _MATCH: a = the pattern's index
    prog: tuple[tuple[int, object, int], ...]
    starts: tuple[int, ...]  # each pattern's first pc

    def scanner(self) -> StopRegexScan:
        return StopRegexScan(self)


class StopRegexScan:
    """One sequence's search over its output text, fed piece by piece (the text as the
    detokenizer appends it). ``threads``: (pc, start) waiting for the next character,
    earliest start first."""

    def __init__(self, program: StopRegex) -> None:
        self.program = program
        self.pos = 0
        self.prev: str | None = None
        self.threads: list[tuple[int, int]] = []

    @property
    def held_from(self) -> int:
        """Where the earliest match still in progress began (the text from there may yet
        be trimmed, so a stream holds it back); the text's length when none is."""
        return self.threads[0][1] if self.threads else self.pos

    def feed(self, piece: str) -> StopRegexMatch | None:
        """Scan ``piece`` (the text's continuation). Returns the match that ends in it,
        or None. When several patterns match in one piece, the first pattern listed
        wins (SGLang checks them in order after each token); a pattern's match is its
        first one to end, and of those the one that starts first."""
        found: dict[int, tuple[int, int]] = {}
        prog = self.program.prog
        for ch in piece:
            clist = self._closure(ch)
            self._match_at(clist, found)
            # the threads that read ch, moved past it
            self.threads = [(pc + 1, start) for pc, start in clist if prog[pc][0] == _CHAR and prog[pc][1](ch)]
            self.prev = ch
            self.pos += 1
        if not found:
            self._match_at(self._closure(None), found)
        if not found:
            return None
        k = min(found)
        start, end = found[k]
        return StopRegexMatch(self.program.patterns[k], start, end)

    def _match_at(self, clist: list[tuple[int, int]], found: dict[int, tuple[int, int]]) -> None:
        prog = self.program.prog
        for pc, start in clist:
            op, k, _ = prog[pc]
            if op == _MATCH and k not in found:
                found[k] = (start, self.pos)

    def _closure(self, nxt: str | None) -> list[tuple[int, int]]:
        """The threads at ``self.pos`` after following jumps, splits and assertions
        (``nxt`` the next character, None at the end of the text so far), a new thread
        per pattern starting here; each pc once, with its earliest start."""
        prog, pos, prev = self.program.prog, self.pos, self.prev
        seen: set[int] = set()
        out: list[tuple[int, int]] = []
        seeds = self.threads + [(pc, pos) for pc in self.program.starts]
        for seed, start in seeds:
            stack = [seed]
            while stack:
                pc = stack.pop()
                if pc in seen:
                    continue
                seen.add(pc)
                op, a, b = prog[pc]
                if op == _SPLIT:
                    stack += (b, a)
                elif op == _JMP:
                    stack.append(a)
                elif op == _ASSERT:
                    if a(prev, nxt, pos):
                        stack.append(pc + 1)
                else:
                    out.append((pc, start))
        return out


@functools.lru_cache(maxsize=256)
def compile_stop_regex(patterns: tuple[str, ...]) -> StopRegex:
    """Compile a request's ``stop_regex`` list; raise ``ValueError`` naming the pattern
    and what is allowed. Cached: a request's patterns compile once per process (the
    front checks them, the engine's output processor reuses the result)."""
    if len(patterns) > MAX_STOP_REGEXES:
        raise ValueError(f"stop_regex has {len(patterns)} patterns; allowed: at most {MAX_STOP_REGEXES}")
    b = _Builder()
    starts = []
    for k, pattern in enumerate(patterns):
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_STOP_REGEX_LEN:
            raise ValueError(f"stop_regex={_short(pattern)} is invalid; allowed: a non-empty regular expression of "
                             f"at most {MAX_STOP_REGEX_LEN} characters")
        starts.append(len(b.prog))
        b.pattern(pattern, k)
    return StopRegex(tuple(patterns), tuple(b.prog), tuple(starts))


def _short(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


class _Builder:
    """sre parse trees -> one NFA program."""

    def __init__(self) -> None:
        self.prog: list[tuple[int, object, int]] = []
        self.pattern_text = ""

    def pattern(self, pattern: str, k: int) -> None:
        self.pattern_text = pattern
        try:
            tree = _parser.parse(pattern)
            lo, _ = tree.getwidth()
        except re.error as e:
            raise ValueError(f"stop_regex={_short(pattern)} is not a valid regular expression: {e}") from None
        except (RecursionError, OverflowError):
            raise ValueError(f"stop_regex={_short(pattern)} is nested too deeply; allowed: {_ALLOWED}") from None
        if lo == 0:
            raise ValueError(f"stop_regex={_short(pattern)} can match the empty string (it would end every output "
                             f"at once); allowed: {_ALLOWED}")
        self.items(list(tree), tree.state.flags)
        self.emit(_MATCH, k)

    # -- emission ---------------------------------------------------------------------------------
    def emit(self, op: int, a: object = None, b: int = 0) -> int:
        if len(self.prog) >= MAX_PROGRAM:
            raise ValueError(f"stop_regex={_short(self.pattern_text)} is too large: its program passes "
                             f"{MAX_PROGRAM} instructions (counted repeats are written out); allowed: smaller "
                             f"patterns or repeat counts")
        self.prog.append((op, a, b))
        return len(self.prog) - 1

    def patch(self, pc: int, a: int, b: int = 0) -> None:
        op = self.prog[pc][0]
        self.prog[pc] = (op, a, b)

    def items(self, items: list[tuple[object, object]], flags: int) -> None:
        for op, av in items:
            if op is C.LITERAL:
                self.emit(_CHAR, _literal(chr(av), flags))  # type: ignore[arg-type]
            elif op is C.NOT_LITERAL:
                same = _literal(chr(av), flags)  # type: ignore[arg-type]
                self.emit(_CHAR, lambda ch, same=same: not same(ch))
            elif op is C.ANY:
                self.emit(_CHAR, (lambda ch: True) if flags & C.SRE_FLAG_DOTALL else (lambda ch: ch != "\n"))
            elif op is C.IN:
                self.emit(_CHAR, _class(av, flags))  # type: ignore[arg-type]
            elif op is C.BRANCH:
                self.branch(av[1], flags)  # type: ignore[index]
            elif op is C.SUBPATTERN:
                _, add, drop, sub = av  # type: ignore[misc]
                self.items(list(sub), (flags | add) & ~drop)
            elif op is C.MAX_REPEAT or op is C.MIN_REPEAT:  # lazy or greedy: the same matches exist
                lo, hi, sub = av  # type: ignore[misc]
                self.repeat(list(sub), lo, hi, flags)
            elif op is C.AT:
                self.emit(_ASSERT, _assertion(av, flags))
            else:
                what = _UNSUPPORTED.get(str(op), str(op).lower())
                raise ValueError(f"stop_regex={_short(self.pattern_text)} uses {what}, which a search without "
                                 f"backtracking cannot run; allowed: {_ALLOWED}")

    def branch(self, alternatives: list[object], flags: int) -> None:
        jumps = []
        for i, alt in enumerate(alternatives):
            split = self.emit(_SPLIT) if i < len(alternatives) - 1 else None
            self.items(list(alt), flags)  # type: ignore[call-overload]
            if split is not None:
                jumps.append(self.emit(_JMP))
                self.patch(split, split + 1, len(self.prog))
        for j in jumps:
            self.patch(j, len(self.prog))

    def repeat(self, sub: list[tuple[object, object]], lo: int, hi: int, flags: int) -> None:
        for _ in range(lo):
            self.items(sub, flags)
        if hi is C.MAXREPEAT or hi == C.MAXREPEAT:
            split = self.emit(_SPLIT)
            self.items(sub, flags)
            self.emit(_JMP, split)
            self.patch(split, split + 1, len(self.prog))
            return
        for _ in range(hi - lo):  # optional copies, each skippable: x{2,4} = xx x? x?
            split = self.emit(_SPLIT)
            self.items(sub, flags)
            self.patch(split, split + 1, len(self.prog))


# -- character tests -----------------------------------------------------------------------------
def _fold(flags: int) -> bool:
    return bool(flags & C.SRE_FLAG_IGNORECASE)


def _literal(c: str, flags: int) -> Pred:
    if not _fold(flags) or c.lower() == c.upper():
        return c.__eq__
    forms = {c, c.lower(), c.upper()}
    return lambda ch: ch in forms or ch.lower() in forms or ch.upper() in forms


def _category(code: object, flags: int) -> Pred:
    ascii_only = bool(flags & C.SRE_FLAG_ASCII)
    name = str(code)
    if "DIGIT" in name:
        test: Pred = (lambda ch: "0" <= ch <= "9") if ascii_only else str.isdecimal
    elif "SPACE" in name:
        test = (lambda ch: ch in " \t\n\r\f\v") if ascii_only else str.isspace
    else:  # WORD
        test = _word_test(ascii_only)
    if "NOT" in name:
        return lambda ch: not test(ch)
    return test


def _word_test(ascii_only: bool) -> Pred:
    if ascii_only:
        return lambda ch: ch.isascii() and (ch.isalnum() or ch == "_")
    return lambda ch: ch.isalnum() or ch == "_"


def _class(members: list[tuple[object, object]], flags: int) -> Pred:
    negate = False
    chars: set[str] = set()
    ranges: list[tuple[int, int]] = []
    tests: list[Pred] = []
    for op, av in members:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            chars.add(chr(av))  # type: ignore[arg-type]
        elif op is C.RANGE:
            ranges.append(av)  # type: ignore[arg-type]
        elif op is C.CATEGORY:
            tests.append(_category(av, flags))
        else:  # not produced inside a class by the parser
            raise ValueError(f"stop_regex: unexpected class member {op}")

    def member(ch: str) -> bool:
        if ch in chars:
            return True
        o = ord(ch)
        return any(lo <= o <= hi for lo, hi in ranges) or any(t(ch) for t in tests)

    fold = _fold(flags)

    def test(ch: str) -> bool:
        hit = member(ch) or fold and (member(ch.lower()) if len(ch.lower()) == 1 else False) \
            or fold and (member(ch.upper()) if len(ch.upper()) == 1 else False)
        return hit != negate

    return test


def _assertion(code: object, flags: int) -> Callable[[str | None, str | None, int], bool]:
    """``test(prev, next, pos)`` for an anchor; ``next`` None is the end of the text so far."""
    multiline = bool(flags & C.SRE_FLAG_MULTILINE)
    word = _word_test(bool(flags & C.SRE_FLAG_ASCII))

    def boundary(prev: str | None, nxt: str | None) -> bool:
        return (prev is not None and word(prev)) != (nxt is not None and word(nxt))

    if code is C.AT_BEGINNING and multiline:
        return lambda prev, nxt, pos: pos == 0 or prev == "\n"
    if code is C.AT_BEGINNING or code is C.AT_BEGINNING_STRING:
        return lambda prev, nxt, pos: pos == 0
    if code is C.AT_END and multiline:
        return lambda prev, nxt, pos: nxt is None or nxt == "\n"
    if code is C.AT_END or code is C.AT_END_STRING:
        return lambda prev, nxt, pos: nxt is None
    if code is C.AT_BOUNDARY:
        return lambda prev, nxt, pos: boundary(prev, nxt)
    if code is C.AT_NON_BOUNDARY:
        return lambda prev, nxt, pos: not boundary(prev, nxt)
    raise ValueError(f"stop_regex: unexpected anchor {code}")
