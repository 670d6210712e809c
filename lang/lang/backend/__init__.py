"""``sglang.lang.backend``: ``runtime_endpoint`` (``RuntimeEndpoint``, ``Runtime``) and
``base_backend`` (``BaseBackend``) as plait's ``plait.runtime_endpoint`` and ``plait.backend``."""
