"""The language without a runtime: building blocks and their validation, choice
methods, chat-template role markers, tracing and prefix analysis, and the
interpreter's semantics on a scripted fake backend."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest

import plait as sgl
from plait.backend import BaseBackend, Pending, Request
from plait.chat_template import ChatTemplate, ChatTemplateError, Transcript, jinja_render
from plait.ir import DTYPE_REGEX, Gen, resolve_params
from plait.tracer import ArgNode, ForkNode, GenNode, JoinNode, RoleNode, SelectNode, StopNode, TextNode, \
    VarScopeNode, plan_batch, token_safe_cut

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]{% endfor %}"
)


# -- a scripted backend ------------------------------------------------------------------------------
class FakeTokenizer:
    """Greedy longest match over a small vocabulary; other characters are tokens."""

    VOCAB = ["The", " answer", " is", ":", " hel", " hello", "lo", " help", "p", " yes", " no", " maybe", "\n"]

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            match = max((v for v in self.VOCAB if text.startswith(v, i)), key=len, default=text[i])
            out.append(self.ids.setdefault(match, len(self.ids) + 10))
            i += len(match)
        return out


class FakeBackend(BaseBackend):
    """Generates ``reply(prompt, sampling_params)``; scores with fake logprobs
    (``-0.1 * token_id``); records requests, pins and aborts. With ``hold`` set, a
    generate request waits until it is aborted (or the event is set)."""

    def __init__(self, reply: Any = None, template: ChatTemplate | None = None, chunks: int = 1) -> None:
        self.reply = reply or (lambda prompt, params: "<out>")
        self.template = template
        self.chunks = chunks
        self.tok = FakeTokenizer()
        self.requests: list[Request] = []
        self.pins: list[str] = []
        self.unpins: list[str] = []
        self.aborted: list[str] = []
        self.hold: threading.Event | None = None
        self.gate: threading.Event | None = None  # streams pause after their first chunk until set
        self.pin_error: str | None = None
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()

    def submit(self, req: Request, on_chunk: Any = None) -> Pending:
        p = Pending(req, on_chunk)
        with self._lock:
            self.requests.append(req)
            self._pending[req.rid] = p
        threading.Thread(target=self._serve, args=(req, p), daemon=True).start()
        return p

    def _serve(self, req: Request, p: Pending) -> None:
        ids = req.input_ids if req.input_ids is not None else self.tok.encode(req.text or "")
        meta: dict[str, Any] = {"prompt_tokens": len(ids), "finish_reason": {"type": "length"}}
        if req.return_logprob and req.logprob_start_len >= 0:
            meta["input_token_logprobs"] = [[None if i == 0 else -0.1 * t, t] for i, t in enumerate(ids)][
                req.logprob_start_len:]
        if req.sampling_params.get("max_new_tokens") == 0:
            p.result(0, {"text": "", "output_ids": [], "meta_info": meta})
            return
        if self.hold is not None:
            self.hold.wait(10)
            if req.rid in self.aborted:
                meta["finish_reason"] = {"type": "abort", "message": "aborted"}
                p.result(0, {"text": "", "output_ids": [], "meta_info": meta})
                return
        for i in range(req.n):
            text = self.reply(req.text, req.sampling_params)
            if req.stream:
                step = max(len(text) // self.chunks, 1)
                for k in range(0, len(text), step):
                    p.chunk(i, text[k:k + step])
                    if self.gate is not None:
                        self.gate.wait(10)
            p.result(i, {"text": text, "output_ids": [], "meta_info": dict(meta)})

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        if self.hold is not None:
            self.hold.set()

    def pin(self, text: str, ttl_s: float) -> str:
        if self.pin_error:
            raise sgl.BackendError(self.pin_error, code=400)
        self.pins.append(text)
        return f"pin{len(self.pins)}"

    def unpin(self, pin_id: str) -> bool:
        self.unpins.append(pin_id)
        return True

    def flush_cache(self) -> bool:
        return True

    def get_server_info(self) -> dict[str, Any]:
        return {"fake": True}

    def get_chat_template(self) -> ChatTemplate | None:
        return self.template

    def gens(self) -> list[Request]:
        return [r for r in self.requests if r.sampling_params.get("max_new_tokens") != 0]


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


# -- building blocks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern,message", [
    ("(ab", "not a valid regular expression"),
    ("a(?=b)", "lookaround"),
    ("(?<!x)y", "lookaround"),
    (r"(a)\1", "backreference"),
    ("", "non-empty"),
    (5, "non-empty"),
])
def test_invalid_regex_raises_at_gen_time(pattern, message):
    with pytest.raises(ValueError, match=message):
        sgl.gen("x", regex=pattern)


@pytest.mark.parametrize("kwargs,message", [
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "JSON object"),
    ({"dtype": complex}, "dtype"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one constraint"),
    ({"stop_regex": "x("}, "stop_regex"),
    ({"stop": 5}, "stop"),
    ({"name": 3}, "name"),
])
def test_bad_gen_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sgl.gen(**{"name": "x", **kwargs})


def test_dtype_beside_a_regex_wins_with_a_warning():
    """SGLang's runtime endpoint warns and keeps only dtype's regex."""
    with pytest.warns(UserWarning, match="only dtype is used"):
        both = sgl.gen("x", regex="[0-9]{1,3}", dtype=int)
    assert both.params == sgl.gen("x", dtype=int).params


def test_meta_info_of_a_name_never_defined_is_none(fake):
    st = few_shot.run(question="2+2?", backend=fake)
    assert st.get_meta_info("never_defined") is None  # SGLang's meta_info.get(name)
    assert st.get_meta_info("answer") is not None


def test_select_and_choices_validation():
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", [])
    with pytest.raises(ValueError, match="non-empty strings"):
        sgl.select("x", ["a", ""])
    with pytest.raises(ValueError, match="temperature"):
        sgl.select("x", ["a"], temperature=-1)
    e = sgl.gen("x", choices=["a", "b"])  # gen with choices is a select
    assert type(e).__name__ == "Select" and e.choices == ["a", "b"]


def test_gen_params_use_runtime_names_and_run_defaults_merge():
    g = sgl.gen("a", max_tokens=5, min_tokens=1, stop="\n", temperature=0.0, regex=r"\d+", return_logprob=True)
    assert isinstance(g, Gen)
    assert g.params == {"max_new_tokens": 5, "min_new_tokens": 1, "stop": ["\n"], "temperature": 0.0,
                        "regex": r"\d+", "return_logprob": True}
    r = resolve_params({"max_new_tokens": 128, "temperature": 1.0, "top_p": 0.9, "stop": ["END"]},
                       g.params, extra_stop=("<|im_end|>",))
    assert r.sampling == {"max_new_tokens": 5, "min_new_tokens": 1, "temperature": 0.0, "top_p": 0.9,
                          "stop": ["\n", "<|im_end|>"], "regex": r"\d+"}
    assert r.request == {"return_logprob": True}
    assert sgl.gen_int("n").params["dtype"] is int
    assert sgl.gen_string("s", max_tokens=3).params == {"max_new_tokens": 3, "dtype": str}


def test_expressions_concatenate_with_strings():
    e = "Name: " + sgl.gen("name", stop='"') + "\n"
    assert [type(x).__name__ for x in e.items] == ["Text", "Gen", "Text"]
    with pytest.raises(TypeError, match="str"):
        sgl.gen("a") + 5


# -- choice methods ---------------------------------------------------------------------------------------
def _lp(*xs: float) -> list[list[Any]]:
    return [[x, i] for i, x in enumerate(xs)]


def test_token_length_normalized_picks_best_mean():
    d = sgl.token_length_normalized(choices=["a", "b"], normalized_prompt_logprobs=[-2.0, -1.0],
                                    input_token_logprobs=[_lp(-2.0), _lp(-1.0)], output_token_logprobs=[[], []])
    assert d.decision == "b" and d.meta_info["normalized_prompt_logprobs"] == [-2.0, -1.0]


def test_greedy_token_selection_walks_tokens_and_pads_with_mean():
    toks = [_lp(-1.0, -5.0), _lp(-1.0, -0.5, -9.0), _lp(-3.0)]
    d = sgl.greedy_token_selection(choices=["a", "b", "c"], normalized_prompt_logprobs=[0, 0, 0],
                                   input_token_logprobs=toks, output_token_logprobs=[[], [], []])
    assert d.decision == "b"  # ties with a at token 0, wins at token 1
    assert d.meta_info["greedy_logprob_matrix"][0] == [-1.0, -5.0, -3.0]  # padded with its mean


def test_unconditional_likelihood_normalized_subtracts_prior():
    cond = [_lp(-1.0, -1.0), _lp(-2.0, -2.0)]
    uncond = [[[None, 0], [-0.5, 1]], [[None, 0], [-4.0, 1]]]
    d = sgl.unconditional_likelihood_normalized(
        choices=["common", "rare"], normalized_prompt_logprobs=[-1.0, -2.0], input_token_logprobs=cond,
        output_token_logprobs=[[], []], unconditional_token_logprobs=uncond)
    assert d.decision == "rare"  # -1.0 vs (-2 + 2)/2 = 0.0... the rare one gains more from the context
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == [pytest.approx(-0.75), pytest.approx(0.0)]


# -- chat templates --------------------------------------------------------------------------------------
def test_role_markers_from_the_models_template():
    t = ChatTemplate(jinja_render(SMOLLM2_TEMPLATE))
    sys_default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert t.markers("user") == (sys_default + "<|im_start|>user\n", "<|im_end|>\n")
    assert t.markers("system") == ("<|im_start|>system\n", "<|im_end|>\n")
    assert t.markers("assistant", ("system", "user")) == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert t.stop_str == ("<|im_end|>",)
    llama = ChatTemplate(jinja_render(LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>"}))
    assert llama.markers("user") == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")
    assert llama.markers("assistant", ("user",))[0] == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert llama.stop_str == ("<|eot_id|>",)


def test_transcript_renders_what_the_template_renders():
    render = jinja_render(SMOLLM2_TEMPLATE)
    t = ChatTemplate(render)
    ts = Transcript()
    for role, content in [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]:
        ts.begin_role(role, t)
        ts.fill(content)
        ts.end_role(role, t)
    assert ts.text == render(ts.messages)
    assert [m["role"] for m in ts.messages] == ["system", "user", "assistant", "user"]


def test_the_templates_default_system_text_is_a_system_message_as_in_sglang():
    render = jinja_render(SMOLLM2_TEMPLATE)
    t = ChatTemplate(render)
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert t.default_system("user") == default and t.default_system("system") is None
    assert ChatTemplate(jinja_render(LLAMA3_TEMPLATE, {"bos_token": "<b>"})).default_system("user") is None
    for roles, head in [(["user", "assistant"], [{"role": "system", "content": default}]), (["system", "user"], [])]:
        ts = Transcript()
        for role in roles:
            ts.begin_role(role, t)
            ts.fill(role + " says")
            ts.end_role(role, t)
        assert ts.chat_messages() == head + [{"role": r, "content": r + " says"} for r in roles]
        assert render(ts.chat_messages()) == ts.text and ts.copy().chat_messages() == ts.chat_messages()
        assert [m["role"] for m in ts.messages] == roles  # the history the markers follow is unchanged

    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a", max_tokens=4))

    st = chat.run(backend=FakeBackend(template=t))
    assert st.messages() == [{"role": "system", "content": default}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "<out>"}]
    assert render(st.messages()) == st.text()


def test_appending_none_or_a_number_raises_sglangs_valueerror_and_a_typeerror():
    @sgl.function
    def bad(s, x):
        s += x

    for x in (None, 5):
        with pytest.raises(ValueError, match="cannot append") as e:
            bad.run(x, backend=FakeBackend())
        assert isinstance(e.value, TypeError)


def test_template_errors_are_clear():
    t = ChatTemplate(jinja_render(ALTERNATING_TEMPLATE))
    ts = Transcript()
    with pytest.raises(ChatTemplateError, match="alternate"):
        ts.begin_role("assistant", t)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Transcript().begin_role("user", None)
    ts = Transcript()
    ts.begin_role("user", t)
    with pytest.raises(ValueError, match="do not nest"):
        ts.begin_role("assistant", t)


# -- tracing -------------------------------------------------------------------------------------------------
EXAMPLES = "Q: 1+1?\nA: 2\n\nQ: 2+2?\nA: 4\n\nQ: 3+3?\nA: 6\n\n"


@sgl.function
def few_shot(s, question, examples=EXAMPLES):
    s += "Answer the questions.\n\n" + examples
    s += f"Q: {question}\nA:"
    s += sgl.gen("answer", max_tokens=16, stop="\n")
    s += "\nConfident? " + sgl.select("sure", ["yes", "no"])


def test_trace_records_text_args_and_sites():
    g = few_shot.trace()  # question unbound: a placeholder survives the f-string
    assert g.complete
    kinds = [type(n).__name__ for n in g.nodes]
    assert kinds == ["TextNode", "ArgNode", "TextNode", "ArgNode", "TextNode", "GenNode", "TextNode", "SelectNode"]
    assert g.nodes[1] == ArgNode("examples", EXAMPLES)  # bound by its default
    assert g.nodes[3] == ArgNode("question", None)
    assert g.nodes[5] == GenNode("answer", {"max_new_tokens": 16, "stop": ["\n"]})
    sites = g.call_sites()
    assert [(s.kind, s.name, s.complete) for s in sites] == [("gen", "answer", False), ("select", "sure", False)]
    # the unbound question blocks: known before run time is the instruction and the examples
    assert [type(n).__name__ for n in sites[0].known_prefix] == ["TextNode", "ArgNode", "TextNode"]
    assert g.prefix_text() == "Answer the questions.\n\n" + EXAMPLES + "Q: "
    assert [type(n).__name__ for n in g.static_prefix()] == ["TextNode"]

    bound = few_shot.trace(question="What is 3+3?")
    assert bound.nodes[3] == ArgNode("question", "What is 3+3?")
    site = bound.call_sites()[0]
    assert site.complete
    assert bound.prefix_text(site=site) == bound.prefix_text().rstrip() + "\nA:" or \
        bound.prefix_text(site=site).endswith("What is 3+3?\nA:")
    assert bound.call_sites()[1].known_prefix == site.known_prefix  # the answer is dynamic


def test_trace_stops_where_values_are_needed():
    @sgl.function
    def branchy(s, topic):
        s += "Topic: " + topic + "\n"
        s += sgl.gen("kind", max_tokens=4)
        if s["kind"] == "math":
            s += "Solve it."

    g = branchy.trace(topic="x")
    assert not g.complete and isinstance(g.nodes[-1], StopNode)
    assert "'kind'" in g.stop_reason and "run time" in g.stop_reason

    @sgl.function
    def loops(s, items):
        for it in items:
            s += it + "\n"
        s += sgl.gen("a")

    unbound = loops.trace()  # iterating a placeholder walks its characters: still traces
    assert any(isinstance(n, GenNode) for n in unbound.nodes)
    bound = loops.trace(items=["x", "y"])
    assert bound.prefix_text() == "x\ny\n"


def test_trace_records_roles_forks_and_scopes():
    @sgl.function
    def prog(s, q):
        s += sgl.system("Be brief.")
        with s.user():
            s += q
        s += sgl.assistant(sgl.gen("a", max_tokens=8))
        forks = s.fork(2)
        forks += lambda i: f"Tip {i + 1}:"
        for f in forks:
            f += sgl.gen("tip", max_tokens=4)
        forks.join()
        with s.var_scope("v"):
            s += "x" + sgl.gen("y")

    g = prog.trace(q="hi")
    roles = [(n.role, n.begin) for n in g.nodes if isinstance(n, RoleNode)]
    assert roles == [("system", True), ("system", False), ("user", True), ("user", False),
                     ("assistant", True), ("assistant", False)]
    fork = next(n for n in g.nodes if isinstance(n, ForkNode))
    assert fork.size == 2 and [b[0] for b in fork.branches] == [TextNode("Tip 1:"), TextNode("Tip 2:")]
    assert any(isinstance(n, JoinNode) for n in g.nodes)
    assert [n.name for n in g.nodes if isinstance(n, VarScopeNode)] == ["v", "v"]
    sites = g.call_sites()
    assert [(s.name, s.path) for s in sites] == [("a", ()), ("tip", ((g.nodes.index(fork), 0),)),
                                                 ("tip", ((g.nodes.index(fork), 1),)), ("y", ())]
    t = ChatTemplate(jinja_render(SMOLLM2_TEMPLATE))
    assert g.prefix_text(t) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                               "<|im_start|>assistant\n"
    assert "fork 2" in g.pretty() and "gen 'tip'" in g.pretty()
    assert g.uses_roles


@pytest.mark.parametrize("text,cut", [
    ("Q: What is", "Q: What"),
    ("Q: What is ", "Q: What is"),
    ("line one\nQ: Wh", "line one\nQ:"),
    ("<|im_start|>user\n", "<|im_start|>user"),
    ("oneword", ""),
])
def test_token_safe_cut(text, cut):
    assert token_safe_cut(text) == cut


def test_plan_batch_pins_shared_prefixes_and_groups_instances():
    qs = ["What is 5+5?", "Who wrote Hamlet?", "What is 7+1?", "Why is the sky blue?"]
    graphs = [few_shot.trace(question=q) for q in qs]
    other = "Q: a?\nA: b\n\n" * 4
    graphs += [few_shot.trace(question=q, examples=other) for q in qs[:2]]
    plan = plan_batch(graphs, None)
    shared = "Answer the questions.\n\n" + EXAMPLES.rstrip()
    pins = dict(plan.pins)
    assert pins[shared + "\n\nQ: What is"] == [0, 2]  # deepest shared prefix of the 'What is' pair
    # 'Who'/'Why' share only up to 'Q:', which the deeper pin's lock covers already
    assert len(plan.pins) == 2 and pins["Answer the questions.\n\n" + other + "Q:"] == [4, 5]
    assert all(not a.startswith(b) for a in pins for b in pins if a != b)  # no pin covers another
    assert sorted(plan.order) == list(range(6))
    # instances sharing a prefix are submitted next to each other
    pos = {i: k for k, i in enumerate(plan.order)}
    assert abs(pos[0] - pos[2]) == 1 and abs(pos[4] - pos[5]) == 1
    assert plan.prefixes[1].endswith("Q: Who wrote Hamlet?\nA:")


def test_plan_batch_pins_what_many_instances_share_not_small_groups():
    qs = [f"{w} is {i}?" for i, w in enumerate(["Who", "What", "Why", "When", "Where", "How"] * 2)]
    plan = plan_batch([few_shot.trace(question=q) for q in qs], None)
    # pairs share "Q: Who is" etc., but a pair is under a quarter of the batch: only the
    # prefix all twelve share is pinned
    assert plan.pins == [("Answer the questions.\n\n" + EXAMPLES + "Q:", sorted(range(12), key=lambda i: qs[i]))]
    pairs = plan_batch([few_shot.trace(question=q) for q in qs], None, min_pin_share=0.0, max_pins=3).pins
    assert len(pairs) == 3 and all(text.endswith(" is") and len(members) == 2 for text, members in pairs)


def test_plan_batch_skips_short_and_unshared_prefixes():
    @sgl.function
    def short(s, x):
        s += x + sgl.gen("y")

    assert plan_batch([short.trace(x="a b"), short.trace(x="a c")], None).pins == []
    assert plan_batch([few_shot.trace(question="x")], None).pins == []


# -- the interpreter on the fake backend ----------------------------------------------------------------
def test_run_executes_in_order_and_stores_variables(fake):
    fake.reply = lambda prompt, params: "4" if prompt.endswith("A:") else "ok"
    st = few_shot.run(question="2+2?", backend=fake, temperature=0.0)
    assert st["answer"] == "4" and st["sure"] in ("yes", "no")
    assert st.text().endswith("Q: 2+2?\nA:4\nConfident? " + st["sure"])
    gen = fake.gens()[0]
    assert gen.sampling_params == {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                   "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                   "ignore_eos": False, "stop": ["\n"]}
    assert "answer" in st and "nothing" not in st
    with pytest.raises(sgl.UnknownVariableError, match="unknown variable 'nothing'; defined variables: 'answer'"):
        st["nothing"]
    with pytest.raises(KeyError):
        st["nothing"]
    st["note"] = 5
    assert st["note"] == 5


def test_constraints_pass_through_to_the_backend(fake):
    @sgl.function
    def record(s):
        s += "{"
        s += '"n": ' + sgl.gen_int("n") + ", "
        s += '"s": ' + sgl.gen_string("s") + ", "
        s += '"id": "' + sgl.gen("id", regex=r"[a-z]{3}-\d{2}") + '"'
        s += '"j": ' + sgl.gen("j", json_schema={"type": "object"}) + "}"

    record.run(backend=fake)
    sp = [r.sampling_params for r in fake.gens()]
    assert sp[0]["regex"] == DTYPE_REGEX["int"] and sp[1]["regex"] == DTYPE_REGEX["str"]
    assert [("regex" in p, "json_schema" in p) for p in sp] == [(True, False)] * 3 + [(False, True)]
    assert sp[2]["regex"] == r"[a-z]{3}-\d{2}" and sp[3]["json_schema"] == '{"type": "object"}'


def test_roles_use_the_template_and_its_stop_text():
    fake = FakeBackend(template=ChatTemplate(jinja_render(SMOLLM2_TEMPLATE)))

    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a", max_tokens=4))

    st = chat.run(backend=fake)
    assert fake.gens()[0].text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    assert fake.gens()[0].sampling_params["stop"] == ["<|im_end|>"]
    assert st.messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "<out>"}]


def test_fork_join_gathers_and_concatenates(fake):
    fake.reply = lambda prompt, params: prompt[-1]

    @sgl.function
    def tips(s):
        s += "Tips:"
        forks = s.fork(3)
        forks += lambda i: f"{i}"
        forks += sgl.gen("tip", max_tokens=2)
        forks.join()
        s += "|"
        more = s.fork(2)
        more += ["a", "b"]
        more.join("concate_and_append")

    st = tips.run(backend=fake)
    assert st["tip"] == ["0", "1", "2"]
    assert st.text() == "Tips:|ab"
    warm = [r for r in fake.requests if r.sampling_params.get("max_new_tokens") == 0]
    assert [r.text for r in warm] == ["Tips:", "Tips:|"]  # shared text prefilled once per fork


def test_var_scope_and_copy(fake):
    fake.reply = lambda prompt, params: "Ann"

    @sgl.function
    def rec(s):
        with s.var_scope("json"):
            s += '{"name": "' + sgl.gen("name", stop='"') + '"}'
        with s.copy() as c:
            c += "side" + sgl.gen("side")

    st = rec.run(backend=fake)
    assert st["json"] == '{"name": "Ann"}' and st["side"] == ["Ann"]
    assert st.text() == '{"name": "Ann"}'


def test_streaming_deltas_concatenate(fake):
    fake.reply = lambda prompt, params: "streamed words here"
    fake.chunks = 4
    st = few_shot.run(question="x", backend=fake, stream=True)
    pieces = list(st.text_iter())
    assert "".join(pieces) == st.text() and st.text().endswith("A:streamed words here\nConfident? " + st["sure"])
    fake.gate = threading.Event()
    st = few_shot.run(question="x", backend=fake, stream=True)
    it = st.text_iter("answer")
    first = next(it)
    assert first == "stre" and st.executor.pending["answer"] == 1  # arrives while the gen still runs
    fake.gate.set()
    assert first + "".join(it) == "streamed words here" == st["answer"]


def test_async_streaming(fake):
    import asyncio

    fake.reply = lambda prompt, params: "abcdefgh"
    fake.chunks = 4

    async def consume() -> list[str]:
        st = few_shot.run(question="x", backend=fake, stream=True)
        return [p async for p in st.text_async_iter("answer")]

    assert "".join(asyncio.run(consume())) == "abcdefgh"


def test_a_program_that_raises_aborts_its_requests(fake):
    fake.hold = threading.Event()

    @sgl.function
    def boom(s):
        s += "x" + sgl.gen("a", max_tokens=100)
        while not fake.gens():  # the gen is in flight
            threading.Event().wait(0.01)
        raise RuntimeError("user bug")

    with pytest.raises(RuntimeError, match="user bug"):
        boom.run(backend=fake)
    rid = fake.gens()[0].rid
    assert rid in fake.aborted


def test_abort_cancels_a_streaming_program(fake):
    fake.hold = threading.Event()
    st = few_shot.run(question="x", backend=fake, stream=True)
    while not fake.gens():
        threading.Event().wait(0.01)
    st.abort()
    with pytest.raises(sgl.ProgramError, match="aborted by the caller"):
        st["answer"]
    assert isinstance(st.error(), sgl.ProgramCancelled)
    assert fake.gens()[0].rid in fake.aborted


def test_backend_errors_surface_on_read():
    class Failing(FakeBackend):
        def submit(self, req: Request, on_chunk: Any = None) -> Pending:
            p = Pending(req, on_chunk)
            p.fail(sgl.BackendError("unknown sampling parameter(s) 'regex'", code=400, param="sampling_params"))
            return p

    st = few_shot.run(question="x", backend=Failing())
    with pytest.raises(sgl.ProgramError, match="'regex'") as info:
        st["answer"]
    assert isinstance(info.value.__cause__, sgl.BackendError)
    assert isinstance(st.error(), sgl.BackendError)


def test_select_scores_from_the_first_token_that_carries_choice_text(fake):
    @sgl.function
    def pick(s):
        s += "The answer is: hel"
        s += sgl.select("w", ["lo", "p", "icopter"])

    st = pick.run(backend=fake)
    meta = st.get_meta_info("w")
    tok = fake.tok
    # "lo" merges with " hel" into " hello": the merged token is the choice's first token
    assert [t for _, t in meta["input_token_logprobs"][0]] == [tok.ids[" hello"]]
    assert [t for _, t in meta["input_token_logprobs"][1]] == [tok.ids[" help"]]
    assert [t for _, t in meta["input_token_logprobs"][2]] == tok.encode("The answer is: helicopter")[5:]  # ' hel' stays
    ids = [t for _, t in meta["input_token_logprobs"][0]]
    assert meta["normalized_prompt_logprobs"][0] == pytest.approx(-0.1 * ids[0])
    scoring = [r for r in fake.requests if r.return_logprob]
    assert {r.logprob_start_len for r in scoring} == {0}  # the context is 4 tokens: window from 0
    assert len(scoring) == 4  # context + 3 choices, submitted together


def test_run_batch_pins_groups_and_unpins(fake):
    qs = [{"question": q} for q in ["What is 5+5?", "Who wrote it?", "What is 1+1?"]]
    states = few_shot.run_batch(qs, backend=fake, num_threads=2, progress_bar=True)
    assert [s["answer"] for s in states] == ["<out>"] * 3
    assert len(fake.pins) == 1 and fake.pins[0].startswith("Answer the questions.")
    assert fake.unpins == ["pin1"]
    fake.pins.clear()
    few_shot.run_batch(qs, backend=fake, pin_prefixes=False)
    assert fake.pins == []
    fake.pin_error = "pinning 900 tokens exceeds the pin budget"
    states = few_shot.run_batch(qs, backend=fake)  # a refused pin does not fail the batch
    assert all(s["answer"] == "<out>" for s in states)
    positional = few_shot.run_batch([["What?"]], backend=fake)
    assert positional[0]["answer"] == "<out>"


def test_run_batch_returns_input_order(fake):
    fake.reply = lambda prompt, params: prompt.split("Q: ")[-1].split("?")[0]
    qs = [{"question": f"{c}{i}?"} for i, c in enumerate("zyxwvu")]
    states = few_shot.run_batch(qs, backend=fake)
    assert [s["answer"] for s in states] == [f"{c}{i}" for i, c in enumerate("zyxwvu")]


@sgl.function
def summarize(s, docs, options, tag):
    options.append("None of the above")  # changes the caller's list when given it
    s += "Pick one of: " + ", ".join(options) + "\nDocuments:\n"
    for d in docs:
        s += "- " + d + "\n"
    s += f"[{tag}] Summary:" + sgl.gen("summary", max_tokens=4)


def test_run_batch_traces_never_consume_or_change_the_instances_arguments(fake):
    """Planning traces each instance with its arguments before the run: a one-shot
    iterator (map, a generator) reached the run empty, and a list the body appends to
    got the item twice. Plain data is copied for the trace, anything else a placeholder."""
    fake.reply = lambda prompt, params: "ok"
    lists = [["A", "B"], ["C", "D"]]
    batch = [{"docs": map(str.strip, [" alpha ", " beta "]), "options": lists[0], "tag": "x"},
             {"docs": (d for d in ["gamma", "delta"]), "options": lists[1], "tag": "y"}]
    states = summarize.run_batch(batch, backend=fake)
    texts = [s.text() for s in states]
    assert texts[0] == "Pick one of: A, B, None of the above\nDocuments:\n- alpha\n- beta\n[x] Summary:ok"
    assert texts[1] == "Pick one of: C, D, None of the above\nDocuments:\n- gamma\n- delta\n[y] Summary:ok"
    assert lists == [["A", "B", "None of the above"], ["C", "D", "None of the above"]]  # once each
    # the same as run() on fresh arguments; and plain-data arguments still give the plan its prefixes
    one = summarize.run(docs=iter(["alpha", "beta"]), options=["A", "B"], tag="x", backend=fake)
    assert one.text() == texts[0]
    plan = summarize.plan([{"docs": ["p", "q"], "options": ["A"], "tag": "x"},
                           {"docs": map(str, "pq"), "options": ["A"], "tag": "y"}])
    assert plan.prefixes[0].startswith("Pick one of: A, None of the above\nDocuments:\n- p\n- q\n[x]")
    assert "- p" not in plan.prefixes[1] and plan.prefixes[1].startswith("Pick one of: A, None of the above")


def test_run_batch_generator_style_yields_in_order_and_unpins_at_the_end(fake):
    fake.reply = lambda prompt, params: prompt.split("Q: ")[-1].split("?")[0]
    qs = [{"question": f"{c}{i}?"} for i, c in enumerate("zyxwvu")]
    it = few_shot.run_batch(qs, backend=fake, num_threads=3, generator_style=True)
    assert not isinstance(it, list)
    first = next(it)
    assert first["answer"] == "z0"
    assert fake.unpins == []  # the pin is held while the batch is still being consumed
    rest = list(it)
    assert [s["answer"] for s in [first, *rest]] == [f"{c}{i}" for i, c in enumerate("zyxwvu")]
    assert fake.unpins == ["pin1"]
    # closing early releases the pin too; sequential mode yields the same order
    it = few_shot.run_batch(qs, backend=fake, num_threads=1, generator_style=True)
    assert next(it)["answer"] == "z0"
    it.close()
    assert fake.unpins == ["pin1", "pin2"]


def test_function_surface(fake):
    with pytest.raises(ValueError, match="named 's'"):
        sgl.function(lambda state: None)
    bound = few_shot.bind(question="Bound?")
    assert bound.run(backend=fake).text().count("Bound?") == 1
    with pytest.raises(TypeError, match="unexpected argument"):
        few_shot.run(backend=fake, questionn="typo")

    @sgl.function()
    def outer(s):
        s += "pre "
        few_shot(s, "inner?")  # calling a program inside another runs its body here

    assert "pre Answer the questions." in outer.run(backend=fake).text()
    sgl.set_default_backend(fake)
    try:
        assert few_shot("default?")["answer"] == "<out>"
        assert sgl.get_server_info() == {"fake": True} and sgl.flush_cache() is True
    finally:
        sgl.set_default_backend(None)
    with pytest.raises(RuntimeError, match="no backend"):
        few_shot.run(question="x")


def test_import_plait_stays_light():
    code = ("import sys, plait, plait.protocol; plait.gen('a', regex='[0-9]+'); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runtime_endpoint_says_why_no_runtime_answered():
    """A refused connection said "(its server info names no ZMQ address)", as if a
    server had answered; now that is said only of a server that answers without one."""
    import json
    import socket
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from plait.errors import RuntimeUnavailableError
    from plait.runtime_endpoint import _zmq_address_from_http

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RuntimeUnavailableError) as e:
        _zmq_address_from_http(f"http://127.0.0.1:{port}", None, 2.0)
    assert "refused" in str(e.value) and "ZMQ" not in str(e.value)

    class NotPlait(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"version": "x"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), NotPlait)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RuntimeUnavailableError) as e:
            _zmq_address_from_http(f"http://127.0.0.1:{server.server_port}", None, 2.0)
        assert "names no ZMQ address" in str(e.value)
    finally:
        server.shutdown()
