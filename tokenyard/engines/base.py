"""Engine interface: sequences in, per-step outputs out; the busy loop runs in its own thread.

Engines are steppers: the worker's scheduler alone decides what runs, and calls `add` only for
sequences that fit `capacity`; an added sequence runs from the next step. Plumbing the engines
share (request checks, sequence state, capacity accounting, outputs and stats) lives here.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from tokenyard import limits
from tokenyard.engines.detok import Delta, SequenceDecoder
from tokenyard.errors import EngineClosed, EngineError
from tokenyard.messages import (
    EngineStats,
    Feature,
    FinishReason,
    ModelLimits,
    PoolingOptions,
    Priority,
    PromptLogprob,
    SamplingParams,
    TokenLogprob,
)


class EngineRequest(msgspec.Struct, frozen=True, array_like=True):
    """One sequence to start: `resume_token_ids` continue an earlier attempt, and `priority`
    (lower first) orders the sequences an engine with its own queue holds."""

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    resume_token_ids: Sequence[int] = ()
    priority: int = Priority.NORMAL
    # an embeddings request: `prompt_token_ids` are its inputs one after another, of these
    # lengths (engines that do not embed refuse it: see `limits.embedding_refusal`)
    input_lengths: Sequence[int] | None = None
    # an embeddings or scoring request's options (see `limits.embedding_refusal`)
    pooling: PoolingOptions | None = None
    # a LoRA adapter to run the model with (None: the base), and where to load it from when
    # the engine was not given it (`--lora`); engines without adapters refuse it
    adapter: str | None = None
    adapter_path: str = ""
    # its first step runs alone: without the sequences already running, which wait out that one
    # step (the worker's scheduler asks it for a job that outranks every running one, so its
    # first token does not wait on a full batch's step: `Plan.alone`). Engines that step a batch
    # of their own (sim, hf) honour it; those whose runtime schedules (vllm, remote: priority
    # orders their queue) and hf-static (a batch runs to its end) ignore it
    alone: bool = False


class EngineCapacity(msgspec.Struct, frozen=True):
    """How much an engine runs at once: sequences, and tokens (prompt + max_tokens) across them."""

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
    # an embeddings request's vectors, one per input (float32, little-endian), with STOP
    embeddings: list[bytes] | None = None
    # one per token id, when the request's params ask for logprobs
    logprobs: list[TokenLogprob] | None = None
    # prompt tokens the engine's prefix cache held, once it knows (None: it does not say)
    cached_tokens: int | None = None
    # the prompt's (after its first token), once per sequence, when its params ask
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass(frozen=True, kw_only=True)
class ChatRender:
    """A conversation and the switches to render it with (`apply_chat_template`'s arguments);
    `tools` None when there are none, `variables` the template's own."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    variables: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None


class EngineTokenizer(Protocol):
    """The tokenizer surface the rest of tokenyard relies on."""

    @property
    def eos_token_id(self) -> int | None: ...

    max_model_len: int
    vocab_size: int  # token ids the model embeds: every id must be below it

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """A prompt's ids; `add_special_tokens` None: the model's usual (BOS unless the text
        starts with it), True or False: vLLM's switch."""
        ...

    def decode(
        self,
        ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Text of token ids, with vLLM's detokenization switches."""
        # one signature for every tokenizer: each writes `text_of`
        return self.text_of(list(ids), skip_special_tokens, spaces_between_special_tokens)

    def text_of(self, ids: list[int], skip_special: bool, spaces_between_special: bool) -> str:
        """`decode`'s text (what each tokenizer writes)."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's own text, as logprobs name it (vLLM's decoded token): special tokens
        included, a partial UTF-8 character as U+FFFD."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> str:
        """The prompt of a conversation; `tools` (OpenAI's shape) are offered to the model as
        its template shows them. Messages may carry `tool_calls` (arguments as dicts) and
        `tool_call_id`, as transformers' templates take them. `variables` are the
        template's own (`enable_thinking`, `reasoning_effort`: vLLM's
        `chat_template_kwargs`); the switches are vLLM's: the assistant's turn opened, the last
        message left open, another template (jinja)."""
        # one signature for every tokenizer: they render a `ChatRender`, which holds it whole
        return self.render_chat(
            ChatRender(
                messages=messages,
                tools=tools or None,
                variables=dict(variables or {}),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
            )
        )

    def render_chat(self, chat: ChatRender) -> str:
        """The prompt of `apply_chat_template`'s conversation (what each tokenizer writes)."""
        ...

    @property
    def chat_template(self) -> str:
        """The chat template's text ("" when it has none): it shows how the model writes
        tool calls (the gateway's `tool_call_parser` `auto`)."""
        ...


class Engine(abc.ABC):
    """A model runtime that steps many sequences together in its own thread.

    `capacity` is final once `start()` returned (on CUDA it is measured from free memory after
    the weights load); before that it is the engine's estimate.
    """

    name: str
    capacity: EngineCapacity
    tokenizer: EngineTokenizer
    # the optional decoding features it implements: a request needing another is refused at
    # admission, naming the parameter and this engine (never accepted and ignored)
    features: frozenset[Feature] = frozenset()
    # runs LoRA adapters (`EngineRequest.adapter`); the worker refuses an adapter's job on an
    # engine that does not, by name, rather than run the base in its place
    runs_adapters: bool = False

    @property
    def revision(self) -> str:
        """What identifies the weights (and numerics) it serves; part of the response cache's
        key, published in `limits()`. Engines that know their weights say more."""
        return self.name

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and start the busy loop in its own thread."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop the loop; sequences still running finish with ERROR ("engine stopped")."""

    @abc.abstractmethod
    def add(self, request: EngineRequest) -> None:
        """Start a sequence from the next step (thread-safe).

        Raises `InvalidRequest` when the request breaks the model's limits (`limits()`), and
        `EngineError` when it does not fit the free capacity, repeats a running seq_id, or the
        engine is stopped: those are the caller's bugs.
        """

    async def ready_for(
        self, params: SamplingParams, adapter: str | None = None, adapter_path: str = ""
    ) -> None:
        """Do off the caller's loop what `add` would otherwise do on it for these params and
        this LoRA adapter (compiling a structured output, loading the adapter): the worker
        awaits it for a claimed job with a guide or an adapter before the job may start. Never
        raises: `add` raises what it found (the compiled result is remembered; a failed load
        is tried again there). The default does nothing."""
        return None

    def cap_prefill(self, tokens: int | None) -> None:
        """From the next step on, prefill at most `tokens` prompt tokens a step of the sequences
        not `alone` (None: the engine's own budget): the worker's scheduler sets it while work
        that may preempt could arrive (`Scheduler.step_prefill_cap`), so that work waits for a
        short step rather than a long prompt's whole prefill. Thread-safe. Engines that cannot
        split a prefill, or whose runtime schedules, ignore it (the default)."""
        return None

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

    def counters(self) -> EngineStats:
        """The step counters (steps, sequences stepped, tokens), as cheaply as the engine can
        give them: the worker folds them into its metrics after every delivery. Gauges that
        take work to read (KV use, running) may be stale or absent; `stats` has them."""
        return self.stats()

    def limits(self) -> ModelLimits:
        """What one request may ask of this engine; workers publish it in their heartbeat."""
        return ModelLimits(
            max_model_len=self.tokenizer.max_model_len,
            max_seqs=self.capacity.max_seqs,
            token_budget=self.capacity.max_tokens,
            vocab_size=self.tokenizer.vocab_size,
            revision=self.revision,
            engine=self.name,
            features=self.features,
            adapters=self.runs_adapters,
        )


def weights_fingerprint(path: str | os.PathLike[str]) -> str:
    """A short digest of a local model directory's files (name, size, mtime): it changes when
    the weights are replaced, without reading them."""
    digest = hashlib.blake2s(digest_size=8)
    root = os.fspath(path)
    if not os.path.isdir(root):
        digest.update(root.encode())
        return digest.hexdigest()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            stat = os.stat(full)
            rel = os.path.relpath(full, root)
            digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class OutputChannel:
    """Carries step outputs from engine threads to the asyncio loop the engine was started on.

    Outputs delivered before `bind` (e.g. a sequence added before start that is already
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

    def deliver(self, outputs: list[StepOutput]) -> None:
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


def footprint(prompt_tokens: int, params: SamplingParams) -> int:
    """Tokens a sequence reserves against `EngineCapacity.max_tokens`: prompt + max_tokens."""
    return prompt_tokens + params.max_tokens


@dataclass(eq=False)
class EngineSeq:
    """One sequence inside an engine: its request, decoder and noise seed (None: greedy)."""

    seq_id: str
    prompt_tokens: int
    input_ids: list[int]  # prompt + resumed tokens
    params: SamplingParams
    decoder: SequenceDecoder
    noise_seed: int | None
    cached_tokens: int | None = None  # of its prompt, in the engine's prefix cache (if known)
    alone: bool = False  # its first step runs without the others (`EngineRequest.alone`)

    @property
    def reserved(self) -> int:
        return footprint(self.prompt_tokens, self.params)

    def output(self, delta: Delta, error: str | None = None) -> StepOutput:
        return StepOutput(
            seq_id=self.seq_id,
            token_ids=delta.token_ids,
            text=delta.text,
            finish_reason=delta.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.decoder.completion_tokens,
            error=error,
            cached_tokens=self.cached_tokens,
        )

    def finish(self, reason: FinishReason, error: str | None = None) -> StepOutput:
        return self.output(Delta([], "", reason), error)


S = TypeVar("S", bound=EngineSeq)


def open_seq(
    kind: type[S],
    request: EngineRequest,
    *,
    decode: Callable[[Sequence[int]], str],
    eos_token_ids: Collection[int],
    model_limits: ModelLimits,
    **extra: Any,
) -> S:
    """Check a request against the model's limits (`InvalidRequest`) and build its sequence."""
    seq_id, prompt, params = request.seq_id, request.prompt_token_ids, request.params
    if not seq_id:
        raise EngineError("seq_id must be non-empty")
    limits.check(limits.refusal(len(prompt), params, model_limits))
    decoder = SequenceDecoder(
        decode,
        params,
        prompt_ids=prompt,
        eos_token_ids=eos_token_ids,
        resume_ids=request.resume_token_ids,
    )
    noise_seed = None
    if not params.greedy:
        noise_seed = params.seed if params.seed is not None else default_seed(seq_id)
    return kind(
        seq_id=seq_id,
        prompt_tokens=len(prompt),
        input_ids=[*prompt, *request.resume_token_ids],
        params=params,
        decoder=decoder,
        noise_seed=noise_seed,
        alone=request.alone,
        **extra,
    )


class Ledger:
    """The sequences an engine holds and the tokens they reserve, bounded by its capacity."""

    def __init__(self) -> None:
        self.reserved = 0
        self._held: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._held

    def take(self, seq_id: str, tokens: int, capacity: EngineCapacity) -> None:
        """Hold a slot and `tokens`; EngineError when the seq_id is held or they do not fit."""
        if seq_id in self._held:
            raise EngineError(f"sequence {seq_id!r} is already in the engine")
        if len(self._held) >= capacity.max_seqs:
            raise EngineError(f"engine is full: {len(self._held)} of {capacity.max_seqs} sequences")
        if self.reserved + tokens > capacity.max_tokens:
            raise EngineError(
                f"sequence needs {tokens} tokens; {capacity.max_tokens - self.reserved} of "
                f"{capacity.max_tokens} are free"
            )
        self._held[seq_id] = tokens
        self.reserved += tokens

    def give_back(self, seq_id: str) -> bool:
        """Free a sequence's slot and tokens; False when it held none."""
        tokens = self._held.pop(seq_id, None)
        if tokens is None:
            return False
        self.reserved -= tokens
        return True

    def clear(self) -> None:
        self._held.clear()
        self.reserved = 0


class ChannelEngine(Engine):
    """What every engine here keeps: an output channel, step counters and a capacity ledger."""

    def __init__(self, capacity: EngineCapacity) -> None:
        self.capacity = capacity
        self._lock = threading.RLock()
        self._channel = OutputChannel()
        self._stats = EngineStats()
        self._ledger = Ledger()

    async def outputs(self) -> list[StepOutput]:
        return await self._channel.get()

    def stats(self) -> EngineStats:
        with self._lock:
            return msgspec.structs.replace(
                self._stats, running=len(self._ledger), reserved_tokens=self._ledger.reserved
            )

    def counters(self) -> EngineStats:
        # Without the lock: the engine's thread holds it through a whole step's outputs, and a
        # worker waiting on it after every delivery then waits for the GIL as well. The copy is
        # one C call under the GIL; a step's counters half updated by then (steps before
        # sequences stepped) come in with the next delivery, so the sums stay exact.
        return msgspec.structs.replace(self._stats)


class ThreadedEngine(ChannelEngine):
    """An engine whose passes run on a thread of its own (`_loop`): it sleeps on `_cond` while
    there is nothing to do and ends once `_closed` is set; `stop` wakes and joins it."""

    def __init__(self, capacity: EngineCapacity) -> None:
        super().__init__(capacity)
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None

    def _start_thread(self, name: str) -> None:
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        raise NotImplementedError  # an engine that starts its thread runs its passes here

    def _wait_locked(self, pending: Sized) -> bool:
        """Under `_cond`: sleep while `pending` (the work not yet stepped) is empty; False once
        the engine has stopped, when the loop ends."""
        while not self._closed and not pending:
            self._cond.wait()
        return not self._closed

    async def stop(self) -> None:
        with self._cond:
            if self._closed:
                return
            left = self._close_locked()
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._deliver(left)
        self._channel.close()

    def _close_locked(self) -> list[StepOutput]:
        """Mark the engine stopped; the "engine stopped" outputs of what still ran (an engine
        that holds work adds its own)."""
        self._closed = True
        self._ledger.clear()
        return []

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """Every output of this engine passes here, in order (a hook for instrumentation)."""
        self._channel.deliver(outputs)


class LocalEngine(ThreadedEngine, Generic[S]):
    """An engine in this process that holds its sequences by id (`_seqs`)."""

    def __init__(self, capacity: EngineCapacity) -> None:
        super().__init__(capacity)
        self._seqs: dict[str, S] = {}

    def abort(self, seq_id: str) -> None:
        with self._cond:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return
            self._abort_locked(seq)
            self._deliver([seq.finish(FinishReason.CANCELLED)])

    def _abort_locked(self, seq: S) -> None:
        """Let an aborted sequence go: its slot and tokens are free once this returns."""
        self._release_locked(seq)

    def _hold_locked(self, seq: S) -> bool:
        """Take a new sequence in; False when its resumed tokens already finished it."""
        if self._closed:
            raise EngineError("engine is stopped")
        if seq.decoder.finish_reason is not None:
            if seq.seq_id in self._seqs:
                raise EngineError(f"sequence {seq.seq_id!r} is already in the engine")
            self._deliver([seq.finish(seq.decoder.finish_reason)])
            return False
        self._ledger.take(seq.seq_id, seq.reserved, self.capacity)
        self._seqs[seq.seq_id] = seq
        self._stats.prefill_tokens += len(seq.input_ids)
        return True

    def _release_locked(self, seq: S) -> bool:
        """Forget a sequence (it finished or was aborted); False when it was not held."""
        if self._seqs.get(seq.seq_id) is not seq:
            return False
        del self._seqs[seq.seq_id]
        self._ledger.give_back(seq.seq_id)
        return True

    def _close_locked(self) -> list[StepOutput]:
        left = [s.finish(FinishReason.ERROR, "engine stopped") for s in self._seqs.values()]
        self._seqs.clear()
        return left + super()._close_locked()
