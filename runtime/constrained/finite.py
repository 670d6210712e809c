"""Whether a constraint admits any *finite* output: refused up front when it does not.

A grammar can describe values that all go on forever: a JSON Schema whose required
property is the schema itself (``{"type": "object", "properties": {"next": {"$ref":
"#"}}, "required": ["next"]}``, a linked list with no end), or a rule that only ever
refers to itself (``root ::= "x" root``). llguidance's Earley parser builds these and
computes masks for them without complaint, so decoding would run until ``max_tokens``
or stall on a mask with no token (a 200 ``abort``). This module finds them before
any decoding, in the edge's worker like the rest of the translation.

It is the classic "productive symbols" computation of a context-free grammar, written
over an AND/OR graph (:class:`Productive`): an AND node holds when all its children do
(a sequence, a schema's keywords together), an OR node when one child does (rule
alternatives, ``anyOf``). Least fixpoint by counting, linear in the graph's size (a
client cannot make it quadratic with long ``$ref`` chains).

Conservative both ways that matter: anything this does not read (an external
``$ref``, ``patternProperties``, a Lark construct it does not parse) counts as finite,
so a constraint is refused only when every value it admits provably never ends.
``not`` and ``if``/``then``/``else`` are among those: they only narrow the values of
the schema beside them, so the values read here are a superset of the real ones and a
refusal stays right; what is missed is a recursion they alone make unending (``then:
{"required": ["next"]}``), which is let through (tests/test_schema_regex_siblings.py).
"""

from __future__ import annotations

import re
from typing import Any

_SCALARS = frozenset(("null", "boolean", "string", "number", "integer"))


class Productive:
    """An AND/OR graph; :meth:`solve` gives each node's least-fixpoint truth."""

    def __init__(self) -> None:
        self.kinds: list[bool] = []  # True: AND, False: OR
        self.kids: list[list[int]] = []
        self.true = self.node(True)  # AND of nothing
        self.false = self.node(False)  # OR of nothing

    def node(self, is_and: bool, kids: list[int] | None = None) -> int:
        self.kinds.append(is_and)
        self.kids.append(list(kids or ()))
        return len(self.kinds) - 1

    def solve(self) -> list[bool]:
        n = len(self.kinds)
        parents: list[list[int]] = [[] for _ in range(n)]
        for p, ks in enumerate(self.kids):
            for k in ks:
                parents[k].append(p)
        need = [len(ks) if is_and else 1 for is_and, ks in zip(self.kinds, self.kids)]
        value = [False] * n
        todo = [i for i in range(n) if self.kinds[i] and not self.kids[i]]
        for i in todo:
            value[i] = True
        while todo:
            c = todo.pop()
            for p in parents[c]:
                if value[p]:
                    continue
                need[p] -= 1
                if need[p] == 0:
                    value[p] = True
                    todo.append(p)
        return value


# -- JSON Schema --------------------------------------------------------------------------------
def schema_unending(root: Any) -> str | None:
    """None when some finite JSON value may satisfy ``root`` (a parsed schema, as the
    llguidance compiler gets it), or when none would even if every recursion ended (a
    ``false`` subschema: no value at all, which the compiler names); else what says why
    not: the local ``$ref`` targets with no finite value."""
    g, top, targets, edges = _schema_graph(root, cut=frozenset())
    value = g.solve()
    if value[top]:
        return None
    loose, loose_top, _, _ = _schema_graph(root, cut=_cyclic(edges))
    if not loose.solve()[loose_top]:
        return None  # no value even with every recursion ended: not a recursion's fault
    stuck = sorted("#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in place)
                   for place, i in targets.items() if not value[i])
    return ("every value it admits goes on forever: a required property, minItems or allOf recurses through "
            f"$ref with no way out (no finite value for: {', '.join(repr(p) for p in stuck[:4])}); give the "
            "recursion an end (make it optional, add null or an empty case through anyOf)")


_TOP: tuple[str, ...] = ("<top>",)  # the owner of what is not under any $ref target


def _schema_graph(root: Any, cut: frozenset) -> tuple[Productive, int, dict[tuple[str, ...], int], set]:
    """The AND/OR graph of ``root``'s "has a finite value", its top node, the node of
    each local ``$ref`` target, and the ``$ref`` edges (owner target, target) seen; a
    ``$ref`` edge in ``cut`` counts as satisfiable (a recursion taken as ended)."""
    from plait.runtime.constrained.json_schema import NOWHERE, local_pointer, pointer_target

    g = Productive()
    targets: dict[tuple[str, ...], int] = {}
    edges: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
    pending: list[tuple[int, Any, tuple[str, ...]]] = []

    def target(place: tuple[str, ...]) -> int:
        if place in targets:
            return targets[place]
        node = pointer_target(root, list(place))
        if node is NOWHERE:
            targets[place] = g.true  # a dangling $ref is the compiler's to report
            return g.true
        targets[place] = i = g.node(True)
        pending.append((i, node, place))
        return i

    def build(s: Any, owner: tuple[str, ...]) -> int:
        if s is False:
            return g.false
        if not isinstance(s, dict):
            return g.true
        parts: list[int] = []
        place = local_pointer(root, s.get("$ref"))
        if place is not None:
            edges.add((owner, tuple(place)))
            if (owner, tuple(place)) not in cut:
                parts.append(target(tuple(place)))
        if isinstance(s.get("allOf"), list):
            parts += [build(x, owner) for x in s["allOf"]]
        for k in ("anyOf", "oneOf"):
            if isinstance(s.get(k), list) and s[k]:
                parts.append(g.node(False, [build(x, owner) for x in s[k]]))
        types = s.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if "const" not in s and "enum" not in s and types is not None and not _SCALARS.intersection(types):
            alts = []
            if "object" in types:
                alts.append(g.node(True, [build(_property(s, name), owner) for name in _required(s)]))
            if "array" in types:
                alts.append(g.node(True, [build(x, owner) for x in _needed_items(s)]))
            parts.append(g.node(False, alts))
        return g.node(True, parts)

    top = build(root, _TOP)
    while pending:
        i, node, place = pending.pop()
        g.kids[i] = [build(node, place)]
    return g, top, targets, edges


def _cyclic(edges: set) -> frozenset:
    """The edges of ``edges`` (a directed graph) that lie on a cycle: both ends in one
    strongly connected component (Tarjan's algorithm, iterative)."""
    succ: dict[Any, list[Any]] = {}
    for u, v in edges:
        succ.setdefault(u, []).append(v)
        succ.setdefault(v, [])
    index: dict[Any, int] = {}
    low: dict[Any, int] = {}
    comp: dict[Any, int] = {}
    stack: list[Any] = []
    on_stack: set[Any] = set()
    counter = 0
    for start in succ:
        if start in index:
            continue
        work = [(start, 0)]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, i = work[-1]
            if i < len(succ[v]):
                work[-1] = (v, i + 1)
                w = succ[v][i]
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp[w] = index[v]
                    if w == v:
                        break
    return frozenset((u, v) for u, v in edges if comp[u] == comp[v])


def _required(s: dict[str, Any]) -> list[str]:
    req = s.get("required")
    return [r for r in req if isinstance(r, str)] if isinstance(req, list) else []


def _property(s: dict[str, Any], name: str) -> Any:
    props = s.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name]
    if s.get("patternProperties"):
        return True  # which pattern applies is not read here
    return s.get("additionalProperties", True)


def _needed_items(s: dict[str, Any]) -> list[Any]:
    """The item schemas every array value must have (its first ``minItems`` and one
    ``contains``)."""
    n = s.get("minItems", 0)
    n = n if isinstance(n, int) and not isinstance(n, bool) else 0
    items = s.get("items")
    if isinstance(items, list):  # draft 4-2019: a tuple, then additionalItems
        prefix, rest = items, s.get("additionalItems", True)
    else:
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        rest = True if items is None else items
    out = [prefix[i] if i < len(prefix) else rest for i in range(min(n, len(prefix) + 1))]
    if "contains" in s and s.get("minContains", 1) != 0:
        out.append(s["contains"])
    return out


# -- Lark (llguidance's dialect; GBNF arrives converted) ----------------------------------------
_LARK_TOKEN = re.compile(r"""
    (?P<ws>[ \t]+|\#[^\n]*|//[^\n]*)
  | (?P<nl>\n)
  | (?P<str>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><\[[^\]\n]*\]>|<[A-Za-z0-9_|.\-]+>)
  | (?P<range>\.\.)
  | (?P<name>[?!_]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?)
  | (?P<num>\d+)
  | (?P<punct>::=|[:|()\[\]*+?~{},=&])
  | (?P<other>.)
""", re.VERBOSE)


class _Unread(Exception):
    """A grammar construct this module does not read: the grammar counts as finite."""


def lark_unending(text: str) -> str | None:
    """None when llguidance's Lark grammar ``text`` may admit a finite text (or uses
    something this does not read); else why not: the rules with no finite expansion.
    Reads rules and terminals (``name: alternatives``), strings, regexes, special
    tokens, rule references, groups, ``[..]``, ``*``, ``+``, ``?`` and ``~ n..m``;
    ``%`` directives' lines are skipped; a rule using ``%json {..}``, ``%regex {..}`` or
    a template makes the whole grammar count as finite (not read)."""
    lines = []
    skipping = 0  # open braces of a skipped directive
    for line in text.split("\n"):
        if skipping or line.lstrip().startswith("%"):  # %llguidance {..}, %import, %ignore
            skipping = max(0, skipping + line.count("{") - line.count("}"))
            continue
        lines.append(line)
    try:
        rules = _lark_rules("\n".join(lines))
    except _Unread:
        return None
    if "start" not in rules:
        return None
    g = Productive()
    ids = {name: g.node(True) for name in rules}
    for name, alts in rules.items():
        g.kids[ids[name]] = [_lark_alts(g, ids, alts)]
    value = g.solve()
    if value[ids["start"]]:
        return None
    stuck = sorted(n for n in rules if not value[ids[n]])
    return (f"every text it admits goes on forever: no finite expansion of {', '.join(stuck[:6])}; give each "
            "recursive rule an alternative without itself")


def _lark_rules(text: str) -> dict[str, list]:
    toks: list[tuple[str, str]] = []
    for m in _LARK_TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "other":
            raise _Unread(m.group())
        if kind != "ws":
            toks.append((kind, m.group()))
    # split into definitions: NAME ':' body, up to the next NAME ':' at a line start
    rules: dict[str, list] = {}
    i = 0
    while i < len(toks):
        if toks[i][0] == "nl":
            i += 1
            continue
        if toks[i][0] != "name" or i + 1 >= len(toks) or toks[i + 1][1] not in (":", "::="):
            raise _Unread(toks[i][1])
        name = toks[i][1].lstrip("?!").split(".")[0]
        j = i + 2
        body: list[tuple[str, str]] = []
        while j < len(toks):
            if toks[j][0] == "nl":
                k = j + 1
                while k < len(toks) and toks[k][0] == "nl":
                    k += 1
                if k + 1 < len(toks) and toks[k][0] == "name" and toks[k + 1][1] in (":", "::="):
                    break
                j = k
                continue
            body.append(toks[j])
            j += 1
        pos, alts = _lark_parse_alts(body, 0)
        if pos != len(body):
            raise _Unread(body[pos][1])
        if name in rules:
            rules[name] = rules[name] + alts
        else:
            rules[name] = alts
        i = j
    return rules


# A parsed body: a list of alternatives, each a list of items (kind, value, (lo, hi)):
# kind "ref" (value a name), "leaf" (a string, regex, special token, %json), "group"
# (value a list of alternatives); (lo, hi) its repetition (hi None: unbounded).
def _lark_parse_alts(body: list, pos: int) -> tuple[int, list]:
    alts = [[]]
    while pos < len(body):
        kind, v = body[pos]
        if v == "|":
            alts.append([])
            pos += 1
        elif v in (")", "]"):
            break
        else:
            pos, item = _lark_parse_item(body, pos)
            alts[-1].append(item)
    return pos, alts


def _lark_parse_item(body: list, pos: int) -> tuple[int, tuple]:
    kind, v = body[pos]
    if v in ("(", "["):
        close = ")" if v == "(" else "]"
        pos, inner = _lark_parse_alts(body, pos + 1)
        if pos >= len(body) or body[pos][1] != close:
            raise _Unread(v)
        item: tuple = ("group", inner, (0, 1) if v == "[" else (1, 1))
        pos += 1
    elif kind == "name":
        item, pos = ("ref", v.lstrip("?!").split(".")[0], (1, 1)), pos + 1
    elif kind in ("str", "regex", "special"):
        item, pos = ("leaf", v, (1, 1)), pos + 1
    else:  # %json {..}, a template's {..}, anything else
        raise _Unread(v)
    while pos < len(body) and body[pos][1] in ("*", "+", "?", "~"):
        op = body[pos][1]
        lo, hi = item[2]
        if op == "~":
            if pos + 1 >= len(body) or body[pos + 1][0] != "num":
                raise _Unread(op)
            n = int(body[pos + 1][1])
            rep = (n, n)
            pos += 2
            if pos + 1 < len(body) and body[pos][1] == ".." and body[pos + 1][0] == "num":
                rep = (n, int(body[pos + 1][1]))
                pos += 2
        else:
            rep = {"*": (0, None), "+": (1, None), "?": (0, 1)}[op]
            pos += 1
        item = (item[0], item[1], (lo * rep[0], None if hi is None or rep[1] is None else hi * rep[1]))
    return pos, item


def _lark_alts(g: Productive, ids: dict[str, int], alts: list) -> int:
    return g.node(False, [g.node(True, [_lark_item(g, ids, it) for it in seq]) for seq in alts])


def _lark_item(g: Productive, ids: dict[str, int], item: tuple) -> int:
    kind, value, (lo, _) = item
    if lo == 0 or kind == "leaf":
        return g.true
    if kind == "ref":
        return ids.get(value, g.true)  # an undefined name is the compiler's to report
    return _lark_alts(g, ids, value)
