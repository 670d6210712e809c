"""``sglang.lang.api``: plait's ``plait.api`` (the same module object)."""

import sys

from plait import api as _module

sys.modules[__name__] = _module
