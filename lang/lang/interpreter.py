"""``sglang.lang.interpreter``: plait's ``plait.interpreter`` (the same module object)."""

import sys

from plait import interpreter as _module

sys.modules[__name__] = _module
