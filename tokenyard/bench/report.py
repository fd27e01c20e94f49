"""The JSON report of a run (one entry per load level) and its rich table."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenyard.bench.runner import BenchSettings, LevelRun
from tokenyard.bench.stats import DEFAULT_PERCENTILES, percentile_key, rate, summarize

REPORT_VERSION = 1
MS = 1000.0


def level_report(run: LevelRun) -> dict[str, Any]:
    """Counts, throughput, latency percentiles (ms) and errors of one level.

    Latencies and throughput count successful requests only; failures are counted by kind.
    """
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    errors = Counter(r.error or "unknown" for r in failed)
    examples: dict[str, str] = {}
    for r in failed:
        if r.error_detail and (r.error or "unknown") not in examples:
            examples[r.error or "unknown"] = r.error_detail
    return {
        "load": run.load.as_dict(),
        "requests": {"sent": len(run.results), "completed": len(ok), "failed": len(failed)},
        "duration_s": round(run.wall_s, 3),
        "throughput": {
            "requests_per_s": round(rate(len(ok), run.wall_s), 3),
            "output_tokens_per_s": round(rate(output_tokens, run.wall_s), 3),
        },
        "tokens": {
            "output": output_tokens,
            # None when the server reported no usage; the output count is then chunks seen
            "prompt": sum(prompt_counts) if prompt_counts else None,
            "output_from_usage": bool(ok) and all(r.usage_reported for r in ok),
        },
        "ttft_ms": summarize(r.ttft_s for r in ok if r.ttft_s is not None).as_dict(MS),
        "itl_ms": summarize(gap for r in ok for gap in r.itl_s).as_dict(MS),
        "tpot_ms": summarize(r.tpot_s for r in ok if r.tpot_s is not None).as_dict(MS),
        "e2e_ms": summarize(r.e2e_s for r in ok).as_dict(MS),
        "errors": dict(errors.most_common()),
        "error_examples": examples,
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in ok).most_common()),
    }


def build_report(settings: BenchSettings, runs: Sequence[LevelRun]) -> dict[str, Any]:
    """The whole report: the run's settings (API key left out) and one entry per level."""
    options = settings.options
    return {
        "report_version": REPORT_VERSION,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": {
            "base_url": settings.base_url,
            "endpoint": options.endpoint.value,
            "model": options.model,
            "requests": settings.requests,
            "duration_s": settings.duration_s,
            "seed": settings.seed,
            "include_usage": options.include_usage,
            "ignore_eos": options.ignore_eos,
            "min_tokens": options.min_tokens,
            "temperature": options.temperature,
            "extra_body": dict(options.extra_body),
            "workload": settings.workload.describe(),
        },
        "levels": [level_report(run) for run in runs],
    }


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _load_text(load: dict[str, Any]) -> str:
    if load["mode"] == "open":
        return f"{load['rate']:g}/s"
    return f"{load['concurrency']} clients"


def _ms(summary: dict[str, Any], q: float) -> str:
    value = summary.get(percentile_key(q))
    return "-" if value is None else f"{value:.1f}"


def render_table(report: dict[str, Any]) -> Table:
    """One row per level: load, outcome, throughput, and p50/p99 latencies in ms."""
    low, high = DEFAULT_PERCENTILES[0], DEFAULT_PERCENTILES[-1]
    table = Table(
        title=f"tokenyard bench · {report['config']['model']} · /{report['config']['endpoint']}"
    )
    for name in ("load", "ok/sent", "errors", "req/s", "out tok/s"):
        table.add_column(name, justify="left" if name in ("load", "errors") else "right")
    for metric in ("TTFT", "ITL", "E2E"):
        for q in (low, high):
            table.add_column(f"{metric} {percentile_key(q)}", justify="right")
    for level in report["levels"]:
        requests, throughput = level["requests"], level["throughput"]
        errors = " ".join(f"{k} x{v}" for k, v in level["errors"].items()) or "-"
        table.add_row(
            _load_text(level["load"]),
            f"{requests['completed']}/{requests['sent']}",
            errors,
            f"{throughput['requests_per_s']:.2f}",
            f"{throughput['output_tokens_per_s']:.1f}",
            *(_ms(level[key], q) for key in ("ttft_ms", "itl_ms", "e2e_ms") for q in (low, high)),
        )
    table.caption = "latencies in ms, successful requests only"
    return table


def print_table(report: dict[str, Any], console: Console) -> None:
    console.print(render_table(report))
