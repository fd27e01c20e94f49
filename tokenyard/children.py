"""Child processes tied to their parent: a `serve` or test run that is SIGKILLed (OOM killer,
CI timeout, `kill -9`) never runs its shutdown, and must not leave servers or workers behind.

On Linux the child asks the kernel for a signal when its parent dies (prctl PR_SET_PDEATHSIG).
The kernel ties that signal to the *thread* that forked, not to the process: a child spawned
from `asyncio.to_thread`, a pool thread or the autoscaler's thread would be signalled as soon
as that thread exits. So every spawn goes through one daemon thread that lives as long as the
process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, on `host` (IPv4 or IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _tie_to_parent(on_death: signal.Signals) -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # prctl is variadic over unsigned longs; build the arguments here, not in the child.
    args = (
        ctypes.c_int(_PR_SET_PDEATHSIG),
        ctypes.c_ulong(int(on_death)),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
    )
    parent = os.getpid()

    def preexec() -> None:
        # Runs in the forked child before exec; PDEATHSIG survives exec of a non-setuid binary.
        prctl(*args)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), on_death)

    return preexec


_Job = tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
_jobs: SimpleQueue[_Job] = SimpleQueue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def _spawner_loop() -> None:
    while True:
        fn, future = _jobs.get()
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)


def spawn_tied(
    argv: Sequence[str], on_parent_death: signal.Signals, **popen: Any
) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(argv, **popen)` whose child gets `on_parent_death` when we die."""
    global _spawner
    preexec = _tie_to_parent(on_parent_death)
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawner_loop, name="tokenyard-spawner", daemon=True)
            _spawner.start()
    future: Future[subprocess.Popen[bytes]] = Future()
    _jobs.put((lambda: subprocess.Popen(list(argv), preexec_fn=preexec, **popen), future))
    return future.result()
