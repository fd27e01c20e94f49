"""Engine interface: sequences in, per-step outputs out; the busy loop runs in its own thread."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

from tokenyard.messages import FinishReason, SamplingParams


class EngineCapacity(msgspec.Struct, frozen=True):
    """How much an engine runs at once: sequences, and tokens (prompt + generated) across them."""

    max_seqs: int
    max_tokens: int


class StepOutput(msgspec.Struct):
    """What one engine step produced for one sequence."""

    seq_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int  # generated so far, resumed tokens included
    error: str | None = None
    # with ERROR: the request itself is at fault (a remote upstream's 4xx, a value the runtime
    # refuses), so the job fails as InvalidRequest would, without a retry
    refused: bool = False


class EngineStats(msgspec.Struct):
    """Counters since start; mean_batch is the average number of sequences per step."""

    steps: int = 0
    sequences_stepped: int = 0
    tokens_generated: int = 0
    running: int = 0

    @property
    def mean_batch(self) -> float:
        return self.sequences_stepped / self.steps if self.steps else 0.0


class EngineTokenizer(Protocol):
    """The tokenizer surface the rest of tokenyard relies on."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def max_model_len(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str: ...


class EngineClosed(RuntimeError):
    """Raised by `outputs()` once the engine has stopped and every output was delivered."""


class Engine(abc.ABC):
    """A model runtime that steps many sequences together in its own thread."""

    name: str
    capacity: EngineCapacity
    tokenizer: EngineTokenizer

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and start the busy loop in its own thread."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop the loop; sequences still running finish with ERROR ("engine stopped")."""

    @abc.abstractmethod
    def add(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a sequence (thread-safe); resume_token_ids continue an earlier attempt."""

    @abc.abstractmethod
    def abort(self, seq_id: str) -> None:
        """Finish a sequence with CANCELLED and free its slot (thread-safe; unknown ids ignored)."""

    @abc.abstractmethod
    async def outputs(self) -> list[StepOutput]:
        """Wait for the outputs of the next step(s), in order; raises EngineClosed after stop().

        When several steps finished since the last call, their outputs come back together and
        one sequence may appear more than once.
        """

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the step counters."""


class OutputChannel:
    """Carries step outputs from engine threads to the asyncio loop the engine was started on.

    Outputs published before `bind` (e.g. a sequence added before start that is already
    complete) are kept and delivered once the loop is known.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[list[StepOutput] | None] = asyncio.Queue()
        self._early: list[list[StepOutput]] = []
        self._closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._loop = loop
            early, self._early = self._early, []
            for item in early:
                self._put_locked(item)

    def publish(self, outputs: list[StepOutput]) -> None:
        """Deliver one step's outputs; callable from any thread."""
        with self._lock:
            if not outputs or self._closed:
                return
            if self._loop is None:
                self._early.append(outputs)
            else:
                self._put_locked(outputs)

    def close(self) -> None:
        """Wake every waiter with EngineClosed once queued outputs are consumed."""
        with self._lock:
            if not self._closed and self._loop is not None:
                self._put_locked(None)
            self._closed = True

    def _put_locked(self, item: list[StepOutput] | None) -> None:
        assert self._loop is not None
        # A loop that is already closed has nobody left to deliver to.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> list[StepOutput]:
        if self._loop is None:
            raise RuntimeError("engine not started")
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # keep the sentinel for other waiters
            raise EngineClosed("engine stopped")
        # Steps that queued up while the consumer was busy go out together, so a slow consumer
        # catches up in one round trip instead of one per step.
        while not self._queue.empty():
            more = self._queue.get_nowait()
            if more is None:
                self._queue.put_nowait(None)
                break
            item = item + more
        return item


def default_seed(seq_id: str) -> int:
    """Seed for sampled sequences without one: stable per seq_id, so a resumed attempt matches."""
    return int.from_bytes(hashlib.blake2b(seq_id.encode(), digest_size=4).digest(), "little")


def validate_request(
    seq_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int
) -> None:
    """Reject requests no engine step could serve (user errors, raised as ValueError)."""
    if not seq_id:
        raise ValueError("seq_id must be non-empty")
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens; the model context is {max_model_len}"
        )
    if params.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if params.temperature < 0 or not 0.0 < params.top_p <= 1.0 or params.top_k < 0:
        raise ValueError("invalid sampling parameters")


def size_request(
    seq_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    token_budget: int,
) -> tuple[int, int]:
    """Validate a request and size it: (tokens it may generate, tokens it reserves)."""
    validate_request(seq_id, prompt_token_ids, params, max_model_len)
    limit = min(params.max_tokens, max_model_len - len(prompt_token_ids))
    reserved = len(prompt_token_ids) + limit
    if reserved > token_budget:
        raise ValueError(f"sequence needs {reserved} tokens; engine budget is {token_budget}")
    return limit, reserved
