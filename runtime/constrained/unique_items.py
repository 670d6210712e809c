"""``uniqueItems`` over free scalars (strings, numbers), enforced beside the grammar.

Neither grammar engine can keep array items distinct: a regex or a context-free grammar
has no memory of the items already written. plait's regex translation enumerates the
orders of a finite domain (an ``enum`` of items); everything else with ``uniqueItems:
true`` (``tags: set[str]`` in a pydantic model: ``{"type": "array", "items": {"type":
"string"}, "uniqueItems": true}``) was refused. Here such a schema is compiled without
the keyword and the request's matcher is wrapped in :class:`UniqueGuard`, which follows
the output's JSON and takes out of each step's mask the tokens that would complete an
item equal to an earlier item of the same array.

Soundness: :func:`plan` walks every place a subschema applies (``properties``,
``items``, ``anyOf``, ``not``, ``$ref`` ...) and records the *instance path* of each
``uniqueItems: true`` it strips (keys, indices, ``*`` for any key or index, ``**`` for
any depth below a recursive ``$ref``). The guard keeps every array at such a path
distinct; on those outputs a stripped subschema is true exactly where the original is
(its uniqueness holds everywhere the keyword could be evaluated), so an output the
stripped grammar admits and the guard lets through is valid under the original schema.
The guard may over-restrict (an array at a recorded path that no ``uniqueItems`` covers
in the branch the output takes); it never admits a duplicate.

Items compared: strings (at the closing quote: a duplicate's closing quote is
refused, so the model writes on), numbers, ``true``/``false``/``null`` (at the byte
that ends them). JSON equality as ``jsonschema`` has it, on the values Python's ``json`` reads:
``1 == 1.0``, ``"a" == "\\u0061"``, ``true != 1``, ``1e400 == 2e400`` (both ``inf``). Items that are objects or arrays are not compared: a
``uniqueItems`` whose items may be containers stays refused (:func:`plan`). When every
token the grammar allows would write a duplicate (integers bounded to ``1..3`` with
all three written and ``minItems`` 4), the request ends with an error naming
``uniqueItems``, as any dead end of a constraint does.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np

ANY = "*"  # one path step: any key or any index
DEEP = "**"  # any number of steps (below a recursive $ref)
MAX_VISITS = 20_000  # (subschema, instance path) pairs plan() walks
MAX_SITES = 256
LOOKAHEAD_TOKENS = 256  # a mask with more tokens than this is not searched (a large domain)
LOOKAHEAD_NODES = 96  # masks one step's look-ahead computes at most
LOOKAHEAD_GIVE_UP = 4  # searches that cannot finish before a step stops looking (none found dead)
# tokens one step's look-ahead tries at most (each a copy of the output's tracker fed the
# token): a string of a large domain in small masks (format uuid: ~20 hex tokens a mask)
# kept every search going to LOOKAHEAD_NODES masks, ~24,000 tries a step, 155 ms a token
# against 21 ms without uniqueItems, slowing every request in the batch with it
LOOKAHEAD_TRIES = 512
SCALAR_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})
_IN_PLACE = ("allOf", "anyOf", "oneOf")
_ONE_SCHEMA = ("not", "if", "then", "else")
_WS = b" \t\n\r"
_VALUE_CHARS = b"0123456789+-.eEtrufalsn"
_NUMBER_CHARS = b"0123456789+-.eE"
_LITERAL_ENDS = frozenset(w[k:] for w in (b"true", b"false", b"null") for k in range(1, len(w) + 1))


def has_unique(schema: Any) -> bool:
    """Whether ``uniqueItems: true`` appears anywhere in ``schema`` (a cheap test before
    :func:`plan`)."""
    stack = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, dict):
            if s.get("uniqueItems") is True:
                return True
            stack.extend(v for k, v in s.items() if k not in ("enum", "const", "default", "examples"))
        elif isinstance(s, list):
            stack.extend(s)
    return False


def plan(schema: Any) -> tuple[Any, list[list[Any]]]:
    """(``schema`` without the ``uniqueItems: true`` the guard enforces, the instance
    path patterns of those arrays). ``ValueError`` naming the place when one cannot be
    guarded (items that may be objects or arrays, a reference to another document)."""
    from plait.runtime.constrained.json_schema import local_pointer, pointer_target, NOWHERE

    root = copy.deepcopy(schema)
    sites: list[list[Any]] = []
    seen_sites: set[tuple[Any, ...]] = set()
    stripped: set[int] = set()  # ids of the subschemas whose uniqueItems was taken out
    visits = 0

    def deref(s: Any, where: str) -> Any:
        for _ in range(64):
            if not (isinstance(s, dict) and isinstance(s.get("$ref"), str) and len(s) == 1):
                return s
            parts = local_pointer(root, s["$ref"])
            target = NOWHERE if parts is None else pointer_target(root, parts)
            if target is NOWHERE:
                raise ValueError(f"json_schema 'uniqueItems' at {where}: its items' $ref {s['$ref']!r} is not in this "
                                 "document")
            s = target
        return s

    def scalar_only(s: Any, where: str, depth: int = 0) -> bool:
        """Whether every value ``s`` admits is a scalar (no object, no array)."""
        s = deref(s, where)
        if depth > 16 or not isinstance(s, dict):
            return s is False
        if "const" in s:
            return not isinstance(s["const"], (dict, list))
        if "enum" in s and isinstance(s["enum"], list):
            return all(not isinstance(v, (dict, list)) for v in s["enum"])
        t = s.get("type")
        if isinstance(t, str) and t in SCALAR_TYPES:
            return True
        if isinstance(t, list) and t and all(isinstance(x, str) and x in SCALAR_TYPES for x in t):
            return True
        if isinstance(s.get("allOf"), list) and any(scalar_only(b, where, depth + 1) for b in s["allOf"]):
            return True
        for k in ("anyOf", "oneOf"):
            if isinstance(s.get(k), list) and s[k] and all(scalar_only(b, where, depth + 1) for b in s[k]):
                return True
        return False

    def add(path: list[Any]) -> None:
        key = tuple(path)
        if key not in seen_sites:
            seen_sites.add(key)
            sites.append(list(path))
            if len(sites) > MAX_SITES:
                raise ValueError(f"json_schema has more than {MAX_SITES} places with 'uniqueItems'; allowed: at most "
                                 f"{MAX_SITES}")

    def walk(s: Any, path: list[Any], refs: tuple[int, ...], where: str) -> None:
        nonlocal visits
        visits += 1
        if visits > MAX_VISITS:
            raise ValueError(f"json_schema is too large to place its 'uniqueItems' (more than {MAX_VISITS} "
                             "subschema visits)")
        if not isinstance(s, dict):
            return
        if isinstance(s.get("$ref"), str):
            parts = local_pointer(root, s["$ref"])
            target = NOWHERE if parts is None else pointer_target(root, parts)
            if target is not NOWHERE:
                if id(target) in refs:  # recursion: every depth below here
                    add([*path, DEEP])
                else:
                    walk(target, path, (*refs, id(target)), "#/" + "/".join(parts))
        if id(s) in stripped:  # a shared subschema ($ref) met again at another place
            add(path)
        elif s.get("uniqueItems") is True:
            parts_ok = True
            items = s.get("items")
            prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else None
            if isinstance(items, list):  # drafts 4-2019: items as a list, then additionalItems
                prefix, items = items, s.get("additionalItems", True)
            for p in prefix or []:
                parts_ok = parts_ok and scalar_only(p, where)
            if items is not False:
                parts_ok = parts_ok and items is not None and items is not True and scalar_only(items, where)
            if not parts_ok:
                raise ValueError(f"json_schema keyword 'uniqueItems' at {where} is not supported over items that may "
                                 "be objects or arrays (allowed: over strings, numbers, booleans, null)")
            room = _distinct_values(deref(items, where), prefix)
            least = s.get("minItems")
            if room is not None and isinstance(least, int) and not isinstance(least, bool) and least > room:
                raise ValueError(f"json_schema at {where}: 'uniqueItems' with {room} possible item values cannot reach "
                                 f"'minItems' {least}")
            del s["uniqueItems"]
            stripped.add(id(s))
            add(path)
        for k in ("properties",):
            if isinstance(s.get(k), dict):
                for name, sub in s[k].items():
                    walk(sub, [*path, name], refs, f"{where}/{k}/{name}")
        for k in ("patternProperties",):
            if isinstance(s.get(k), dict):
                for name, sub in s[k].items():
                    walk(sub, [*path, ANY], refs, f"{where}/{k}/{name}")
        for k in ("additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems", "contains"):
            if isinstance(s.get(k), dict):
                walk(s[k], [*path, ANY], refs, f"{where}/{k}")
        items = s.get("items")
        if isinstance(items, dict):  # every index (after prefixItems too: ANY covers them)
            walk(items, [*path, ANY], refs, f"{where}/items")
        elif isinstance(items, list):
            for i, sub in enumerate(items):
                walk(sub, [*path, i], refs, f"{where}/items/{i}")
        if isinstance(s.get("prefixItems"), list):
            for i, sub in enumerate(s["prefixItems"]):
                walk(sub, [*path, i], refs, f"{where}/prefixItems/{i}")
        for k in _IN_PLACE:
            if isinstance(s.get(k), list):
                for i, sub in enumerate(s[k]):
                    walk(sub, path, refs, f"{where}/{k}/{i}")
        for k in _ONE_SCHEMA:
            if isinstance(s.get(k), dict):
                walk(s[k], path, refs, f"{where}/{k}")
        for k in ("dependentSchemas", "dependencies"):
            if isinstance(s.get(k), dict):
                for name, sub in s[k].items():
                    if isinstance(sub, dict):
                        walk(sub, path, refs, f"{where}/{k}/{name}")

    walk(root, [], (id(root),), "#")
    return root, sites


def _distinct_values(items: Any, prefix: list[Any] | None) -> int | None:
    """How many distinct values an array's items may take when that is plainly finite
    (``items`` an ``enum``, a ``const``, boolean or null; no ``prefixItems``), else None."""
    if prefix or not isinstance(items, dict):
        return None
    if "const" in items:
        return 1
    if isinstance(items.get("enum"), list):
        from plait.runtime.constrained.json_schema import _json_unique

        return len(_json_unique(items["enum"]))
    t = items.get("type")
    if t == "boolean":
        return 2
    if t == "null":
        return 1
    return None


def sites_text(sites: list[list[Any]]) -> str:
    return json.dumps(sites, separators=(",", ":"))


def groups_text(groups: list[tuple[str, list[list[Any]]]]) -> str:
    """The wire form of guarded JSON values inside a larger output (a regex around
    them): ``{"after": [[text, sites], ...]}``, each JSON value written right after
    ``text`` (``""``: at the output's start) keeps its arrays at ``sites`` distinct."""
    return json.dumps({"after": [[a, s] for a, s in groups]}, separators=(",", ":"))


def load_groups(spec: Any) -> list[tuple[bytes, list[list[Any]]]]:
    """(anchor bytes, sites) from :attr:`Constraint.unique`'s JSON: a list of sites
    (one JSON value, the whole output) or :func:`groups_text`'s object."""
    if isinstance(spec, list):
        return [(b"", spec)]
    return [(a.encode("utf-8"), s) for a, s in spec["after"]]


def guarded_regex(schema: Any, whitespace: str | None = None) -> tuple[str, list[list[Any]]]:
    """(the regex of ``schema``, the sites of the ``uniqueItems`` kept beside it): plait's
    schema -> regex translation, and when it refuses a ``uniqueItems`` the guard can
    keep, the translation of the schema without them (:func:`plan`). ``ValueError`` as
    the translation's (or :func:`plan`'s, naming what cannot be kept)."""
    from plait.runtime.constrained.json_schema import schema_to_regex

    try:
        return schema_to_regex(schema, whitespace), []
    except ValueError as e:
        if "uniqueItems" not in str(e) or not has_unique(schema):
            raise
        first = e
    stripped, sites = plan(schema)
    try:
        return schema_to_regex(stripped, whitespace), sites
    except ValueError:
        raise first from None


def _closure(sites: list[list[Any]], states: set[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    """``states`` with every ``**`` skipped too (it matches no step as well)."""
    todo, out = list(states), set(states)
    while todo:
        i, pos = todo.pop()
        if pos < len(sites[i]) and sites[i][pos] == DEEP and (i, pos + 1) not in out:
            out.add((i, pos + 1))
            todo.append((i, pos + 1))
    return frozenset(out)


def _start(sites: list[list[Any]]) -> frozenset[tuple[int, int]]:
    """The pattern states at the root (nothing consumed)."""
    return _closure(sites, {(i, 0) for i in range(len(sites))})


def _step(sites: list[list[Any]], states: frozenset[tuple[int, int]], step: Any) -> frozenset[tuple[int, int]]:
    """The states after one path step (a key, or an index): the path patterns (keys,
    indices, ``*`` one step, ``**`` any number) matched as an automaton, a step at a time."""
    out = set()
    for i, pos in states:
        if pos >= len(sites[i]):
            continue
        head = sites[i][pos]
        if head == DEEP:
            out.add((i, pos))
        elif head == ANY or head == step and isinstance(head, int) == isinstance(step, int):
            out.add((i, pos + 1))
    return _closure(sites, out)


def _value_key(kind: str, raw: bytes) -> Any:
    """A scalar's identity under JSON equality, from its text; None if it does not parse
    (an unfinished or odd value: then nothing is compared)."""
    try:
        if kind == "s":
            return ("s", json.loads(b'"' + raw + b'"'))
        text = raw.decode("ascii")
        if text in ("true", "false"):
            return ("b", text == "true")
        if text == "null":
            return ("z",)
        value = json.loads(text)  # as jsonschema reads it: ints exact, floats as Python's (1e400 is inf)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return ("n", value)
    except (ValueError, UnicodeDecodeError):
        return None


class Duplicate(Exception):
    def __init__(self, path: list[Any], value: Any) -> None:
        super().__init__(path, value)
        self.path, self.value = path, value


class JsonTracker:
    """Where the output is in its JSON, byte by byte (the grammar keeps it well formed):
    the open containers with the key or index being written, and for each array at a
    guarded path the items it holds. ``feed`` raises :class:`Duplicate` at a byte that
    completes an item equal to an earlier one.

    Cheap to copy (the mask tries tokens on copies): frames below ``shared`` belong to
    copies too and are copied before they change; each frame keeps the states of the
    path patterns at its place, so opening one costs the same at any depth."""

    __slots__ = ("sites", "stack", "shared", "scalar", "raw", "escape", "is_key", "key", "expect_key")

    def __init__(self, sites: list[list[Any]]) -> None:
        self.sites = sites
        # frames: [kind "o"/"a", key-or-index, seen set or None (guarded arrays), item
        # started, the pattern states (site, position) before this frame's key]
        self.stack: list[list[Any]] = []
        self.shared = 0
        self.scalar: str | None = None  # "s" string, "v" number / literal, None between values
        self.raw = b""
        self.escape = False
        self.is_key = False
        self.key: Any = None
        self.expect_key = False

    def copy(self) -> JsonTracker:
        t = JsonTracker.__new__(JsonTracker)
        t.sites = self.sites
        t.stack = list(self.stack)
        t.shared = self.shared = len(self.stack)
        t.scalar, t.raw, t.escape, t.is_key, t.key, t.expect_key = (
            self.scalar, self.raw, self.escape, self.is_key, self.key, self.expect_key)
        return t

    def _top(self) -> list[Any]:
        """The innermost frame, this tracker's own (copied if a copy shares it)."""
        i = len(self.stack) - 1
        if i < self.shared:
            f = self.stack[i]
            self.stack[i] = [f[0], f[1], None if f[2] is None else set(f[2]), f[3], f[4]]
            self.shared = i
        return self.stack[i]

    def path(self) -> list[Any]:
        return [f[1] for f in self.stack]

    @property
    def guarded(self) -> bool:
        """Inside an array whose items are kept distinct (its items are being written)."""
        return bool(self.stack) and self.stack[-1][0] == "a" and self.stack[-1][2] is not None

    def _item_done(self, kind: str) -> None:
        frame = self.stack[-1] if self.stack else None
        if frame is None or frame[0] != "a" or frame[2] is None:
            return
        key = _value_key(kind, self.raw)
        if key is None:
            return
        if key in frame[2]:
            raise Duplicate(self.path(), key)
        self._top()[2].add(key)

    def _open(self, kind: str) -> None:
        if self.stack:
            top = self.stack[-1]
            states = _step(self.sites, top[4], top[1])
        else:
            states = _start(self.sites)
        accept = kind == "a" and any(pos == len(self.sites[i]) for i, pos in states)
        self.stack.append([kind, 0 if kind == "a" else None, set() if accept else None, False, states])
        self.expect_key = kind == "o"

    def feed(self, data: bytes) -> None:
        for b in data:
            c = bytes((b,))
            if self.scalar == "s":
                if self.escape:
                    self.escape = False
                    self.raw += c
                elif c == b"\\":
                    self.escape = True
                    self.raw += c
                elif c == b'"':
                    self.scalar = None
                    if self.is_key:
                        try:
                            self.key = json.loads(b'"' + self.raw + b'"')
                        except ValueError:
                            self.key = None
                        if self.stack:
                            self._top()[1] = self.key
                    else:
                        self._item_done("s")
                    self.raw = b""
                else:
                    self.raw += c
                continue
            if self.scalar == "v":
                if c in _VALUE_CHARS:
                    self.raw += c
                    continue
                self.scalar = None
                self._item_done("v")
                self.raw = b""
            if c in _WS or c == b":":
                continue
            if c == b'"':
                self.scalar, self.raw, self.escape = "s", b"", False
                self.is_key = bool(self.stack) and self.stack[-1][0] == "o" and self.expect_key
                if self.is_key:
                    self.expect_key = False
                continue
            if c == b",":
                if self.stack:
                    if self.stack[-1][0] == "a":
                        self._top()[1] += 1
                    else:
                        self.expect_key = True
                continue
            if c in b"]}":
                if self.stack:
                    self.stack.pop()
                    self.shared = min(self.shared, len(self.stack))
                continue
            if c == b"{":
                self._open("o")
                continue
            if c == b"[":
                self._open("a")
                continue
            self.scalar, self.raw = "v", c  # a number or a literal begins


MAX_OPEN_VALUES = 16  # JSON values one output tracks at once (anchors written again inside one)


class OutputTracker:
    """The JSON values of an output whose arrays are kept distinct, each followed by a
    :class:`JsonTracker`: the whole output (anchor ``b""``), or the values written right
    after an anchor (the text a regex writes before a tool call's arguments, a tag's
    begin). Every place an anchor ends starts a value (one that does not begin with ``{``
    or ``[`` is let go; one that closes is done), so a value is followed from its start
    even when the anchor's text also appears where no value follows (free text, a string
    inside another value): extra places can only over-restrict. At most
    :data:`MAX_OPEN_VALUES` open at once (the oldest let go: an output that writes an
    anchor and an opening bracket over and over costs no more than that)."""

    __slots__ = ("groups", "lasts", "width", "values", "tail")

    def __init__(self, groups: list[tuple[bytes, list[list[Any]]]]) -> None:
        self.groups = [(a, s) for a, s in groups if a]
        self.lasts = frozenset(a[-1] for a, _ in self.groups)
        self.width = max((len(a) for a, _ in self.groups), default=0)
        # [tracker, began]: began once its first non-blank byte was a bracket
        self.values: list[list[Any]] = [[JsonTracker(s), False] for a, s in groups if not a]
        self.tail = b""  # the last ``width`` bytes (where an anchor ends)

    def copy(self) -> OutputTracker:
        t = OutputTracker.__new__(OutputTracker)
        t.groups, t.lasts, t.width, t.tail = self.groups, self.lasts, self.width, self.tail
        t.values = [[v[0].copy(), v[1]] for v in self.values]
        return t

    @property
    def trackers(self) -> list[JsonTracker]:
        return [v[0] for v in self.values]

    @property
    def inside(self) -> bool:
        """Inside an array kept distinct (in any value followed)."""
        return any(f[2] is not None for v in self.values for f in v[0].stack)

    def feed(self, data: bytes) -> None:
        if not self.groups:  # the whole output is one value
            for v in self.values:
                v[0].feed(data)
            return
        for b in data:
            c = bytes((b,))
            live = []
            for v in self.values:
                if not v[1]:
                    if b in _WS:
                        live.append(v)
                        continue
                    if b not in b"{[":
                        continue  # not a container: nothing in it to keep distinct
                    v[1] = True
                v[0].feed(c)
                if v[0].stack or v[0].scalar is not None:
                    live.append(v)
            self.values = live
            self.tail = (self.tail + c)[-self.width:]
            if b in self.lasts:
                for a, sites in self.groups:
                    if self.tail.endswith(a):
                        self.values.append([JsonTracker(sites), False])
                del self.values[:-MAX_OPEN_VALUES]


class _Pools:
    """Per vocabulary: which tokens can end a scalar, and the quote-holding tokens by
    the bytes before their first quote (a string item's candidates, looked up)."""

    def __init__(self, token_bytes: list[bytes | None], words: int) -> None:
        n = 32 * words
        self.opens = np.zeros(n, dtype=np.bool_)  # '[' and ',': may open an array and write two items
        self.by_head: dict[bytes, list[int]] = {}  # bytes before the first quote (no backslash) -> tokens
        self.hard: list[int] = []  # a backslash before the first quote
        self.value = np.zeros(n, dtype=np.bool_)  # number / literal characters only (after whitespace)
        self.extends = np.zeros(n, dtype=np.bool_)  # begins with a character that continues a number
        self.closes = np.zeros(n, dtype=np.bool_)  # begins with a quote
        self.by_bytes: dict[bytes, list[int]] = {}  # quote-free tokens by their bytes
        # may complete a whole item that can be compared, from between items: two quotes,
        # a digit, or a literal (any other scalar text does not parse, so never repeats)
        self.completes = np.zeros(n, dtype=np.bool_)
        # tokens that end a number or literal being written, by the value characters
        # before the first byte that ends it (the rest of that item)
        self.by_value_head: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes[:n]):
            if not b:
                continue
            if b"[" in b and b"," in b:
                self.opens[i] = True
            v = b.lstrip(_WS)
            if v and all(x in _VALUE_CHARS for x in v):
                self.value[i] = True
            if b[0] in b"0123456789.eE+-":
                self.extends[i] = True
            if b[:1] == b'"':
                self.closes[i] = True
            if b.count(b'"') >= 2 or any(48 <= x <= 57 for x in b) or b"true" in b or b"false" in b \
                    or b"null" in b:
                self.completes[i] = True
            k = next((j for j, x in enumerate(b) if x not in _VALUE_CHARS), None)
            if k is not None and (all(x in _NUMBER_CHARS for x in b[:k]) or b[:k] in _LITERAL_ENDS):
                self.by_value_head.setdefault(b[:k], []).append(i)
            q = b.find(b'"')
            if q < 0:
                self.by_bytes.setdefault(b, []).append(i)
            if q >= 0:
                if b"\\" in b[:q]:
                    self.hard.append(i)
                else:
                    self.by_head.setdefault(b[:q], []).append(i)


_POOLS: dict[int, tuple[list[bytes | None], _Pools]] = {}


def pools_for(token_bytes: list[bytes | None], words: int) -> _Pools:
    hit = _POOLS.get(id(token_bytes))
    if hit is None or hit[0] is not token_bytes:
        hit = (token_bytes, _Pools(token_bytes, words))
        if len(_POOLS) > 8:
            _POOLS.clear()
        _POOLS[id(token_bytes)] = hit
    return hit[1]


class UniqueGuard:
    """A matcher (:class:`plait.runtime.constrained.backend.Matcher`) that is ``inner``
    with the tokens completing a duplicate item taken out of every mask (see the module
    docstring). No jump-forward inside a guarded array (the forced text is not checked
    before it is written); speculative drafts get guarded masks."""

    def __init__(self, inner: Any, spec: Any, token_bytes: list[bytes | None]) -> None:
        """``spec``: :attr:`Constraint.unique` read as JSON (:func:`load_groups`)."""
        self.inner = inner
        self.token_bytes = token_bytes
        self.tracker = OutputTracker(load_groups(spec))
        self._skip = 0  # healed prompt bytes the first token writes again (not constrained text)
        self._violation: str | None = None
        self._own_reject: int | None = None
        self._before: OutputTracker | None = None  # the tracker before the newest token (jump-forward)
        self._dead: str | None = None  # why the last mask was emptied

    # -- delegated --------------------------------------------------------------------------
    kind = property(lambda self: self.inner.kind)
    started = property(lambda self: self.inner.started)
    healed_text = property(lambda self: self.inner.healed_text)
    ready = property(lambda self: self.inner.ready)
    error = property(lambda self: self.inner.error)
    is_final = property(lambda self: self.inner.is_final)
    terminated = property(lambda self: self.inner.terminated)
    stuck = property(lambda self: getattr(self.inner, "stuck", False))

    @property
    def rejected(self) -> int | None:
        return self._own_reject if self._own_reject is not None else self.inner.rejected

    @property
    def parser_error(self) -> str | None:
        return self._violation or self._dead or getattr(self.inner, "parser_error", None)

    def __getattr__(self, name: str) -> Any:  # counters and the like (num_advanced, g, ...)
        return getattr(self.inner, name)

    # -- life -------------------------------------------------------------------------------
    def start(self, prompt_ids: list[int]) -> int:
        dropped = self.inner.start(prompt_ids)
        self._skip = len(self.inner.healed_text.encode("utf-8")) if dropped else 0
        return dropped

    def _note(self, e: Duplicate) -> None:
        where = _where(e.path)
        self._violation = (f"'uniqueItems' at {where}: every token the schema allows next would repeat an earlier item "
                           f"({_show(e.value)})")

    def jump_start(self, budget: int) -> list[int]:
        tokens = self.inner.jump_start(budget)
        try:
            for t in tokens:
                self.tracker.feed(self.token_bytes[t] or b"")
        except Duplicate as e:  # forced text repeating an item: the next token is refused
            self._note(e)
        return tokens

    def advance(self, token: int) -> bool:
        if self._violation is not None:
            self._own_reject = token
            return False
        trial = self.tracker.copy()
        data = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        data = data or b""
        cut = min(self._skip, len(data))
        try:
            trial.feed(data[cut:])
        except Duplicate as e:
            self._note(e)
            self._own_reject = token
            return False
        if not self.inner.advance(token):
            return False
        self._before, self.tracker = (None if cut else self.tracker), trial
        self._skip -= cut
        return True

    def jump_forward(self, last: int, budget: int) -> list[int] | None:
        """The inner matcher's jump, but never from inside a guarded array (its forced
        text would be written unchecked); forced text that repeats an item (a ``const``
        item written twice) ends the request at its next token."""
        if self._before is None or self._before.inside:
            return None
        tokens = self.inner.jump_forward(last, budget)
        if tokens:
            t = self._before.copy()
            try:
                for tok in tokens:
                    t.feed(self.token_bytes[tok] or b"")
            except Duplicate as e:
                self._note(e)
            self.tracker = t
        return tokens

    # -- masks -------------------------------------------------------------------------------
    def allowed(self, eos_ok: bool) -> np.ndarray:
        self._dead = None
        return self._veto(self.inner.allowed(eos_ok), self.tracker)

    def draft_masks(self, drafts: list[int], eos_ok: bool) -> list[np.ndarray]:
        inner = self.inner.draft_masks(drafts, eos_ok)
        if self._skip:
            return [self._veto(inner[0], self.tracker)]
        t = self.tracker.copy()
        out = [self._veto(inner[0], t)]
        for i, d in enumerate(drafts[: len(inner) - 1]):
            if not _bit(out[-1], d):
                break
            try:
                t.feed(self.token_bytes[d] or b"")
            except Duplicate:
                break
            out.append(self._veto(inner[i + 1], t))
        return out

    def _veto(self, mask: np.ndarray, tracker: OutputTracker) -> np.ndarray:
        """``mask`` without the tokens that would complete a duplicate item from
        ``tracker``'s place."""
        if self._violation is not None:
            return np.zeros_like(mask)
        if self._skip:  # healing: the boundary token is checked when it is taken
            return mask
        pools = pools_for(self.token_bytes, mask.shape[0])
        ahead = tracker is self.tracker
        ahead_only = False
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little").view(np.bool_)
        n = min(len(bits), len(pools.opens))
        blocked: set[int] = set()
        # tokens to try on a copy: those that may open an array and write two items (in any
        # value, or a value an anchor in the token begins), and per value the tokens that
        # may complete an item that can repeat one (few: the mask may be all free text)
        trial: set[int] = set(np.flatnonzero(bits[:n] & pools.opens[:n]).tolist())
        ends = False
        for sub in tracker.trackers:
            if sub.scalar == "s" and not sub.escape and sub.guarded and not sub.is_key and b"\\" not in sub.raw:
                # a string item: a token completes it at its first quote; the item repeats an
                # earlier one when the bytes before that quote are the rest of its text
                raw = sub.raw
                for key in sub.stack[-1][2]:
                    if key[0] != "s":
                        continue
                    text = key[1].encode("utf-8", "surrogatepass")
                    if text.startswith(raw):
                        blocked.update(pools.by_head.get(text[len(raw):], ()))
                        if ahead and len(text) > len(raw):  # a token that writes the rest of an earlier item
                            blocked.update(t for t in pools.by_bytes.get(text[len(raw):], ())
                                           if _bit(mask, t) and self._must_close(t, pools))
                trial.update(t for t in pools.hard if _bit(mask, t))
            elif any(f[2] is not None for f in sub.stack):
                ends = True
                if sub.scalar == "v" and sub.guarded:  # the number or literal ends at the token's first other byte
                    seen = sub.stack[-1][2]
                    for head, ids in pools.by_value_head.items():
                        if _value_key("v", sub.raw + head) in seen:
                            blocked.update(ids)
            if ahead and sub.guarded and sub.scalar != "s":
                blocked |= self._no_way_out(mask, sub, pools)
        if ends:
            trial.update(np.flatnonzero(bits[:n] & pools.completes[:n]).tolist())
        for t in trial - blocked:
            copy = tracker.copy()
            try:
                copy.feed(self.token_bytes[t] or b"")
            except Duplicate:
                blocked.add(t)
        if ahead:
            doomed, reach = self._doomed(bits, tracker, blocked)
            ahead_only = bool(doomed - blocked)  # some token is out only for what it leads to
            blocked |= doomed
        if not blocked:
            return mask
        # (vectorised: inside a number whose text equals an item, every token that ends
        # it is blocked, thousands of ids: a loop over them took 14 ms of a 16 ms mask)
        idx = np.fromiter(blocked, dtype=np.int64, count=len(blocked))
        idx = idx[(idx >= 0) & (idx < len(bits))]
        idx = idx[bits[idx]]
        if idx.size == 0:
            return mask
        keep = bits.copy()
        keep[idx] = False
        out = np.packbits(keep, bitorder="little").view(np.uint32)
        if ahead and not out.any() and mask.view(np.uint32).any():
            sub = next((x for x in tracker.trackers if x.guarded), None)
            path = [] if sub is None else sub.path()
            if sub is not None and (ahead_only or sub.scalar is None):
                # the item that runs out: after those held (and, found ahead, after the one
                # the next token could still complete)
                path[-1] = max(reach, len(sub.stack[-1][2])) if ahead_only else len(sub.stack[-1][2])
            where = _where(path)
            self._dead = f"'uniqueItems' at {where}: every token the schema allows next would repeat an earlier item"
        return out.view(np.int32)

    def _doomed(self, bits: np.ndarray, tracker: OutputTracker, blocked: set[int]) -> tuple[set[int], int]:
        """Tokens after which every way on repeats an earlier item: a token that leaves
        the output inside a guarded array without completing a new item (``"a`` with
        ``"a"``, ``"aa"`` and ``"ab"`` written and items ``^[ab]{1,2}$``) is kept only
        if the grammar lets some continuation complete a new item or close the array
        (:meth:`_dead_from`). Searched only where the choices are few (at most
        :data:`LOOKAHEAD_TOKENS` tokens in a mask: a small domain, the only kind whose
        values can run out) and within :data:`LOOKAHEAD_NODES` masks and
        :data:`LOOKAHEAD_TRIES` tokens tried a step; a search
        that does not finish keeps the token (the one-token guard still holds), and
        after :data:`LOOKAHEAD_GIVE_UP` such searches (with none found dead) the step
        stops looking: a free string's first characters lead to masks of thousands of
        tokens, and each search would cost a mask to learn it (SmolLM2, free-string
        tags: 36.8 ms p99 a mask against 0.4 ms without the look-ahead). Also returns the
        index of the furthest item the search found repeating (where the values run out)."""
        if not any(f[2] for sub in tracker.trackers for f in sub.stack if f[2] is not None):
            return set(), 0
        ids = np.flatnonzero(bits).tolist()
        if len(ids) > LOOKAHEAD_TOKENS:
            return set(), 0
        base = _progress_mark(tracker)
        memo: dict[tuple[tuple[int, int], bytes], bool] = {}
        budget = [LOOKAHEAD_NODES, 0, LOOKAHEAD_TRIES]  # masks left; furthest item found repeating; tries left
        out = set()
        unknown = 0  # searches that met a large mask: past a few, the domain is large
        for t in ids:
            if unknown >= LOOKAHEAD_GIVE_UP and not out or budget[2] <= 0:
                break
            if t in blocked:
                continue
            budget[2] -= 1
            data = self.token_bytes[t] or b"" if 0 <= t < len(self.token_bytes) else b""
            after = tracker.copy()
            try:
                after.feed(data)
            except Duplicate:
                out.add(t)
                continue
            if not _pending(base, after):
                if not _goes_on(after, data):
                    continue
                # it completes a new item and goes on into the next one (`",` after the
                # last value left, `","`): that one must still have a way on
                dead = self._dead_from(after, [t], data, _progress_mark(after), memo, budget)
            else:
                dead = self._dead_from(after, [t], data, base, memo, budget)
            if dead is True:
                out.add(t)
            elif dead is None:
                unknown += 1
        return out, budget[1]

    def _dead_from(self, tracker: OutputTracker, path: list[int], written: bytes, base: tuple[int, int],
                   memo: dict[tuple[tuple[int, int], bytes], bool], budget: list[int]) -> bool | None:
        """Whether every continuation the grammar allows after ``path`` (the tokens
        tried, ``written`` their bytes; the inner matcher does not move) repeats an item
        before one completes a new item or an array closes: True, False, or None when
        the search would pass its limits. States are the bytes written (two paths with
        the same bytes are one state for the grammar and the tracker)."""
        key = (base, written)  # the same bytes from another base are another question
        if key in memo:
            return memo[key]
        if budget[0] <= 0 or len(path) > 32:
            return None
        budget[0] -= 1
        masks = self.inner.draft_masks(path, False)
        if len(masks) <= len(path):  # the grammar refuses the path: no way on through it
            memo[key] = True
            return True
        bits = np.unpackbits(masks[-1].view(np.uint8), bitorder="little").view(np.bool_)
        ids = np.flatnonzero(bits).tolist()
        if len(ids) > LOOKAHEAD_TOKENS or len(ids) > budget[2]:
            return None
        budget[2] -= len(ids)
        todo = []
        for u in ids:
            data = self.token_bytes[u] or b"" if 0 <= u < len(self.token_bytes) else b""
            after = tracker.copy()
            try:
                after.feed(data)
            except Duplicate:
                budget[1] = max(budget[1], _held(after))
                continue
            if not _pending(base, after):
                if not _goes_on(after, data):
                    memo[key] = False
                    return False
                todo.append((u, data, after, _progress_mark(after)))  # a new item, then the next
                continue
            todo.append((u, data, after, base))
        result: bool | None = True
        for u, data, after, at in todo:
            r = self._dead_from(after, [*path, u], written + data, at, memo, budget)
            if r is False:
                memo[key] = False
                return False
            if r is None:
                result = None
        if result is True:
            memo[key] = True
        return result

    def _must_close(self, t: int, pools: _Pools) -> bool:
        """After ``t``, whether the grammar allows only tokens that close the string (one
        step of look-ahead; the inner matcher stays where it is)."""
        after = self.inner.draft_masks([t], False)
        if len(after) < 2:
            return False
        nxt = np.unpackbits(after[1].view(np.uint8), bitorder="little").view(np.bool_)
        m = min(len(nxt), len(pools.closes))
        return bool(nxt[:m].any()) and not (nxt[:m] & ~pools.closes[:m]).any()

    def _no_way_out(self, mask: np.ndarray, tracker: JsonTracker, pools: _Pools) -> set[int]:
        """Tokens that make the number or literal being written equal to an earlier item
        when the grammar then allows nothing that continues it (``7`` with items up to 9:
        its end would be refused, so the request would be stuck): one step of look-ahead
        through the inner matcher, which stays where it is."""
        seen = tracker.stack[-1][2]
        if not any(k[0] != "s" for k in seen):
            return set()
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little").view(np.bool_)
        n = min(len(bits), len(pools.value))
        out = set()
        for t in np.flatnonzero(bits[:n] & pools.value[:n]).tolist():
            data = self.token_bytes[t] or b""
            text = tracker.raw + data if tracker.scalar == "v" else data.lstrip(_WS)
            literal = next((w for w in (b"true", b"false", b"null") if w.startswith(text)), None)
            if literal is not None and len(text) < len(literal):  # only an earlier item can follow
                if _value_key("v", literal) in seen:
                    out.add(t)
                continue
            if _value_key("v", text) not in seen:
                continue
            after = self.inner.draft_masks([t], False)
            if len(after) < 2:
                continue
            nxt = np.unpackbits(after[1].view(np.uint8), bitorder="little").view(np.bool_)
            m = min(len(nxt), len(pools.extends))
            if not (nxt[:m] & pools.extends[:m]).any():
                out.add(t)
        return out


def _progress_mark(tracker: OutputTracker) -> tuple[int, int]:
    """(items held by the guarded arrays open, how many are open) of ``tracker``."""
    frames = [f[2] for sub in tracker.trackers for f in sub.stack if f[2] is not None]
    return sum(len(seen) for seen in frames), len(frames)


def _pending(base: tuple[int, int], tracker: OutputTracker) -> bool:
    """Whether ``tracker`` is still inside the guarded arrays of ``base``
    (:func:`_progress_mark`) with no new item completed and none closed (any change
    counts as a way on: the search only ever keeps a token it cannot rule out)."""
    return base[1] > 0 and _progress_mark(tracker) == base


def _goes_on(tracker: OutputTracker, data: bytes) -> bool:
    """After ``data`` completed an item (or closed an array), whether it also went on into
    the next item of a guarded array: it ends with the comma after the item, or inside the
    next item (``",`` or ``","`` after a string item, ``,`` after a number)."""
    if _progress_mark(tracker)[1] == 0:
        return False
    if any(sub.scalar is not None and sub.guarded for sub in tracker.trackers):
        return True
    return data.rstrip(_WS).endswith(b",") and any(sub.guarded for sub in tracker.trackers)


def _held(tracker: OutputTracker) -> int:
    """Items the innermost guarded array being written holds (its next item's index)."""
    return next((len(sub.stack[-1][2]) for sub in tracker.trackers if sub.guarded), 0)


def _where(path: list[Any]) -> str:
    """An instance path as a JSON pointer, its middle left out past 16 steps."""
    steps = [str(p)[:40] for p in path]
    if len(steps) > 16:
        steps = [*steps[:8], f"...({len(steps) - 16} more)", *steps[-8:]]
    return "#" + "".join(f"/{p}" for p in steps)


def _bit(mask: np.ndarray, t: int) -> bool:
    w = mask.view(np.uint32)
    return 0 <= t < 32 * len(w) and bool(w[t >> 5] >> np.uint32(t & 31) & np.uint32(1))


def _show(key: Any) -> str:
    if key[0] == "s":
        return json.dumps(key[1])[:60]
    if key[0] == "b":
        return "true" if key[1] else "false"
    if key[0] == "z":
        return "null"
    return str(key[1])[:60]
