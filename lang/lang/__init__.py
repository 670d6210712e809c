"""SGLang's ``sglang.lang`` module paths, for programs that import from them: a program
whose ``sglang`` became ``plait`` (``from plait.lang.api import set_default_backend``,
``from plait.lang.ir import REGEX_INT``) finds plait's own modules there (each name below
is the same module object as ``plait.<name>``)."""
