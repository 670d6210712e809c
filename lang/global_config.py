"""``plait.global_config``: SGLang's ``GlobalConfig``, the language's process-wide settings.

Only the fields that mean something to a language program exist; assigning any other
attribute raises ``AttributeError`` (SGLang's runtime constants, such as
``default_init_new_token_ratio``, are server options here: ``init_new_token_ratio``).
"""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    """``default_backend``: where programs run when ``run()`` gets no backend (written by
    :func:`plait.set_default_backend`). ``verbosity``: 2 or more prints a program's text
    when ``run()`` returns. ``enable_precache_with_tracing``: ``run_batch`` traces its
    instances and pins the prefixes they share (the default of its ``pin_prefixes``);
    False: it traces nothing, so each program body runs once.
    ``enable_parallel_encoding``: accepted for SGLang programs and has no effect: a
    ``concate_and_append`` join always appends the branches' text (plait does not splice
    KV caches). ``skip_special_tokens_in_output``: False keeps special tokens in the
    text of gens (their ``skip_special_tokens``), read when ``run()`` starts.
    ``spaces_between_special_tokens_in_out``: False is the gens' ``spaces_between_special_tokens``
    (read when ``run()`` starts; a fast HF tokenizer, what the runtime loads, decodes the
    same either way)."""

    __slots__ = ("default_backend", "verbosity", "enable_precache_with_tracing", "enable_parallel_encoding",
                 "skip_special_tokens_in_output", "spaces_between_special_tokens_in_out")

    def __init__(self) -> None:
        self.default_backend: Any = None
        self.verbosity = 0
        self.enable_precache_with_tracing = True
        self.enable_parallel_encoding = True
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"GlobalConfig({fields})"


global_config = GlobalConfig()
