"""Exception taxonomy: user errors (the caller must change the request) vs system errors.

Raised where the problem is found; the HTTP edge (`gateway/errors.py`) maps each class to one
OpenAI-shaped answer, and the worker turns `UserError` into a failed job, `EngineError` into a
retry. Nothing else decides what an error means.
"""

from __future__ import annotations


class TokenyardError(Exception):
    """Base of every error tokenyard raises on purpose."""

    retryable: bool = False


class UserError(TokenyardError):
    """The request is wrong; retrying it unchanged will fail again."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class InvalidRequest(UserError):
    """A request no engine of its model can serve as given (HTTP 400)."""


class NotFound(UserError):
    """A job, model or file that does not exist (HTTP 404)."""


class QueueFull(TokenyardError):
    """The lane is at its bound; the caller should back off and retry."""

    retryable = True

    def __init__(self, lane: str, depth: int, limit: int) -> None:
        super().__init__(f"lane {lane} is full ({depth} >= {limit} jobs)")
        self.lane = lane
        self.depth = depth
        self.limit = limit


class SystemError_(TokenyardError):
    """Something on our side failed; the job may be retried."""

    retryable = True


class BrokerUnavailable(SystemError_):
    pass


class EngineError(SystemError_):
    """The engine failed a sequence it had accepted; the job is retried, then dead-lettered."""


class FatalError(TokenyardError):
    """Misconfiguration or a broken invariant; the process should stop."""
