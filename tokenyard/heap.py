"""A serving process's heap: its startup objects kept out of the cycle collector's way, and the
memory its engine frees each step kept for the next (both only where the process is its own)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

# glibc's mallopt(3) parameters
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# Freed memory kept up to this much before it goes back to the system, and grown by at least
# this much each time: an engine step's activations (tens of MB on the tiny model at 64
# sequences) are then reused, not unmapped and faulted in again, page by page, the next step.
RETAIN_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for it: larger blocks still map directly

# Container objects allocated (net of those freed) before a young collection runs; CPython's
# default is 700. A request's objects die by reference count long before a collection could
# find them, but with 64 calls in flight 700 is crossed every few requests, each pass scanning
# every request's live objects and promoting them to be scanned again: 5 % of the gateway's and
# 2.5 % of the worker's CPU under load (docs/benchmarks.md). At this threshold a pass comes when
# garbage does (a few MB of cyclic garbage at most waits for it), not once per few requests.
YOUNG_THRESHOLD = 10_000


def freeze() -> None:
    """Collect once, then move every object alive now (modules, the app, an engine's model) to
    the permanent generation, so later collections stop re-scanning them: a full collection of
    the gateway's startup heap stalled it ~20 ms on the 2-core box (docs/benchmarks.md). Young
    collections then wait for `YOUNG_THRESHOLD` new objects."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, young), middle, old)


def retain_freed_memory() -> bool:
    """Have glibc's malloc keep what is freed for reuse. With its defaults, the buffers a CPU
    forward pass frees (in the engine's thread, whose arena trims its top after every free)
    go back to the system and come back as fresh zeroed pages on the next step: the tiny model
    at 64 sequences took ~20 page faults per token, a fifth of its engine thread's CPU time in
    the kernel (docs/benchmarks.md, engine ceiling). Process-wide, so only for a process that
    is its own (the worker's, an engine child's); False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, RETAIN_BYTES),
            (_M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
