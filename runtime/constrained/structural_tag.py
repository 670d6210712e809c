"""SGLang's / vLLM's ``structural_tag`` response format as a regex.

Two shapes. The newer one, ``{"type": "structural_tag", "format": {...}}`` (xgrammar's
tree of elements), is translated element by element (:func:`format_regex`, at the end
of this module). The legacy one:

``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...],
"triggers": [...]}``: the output is free text, except that where a trigger appears,
the text from it on must be one of the structures whose ``begin`` starts with that
trigger: ``begin``, a JSON value of ``schema``, ``end``; free text may follow, with
more structures. Written as one regex: free segments that hold no trigger (the
automaton that finds the triggers, turned into a regex by state elimination), each but
the last ending at its first trigger, which the rest of a structure then follows.
Torch-free; the schema regexes are plait's JSON Schema translation.
"""

from __future__ import annotations

import json
import re
from typing import Any

from plait.runtime.constrained.regexes import eliminate
from plait.runtime.constrained.regexes import union as _union

MAX_TRIGGERS = 8
MAX_TRIGGER_CHARS = 64  # each trigger's length
MAX_STRUCTURES = 64
MAX_FREE_REGEX_CHARS = 20_000  # the free-text regex (state elimination may grow it)


def _lit(s: str) -> str:
    return "".join(_char(c) for c in s)


def _char(c: str) -> str:
    return re.escape(c) if c not in "\n\t" else {"\n": r"\n", "\t": r"\t"}[c]


def _star(r: str) -> str:
    if r == "":
        return ""
    return f"(?:{r})*"


def free_text_regexes(triggers: list[str]) -> tuple[str, dict[str, str]]:
    """(text holding no trigger, {trigger: text whose first trigger is this one, at its
    end}). The automaton's states are the longest suffix of the text read that is a
    proper prefix of some trigger; a character that completes a trigger leaves it."""
    prefixes = sorted({t[:i] for t in triggers for i in range(len(t))}, key=lambda s: (len(s), s))
    index = {p: i for i, p in enumerate(prefixes)}
    chars = sorted({c for t in triggers for c in t})
    other = "[^" + "".join(_char(c) if c not in "]^-\\" else "\\" + c for c in chars) + "]"
    # GNFA: states 0..n-1 (prefixes), S = n (start), F = n + 1 (the free text's end),
    # H_k = n + 2 + k (trigger k seen): edges hold regex alternatives
    n = len(prefixes)
    start, free_end = n, n + 1
    edges: dict[tuple[int, int], list[str]] = {}

    def add(a: int, b: int, r: str) -> None:
        edges.setdefault((a, b), []).append(r)

    add(start, index[""], "")
    for p, i in index.items():
        add(i, free_end, "")
        for c in chars:
            s = p + c
            hit = [k for k, t in enumerate(triggers) if s.endswith(t)]
            if hit:
                add(i, n + 2 + hit[0], _char(c))
                continue
            nxt = next(s[j:] for j in range(len(s) + 1) if s[j:] in index)
            add(i, index[nxt], _char(c))
        add(i, index[""], other)
    def too_large() -> ValueError:
        return ValueError(f"the triggers' free-text regex grows past {MAX_FREE_REGEX_CHARS} characters; "
                          f"allowed: shorter or fewer triggers")

    # the prefix states, the longest first
    edges = eliminate(edges, list(range(n - 1, -1, -1)), max_chars=MAX_FREE_REGEX_CHARS, too_large=too_large,
                      fixed_order=True)
    free = _union(edges.get((start, free_end), [""]))
    firsts = {t: _union(edges[(start, n + 2 + k)]) for k, t in enumerate(triggers) if (start, n + 2 + k) in edges}
    return free, firsts


Groups = list[tuple[str, list[list[Any]]]]  # (text before a JSON value, its uniqueItems sites)


def structural_tag_regex(fmt: dict[str, Any], param: str = "response_format") -> str:
    """The regex of a ``structural_tag`` whose schemas need nothing kept beside the
    regex (:func:`structural_tag_constraint` otherwise); ``ValueError`` naming the part
    at fault."""
    rx, groups = structural_tag_constraint(fmt, param)
    if groups:
        raise ValueError(f"{param}: a schema's 'uniqueItems' is kept beside the regex, which this caller cannot do")
    return rx


def structural_tag_constraint(fmt: dict[str, Any], param: str = "response_format") -> tuple[str, Groups]:
    """(the regex of a ``structural_tag`` response format, legacy (``structures`` and
    ``triggers``) or the newer ``format`` tree (:func:`format_regex`); the JSON values
    whose ``uniqueItems`` the matcher keeps: (the text right before such a value, the
    sites of :func:`plait.runtime.constrained.unique_items.plan`)). ``ValueError``
    naming the part at fault."""
    from plait.runtime.constrained.holes import regex_or_hole

    if "format" in fmt:  # the newer shape (xgrammar's element tree)
        return format_regex(fmt, param)
    structures, triggers = fmt.get("structures"), fmt.get("triggers")
    if not isinstance(structures, list) or not structures or len(structures) > MAX_STRUCTURES:
        raise ValueError(f"{param}.structures={json.dumps(structures)[:80]} is invalid; allowed: a list of 1 to "
                         f"{MAX_STRUCTURES} {{\"begin\", \"schema\", \"end\"}} objects")
    if (not isinstance(triggers, list) or not triggers or len(triggers) > MAX_TRIGGERS
            or not all(isinstance(t, str) and 0 < len(t) <= MAX_TRIGGER_CHARS for t in triggers)):
        raise ValueError(f"{param}.triggers={json.dumps(triggers)[:80]} is invalid; allowed: a list of 1 to "
                         f"{MAX_TRIGGERS} non-empty strings of at most {MAX_TRIGGER_CHARS} characters")
    triggers = list(dict.fromkeys(triggers))
    for t in triggers:
        for u in triggers:
            if t != u and u.endswith(t):
                raise ValueError(f"{param}.triggers: {t!r} ends {u!r}, so where one was written is ambiguous; "
                                 f"allowed: triggers none of which ends another")
    rests: dict[str, list[str]] = {t: [] for t in triggers}
    groups: Groups = []
    for i, s in enumerate(structures):
        where = f"{param}.structures[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) \
                or "schema" not in s or set(s) - {"begin", "schema", "end"}:
            raise ValueError(f"{where} is invalid; allowed: {{\"begin\": str, \"schema\": {{...}}, \"end\": str}}")
        trig = [t for t in triggers if s["begin"].startswith(t)]
        if not trig:
            raise ValueError(f"{where}.begin={s['begin']!r} starts with none of the triggers; allowed: a begin that "
                             f"starts with one of {triggers}")
        t = max(trig, key=len)
        body, sites = regex_or_hole(s["schema"])  # (or a JSON hole: plait.runtime.constrained.holes)
        if sites:
            if not s["begin"]:
                raise ValueError(f"{where}.schema: its 'uniqueItems' are kept after the structure's begin, which is "
                                 f"empty; allowed: a non-empty begin")
            groups.append((s["begin"], sites))
        rests[t].append(_lit(s["begin"][len(t):]) + f"(?:{body})" + _lit(s["end"]))
    free, firsts = free_text_regexes(triggers)
    segments = [firsts[t] + _union(r) for t, r in rests.items() if r and t in firsts]
    # a trigger no structure begins with may not be written (its text would be free)
    return (_star(_union(segments)) if segments else "") + free, groups


# ---------------------------------------------------------------------------------------
# The newer shape (xgrammar's, which SGLang and vLLM pass through):
# ``{"type": "structural_tag", "format": {...}}``, a tree of format elements.
# Each element becomes a regex, so the whole tree is one regex again. Inside a ``tag``
# the unlimited elements (``any_text``, ``triggered_tags``, ``dispatch``) may not write
# the tag's ``end``; the one the tag's content ends with stops at its first ``end``.

MAX_FORMAT_DEPTH = 16  # elements nested inside each other (a tag's content, a sequence's elements...)
MAX_FORMAT_ELEMENTS = 256  # elements in the whole tree
MAX_FORMAT_LIST = 64  # elements of one sequence / or, tags of one triggered_tags / tags_with_separator
MAX_FREE_WORDS = 16  # strings one stretch of free text may not hold (triggers, excludes, ends)
MAX_WORD_CHARS = 64  # each of them (a trigger, an exclude, a tag's end as it ends free text)
MAX_REPEAT_COUNT = 100  # repeat's min and max
MAX_ANY_TEXT_CHARS = 4096  # any_text's max_chars

SUPPORTED_FORMATS = ("const_string", "json_schema", "regex", "any_text", "sequence", "or", "optional", "plus",
                     "star", "repeat", "tag", "triggered_tags", "tags_with_separator", "dispatch")
_TOKEN_FORMATS = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch")
_REFUSED = {
    "grammar": "an EBNF grammar, which is not a regular language in general",
    "qwen_xml_parameter": "a JSON Schema in Qwen's XML parameter style",
    "qwen_xml": "a JSON Schema in Qwen's XML parameter style",
    **{t: "a token-level element (it matches token ids, not text)" for t in _TOKEN_FORMATS},
}
_UNLIMITED = ("any_text", "triggered_tags", "dispatch")
# each element's children: fields holding one element, a list of them, or dispatch's [pattern, element] rules
_CHILD = {"tag": "content", "optional": "content", "plus": "content", "star": "content", "repeat": "content"}
_CHILDREN = {"sequence": "elements", "or": "elements", "triggered_tags": "tags", "tags_with_separator": "tags"}
_FIELDS = {
    "const_string": {"value"}, "json_schema": {"json_schema", "style", "any_order"}, "regex": {"pattern"},
    "any_text": {"excludes", "max_chars", "max_tokens"}, "sequence": {"elements"}, "or": {"elements"},
    "optional": {"content"}, "plus": {"content"}, "star": {"content"}, "repeat": {"min", "max", "content"},
    "tag": {"begin", "content", "end"},
    "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first", "excludes"},
    "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
    "dispatch": {"rules", "loop", "excludes"},
}
MAX_EXPANDED_CHARS = 1 << 20  # a repeat's regex with its counted repetitions written out (the automaton's size)
ANY_CHAR = r"[\s\S]"
_COUNT = re.compile(r"\{([0-9]+)(?:,([0-9]*))?\}")


def _expanded(rx: str) -> int:
    """The length of ``rx`` with each counted repetition ``{n,m}`` written out ``max(n, m)``
    times: a bound on its automaton's size (the text alone hides ``(?:x{100}){100}``).
    One pass; ``rx`` is in the engine's dialect (escapes, classes, groups)."""
    stack: list[int] = [0]
    last = 0  # the size of the last atom (what a count applies to)
    i, n = 0, len(rx)
    while i < n:
        c = rx[i]
        if c == "\\":
            j = i + 2
            if i + 1 < n and rx[i + 1] in "xuUpP" and j < n and rx[j] == "{":
                j = rx.find("}", j) + 1 or n
            last = 1
            i = j
        elif c == "[":
            j = i + 1
            if j < n and rx[j] == "^":
                j += 1
            if j < n and rx[j] == "]":
                j += 1
            while j < n and rx[j] != "]":
                j += 2 if rx[j] == "\\" else 1
            last, i = 1, j + 1
        elif c == "(":
            stack.append(0)
            last, i = 0, i + 1
            continue
        elif c == ")":
            last = stack.pop() if len(stack) > 1 else 0
            i += 1
        elif c == "{" and (m := _COUNT.match(rx, i)):
            times = max(int(m.group(1)), int(m.group(2) or 0))
            stack[-1] += last * (times - 1)
            last, i = 0, m.end()
            continue
        else:
            last, i = 1, i + 1
        stack[-1] += last
    return sum(stack)


def _short(v: Any, n: int = 80) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        s = repr(v)
    return s if len(s) <= n else s[:n] + "..."


def _check_tree(fmt: Any, where: str) -> None:
    """Depth and size of the element tree, walked without recursion, before any work."""
    stack: list[tuple[Any, int, str]] = [(fmt, 1, where)]
    count = 0
    while stack:
        node, depth, path = stack.pop()
        count += 1
        if count > MAX_FORMAT_ELEMENTS:
            raise ValueError(f"{where} has more than {MAX_FORMAT_ELEMENTS} elements; allowed: at most "
                             f"{MAX_FORMAT_ELEMENTS} (MAX_FORMAT_ELEMENTS)")
        if depth > MAX_FORMAT_DEPTH:
            raise ValueError(f"{path} is nested {depth} elements deep; allowed: at most {MAX_FORMAT_DEPTH} "
                             f"(MAX_FORMAT_DEPTH)")
        if not isinstance(node, dict):
            continue  # reported, with its path, by the translation
        kind = node.get("type", "tag" if "begin" in node else None)
        if not isinstance(kind, str):
            continue
        if kind in _CHILD and isinstance(node.get(_CHILD[kind]), dict):
            stack.append((node[_CHILD[kind]], depth + 1, f"{path}.{_CHILD[kind]}"))
        if kind in _CHILDREN and isinstance(node.get(_CHILDREN[kind]), list):
            items = node[_CHILDREN[kind]]
            if len(items) > MAX_FORMAT_LIST:
                raise ValueError(f"{path}.{_CHILDREN[kind]} has {len(items)} elements; allowed: at most "
                                 f"{MAX_FORMAT_LIST} (MAX_FORMAT_LIST)")
            stack.extend((c, depth + 1, f"{path}.{_CHILDREN[kind]}[{i}]") for i, c in enumerate(items))
        if kind == "dispatch" and isinstance(node.get("rules"), list):
            if len(node["rules"]) > MAX_TRIGGERS:
                raise ValueError(f"{path}.rules has {len(node['rules'])} rules; allowed: at most {MAX_TRIGGERS}")
            stack.extend((r[1], depth + 1, f"{path}.rules[{i}][1]") for i, r in enumerate(node["rules"])
                         if isinstance(r, list) and len(r) == 2)


class _Translator:
    """The regex of a format tree. ``excl``: the end strings of the nearest enclosing
    tag, which its unlimited elements may not write."""

    def __init__(self) -> None:
        # the JSON values whose uniqueItems the matcher keeps (the translation's second result)
        self.groups: Groups = []

    # -- fields --------------------------------------------------------------------------
    @staticmethod
    def _field(node: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str, path: str,
               default: Any = ...) -> Any:
        v = node.get(key)
        if v is None:
            if default is ...:
                raise ValueError(f"{path}.{key} is missing; allowed: {what}")
            return default
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ValueError(f"{path}.{key}={_short(v)} is invalid; allowed: {what}")
        return v

    def _words(self, node: dict[str, Any], key: str, path: str, *, required: bool = False,
               limit: int = MAX_FREE_WORDS) -> list[str]:
        v = node.get(key)
        what = f"a list of up to {limit} non-empty strings of at most {MAX_WORD_CHARS} characters"
        if v is None and not required:
            return []
        if (not isinstance(v, list) or (required and not v) or len(v) > limit
                or not all(isinstance(w, str) and 0 < len(w) <= MAX_WORD_CHARS for w in v)):
            raise ValueError(f"{path}.{key}={_short(v)} is invalid; allowed: {what}"
                             + (" (at least one)" if required else ""))
        return list(dict.fromkeys(v))

    @staticmethod
    def _ends(node: dict[str, Any], path: str) -> list[str]:
        end = node.get("end")
        if isinstance(end, str):
            return [end]
        if isinstance(end, list) and end and len(end) <= MAX_TRIGGERS and all(isinstance(e, str) for e in end):
            return list(dict.fromkeys(end))
        if isinstance(end, dict):
            raise ValueError(f"{path}.end={_short(end)} is a token-level end, which plait cannot enforce (it enforces "
                             f"a structural tag as a text regex); allowed: a string or a list of strings")
        raise ValueError(f"{path}.end={_short(end)} is invalid; allowed: a string or a list of 1 to {MAX_TRIGGERS} "
                         f"strings")

    @staticmethod
    def _free(words: list[str], path: str) -> tuple[str, dict[str, str]]:
        """free_text_regexes over ``words``, which none may end another (then where one
        was written would be ambiguous)."""
        if not words:
            return f"{ANY_CHAR}*", {}
        if len(words) > MAX_FREE_WORDS:
            raise ValueError(f"{path}: free text there may not hold {len(words)} strings (its triggers, excludes "
                             f"and the enclosing tag's ends); allowed: at most {MAX_FREE_WORDS} (MAX_FREE_WORDS)")
        for w in words:
            if not w:
                raise ValueError(f"{path}: an empty end string cannot end free text; allowed: non-empty ends")
            if len(w) > MAX_WORD_CHARS:
                raise ValueError(f"{path}: {w[:40]!r}... ends free text and is {len(w)} characters; allowed: at "
                                 f"most {MAX_WORD_CHARS} (MAX_WORD_CHARS)")
            for u in words:
                if w != u and u.endswith(w):
                    raise ValueError(f"{path}: {w!r} ends {u!r} (triggers, excludes and the enclosing tag's ends "
                                     f"of one stretch of free text), so where one was written is ambiguous; "
                                     f"allowed: strings none of which ends another")
        try:
            return free_text_regexes(words)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def _tags(self, node: dict[str, Any], path: str) -> list[dict[str, Any]]:
        tags = node.get("tags")
        if not isinstance(tags, list) or not tags:
            raise ValueError(f"{path}.tags={_short(tags)} is invalid; allowed: a list of 1 to {MAX_FORMAT_LIST} "
                             f"tag elements")
        for i, t in enumerate(tags):
            if not isinstance(t, dict) or t.get("type", "tag") != "tag":
                raise ValueError(f"{path}.tags[{i}]={_short(t)} is invalid; allowed: a tag element "
                                 f"({{\"type\": \"tag\", \"begin\", \"content\", \"end\"}})")
        return tags

    @staticmethod
    def _flag(node: dict[str, Any], key: str, path: str, default: bool) -> bool:
        v = node.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ValueError(f"{path}.{key}={_short(v)} is invalid; allowed: true or false")
        return v

    # -- elements ------------------------------------------------------------------------
    def kind(self, node: Any, path: str) -> str:
        if not isinstance(node, dict):
            raise ValueError(f"{path}={_short(node)} is invalid; allowed: a format element, an object with a "
                             f"\"type\" ({', '.join(SUPPORTED_FORMATS)})")
        kind = node.get("type")
        if kind is None and "begin" in node:
            kind = "tag"  # (xgrammar's tags may leave their type out)
        if not isinstance(kind, str):
            raise ValueError(f"{path}.type={_short(kind)} is invalid; allowed: one of {', '.join(SUPPORTED_FORMATS)}")
        if kind in _REFUSED:
            raise ValueError(
                f"{path}.type={kind!r} is not supported: {_REFUSED[kind]}; plait enforces a structural tag as one "
                f"regular expression over the text; allowed: {', '.join(SUPPORTED_FORMATS)}"
                + (" (a grammar for the whole output: the ebnf sampling parameter)" if kind == "grammar" else ""))
        if kind not in _FIELDS:
            raise ValueError(f"{path}.type={_short(kind)} is not a structural tag format; allowed: "
                             f"{', '.join(SUPPORTED_FORMATS)}")
        extra = sorted(set(node) - _FIELDS[kind] - {"type"})
        if extra:
            raise ValueError(f"{path} ({kind}) has unknown field(s) {', '.join(map(repr, extra))}; allowed: "
                             f"{', '.join(sorted(_FIELDS[kind]))}")
        return kind

    def regex(self, node: Any, path: str, excl: list[str], before: str | None = None) -> str:
        """The element's regex where something follows it (or the output ends);
        ``before``: the literal text right before the element (None: not known)."""
        kind = self.kind(node, path)
        if kind == "const_string":
            return _lit(self._field(node, "value", str, "a string", path))
        if kind == "json_schema":
            if "json_schema" not in node or node["json_schema"] is None:
                raise ValueError(f"{path}.json_schema is missing; allowed: a JSON Schema (an object, or true)")
            style = node.get("style")
            if style not in (None, "json"):
                raise ValueError(f"{path}.style={_short(style)} is not supported; allowed: \"json\" (the XML styles "
                                 f"are not enforced by plait)")
            if node.get("any_order") not in (None, False):
                raise ValueError(f"{path}.any_order={_short(node.get('any_order'))} is not supported; allowed: false "
                                 f"(properties in the schema's order)")
            return f"(?:{self.schema(node['json_schema'], path, before)})"
        if kind == "regex":
            from plait.runtime.constrained.regexes import check_regex

            return f"(?:{check_regex(node.get('pattern'), f'{path}.pattern')})"
        if kind == "any_text":
            return self.any_text(node, path, excl, None)
        if kind == "sequence":
            elements = self._list(node, "elements", path)
            return "".join(self.regex(e, f"{path}.elements[{i}]", excl, _before(elements, i, before))
                           for i, e in enumerate(elements))
        if kind == "or":
            elements = self._list(node, "elements", path)
            return _union([self.regex(e, f"{path}.elements[{i}]", excl, before) for i, e in enumerate(elements)])
        if kind in ("optional", "plus", "star", "repeat"):  # (a repetition's text before is not fixed)
            inner = self.regex(node.get("content"), f"{path}.content", excl, before if kind == "optional" else None)
            return self.repeat(node, kind, path, inner)
        if kind == "tag":
            return self.tag(node, path)
        if kind == "triggered_tags":
            return self.triggered(node, path, excl, None)
        if kind == "tags_with_separator":
            return self.separated(node, path)
        return self.dispatch(node, path, excl, None)

    def tail(self, node: Any, path: str, ends: list[str], before: str | None = None) -> str:
        """The element's regex followed by one of ``ends`` (a tag's content and its end):
        an unlimited element stops at the first end it writes."""
        kind = self.kind(node, path)
        end_rx = _union([_lit(e) for e in ends])
        if kind == "sequence":
            elements = self._list(node, "elements", path)
            last = len(elements) - 1
            head = "".join(self.regex(e, f"{path}.elements[{i}]", ends, _before(elements, i, before))
                           for i, e in enumerate(elements[:-1]))
            return head + self.tail(elements[-1], f"{path}.elements[{last}]", ends, _before(elements, last, before))
        if kind == "or":
            elements = self._list(node, "elements", path)
            return _union([self.tail(e, f"{path}.elements[{i}]", ends, before) for i, e in enumerate(elements)])
        if kind == "optional":
            return _union([self.tail(node.get("content"), f"{path}.content", ends, before), end_rx])
        if kind in _UNLIMITED and "" in ends:
            raise ValueError(f"{path} ({kind}) is a tag's content, whose end includes \"\", which cannot end it; "
                             f"allowed: non-empty end strings")
        if kind == "any_text":
            return self.any_text(node, path, [], ends)
        if kind == "triggered_tags":
            return self.triggered(node, path, [], ends)
        if kind == "dispatch":
            return self.dispatch(node, path, [], ends)
        return self.regex(node, path, ends, before) + end_rx

    def schema(self, schema: Any, path: str, before: str | None) -> str:
        """A ``json_schema`` element's regex; its ``uniqueItems`` over scalars are kept by
        the matcher after ``before``, the literal text right before it."""
        from plait.runtime.constrained.holes import regex_or_hole

        try:  # (or a JSON hole: plait.runtime.constrained.holes)
            rx, sites = regex_or_hole(schema)
        except ValueError as e:
            raise ValueError(f"{path}.{e}" if str(e).startswith("json_schema") else f"{path}.json_schema: {e}") \
                from None
        if sites:
            if before is None:
                raise ValueError(f"{path}.json_schema: its 'uniqueItems' can be kept only where fixed text comes "
                                 f"right before the JSON (a tag's begin, a non-empty const_string before it in a "
                                 f"sequence, or the output's start); allowed: such an element there, or the schema "
                                 f"without uniqueItems")
            self.groups.append((before, sites))
        return rx

    def _list(self, node: dict[str, Any], key: str, path: str) -> list[Any]:
        v = node.get(key)
        if not isinstance(v, list) or not v:
            raise ValueError(f"{path}.{key}={_short(v)} is invalid; allowed: a list of 1 to {MAX_FORMAT_LIST} "
                             f"format elements")
        return v

    def repeat(self, node: dict[str, Any], kind: str, path: str, inner: str) -> str:
        if inner == "":
            return ""
        if kind == "optional":
            return f"(?:{inner})?"
        if kind == "plus":
            return f"(?:{inner})+"
        if kind == "star":
            return f"(?:{inner})*"
        what = f"an integer from 0 to {MAX_REPEAT_COUNT} (MAX_REPEAT_COUNT)"
        lo = self._field(node, "min", int, what, path)
        hi = self._field(node, "max", int, what + ", or -1 for no upper bound", path)
        if not 0 <= lo <= MAX_REPEAT_COUNT:
            raise ValueError(f"{path}.min={lo} is invalid; allowed: {what}")
        if hi != -1 and not lo <= hi <= MAX_REPEAT_COUNT:
            raise ValueError(f"{path}.max={hi} is invalid; allowed: an integer from min ({lo}) to "
                             f"{MAX_REPEAT_COUNT} (MAX_REPEAT_COUNT), or -1 for no upper bound")
        size = _expanded(inner) * max(lo, hi, 1)
        if size > MAX_EXPANDED_CHARS:
            raise ValueError(f"{path} repeats a regex of {_expanded(inner)} characters (its own repetitions written "
                             f"out) {max(lo, hi)} times, {size} in all; allowed: at most {MAX_EXPANDED_CHARS} "
                             f"(MAX_EXPANDED_CHARS: a smaller content or count)")
        return f"(?:{inner}){{{lo},}}" if hi == -1 else f"(?:{inner}){{{lo},{hi}}}"

    def any_text(self, node: dict[str, Any], path: str, excl: list[str], ends: list[str] | None) -> str:
        excludes = self._words(node, "excludes", path)
        if node.get("max_tokens") is not None:
            raise ValueError(f"{path}.max_tokens={_short(node['max_tokens'])} is not supported: a token budget is not "
                             f"a property of the text, and plait enforces a structural tag as a regex over the text; "
                             f"allowed: max_chars, or the request's max_tokens")
        max_chars = node.get("max_chars")
        if max_chars is not None:
            if not isinstance(max_chars, int) or isinstance(max_chars, bool) or \
                    not 0 <= max_chars <= MAX_ANY_TEXT_CHARS:
                raise ValueError(f"{path}.max_chars={_short(max_chars)} is invalid; allowed: an integer from 0 to "
                                 f"{MAX_ANY_TEXT_CHARS} (MAX_ANY_TEXT_CHARS)")
            if excludes or excl or ends:
                raise ValueError(f"{path}.max_chars is supported only on any_text with no excludes outside any tag "
                                 f"(text of bounded length that stops at a given string is not a regex plait "
                                 f"builds); allowed: drop max_chars, or the excludes and the enclosing tag")
            return f"{ANY_CHAR}{{0,{max_chars}}}" if max_chars else ""
        if ends is None:
            return self._free(list(dict.fromkeys(excludes + excl)), path)[0]
        words = list(dict.fromkeys(ends + [x for x in excludes if x not in ends]))
        _, firsts = self._free(words, path)
        return self._to_end(firsts, ends, path)

    @staticmethod
    def _to_end(firsts: dict[str, str], ends: list[str], path: str) -> str:
        reachable = [firsts[e] for e in ends if e in firsts]
        if not reachable:
            raise ValueError(f"{path}: every end string of the enclosing tag ({ends}) holds one of the strings the "
                             f"text before it may not, so it could never end; allowed: ends that hold no trigger or "
                             f"exclude")
        return _union(reachable)

    def tag(self, node: dict[str, Any], path: str) -> str:
        begin = node.get("begin")
        if isinstance(begin, dict):
            raise ValueError(f"{path}.begin={_short(begin)} is a token-level begin, which plait cannot enforce (it "
                             f"enforces a structural tag as a text regex); allowed: a string")
        begin = self._field(node, "begin", str, "a string", path)
        ends = self._ends(node, path)
        if "content" not in node:
            raise ValueError(f"{path}.content is missing; allowed: a format element")
        return _lit(begin) + self.tail(node["content"], f"{path}.content", ends, begin or None)

    def triggered(self, node: dict[str, Any], path: str, excl: list[str], ends: list[str] | None) -> str:
        triggers = self._words(node, "triggers", path, required=True, limit=MAX_TRIGGERS)
        tags = self._tags(node, path)
        excludes = self._words(node, "excludes", path)
        at_least_one = self._flag(node, "at_least_one", path, False)
        stop_after_first = self._flag(node, "stop_after_first", path, False)
        stops = ends if ends is not None else excl
        _no_clash(triggers, excludes, stops, f"{path}.triggers", "triggers")
        rests: dict[str, list[str]] = {t: [] for t in triggers}
        for i, tag in enumerate(tags):
            where = f"{path}.tags[{i}]"
            self.kind(tag, where)
            begin = tag.get("begin")
            if not isinstance(begin, str):
                raise ValueError(f"{where}.begin={_short(begin)} is invalid; allowed: a string starting with one of "
                                 f"the triggers {triggers}")
            trig = [t for t in triggers if begin.startswith(t)]
            if not trig:
                raise ValueError(f"{where}.begin={begin!r} starts with none of the triggers; allowed: a begin that "
                                 f"starts with one of {triggers}")
            t = max(trig, key=len)
            rests[t].append(_lit(begin[len(t):]) + self.tail(tag.get("content"), f"{where}.content",
                                                               self._ends(tag, where), begin))
        words = list(dict.fromkeys(triggers + excludes + stops))
        free, firsts = self._free(words, path)
        segments = [firsts[t] + _union(r) for t, r in rests.items() if r and t in firsts]
        whole = _union([_lit(t) + _union(r) for t, r in rests.items() if r])
        end_rx = _union([_lit(e) for e in ends]) if ends is not None else ""
        last = self._to_end(firsts, ends, path) if ends is not None else free
        if at_least_one and stop_after_first:
            return whole + end_rx
        if stop_after_first:
            return _union([last] + [s + end_rx for s in segments])
        more = _star(_union(segments)) if segments else ""
        return (whole if at_least_one else "") + more + last

    def separated(self, node: dict[str, Any], path: str) -> str:
        tags = self._tags(node, path)
        sep = self._field(node, "separator", str, "a string", path)
        at_least_one = self._flag(node, "at_least_one", path, False)
        stop_after_first = self._flag(node, "stop_after_first", path, False)
        one = _union([self.regex(t, f"{path}.tags[{i}]", []) for i, t in enumerate(tags)])
        if stop_after_first:
            return one if at_least_one else f"(?:{one})?"
        many = one + _star(_lit(sep) + one)
        return many if at_least_one else f"(?:{many})?"

    def dispatch(self, node: dict[str, Any], path: str, excl: list[str], ends: list[str] | None) -> str:
        rules = node.get("rules")
        if not isinstance(rules, list) or not rules or not all(
                isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and 0 < len(r[0]) <= MAX_WORD_CHARS
                for r in rules):
            raise ValueError(f"{path}.rules={_short(rules)} is invalid; allowed: a list of 1 to {MAX_TRIGGERS} "
                             f"[pattern, format] pairs, each pattern a non-empty string of at most {MAX_WORD_CHARS} "
                             f"characters")
        patterns = [r[0] for r in rules]
        if len(set(patterns)) < len(patterns):
            raise ValueError(f"{path}.rules: a pattern appears twice; allowed: distinct patterns")
        excludes = self._words(node, "excludes", path)
        loop = self._flag(node, "loop", path, True)
        stops = ends if ends is not None else excl
        _no_clash(patterns, excludes, stops, f"{path}.rules", "patterns")
        free, firsts = self._free(list(dict.fromkeys(patterns + excludes + stops)), path)
        segments = [firsts[p] + self.regex(f, f"{path}.rules[{i}][1]", excl, p)
                    for i, (p, f) in enumerate(rules) if p in firsts]
        end_rx = _union([_lit(e) for e in ends]) if ends is not None else ""
        last = self._to_end(firsts, ends, path) if ends is not None else free
        if not loop:
            return _union([last] + [s + end_rx for s in segments])
        return (_star(_union(segments)) if segments else "") + last


def _before(elements: list[Any], i: int, before: str | None) -> str | None:
    """The literal text right before a sequence's ``i``-th element: the sequence's own
    for the first, a non-empty ``const_string`` just before it, else None."""
    if i == 0:
        return before
    prev = elements[i - 1]
    if isinstance(prev, dict) and prev.get("type") == "const_string" and isinstance(prev.get("value"), str) \
            and prev["value"]:
        return prev["value"]
    return None


def _no_clash(words: list[str], excludes: list[str], stops: list[str], where: str, noun: str) -> None:
    """``ValueError`` when one of ``words`` (triggers, dispatch patterns) is also an
    exclude or the enclosing tag's end: the free text could not both stop at it and
    begin a structure there."""
    for w in words:
        if w in excludes or w in stops:
            raise ValueError(f"{where}: {w!r} is also an exclude or the enclosing tag's end; allowed: {noun} that "
                             f"are neither")


def format_regex(fmt: dict[str, Any], param: str = "response_format") -> tuple[str, Groups]:
    """The regex of a ``{"type": "structural_tag", "format": {...}}`` and the JSON values
    whose ``uniqueItems`` the matcher keeps (:func:`structural_tag_constraint`);
    ``ValueError`` naming the element at fault, by its path, and what is allowed."""
    from plait.runtime.constrained.holes import has_holes, masked
    from plait.runtime.constrained.regexes import check_regex

    extra = sorted(set(fmt) - {"type", "format"})
    if extra:
        raise ValueError(f"{param} has {', '.join(map(repr, extra))} beside format; allowed: either "
                         f"{{\"type\": \"structural_tag\", \"format\": {{...}}}} or the legacy {{\"type\": "
                         f"\"structural_tag\", \"structures\": [...], \"triggers\": [...]}}")
    where = f"{param}.format"
    _check_tree(fmt["format"], where)
    translator = _Translator()
    try:
        rx = translator.regex(fmt["format"], where, [], "")  # "": the output's start
    except RecursionError:  # a guard: the depth limit keeps the walk shallow
        raise ValueError(f"{where} is nested too deeply; allowed: at most {MAX_FORMAT_DEPTH} levels") from None
    if rx == "":
        raise ValueError(f"{where} admits only the empty output; allowed: a format that writes something")
    try:
        if has_holes(rx):  # (JSON holes are no regex text: the rest is checked, the holes kept)
            check_regex(masked(rx), f"{where} (as a regex)")
            return rx, translator.groups
        return check_regex(rx, f"{where} (as a regex)"), translator.groups
    except ValueError as e:
        raise ValueError(f"{e} (the structural tag's regex: fewer or smaller elements)") from None
