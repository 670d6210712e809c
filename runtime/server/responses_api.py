"""OpenAI's Responses API (``POST /v1/responses``), on the chat path.

A request becomes one chat turn (:func:`openai_api.chat_request`): ``instructions`` as
the system message, ``input`` (text, or items: messages, ``function_call``,
``function_call_output``) after the conversation of ``previous_response_id``, flat
function ``tools``, ``tool_choice``, ``text.format`` for JSON output. The output is a
list of items (``reasoning``, ``message``, ``function_call``), non-streamed or as the
API's events (``response.created`` ... ``response.completed``).

Continuation is stateless for the client and bounded here: the server keeps the
conversations of its last :data:`STORE_SIZE` stored responses (``store`` true, the
default), holding at most :data:`STORE_BYTES`, in memory, least recently used first out;
an id it does not hold is a 404 naming ``previous_response_id``. ``GET
/v1/responses/{id}`` returns a stored response object, ``GET
/v1/responses/{id}/input_items`` pages its input items (:func:`input_items_page`) and
``DELETE /v1/responses/{id}`` forgets it (the openai client's ``responses.retrieve`` /
``responses.input_items.list`` / ``responses.delete``); ``POST
/v1/responses/{id}/cancel`` says why it cannot be cancelled (:func:`cancel`). Nothing
survives a restart.

``include: ["message.output_text.logprobs"]`` (with ``top_logprobs`` alternatives) puts
the output tokens' logprobs on the message's ``output_text``, as chat completions'
``logprobs.content`` has them: every token of the output, in order (the parsers split
text, not tokens, so a response with reasoning or tool calls has theirs counted in too).
Streamed, each ``response.output_text.delta`` carries the tokens written since the last
one.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import QueryParams

from plait import protocol as P
from plait.errors import RequestError
from plait.runtime.server import openai_api as oa
from plait.runtime.server.front import Front

STORE_SIZE = 256  # responses whose conversations a server keeps for previous_response_id
# ... and the most their requests and outputs may hold together: a response's request may
# carry up to a 64 MiB body the prompt never shows (a reasoning item's encrypted_content, a
# text.format schema's annotations), so 256 of them held ~16 GiB, and the front was killed
STORE_BYTES = 256 * 1024 * 1024

# fields of the openai client naming features this server lacks: accepted as null
NULL_ONLY = {"conversation": "no stored conversations; continue one with previous_response_id",
             "prompt": "no stored prompt templates", "context_management": "no context compaction",
             "moderation": "no moderation", "access_programs": "no access programs",
             "image": "it reads text only"}

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "previous_response_id",
          "text", "max_output_tokens", "temperature", "top_p", "stream", "store", "metadata", "user", "seed",
          "reasoning", "truncation", "include", "service_tier", "top_k", "min_p", "repetition_penalty",
          "frequency_penalty", "presence_penalty", "stop", "cache_salt", "prompt_cache_key", "safety_identifier",
          "max_reasoning_chars", "background", "max_tool_calls", "top_logprobs", "logit_bias"} | set(NULL_ONLY)

LOGPROBS = "message.output_text.logprobs"
# The openai client's ResponseIncludable. Only LOGPROBS changes a response here. The others are
# accepted and ignored because ignoring them is harmless: each adds to an item this server never
# writes (built-in tool calls, image inputs: refused in tools and input), except
# reasoning.encrypted_content, which agent clients send with store=false to replay reasoning; here
# reasoning items are in clear text, and a replayed one's text goes with the assistant turn after it
# (input_messages).
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")


# stream events that repeat the whole output so far (with its logprobs, when asked for)
WHOLE_OUTPUT_EVENTS = frozenset({"response.output_text.done", "response.content_part.done",
                                 "response.output_item.done", "response.completed", "response.incomplete"})


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Stored:
    """One stored response."""

    messages: list[dict[str, Any]]  # its conversation, output included (previous_response_id)
    response: dict[str, Any] | None  # its response object (GET /v1/responses/{id})
    input_items: list[dict[str, Any]]  # its input as items, those of previous_response_id first (input_items)
    # bytes it holds: its request body's and output text's, and those of the response it
    # continued (whose input items it lists: they stay in memory while it is held)
    size: int = 0


class ResponseStore:
    """The last ``capacity`` stored responses (:class:`Stored`), by id, holding at most
    ``max_bytes`` together (a response larger than that alone is not held); LRU. One per
    server; written only by the routes, once a response completes (and by ``DELETE``).
    Read by requests parsed in worker threads too (a large body, a schema), so every
    method holds the lock: an entry evicted between a reader's lookup and its
    ``move_to_end`` was a ``KeyError``, a 500."""

    def __init__(self, capacity: int = STORE_SIZE, max_bytes: int = STORE_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0  # the sizes of the held responses, summed
        self._lock = threading.Lock()

    def get(self, rid: str) -> list[dict[str, Any]] | None:
        """The conversation of a stored response (None: not held)."""
        with self._lock:
            entry = self._items.get(rid)
            if entry is None:
                return None
            self._items.move_to_end(rid)
            return entry.messages

    def _entry(self, rid: str) -> Stored | None:
        with self._lock:
            return self._items.get(rid)

    def response(self, rid: str) -> dict[str, Any] | None:
        """The response object of a stored response (None: not held)."""
        entry = self._entry(rid)
        return None if entry is None else entry.response

    def input_items(self, rid: str) -> list[dict[str, Any]] | None:
        """The input items of a stored response (None: not held)."""
        entry = self._entry(rid)
        return None if entry is None else entry.input_items

    def context_items(self, rid: str) -> list[dict[str, Any]]:
        """What a response continuing ``rid`` was given before its own input: ``rid``'s
        input items and output items (none when not held)."""
        entry = self._entry(rid)
        if entry is None:
            return []
        return entry.input_items + (entry.response or {}).get("output", [])

    def size(self, rid: str) -> int:
        """The bytes stored response ``rid`` holds (0: not held)."""
        entry = self._entry(rid)
        return 0 if entry is None else entry.size

    def put(self, rid: str, messages: list[dict[str, Any]], obj: dict[str, Any] | None = None,
            input_items: list[dict[str, Any]] | None = None, size: int = 0) -> None:
        with self._lock:
            self._pop(rid)
            if size > self.max_bytes:  # alone past the budget: not held (the others stay)
                return
            self._items[rid] = Stored(messages, obj, input_items or [], size)
            self._bytes += size
            while len(self._items) > self.capacity or self._bytes > self.max_bytes:
                self._bytes -= self._items.popitem(last=False)[1].size

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._pop(rid)

    def _pop(self, rid: str) -> bool:
        entry = self._items.pop(rid, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    @property
    def held_bytes(self) -> int:
        """The sizes of the held responses, summed (at most ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def kept(self) -> str:
        """What this store keeps, in words (for the 404 of an id it does not hold)."""
        return (f"it keeps the last {self.capacity} stored responses, in memory, up to "
                f"{self.max_bytes // (1024 * 1024)} MiB of requests and outputs together")


def not_held(store: ResponseStore, rid: str) -> RequestError:
    """The 404 for a response id this server does not hold."""
    return RequestError(f"response_id={rid!r} is not held by this server ({store.kept()}; store=false responses "
                        "are not kept)", "response_id", 404)


# -- request ----------------------------------------------------------------------------------
def _content_text(content: Any, where: str, role: str = "user", key: str = "content") -> str:
    """A message's content (``key`` of item ``where``: a function_call_output's
    ``output`` too) as text: a string or text parts (and, in an assistant message,
    ``refusal`` parts, whose text it said: an output replayed as input)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "refusal" and role == "assistant":
                if not isinstance(part.get("refusal"), str):
                    raise RequestError(f"{where}.{key}[{k}].refusal must be a string", "input")
                parts.append(part["refusal"])
                continue
            if kind not in ("input_text", "output_text", "text"):
                what = f"a {kind!r} part" if isinstance(kind, str) else repr(part)[:80]
                raise RequestError(f"{where}.{key}[{k}] is {what}, which is not supported (this server reads text "
                                   f"only); allowed: input_text and output_text parts", "input")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.{key}[{k}].text must be a string", "input")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.{key} must be a string or an array of text parts", "input")


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A replayed ``reasoning`` item's text: its ``reasoning_text`` content (what this
    server writes), else its summary's text ("" for an item that holds only OpenAI's
    ``encrypted_content``)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise RequestError(f"{where}: a reasoning item's content and summary must be arrays of "
                           f"{{\"type\": ..., \"text\": str}} parts", "input")
    return "".join(p["text"] for p in parts)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string or items) as chat messages; an assistant's consecutive
    ``function_call`` items become one message with ``tool_calls``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input is required: a string or a non-empty array of items", "input")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object (a message, function_call or function_call_output)", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role={role!r} is invalid; allowed: user, system, developer, assistant",
                                   "input")
            out.append({"role": role, "content": _content_text(item.get("content"), where, role)})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise RequestError(f"{where}: a function_call needs call_id, name and arguments (strings)", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and not reasoning:  # the calls of the message just before
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise RequestError(f"{where}: a function_call_output needs call_id (a string) and output (a string "
                                   f"or an array of input_text parts)", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _content_text(output, where, key="output")})
        elif kind == "reasoning":
            # its text goes with the assistant turn it led to (reasoning_content), which
            # the template shows or drops (Qwen3's shows a tool loop's thinking)
            reasoning.append(_reasoning_text(item, where))
        else:
            raise RequestError(f"{where}.type={kind!r} is not supported; allowed: message, function_call, "
                               f"function_call_output, reasoning", "input")
    if not out:  # (it read "messages ... got an empty array" for an input of one reasoning item)
        raise RequestError(f"input holds only reasoning items ({len(items)}), which go with the turn they led to: "
                           f"there is no message to answer; allowed: at least one message, function_call or "
                           f"function_call_output item", "input")
    return out


def _text_parts(content: Any, kind: str) -> list[dict[str, Any]]:
    """A (checked) message content as a list of ``kind`` parts (an assistant's refusal
    parts stay refusal parts)."""
    parts = [{"text": content}] if isinstance(content, str) else content
    return [{"type": "refusal", "refusal": p["refusal"]} if p.get("type") == "refusal" else
            {"type": kind, "text": p["text"], **({"annotations": []} if kind == "output_text" else {})} for p in parts]


def stored_input_items(store: ResponseStore, prev: str | None, items: Any) -> list[dict[str, Any]]:
    """What ``GET /v1/responses/{id}/input_items`` lists for a response continuing
    ``prev`` (None: none) with ``input`` ``items`` (checked by :func:`input_messages`):
    ``prev``'s context (:meth:`ResponseStore.context_items`), then ``items`` in OpenAI's
    shapes: each with an ``id`` (the client's, else a new one) and a ``status``; text
    content as parts."""
    out = store.context_items(prev) if prev is not None else []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items:
        kind = item.get("type", "message")
        given = item.get("id") if isinstance(item.get("id"), str) else None
        if kind == "message":
            assistant = item["role"] == "assistant"
            out.append({"type": "message", "id": given or _id("msg"), "role": item["role"], "status": "completed",
                        "content": _text_parts(item["content"], "output_text" if assistant else "input_text")})
        elif kind == "function_call":
            out.append({**_call_item(item["call_id"], item["name"], item["arguments"]), "id": given or _id("fc")})
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "id": given or _id("fco"), "call_id": item["call_id"],
                        "output": item["output"], "status": "completed"})
        else:  # reasoning, as given
            out.append({"summary": [], **item, "id": given or _id("rs")})
    return out


def cancel(store: ResponseStore, rid: str) -> RequestError:
    """``POST /v1/responses/{id}/cancel`` (the openai client's ``responses.cancel``):
    only a background response can be cancelled, and this server runs none (``background``
    is refused), so a held id is a 400 saying so; another one is the 404 of :func:`not_held`."""
    if store.response(rid) is None:
        return not_held(store, rid)
    return RequestError(f"response {rid!r} cannot be cancelled: only background responses can be, and this server "
                        "runs none (background=true is not supported); it has already finished", "response_id")


def input_items_page(store: ResponseStore, rid: str, query: QueryParams) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of a stored response's input items
    (those of the response it continued first, as the model was given them; the
    instructions are not an item) as OpenAI's list object. ``query``: ``limit`` (1-100,
    20), ``order`` (``desc``, the default, newest first, or ``asc``), ``after`` (the id
    of the item before the page), ``include`` (checked; input items have nothing to add)."""
    items = store.input_items(rid)
    if items is None:
        raise not_held(store, rid)
    check_include(query.getlist("include") + query.getlist("include[]"))
    raw = query.get("limit", "20")
    if not (raw.isdigit() and 1 <= int(raw) <= 100):
        raise RequestError(f"limit={raw!r} is invalid; allowed: an integer in [1, 100]", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError(f"order={order!r} is invalid; allowed: 'asc' or 'desc'", "order")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    start = 0
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise RequestError(f"after={after!r} is not an input item of response {rid!r}", "after")
        start = ids.index(after) + 1
    page = ordered[start: start + int(raw)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(ordered)}


def check_include(include: list[Any]) -> bool:
    """``include`` checked against :data:`INCLUDABLE`; whether it asks for logprobs."""
    for k, v in enumerate(include):
        if v not in INCLUDABLE:
            raise RequestError(f"include[{k}]={oa._short(v)} is invalid; allowed: "
                               f"{', '.join(repr(x) for x in INCLUDABLE)}", "include")
    return LOGPROBS in include


@dataclass
class ResponseJob:
    """One Responses request: the chat job plus what the response object echoes."""

    job: oa.Job
    messages: list[dict[str, Any]]  # the conversation given to the model
    body: dict[str, Any]
    store: bool
    input_items: list[dict[str, Any]]  # what GET .../input_items lists once stored
    logprobs: oa.LogprobFormatter | None  # include asked for the output's logprobs
    body_bytes: int = 0  # what storing it holds, with the output: its body's and its context's bytes
    created: int = field(default_factory=lambda: int(time.time()))


def parse_response_request(front: Front, store: ResponseStore, body: dict[str, Any],
                           body_bytes: int = 0) -> ResponseJob:
    """A Responses request (``body``, of ``body_bytes`` bytes as sent) as its job."""
    oa.check_fields(body, FIELDS)
    model = oa.check_model(front, body)
    oa.check_null_only(body, NULL_ONLY)
    oa.stream_fields(body, ("include_obfuscation",))
    if oa.get_field(body, "background", "bool", False):  # accepted at its default: clients send it
        raise RequestError("background=true is not supported by this server; allowed: false", "background")
    want_lp = check_include(oa.get_field(body, "include", "list", []))
    top = oa.get_field(body, "top_logprobs", "int", None, 0, oa.MAX_TOP_LOGPROBS)
    if top is not None and not want_lp:
        raise RequestError(f"top_logprobs needs include to list {LOGPROBS!r} (the logprobs it adds alternatives to)",
                           "top_logprobs")
    reasoning = oa.get_field(body, "reasoning", "dict")  # a hint, as chat's reasoning_effort
    if reasoning is not None:
        oa.check_reasoning_effort(reasoning.get("effort"), "reasoning.effort")
    oa.get_field(body, "max_tool_calls", "int", None, 1)  # accepted and ignored (no built-in tools), but typed
    truncation = oa.get_field(body, "truncation", "str")
    if truncation not in (None, "auto", "disabled"):
        raise RequestError(f"truncation={truncation!r} is invalid; allowed: 'auto' or 'disabled'", "truncation")
    prev = oa.get_field(body, "previous_response_id", "str")
    history: list[dict[str, Any]] = []
    if prev is not None:
        found = store.get(prev)
        if found is None:
            raise RequestError(f"previous_response_id={prev!r} is not held by this server ({store.kept()})",
                               "previous_response_id", 404)
        # (the stored conversation holds no instructions: they are not carried over, while
        # the system and developer messages of earlier inputs are, as OpenAI keeps them)
        history = found
    new = input_messages(body.get("input"))
    items = stored_input_items(store, prev, body["input"])
    instructions = oa.get_field(body, "instructions", "str")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + new
    text = oa.get_field(body, "text", "dict")
    if text is not None:
        unknown = sorted(set(text) - {"format", "verbosity"})
        if unknown:
            raise RequestError(f"text has the key {oa._short(unknown[0])}, which is not a text option; allowed: "
                               f"format, verbosity", "text")
        oa.check_verbosity(text, "text.verbosity")
    fmt = oa.get_field(text, "format", "dict") if text is not None else None
    for name in ("tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p"):  # repeated in the response
        oa.check_echoable(body.get(name), name)
    oa.check_echoable(fmt, "text.format")
    schema = oa.response_format_schema(fmt, "text.format")
    try:  # the chat path's checks, on the merged conversation, whose errors name the chat's field
        checked = oa._messages({"messages": messages})
        chat = oa.chat_request(front, body, checked, schema, "text.format", nested_tools=False)
    except RequestError as e:
        if e.param != "messages":
            raise
        bare = e.message.startswith("messages ")  # (an indexed one counts the instructions and history too)
        raise e.with_param("input", "input" + e.message[len("messages"):] if bare else e.message) from None
    sp = oa.sampling_params(front, body, len(chat.ids), None, "max_output_tokens", least=1)
    sp = chat.sampling(sp)
    sp.pop("n", None)
    stream = oa.get_field(body, "stream", "bool", False)
    rid = _id("resp")
    req = P.GenerateRequest(rid=front.new_rid("resp"), input_ids=chat.ids, sampling_params=sp, stream=stream,
                            cache_salt=oa.get_field(body, "cache_salt", "str"), return_logprob=want_lp,
                            top_logprobs_num=top or 0)
    job = oa.Job(True, rid, model, int(time.time()), [req], 1, stream, prompt_tokens=[len(chat.ids)],
                 constraint_field=chat.constraint_field, output=chat.output,
                 logprobs=(top or 0) if want_lp else None)
    return ResponseJob(job, checked, body, oa.get_field(body, "store", "bool", True), items,
                       oa.LogprobFormatter(front) if want_lp else None,
                       body_bytes + (store.size(prev) if prev is not None else 0))


# -- response ---------------------------------------------------------------------------------
def _message_item(text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A chat message as Responses output items: reasoning, text (with ``logprobs``),
    calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"], logprobs=logprobs))
    for c in message.get("tool_calls", []):
        items.append(_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    return items


def _echo_reasoning(reasoning: Any) -> dict[str, Any] | None:
    """The request's ``reasoning`` as OpenAI repeats it (``effort``, ``summary``): a hint
    here, checked when the request came, as chat's ``reasoning_effort``."""
    if not isinstance(reasoning, dict):
        return None
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def conversation(rj: ResponseJob, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation after this response (what a continuation starts from), without
    the request's ``instructions`` (its first message when given: a continuation has its
    own). Input messages of role system or developer stay in it: a continuation once
    dropped every system message, so an agent's developer prompt vanished after one turn."""
    msgs = [dict(m) for m in rj.messages[1 if rj.body.get("instructions") else 0:]]
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    reasoning = "".join(p["text"] for it in items if it["type"] == "reasoning" for p in it["content"])
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msgs + [msg]


def response_object(rj: ResponseJob, items: list[dict[str, Any]], meta: dict[str, Any] | None,
                    status: str, reasoning: int = 0) -> dict[str, Any]:
    """The response object; ``meta``: the result's (None while in progress: no usage
    yet), ``reasoning``: its output tokens of reasoning (:meth:`oa.ChatOutput.reasoning_tokens`)."""
    body = rj.body
    fr = oa.finish_reason(meta or {})
    if status == "completed" and fr == "length":
        status = "incomplete"
    elif status == "completed" and fr == "abort":  # /abort_request, a shutdown: not a finished turn
        status = "cancelled"
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    completion = (meta or {}).get("completion_tokens", 0)
    prompt = sum(rj.job.prompt_tokens)
    return {
        "id": rj.job.id, "object": "response", "created_at": rj.created, "status": status,
        "model": rj.job.model, "output": items, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": {"format": text.get("format") or {"type": "text"}}, "store": rj.store,
        "metadata": body.get("metadata") or {}, "truncation": "disabled",
        # (truncation: what was done, whatever was asked; "auto" is accepted, but a
        # conversation past the context is refused, not cut from its start)
        "reasoning": _echo_reasoning(body.get("reasoning")),
        # the limits as set, as OpenAI repeats them (max_tool_calls counts built-in tool calls:
        # there are none here, so it always holds)
        "max_tool_calls": body.get("max_tool_calls"), "top_logprobs": body.get("top_logprobs"),
        "usage": None if meta is None else {
            "input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            # (cache_write_tokens: the openai client's ResponseUsage requires it; here the prompt
            # tokens computed, which the prefix cache then holds)
            "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0),
                                     "cache_write_tokens": max(prompt - meta.get("cached_tokens", 0), 0)},
            "output_tokens_details": {"reasoning_tokens": reasoning},
        },
    }


def completed(rj: ResponseJob, items: list[dict[str, Any]], result: P.GenerateResult) -> dict[str, Any]:
    """The completed response of the engine's ``result``, whose output is ``items``."""
    reasoning = rj.job.output.reasoning_tokens(result.output_ids) if rj.job.output is not None else 0
    return response_object(rj, items, result.meta_info, "completed", reasoning)


def keep(store: ResponseStore, rj: ResponseJob, obj: dict[str, Any], result: P.GenerateResult) -> dict[str, Any]:
    """``obj`` (the completed response of ``result``), stored for continuation when
    ``store``; on the event loop, the store's one writer."""
    if rj.store:
        store.put(rj.job.id, conversation(rj, obj["output"]), obj, rj.input_items, rj.body_bytes + len(result.text))
    return obj


def _mark_cut(items: list[dict[str, Any]], cut: bool) -> None:
    """The length limit or a stop string cut the output: its last item (a message, or a
    call whose arguments stop where the cut fell) is ``incomplete``, as OpenAI marks
    it (the response itself is ``incomplete`` only for the length limit). Callers pass
    ``cut`` false when the output's calls are all whole: the cut then fell in a call
    dropped before its name, and the last call is complete."""
    if cut and items:
        items[-1]["status"] = "incomplete"


def logprob_entries(obj: dict[str, Any]) -> int:
    """The logprob entries a response object carries (each token's, and its alternatives)."""
    return sum(1 + len(lp.get("top_logprobs", [])) for it in obj.get("output", []) if it.get("type") == "message"
               for part in it.get("content", []) for lp in part.get("logprobs") or [])


def build_response(rj: ResponseJob, result: P.GenerateResult) -> dict[str, Any]:
    """The non-streamed response of ``result`` (not stored: :func:`keep`). Pure, so a
    large one (logprobs) is built in a worker thread."""
    cut = oa.output_cut(result.meta_info)
    message, whole_calls = (rj.job.output or oa.ChatOutput()).message(result.text, cut)
    lps = rj.logprobs.output(result.meta_info, rj.job.logprobs or 0) if rj.logprobs is not None else None
    items = output_items(message, lps)
    _mark_cut(items, cut and not whole_calls)
    return completed(rj, items, result)


def response(store: ResponseStore, rj: ResponseJob, result: P.GenerateResult) -> dict[str, Any]:
    """The non-streamed response of ``result``, stored when ``store``."""
    return keep(store, rj, build_response(rj, result), result)


class _Events:
    """Chat deltas turned into the Responses API's stream events, in order; the items
    they build are the response's output."""

    def __init__(self, rj: ResponseJob) -> None:
        self.rj = rj
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, int] = {}  # tool-call stream index -> output index
        self.unsent: list[dict[str, Any]] = []  # logprobs of tokens written since the last text delta

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.items.append(item)
        self.open = item
        i = len(self.items) - 1
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        if item["type"] == "reasoning":
            added["content"] = []
        out.append(self.event("response.output_item.added", output_index=i, item=added))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        elif item["type"] == "reasoning":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                                  part={"type": "reasoning_text", "text": ""}))
        return out

    def close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = self.items.index(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self.unsent
            self.unsent = []
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=part["text"], logprobs=part["logprobs"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=part["text"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def deltas(self, deltas: list[dict[str, Any]], logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events of one engine chunk's ``deltas``; ``logprobs``: its tokens' (the
        first text delta since carries them)."""
        self.unsent += logprobs
        out: list[dict[str, Any]] = []
        for d in deltas:
            if d.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open(_reasoning_item(""))
                assert self.open is not None
                self.open["content"][0]["text"] += d["reasoning_content"]
                out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=d["reasoning_content"]))
            if d.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._open(_message_item(""))
                assert self.open is not None
                part = self.open["content"][0]
                part["text"] += d["content"]
                part["logprobs"] += self.unsent
                out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=d["content"],
                                      logprobs=self.unsent))
                self.unsent = []
            for tc in d.get("tool_calls", []):
                if "id" in tc:
                    out += self._open(_call_item(tc["id"], tc["function"]["name"], ""))
                    self.calls[tc["index"]] = len(self.items) - 1
                frag = tc["function"].get("arguments", "")
                if frag:
                    item = self.items[self.calls[tc["index"]]]
                    item["arguments"] += frag
                    out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.calls[tc["index"]], delta=frag))
        return out


async def stream(store: ResponseStore, rj: ResponseJob, events: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """The stream events of one response, from the engine's chunks and result."""
    ev = _Events(rj)
    cs = (rj.job.output or oa.ChatOutput()).stream()
    try:
        async for msg in events:
            if ev.seq == 0:  # once the engine answered: a request it refuses at admission is a 400, not a stream
                yield ev.event("response.created", response=response_object(rj, [], None, "in_progress"))
                yield ev.event("response.in_progress", response=response_object(rj, [], None, "in_progress"))
            for e in _engine_events(store, rj, ev, cs, msg):
                yield e
    except RequestError as e:
        if ev.seq == 0:
            raise
        # OpenAI's error event; the "error" object (as chat streams write it) makes the
        # openai client raise it
        err = oa.openai_error(e, rj.job)
        yield ev.event("error", code=err.error_type, message=err.message, param=err.param,
                       error=P.error_body(err)["error"])


def _engine_events(store: ResponseStore, rj: ResponseJob, ev: _Events, cs: oa.ChatStream,
                   msg: P.StreamChunk | P.GenerateResult) -> list[dict[str, Any]]:
    """The stream events of one engine message: a chunk's deltas, or the last ones and
    the response, for the result."""
    fmt, top = rj.logprobs, rj.job.logprobs or 0
    if isinstance(msg, P.StreamChunk):
        return ev.deltas(cs.feed(msg.text), fmt.output(msg.meta, top) if fmt is not None else [])
    cut = oa.output_cut(msg.meta_info)
    out = ev.deltas(cs.finish(cut), [])
    _mark_cut(ev.items, cut and not cs.has_calls)
    for k in cs.cut_calls:  # (a call that streamed, then was no call: not a whole one)
        ev.items[ev.calls[k]]["status"] = "incomplete"
    out += ev.close()
    parts = [it["content"][0] for it in ev.items if it["type"] == "message"]
    if fmt is not None and parts:  # every token, as non-streamed: those after the last text delta too
        placed = sum(len(p["logprobs"]) for p in parts)
        tail = {k: msg.meta_info[k][placed:] for k in ("output_token_logprobs", "output_top_logprobs")
                if isinstance(msg.meta_info.get(k), list)}  # (formatted alone: the rest was, as it streamed)
        parts[-1]["logprobs"] += fmt.output(tail, top)
    done = keep(store, rj, completed(rj, ev.items, msg), msg)
    # (the API has no event for a cancelled response: it ends as one that did not finish)
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    return out + [ev.event(kind, response=done)]
