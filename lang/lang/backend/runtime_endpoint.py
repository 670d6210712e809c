"""``sglang.lang.backend.runtime_endpoint``: plait's ``plait.runtime_endpoint`` (the same module object)."""

import sys

from plait import runtime_endpoint as _module

sys.modules[__name__] = _module
