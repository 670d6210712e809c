"""Fingerprints of what cached KV depends on: the weights and the tokenizer.

Cached KV is valid for the weights that computed it; token ids mean what the tokenizer
says. The engine keeps both fingerprints and drops its prefix cache when new weights
differ (:meth:`plait.runtime.Engine.update_weights_from_disk`). Weights are
fingerprinted by their files (name, size, modification time), which is cheap at any
model size; the tokenizer by its vocabulary and special tokens.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_fingerprint(kind: str, path: str) -> str:
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith(WEIGHT_SUFFIXES))
    h = hashlib.blake2b(kind.encode(), digest_size=12)
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.blake2b(type(tokenizer).__name__.encode(), digest_size=12)
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{i}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    h.update(repr(sorted(getattr(tokenizer, "all_special_tokens", []))).encode())
    return h.hexdigest()
