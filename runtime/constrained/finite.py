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
client cannot make it quadratic with long ``$ref`` chains). A schema's node is a
*conjunction* (:class:`_Conjunctions`): what ``allOf`` and ``$ref`` put beside it
applies to the same instance, so ``{"properties": {"next": {"$ref": "#"}}, "allOf":
[{"required": ["next"]}]}`` is read as requiring ``next``. The conjunctions one schema
makes are bounded (:data:`MAX_CONJUNCTS`; past it the schema counts as finite).

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
_TYPES = _SCALARS | {"object", "array"}


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
MAX_CONJUNCTS = 200_000  # subschemas read into conjunctions, in all; past it the schema counts as finite


def schema_unending(root: Any) -> str | None:
    """None when some finite JSON value may satisfy ``root`` (a parsed schema, as the
    llguidance compiler gets it), or when none would even if every recursion ended (a
    ``false`` subschema, types no value has: no value at all, which the compiler names);
    else what says why not: the local ``$ref`` targets the endless recursion goes
    through."""
    try:
        strict = _Conjunctions(root, cut=frozenset())
        value = strict.g.solve()
        if value[strict.top]:
            return None
        loose = _Conjunctions(root, cut=_cyclic(strict.edges))
    except _TooMany:
        return None
    if not loose.g.solve()[loose.top]:
        return None  # no value even with every recursion ended: not a recursion's fault
    stuck_ids = {i for key, node in strict.nodes.items() if not value[node] for i in key}
    stuck = sorted("#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in place)
                   for place, i in strict.places.items() if i in stuck_ids)
    return ("every value it admits goes on forever: a required property, minItems or allOf recurses through "
            f"$ref with no way out (no finite value for: {', '.join(repr(p) for p in stuck[:4])}); give the "
            "recursion an end (make it optional, add null or an empty case through anyOf)")


class _TooMany(Exception):
    """More than :data:`MAX_CONJUNCTS` read: the schema counts as finite (not read)."""


class _Conjunctions:
    """The AND/OR graph of "a finite value satisfies all of these subschemas at once",
    one node per *conjunction*: the set of subschemas one instance must satisfy, closed
    under ``allOf`` and local ``$ref`` (JSON Schema applies both to the instance itself).
    Its keywords read together: ``type`` intersected (``integer`` within ``number``),
    ``required`` names united (with those ``dependentRequired`` adds), each required
    property's value the conjunction of every part's schema for that name
    (``properties``, else ``additionalProperties``), the
    largest ``minItems`` with each needed index's item schemas together; each
    ``contains`` alone. An ``anyOf``/``oneOf`` is an OR of its branches, each added to
    the whole conjunction when it is the only list of branches there not yet chosen
    from (so ``anyOf: [{required: [a]}, ..]`` beside ``properties`` is read), else each
    branch alone (a superset of its values: no blow-up over several lists).

    Nodes are keyed by the set of subschemas, so a recursion meets a node again: a
    cycle, which the least fixpoint leaves false unless an exit makes it true. A child
    edge in ``cut`` counts as satisfiable (a recursion taken as ended). ``edges``: the
    (parent, child) node keys seen; ``places``: each ``$ref`` target's place and the
    id of its subschema."""

    def __init__(self, root: Any, cut: frozenset) -> None:
        self.root, self.cut = root, cut
        self.g = Productive()
        self.nodes: dict[frozenset[int], int] = {}
        self.keys: dict[int, frozenset[int] | None] = {}  # id(subschema) -> its conjunction's key
        self.places: dict[tuple[str, ...], int] = {}
        self.edges: set[tuple[frozenset[int], frozenset[int]]] = set()
        self.budget = MAX_CONJUNCTS
        self.pending: list[tuple[int, list[dict[str, Any]], frozenset[int]]] = []
        self.loops: set[frozenset[int]] = set()  # conjunctions whose $ref / allOf chain comes back to itself
        self.top = self.conj([root], None)
        while self.pending:
            i, flat, key = self.pending.pop()
            self.g.kids[i] = [self.body(flat, key)]
            if key in self.loops:
                # {"$ref": "#/$defs/a"} with a = {"$ref": "#/$defs/a"}: the instance must satisfy
                # itself before anything else; no value ends that (validators recurse forever)
                self.edges.add((key, key))
                if (key, key) not in self.cut:
                    self.g.kids[i].append(i)

    def conj(self, schemas: list[Any], parent: frozenset[int] | None) -> int:
        """The node of ``schemas`` together (reached from node ``parent``)."""
        single = id(schemas[0]) if len(schemas) == 1 else None
        if single is not None and single in self.keys:
            key = self.keys[single]
        else:
            flat = self.flatten(schemas)
            key = None if flat is None else frozenset(id(s) for s in flat)
            if single is not None:
                self.keys[single] = key
            if key is not None and key not in self.nodes:
                self.nodes[key] = i = self.g.node(True)
                self.pending.append((i, flat or [], key))
        if key is None:
            return self.g.false
        if not key:
            return self.g.true
        if parent is not None:
            self.edges.add((parent, key))
            if (parent, key) in self.cut:
                return self.g.true
        return self.nodes[key]

    def flatten(self, schemas: list[Any]) -> list[dict[str, Any]] | None:
        """``schemas`` with every ``allOf`` part and local ``$ref`` target they reach,
        each once; None when one is ``false``."""
        from plait.runtime.constrained.json_schema import NOWHERE, local_pointer, pointer_target

        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        succ: dict[int, list[int]] = {}  # the $ref / allOf edges among them, for the loop check
        todo = list(reversed(schemas))
        while todo:
            s = todo.pop()
            if s is False:
                return None
            if not isinstance(s, dict) or id(s) in seen:
                continue  # true, or what is not a schema: the compiler's to report
            seen.add(id(s))
            out.append(s)
            self.budget -= 1
            if self.budget < 0:
                raise _TooMany
            kids = succ[id(s)] = []
            place = local_pointer(self.root, s.get("$ref"))
            if place is not None:
                target = pointer_target(self.root, place)
                if target is not NOWHERE:  # a dangling $ref is the compiler's to report
                    if isinstance(target, dict):
                        self.places.setdefault(tuple(place), id(target))
                        kids.append(id(target))
                    todo.append(target)
            if isinstance(s.get("allOf"), list):
                kids += [id(x) for x in s["allOf"] if isinstance(x, dict)]
                todo.extend(reversed(s["allOf"]))
        if _has_cycle(succ):
            self.loops.add(frozenset(id(s) for s in out))
        return out

    def body(self, flat: list[dict[str, Any]], key: frozenset[int]) -> int:
        g = self.g
        lists = []
        for s in flat:
            for k in ("anyOf", "oneOf"):
                alts = s.get(k)
                if (isinstance(alts, list) and alts and not any(id(x) in key for x in alts)
                        and not any(x is True or not isinstance(x, (dict, bool)) for x in alts)):
                    lists.append(alts)  # not yet chosen from, and no branch every value satisfies
        parts = [g.node(False, [self.conj([*flat, x] if len(lists) == 1 else [x], key) for x in alts])
                 for alts in lists]
        if not any("const" in s or "enum" in s for s in flat):
            types = _types(flat)
            if types is not None and not _SCALARS.intersection(types):
                alts = []
                if "object" in types:
                    names = _required_names(flat)
                    alts.append(g.node(True, [self.conj([_property(s, n) for s in flat], key) for n in names]))
                if "array" in types:
                    alts.append(g.node(True, [self.conj(items, key) for items in _needed_items(flat)]))
                parts.append(g.node(False, alts))
        return g.node(True, parts)


def _has_cycle(succ: dict[int, list[int]]) -> bool:
    """Whether the directed graph ``succ`` (node -> successors) has a cycle (iterative
    three-colour depth-first search)."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    for start in succ:
        if start in state:
            continue
        state[start] = 1
        work = [(start, iter(succ[start]))]
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                state[v] = 2
                work.pop()
            elif state.get(w) == 1:
                return True
            elif w not in state and w in succ:
                state[w] = 1
                work.append((w, iter(succ[w])))
    return False


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


def _types(flat: list[dict[str, Any]]) -> set[str] | None:
    """The types every part of a conjunction allows (None: no part says); a ``type`` with
    a name no draft defines is not read."""
    out: set[str] | None = None
    for s in flat:
        t = s.get("type")
        names = [t] if isinstance(t, str) else t if isinstance(t, list) else None
        if names is None or not all(isinstance(n, str) and n in _TYPES for n in names):
            continue
        allowed = set(names) | ({"integer"} if "number" in names else set())
        out = allowed if out is None else out & allowed
    return out


def _required(s: dict[str, Any]) -> list[str]:
    req = s.get("required")
    return [r for r in req if isinstance(r, str)] if isinstance(req, list) else []


def _required_names(flat: list[dict[str, Any]]) -> list[str]:
    """The property names every object value of all of ``flat`` has: ``required`` names,
    and those ``dependentRequired`` (draft-7 ``dependencies`` lists) add for a name
    already there."""
    names = dict.fromkeys(n for s in flat for n in _required(s))
    todo = list(names)
    while todo:
        name = todo.pop()
        for s in flat:
            for k in ("dependentRequired", "dependencies"):
                deps = s.get(k)
                more = deps.get(name) if isinstance(deps, dict) else None
                for n in more if isinstance(more, list) else ():
                    if isinstance(n, str) and n not in names:
                        names[n] = None
                        todo.append(n)
    return list(names)


def _property(s: dict[str, Any], name: str) -> Any:
    props = s.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name]
    if s.get("patternProperties"):
        return True  # which pattern applies is not read here
    return s.get("additionalProperties", True)


def _needed_items(flat: list[dict[str, Any]]) -> list[list[Any]]:
    """The item schemas (each a conjunction) every array value of all of ``flat`` must
    have: its first ``minItems`` (the largest), each index's schemas from every part,
    and one item per ``contains``."""
    n = max((s["minItems"] for s in flat if isinstance(s.get("minItems"), int)
             and not isinstance(s.get("minItems"), bool)), default=0)
    shapes = []
    for s in flat:
        items = s.get("items")
        if isinstance(items, list):  # draft 4-2019: a tuple, then additionalItems
            shapes.append((items, s.get("additionalItems", True)))
        else:
            prefix = s.get("prefixItems")
            shapes.append((prefix if isinstance(prefix, list) else [], True if items is None else items))
    longest = max((len(prefix) for prefix, _ in shapes), default=0)
    out = [[prefix[i] if i < len(prefix) else rest for prefix, rest in shapes] for i in range(min(n, longest + 1))]
    out += [[s["contains"]] for s in flat if "contains" in s and s.get("minContains", 1) != 0]
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
