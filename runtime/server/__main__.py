"""``python -m plait.runtime.server [flags]``: run the front process (it starts the engine)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from plait.runtime.server.args import ServerArgs, add_server_arguments, args_from_namespace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.runtime.server", usage="%(prog)s [MODEL] [options]",
                                     description="plait server (front process)", allow_abbrev=False)
    add_server_arguments(parser)
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--validated-args", default=None, help=argparse.SUPPRESS)  # from launch()
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_validated_json(ns.validated_args) if ns.validated_args else args_from_namespace(ns)
    except ValueError as e:
        if ns.ready_fd is None:
            parser.error(str(e))  # exits 2, as an argparse error does
        os.write(ns.ready_fd, (json.dumps({"error": str(e)}) + "\n").encode())
        print(f"error: {e}", file=sys.stderr)
        return 2
    from plait.runtime.server.serve import run

    return run(args, ns.ready_fd, ns.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
