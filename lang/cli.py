"""The ``plait`` command line."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    # allow_abbrev=False: an abbreviation accepted today (--prot for --protocol) becomes
    # ambiguous, or means another option, when an option is added; spell options out
    parser = argparse.ArgumentParser(prog="plait", description="plait command line", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with the in-process engine", allow_abbrev=False)
    gen.add_argument("prompt", nargs="+", help="one or more prompts, each sent as raw text (no chat template: an "
                     "Instruct model continues the text; for chat, use plait serve and its /v1/chat/completions)")
    gen.add_argument("--model", default=None, help="HF folder, .gguf path or hub id (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0.0)")
    gen.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: one per core; on a machine busy with other work, 1 is often faster)")
    serve = sub.add_parser(
        "serve",
        usage="%(prog)s [MODEL] [options]",
        allow_abbrev=False,
        help="run the plait server (OpenAI-compatible and native HTTP API, ZMQ for language clients)",
        description="Run the plait server: a front process (HTTP + ZMQ) and an engine process. "
        "Stop it with Ctrl-C or SIGTERM.",
    )
    lint = sub.add_parser("lint", help="check a program's prompt layout for prefix-cache reuse (plait.lint)",
                          description="Trace a plait function and report values that differ between calls (arguments, "
                          "model outputs) placed before long constant text, with the tokens of reuse lost. Exit "
                          "status 1 when there is something to report.", allow_abbrev=False)
    lint.add_argument("target", help="module:function or path/to/file.py:function, e.g. myapp.prompts:answer")
    lint.add_argument("--min-tokens", type=int, default=32, help="report constant text of at least this many tokens")
    from plait.runtime.server.args import add_server_arguments  # torch-free

    add_server_arguments(serve, default_port=30000)
    # an unknown option is reported with its subcommand's usage, not the top-level one
    args, extra = parser.parse_known_args(argv)
    if extra:
        {"serve": serve, "lint": lint, "generate": gen}[args.command].error(
            f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "serve":
        from plait.runtime.server.args import args_from_namespace
        from plait.runtime.server.serve import run

        try:
            server_args = args_from_namespace(args)
        except ValueError as e:
            serve.error(str(e))
        return run(server_args, announce=True)

    if args.command == "lint":
        return _lint(parser, args.target, args.min_tokens)

    if args.command == "generate":
        return _generate(gen, args)
    return 0


def _generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``plait generate``: options checked before the model loads; a bad option, model
    path or prompt is one line on stderr (exit status 2), as ``plait serve`` reports it."""
    from plait.runtime import Engine
    from plait.runtime.config import EngineConfig
    from plait.runtime.sampling_params import SamplingParams

    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    config = {} if args.num_threads is None else {"num_threads": args.num_threads}
    try:
        SamplingParams.from_dict(params).validate()
        EngineConfig(**config)
        with Engine(args.model, **config) as engine:
            outs = engine.generate(list(args.prompt), params)
    except (ValueError, OSError) as e:  # RequestError is a ValueError; a missing model an OSError
        parser.error(" ".join(str(e).split()) or type(e).__name__)
    for prompt, out in zip(args.prompt, outs):
        print(f"### {prompt}\n{out['text']}\n")
    return 0


def _lint(parser: argparse.ArgumentParser, target: str, min_tokens: int) -> int:
    import importlib
    import importlib.util

    from plait.api import Function

    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        parser.error(f"lint target {target!r} must be module:function or path/to/file.py:function")
    sys.path.insert(0, "")  # modules of the current directory, as python -m does
    try:
        if module_name.endswith(".py"):  # a file, run as a module of its own name (its folder importable)
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                parser.error(f"cannot load {target}: no file {module_name!r}")
            sys.path.insert(0, os.path.dirname(path))
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        parser.error(f"cannot load {target}: {e}")
    if not isinstance(fn, Function):
        parser.error(f"{target} is not a plait function (decorate it with @plait.function)")
    issues = fn.lint(min_tokens=min_tokens)
    for issue in issues:
        print(issue)
    if not issues:
        print(f"{fn.__name__}: no prompt-layout problems found")  # (named as the reports name it)
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main())
