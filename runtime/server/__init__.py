"""The plait server: a front process (HTTP + language-client ZMQ socket, tokenizer,
request table, streams, metrics) and an engine process (scheduler, KV cache, model).

``launch()`` starts both as a sidecar of the calling process; ``plait serve`` runs
them from the command line. The wire protocol is :mod:`plait.protocol`.
"""

from __future__ import annotations

from plait.runtime.server.args import ServerArgs
from plait.runtime.server.launch import RuntimeProcess, launch

__all__ = ["RuntimeProcess", "ServerArgs", "launch"]
