"""The ``plait`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait", description="plait command line")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with the in-process engine")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default=None, help="HF folder, .gguf path or hub id (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--num-threads", type=int, default=None)
    serve = sub.add_parser(
        "serve",
        help="run the plait server (OpenAI-compatible and native HTTP API, ZMQ for language clients)",
        description="Run the plait server: a front process (HTTP + ZMQ) and an engine process. "
        "Stop it with Ctrl-C or SIGTERM.",
    )
    from plait.runtime.server.args import add_server_arguments  # torch-free

    add_server_arguments(serve, default_port=30000)
    args = parser.parse_args(argv)

    if args.command == "serve":
        from plait.runtime.server.args import args_from_namespace
        from plait.runtime.server.serve import run

        try:
            server_args = args_from_namespace(args)
        except ValueError as e:
            parser.error(str(e))
        return run(server_args, announce=True)

    if args.command == "generate":
        from plait.runtime import Engine

        config = {} if args.num_threads is None else {"num_threads": args.num_threads}
        with Engine(args.model, **config) as engine:
            outs = engine.generate(
                list(args.prompt),
                {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
            )
        for prompt, out in zip(args.prompt, outs):
            print(f"### {prompt}\n{out['text']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
