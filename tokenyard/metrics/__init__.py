"""Every Prometheus metric tokenyard exports, defined once, registered on a caller's registry.

Latency histograms use vLLM's bucket boundaries so dashboards built for vLLM translate.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenyard.metrics.promcache import BulkHistogram, CachedCounter, CachedGauge, CachedHistogram
from tokenyard.metrics.vllm import VllmNames

if TYPE_CHECKING:
    from tokenyard.messages import EngineStats

# vllm/v1/metrics/loggers.py: time_to_first_token_seconds
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vllm: inter_token_latency_seconds (formerly time_per_output_token_seconds)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
# vllm: request_latency_buckets, shared by e2e_request_latency and request_queue_time
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class GatewayMetrics:
    """The gateway's metrics; one instance per app, so several apps can share a process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        # every metric of this app on its registry (the label names after the description)
        def counter(name: str, documentation: str, *labels: str) -> CachedCounter:
            return CachedCounter(name, documentation, labels, registry=r)

        def gauge(name: str, documentation: str, *labels: str) -> CachedGauge:
            return CachedGauge(name, documentation, labels, registry=r)

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> CachedHistogram:
            # each latency is per model, in vLLM's buckets for the same measure
            return CachedHistogram(name, documentation, ["model"], buckets=buckets, registry=r)

        self.requests = counter(
            "tokenyard_http_requests",
            "HTTP requests answered, by route template and status code.",
            "method",
            "route",
            "status",
        )
        self.rejections = counter(
            "tokenyard_rejections",
            "Requests refused before reaching the queue, by reason.",
            "reason",
        )
        self.time_to_first_token = histogram(
            "tokenyard_time_to_first_token_seconds",
            "From request arrival to the first generated token seen by the gateway.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "tokenyard_inter_token_latency_seconds",
            "Time between generated tokens as seen by the gateway.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "tokenyard_e2e_request_latency_seconds",
            "From request arrival to the job's terminal event.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "tokenyard_request_queue_time_seconds",
            "Time a job waited in its lane before a worker claimed it.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = counter(
            "tokenyard_prompt_tokens", "Prompt tokens of finished jobs.", "model"
        )
        self.generation_tokens = counter(
            "tokenyard_generation_tokens", "Generated tokens of finished jobs.", "model"
        )
        self.jobs_finished = counter(
            "tokenyard_jobs_finished",
            "Jobs whose end a gateway caller saw, by terminal status.",
            "model",
            "status",
        )
        self.queue_depth = gauge(
            "tokenyard_queue_depth",
            "Jobs waiting in a lane, not yet claimed (sampled at scrape).",
            "model",
            "priority",
        )
        self.queue_in_flight = gauge(
            "tokenyard_queue_in_flight",
            "Jobs claimed by a worker and not yet completed (sampled at scrape).",
            "model",
            "priority",
        )
        self.queue_oldest_age = gauge(
            "tokenyard_queue_oldest_age_seconds",
            "Age of the oldest waiting job of a lane; 0 when the lane is empty.",
            "model",
            "priority",
        )
        self.dead_letters = gauge(
            "tokenyard_dead_letters",
            "Entries in a model's dead-letter stream (sampled at scrape).",
            "model",
        )
        self.live_workers = gauge(
            "tokenyard_live_workers",
            "Workers of a model whose heartbeat has not lapsed (sampled at scrape).",
            "model",
        )
        self.broker_up = gauge("tokenyard_broker_up", "1 when the broker answered the last scrape.")
        self.routed = counter(
            "tokenyard_routed_requests",
            "Requests by the model asked for, the model chosen, and the routing rule that chose.",
            "requested",
            "model",
            "rule",
        )
        # -- response cache and collapsing (tokenyard/gateway/cache.py) --
        self.cache_hits = counter(
            "tokenyard_cache_hits",
            "Deterministic requests answered from the response cache, by tier (local|shared).",
            "model",
            "tier",
        )
        self.cache_misses = counter(
            "tokenyard_cache_misses",
            "Deterministic requests the response cache could not answer.",
            "model",
        )
        self.cache_hit_bytes = counter(
            "tokenyard_cache_hit_bytes", "Bytes of cached answers served.", "model"
        )
        self.cache_stored_bytes = counter(
            "tokenyard_cache_stored_bytes",
            "Bytes of answers this gateway wrote to the shared cache tier.",
            "model",
        )
        self.cache_local_bytes = gauge(
            "tokenyard_cache_local_bytes", "Bytes held by this gateway's in-process cache tier."
        )
        self.collapsed = counter(
            "tokenyard_collapsed_requests",
            "Requests that joined an identical job in flight instead of creating one.",
            "model",
        )
        VllmNames(r)  # vLLM's names of these (and, under serve, the workers'): metrics/vllm.py


# vllm: iteration_tokens_total's buckets (its cudagraph sizes), for sequences per engine step
BATCH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class WorkerMetrics:
    """One worker's metrics. Counting happens at the worker's I/O edge (claims, renewals,
    completions, engine steps as delivered); the scheduler stays a pure state machine.

    Under `tokenyard serve` workers run with PROMETHEUS_MULTIPROC_DIR set and the gateway's
    /metrics aggregates them: counters and histograms add up, gauges say how they combine.
    """

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model = model
        r = self.registry

        # a worker serves one model: its own series carry that label, bound here once
        def counter(name: str, documentation: str) -> Counter:
            family = Counter(name, documentation, ["model"], registry=r)
            return family.labels(model)

        def gauge(name: str, documentation: str) -> Gauge:
            # livesum: under serve, the workers' gauges of one model add up on /metrics
            family = Gauge(name, documentation, ["model"], registry=r, multiprocess_mode="livesum")
            return family.labels(model)

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> BulkHistogram:
            family = BulkHistogram(name, documentation, ["model"], buckets=buckets, registry=r)
            return family.labels(model)

        self.running = gauge(
            "tokenyard_worker_running_sequences", "Sequences running in the engines."
        )
        self.waiting = gauge(
            "tokenyard_worker_waiting_sequences",
            "Jobs claimed and waiting for room in the engines.",
        )
        self.tokens_per_s = gauge(
            "tokenyard_worker_tokens_per_second",
            "Generated tokens per second (moving average, as in the heartbeat).",
        )
        self.kv_cache_usage = Gauge(
            "tokenyard_worker_kv_cache_usage_ratio",
            "Fraction of the KV cache in use, where the engine reports it (highest worker).",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.accelerator_utilization = Gauge(
            "tokenyard_accelerator_utilization_ratio",
            "GPU utilisation over the last sample period, on CUDA workers only.",
            ["model", "device"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.batch_size = histogram(
            "tokenyard_worker_batch_size",
            "Sequences stepped together by one engine step.",
            BATCH_BUCKETS,
        )
        self.step_time = histogram(
            "tokenyard_worker_step_seconds",
            "Engine step time as the worker sees it (busy time between deliveries / steps).",
            ITL_BUCKETS,
        )
        # a new job's way into the running batch, stage by stage (how fast a freed slot
        # fills is these plus what happens before the job reaches the lanes)
        self.claim_wait = histogram(
            "tokenyard_worker_claim_wait_seconds",
            "From a job's enqueue (its created_at) to this worker's claim returning it.",
            TTFT_BUCKETS,
        )
        self.to_engine = histogram(
            "tokenyard_worker_claim_to_engine_seconds",
            "From a claim returning a job to the job's engine add (preparing it, its wait "
            "for a slot).",
            TTFT_BUCKETS,
        )
        self.first_step = histogram(
            "tokenyard_worker_first_step_seconds",
            "From a job's engine add to its first token reaching the worker (the step in "
            "flight, its prefill, one decode).",
            TTFT_BUCKETS,
        )
        self.publish_time = histogram(
            "tokenyard_worker_publish_seconds",
            "One delivery's broker writes (events, completions), refilling the engine first.",
            TTFT_BUCKETS,
        )
        self.prefill_tokens = counter("tokenyard_worker_prefill_tokens", "Prompt tokens prefilled.")
        self.decode_tokens = counter("tokenyard_worker_decode_tokens", "Tokens generated.")
        self.claims = counter("tokenyard_worker_claims", "Jobs claimed from the lanes.")
        self.affinity_claims = counter(
            "tokenyard_worker_affinity_claims",
            "Jobs claimed as prefix-affinity work (held for this worker, or past the wait).",
        )
        self.prefix_cache_queries = counter(
            "tokenyard_worker_prefix_cache_queries",
            "Prompt tokens looked up in the engine's prefix cache (engines that report it).",
        )
        self.prefix_cache_hits = counter(
            "tokenyard_worker_prefix_cache_hits",
            "Prompt tokens found in the engine's prefix cache (engines that report it).",
        )
        self.lease_renewals = counter("tokenyard_worker_lease_renewals", "Leases renewed.")
        self.leases_lost = counter(
            "tokenyard_worker_leases_lost",
            "Jobs dropped because their lease was lost (reclaimed by the reaper).",
        )
        self.fenced_completions = counter(
            "tokenyard_worker_fenced_completions",
            "Completions the broker rejected because the lease was no longer ours.",
        )
        self.preemptions = counter(
            "tokenyard_worker_preemptions",
            "Running jobs handed back for higher-priority work (resumed later from their tokens).",
        )
        self.retries = counter(
            "tokenyard_worker_retries",
            "Jobs handed back for another delivery after an engine fault.",
        )
        self.dead_letters = counter(
            "tokenyard_worker_dead_letters",
            "Jobs this worker sent to the dead-letter stream (retries used up, or reaped).",
        )
        self.jobs = Counter(
            "tokenyard_worker_jobs",
            "Jobs whose terminal result this worker wrote, by status.",
            ["model", "status"],
            registry=r,
        )
        self._steps = 0
        self._sequences = 0
        self._decoded = 0
        self._prefilled = 0
        self._prefix_queries = self._prefix_hits = 0
        self._kv_reported = False
        VllmNames(r)  # on its own port; under serve, the gateway's names them (metrics/vllm.py)

    def engine_delivered(self, stats: EngineStats, busy_s: float | None) -> None:
        """Fold the engine's counters since the last delivery in; `busy_s` is the time the
        worker waited for it while sequences were running (None: the engine was idle)."""
        steps = stats.steps - self._steps
        if steps > 0:
            per_step = (stats.sequences_stepped - self._sequences) / steps
            self.batch_size.observe_many(per_step, steps)
            if busy_s is not None:
                self.step_time.observe_many(busy_s / steps, steps)
        self.decode_tokens.inc(max(0, stats.tokens_generated - self._decoded))
        self.prefill_tokens.inc(max(0, stats.prefill_tokens - self._prefilled))
        self._steps, self._sequences = stats.steps, stats.sequences_stepped
        self._decoded, self._prefilled = stats.tokens_generated, stats.prefill_tokens
        self.prefix_cache_queries.inc(max(0, stats.prefix_cache_queries - self._prefix_queries))
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - self._prefix_hits))
        self._prefix_queries, self._prefix_hits = (
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
        )

    def sample(
        self,
        running: int,
        waiting: int,
        tokens_per_s: float,
        stats: EngineStats,
        accelerator: tuple[str, float] | None,
    ) -> None:
        """Gauges of the moment, set once per heartbeat."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.tokens_per_s.set(tokens_per_s)
        if stats.kv_cache_usage > 0 or self._kv_reported:  # engines without one leave it out
            self._kv_reported = True
            self.kv_cache_usage.labels(self.model).set(stats.kv_cache_usage)
        if accelerator is not None:
            self.accelerator_utilization.labels(self.model, accelerator[0]).set(accelerator[1])


class AuditLogMetrics:
    """The Kafka audit log's counters in one process (broker/kafka.py); `prefix` keeps a
    gateway's and its workers' apart under `serve`, which shows both on one /metrics."""

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.sent = Counter(
            f"{prefix}_audit_kafka_sent",
            "Audit entries Kafka acknowledged.",
            registry=registry,
        )
        self.dropped = Counter(
            f"{prefix}_audit_kafka_dropped",
            "Audit entries that never reached Kafka: offered while the buffer in front of it"
            " was full or after close, or still waiting when close gave up.",
            registry=registry,
        )
        self.buffered = Gauge(
            f"{prefix}_audit_kafka_buffered",
            "Audit entries waiting for Kafka's acknowledgement.",
            registry=registry,
            multiprocess_mode="livesum",
        )


def accelerator_utilization(device: str) -> tuple[str, float] | None:
    """(device, 0..1) of the CUDA device a worker uses; None on CPU or when it cannot be read
    (torch.cuda.utilization needs pynvml / nvidia-ml-py)."""
    if device == "cpu" or "torch" not in sys.modules:
        return None  # an engine that never imported torch runs no CUDA kernels here
    torch = sys.modules["torch"]
    try:
        if not torch.cuda.is_available():
            return None
        if device in ("auto", "cuda"):
            index = int(torch.cuda.current_device())
        else:
            index = int(torch.device(device).index or 0)
        return f"cuda:{index}", float(torch.cuda.utilization(index)) / 100.0
    except Exception:
        return None


def add_worker_metrics(registry: CollectorRegistry, multiprocess_dir: Path) -> None:
    """Make `registry` also serve the metrics worker processes write to `multiprocess_dir`."""
    from prometheus_client import multiprocess

    multiprocess.MultiProcessCollector(registry, path=str(multiprocess_dir))  # type: ignore[no-untyped-call]
