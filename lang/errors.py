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


class RequestError(PlaitError, ValueError):
    """A request is invalid. Raised where the problem is found (validation of sampling
    parameters, prompts, constraints, pins) and turned into an HTTP error body, a ZMQ
    :class:`~plait.protocol.ErrorResponse` or a :class:`BackendError` in one place
    (:func:`plait.protocol.error_response` / :meth:`from_response`).

    ``param`` names the request field at fault (``None`` when the request as a whole
    is at fault); ``status`` follows HTTP (400 invalid, 404 unknown, 413 too large);
    ``code`` is OpenAI's error ``code`` where it has a name (``model_not_found``),
    else the status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        # the field named as the client sent it may hold a lone surrogate (an unknown key
        # "\ud800"): written as its escape, the error can be sent (UTF-8 refused it: a 500)
        message, param = _sendable(message), _sendable(param) if isinstance(param, str) else param
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code

    def with_param(self, param: str | None, message: str | None = None) -> "RequestError":
        """The same error under another field name (an API that renames fields)."""
        return RequestError(self.message if message is None else message, param, self.status, self.error_type,
                            self.code)

    def to_backend_error(self) -> BackendError:
        """The error a language program sees (a 503, the runtime being gone, is a
        :class:`RuntimeUnavailableError`)."""
        if self.status == 503:
            return RuntimeUnavailableError(self.message)
        return BackendError(self.message, code=self.status, param=self.param, error_type=self.error_type)

    def __reduce__(self) -> tuple:
        return (RequestError, (self.message, self.param, self.status, self.error_type, self.code))


def _sendable(text: str) -> str:
    """``text`` with each lone surrogate (which UTF-8 cannot encode) as its ``\\udXXX`` escape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def is_int(v: object) -> bool:
    """An integer that is not a bool (JSON's true/false arrive as Python bools)."""
    return isinstance(v, int) and not isinstance(v, bool)


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
