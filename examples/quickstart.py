"""A plait program: few-shot prompting, a select, and a JSON record with regex fields.

    python examples/quickstart.py                 # default model (SmolLM2-135M-Instruct), runtime sidecar
    python examples/quickstart.py --in-process    # the same on an in-process engine, no server
    python examples/quickstart.py --model PATH    # any Hugging Face folder, .gguf file or hub id

The program is plain SGLang frontend code: ``import plait as sgl`` is the only change.
``run_batch`` traces it first, finds the few-shot prefix every instance shares, pins
that prefix in the runtime's KV cache for the batch, and submits the instances grouped
by it.
"""

from __future__ import annotations

import argparse
import json
import sys

import plait as sgl

FEW_SHOT = """Label each product review as JSON.

Review: Works exactly as described and shipping was fast.
Label: {"sentiment": "positive", "stars": 5, "topic": "shipping"}

Review: It's fine, nothing special, a bit noisy at night.
Label: {"sentiment": "neutral", "stars": 3, "topic": "noise"}

Review: Great sound, the bass is amazing.
Label: {"sentiment": "positive", "stars": 4, "topic": "sound"}

Review: The battery died after two days. Useless, I want a refund.
Label: {"sentiment": "negative", "stars": 1, "topic": "battery"}

"""

REVIEWS = [
    "The screen is gorgeous and bright, I love it.",
    "Stopped charging after a week, and support never answered.",
    "Decent blender for the price, but the lid leaks.",
    "Comfortable shoes, I wear them every day.",
]


@sgl.function
def label_review(s, review, constrained=True):
    s += FEW_SHOT + "Review: " + review + "\nLabel: "
    with s.var_scope("label"):
        s += '{"sentiment": "' + sgl.select("sentiment", ["positive", "negative", "neutral"]) + '", '
        if constrained:  # the runtime's constrained decoding enforces these patterns
            s += '"stars": ' + sgl.gen("stars", max_tokens=2, regex=r"[1-5]") + ", "
            # the pattern ends the field with its quote (or the quote and the brace, the
            # one token "}" models write there: without it the model was held to letters
            # until max_tokens); the stop string trims it off
            s += '"topic": "' + sgl.gen("topic", max_tokens=8, regex=r'[a-z]+( [a-z]+)?"\}?', stop='"') + '"}'
        else:
            s += '"stars": ' + sgl.gen("stars", max_tokens=2, stop=[",", "}"]) + ", "
            s += '"topic": "' + sgl.gen("topic", max_tokens=6, stop=['"', "\n"]) + '"}'


def regex_unsupported(states: list[sgl.ProgramState]) -> bool:
    err = states[0].error()
    return isinstance(err, sgl.BackendError) and "regex" in str(err)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder, .gguf path or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--in-process", action="store_true", help="run on an in-process engine instead of a sidecar")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine")
    args = parser.parse_args(argv)
    config = {} if args.num_threads is None else {"num_threads": args.num_threads}
    backend = sgl.EngineBackend(args.model, **config) if args.in_process else sgl.Runtime(args.model, **config)
    sgl.set_default_backend(backend)
    try:
        print("The program as plait traces it (run_batch pins the prefix every review shares, once):\n")
        print(label_review.trace(review="...").pretty(), end="\n\n")
        batch = [{"review": r} for r in REVIEWS]
        states = label_review.run_batch(batch, temperature=0)
        if regex_unsupported(states):
            print("note: this runtime has no constrained decoding yet; using stop strings for the regex fields\n")
            states = label_review.run_batch([{**b, "constrained": False} for b in batch], temperature=0)
        print("Labels (a 135M model: the JSON shape is enforced, the judgement is the small model's):\n")
        for review, state in zip(REVIEWS, states):
            if state.error() is not None:
                print(f"{review}\n  error: {state.error()}")
                continue
            label = state["label"]
            try:
                parsed = json.loads(label)
            except json.JSONDecodeError:
                parsed = None
            print(f"{review}\n  {label}" + ("" if parsed is not None else "  (not valid JSON)"))
    finally:
        sgl.set_default_backend(None)
        backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
