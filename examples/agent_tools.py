"""A small tool-calling agent written as a plait program: the model calls a calculator
and a lookup table until it answers.

    python examples/agent_tools.py                  # default model (SmolLM2-135M-Instruct), in process
    python examples/agent_tools.py --model PATH     # any Hugging Face folder, .gguf file or hub id
    python examples/agent_tools.py --runtime        # on a runtime sidecar instead (same program)

``gen(..., tools=TOOLS, tool_choice=...)`` stores the model's text as usual and the
calls it made in ``s.get_meta_info(name)["tool_calls"]`` (OpenAI's shape). The first
step uses ``tool_choice="required"``: constrained decoding forces a well-formed call
whose arguments follow the tool's JSON Schema, so even a 135M model makes a valid one.
Later steps use ``auto``: the model calls again or answers in text, which ends the loop.

Expect well-formed calls, not sensible ones, from the default 135M model: a run on it
called ``calculator`` with ``"1.0000000000000001"`` and then repeated the tool's
response as its answer. The program is the point; pass ``--model`` with a larger
instruct model for useful answers.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
from typing import Any

import plait as sgl
from plait.tool_parsers import generic_tools_prompt

POPULATION_MILLIONS = {"Paris": 2.1, "Berlin": 3.7, "Rome": 2.8, "Madrid": 3.3, "Vienna": 2.0}

TOOLS = [
    {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 40}},
                       "required": ["expression"]},
    }},
    {"type": "function", "function": {
        "name": "lookup_population",
        "description": "The population of a city, in millions.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "enum": sorted(POPULATION_MILLIONS)}},
                       "required": ["city"]},
    }},
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> float:
    """Arithmetic only: the expression is parsed, never executed."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return ev(ast.parse(expression, mode="eval").body)


def lookup_population(city: str) -> float:
    if city not in POPULATION_MILLIONS:
        raise ValueError(f"no entry for {city!r}; known cities: {', '.join(sorted(POPULATION_MILLIONS))}")
    return POPULATION_MILLIONS[city]


FUNCTIONS = {"calculator": calculator, "lookup_population": lookup_population}


def call_tool(call: dict[str, Any]) -> str:
    """Run one call (OpenAI's shape) and return its result, or the error, as text."""
    fn = call["function"]
    try:
        return json.dumps({"result": FUNCTIONS[fn["name"]](**json.loads(fn["arguments"]))})
    except (ValueError, TypeError, KeyError, SyntaxError, ZeroDivisionError) as e:
        return json.dumps({"error": f"{type(e).__name__}: {e}"})


@sgl.function
def agent(s, question, max_steps=3):
    s += sgl.system("You are a helpful assistant.\n\n" + generic_tools_prompt(TOOLS))
    s += sgl.user(question)
    for step in range(max_steps):
        name = f"step_{step}"
        # the first step must call a tool; later ones may answer instead; the last must answer
        choice = "required" if step == 0 else "auto" if step < max_steps - 1 else "none"
        s += sgl.assistant(sgl.gen(name, max_tokens=96, temperature=0, tools=TOOLS, tool_choice=choice,
                                   parallel_tool_calls=False))
        calls = s.get_meta_info(name)["tool_calls"]
        if not calls:
            s["answer"] = s.get_meta_info(name)["content"]
            return s["answer"]
        for call in calls:
            s += sgl.user("<tool_response>\n" + call_tool(call) + "\n</tool_response>")
    return None  # never reached: the last step cannot call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder, .gguf path or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--runtime", action="store_true", help="run on a runtime sidecar instead of in process")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine")
    parser.add_argument("--question", default="What is the population of Berlin plus the population of Rome?")
    args = parser.parse_args(argv)
    config = {} if args.num_threads is None else {"num_threads": args.num_threads}
    backend = sgl.Runtime(args.model, **config) if args.runtime else sgl.Engine(args.model, **config)
    try:
        state = agent.run(question=args.question, backend=backend)
        for m in state.messages()[1:]:
            print(f"[{m['role']}] {m['content'].strip()}\n")
        print("answer:", state.ret_value)
    finally:
        backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
