"""Exception taxonomy: user errors (the caller must change the request) vs system errors."""

from __future__ import annotations


class TokenyardError(Exception):
    """Base of every error tokenyard raises on purpose."""

    retryable: bool = False


class UserError(TokenyardError):
    """The request is wrong; retrying it unchanged will fail again."""


class InvalidRequest(UserError):
    pass


class NotFound(UserError):
    pass


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
    pass


class FatalError(TokenyardError):
    """Misconfiguration or a broken invariant; the process should stop."""
