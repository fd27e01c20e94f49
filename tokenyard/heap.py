"""A serving process's startup heap, kept out of the cycle collector's way."""

from __future__ import annotations

import gc

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
