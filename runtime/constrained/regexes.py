"""Regex building blocks shared by the runtime, the language and the HTTP front.

Every regex here is written in the dialect both outlines-core (Rust ``regex``) and
interegular read: no look-around, no back-references, no ``\\p{..}``. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

# Characters with a meaning in a regex outside a class. Only these are escaped:
# Rust's regex treats some escaped punctuation as assertions (``\\<``, ``\\>``).
_META = set("\\.+*?()|[]{}^$")

MAX_PATTERN_CHARS = 100_000

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


def choices_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices`` (``gen(choices=...)``)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"choices={choices!r} is invalid; allowed: a non-empty list of strings")
    return "(?:" + "|".join(escape(c) for c in choices) + ")"


def check_regex(pattern: object, name: str = "regex") -> str:
    """Raise ``ValueError`` naming ``name`` if ``pattern`` is not a usable regex.

    A syntax check with interegular's parser (pure Python, linear time). Constructs it
    cannot read (``\\p{..}`` classes) pass here and are judged when the index is built.
    """
    import interegular
    from interegular.patterns import InvalidSyntax, Unsupported

    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{name}={pattern!r} is invalid; allowed: a non-empty regular expression string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{name} is invalid: {len(pattern)} characters; allowed: at most {MAX_PATTERN_CHARS}")
    try:
        interegular.parse_pattern(pattern)
    except InvalidSyntax as e:
        raise ValueError(f"{name}={_short(pattern)} is not a valid regular expression: {str(e) or 'syntax error'}") from None
    except Unsupported:
        pass
    except Exception as e:  # interegular raises assorted errors on odd input
        raise ValueError(f"{name}={_short(pattern)} is not a valid regular expression: {type(e).__name__}: {e}") from None
    return pattern


def _short(s: str, n: int = 80) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")
