"""A serving process's startup heap, kept out of the cycle collector's way."""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect once, then move every object alive now (modules, the app, an engine's model) to
    the permanent generation, so later collections stop re-scanning them: a full collection of
    the gateway's startup heap stalled it ~20 ms on the 2-core box (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
