"""The model's vocabulary as raw bytes: what each token id writes into the output.

Three spellings exist in Hugging Face tokenizers:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): every byte is drawn as a printable
  character through GPT-2's byte table, so ``Ġ`` is a space and ``Ċ`` a newline;
- sentencepiece (Llama 2, Mistral): ``▁`` is a space and ``<0xNN>`` is one raw byte;
- anything else: the token string is its own UTF-8 text.

Special tokens (``<|im_end|>``, ``</s>``...) and EOS ids get no bytes: a constraint can
never emit them as text. Torch-free.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.runtime.constrained.worker import SENTINEL_FIRST_BYTE

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
PLAIN = "plain"

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def gpt2_byte_table() -> dict[str, int]:
    """GPT-2's printable character -> byte. Printable Latin-1 bytes stand for
    themselves; the other 68 bytes are drawn as U+0100 onwards, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


_GPT2_DECODE = gpt2_byte_table()
_GPT2_TRANSLATE = {ord(c): chr(b) for c, b in _GPT2_DECODE.items()}
_GPT2_CHARS = frozenset(_GPT2_DECODE)


def detect_kind(tokenizer: Any) -> str:
    """Which spelling ``tokenizer`` uses (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        parts = json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])
        if '"ByteLevel"' in parts:
            return BYTE_LEVEL
        if '"ByteFallback"' in parts or '"Metaspace"' in parts or "\u2581" in parts:
            return SENTENCEPIECE
        return PLAIN
    if getattr(tokenizer, "sp_model", None) is not None:
        return SENTENCEPIECE
    vocab = tokenizer.get_vocab()
    if sum(t.startswith("\u0120") for t in vocab) > len(vocab) // 20:
        return BYTE_LEVEL
    if sum(t.startswith("\u2581") for t in vocab) > len(vocab) // 20:
        return SENTENCEPIECE
    return PLAIN


def token_to_bytes(token: str, kind: str) -> bytes:
    """Raw bytes of one vocabulary entry of a tokenizer of ``kind``."""
    if kind == BYTE_LEVEL:
        if _GPT2_CHARS.issuperset(token):
            return token.translate(_GPT2_TRANSLATE).encode("latin-1")
        return token.encode("utf-8")  # an added (non-special) token is stored as text
    if kind == SENTENCEPIECE:
        m = _SP_BYTE.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")
    return token.encode("utf-8")


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of every special token, including added tokens flagged special."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


@dataclass
class TokenVocab:
    """Token id -> raw bytes (None: never emitted by a constraint), the EOS ids, and
    the tokenizer's ``encode`` (used to re-tokenize at jump-forward boundaries).

    ``size`` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary (padded embeddings); ids past the tokenizer have no bytes.
    """

    token_bytes: list[bytes | None]
    eos_ids: tuple[int, ...]
    size: int
    encode: Callable[[str], list[int]] | None = None
    kind: str = PLAIN
    fingerprint: str = ""
    _sorted: list[tuple[bytes, int]] = field(default_factory=list, repr=False)
    _keys: list[bytes] = field(default_factory=list, repr=False)
    _by_bytes: dict[bytes, list[int]] = field(default_factory=dict, repr=False)
    _sentinel_ids: frozenset[int] | None = field(default=None, repr=False)
    _sentinel_mask: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.token_bytes) < self.size:
            self.token_bytes = self.token_bytes + [None] * (self.size - len(self.token_bytes))
        for i in self.eos_ids:
            if 0 <= i < len(self.token_bytes):
                self.token_bytes[i] = None
        pairs = [(b, i) for i, b in enumerate(self.token_bytes) if b is not None]
        for b, i in pairs:
            self._by_bytes.setdefault(b, []).append(i)
        pairs.sort()
        self._sorted = pairs
        self._keys = [b for b, _ in pairs]
        if not self.fingerprint:
            h = hashlib.sha1(repr((self.kind, self.eos_ids, self.size)).encode())
            h.update(repr(self.token_bytes).encode())
            self.fingerprint = h.hexdigest()

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, eos_ids: Iterable[int], vocab_size: int | None = None
    ) -> "TokenVocab":
        """Map a Hugging Face tokenizer's vocabulary; special tokens and ``eos_ids``
        get no bytes. ``vocab_size`` is the model's logits width (default: the
        tokenizer's)."""
        kind = detect_kind(tokenizer)
        special = special_token_ids(tokenizer)
        vocab: dict[str, int] = tokenizer.get_vocab()
        n = max(max(vocab.values()) + 1, vocab_size or 0)
        token_bytes: list[bytes | None] = [None] * n
        for tok, i in vocab.items():
            if i in special:
                continue
            b = token_to_bytes(tok, kind)
            if b:
                token_bytes[i] = b

        def encode(text: str) -> list[int]:
            # forced text is literal: "<|im_end|>" inside a schema's const is written with
            # ordinary tokens, never as the special token (which no constraint allows)
            try:
                return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
            except TypeError:  # a tokenizer without the option
                return list(tokenizer.encode(text, add_special_tokens=False))

        return cls(token_bytes, tuple(sorted(set(eos_ids))), vocab_size or n, encode=encode, kind=kind)

    # -- look-ups ---------------------------------------------------------------------
    @property
    def outlines_eos_id(self) -> int:
        """The single EOS id outlines-core's ``Vocabulary`` holds; others are added by
        the matcher. Past the vocabulary when the model has no EOS at all."""
        return self.eos_ids[0] if self.eos_ids else self.size

    @property
    def mask_words(self) -> int:
        """Width of a packed mask row (``int32`` words): every logits column and the
        outlines EOS id fit. Every backend's rows have this width."""
        return (max(self.size, self.outlines_eos_id + 1) + 31) // 32

    def outlines_map(self) -> dict[bytes, list[int]]:
        """``{bytes: [ids]}`` for ``outlines_core.Vocabulary``."""
        return {b: list(ids) for b, ids in self._by_bytes.items()}

    @property
    def sentinel_byte_mask(self) -> np.ndarray:
        """Packed row (``int32 [mask_words]``) of the tokens holding the first byte of
        the outlines end sentinel (0xF4; ``worker.py``): never offered under it."""
        if self._sentinel_mask is None:
            bits = np.zeros(self.mask_words * 32, dtype=np.bool_)
            bits[sorted(self._sentinel_token_ids())] = True
            self._sentinel_mask = np.packbits(bits, bitorder="little").view(np.int32)
            self._sentinel_mask.setflags(write=False)
        return self._sentinel_mask

    def holds_sentinel_byte(self, token: int) -> bool:
        return token in self._sentinel_token_ids()

    def _sentinel_token_ids(self) -> frozenset[int]:
        if self._sentinel_ids is None:
            self._sentinel_ids = frozenset(
                i for i, b in enumerate(self.token_bytes) if b is not None and SENTINEL_FIRST_BYTE in b
            )
        return self._sentinel_ids

    def ids_of(self, b: bytes) -> list[int]:
        return self._by_bytes.get(b, [])

    def byte_token(self, byte: int) -> int | None:
        """A token that writes exactly this one byte, if the vocabulary has one."""
        ids = self._by_bytes.get(bytes([byte]))
        return ids[0] if ids else None

    def tokens_with_prefix(self, prefix: bytes) -> list[int]:
        """Ids of tokens whose bytes start with ``prefix`` and are longer than it."""
        lo = bisect.bisect_right(self._keys, prefix)
        out = []
        for k in range(lo, len(self._keys)):
            b = self._keys[k]
            if not b.startswith(prefix):
                break
            out.append(self._sorted[k][1])
        return out

    def join(self, ids: Sequence[int]) -> bytes | None:
        """Bytes of a token sequence; None if one of them has no bytes."""
        out = bytearray()
        for i in ids:
            b = self.token_bytes[i] if 0 <= i < len(self.token_bytes) else None
            if b is None:
                return None
            out += b
        return bytes(out)
