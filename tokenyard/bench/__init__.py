"""`tokenyard bench`: a load generator for any OpenAI-compatible endpoint.

Open-loop (Poisson) or closed-loop load, streamed requests timed per token, a JSON report of
TTFT / ITL / E2E percentiles and throughput, and an optional rate sweep with a plot.
"""

from __future__ import annotations

from tokenyard.bench.arrivals import closed_loop_budget, poisson_intervals, poisson_offsets
from tokenyard.bench.stats import Summary, percentile, summarize

__all__ = [
    "Summary",
    "closed_loop_budget",
    "percentile",
    "poisson_intervals",
    "poisson_offsets",
    "summarize",
]
