"""``sglang.lang.tracer``: plait's ``plait.tracer`` (the same module object)."""

import sys

from plait import tracer as _module

sys.modules[__name__] = _module
