"""What the command line prints when a command fails: one line saying what went wrong, never
a traceback (`--debug` or TOKENYARD_DEBUG=1 asks for it)."""

from __future__ import annotations

import httpx

from tokenyard.errors import FAILURE_PREFIX, TokenyardError

__all__ = ["DEBUG_ENV", "FAILURE_PREFIX", "failure_line"]

DEBUG_ENV = "TOKENYARD_DEBUG"
_HINT = "(--debug shows the traceback)"


def failure_line(exc: BaseException) -> str:
    """One line for `exc`: tokenyard's own errors say what to do already; a connection that
    failed names where it went; anything else is its type and message."""
    text = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever it held
    if isinstance(exc, TokenyardError):
        return text
    if isinstance(exc, httpx.TransportError):
        return f"cannot reach {_url(exc)}: {text} {_HINT}"
    if isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        return failure_line(exc.exceptions[0])
    return f"{type(exc).__name__}: {text} {_HINT}"


def _url(exc: httpx.TransportError) -> str:
    try:
        request = exc.request
    except RuntimeError:  # raised before a request was made
        return "the server"
    return f"{request.url.scheme}://{request.url.netloc.decode()}"
