"""Constrained decoding: regex and JSON Schema constraints compiled (outlines-core)
to an index over the model's vocabulary, batched allowed-token masks, jump-forward
through a character automaton (interegular), and token-boundary healing.

Torch-free at import: ``regexes`` and ``json_schema`` can be used by the language and
the HTTP front to build and validate constraints without loading the runtime.

Pieces, in the order a request meets them:

- ``json_schema.schema_to_regex`` / ``regexes``: constraint -> regex (pure Python).
- ``vocab.TokenVocab``: token id -> raw bytes for the real tokenizer.
- ``compiler.GrammarCompiler``: builds and caches indexes in a worker process, under
  time and memory limits, without blocking the engine loop.
- ``matcher.GrammarMatcher``: one request's state (mask, advance, final, healing,
  jump-forward).
- ``mask.apply_grammar_masks``: the batched mask on the sampling logits.
"""
