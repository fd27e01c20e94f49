"""vLLM's metric names beside tokenyard's, for dashboards and autoscalers (KEDA triggers, the
vLLM Grafana dashboard) written against `vllm serve`.

Nothing is observed twice: at each scrape `VllmNames` reads the families its registry already
collects (the gateway's own, and under `serve` its workers' through the multiprocess
collector; a standalone worker's on its own port) and shows each again under vLLM's name, its
`model` label as vLLM's `model_name`, summed over tokenyard's other labels (priority, status).
An alias whose vLLM meaning two tokenyard families can give takes the first that has samples:
`vllm:num_requests_waiting` is the lanes' depth where the gateway samples it, else the
worker's jobs waiting for room in its engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class Alias:
    """One vLLM family: its name and type, the tokenyard families it is read from (the first
    with samples wins), a label filter, and how a gauge's series combine."""

    name: str
    kind: str  # gauge | counter | histogram
    sources: tuple[str, ...]
    documentation: str
    only: dict[str, str] = field(default_factory=dict)  # keep samples with these labels
    combine: str = "sum"  # a gauge's series over workers or lanes: sum | max


ALIASES: tuple[Alias, ...] = (
    Alias(
        "vllm:num_requests_running",
        "gauge",
        ("tokenyard_worker_running_sequences", "tokenyard_queue_in_flight"),
        "Number of requests in model execution batches (tokenyard: sequences in the engines, "
        "else jobs claimed by workers).",
    ),
    Alias(
        "vllm:num_requests_waiting",
        "gauge",
        ("tokenyard_queue_depth", "tokenyard_worker_waiting_sequences"),
        "Number of requests waiting to be processed (tokenyard: jobs waiting in the lanes, "
        "else jobs a worker holds waiting for room in its engine).",
    ),
    Alias(
        "vllm:kv_cache_usage_perc",
        "gauge",
        ("tokenyard_worker_kv_cache_usage_ratio",),
        "KV-cache usage. 1 means 100 percent usage (the fullest worker's).",
        combine="max",
    ),
    Alias(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        ("tokenyard_worker_kv_cache_usage_ratio",),
        "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: use vllm:kv_cache_usage_perc.",
        combine="max",
    ),
    Alias(
        "vllm:prompt_tokens",
        "counter",
        ("tokenyard_prompt_tokens", "tokenyard_worker_prefill_tokens"),
        "Number of prefill tokens processed.",
    ),
    Alias(
        "vllm:generation_tokens",
        "counter",
        ("tokenyard_generation_tokens", "tokenyard_worker_decode_tokens"),
        "Number of generation tokens processed.",
    ),
    Alias(
        "vllm:request_success",
        "counter",
        ("tokenyard_jobs_finished", "tokenyard_worker_jobs"),
        "Count of successfully processed requests.",
        only={"status": "succeeded"},
    ),
    Alias(
        "vllm:prefix_cache_queries",
        "counter",
        ("tokenyard_worker_prefix_cache_queries",),
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    Alias(
        "vllm:prefix_cache_hits",
        "counter",
        ("tokenyard_worker_prefix_cache_hits",),
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    Alias(
        "vllm:time_to_first_token_seconds",
        "histogram",
        ("tokenyard_time_to_first_token_seconds",),
        "Histogram of time to first token in seconds.",
    ),
    Alias(
        "vllm:inter_token_latency_seconds",
        "histogram",
        ("tokenyard_inter_token_latency_seconds",),
        "Histogram of inter-token latency in seconds.",
    ),
    Alias(
        "vllm:time_per_output_token_seconds",
        "histogram",
        ("tokenyard_inter_token_latency_seconds",),
        "Histogram of time per output token in seconds. DEPRECATED: use "
        "vllm:inter_token_latency_seconds.",
    ),
    Alias(
        "vllm:e2e_request_latency_seconds",
        "histogram",
        ("tokenyard_e2e_request_latency_seconds",),
        "Histogram of e2e request latency in seconds.",
    ),
    Alias(
        "vllm:request_queue_time_seconds",
        "histogram",
        ("tokenyard_request_queue_time_seconds",),
        "Histogram of time spent in WAITING phase for request.",
    ),
)

# the samples an alias carries: counters' totals, histograms' buckets, counts and sums
_SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
_KEPT_LABELS = ("le",)


def aliased(families: Iterable[Metric], aliases: Iterable[Alias] = ALIASES) -> list[Metric]:
    """The vLLM families `aliases` make of tokenyard's `families` (as a registry collects them)."""
    by_name = {f.name: f for f in families}
    out = []
    for alias in aliases:
        metric = Metric(alias.name, alias.documentation, alias.kind)
        source = next(
            (by_name[s] for s in alias.sources if s in by_name and by_name[s].samples), None
        )
        if source is not None:
            _fold(source, alias, metric)
        out.append(metric)
    return out


def _fold(source: Metric, alias: Alias, into: Metric) -> None:
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in source.samples:
        suffix = sample.name.removeprefix(source.name)
        if suffix not in _SUFFIXES[alias.kind]:
            continue  # _created, a multiprocess gauge's pid series and the like
        if any(sample.labels.get(k) != v for k, v in alias.only.items()):
            continue
        labels = {"model_name": sample.labels.get("model", "")}
        labels.update((k, sample.labels[k]) for k in _KEPT_LABELS if k in sample.labels)
        key = (suffix, tuple(sorted(labels.items())))
        if key in values and alias.combine == "max":
            values[key] = max(values[key], sample.value)
        else:
            values[key] = values.get(key, 0.0) + sample.value
    for (suffix, pairs), value in values.items():
        into.add_sample(alias.name + suffix, dict(pairs), value)


class VllmNames(Collector):
    """The vLLM families of what `registry` collects, registered on that registry itself."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._inside = threading.local()  # its own collect reads the registry: not itself
        registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return []  # names are not claimed: no check against tokenyard's (which differ)

    def collect(self) -> Iterator[Metric]:
        if getattr(self._inside, "active", False):
            return
        self._inside.active = True
        try:
            families = list(self._registry.collect())
        finally:
            self._inside.active = False
        yield from aliased(families)
