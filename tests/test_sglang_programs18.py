"""SGLang programs and scripts plait's authors did not write, in the idioms of public
code that does ``import sglang as sgl`` (an evaluation harness that builds ``sgl.Engine``
from its model arguments and reads the tokenizer off the engine, the offline-engine docs'
streaming modes, the reasoning docs' look at the executor's variables), run through
``import plait as sgl``; one test per gap they found:

1. ``sgl.Engine(model_path=..., tp_size=1, dp_size=1, ...)`` (lm-eval's constructor)
   was refused: ``dp_size`` is a server option, and any server option, even at the
   value that changes nothing, said "options of a server". A server option at its
   default is now accepted; another value is refused naming the option and value.
2. ``engine.tokenizer_manager.tokenizer`` / ``.context_len`` (where lm-eval reads the
   tokenizer and the context length) raised AttributeError.
3. ``engine.generate(prompt, params, stream=True)`` and ``await
   engine.async_generate(..., stream=True)`` (two of the four modes of SGLang's offline
   engine docs) were refused; they now yield output dicts with the text so far, as
   SGLang's stream by default, the last one the final output.
4. ``state.stream_executor.variable_event`` (SGLang's reasoning docs print its keys)
   raised AttributeError.

Model outputs are compared with a plain reference ``Engine`` on the same tiny weights,
so nothing depends on what the random model says.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import plait as sgl
from plait.errors import BackendError
from plait.runtime import Engine

from lang_fixtures import ENGINE_OPTS, folder, ref  # noqa: F401  (pytest fixtures)

def greedy(ref: Engine, prompt: str, **params: Any) -> dict[str, Any]:
    return ref.generate(prompt, {"temperature": 0.0, **params})


@pytest.fixture(scope="module")
def llm(folder):
    """``sgl.Engine`` built as lm-eval builds it (its model arguments; the device is
    the CPU here, lm-eval's default is CUDA)."""
    args = {
        "model_path": folder, "tokenizer_path": None, "tokenizer_mode": "auto", "load_format": "auto",
        "trust_remote_code": True, "dtype": "auto", "kv_cache_dtype": "auto", "device": "cpu",
        "mem_fraction_static": None, "tp_size": 1, "dp_size": 1, "chunked_prefill_size": -1,
    }
    engine = sgl.Engine(**args, **ENGINE_OPTS)
    yield engine
    engine.shutdown()


# -- 1. an evaluation harness's engine options ------------------------------------------------------
def test_engine_takes_server_options_at_their_defaults(llm, ref, folder):
    tok = llm.tokenizer
    contexts = ["The capital of France is", "Once upon a time"]
    ids = tok(contexts, add_special_tokens=False).input_ids
    params = {"temperature": 0.0, "max_new_tokens": 5, "skip_special_tokens": False}
    outs = llm.generate(input_ids=ids, sampling_params=[params, params])
    assert [o["text"] for o in outs] == [greedy(ref, c, max_new_tokens=5)["text"] for c in contexts]
    # a value that would change something is refused by name, before a model is loaded
    with pytest.raises(ValueError, match=r"dp_size=2 is an option of a server.*one replica.*plait.Runtime"):
        sgl.Engine(folder, dp_size=2)
    with pytest.raises(ValueError, match=r"host='0.0.0.0' is an option of a server"):
        sgl.Engine(folder, host="0.0.0.0")


# -- 2. the tokenizer and context length where SGLang's engine keeps them ------------------------------
def test_tokenizer_manager_holds_the_tokenizer_and_context_length(llm, ref):
    manager = llm.tokenizer_manager
    assert manager.tokenizer is llm.tokenizer
    assert manager.context_len == ref.context_len == 1024
    # lm-eval's loglikelihood: one token generated, the prompt's logprobs read back
    ids = manager.tokenizer("Hello there friend", add_special_tokens=False).input_ids
    out = llm.generate(input_ids=[ids], sampling_params=[{"temperature": 0, "max_new_tokens": 1}],
                       return_logprob=True, top_logprobs_num=2, logprob_start_len=0)[0]
    assert [tid for _, tid, _ in out["meta_info"]["input_token_logprobs"]] == ids
    assert out["meta_info"]["input_top_logprobs"][0] is None and len(out["meta_info"]["input_top_logprobs"][1]) == 2


# -- 3. the offline engine's streaming modes -----------------------------------------------------------
def test_generate_and_async_generate_stream_the_text_so_far(llm, ref):
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    expected = greedy(ref, "Hello, my name is", max_new_tokens=6, ignore_eos=True)
    chunks = list(llm.generate("Hello, my name is", params, stream=True))
    *pieces, final = chunks
    assert len(pieces) >= 2
    for before, after in zip(pieces, pieces[1:]):  # the text so far: each extends the one before
        assert after["text"].startswith(before["text"])
        assert after["meta_info"]["completion_tokens"] > before["meta_info"]["completion_tokens"]
    assert final["text"] == pieces[-1]["text"] == expected["text"]
    assert final["output_ids"] == expected["output_ids"]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    # the docs' merge of the chunks (a chunk's overlap with the text so far is trimmed)
    merged = ""
    for chunk in llm.generate("Hello, my name is", params, stream=True):
        overlap = next((i for i in range(len(chunk["text"]), 0, -1) if merged.endswith(chunk["text"][:i])), 0)
        merged += chunk["text"][overlap:]
    assert merged == expected["text"]

    async def consume() -> list[str]:
        stream = await llm.async_generate("Hello, my name is", params, stream=True)
        return [chunk["text"] async for chunk in stream]

    assert asyncio.run(consume())[-1] == expected["text"]
    # leaving early aborts the request (a long one: the engine is free again at once)
    stream = llm.generate("Hello", {"temperature": 0.0, "max_new_tokens": 500, "ignore_eos": True}, stream=True)
    assert next(stream)["meta_info"]["completion_tokens"] >= 1
    stream.close()
    assert llm.generate("Hi", {"temperature": 0.0, "max_new_tokens": 3})["text"] == greedy(
        ref, "Hi", max_new_tokens=3)["text"]
    with pytest.raises(ValueError, match="stream=True streams one prompt; 2 were given"):
        llm.generate(["a", "b"], params, stream=True)
    with pytest.raises(BackendError, match="max_new_tokens=-1 is invalid"):
        list(llm.generate("a", {"max_new_tokens": -1}, stream=True))


# -- 4. the executor's variable events, as the reasoning docs print them -------------------------------
@sgl.function
def basic_qa_separate_reasoning(s, question):
    s += sgl.system("You are a helpful assistant than can answer questions.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    s += sgl.separate_reasoning(sgl.gen("answer", max_tokens=5), model_type="qwen3")
    s += sgl.assistant_end()


def test_executor_variable_events_name_the_variables(llm, ref):
    state = basic_qa_separate_reasoning("List 3 countries.", temperature=0, backend=llm)
    events = state.stream_executor.variable_event
    assert set(events) == {"answer", "answer_reasoning_content"}
    assert all(e.is_set() and e.wait(0) for e in events.values())
    # the model gave no reasoning section: all of it is the answer
    text = state.text()
    prompt = text[: text.index(state["answer"])]
    assert state["answer"] == greedy(ref, prompt, max_new_tokens=5, stop=["<|im_end|>"])["text"]
    assert state["answer_reasoning_content"] is None

    @sgl.function
    def slow(s):
        s += "Count:" + sgl.gen("n", max_tokens=40, ignore_eos=True)

    streamed = slow.run(stream=True, temperature=0, backend=llm)
    event = streamed.stream_executor.variable_event.get("n")
    if event is not None:  # the body may not have reached the gen yet
        assert event.wait(30) and event.is_set()
    streamed.sync()
    assert streamed.stream_executor.variable_event["n"].is_set()
