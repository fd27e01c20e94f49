"""Any engine in a child process: its busy loop stops competing with the worker for the GIL.

The parent keeps the `Engine` interface. Commands (add/abort/stop) go to the child as msgpack
over a pipe; the child sends back each step's outputs (with its latest stats) the same way,
and a parent thread hands them to an `OutputChannel`. The parent holds an unstarted engine's
tokenizer and capacity: engine constructors read config and tokenizer files, never weights
(nor CUDA). The child's capacity, measured when its engine started, replaces it on start.

Refusals are the parent's: it checks each request against the model's limits and its own
account of the child's capacity, so `add` raises `InvalidRequest` / `EngineError` exactly as
an in-thread engine does; the parent frees a slot only once the child reported its finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from tokenyard import heap, limits
from tokenyard.engines.base import (
    ChannelEngine,
    Engine,
    EngineCapacity,
    EngineRequest,
    EngineTokenizer,
    StepOutput,
    footprint,
)
from tokenyard.errors import EngineClosed, EngineError, UserError
from tokenyard.messages import EngineStats, FinishReason, ModelLimits

log = logging.getLogger(__name__)

DIED = "engine process died"
STOPPED = "engine stopped"
# ModelLimits the child's engine decides (its context, which tasks, which optional decoding
# features); the rest (capacity, vocab size, revision, name) this side knows as well
_CHILD_LIMITS = (
    "max_model_len",
    "generates",
    "embeds",
    "scores",
    "matryoshka",
    "matryoshka_dimensions",
    "features",
    "adapters",
)

# -- wire messages ---------------------------------------------------------------------------


class _Init(msgspec.Struct, tag="init", array_like=True):
    name: str
    options: dict[str, Any]


class _Add(msgspec.Struct, tag="add", array_like=True):
    request: EngineRequest


class _Abort(msgspec.Struct, tag="abort", array_like=True):
    seq_id: str


class _Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


class _Ready(msgspec.Struct, tag="ready", array_like=True):
    capacity: EngineCapacity


class _Failed(msgspec.Struct, tag="failed", array_like=True):
    error: str


class _Batch(msgspec.Struct, tag="batch", array_like=True):
    outputs: list[StepOutput]
    stats: EngineStats


class _Closed(msgspec.Struct, tag="closed", array_like=True):
    pass


_ToChild = _Init | _Add | _Abort | _Stop
_ToParent = _Ready | _Failed | _Batch | _Closed
_Send = Callable[[_ToParent], None]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise NotImplementedError(f"cannot send {type(obj).__name__} to the engine process")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_to_child = msgspec.msgpack.Decoder(_ToChild)
_to_parent = msgspec.msgpack.Decoder(_ToParent)


# -- parent side -----------------------------------------------------------------------------


def engine_frontend(
    name: str, options: Mapping[str, Any]
) -> tuple[str, EngineTokenizer, EngineCapacity, ModelLimits]:
    """The engine's name, tokenizer, capacity and limits, from an engine that is built but not
    started.

    Constructors only read the model's config and tokenizer; weights load in `start()`.
    """
    from tokenyard.engines import make_engine

    shell = make_engine(name, **options)
    return shell.name, shell.tokenizer, shell.capacity, shell.limits()


class ProcessEngine(ChannelEngine):
    """Runs `make_engine(name, **options)` in a spawned child process behind the Engine API."""

    def __init__(
        self,
        name: str,
        options: Mapping[str, Any] | None = None,
        *,
        start_timeout_s: float = 600.0,
        stop_timeout_s: float = 90.0,
    ) -> None:
        opts = dict(options or {})
        try:
            self._init = _encoder.encode(_Init(name, opts))
        except (TypeError, NotImplementedError) as exc:
            # Fail here, not in the child: options must be plain data to cross the pipe.
            raise TypeError(f"engine options cannot be sent to a process: {exc}") from exc
        self.name, self.tokenizer, capacity, self._shell_limits = engine_frontend(name, opts)
        # The ledger is the child's capacity as the parent accounts for it; the stats are the
        # child's, as attached to its last step.
        super().__init__(capacity)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._send_lock = threading.Lock()  # one writer at a time on the pipe
        # seq_id -> [prompt_tokens, completion_tokens]: what an ERROR needs if the child dies.
        self._running: dict[str, list[int]] = {}
        self._backlog: list[bytes] = []  # commands sent before start()
        self._conn: Connection | None = None
        self._proc: BaseProcess | None = None
        self._reader: threading.Thread | None = None
        self._starting = False
        self._stopping = False
        self._dead = False

    @property
    def runs_adapters(self) -> bool:  # type: ignore[override]
        # as the child's engine, built with the same options, publishes it
        return self._shell_limits.adapters

    @property
    def pid(self) -> int | None:
        """The child's process id once started."""
        return None if self._proc is None else self._proc.pid

    async def start(self) -> None:
        with self._lock:
            if self._starting:
                return
            if self._stopping:
                raise EngineError("engine is stopped")
            self._starting = True
        self._channel.bind(asyncio.get_running_loop())
        ctx = mp.get_context("spawn")  # fork after torch started its threads is unsafe
        conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_child_main, args=(child_conn,), name=f"tokenyard-engine-{self.name}"
        )
        proc.daemon = True  # multiprocessing ends it when this process exits normally
        proc.start()
        child_conn.close()  # only the child holds its end, so its death reads as EOF here
        self._proc = proc
        try:
            conn.send_bytes(self._init)
            ready = await asyncio.to_thread(self._handshake, conn, proc)
        except BaseException:
            await asyncio.to_thread(_reap, proc, 0.0)
            conn.close()
            self._fail_all(DIED)
            raise
        self.capacity = ready.capacity  # the child's word is final (same constructor anyway)
        self._reader = threading.Thread(
            target=self._read_loop, args=(conn,), name="tokenyard-engine-reader", daemon=True
        )
        self._reader.start()
        with self._send_lock:
            self._conn = conn
            backlog, self._backlog = self._backlog, []
            with contextlib.suppress(OSError):  # a dead child is reported by the reader
                for data in backlog:
                    conn.send_bytes(data)

    def _handshake(self, conn: Connection, proc: BaseProcess) -> _Ready:
        deadline = time.monotonic() + self.start_timeout_s
        while not conn.poll(0.2):
            if not proc.is_alive() and not conn.poll(0):
                raise RuntimeError(f"engine process exited during start ({proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine process not ready after {self.start_timeout_s}s")
        try:
            msg = _to_parent.decode(conn.recv_bytes())
        except EOFError:
            raise RuntimeError(f"engine process exited during start ({proc.exitcode})") from None
        if isinstance(msg, _Failed):
            raise RuntimeError(f"engine process failed to start: {msg.error}")
        if not isinstance(msg, _Ready):
            raise RuntimeError(f"unexpected {type(msg).__name__} from the engine process")
        return msg

    async def stop(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        proc, reader = self._proc, self._reader
        if reader is None:  # never started, start failed, or still in its handshake
            if proc is not None:
                await asyncio.to_thread(_reap, proc, 0.0)  # a pending start() then raises
            self._fail_all(STOPPED)
            return
        assert proc is not None  # the reader starts only after the child is up
        self._send(_encoder.encode(_Stop()))
        # The child stops its engine (running sequences end with "engine stopped"), sends
        # _Closed and exits; a child that hangs is killed after the timeout.
        await asyncio.to_thread(_reap, proc, self.stop_timeout_s)
        await asyncio.to_thread(reader.join)
        with self._send_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def add(self, request: EngineRequest) -> None:
        # Refusals are raised here, synchronously, as the in-thread engines do.
        seq_id, prompt_tokens = request.seq_id, len(request.prompt_token_ids)
        if not seq_id:
            raise EngineError("seq_id must be non-empty")
        if request.input_lengths is None:
            limits.check(limits.refusal(prompt_tokens, request.params, self.limits()))
        else:
            limits.check(
                limits.embedding_refusal(
                    request.input_lengths, self.limits(), pooling=request.pooling
                )
            )
        data = _encoder.encode(_Add(request))
        with self._lock:
            if self._stopping:
                raise EngineError("engine is stopped")
            if self._dead:
                raise EngineError(DIED)
            if seq_id in self._running:
                raise EngineError(f"sequence {seq_id!r} is already in the engine")
            self._ledger.take(seq_id, footprint(prompt_tokens, request.params), self.capacity)
            # Registered before sending: if the child dies first, this one gets its ERROR too.
            self._running[seq_id] = [prompt_tokens, len(request.resume_token_ids)]
        self._send(data)

    def limits(self) -> ModelLimits:
        shell = self._shell_limits
        return msgspec.structs.replace(
            super().limits(), **{name: getattr(shell, name) for name in _CHILD_LIMITS}
        )

    def abort(self, seq_id: str) -> None:
        with self._lock:
            if seq_id not in self._running or self._dead:
                return
            # Freed now, as in-thread engines do: the child applies this abort before any later
            # add, since commands cross the pipe in order.
            self._ledger.give_back(seq_id)
        self._send(_encoder.encode(_Abort(seq_id)))

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            if self._conn is None:
                if self._proc is None:
                    self._backlog.append(data)
                return
            # A broken pipe means the child died: the reader sees EOF and fails what ran.
            with contextlib.suppress(OSError):
                self._conn.send_bytes(data)

    def _read_loop(self, conn: Connection) -> None:
        """Parent thread: child messages into the output channel until _Closed or EOF."""
        try:
            while True:
                msg = _to_parent.decode(conn.recv_bytes())
                if isinstance(msg, _Closed):
                    break
                if isinstance(msg, _Batch):
                    self._deliver(msg)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("bad message from the engine process; killing it")
            if self._proc is not None:
                with contextlib.suppress(OSError):
                    self._proc.kill()
        finally:
            with self._lock:
                stopping = self._stopping
            if not stopping:
                if self._proc is not None:
                    self._proc.join(2.0)  # reap it, so the log has its exit code
                log.error("engine process %s died (exit code %s)", self.pid, _exitcode(self._proc))
            self._fail_all(STOPPED if stopping else DIED)

    def _deliver(self, batch: _Batch) -> None:
        with self._lock:
            self._stats = batch.stats
            for out in batch.outputs:
                entry = self._running.get(out.seq_id)
                if entry is None:
                    continue
                if out.finish_reason is not None:
                    del self._running[out.seq_id]
                    self._ledger.give_back(out.seq_id)
                else:
                    entry[1] = out.completion_tokens
            # Delivered under the lock so that _fail_all's outputs can never overtake these.
            self._channel.deliver(batch.outputs)

    def _fail_all(self, reason: str) -> None:
        """Finish every sequence still running with ERROR, then close the output channel."""
        with self._lock:
            self._dead = True
            left, self._running = self._running, {}
            self._ledger.clear()
            self._channel.deliver(
                [
                    StepOutput(seq_id, [], "", FinishReason.ERROR, p, c, error=reason)
                    for seq_id, (p, c) in left.items()
                ]
            )
            self._channel.close()


def _exitcode(proc: BaseProcess | None) -> int | None:
    return None if proc is None else proc.exitcode


def _reap(proc: BaseProcess, timeout: float) -> None:
    """Join the child; kill it (SIGKILL: it ignores SIGTERM) if it outlives the timeout."""
    proc.join(timeout)
    if proc.is_alive():
        log.warning("engine process %s did not stop in %.0fs; killing it", proc.pid, timeout)
        proc.kill()
        proc.join(10.0)


def make_engine_in_process(name: str, **options: Any) -> Engine:
    """Like `make_engine`, with the engine running in its own process."""
    return ProcessEngine(name, options)


# -- child side ------------------------------------------------------------------------------


def _child_main(conn: Connection) -> None:
    """Entry point of the engine process."""
    # Terminal Ctrl-C and a group-wide SIGTERM are for the worker, which drains and then
    # stops this engine itself; dying first would fail the sequences it is finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        msg = _to_child.decode(conn.recv_bytes())
    except EOFError:
        return
    if not isinstance(msg, _Init):
        return
    heap.retain_freed_memory()  # this process is the engine's own (see `tokenyard.heap`)
    asyncio.run(_serve(conn, msg))


async def _serve(conn: Connection, init: _Init) -> None:
    send_lock = threading.Lock()

    def send(msg: _ToParent) -> None:
        data = _encoder.encode(msg)
        with send_lock:
            conn.send_bytes(data)

    try:
        from tokenyard.engines import make_engine

        engine = make_engine(init.name, **init.options)
        await engine.start()
    except Exception as exc:
        send(_Failed(f"{type(exc).__name__}: {exc}"))
        return
    send(_Ready(engine.capacity))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    threading.Thread(
        target=_commands,
        args=(conn, engine, send, loop, stop),
        name="tokenyard-engine-commands",
        daemon=True,
    ).start()
    forward = asyncio.create_task(_forward(engine, send))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({forward, stopping}, return_when=asyncio.FIRST_COMPLETED)
    try:
        await engine.stop()
        await forward  # ends with EngineClosed once the "engine stopped" outputs went out
    finally:
        stopping.cancel()
        with contextlib.suppress(OSError):
            send(_Closed())


async def _forward(engine: Engine, send: _Send) -> None:
    while True:
        try:
            outputs = await engine.outputs()
        except EngineClosed:
            return
        send(_Batch(outputs, engine.stats()))


def _commands(
    conn: Connection,
    engine: Engine,
    send: _Send,
    loop: asyncio.AbstractEventLoop,
    stop: asyncio.Event,
) -> None:
    """Child thread: applies the parent's commands; the process exits when the parent is gone."""
    try:
        while True:
            msg = _to_child.decode(conn.recv_bytes())
            if isinstance(msg, _Add):
                _add(engine, msg.request, send)
            elif isinstance(msg, _Abort):
                engine.abort(msg.seq_id)
            elif isinstance(msg, _Stop):
                # Keep reading: EOF while stopping still means the parent is gone.
                loop.call_soon_threadsafe(stop.set)
    except (EOFError, OSError):
        # The parent died or dropped the pipe without a stop: nobody is left to serve.
        os._exit(0)
    except BaseException:
        log.exception("engine process command thread failed")
        os._exit(1)


def _add(engine: Engine, request: EngineRequest, send: _Send) -> None:
    try:
        engine.add(request)
    except Exception as exc:
        # The parent checked the request and the capacity, so this is the engine's failure
        # (or a bug): report it as the sequence's ERROR rather than losing it. A refusal only
        # the engine can make (a structured output that does not compile) fails the job as
        # InvalidRequest would, without a retry.
        out = StepOutput(
            request.seq_id,
            [],
            "",
            FinishReason.ERROR,
            len(request.prompt_token_ids),
            len(request.resume_token_ids),
            error=f"{type(exc).__name__}: {exc}",
            refused=isinstance(exc, UserError),
        )
        send(_Batch([out], engine.stats()))
