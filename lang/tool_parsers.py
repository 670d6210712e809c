"""Tool calls in model output: parsers per format, their streaming form, and the regex
that forces a call (``tool_choice: "required"`` or a named function).

Formats (``--tool-call-parser``):

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one
  block per call (Hermes 2/3, Qwen2.5, Qwen3). Also the format of plait's generic tool
  prompt (:func:`generic_tools_prompt`).
- ``llama3_json``: ``{"name": "f", "parameters": {...}}`` objects separated by ``; ``,
  optionally after ``<|python_tag|>`` (Llama 3.1/3.2 JSON tool calling).
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (also the newer
  ``[TOOL_CALLS]f[ARGS]{...}`` form).
- ``granite``: ``<|tool_call|>[{"name": "f", "arguments": {...}}, ...]`` (IBM Granite 3.x).
- ``pythonic``: the whole output is a Python list of calls, ``[f(a=1), g(b="x")]``
  (Llama 3.2/4 pythonic, optionally inside ``<|python_start|>...<|python_end|>``).
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
  (DeepSeek-V3, R1); ``deepseek_v31``: ``<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
  blocks (DeepSeek-V3.1). Each reads both forms and writes its own.
- ``phi4_mini_json``: ``functools[{"name": "f", "arguments": {...}}, ...]`` (Phi-4-mini).

Parsing never raises. A call whose text is not valid (bad JSON, an unknown function
name, a call cut off) is not a call: its text stays in the content. Output with no
valid call is returned unchanged as content.

``arguments`` is a JSON text. For the JSON formats it is the model's own text of the
arguments object (validated by ``json.loads``), so streamed fragments concatenate to
exactly the non-streamed value.

Torch-free: the language and the HTTP front both use it.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
import uuid
import warnings
from collections.abc import Collection, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from plait.errors import RequestError

MAX_CONSTRAINED_CALLS = 8  # calls one constrained turn may make when parallel calls are allowed
# the arguments of a function that is not strict, beside strict ones under tool_choice "auto"
ANY_ARGUMENTS: dict[str, Any] = {"type": "object", "additionalProperties": {}}


@dataclass
class ToolCall:
    """One function call: ``arguments`` is a JSON text (an object), unless ``cut``:
    the output ended (the length limit, a stop string) while the call was written, and
    ``arguments`` is as far as it got; or, in :attr:`ToolStream.calls`, a call that
    streamed but whose text did not end as a valid call."""

    id: str
    name: str
    arguments: str
    cut: bool = False

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def mistral_call_id(given: str | None = None) -> str:
    """A call id as Mistral's chat templates require (9 alphanumeric characters, else
    they raise "Tool call IDs should be alphanumeric strings with length 9!"): a new
    random one, or for ``given`` (a history's id in another shape, such as OpenAI's
    ``call_...``) the same 9 characters each time it is read, so a call and the tool
    message that answers it still match."""
    if given is not None and len(given) == 9 and given.isascii() and given.isalnum():
        return given
    if given is None:
        n = uuid.uuid4().int
    else:
        import hashlib

        n = int.from_bytes(hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ALNUM))
        out.append(_ALNUM[r])
    return "".join(out)


# -- tools as the OpenAI API sends them ---------------------------------------------------------
# OpenAI's rule ([A-Za-z0-9_-]{1,64}) with MCP's dots and length (its tool-name format: up
# to 128 of A-Z, a-z, 0-9, _, - and .; "github.create_issue" from an MCP bridge was a 400,
# where vLLM and SGLang take any name)
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def check_tools(tools: Any, param: str = "tools", nested: bool = True) -> list[dict[str, Any]]:
    """``tools`` in OpenAI's shape (``[{"type": "function", "function": {"name",
    "description", "parameters"}}]``; with ``nested=False`` the Responses API's
    ``[{"type": "function", "name", ...}]``), checked: names match
    ``[A-Za-z0-9_.-]{1,128}`` and are distinct, ``parameters`` is an object. Returns the
    function objects (name, description, parameters); raises :class:`RequestError`
    naming ``tools[i].function.name`` (``tools[i].name``) etc."""
    if not isinstance(tools, list) or not tools:
        raise RequestError(f"{param} must be a non-empty array of function tools", param)
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError(f"{where}.type must be 'function' (the only tool type supported)", f"{where}.type")
        fn = t.get("function") if nested else {k: t[k] for k in ("name", "description", "parameters") if k in t}
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object with name and parameters", f"{where}.function")
        if nested:
            where += ".function"
        name = fn.get("name")
        if not nested and name is None and isinstance(t.get("function"), dict):
            raise RequestError(f"{where} is in chat completions' shape ({{\"type\": \"function\", \"function\": "
                               f"{{...}}}}); the Responses API's tools are flat: {{\"type\": \"function\", \"name\": "
                               f"..., \"parameters\": ...}}", f"{where}.name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise RequestError(f"{where}.name={name!r} is invalid; allowed: 1 to 128 of a-z, A-Z, 0-9, _, - and .",
                               f"{where}.name")
        if name in seen:
            raise RequestError(f"{where}.name={name!r} is given twice; names must be distinct", f"{where}.name")
        seen.add(name)
        strict = (t if not nested else fn).get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestError(f"{where}.strict={strict!r:.40} is invalid; allowed: true, false or null",
                               f"{where}.strict")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{where}.parameters must be a JSON Schema object", f"{where}.parameters")
        kind = (params or {}).get("type", "object")
        if "object" not in (kind if isinstance(kind, list) else [kind]):
            raise RequestError(f"{where}.parameters has type {kind!r}; allowed: a schema of type 'object' (a call's "
                               f"arguments are an object)", f"{where}.parameters")
        props, required = (params or {}).get("properties"), (params or {}).get("required")
        if props is not None and not isinstance(props, dict):
            raise RequestError(f"{where}.parameters.properties={props!r:.80} is invalid; allowed: an object of "
                               f"property schemas", f"{where}.parameters")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise RequestError(f"{where}.parameters.required={required!r:.80} is invalid; allowed: an array of "
                               f"property names", f"{where}.parameters")
        problem = schema_problem(params) if params else None
        if problem is not None:
            raise RequestError(f"Invalid schema for function {name!r} ({where}.parameters): {problem}",
                               f"{where}.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise RequestError(f"{where}.description must be a string", f"{where}.description")
        out.append(fn)
    return out


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes ``schema`` (a function's ``parameters``) no usable JSON Schema under
    any ``tool_choice``, or None: over the translators' size and depth limits, invalid
    under its draft's metaschema (``$schema``, else 2020-12; formats such as ``regex``
    not checked: Python's ``re`` is not ECMA-262's), or a local ``$ref`` that points
    nowhere. A valid schema that constrained decoding cannot enforce passes: only a
    forced call enforces it (:meth:`ToolParser.constraint`). Linear in the
    schema's size, which the size check bounds first."""
    import jsonschema

    from plait.runtime.constrained.json_schema import (
        _DATA_KEYWORDS, NOWHERE, SchemaError, boolean_bounds, canonical_dialect, check_schema_size, local_pointer,
        nested_resource_ref, pointer_target,
    )

    try:
        check_schema_size(schema)
    except SchemaError as e:
        return str(e)
    schema = canonical_dialect(schema)  # https://json-schema.org/draft-04/schema# is draft 4
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if isinstance(schema, dict) and "$schema" not in schema and boolean_bounds(schema):
        # OpenAPI 3.0's boolean bounds, as the constraint reads them (docs/constrained.md)
        cls = jsonschema.Draft4Validator
    try:
        cls.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as e:
        at = "".join(f"/{p}" for p in e.absolute_path)
        return f"at #{at}: {e.message:.200}"
    if nested_resource_ref(schema) is not None:
        return None  # a $ref under a nested $id resolves against that $id (the translator refuses it)
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, at = stack.pop()
        if isinstance(node, list):
            stack.extend((x, f"{at}/{i}") for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        parts = local_pointer(schema, node.get("$ref"))  # None: not a string, or another document's
        if parts is not None and pointer_target(schema, parts) is NOWHERE:
            return f"'$ref' at {at} points nowhere: {node['$ref']!r:.200}"
        stack.extend((v, f"{at}/{k}") for k, v in node.items()
                     if k not in _DATA_KEYWORDS and isinstance(v, (dict, list)))
    return None


def strict_names(tools: list[dict[str, Any]]) -> set[str]:
    """The functions of ``tools`` given ``strict: true`` (in the function for chat's
    tools, on the tool for the Responses API's flat ones)."""
    return {fn["name"] for fn in _functions(tools) if fn.get("strict") is True}


def _names(tools: list[dict[str, Any]]) -> set[str]:
    return {fn["name"] for fn in _functions(tools)}


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Function objects from tools given either as OpenAI tools or as bare functions."""
    return [t["function"] if isinstance(t.get("function"), dict) else t for t in tools]


Guarded = list[tuple[str, list[list[Any]]]]  # (text right before a JSON value, its uniqueItems sites)


@dataclass(frozen=True)
class CallConstraint:
    """What forces a format's calls: ``regex``, and beside it ``unique`` (sampling
    param ``unique_items``): the arguments whose ``uniqueItems`` over strings and
    numbers the matcher keeps (a regex cannot), each as the text the regex writes right
    before them and the places in them (:mod:`plait.runtime.constrained.unique_items`)."""

    regex: str
    unique: Guarded = field(default_factory=list)

    def sampling(self) -> dict[str, Any]:
        """The sampling params that force the calls."""
        return {"regex": self.regex, **({"unique_items": [list(g) for g in self.unique]} if self.unique else {})}


def _arguments_regex(fn: dict[str, Any], where: str, before: str) -> tuple[str, Guarded]:
    """The regex of ``fn``'s argument objects (JSON, compact): its ``parameters``
    schema narrowed to objects (a schema without ``type``, or with ``["object",
    "null"]``, admits other values), or ``{}`` for a function without listed
    parameters; and its ``uniqueItems`` kept beside the regex, after ``before`` (the
    text the regex writes right before the arguments)."""
    from plait.runtime.constrained.holes import regex_or_hole

    params = fn.get("parameters")
    if _no_parameters(params):
        return r"\{\}", []
    try:  # (a schema only llguidance's JSON compiler follows: a hole, plait.runtime.constrained.holes)
        rx, sites = regex_or_hole({**params, "type": "object"})
    except ValueError as e:
        raise RequestError(f"{where}.parameters (function {fn['name']!r}) cannot be enforced: {e}",
                           f"{where}.parameters") from None
    return rx, [(before, sites)] if sites else []


def _no_parameters(params: dict[str, Any] | None) -> bool:
    """A function that lists no parameters (absent, ``{}`` or ``{"type": "object",
    "properties": {}}``) is called with ``{}``, as OpenAI's API does."""
    if not params:
        return True
    plain = set(params) <= {"type", "properties", "required", "additionalProperties", "title", "description", "$schema"}
    return plain and params.get("type", "object") == "object" and not params.get("properties") \
        and not params.get("required") and not isinstance(params.get("additionalProperties"), dict)


def _chosen(tools: list[dict[str, Any]], choice: str | Collection[str] | None) -> list[tuple[str, dict[str, Any]]]:
    """(where, function) of the functions a constrained call may use: all of ``tools``
    (``choice`` None), the one ``choice`` names, or those whose names are in ``choice``
    (an ``allowed_tools`` set); ``where`` names the function in the request
    (``tools[i].function``, or ``tools[i]`` for tools given flat as the Responses API
    does)."""
    fns = [(f"tools[{i}].function" if isinstance(t.get("function"), dict) else f"tools[{i}]", fn)
           for i, (t, fn) in enumerate(zip(tools, _functions(tools)))]
    if choice is None:
        return fns
    if not isinstance(choice, str):
        return [(i, fn) for i, fn in fns if fn["name"] in choice]
    picked = [(i, fn) for i, fn in fns if fn["name"] == choice]
    if not picked:
        raise RequestError(f"tool_choice names function {choice!r}, which is not in tools", "tool_choice")
    return picked


def _repeat_calls(call: str, sep: str, parallel: bool) -> str:
    if not parallel:
        return call
    return f"{call}(?:{sep}{call}){{0,{MAX_CONSTRAINED_CALLS - 1}}}"


# -- scanning JSON in text --------------------------------------------------------------------------
_OUTSIDE = re.compile(r'["{}\[\]]')  # the characters that change the scan's state outside a string
_INSIDE = re.compile(r'["\\]')  # ... and inside one


@dataclass
class _Memo:
    """What a stream's scans keep for the next one (:class:`ToolStream` sets it while it
    scans; its text only grows). A stream rescans its whole text at every delta, so a
    call's arguments were scanned from their start at each token, and every earlier call
    again: quadratic in the output, on the front's event loop (a 4,000-token argument
    took ~5 s of it, 300 calls of a looping model 17 s, every other client waiting).

    ``ends``: :func:`json_end`'s state per start: (the text scanned from start, depth,
    in_str, esc, end), resumed where the last scan stopped. ``settled``: a parser's own
    (the text up to where nothing later can change its scan, what it found there)."""

    ends: dict[int, tuple[str, int, bool, bool, int | None]] = field(default_factory=dict)
    settled: tuple[str, Any] | None = None
    # per call object's start: the last end tag seen inside one of its strings (it stays
    # there as the text grows: the next scan looks for the end tag after it)
    quoted: dict[int, int] = field(default_factory=dict)


_MEMO: ContextVar[_Memo | None] = ContextVar("_MEMO", default=None)


def json_end(text: str, start: int, stop: int | None = None) -> int | None:
    """The index just past the JSON object or array that opens at ``text[start]``, or
    None when it is not closed yet (strings and escapes are respected); ``stop``: read
    ``text[:stop]`` only (without copying it)."""
    return _json_scan(text, start, stop)[0]


def _json_scan(text: str, start: int, stop: int | None = None) -> tuple[int | None, bool]:
    """:func:`json_end`, and whether ``stop`` (when the value is not closed before it)
    falls inside one of its strings."""
    n = len(text) if stop is None else min(stop, len(text))
    depth, in_str, esc, i = 0, False, False, start
    memo = _MEMO.get()
    hit = memo.ends.get(start) if memo is not None else None
    if hit is not None and start + len(hit[0]) <= n and text.startswith(hit[0], start):  # (the same text: resume)
        if hit[4] is not None:
            return hit[4], False
        depth, in_str, esc, i = hit[1], hit[2], hit[3], start + len(hit[0])
    end = None
    while i < n:
        if esc:
            esc = False
            i += 1
            continue
        m = (_INSIDE if in_str else _OUTSIDE).search(text, i, n)
        if m is None:
            i = n
            break
        i = m.start()
        c = text[i]
        i += 1
        if in_str:
            if c == "\\":
                esc = True
            else:
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                end = i
                break
    if memo is not None and i - start > 256:  # (a short scan is cheaper than its memo)
        memo.ends[start] = (text[start:i], depth, in_str, esc, end)
    return end, end is None and (in_str or esc)


_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_NAMED = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,')  # the name written, another key next


@dataclass
class _Seen:
    """A call found in (possibly partial) text: ``args`` is a prefix of its final
    arguments text while ``complete`` is false."""

    key: int  # where the call starts in the text: stable while text grows
    name: str
    args: str
    complete: bool


def _json_string(raw: str) -> str | None:
    try:
        v = json.loads('"' + raw + '"')
    except ValueError:
        return None
    return v if isinstance(v, str) else None


def _object_call(text: str, start: int, stop: int, names: set[str]) -> tuple[_Seen | None, int | None]:
    """The call object opening at ``text[start]`` (``{``), looking no further than
    ``stop``: (the call or None, the index past the object or None if unclosed). A
    partial object is a call once its name (first key) is a known function and a key
    follows it: its arguments so far are empty until their object begins (a forced call
    cut by ``max_tokens`` at ``{"name": "f", "arguments`` was lost: no call, no content)."""
    end = json_end(text, start, stop)
    head = _HEADER.match(text, start, stop)
    if end is not None:
        try:
            obj = _loads(text[start:end])
        except ValueError:
            return None, end
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
            return None, end
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                if not isinstance(_loads(args), dict):
                    return None, end
            except ValueError:
                return None, end
            raw = args
        elif isinstance(args, dict):
            raw = json.dumps(args, ensure_ascii=False)
            if head is not None and text[head.end():head.end() + 1] == "{":
                a_end = json_end(text, head.end(), end)
                if a_end is not None:
                    raw = text[head.end():a_end]
        else:
            return None, end
        return _Seen(start, obj["name"], raw, True), end
    if head is not None and _json_string(head.group(1)) in names and text[head.end():head.end() + 1] == "{":
        name = _json_string(head.group(1))
        assert name is not None
        a_end = json_end(text, head.end(), stop)
        return _Seen(start, name, text[head.end():a_end if a_end is not None else stop], False), None
    named = _NAMED.match(text, start, stop)
    if named is not None and _json_string(named.group(1)) in names:
        return _Seen(start, _json_string(named.group(1)) or "", "", False), None
    return None, None


# -- parsers ----------------------------------------------------------------------------------------
@dataclass
class _Scan:
    """What a parser sees in text so far.

    ``content_end``: the text before it is content for sure (streamable);
    ``calls``: calls in order; ``rest``: content found after the calls began (invalid
    call text, text between or after calls)."""

    content_end: int
    calls: list[_Seen]
    rest: list[str]


class ToolParser:
    """One tool-call format. Subclasses implement :meth:`scan` and
    :meth:`constraint`; :meth:`parse` and :meth:`stream` derive from ``scan``."""

    name: str = ""
    hint: str = ""  # how a call looks, for the generic tool prompt
    markers: tuple[str, ...] = ()  # what only a call starts with (never content)
    special_marker = False  # the marker is a special token (kept in the text: skip_special_tokens false)
    # what content never holds and a block of calls starts with (the first of them, as
    # :meth:`constraint` writes the block); empty where there is none (a pythonic call
    # starts with "[", which text holds)
    triggers: tuple[str, ...] = ()

    def new_id(self) -> str:
        """The id of a call found in output (OpenAI's ``call_`` shape unless the
        format's templates need another)."""
        return new_call_id()

    def cut_markup(self, tail: str) -> bool:
        """``tail`` (text after the content, where a call may begin) is the start of a
        call cut off before its name: a prefix of one of :attr:`markers`, or one of them
        followed by an unfinished call. Cut off there, it is markup, not content (a
        forced call cut by ``max_tokens`` after ``<tool_`` used to come back as content
        ``"<tool_"``)."""
        t = tail.strip()
        return bool(t) and any(m.startswith(t) or t.startswith(m) for m in self.markers)

    def rest_kept(self, rest: list[str], cut: bool) -> list[str]:
        """A scan's ``rest`` without a last call cut off before its name (:meth:`cut_markup`)."""
        return rest[:-1] if cut and rest and self.cut_markup(rest[-1]) else rest

    def format_calls(self, calls: list[ToolCall]) -> str:
        """Calls as this format writes them (an assistant's calls in a prompt)."""
        raise NotImplementedError

    def scan(self, text: str, names: set[str], final: bool) -> _Scan:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict[str, Any]], cut: bool = False) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: the content is the text outside valid calls (stripped);
        output with no valid call is ``(text, [])``. ``cut``: the text was cut off (by
        the length limit or a stop string), so a call in progress (its name known) is a
        call too, its arguments as far as they were written (what a stream sent; empty
        when the cut came before they began), marked :attr:`ToolCall.cut`."""
        try:
            s = self.scan(text, _names(tools), not cut)
        except Exception:  # noqa: BLE001 - a parser bug must not fail a request; the text stays content
            return text, []
        calls = [ToolCall(self.new_id(), c.name, c.args, not c.complete) for c in s.calls if c.complete or cut]
        rest = self.rest_kept(s.rest, cut)
        if not calls:
            # (only a call cut off before its name is markup: after a whole block that is
            # no call, the text is the model's, and was dropped with it)
            if cut and not s.rest and self.cut_markup(text[s.content_end:]):
                return text[:s.content_end].strip(), []
            return text, []
        return join_content(text[:s.content_end], rest), calls

    def stream(self, tools: list[dict[str, Any]]) -> ToolStream:
        return ToolStream(self, tools)

    def constraint(self, tools: list[dict[str, Any]], choice: str | Collection[str] | None,
                   parallel: bool) -> CallConstraint:
        """A regex (plait's dialect, :func:`plait.regex.check_regex`) of outputs that
        make at least one call in this format: to ``choice`` (a function name), to one of
        the functions it names (a set), or to any of ``tools`` when None; with ``parallel``, up to :data:`MAX_CONSTRAINED_CALLS`
        calls. Arguments follow each function's ``parameters`` schema (``uniqueItems``
        kept beside the regex: :class:`CallConstraint`). Raises :class:`RequestError`
        naming the tool whose schema cannot be enforced."""
        raise NotImplementedError

    def auto_constraint(self, tools: list[dict[str, Any]], choice: Collection[str] | None, parallel: bool,
                        strict: Collection[str]) -> CallConstraint | None:
        """``tool_choice="auto"`` with ``strict`` functions (OpenAI's ``strict: true``: a
        call's arguments follow the schema): the output is free text holding no
        :attr:`triggers`, or such text, one block of calls as :meth:`constraint` forces
        them, and free text again. The model still chooses whether to call; once it
        writes the trigger, the call is constrained (SGLang and vLLM do the same with
        xgrammar's structural-tag triggers). Functions not in ``strict`` are called with
        any JSON object. None where the format has no trigger (the output stays free)."""
        if not self.triggers:
            return None
        from plait.runtime.constrained.structural_tag import free_text_regexes

        loose = []
        for t, fn in zip(tools, _functions(tools)):
            if fn["name"] not in strict:
                fn = {**fn, "parameters": ANY_ARGUMENTS}
                t = {**t, "function": fn} if isinstance(t.get("function"), dict) else fn
            loose.append(t)
        calls = self.constraint(loose, choice, parallel)
        free, _ = free_text_regexes(list(self.triggers))
        # (a block starts with the trigger and free text cannot hold it, so where the
        # block begins is never in doubt: no format's trigger overlaps itself)
        return CallConstraint(f"{free}(?:{calls.regex}{free})?", calls.unique)


def _json_call_regex(tools: list[dict[str, Any]], choice: str | Collection[str] | None,
                     key: str) -> tuple[str, Guarded]:
    from plait.runtime.constrained.regexes import escape

    alts, unique = [], []
    for where, fn in _chosen(tools, choice):
        before = '{"name": ' + json.dumps(fn["name"]) + f', "{key}": '
        args, kept = _arguments_regex(fn, where, before)
        alts.append(escape(before) + args + r"\}")
        unique += kept
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")", unique


def _hold_back(text: str, start: int, markers: tuple[str, ...]) -> int:
    """The end of streamable content in ``text[start:]`` when no marker was found:
    trailing whitespace and a tail that could begin a marker are held back."""
    end = len(text)
    for m in markers:
        for k in range(min(len(m) - 1, len(text) - start), 0, -1):
            if text.endswith(m[:k]):
                end = min(end, len(text) - k)
                break
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def join_content(before: str, rest: list[str]) -> str:
    """A reply's content when it makes calls: the text before the first call, then a
    line break and the text found after the calls began (:attr:`_Scan.rest`), stripped;
    as :class:`ToolStream` sends it (the words either side of a call were glued)."""
    tail = "".join(rest).strip()
    return (before + ("\n" if before and tail else "") + tail).strip()


def _content_before(text: str, m: int) -> int:
    while m > 0 and text[m - 1].isspace():
        m -= 1
    return m


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """JSON ``text`` parsed as JSON is written: Python's ``json.loads`` also reads
    ``NaN`` and ``Infinity``, which no JSON parser of a client's takes (a model's
    ``{"a": Infinity}`` came back as a call whose arguments ``JSON.parse`` refuses)."""
    return json.loads(text, parse_constant=_no_constant)


def _args_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _array_calls(text: str, i: int, stop: int, names: set[str], final: bool, calls: list[_Seen],
                 rest: list[str]) -> None:
    """The call objects of a JSON array whose ``[`` is just before ``text[i]`` (up to
    ``stop``), added to ``calls``; invalid ones and text after the array to ``rest``."""
    while True:
        while i < stop and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= stop or text[i] == "]":
            if i < stop and text[i + 1:stop].strip():
                rest.append(text[i + 1:stop])
            return
        if text[i] != "{":
            rest.append(text[i:stop])
            return
        seen, end = _object_call(text, i, stop, names)
        if seen is not None and (seen.complete or not final):
            calls.append(seen)
        elif end is not None or final:
            rest.append(text[i:end if end is not None else stop])
        if end is None:
            return
        i = end


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START,)
    triggers = (START,)
    hint = ('one block per call:\n<tool_call>\n{"name": "<function name>", "arguments": <arguments as a JSON object>}'
            '\n</tool_call>')

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{self.START}\n" + json.dumps({"name": c.name, "arguments": _args_value(c.arguments)},
                                                       ensure_ascii=False) + f"\n{self.END}" for c in calls)

    def scan(self, text: str, names: set[str], final: bool) -> _Scan:
        memo = _MEMO.get()
        if memo is not None and memo.settled is not None and text.startswith(memo.settled[0]):
            m, i, calls, rest = memo.settled[1]  # (blocks before i are settled: resume after them)
            calls, rest = list(calls), list(rest)
        else:
            m = text.find(self.START)
            if m < 0:
                return _Scan(len(text) if final else _hold_back(text, 0, (self.START,)), [], [])
            calls, rest, i = [], [], m
        while i < len(text):
            j = text.find(self.START, i)
            if j < 0:
                if text[i:].strip():
                    rest.append(text[i:])  # (read by the stream only at the end)
                break
            if text[i:j].strip():
                rest.append(text[i:j])
            body = j + len(self.START)
            k = body
            while k < len(text) and text[k].isspace():
                k += 1
            close = self._close(text, body, k)
            stop = close if close >= 0 else len(text)
            seen, end = (None, None)
            if k < stop and text[k] == "{":
                seen, end = _object_call(text, k, stop, names)
            after = text[end:stop].strip() if end is not None else ""
            # (while streaming, the start of the end tag may follow the object)
            ok = seen is not None and (seen.complete or not final) and (
                not after or (not final and close < 0 and self.END.startswith(after)))
            if ok:
                assert seen is not None
                seen.key = j
                calls.append(seen)
            elif close >= 0 or final:
                rest.append(text[j:close + len(self.END) if close >= 0 else len(text)])
            if close < 0:
                break
            i = close + len(self.END)
            if memo is not None and not (k < close and text[k] == "{" and json_end(text, k, close) is None):
                # a block whose call object (or other text) ends before its end tag: no later
                # text changes how it or any block before it reads
                memo.settled = (text[:i], (m, i, tuple(calls), tuple(rest)))
        return _Scan(_content_before(text, m), calls, rest)

    def _close(self, text: str, body: int, k: int) -> int:
        """Where the end tag of the block whose body starts at ``body`` is (-1: not
        yet). An end tag inside a JSON string of the call (an argument that mentions
        ``</tool_call>``) does not end it, whether or not the call is complete yet (a
        forced call cut by the length limit inside such a string used to be split at
        the tag, its rest coming back as content)."""
        close = text.find(self.END, body)
        if close < 0 or k >= close or text[k] != "{":
            return close
        memo = _MEMO.get()
        if memo is not None and k in memo.quoted:
            close = text.find(self.END, memo.quoted[k] + 1)
        while close >= 0:
            # (read through the tag: it holds nothing that changes the scan's state, and a
            # stream's scan resumes where the last one stopped only if this one goes further)
            end, in_str = _json_scan(text, k, close + len(self.END))
            if end is not None or not in_str:
                return close
            if memo is not None:
                memo.quoted[k] = close
            close = text.find(self.END, close + 1)
        return -1

    def constraint(self, tools: list[dict[str, Any]], choice: str | Collection[str] | None,
                   parallel: bool) -> CallConstraint:
        call, unique = _json_call_regex(tools, choice, "arguments")
        return CallConstraint(_repeat_calls("<tool_call>\\n" + call + "\\n</tool_call>", "\\n", parallel), unique)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)
    # (the calls as this parser forces them begin with it; free text never holds it: not
    # '{"name": ' alone, since this parser also starts a call at '{"name":' or '{"name" :')
    triggers = ('{"name"',)
    hint = 'a JSON object per call, separated by "; ":\n{"name": "<function name>", "parameters": <arguments as a JSON object>}'

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": _args_value(c.arguments)}, ensure_ascii=False)
                         for c in calls)
    _START = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')

    def scan(self, text: str, names: set[str], final: bool) -> _Scan:
        memo = _MEMO.get()
        if memo is not None and memo.settled is not None and text.startswith(memo.settled[0]):
            m, i, calls, rest = memo.settled[1]  # (calls before i are settled: resume after them)
            calls, rest = list(calls), list(rest)
        else:
            found = self._START.search(text)
            if found is None:
                return _Scan(len(text) if final else _hold_back(text, 0, (self.TAG, '{"name":')), [], [])
            m = found.start()
            i = found.end() if found.group(0) == self.TAG else m
            calls, rest = [], []
        while True:
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
            if text.startswith(self.TAG, i):
                i += len(self.TAG)
                continue
            if i >= len(text):
                break
            if text[i] != "{":
                rest.append(text[i:])
                break
            seen, end = _object_call(text, i, len(text), names)
            if seen is not None and (seen.complete or not final):
                calls.append(seen)
            elif end is not None or final:
                rest.append(text[i:end if end is not None else len(text)])
            if end is None:
                break
            i = end
            if memo is not None:  # a closed object reads the same whatever follows
                memo.settled = (text[:i], (m, i, tuple(calls), tuple(rest)))
        return _Scan(_content_before(text, m), calls, rest)

    def constraint(self, tools: list[dict[str, Any]], choice: str | Collection[str] | None,
                   parallel: bool) -> CallConstraint:
        call, unique = _json_call_regex(tools, choice, "parameters")
        return CallConstraint(_repeat_calls(call, "; ", parallel), unique)


class MistralParser(ToolParser):
    name = "mistral"
    special_marker = True
    START = "[TOOL_CALLS]"
    markers = (START,)

    @property
    def triggers(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.START,)
    ARGS = "[ARGS]"
    hint = '[TOOL_CALLS] and a JSON array of calls:\n[TOOL_CALLS][{"name": "<function name>", "arguments": <arguments as a JSON object>}]'

    def new_id(self) -> str:
        return mistral_call_id()  # (its templates refuse a history whose ids are not 9 alphanumerics)

    def format_calls(self, calls: list[ToolCall]) -> str:
        return self.START + json.dumps([{"name": c.name, "arguments": _args_value(c.arguments)} for c in calls],
                                       ensure_ascii=False)

    def scan(self, text: str, names: set[str], final: bool) -> _Scan:
        m = text.find(self.START)
        if m < 0:
            return _Scan(len(text) if final else _hold_back(text, 0, (self.START,)), [], [])
        calls: list[_Seen] = []
        rest: list[str] = []
        starts = [k for k in _find_all(text, self.START) if k >= m]
        for n, s in enumerate(starts):
            stop = starts[n + 1] if n + 1 < len(starts) else len(text)
            i = s + len(self.START)
            while i < stop and text[i].isspace():
                i += 1
            if i >= stop:
                continue
            if text[i] == "[":  # a JSON array of call objects
                _array_calls(text, i + 1, stop, names, final, calls, rest)
            elif text[i] == "{":
                seen, end = _object_call(text, i, stop, names)
                if seen is not None and (seen.complete or not final):
                    calls.append(seen)
                elif end is not None or final:
                    rest.append(text[i:stop])
            else:  # name[ARGS]{...}
                a = text.find(self.ARGS, i, stop)
                name = text[i:a].strip() if a >= 0 else None
                if name is None or name not in names:
                    if a >= 0 or final:
                        rest.append(text[s:stop])
                    continue
                j = a + len(self.ARGS)
                while j < stop and text[j].isspace():
                    j += 1
                end = json_end(text, j, stop) if j < stop and text[j] == "{" else None
                if end is not None:
                    try:
                        ok = isinstance(_loads(text[j:end]), dict)
                    except ValueError:
                        ok = False
                    if ok:
                        calls.append(_Seen(s, name, text[j:end], True))
                    else:
                        rest.append(text[s:stop])
                elif j < stop and text[j] == "{" and not final:
                    calls.append(_Seen(s, name, text[j:stop], False))
                elif final or (j < stop and text[j] != "{"):
                    rest.append(text[s:stop])
        return _Scan(_content_before(text, m), calls, rest)

    def constraint(self, tools: list[dict[str, Any]], choice: str | Collection[str] | None,
                   parallel: bool) -> CallConstraint:
        from plait.runtime.constrained.regexes import escape

        call, unique = _json_call_regex(tools, choice, "arguments")
        return CallConstraint(escape(self.START) + r"\[" + _repeat_calls(call, ", ", parallel) + r"\]", unique)


class GraniteParser(MistralParser):
    """IBM Granite 3.x: ``<|tool_call|>`` and a JSON array of calls (read as Mistral's
    array form after its own marker)."""

    name = "granite"
    START = "<|tool_call|>"
    markers = (START,)
    hint = '<|tool_call|> and a JSON array of calls:\n<|tool_call|>[{"name": "<function name>", "arguments": <arguments as a JSON object>}]'

    def new_id(self) -> str:
        return new_call_id()


def _json_text(arguments: str) -> str:
    """A call's arguments as JSON text: the text itself when it is JSON (as the model
    wrote it), else the string as a JSON string."""
    try:
        _loads(arguments)
    except ValueError:
        return json.dumps(arguments, ensure_ascii=False)
    return arguments


def _literal_at(text: str, i: int, lit: str, final: bool) -> tuple[int | None, bool]:
    """``lit`` at ``text[i]``: (the index past it, or None; whether text may still
    bring it: the text ends within a start of it and more can come)."""
    if text.startswith(lit, i):
        return i + len(lit), False
    return None, not final and lit.startswith(text[i:])


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class DeepSeekV3Parser(ToolParser):
    """DeepSeek-V3 / R1: ``<｜tool▁calls▁begin｜>``, then one block per call,
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
    (line breaks between blocks), then ``<｜tool▁calls▁end｜>``. A block in DeepSeek-V3.1's
    form (``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``) is read too,
    whichever form the model writes; what the server writes (earlier calls in a prompt,
    forced calls) is in this parser's form. The closing markers may be missing at the end
    of the output (a model stopped after the arguments)."""

    name = "deepseek_v3"
    special_marker = True  # (the markers are added tokens of DeepSeek's tokenizers: kept in the text)
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    JOIN = "\n"  # between call blocks
    STARTS = (BEGIN, CALL)
    markers = (BEGIN, CALL, END)
    triggers = (BEGIN, CALL)  # (a block the model starts at CALL is read, but the constraint writes BEGIN first)
    hint = ("<｜tool▁calls▁begin｜>, one block per call, then <｜tool▁calls▁end｜>:\n<｜tool▁calls▁begin｜>"
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜><function name>\n```json\n<arguments as a JSON object>\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")

    def _parts(self, name: str) -> tuple[str, str]:
        """The text of a call block before and after its arguments."""
        return f"{self.CALL}function{self.SEP}{name}\n```json\n", f"\n```{self.CALL_END}"

    def format_calls(self, calls: list[ToolCall]) -> str:
        blocks = []
        for c in calls:
            before, after = self._parts(c.name)
            blocks.append(before + _json_text(c.arguments) + after)
        return self.BEGIN + self.JOIN.join(blocks) + self.END

    def constraint(self, tools: list[dict[str, Any]], choice: str | Collection[str] | None,
                   parallel: bool) -> CallConstraint:
        from plait.runtime.constrained.regexes import escape

        alts, unique = [], []
        for where, fn in _chosen(tools, choice):
            before, after = self._parts(fn["name"])
            args, kept = _arguments_regex(fn, where, before)
            alts.append(escape(before) + args + escape(after))
            unique += kept
        call = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return CallConstraint(escape(self.BEGIN) + _repeat_calls(call, escape(self.JOIN), parallel) + escape(self.END),
                              unique)

    def scan(self, text: str, names: set[str], final: bool) -> _Scan:
        memo = _MEMO.get()
        if memo is not None and memo.settled is not None and text.startswith(memo.settled[0]):
            m, i, calls, rest = memo.settled[1]  # (blocks before i are settled: resume after them)
            calls, rest = list(calls), list(rest)
        else:
            found = [k for k in (text.find(s) for s in self.STARTS) if k >= 0]
            if not found:
                return _Scan(len(text) if final else _hold_back(text, 0, self.markers), [], [])
            m = i = min(found)
            calls, rest = [], []
        while True:
            while True:  # the markers around the blocks, and line breaks
                i = _skip_space(text, i)
                for mark in (self.BEGIN, self.END):
                    if text.startswith(mark, i):
                        i += len(mark)
                        break
                else:
                    break
            if i >= len(text):
                break
            if not text.startswith(self.CALL, i):  # text between or after the blocks
                nxt = text.find(self.CALL, i)
                rest.append(text[i:nxt if nxt >= 0 else len(text)])  # (read by the stream only at the end)
                if nxt < 0:
                    break
                i = nxt
                continue
            seen, end = self._block(text, i, names, final)
            if seen is not None and (seen.complete or not final):
                calls.append(seen)
            elif end is not None or final:
                rest.append(text[i:end if end is not None else len(text)])
            if end is None:
                break
            i = end
            if memo is not None and not final:  # a block closed by its end marker reads the same whatever follows
                memo.settled = (text[:i], (m, i, tuple(calls), tuple(rest)))
        return _Scan(_content_before(text, m), calls, rest)

    def _block(self, text: str, j: int, names: set[str], final: bool) -> tuple[_Seen | None, int | None]:
        """The call block opening at ``text[j]``: (the call or None, the index past the
        block, or None while it may still grow). A block that is no valid call ends at
        its end marker (or the end of the text)."""
        n = len(text)
        body = j + len(self.CALL)
        sep = text.find(self.SEP, body)
        close = text.find(self.CALL_END, body)
        bad = (close + len(self.CALL_END)) if close >= 0 else (n if final else None)
        if sep < 0 or 0 <= close < sep:
            return None, bad
        k = _skip_space(text, sep + len(self.SEP))
        if k >= n:
            return None, bad
        if text[k] == "{":  # V3.1: NAME<sep>{...}
            name = text[body:sep].strip()
            fence = False
        else:  # V3 / R1: TYPE<sep>NAME\n```json\n{...}\n```
            nl = text.find("\n", k)
            if nl < 0 or 0 <= close < nl:
                return None, bad
            name = text[k:nl].strip()
            p = _skip_space(text, nl)
            p2, wait = _literal_at(text, p, "```", final)
            if p2 is None:
                return None, None if wait or (p >= n and not final) else bad
            if text.startswith("json", p2):
                p2 += 4
            elif not final and "json".startswith(text[p2:]):
                return None, None
            k = _skip_space(text, p2)
            if k >= n or text[k] != "{":
                return None, None if k >= n and not final else bad
            fence = True
        if name not in names:
            return None, bad
        a_end = json_end(text, k)
        if a_end is None:  # the arguments are being written (or broken: a call only while more may come)
            return (_Seen(j, name, text[k:], False), None) if not final else (None, bad)
        try:
            ok = isinstance(_loads(text[k:a_end]), dict)
        except ValueError:
            ok = False
        if not ok:
            return None, bad
        seen = _Seen(j, name, text[k:a_end], True)
        p = _skip_space(text, a_end)
        if fence:
            p2, wait = _literal_at(text, p, "```", final)
            if p2 is None:
                if p >= n:
                    return seen, n if final else None
                return (seen, None) if wait else (None, bad)
            p = _skip_space(text, p2)
        if p >= n:
            return seen, n if final else None
        p2, wait = _literal_at(text, p, self.CALL_END, final)
        if p2 is not None:
            return seen, p2
        if text.startswith(self.END, p):  # the calls end without this block's end marker
            return seen, p
        if wait or (not final and self.END.startswith(text[p:])):
            return seen, None
        return None, bad  # other text follows the arguments


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
    <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (no line breaks, no code fence); reads the
    V3 / R1 form too."""

    name = "deepseek_v31"
    JOIN = ""
    hint = ("<｜tool▁calls▁begin｜>, one block per call, then <｜tool▁calls▁end｜>:\n<｜tool▁calls▁begin｜>"
            "<｜tool▁call▁begin｜><function name><｜tool▁sep｜><arguments as a JSON object><｜tool▁call▁end｜>"
            "<｜tool▁calls▁end｜>")

    def _parts(self, name: str) -> tuple[str, str]:
        return f"{self.CALL}{name}{self.SEP}", self.CALL_END


class Phi4MiniJsonParser(ToolParser):
    """Phi-4-mini: ``functools`` and one JSON array of calls,
    ``functools[{"name": "f", "arguments": {...}}, ...]`` (``parameters`` read too); text
    after the array is content."""

    name = "phi4_mini_json"
    START = "functools["
    markers = (START,)
    triggers = (START,)
    hint = ('functools and a JSON array of calls:\nfunctools[{"name": "<function name>", "arguments": <arguments as a '
            'JSON object>}]')

    def cut_markup(self, tail: str) -> bool:
        # (a plain word cut by the length limit, "f" or "func", is content: only the whole
        # word "functools" or more begins a call)
        t = tail.strip()
        return t.startswith(self.START) or (len(t) >= len(self.START) - 1 and self.START.startswith(t))

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "functools" + json.dumps([{"name": c.name, "arguments": _args_value(c.arguments)} for c in calls],
                                        ensure_ascii=False)

    def scan(self, text: str, names: set[str], final: bool) -> _Scan:
        m = text.find(self.START)
        if m < 0:
            return _Scan(len(text) if final else _hold_back(text, 0, self.markers), [], [])
        calls: list[_Seen] = []
        rest: list[str] = []
        _array_calls(text, m + len(self.START), len(text), names, final, calls, rest)
        return _Scan(_content_before(text, m), calls, rest)

    def constraint(self, tools: list[dict[str, Any]], choice: str | Collection[str] | None,
                   parallel: bool) -> CallConstraint:
        from plait.runtime.constrained.regexes import escape

        call, unique = _json_call_regex(tools, choice, "arguments")
        return CallConstraint(escape(self.START) + _repeat_calls(call, ", ", parallel) + r"\]", unique)


def _find_all(text: str, sub: str) -> Iterator[int]:
    i = text.find(sub)
    while i >= 0:
        yield i
        i = text.find(sub, i + len(sub))


class PythonicParser(ToolParser):
    """The whole output (outside optional ``<|python_start|>``/``<|python_end|>``) is a
    list of calls with keyword arguments whose values are literals (Python's or JSON's
    ``true``/``false``/``null``). Anything else is content; a call list after text is
    content too."""

    name = "pythonic"
    OPEN, CLOSE = "<|python_start|>", "<|python_end|>"
    markers = (OPEN,)
    hint = "a Python list of calls with keyword arguments, and nothing else:\n[func_name1(param1=value1, param2=value2), func_name2(param=value)]"

    def format_calls(self, calls: list[ToolCall]) -> str:
        def one(c: ToolCall) -> str:
            args = _args_value(c.arguments)
            if not isinstance(args, dict):
                return f"{c.name}()"
            return f"{c.name}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items()) + ")"

        return "[" + ", ".join(one(c) for c in calls) + "]"

    def _body(self, text: str) -> tuple[int, int]:
        a, b = 0, len(text)
        s = text.strip()
        if s.startswith(self.OPEN):
            a = text.find(self.OPEN) + len(self.OPEN)
        if s.endswith(self.CLOSE):
            b = text.rfind(self.CLOSE)
        return a, b

    def scan(self, text: str, names: set[str], final: bool) -> _Scan:
        s = text.lstrip()
        maybe = s == "" or s.startswith("[") or self.OPEN.startswith(s[:len(self.OPEN)]) or s.startswith(self.OPEN)
        if not maybe:
            return _Scan(len(text), [], [])
        if not final:
            return _Scan(0, [], [])  # held until the end: a list of calls is known only when closed
        a, b = self._body(text)
        calls = _python_calls(text[a:b], names)
        if calls is None:
            return _Scan(len(text), [], [])
        return _Scan(0, [_Seen(k, n, args, True) for k, (n, args) in enumerate(calls)], [])

    def constraint(self, tools: list[dict[str, Any]], choice: str | Collection[str] | None,
                   parallel: bool) -> CallConstraint:
        from plait.runtime.constrained.regexes import escape
        from plait.runtime.constrained.unique_items import guarded_regex

        alts, unique = [], []
        for at, fn in _chosen(tools, choice):
            if not _python_name(fn["name"]):
                raise RequestError(f"{at}.name {fn['name']!r} is not a Python identifier, so the {self.name} tool "
                                   f"parser cannot read a call to it (the output would be no call)", at + ".name")
            where = at + ".parameters"
            params = fn.get("parameters") or {}
            allowed = {"type", "properties", "required", "additionalProperties", "title", "description", "$schema"}
            extra = set(params) - allowed
            props = params.get("properties") or {}
            if extra or params.get("type", "object") != "object" or not isinstance(props, dict):
                raise RequestError(f"{where} cannot be enforced as Python keyword arguments: only an object schema "
                                   f"with properties/required is supported here (found {sorted(extra) or params.get('type')})",
                                   where)
            required = params.get("required") or []
            pairs = []
            for key, sub in props.items():
                if not _python_name(key):
                    raise RequestError(f"{where}: property {key!r} is not a Python identifier (or is a keyword), so "
                                       f"it cannot be a keyword argument", where)
                try:
                    value, sites = guarded_regex(sub)
                except ValueError as e:
                    raise RequestError(f"{where}.properties.{key} cannot be enforced: {e}", where) from None
                if sites:  # (the value follows "key=": that text may recur, which only over-restricts)
                    unique.append((key + "=", sites))
                pairs.append((escape(key) + "=" + value, key in required))
            alts.append(escape(fn["name"]) + r"\(" + _keyword_list(pairs) + r"\)")
        call = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return CallConstraint(r"\[" + _repeat_calls(call, ", ", parallel) + r"\]", unique)


def _python_name(name: str) -> bool:
    """``name`` can be a function's or a keyword argument's name in a call ``ast`` reads
    (``API-post-search`` and ``from`` cannot)."""
    return name.isidentifier() and not keyword.iskeyword(name)


def _keyword_list(pairs: list[tuple[str, bool]]) -> str:
    """Keyword arguments in declared order; optional ones may be left out."""
    def rest(i: int, first: bool) -> str:
        if i == len(pairs):
            return ""
        pair, req = pairs[i]
        if not first:
            return (", " + pair if req else "(?:, " + pair + ")?") + rest(i + 1, False)
        if req:
            return pair + rest(i + 1, False)
        alt = rest(i + 1, True)
        return "(?:" + pair + rest(i + 1, False) + (")?" if not alt else "|" + alt + ")")

    return rest(0, True)


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST, src: str) -> Any:
    """A literal's value; JSON's true/false/null are accepted as names, and a
    double-quoted string is read as JSON reads it when it can be (``\\/`` is ``/``)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, src) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_key(k, src): _literal(v, src) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        seg = ast.get_source_segment(src, node) or ""
        if seg.startswith('"'):
            try:
                return json.loads(seg)
            except ValueError:
                pass
    v = ast.literal_eval(node)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    raise ValueError(f"unsupported literal {type(v).__name__}")


def _key(node: ast.AST | None, src: str) -> str:
    v = _literal(node, src) if node is not None else None
    if not isinstance(v, str):
        raise ValueError("dict keys must be strings")
    return v


def _python_calls(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    s = text.strip()
    if not (s.startswith("[") and s.endswith("]")) or len(s) > 1_000_000:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in the model's strings
            tree = ast.parse(s, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    out = []
    for call in tree.body.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args \
                or call.func.id not in names:
            return None
        try:
            kwargs = {kw.arg: _literal(kw.value, s) for kw in call.keywords if kw.arg is not None}
            if len(kwargs) != len(call.keywords):
                return None
            out.append((call.func.id, json.dumps(kwargs, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    return out


# -- streaming --------------------------------------------------------------------------------------
class ToolStream:
    """Incremental parsing of one output. ``feed(delta)`` and ``finish()`` return
    OpenAI chat deltas: ``{"content": str}`` and ``{"tool_calls": [{"index", "id",
    "type", "function": {"name", "arguments": ""}}]}`` when a call's name is known,
    then ``{"tool_calls": [{"index", "function": {"arguments": fragment}}]}``.

    Content before a possible call is held back (whitespace, a partial start marker)
    until it is known not to be a call. A call streams from when its name is known;
    arguments stream as written. What ``finish`` adds makes the concatenated deltas
    equal :meth:`ToolParser.parse` of the whole text (the ids aside), except for a
    call whose name streamed and whose text turned out invalid (cut off by the length
    limit, or broken JSON): its arguments stop where they were sent, and it is marked
    :attr:`ToolCall.cut` in :attr:`calls` (so the turn does not end with
    finish_reason ``tool_calls``, as the parse, which finds no call there, does not).
    With ``finish(cut=True)`` (the length limit cut the output) such a call stays a
    call, as ``parse(text, tools, cut=True)`` reads it, and its text is not sent as
    content.
    """

    def __init__(self, parser: ToolParser, tools: list[dict[str, Any]]) -> None:
        self.parser = parser
        self.names = _names(tools)
        self.text = ""
        self.sent_content = 0  # chars of text[:content_end] sent as content
        self.index: dict[int, int] = {}  # call key -> stream index
        self.sent_args: dict[int, int] = {}  # call key -> chars of arguments sent
        self.calls: list[ToolCall] = []  # calls in stream order, as sent so far
        self.memo = _Memo()  # what scans of this text keep for the next one

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        return self._advance(False)

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        return self._advance(True, cut)

    def _advance(self, final: bool, cut: bool = False) -> list[dict[str, Any]]:
        closed = final and not cut  # no call can still be in progress
        token = _MEMO.set(self.memo)  # (the text only grows: scans of it resume, json_end)
        try:
            s = self.parser.scan(self.text, self.names, closed)
        except Exception:  # noqa: BLE001 - a parser bug must not fail the stream
            s = _Scan(len(self.text) if final else self.sent_content, [], [])
        finally:
            _MEMO.reset(token)
        out: list[dict[str, Any]] = []
        has_calls = bool(self.index) or any(c.complete or not closed for c in s.calls)
        content_end = s.content_end if has_calls else (len(self.text) if final else s.content_end)
        if final and cut and not has_calls and not s.rest and self.parser.cut_markup(self.text[s.content_end:]):
            content_end = s.content_end  # a call cut off before its name: markup (as parse reads it)
        if content_end > self.sent_content:
            out.append({"content": self.text[self.sent_content:content_end]})
            self.sent_content = content_end
        valid: set[int] = set()  # (final: the keys of the calls the whole text holds)
        for c in s.calls:
            if c.key not in self.index:
                k = self.index[c.key] = len(self.index)
                self.sent_args[c.key] = 0
                self.calls.append(ToolCall(self.parser.new_id(), c.name, ""))
                out.append({"tool_calls": [{"index": k, "id": self.calls[k].id, "type": "function",
                                            "function": {"name": c.name, "arguments": ""}}]})
            k, sent = self.index[c.key], self.sent_args[c.key]
            if final:
                self.calls[k].cut = not c.complete
                valid.add(c.key)
            if len(c.args) > sent and c.args.startswith(self.calls[k].arguments):
                frag = c.args[sent:]
                self.sent_args[c.key] = len(c.args)
                self.calls[k].arguments = c.args
                out.append({"tool_calls": [{"index": k, "function": {"arguments": frag}}]})
        if final:
            for key, k in self.index.items():
                if key not in valid:  # streamed, but its text did not end as a call (broken JSON after it)
                    self.calls[k].cut = True
        if final and has_calls and s.rest:
            tail = "".join(self.parser.rest_kept(s.rest, cut)).strip()
            if tail:
                out.append({"content": ("\n" if self.sent_content else "") + tail})
        return out


# -- registry, detection, generic prompt ------------------------------------------------------------
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser, GraniteParser,
                        DeepSeekV3Parser, DeepSeekV31Parser, Phi4MiniJsonParser)
}


def get_tool_parser(name: str) -> ToolParser:
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser={name!r} is unknown; allowed: {', '.join(TOOL_PARSERS)}")
    return cls()


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, from the markers it writes; None
    when it shows none (no tool support, or a format plait does not know)."""
    if not chat_template:
        return None
    t = chat_template
    if "<｜tool▁calls▁begin｜>" in t or "<｜tool▁call▁begin｜>" in t:
        # V3 / R1 blocks fence their arguments (```json); V3.1's do not
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if "<|tool_call|>" in t:
        return "granite"
    if "functools[" in t or ("<|tool|>" in t and "<|/tool|>" in t):
        return "phi4_mini_json"  # (Phi-4-mini's own template: tools between <|tool|> and <|/tool|>)
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_start|>" in t or ("[func_name1(" in t) or "func_name1(param_name1=" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ("<|eom_id|>" in t and "parameters" in t) or '"parameters": dictionary' in t:
        return "llama3_json"
    return None


def generic_tools_prompt(tools: list[dict[str, Any]], parser: str = "hermes") -> str:
    """The system text that offers ``tools`` to a model whose chat template has no tool
    support: the functions as JSON, and how a call is written in ``parser``'s format
    (``hermes`` by default, the format the server then parses)."""
    lines = [
        "You can call functions to help with the user's request. The functions are described here as JSON:",
        "<tools>",
        *(json.dumps({"type": "function", "function": fn}, ensure_ascii=False) for fn in _functions(tools)),
        "</tools>",
        "To call functions, answer with " + get_tool_parser(parser).hint,
        "Results of calls come back in <tool_response> blocks. When you can answer without a call, answer in plain text.",
    ]
    return "\n".join(lines)
