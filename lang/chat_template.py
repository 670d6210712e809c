"""Chat roles rendered through the model's own chat template.

SGLang keeps a table of hand-written templates; plait asks the model's template
instead. For a role after a given history of roles, it renders the history plus one
message whose content is a marker, and reads the text before the marker (the role's
prefix, including anything the template adds first, such as BOS or a default system
prompt) and after it (the suffix, the end-of-turn text). Any Hugging Face chat model
works this way; the assistant's end-of-turn text becomes a stop string (of the gens
without a constraint: a constraint decides where its output ends). An assistant
turn after a history opens as the template's generation prompt opens a reply where
that is shorter than how it writes a finished message (Qwen3 writes a last assistant
message after an empty think block, which switches reasoning off, but opens a reply
without one). A longer opening (DeepSeek-R1's ``<think>\n``) is not taken: the
reasoning ``separate_reasoning`` removes would leave it unclosed in the text.

A template given with ``chat_template`` (``--chat-template``: a file, the Jinja text or
the built-in ``chatml``; :func:`load_chat_template`) takes the model's place, for the
server's chat APIs and for roles alike.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

Render = Callable[[list[dict[str, str]]], str]


class ChatTemplateError(ValueError):
    """The template cannot express the requested roles (or there is none)."""


def _marker(i: int) -> str:
    # letters and digits only: survives `| trim`, escaping and case-preserving filters
    return f"PLAITMSGMARKER{i}X"


class ChatTemplate:
    """Role prefixes and suffixes of one model's chat template.

    ``render(messages)`` returns the template's text for OpenAI-style messages, with no
    generation prompt; ``render_generation(messages)``, when given, the same text with
    the generation prompt (``add_generation_prompt=True``). Results are cached per
    (role, history of roles).
    """

    def __init__(self, render: Render, name: str = "", render_generation: Render | None = None) -> None:
        self._render = render
        self._render_generation = render_generation
        self.name = name
        self._cache: dict[tuple[str, tuple[str, ...]], tuple[str, str]] = {}

    def markers(self, role: str, history: tuple[str, ...] = ()) -> tuple[str, str]:
        """``(prefix, suffix)`` around the content of a ``role`` message that follows
        messages with roles ``history``."""
        key = (role, history)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        msgs = [{"role": r, "content": _marker(i)} for i, r in enumerate(history)]
        content = _marker(len(history))
        full = self._render_checked(msgs + [{"role": role, "content": content}], role, history)
        k = full.find(content)
        end = len(full)
        if k < 0:
            # some templates write a message only once another follows it (Gemma 3 and
            # Llama 2 fold the system text into the first user turn): read it with a
            # turn after it; its suffix is the text up to that turn's content, and that
            # turn's prefix (read after this history) is then empty
            follower = "assistant" if role == "user" else "user"
            nxt = _marker(len(history) + 1)
            full = self._render_checked(msgs + [{"role": role, "content": content}, {"role": follower, "content": nxt}],
                                        role, history)
            k, end = full.find(content), full.find(nxt)
            if k < 0 or end < k:
                raise ChatTemplateError(f"the model's chat template drops the content of a {role!r} message")
        suffix = full[k + len(content):end]
        if not msgs:
            prefix = full[:k]
        else:
            prefix = self._prefix_after_history(full, k, msgs, history)
            if role == "assistant":
                prefix = self._reply_prefix(full, msgs, prefix)
        self._cache[key] = (prefix, suffix)
        return prefix, suffix

    def _reply_prefix(self, full: str, msgs: list[dict[str, str]], written: str) -> str:
        """How the generation prompt opens a reply after ``msgs``, where it extends the
        history's text and is a shorter start of ``written`` (the finished message's
        prefix); else ``written``."""
        if self._render_generation is None:
            return written
        try:
            base, opened = self._render(msgs), self._render_generation(msgs)
        except Exception:  # noqa: BLE001 - the finished message's prefix stands
            return written
        if not (full.startswith(base) and opened.startswith(base) and len(opened) > len(base)):
            return written
        reply = opened[len(base):]
        return reply if written.startswith(reply) else written

    def _prefix_after_history(self, full: str, k: int, msgs: list[dict[str, str]], history: tuple[str, ...]) -> str:
        try:
            base = self._render(msgs)
        except Exception:  # noqa: BLE001 - some templates refuse a history on its own
            base = None
        # (a history whose last message the template writes only when another follows
        # renders without it: then its text is not a prefix of this one's)
        if base is not None and full.startswith(base) and len(base) <= k and msgs[-1]["content"] in base:
            return full[len(base):k]
        # the template renders the last message differently when it is not last:
        # take what lies between the two contents, minus the suffix already emitted
        j = full.find(msgs[-1]["content"]) + len(msgs[-1]["content"])
        between = full[j:k]
        _, prev_suffix = self.markers(history[-1], history[:-1])
        return between[len(prev_suffix):] if between.startswith(prev_suffix) else between

    def _render_checked(self, msgs: list[dict[str, str]], role: str, history: tuple[str, ...]) -> str:
        try:
            return self._render(msgs)
        except Exception as e:  # noqa: BLE001 - templates raise whatever they like
            hint = ""
            if role == "system" and not history:
                hint = ("; this model's template has no system role: put the system text at the start of the "
                        "first user message")
            raise ChatTemplateError(
                f"the model's chat template cannot render a {role!r} message after roles {list(history)}: {e}{hint}"
            ) from None

    def default_system(self, role: str) -> str | None:
        """The system text the template writes on its own before a first message of
        ``role`` when the messages have no system one (SmolLM2's "You are a helpful AI
        assistant named SmolLM...", Qwen's "You are Qwen..."), or None. Read from the
        markers: that first prefix is then the system prefix, the text and the system
        suffix, followed by the prefix ``role`` has after a system message."""
        if role == "system":
            return None
        try:
            first, _ = self.markers(role)
            opens, closes = self.markers("system")
            after, _ = self.markers(role, ("system",))
        except ChatTemplateError:
            return None
        end = len(first) - len(closes) - len(after)
        if end < len(opens) or not first.startswith(opens) or not first.endswith(closes + after):
            return None
        return first[len(opens):end].strip() or None

    @property
    def stop_str(self) -> tuple[str, ...]:
        """The assistant's end-of-turn text (stripped), as stop strings."""
        try:
            _, suffix = self.markers("assistant", ("user",))
        except ChatTemplateError:
            return ()
        s = suffix.strip()
        return (s,) if s else ()


class Transcript:
    """The text of a program so far, and its chat messages.

    ``messages`` holds what the program's roles said (OpenAI format); ``text`` is the
    full prompt, role markers included; ``default_system`` the system text the template
    wrote on its own before a first message that was not a system one (SGLang makes it
    a system turn: :meth:`chat_messages`).
    """

    def __init__(self) -> None:
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.role: str | None = None
        self.role_start = 0
        self.default_system: str | None = None

    def copy(self) -> Transcript:
        t = Transcript()
        t.text, t.messages, t.role, t.role_start = self.text, [dict(m) for m in self.messages], self.role, self.role_start
        t.default_system = self.default_system
        return t

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages with the template's default system text as the system turn it
        is in the text (as SGLang's ``messages()``), copies."""
        head = [{"role": "system", "content": self.default_system}] if self.default_system else []
        return head + [dict(m) for m in self.messages]

    def history(self) -> tuple[str, ...]:
        return tuple(m["role"] for m in self.messages)

    def fill(self, s: str) -> None:
        self.text += s

    def begin_role(self, role: str, template: ChatTemplate | None) -> None:
        if self.role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.role!r}; roles do not nest, end {self.role!r} first")
        prefix, _ = _need(template).markers(role, self.history())
        if not self.messages and template is not None:
            self.default_system = template.default_system(role)
        self.fill(prefix)
        self.role, self.role_start = role, len(self.text)

    def end_role(self, role: str, template: ChatTemplate | None) -> None:
        if self.role != role:
            raise ValueError(f"role {role!r} ends but the open role is {self.role!r}")
        content = self.text[self.role_start:]
        _, suffix = _need(template).markers(role, self.history())
        self.fill(suffix)
        self.messages.append({"role": role, "content": content.lstrip()})
        self.role = None


def _need(template: ChatTemplate | None) -> ChatTemplate:
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template, so roles (system/user/assistant) cannot be rendered; "
            "use a chat model or write the prompt text yourself"
        )
    return template


ROLES = ("system", "user", "assistant")


def jinja_template(source: str, special_tokens: dict[str, Any] | None = None, name: str = "") -> ChatTemplate:
    """The :class:`ChatTemplate` of a Hugging Face chat template given as Jinja source."""
    return ChatTemplate(jinja_render(source, special_tokens), name,
                        jinja_render(source, special_tokens, add_generation_prompt=True))


def jinja_render(source: str, special_tokens: dict[str, Any] | None = None,
                 add_generation_prompt: bool = False) -> Render:
    """A renderer for a Hugging Face chat template given as Jinja source, set up as
    ``transformers`` does (sandbox, trim_blocks, lstrip_blocks, loop controls,
    ``raise_exception``, ``strftime_now``, ``tojson``, the ``{% generation %}`` block).
    An invalid template raises jinja2's ``TemplateSyntaxError`` here."""
    try:
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("rendering the runtime's chat template needs jinja2 (pip install jinja2)") from e

    class GenerationBlock(Extension):
        # transformers' {% generation %}...{% endgeneration %} marks the assistant's text
        # (for training masks); rendering a prompt writes its body as it is
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    tpl = env.from_string(source)
    extra = dict(special_tokens or {})
    return lambda messages: tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


# -- a template given to the server (chat_template, --chat-template) ------------------------------
# ChatML (<|im_start|>role ... <|im_end|>), for a model without a template of its own
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILT_IN_TEMPLATES: dict[str, str] = {"chatml": CHATML}
MAX_TEMPLATE_FILE_BYTES = 1 << 20  # chat templates are kilobytes; more is the wrong file (weights)
_ALLOWED = ("the path of a file holding a Jinja chat template (such as a model's chat_template.jinja), the "
            "template text itself (containing '{%' or '{{'), or the name of a built-in template: "
            + ", ".join(BUILT_IN_TEMPLATES))


def load_chat_template(value: str) -> str:
    """The Jinja source that ``chat_template`` (``--chat-template``) gives: a built-in
    name (:data:`BUILT_IN_TEMPLATES`), the template text itself (it contains ``{%`` or
    ``{{``), or the path of a text file holding one. The source must compile in the
    sandboxed environment chat templates render in (:func:`jinja_render`, as
    transformers sets it up). Raises ``ValueError`` naming the option, the value and
    what is allowed."""
    if not isinstance(value, str) or not value.strip():
        raise _invalid(value, "not a template, file or name")
    if value in BUILT_IN_TEMPLATES:
        source = BUILT_IN_TEMPLATES[value]
    elif "{%" in value or "{{" in value:
        source = value
    else:
        source = _template_file(value)
    from jinja2 import TemplateError, TemplateSyntaxError

    try:
        jinja_render(source)
    except TemplateSyntaxError as e:
        raise _invalid(value, f"the template does not compile (line {e.lineno}: {e.message})") from None
    except TemplateError as e:
        raise _invalid(value, f"the template does not compile ({e})") from None
    return source


def _template_file(path: str) -> str:
    import os

    if not os.path.exists(path):
        raise _invalid(path, "no such file, and neither template text (no '{%' or '{{') nor a built-in name "
                             "(SGLang's other named templates are not built in: give the template as a file)")
    if not os.path.isfile(path):
        raise _invalid(path, "not a file")
    if path.lower().endswith(".json"):
        raise _invalid(path, "JSON files (SGLang's conversation format) are not supported")
    if os.path.getsize(path) > MAX_TEMPLATE_FILE_BYTES:
        raise _invalid(path, f"the file is over {MAX_TEMPLATE_FILE_BYTES >> 20} MiB, too large for a chat template")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise _invalid(path, f"the file cannot be read as UTF-8 text ({e})") from None
    if "{%" not in source and "{{" not in source:
        raise _invalid(path, "the file holds no Jinja template (no '{%' or '{{')")
    return source


def _invalid(value: Any, why: str) -> ValueError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:76] + "...'"
    return ValueError(f"chat_template={shown} (--chat-template) is invalid: {why}; allowed: {_ALLOWED}")


def get_chat_template(name: str) -> ChatTemplate:
    """SGLang's named templates, which programs assign to a backend
    (``runtime.endpoint.chat_template = get_chat_template("chatml")``): plait builds in
    :data:`BUILT_IN_TEMPLATES` (ChatML); other names raise, saying how to get the
    template (roles render with the served model's own template unless one is assigned)."""
    if name in BUILT_IN_TEMPLATES:
        return jinja_template(BUILT_IN_TEMPLATES[name], name=name)
    raise ChatTemplateError(f"get_chat_template({name!r}): plait has no chat template by that name (built in: "
                            + ", ".join(BUILT_IN_TEMPLATES) + "); roles render with the served model's own template, "
                            "so drop the call, or start the runtime with --chat-template FILE (chat_template= in "
                            "plait.Runtime / plait.Engine)")


# -- tools in chat prompts -------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def template_uses_tools(source: str | None) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable (so rendering it with
    ``tools=`` shows the model its tools). Templates that ignore it get plait's generic
    tool prompt instead (:func:`messages_without_tool_support`)."""
    if not source:
        return False
    try:
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(source))
    except Exception:  # noqa: BLE001 - a template jinja2 cannot parse is rendered (and refused) elsewhere
        return "tools" in source


def has_tool_history(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def messages_for_tool_template(messages: list[dict[str, Any]], parser: str | None = None) -> list[dict[str, Any]]:
    """Messages for a template with tool support: a call's ``arguments`` JSON text is
    given as the object it encodes (Hugging Face templates write it with ``tojson``),
    except with the ``phi4_mini_json`` parser: the template that shows Phi-4-mini its
    tools (vLLM's) prints the arguments with ``{{ }}``, which wrote an object as a Python
    repr (``{'city': 'Paris'}``), so they stay JSON text there.
    With the ``mistral`` parser, call ids (``tool_calls[].id``, ``tool_call_id``) are
    given as Mistral's templates require them, 9 alphanumerics
    (:func:`plait.tool_parsers.mistral_call_id`: the same for the same id, so a call and
    its result still match); OpenAI's ``call_...`` ids made them raise."""
    from plait.tool_parsers import mistral_call_id

    def call_id(v: Any) -> Any:
        return mistral_call_id(v) if parser == "mistral" and isinstance(v, str) else v

    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                try:
                    args = json.loads(fn["arguments"])
                    if isinstance(args, dict) and parser != "phi4_mini_json":
                        fn["arguments"] = args
                except (ValueError, TypeError):
                    pass
                calls.append({**c, "function": fn, **({"id": call_id(c["id"])} if "id" in c else {})})
            m = {**m, "tool_calls": calls}
        if "tool_call_id" in m:
            m = {**m, "tool_call_id": call_id(m["tool_call_id"])}
        out.append(m)
    return out


def messages_without_tool_support(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                                  parser: str = "hermes") -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: the tools are described in the
    system message (:func:`plait.tool_parsers.generic_tools_prompt`), an assistant's
    calls become text in ``parser``'s format, and tool results (consecutive ones merged)
    become a user message of ``<tool_response>`` blocks, which a user message right
    after them joins (roles keep alternating)."""
    from plait.tool_parsers import ToolCall, generic_tools_prompt, get_tool_parser

    fmt = get_tool_parser(parser)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "user" and out and out[-1].get("_tool_results"):
            # the user's next words join the results' turn: templates that want roles to
            # alternate (Gemma's, Mistral's) refused two user turns in a row
            out[-1]["content"] += "\n\n" + (m.get("content") or "")
            out[-1].pop("_tool_results")
        elif m.get("role") == "tool":
            block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m.get("tool_calls"):
            calls = [ToolCall(c.get("id", ""), c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = fmt.format_calls(calls)
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + text})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        prompt = generic_tools_prompt(tools, parser)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
