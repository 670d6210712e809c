"""A faster ``gguf.GGUFReader``: the same fields and tensors, read in seconds less.

``gguf.GGUFReader`` (gguf-py 0.19) reads every element of a metadata array on its own,
each a slice of a ``numpy.memmap`` (whose Python-level ``__getitem__`` and
``__array_finalize__`` run per slice): the 262,144-entry vocabulary of Gemma 3 270M
(token strings, scores, token types) took ~24 s to open on a 2-core Zen 3, SmolLM2's
49,152 entries ~4 s, and a GGUF model is opened twice on load (plait's config and
weights, transformers' tokenizer conversion). :class:`FastGGUFReader` reads the same
file into the same :class:`gguf.ReaderField` structure (one part per element, as
``ReaderField.contents`` and transformers' GGUF loader index them), slicing a plain
array over the same mapping and reading an array of scalars with one view: 1-2 s for
Gemma's vocabulary. Files in the host's byte order only; any other file, and nested
arrays, take the base class's code. :func:`fast_gguf` lends the class to code that
imports ``gguf.GGUFReader`` at call time (transformers' ``load_gguf_checkpoint``).
"""

from __future__ import annotations

import contextlib
import struct
import sys
import threading
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

_U64 = struct.Struct("<Q")
_LEND_LOCK = threading.Lock()


class FastGGUFReader(gguf.GGUFReader):
    """:class:`gguf.GGUFReader` with faster metadata reads (module docstring)."""

    _plain: np.ndarray | None = None

    def _native(self, override_order: str | None = None) -> bool:
        # (a little-endian host reading a file in its own order: '<' and 'I' read alike)
        return sys.byteorder == "little" and self.byte_order == "I" and override_order in (None, "<", "I")

    def _flat(self) -> np.ndarray:
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)  # same bytes, no memmap subclass per slice
        return self._plain

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if not self._native(override_order):
            return super()._get(offset, dtype, count, override_order)
        dt = np.dtype(dtype)
        count = int(count)
        return self._flat()[offset:offset + dt.itemsize * count].view(dt)[:count]

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or not self._native():
            return super()._get_field_parts(orig_offs, raw_type)
        flat = self._flat()
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs = orig_offs + 12
        n = int(alen[0])
        itype = int(raw_itype[0])
        parts: list[np.ndarray] = [raw_itype, alen]
        types: list[Any] = [GGUFValueType.ARRAY]
        if n == 0:
            return offs - orig_offs, parts, [], types
        nptype = self.gguf_scalar_to_np.get(GGUFValueType(itype))
        if nptype is not None:
            size = np.dtype(nptype).itemsize
            values = flat[offs:offs + size * n].view(nptype)
            if len(values) < n:
                raise ValueError(f"GGUF array at offset {orig_offs} runs past the end of the file")
            parts += [values[i:i + 1] for i in range(n)]
            return offs + size * n - orig_offs, parts, list(range(2, 2 + n)), types + [GGUFValueType(itype)]
        if itype != GGUFValueType.STRING:  # arrays of arrays: the base class's code
            return super()._get_field_parts(orig_offs, raw_type)
        buf = memoryview(flat)
        end = len(flat)
        idxs = []
        for _ in range(n):
            if offs + 8 > end:
                raise ValueError(f"GGUF string array at offset {orig_offs} runs past the end of the file")
            (slen,) = _U64.unpack_from(buf, offs)
            if offs + 8 + slen > end:
                raise ValueError(f"GGUF string array at offset {orig_offs} runs past the end of the file")
            parts.append(flat[offs:offs + 8].view(np.uint64))
            idxs.append(len(parts))
            parts.append(flat[offs + 8:offs + 8 + slen])
            offs += 8 + slen
        return offs - orig_offs, parts, idxs, types + [GGUFValueType.STRING]


@contextlib.contextmanager
def fast_gguf() -> Iterator[None]:
    """``gguf.GGUFReader`` is :class:`FastGGUFReader` inside the block (for code that
    imports it at call time: transformers' GGUF config, tokenizer and weight loading).
    One block at a time; the reader reads the same structure, so another thread that
    opens a file meanwhile only opens it faster."""
    with _LEND_LOCK:
        saved = gguf.GGUFReader
        gguf.GGUFReader = FastGGUFReader  # type: ignore[misc]
        try:
            yield
        finally:
            gguf.GGUFReader = saved  # type: ignore[misc]
