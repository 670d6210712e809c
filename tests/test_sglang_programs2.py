"""More SGLang frontend programs, written again here in the idioms of SGLang's docs,
examples and benchmarks (tree-of-thought, multi-document QA, ReAct, multi-chain
reasoning, mt-bench), run through ``import plait as sgl``; one test per gap they found:

1. Programs with ``**kwargs`` or ``*args`` failed: every parameter after ``s`` was
   taken for a named argument (``f.run(q="x")`` on ``def f(s, **kwargs)`` raised
   "unexpected argument 'q'", and ``*args`` got the first value as ``args=``).
2. ``sgl.flush_cache(empty_cache=False)``, SGLang's signature, raised TypeError.
3. ``sgl.system(...)`` on a model whose chat template folds the system text into the
   first user turn (Gemma 3, Llama 2) failed with "drops the content of a 'system'
   message"; a template that refuses the system role now says what to do.
4. ``text_async_iter(var, return_meta_data=True)`` gave None for every piece's meta
   info, and never the final one.
5. ``sgl.image`` / ``sgl.video`` said "not supported" without naming a way out.
6. Reading a streamed program from outside raced its body: ``state["later"]`` raised
   UnknownVariableError until the body appended that gen; ``sync()`` could return
   before ``ret_value`` was set.
7. After ``f.bind(prompt=...)``, positional arguments went to the bound parameter.
8. ``sgl.Runtime`` had no ``get_tokenizer()`` / ``generate()`` / ``cache_prefix()``,
   ``sgl.Engine`` no ``get_tokenizer()`` / ``async_generate()``.
9. ``global_config.enable_precache_with_tracing = False`` still traced every
   instance of a batch, so a body's work before its first gen (a retrieval) ran twice.
10. ``global_config.skip_special_tokens_in_output`` and
    ``spaces_between_special_tokens_in_out`` (SGLang's) raised AttributeError.

Model outputs are compared with a plain reference ``Engine`` on the same tiny weights,
so nothing depends on what the random model says.
"""

from __future__ import annotations

from typing import Any

import pytest

import plait as sgl
from plait.runtime import Engine

from lang_fixtures import ENGINE_OPTS, backend, folder, ref  # noqa: F401  (pytest fixtures)


def greedy(ref: Engine, prompt: str, **params: Any) -> str:
    return ref.generate(prompt, {"temperature": 0.0, **params})["text"]


# -- 1. *args and **kwargs ------------------------------------------------------------------------
@sgl.function
def ask_with_options(s, question, **options):
    s += "Q: " + question + options.get("suffix", "") + "\nA:" + sgl.gen("answer", max_tokens=4)
    return sorted(options)


@sgl.function
def ask_all(s, head, *questions):
    s += head
    for q in questions:
        s += "Q: " + q + "\nA:" + sgl.gen(max_tokens=3, stop="\n") + "\n"
    return len(questions)


@sgl.function
def outer_program(s, topic):
    s += "Topic: " + topic + "\n"
    seen = ask_with_options(s, "why?", suffix=" (short)")  # a nested call passes **options on
    s += " So" + sgl.gen("more", max_tokens=2)
    return seen


def test_kwargs_and_varargs_programs_get_their_arguments_as_python_passes_them(backend, ref):
    state = ask_with_options.run("Why is the sky blue?", suffix=" Be brief.", temperature=0, backend=backend)
    prompt = "Q: Why is the sky blue? Be brief.\nA:"
    assert state.ret_value == ["suffix"] and state["answer"] == greedy(ref, prompt, max_new_tokens=4)

    # run_batch: dicts with names only **options takes, traced and planned like the others
    states = ask_with_options.run_batch([{"question": "a?", "suffix": "!"}, {"question": "b?"}], temperature=0,
                                        backend=backend)
    assert [st.ret_value for st in states] == [["suffix"], []]
    assert [st.text() for st in states] == [f"Q: {q}\nA:" + greedy(ref, f"Q: {q}\nA:", max_new_tokens=4)
                                           for q in ("a?!", "b?")]
    assert "suffix" in ask_with_options.trace(question="a?", suffix="!").arg_names

    state = ask_all.run("Answer briefly.\n", "one?", "two?", temperature=0, backend=backend)
    assert state.ret_value == 2 and state.text().count("Q: ") == 2 and "Q: two?\nA:" in state.text()

    state = outer_program.run(topic="sky", temperature=0, backend=backend)
    assert state.ret_value == ["suffix"] and state.text().startswith("Topic: sky\nQ: why? (short)\nA:")

    with pytest.raises(TypeError, match="unexpected argument 'extra'"):
        outer_program.run(topic="x", extra=1, backend=backend)
    with pytest.raises(TypeError, match=r"takes 1 positional arguments after s, got 2"):
        outer_program.run("x", "y", backend=backend)


# -- 2. flush_cache(empty_cache=...) ----------------------------------------------------------------
def test_flush_cache_takes_sglangs_empty_cache_keyword(backend):
    assert sgl.flush_cache(backend, empty_cache=False) is True
    assert sgl.flush_cache(backend=backend, empty_cache=True) is True


# -- 3. a system role the template folds into the first user turn -----------------------------------
# A Gemma-3-style template (written here): the system text opens the first user turn.
FOLDING_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set head = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set head = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (head if loop.first else '') + m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# A Gemma-2-style template: no system role at all.
REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def folding_folder(folder, tmp_path_factory):
    """The tiny model with :data:`FOLDING_TEMPLATE` as its chat template."""
    from pathlib import Path

    out = tmp_path_factory.mktemp("tiny-folding-template")
    for f in Path(folder).iterdir():
        if f.name != "chat_template.jinja":
            (out / f.name).symlink_to(f)
    (out / "chat_template.jinja").write_text(FOLDING_TEMPLATE)
    return str(out)


@sgl.function
def chat_with_system(s, question):
    s += sgl.system("Answer in one word.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))
    s += sgl.user("And then?")


def test_system_folded_into_the_first_user_turn_renders_as_the_template_does(folding_folder, ref):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folding_folder)
    with sgl.EngineBackend(folding_folder, **ENGINE_OPTS) as b:
        state = chat_with_system.run(question="Hi there", temperature=0, backend=b)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    head = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert head == tok.bos_token + "<start_of_turn>user\nAnswer in one word.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert state["answer"] == greedy(ref, head, max_new_tokens=4, stop=["<end_of_turn>"])
    assert state.text() == (head + state["answer"] + "<end_of_turn>\n<start_of_turn>user\nAnd then?<end_of_turn>\n")


def test_a_template_without_a_system_role_says_what_to_do():
    from plait.chat_template import ChatTemplate, ChatTemplateError, Transcript, jinja_render

    template = ChatTemplate(jinja_render(REFUSING_TEMPLATE))
    with pytest.raises(ChatTemplateError, match="System role not supported; this model's template has no system "
                                                "role: put the system text at the start of the first user message"):
        Transcript().begin_role("system", template)
    ts = Transcript()  # the other roles render as before
    ts.begin_role("user", template)
    ts.fill("Hi")
    ts.end_role("user", template)
    assert ts.text == "<start_of_turn>user\nHi<end_of_turn>\n"


# -- 4. streamed meta info ---------------------------------------------------------------------------
@sgl.function
def answer_with_logprobs(s, question):
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=6, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)


def test_text_async_iter_with_meta_data_streams_each_piece_s_meta_info(backend, ref):
    """SGLang's ``text_async_iter(var, return_meta_data=True)``: every piece comes with
    the meta info so far (it came with None, and the final meta info never came)."""
    import asyncio

    async def consume() -> list[tuple[str, Any]]:
        st = answer_with_logprobs.run(question="Why?", temperature=0, ignore_eos=True, stream=True, backend=backend)
        return [x async for x in st.text_async_iter(var_name="answer", return_meta_data=True)]

    got = asyncio.run(consume())
    want = ref.generate("Q: Why?\nA:", {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
                        return_logprob=True, top_logprobs_num=2)
    assert len(got) > 1 and "".join(p for p, _ in got) == want["text"]
    metas = [m for _, m in got]
    assert all(isinstance(m, dict) for m in metas)
    counts = [m["completion_tokens"] for m in metas]
    assert counts == sorted(counts) and counts[-1] == 6 and metas[-1]["finish_reason"]["type"] == "length"
    # SGLang's per-piece fields on every piece: finish_reason None until the end
    assert all(m["finish_reason"] is None for m in metas[:-1])
    assert all(m["prompt_tokens"] == want["meta_info"]["prompt_tokens"] and m["cached_tokens"] >= 0
               and isinstance(m["id"], str) for m in metas)
    # each piece's logprob entries are its own tokens': together, the whole output's
    entries = [e for m in metas for e in m["output_token_logprobs"]]
    assert [e[1] for e in entries] == [e[1] for e in want["meta_info"]["output_token_logprobs"]]
    assert [e[0] for e in entries] == pytest.approx([e[0] for e in want["meta_info"]["output_token_logprobs"]],
                                                    abs=1e-4)
    assert all(isinstance(e, tuple) and len(e) == 3 and isinstance(e[2], str) for e in entries)
    tops = [row for m in metas for row in m["output_top_logprobs"]]
    assert len(tops) == 6 and all(len(row) == 2 and isinstance(row[0], tuple) for row in tops)


# -- 5. images on a text model -------------------------------------------------------------------------
def test_image_and_video_say_what_to_do_instead(backend):
    """SGLang's image_qa shape: the error comes where the program builds the prompt,
    naming the file and what to do."""

    @sgl.function
    def image_qa(s, question):
        s += sgl.user(sgl.image("example_image.png") + question)
        s += sgl.assistant(sgl.gen("answer"))

    with pytest.raises(NotImplementedError, match=r"image\('example_image.png'\): plait serves text-only models.*"
                                                  r"put a description of the image in the text instead"):
        image_qa.run(question="What is this?", backend=backend)
    with pytest.raises(NotImplementedError, match=r"video\('clip.mp4', 8\): .*put a description of it in the text"):
        sgl.video("clip.mp4", 8)


# -- 6. reading a streamed program from outside ---------------------------------------------------------
@sgl.function
def branch_on_the_answer(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=4)
    size = len(s["answer"])  # the body waits here before it appends the next gen
    s += f"\nThat was {size} characters. More:" + sgl.gen("more", max_tokens=4)
    return size


def test_a_streamed_program_s_later_variables_and_return_value_wait_for_its_body(backend, ref):
    """``state = f.run(stream=True); state["more"]``: the body had not appended gen
    "more" yet (it was waiting for "answer"), so the read raised UnknownVariableError;
    ``sync()`` could return before the body did, leaving ``ret_value`` None."""
    first = greedy(ref, "Q: Why?\nA:", max_new_tokens=4)
    second_prompt = f"Q: Why?\nA:{first}\nThat was {len(first)} characters. More:"
    want = greedy(ref, second_prompt, max_new_tokens=4)
    for _ in range(3):
        state = branch_on_the_answer.run(question="Why?", temperature=0, stream=True, backend=backend)
        assert state["more"] == want
        assert state.get_meta_info("more")["completion_tokens"] == 4
        state = branch_on_the_answer.run(question="Why?", temperature=0, stream=True, backend=backend)
        state.sync()
        assert state.ret_value == len(first) and state.text() == second_prompt + want
    with pytest.raises(sgl.UnknownVariableError, match="unknown variable 'nothing'"):
        branch_on_the_answer.run(question="Why?", temperature=0, stream=True, backend=backend)["nothing"]


# -- 7. bind, then positional arguments ---------------------------------------------------------------
@sgl.function
def few_shot(s, prompt, question):
    s += prompt + "Q: What is the capital of France?\nA: Paris\nQ: " + question + "\nA:"
    s += sgl.gen("answer", stop="\n", max_tokens=4)


def test_positional_arguments_fill_what_bind_left_open(backend, ref):
    """SGLang's test_bind shape, then ``run("...")`` / ``run_batch([[...]])``: the
    positional value went to the bound ``prompt`` and ``question`` was missing."""
    kid = few_shot.bind(prompt="Answer as a child would.\n\n")
    prompts = [f"Answer as a child would.\n\nQ: What is the capital of France?\nA: Paris\nQ: {q}\nA:"
               for q in ("Why?", "How?")]
    want = [greedy(ref, p, stop=["\n"], max_new_tokens=4) for p in prompts]
    assert kid.run("Why?", temperature=0, backend=backend)["answer"] == want[0]
    assert [st["answer"] for st in kid.run_batch([["Why?"], ["How?"]], temperature=0, backend=backend)] == want
    assert kid.trace(question="Why?").prefix_text(None) == prompts[0]
    with pytest.raises(TypeError, match=r"takes 1 positional arguments after s, got 2"):
        kid.run("Why?", "extra", backend=backend)


# -- benchmark shapes that already ran, kept running ------------------------------------------------------
@sgl.function
def multi_document_qa(s, docs, question):
    """SGLang's multi_document_qa benchmark shape: the documents are forked inside an
    open user turn and joined back as text."""
    s += sgl.user_begin()
    s += "Answer from the documents.\nQuestion: " + question + "\nDocuments begin.\n"
    forks = s.fork(len(docs))
    forks += lambda i: docs[i]
    forks.join("concate_and_append")
    s += "Documents end."
    s += sgl.user_end()
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


def _plan(s, question, branches):
    s += sgl.user("Plan: " + question)
    forks = s.fork(branches)
    forks += sgl.assistant(sgl.gen("plan", max_tokens=3))
    return forks


@sgl.function
def tree_search(s, question, branches):
    """The tree-of-thought benchmark shape: plain helpers fork forks, the program
    returns the leaves' texts."""
    leaves = []
    for plan in _plan(s, question, branches):
        plan += sgl.user("Solve it.")
        forks = plan.fork(branches)
        forks += sgl.assistant(sgl.gen("answer", max_tokens=3))
        leaves.extend(forks)
    return [leaf.text() for leaf in leaves]


def test_benchmark_shaped_programs_match_the_reference(backend, ref, folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    end = "<|im_end|>"
    docs = ["Ethan is Liam's father. ", "Noah is Julian's father. "]
    states = multi_document_qa.run_batch([{"docs": docs, "question": "Who is Julian's father?"},
                                          {"docs": docs[:1], "question": "Who is Liam's father?"}],
                                         temperature=0, num_threads=2, backend=backend)
    for st, n, q in zip(states, (2, 1), ("Who is Julian's father?", "Who is Liam's father?")):
        user = "Answer from the documents.\nQuestion: " + q + "\nDocuments begin.\n" + "".join(docs[:n]) + "Documents end."
        prompt = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        answer = greedy(ref, prompt, max_new_tokens=4, stop=[end])
        assert st["answer"] == answer and st.text() == prompt + answer + end + "\n"

    [state] = tree_search.run_batch([{"question": "2+2?", "branches": 2}], temperature=0, backend=backend)
    msgs = [{"role": "user", "content": "Plan: 2+2?"}]
    plan = greedy(ref, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), max_new_tokens=3,
                  stop=[end])
    msgs += [{"role": "assistant", "content": plan.lstrip()}, {"role": "user", "content": "Solve it."}]
    head = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if plan != plan.lstrip():  # the text keeps the generated whitespace that messages() strips
        head = head.replace(plan.lstrip(), plan, 1)
    leaf = head + greedy(ref, head, max_new_tokens=3, stop=[end]) + end + "\n"
    assert state.ret_value == [leaf] * 4


# -- 8. sgl.Runtime's helpers ---------------------------------------------------------------------------
def test_runtime_get_tokenizer_generate_and_cache_prefix(folder, ref):
    """``runtime = sgl.Runtime(...); tok = runtime.get_tokenizer()`` (scripts count and
    template tokens with it), ``json.loads(runtime.generate(prompt, params))["text"]``,
    ``runtime.cache_prefix(text)`` and ``sgl.Engine``'s ``get_tokenizer()`` raised
    AttributeError; so did ``await engine.async_generate(...)``."""
    import asyncio
    import json

    from transformers import AutoTokenizer

    text = "A shared instruction that every request of the batch starts with. " * 3
    with sgl.Runtime(model_path=folder, kv_cache_tokens=8192, num_threads=1, attention_backend="torch",
                     echo_logs=False) as rt:
        tok = rt.get_tokenizer()
        want = AutoTokenizer.from_pretrained(folder)
        assert tok.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)
        assert tok.chat_template == want.chat_template
        out = json.loads(rt.generate("Q: Why?\nA:", {"temperature": 0, "max_new_tokens": 4}))
        assert out["text"] == greedy(ref, "Q: Why?\nA:", max_new_tokens=4) and out["meta_info"]["completion_tokens"] == 4
        outs = json.loads(rt.generate(["Q: Why?\nA:", "Q: How?\nA:"], {"temperature": 0, "max_new_tokens": 2},
                                      return_logprob=True))
        assert [o["text"] for o in outs] == [greedy(ref, p, max_new_tokens=2) for p in ("Q: Why?\nA:", "Q: How?\nA:")]
        assert all(len(o["meta_info"]["output_token_logprobs"]) == 2 for o in outs)
        with pytest.raises(ValueError, match="lora_path='a' is not supported"):
            rt.generate("x", lora_path="a")
        rt.flush_cache()
        rt.cache_prefix(text)

        @sgl.function
        def after_the_prefix(s):
            s += text + sgl.gen("x", max_tokens=2)

        meta = after_the_prefix.run(temperature=0, backend=rt).get_meta_info("x")
        assert meta["cached_tokens"] > 0  # a fresh runtime: only cache_prefix put it there (whole blocks of it)

    with sgl.Engine(model_path=folder, max_total_tokens=4096, num_threads=1, attention_backend="torch") as engine:
        assert engine.get_tokenizer().encode(text, add_special_tokens=False) == \
            want.encode(text, add_special_tokens=False)

        async def both() -> list[Any]:  # SGLang's "non-streaming asynchronous generation"
            return list(await asyncio.gather(
                engine.async_generate(["Q: Why?\nA:", "Q: How?\nA:"], {"temperature": 0, "max_new_tokens": 3}),
                engine.async_generate("Q: When?\nA:", {"temperature": 0, "max_new_tokens": 3})))

        batch, single = asyncio.run(both())
        assert [o["text"] for o in batch + [single]] == [greedy(ref, f"Q: {q}\nA:", max_new_tokens=3)
                                                         for q in ("Why?", "How?", "When?")]


# -- 9. enable_precache_with_tracing = False traces nothing ------------------------------------------------
def test_without_precache_tracing_a_batch_runs_each_body_once(backend, ref):
    """A RAG-shaped body calls a retriever before its first gen. run_batch traces the
    instances (the body runs once more, up to its first model output); SGLang's off
    switch, ``global_config.enable_precache_with_tracing = False``, still traced them
    (for the submission order and the layout lint), so the retriever ran twice."""
    calls: list[str] = []

    def retrieve(question: str) -> str:
        calls.append(question)
        return f"Context for {question}\n"

    @sgl.function
    def rag(s, question):
        s += retrieve(question) + "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3)

    batch = [{"question": q} for q in ("Why?", "How?", "When?")]
    cfg = sgl.global_config
    cfg.enable_precache_with_tracing = False
    try:
        states = rag.run_batch(batch, temperature=0, backend=backend)
    finally:
        cfg.enable_precache_with_tracing = True
    assert sorted(calls) == sorted(q["question"] for q in batch)  # once per instance
    assert [st["answer"] for st in states] == [greedy(ref, f"Context for {q}\nQ: {q}\nA:", max_new_tokens=3)
                                              for q in ("Why?", "How?", "When?")]
    calls.clear()
    rag.run_batch(batch, temperature=0, backend=backend)  # the default traces: the retriever runs again
    assert len(calls) > len(batch)


# -- 10. SGLang's output settings in global_config ------------------------------------------------------
class Recording(sgl.BaseBackend):
    """Answers every request with "ok" and records it."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def submit(self, req: Any, on_chunk: Any = None) -> Any:
        from plait.backend import Pending

        self.requests.append(req)
        p = Pending(req, on_chunk)
        meta = {"prompt_tokens": 1, "completion_tokens": 1, "finish_reason": {"type": "stop"}}
        for i in range(req.n):
            p.result(i, {"text": "ok", "output_ids": [], "meta_info": dict(meta)})
        return p

    def abort(self, rid: str) -> None:
        pass

    def get_chat_template(self) -> Any:
        return None


def test_global_config_special_token_settings(backend, ref):
    """``sgl.global_config.skip_special_tokens_in_output = False`` (SGLang's switch to
    keep special tokens in outputs) raised AttributeError."""
    cfg = sgl.global_config
    assert cfg.skip_special_tokens_in_output is True and cfg.spaces_between_special_tokens_in_out is True
    fake = Recording()
    few_shot.run(prompt="P\n", question="Why?", backend=fake)
    assert "skip_special_tokens" not in fake.requests[-1].sampling_params  # the runtime's default: skip them
    cfg.skip_special_tokens_in_output = False
    cfg.spaces_between_special_tokens_in_out = False
    try:
        few_shot.run(prompt="P\n", question="Why?", backend=fake)
        assert fake.requests[-1].sampling_params["skip_special_tokens"] is False
        state = few_shot.run(prompt="P\n", question="Why?", temperature=0, backend=backend)
    finally:
        cfg.skip_special_tokens_in_output = True
        cfg.spaces_between_special_tokens_in_out = True
    prompt = "P\nQ: What is the capital of France?\nA: Paris\nQ: Why?\nA:"
    want = greedy(ref, prompt, stop=["\n", "<|im_end|>"], max_new_tokens=4, skip_special_tokens=False)
    assert state["answer"] == want
