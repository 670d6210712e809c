"""How a text prompt becomes token ids, in one place (the front, ``Engine.generate``,
the language's in-process backend). Torch-free.

A text prompt is encoded as Hugging Face's default encoding does it (vLLM's and
SGLang's too): with the BOS token in front when the tokenizer puts one there (Gemma,
Llama 2/3), without one when it does not (SmolLM2, Qwen). One exception: a text that
already starts with the BOS token (a chat template that writes it) does not get a
second one. Chat messages rendered by the server's template are encoded as the
template wrote them (``bos=False``), as ``apply_chat_template`` tokenizes them.
"""

from __future__ import annotations

import weakref
from typing import Any

_LEADING_BOS: "weakref.WeakKeyDictionary[Any, int | None]" = weakref.WeakKeyDictionary()


def leading_bos(tokenizer: Any) -> int | None:
    """The BOS id ``tokenizer`` puts before a text by default, or None."""
    try:
        return _LEADING_BOS[tokenizer]
    except (KeyError, TypeError):
        pass
    bos = getattr(tokenizer, "bos_token_id", None)
    found = None
    if bos is not None:
        with_special = list(tokenizer.encode("a", add_special_tokens=True))
        plain = list(tokenizer.encode("a", add_special_tokens=False))
        if len(with_special) > len(plain) and with_special[0] == bos:
            found = int(bos)
    try:
        _LEADING_BOS[tokenizer] = found
    except TypeError:  # not weakly referenceable: asked again next time
        pass
    return found


def encode_prompt(tokenizer: Any, text: str, *, bos: bool = True) -> list[int]:
    """Token ids of the text prompt ``text`` (an empty text has none)."""
    if not text:
        return []
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    first = leading_bos(tokenizer) if bos else None
    if first is not None and (not ids or ids[0] != first):
        ids.insert(0, first)
    return ids
