"""``sglang.lang.backend.base_backend``: plait's ``plait.backend`` (the same module object)."""

import sys

from plait import backend as _module

sys.modules[__name__] = _module
