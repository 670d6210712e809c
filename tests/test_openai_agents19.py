"""Agent trial, round 3 (after test_openai_agents18.py): full agent loops on the official
``openai`` client's helpers (``chat.completions.stream``/``parse`` with
``openai.pydantic_function_tool``, ``responses.parse``/``stream``), LangChain's,
LiteLLM's, the OpenAI Agents SDK's and the Vercel AI SDK's request shapes, against a
tiny random model with Qwen3's own template (hermes calls). Most of what they send was
already served; the gaps found:

- Tool results answered in another order than the calls: agents run a turn's calls
  concurrently and may send the ``tool`` messages (``function_call_output`` items) as
  the tools finished. OpenAI matches them to calls by ``tool_call_id``, but Qwen3's and
  Hermes' templates (and plait's generic tool prompt) show results without ids, in
  order, so the model read each result as the answer to the call in its place. A run of
  results is now put in the order of the calls it answers, on both APIs; results that
  answer no call follow as given (served, as test_openai_agents_trial.py decided).
- The Responses object dropped ``max_tool_calls`` and ``top_logprobs`` the request set
  (OpenAI repeats them; the client types them); they are repeated now.

Found and not changed: ``functions``/``function_call`` (the deprecated API) and a
message's ``function_call`` or ``role: "function"`` stay 400s naming the field; a
``tool_call_id`` that answers no call, or a call left unanswered, is served (vLLM
does; OpenAI refuses); a ``strict`` tool is enforced only when a call is forced (or
beside a JSON format), not in a call the model writes by itself under ``auto``.

A random model rarely calls a tool by itself, so forced choices (constrained decoding)
carry the call checks; what the template rendered is checked by greedy logprobs, each
request in its own cache namespace (the same prompt gives the same numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pydantic
import pytest

from conftest import with_chat_template

from plait.runtime.server import launch

MODEL = "tiny"
TEMPLATE = Path(__file__).parent / "data" / "templates17" / "qwen3.jinja"


class Add(pydantic.BaseModel):
    """Add two digits."""

    a: int = pydantic.Field(ge=0, le=9)
    b: int = pydantic.Field(ge=0, le=9)


class Mul(pydantic.BaseModel):
    """Multiply two digits."""

    a: int = pydantic.Field(ge=0, le=9)
    b: int = pydantic.Field(ge=0, le=9)


TOOLS = [openai.pydantic_function_tool(Add, name="add"), openai.pydantic_function_tool(Mul, name="mul")]
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = [{"role": "user", "content": "What are 2 + 3 and 2 * 3?"}]


@pytest.fixture(scope="module")
def oai(tiny_model_factory, tmp_path_factory):
    folder = with_chat_template(tiny_model_factory("llama"), tmp_path_factory.mktemp("qwen3-agents19"),
                                TEMPLATE.read_text())
    with launch(str(folder), num_threads=1, kv_cache_tokens=8192, max_running_requests=8,
                served_model_name=MODEL) as rt:
        yield openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat_logprobs(oai: openai.OpenAI, messages: list, salt: str) -> list[float]:
    """The greedy continuation's logprobs (its own cache namespace: computed from scratch)."""
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, logprobs=True,
                                    max_completion_tokens=4, extra_body={"cache_salt": salt})
    return [t.logprob for t in r.choices[0].logprobs.content]


def _responses_logprobs(oai: openai.OpenAI, salt: str, **kw) -> list[float]:
    r = oai.responses.create(model=MODEL, tools=FLAT, temperature=0, max_output_tokens=4, store=False,
                             include=["message.output_text.logprobs"], extra_body={"cache_salt": salt}, **kw)
    assert r.output[-1].type == "message", r.output
    return [t.logprob for t in r.output[-1].content[0].logprobs]


def test_tool_results_sent_out_of_order_are_shown_in_call_order(oai):
    calls = [{"id": f"call_{k}", "type": "function",
              "function": {"name": name, "arguments": json.dumps({"a": 2, "b": 3})}}
             for k, name in enumerate(("add", "mul", "add"))]
    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    answers = [f"result {k}: {'x' * k}" for k in range(len(calls))]
    in_order = [{"role": "tool", "tool_call_id": c["id"], "content": a} for c, a in zip(calls, answers)]
    # each call's answer, sent last-finished first (the answers themselves unchanged)
    reversed_ = in_order[::-1]
    # what the unfixed server rendered for that: the answers in the wrong places
    misplaced = [{**m, "content": a} for m, a in zip(in_order, answers[::-1])]
    want = _chat_logprobs(oai, ASK + [turn] + in_order, "a")
    assert _chat_logprobs(oai, ASK + [turn] + reversed_, "b") == want
    assert _chat_logprobs(oai, ASK + [turn] + misplaced, "c") != want  # the check can tell them apart
    # an answer to no call stays after the matched ones, as given
    stray = {"role": "tool", "tool_call_id": "call_unknown", "content": "nobody asked"}
    assert _chat_logprobs(oai, ASK + [turn, stray] + reversed_, "d") == \
        _chat_logprobs(oai, ASK + [turn] + in_order + [stray], "e")

    # the Agents SDK's replay: the response's items, then the outputs as the tools finished
    # (a forced parallel turn of a random model writes calls until the length limit)
    r1 = oai.responses.create(model=MODEL, input=ASK, tools=FLAT, tool_choice="required", max_output_tokens=60,
                              temperature=0)
    fcs = [it for it in r1.output if it.type == "function_call"]
    assert len(fcs) >= 2, r1.output
    outputs = [{"type": "function_call_output", "call_id": fc.call_id, "output": a} for fc, a in zip(fcs, answers)]
    replay = ASK + [it.model_dump(exclude_none=True) for it in r1.output]
    want = _responses_logprobs(oai, "f", input=replay + outputs)
    assert _responses_logprobs(oai, "g", input=replay + outputs[::-1]) == want
    swapped = [{**o, "output": a} for o, a in zip(outputs, [o["output"] for o in outputs][::-1])]
    assert _responses_logprobs(oai, "h", input=replay + swapped) != want
    # ... and continued with previous_response_id
    assert _responses_logprobs(oai, "i", previous_response_id=r1.id, input=outputs[::-1]) == \
        _responses_logprobs(oai, "j", previous_response_id=r1.id, input=outputs)


def test_the_response_repeats_max_tool_calls_and_top_logprobs(oai):
    r = oai.responses.create(model=MODEL, input="hi", tools=FLAT, max_tool_calls=3, top_logprobs=2,
                             include=["message.output_text.logprobs"], max_output_tokens=2)
    assert r.max_tool_calls == 3 and r.top_logprobs == 2
    # (a named call ends the turn: the client's stream helper gives a final response only then)
    with oai.responses.stream(model=MODEL, input="hi", tools=FLAT, tool_choice={"type": "function", "name": "add"},
                              max_tool_calls=1, max_output_tokens=60) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert final.max_tool_calls == 1 and final.top_logprobs is None
    assert oai.responses.retrieve(r.id).max_tool_calls == 3
    plain = oai.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert plain.max_tool_calls is None and plain.top_logprobs is None
    assert json.loads(plain.model_dump_json())["truncation"] == "disabled"
