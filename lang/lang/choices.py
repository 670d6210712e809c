"""``sglang.lang.choices``: plait's ``plait.choices`` (the same module object)."""

import sys

from plait import choices as _module

sys.modules[__name__] = _module
