"""What the command line prints when a command fails: one line saying what went wrong, never
a traceback (`--debug` or TOKENYARD_DEBUG=1 asks for it)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import httpx

from tokenyard.errors import FAILURE_FILE_ENV, FAILURE_PREFIX, TokenyardError
from tokenyard.logs import json_logging

__all__ = ["DEBUG_ENV", "FAILURE_PREFIX", "failure_line", "report_failure"]

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


def report_failure(exc: BaseException) -> None:
    """Say why the command failed: one line on stderr (a JSON line where the command logs
    JSON), and into TOKENYARD_FAILURE_FILE when its parent (`serve`) asked for it there."""
    line = failure_line(exc)
    path = os.environ.get(FAILURE_FILE_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    if json_logging():
        logging.getLogger("tokenyard").critical(line)
    else:
        print(FAILURE_PREFIX + line, file=sys.stderr)


def _url(exc: httpx.TransportError) -> str:
    try:
        request = exc.request
    except RuntimeError:  # raised before a request was made
        return "the server"
    return f"{request.url.scheme}://{request.url.netloc.decode()}"
