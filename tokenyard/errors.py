"""Exception taxonomy: every error tokenyard raises on purpose, by who has to act on it.

- `UserError` (`InvalidRequest`, `NotFound`): the request is wrong. The HTTP edge
  (`gateway/errors.py`) answers 400 / 404; the worker fails the job without a retry.
- `QueueFull`: a lane is at its bound; the gateway answers 429, the caller backs off.
- `BrokerUnavailable`: the broker cannot be reached; the gateway answers 503.
- `EngineError` (`UpstreamError`): an engine could not take or run a sequence; the worker
  retries the job, which is dead-lettered once its deliveries run out.
- `FatalError`: misconfiguration or a broken invariant; the process stops.
- `EngineClosed` is no failure: it ends an engine's outputs once the engine has stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenyard.broker.core import EnqueueResult

# how a command's one-line failure on stderr starts (cli/app.py `main`; a JSON line instead
# where the command logs JSON)
FAILURE_PREFIX = "tokenyard: "
# where a command also writes its failure's one line, when set: `serve` reads its workers'
# reasons there (their stderr is serve's own, never read by it)
FAILURE_FILE_ENV = "TOKENYARD_FAILURE_FILE"


class TokenyardError(Exception):
    """Base of every error tokenyard raises on purpose."""


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
    """The lane is at its bound; the caller should back off and retry.

    Raised by an enqueue of several models' jobs, `admitted` holds the batch's results where
    they stand (the models whose lanes took them) and None for the refused models' jobs, none
    of which was added (`core.Producer.enqueue_many`)."""

    def __init__(self, lane: str, depth: int, limit: int) -> None:
        super().__init__(f"lane {lane} is full ({depth} >= {limit} jobs)")
        self.limit = limit
        self.admitted: list[EnqueueResult | None] = []


class BrokerUnavailable(TokenyardError):
    """The broker did not answer (connection refused, reset or timed out)."""


class EngineError(TokenyardError):
    """An engine could not take a sequence (stopped, died, no room, a seq_id it holds) or failed
    one it had taken; the job is retried, then dead-lettered."""


class UpstreamError(EngineError):
    """The remote engine's upstream refused or broke a request; `retry` says whether trying
    again may help, `refused` that the upstream found the request itself wrong (a 4xx)."""

    def __init__(self, message: str, *, retry: bool, refused: bool = False) -> None:
        super().__init__(message)
        self.retry = retry
        self.refused = refused


class EngineClosed(TokenyardError):
    """Raised by `Engine.outputs()` once the engine has stopped and every output was delivered."""


class FatalError(TokenyardError):
    """Misconfiguration or a broken invariant; the process should stop."""
