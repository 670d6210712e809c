"""Regex building blocks shared by the runtime, the language and the HTTP front.

Every regex here is written in the dialect both outlines-core (Rust ``regex``) and
interegular read: no look-around, no back-references, no ``\\p{..}``. Torch-free.
Patterns from users are checked by :func:`plait.regex.check_regex` (re-exported here).
"""

from __future__ import annotations

from plait.regex import ascii_classes, check_regex  # noqa: F401  (runtime/sampling_params.py imports them from here)

# Characters with a meaning in a regex outside a class. Only these are escaped:
# Rust's regex treats some escaped punctuation as assertions (``\\<``, ``\\>``).
_META = set("\\.+*?()|[]{}^$")

# JSON numbers have at most 16 integer and 16 fraction digits (more is past float
# precision anyway): a model cannot loop on digits.
MAX_DIGITS = 16
INTEGER = r"-?(?:0|[1-9][0-9]{0,15})"
NUMBER = r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,16})?(?:[eE][+-]?[0-9]{1,3})?"
BOOLEAN = r"(?:true|false)"
NULL = r"null"
# One character of a JSON string: anything but a quote, a backslash or a control
# character, or a short escape. (\\uXXXX escapes are left out: a lone surrogate
# half would make the output invalid.)
JSON_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])'
JSON_STRING = rf'"{JSON_CHAR}*"'


def escape(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\" + c if c in _META else c for c in text)
