"""The worker's periodic stats line, as vLLM logs one: load and throughput over the interval."""

from __future__ import annotations

import logging

from tokenyard.logs import Fields
from tokenyard.messages import EngineStats


class StatsLine:
    """Every `interval_s` (monotonic seconds, injected), the line of the interval just ended;
    an idle interval after an idle one is DEBUG, so an idle worker stays quiet at INFO."""

    def __init__(self, worker: str, interval_s: float, now: float) -> None:
        self.worker = worker
        self.interval_s = interval_s
        self._since = now
        self._last = EngineStats()
        self._was_idle = False
        self._kv_known = False

    def due(self, now: float) -> bool:
        return self.interval_s > 0 and now - self._since >= self.interval_s

    def take(
        self, now: float, stats: EngineStats, running: int, waiting: int, jobs_done: int
    ) -> tuple[int, Fields]:
        """The level and line of the interval ending `now`, whose end stats are `stats`."""
        span = max(now - self._since, 1e-9)
        last, self._last, self._since = self._last, stats, now
        prompt = max(0, stats.prefill_tokens - last.prefill_tokens)
        generated = max(0, stats.tokens_generated - last.tokens_generated)
        steps = stats.steps - last.steps
        # engines that keep no KV cache report 0 throughout: no column for them
        self._kv_known = self._kv_known or stats.kv_cache_usage > 0
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        values = {
            "running": running,
            "waiting": waiting,
            "prompt_tokens_per_s": round(prompt / span, 1),
            "generation_tokens_per_s": round(generated / span, 1),
            "mean_batch": round((stats.sequences_stepped - last.sequences_stepped) / steps, 2)
            if steps > 0
            else 0.0,
            "kv_usage_pct": round(100 * stats.kv_cache_usage, 1) if self._kv_known else None,
            "prefix_hit_pct": round(100 * hits / queries, 1) if queries > 0 else None,
            "jobs_done": jobs_done,
            "worker": self.worker,
        }
        idle = not (prompt or generated or running or waiting)
        level = logging.DEBUG if idle and self._was_idle else logging.INFO
        self._was_idle = idle
        return level, Fields("stats", values)
