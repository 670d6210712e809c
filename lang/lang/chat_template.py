"""``sglang.lang.chat_template``: plait's ``plait.chat_template`` (the same module object)."""

import sys

from plait import chat_template as _module

sys.modules[__name__] = _module
