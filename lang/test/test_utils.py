"""The two helpers SGLang's benchmark scripts (``benchmark/*/bench_sglang.py``) take from
``sglang.test.test_utils``: the common command-line options and the backend they
select. A script whose ``sglang`` became ``plait`` runs against a plait server with the
same flags (``--host``, ``--port``, ``--parallel``, ``--backend``, ``--result-file``).

``is_in_ci`` too, which SGLang's frontend notebooks import to shorten their runs in CI.
SGLang's other test helpers (launching its own test servers) belong to SGLang's test
suite, not to programs, and are not here.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_common_sglang_args_and_parse", "is_in_ci", "select_sglang_backend"]


def is_in_ci() -> bool:
    """Whether the environment variable ``SGLANG_IS_IN_CI`` is true (``1``, ``true``,
    ``yes`` or ``on``, any case), as SGLang reads it."""
    import os

    return os.environ.get("SGLANG_IS_IN_CI", "").strip().lower() in ("1", "true", "yes", "on")


def add_common_sglang_args_and_parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add the options every SGLang benchmark script takes to ``parser`` and parse the
    command line: ``--parallel`` (``run_batch`` threads, 64), ``--host``
    (``http://127.0.0.1``), ``--port`` (30000, ``plait serve``'s default),
    ``--backend`` (``srt``), ``--device``, ``--result-file`` (``result.jsonl``) and
    ``--raw-result-file``."""
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--host", type=str, default="http://127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--backend", type=str, default="srt")
    parser.add_argument("--device", type=str, default="cpu")
    parser.add_argument("--result-file", type=str, default="result.jsonl")
    parser.add_argument("--raw-result-file", type=str)
    return parser.parse_args()


def select_sglang_backend(args: argparse.Namespace) -> Any:
    """The backend ``args.backend`` names: ``srt`` (and SGLang's ``srt-...`` variants)
    is the plait server at ``args.host``:``args.port``, a
    :class:`plait.RuntimeEndpoint`; ``srt-no-parallel`` also turns parallel encoding
    off, as in SGLang. Hosted-API backends (``gpt-...``) and others raise ValueError."""
    from plait.global_config import global_config
    from plait.runtime_endpoint import RuntimeEndpoint
    from plait.utils import normalize_base_url

    name = str(getattr(args, "backend", "srt"))
    if not name.startswith("srt"):
        raise ValueError(f"backend {name!r} is not available in plait: use 'srt' (a plait server at --host/--port); "
                         "hosted-API backends such as OpenAI's are not part of plait")
    if name == "srt-no-parallel":
        global_config.enable_parallel_encoding = False
    return RuntimeEndpoint(normalize_base_url(args.host, args.port))
