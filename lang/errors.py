"""Errors a plait program can raise, each naming what went wrong and what to do."""

from __future__ import annotations


class PlaitError(Exception):
    """Base of plait's own errors."""


class BackendError(PlaitError, RuntimeError):
    """The backend refused or failed a request. ``code`` follows HTTP (400: the
    request was invalid and ``param`` names the field; 503: the runtime is gone)."""

    def __init__(self, message: str, *, code: int = 500, param: str | None = None,
                 error_type: str = "server_error") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type


class RuntimeUnavailableError(BackendError):
    """The runtime cannot be reached, did not answer in time, or died."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=503, error_type="server_error")


class ProgramCancelled(PlaitError):
    """The program was aborted (``state.abort()``, a cancelled stream, or its body
    raised); its in-flight requests were aborted too."""


class ProgramError(PlaitError):
    """A variable cannot be read because the program failed before computing it.
    ``__cause__`` is the original error."""


class UnknownVariableError(PlaitError, KeyError):
    """``s[name]`` for a name that no ``gen``/``select``/``var_scope`` defines."""

    def __init__(self, name: str, known: list[str]) -> None:
        listed = ", ".join(map(repr, known)) if known else "none yet"
        super().__init__(f"unknown variable {name!r}; defined variables: {listed}")
        self.name = name

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])
