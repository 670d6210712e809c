"""SGLang's / vLLM's ``structural_tag`` response format as a regex.

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

MAX_TRIGGERS = 8
MAX_TRIGGER_CHARS = 64  # each trigger's length
MAX_STRUCTURES = 64
MAX_FREE_REGEX_CHARS = 20_000  # the free-text regex (state elimination may grow it)


def _lit(s: str) -> str:
    return "".join(_char(c) for c in s)


def _char(c: str) -> str:
    return re.escape(c) if c not in "\n\t" else {"\n": r"\n", "\t": r"\t"}[c]


def _union(parts: list[str]) -> str:
    """The alternation of ``parts``, grouped (so concatenating unions needs no more groups)."""
    parts = sorted(set(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


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
    for k in range(n):  # eliminate the prefix states, the longest first
        state = n - 1 - k
        loop = edges.pop((state, state), [])
        self_r = _star(_union(loop)) if loop else ""
        ins = [(a, edges.pop((a, state))) for a in [a for (a, b) in list(edges) if b == state]]
        outs = [(b, edges.pop((state, b))) for b in [b for (a, b) in list(edges) if a == state]]
        for a, ra in ins:
            for b, rb in outs:
                add(a, b, _union(ra) + self_r + _union(rb))
        total = sum(len(r) for rs in edges.values() for r in rs)
        if total > MAX_FREE_REGEX_CHARS:
            raise ValueError(f"the triggers' free-text regex grows past {MAX_FREE_REGEX_CHARS} characters; "
                             f"allowed: shorter or fewer triggers")
    free = _union(edges.get((start, free_end), [""]))
    firsts = {t: _union(edges[(start, n + 2 + k)]) for k, t in enumerate(triggers) if (start, n + 2 + k) in edges}
    return free, firsts


def structural_tag_regex(fmt: dict[str, Any], param: str = "response_format") -> str:
    """The regex of a ``structural_tag`` response format (``ValueError`` naming the part
    at fault)."""
    from plait.runtime.constrained.json_schema import schema_to_regex

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
        body = schema_to_regex(s["schema"])
        rests[t].append(_lit(s["begin"][len(t):]) + f"(?:{body})" + _lit(s["end"]))
    free, firsts = free_text_regexes(triggers)
    segments = [firsts[t] + _union(r) for t, r in rests.items() if r and t in firsts]
    # a trigger no structure begins with may not be written (its text would be free)
    return (_star(_union(segments)) if segments else "") + free
