"""``sglang.lang.ir``: plait's ``plait.ir`` (the same module object)."""

import sys

from plait import ir as _module

sys.modules[__name__] = _module
