"""Every Prometheus metric tokenyard exports, defined once, registered on a caller's registry.

Latency histograms use vLLM's bucket boundaries so dashboards built for vLLM translate.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.requests = Counter(
            "tokenyard_http_requests",
            "HTTP requests answered, by route template and status code.",
            ["method", "route", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "tokenyard_rejections",
            "Requests refused before reaching the queue, by reason.",
            ["reason"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "tokenyard_time_to_first_token_seconds",
            "From request arrival to the first generated token seen by the gateway.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "tokenyard_inter_token_latency_seconds",
            "Time between generated tokens as seen by the gateway.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "tokenyard_e2e_request_latency_seconds",
            "From request arrival to the job's terminal event.",
            ["model"],
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "tokenyard_request_queue_time_seconds",
            "Time a job waited in its lane before a worker claimed it.",
            ["model"],
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenyard_prompt_tokens", "Prompt tokens of finished jobs.", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "tokenyard_generation_tokens",
            "Generated tokens of finished jobs.",
            ["model"],
            registry=r,
        )
        self.jobs_finished = Counter(
            "tokenyard_jobs_finished",
            "Jobs whose end a gateway caller saw, by terminal status.",
            ["model", "status"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "tokenyard_queue_depth",
            "Jobs waiting in a lane, not yet claimed (sampled at scrape).",
            ["model", "priority"],
            registry=r,
        )
        self.queue_in_flight = Gauge(
            "tokenyard_queue_in_flight",
            "Jobs claimed by a worker and not yet completed (sampled at scrape).",
            ["model", "priority"],
            registry=r,
        )
        self.queue_oldest_age = Gauge(
            "tokenyard_queue_oldest_age_seconds",
            "Age of the oldest waiting job of a lane; 0 when the lane is empty.",
            ["model", "priority"],
            registry=r,
        )
        self.dead_letters = Gauge(
            "tokenyard_dead_letters",
            "Entries in a model's dead-letter stream (sampled at scrape).",
            ["model"],
            registry=r,
        )
        self.live_workers = Gauge(
            "tokenyard_live_workers",
            "Workers of a model whose heartbeat has not lapsed (sampled at scrape).",
            ["model"],
            registry=r,
        )
        self.broker_up = Gauge(
            "tokenyard_broker_up", "1 when the broker answered the last scrape.", registry=r
        )
        self.routed = Counter(
            "tokenyard_routed_requests",
            "Requests by the model asked for, the model chosen, and the routing rule that chose.",
            ["requested", "model", "rule"],
            registry=r,
        )
        # -- response cache and collapsing (tokenyard/cache.py) --
        self.cache_hits = Counter(
            "tokenyard_cache_hits",
            "Deterministic requests answered from the response cache, by tier (local|shared).",
            ["model", "tier"],
            registry=r,
        )
        self.cache_misses = Counter(
            "tokenyard_cache_misses",
            "Deterministic requests the response cache could not answer.",
            ["model"],
            registry=r,
        )
        self.cache_hit_bytes = Counter(
            "tokenyard_cache_hit_bytes",
            "Bytes of cached answers served.",
            ["model"],
            registry=r,
        )
        self.cache_stored_bytes = Counter(
            "tokenyard_cache_stored_bytes",
            "Bytes of answers this gateway wrote to the shared cache tier.",
            ["model"],
            registry=r,
        )
        self.cache_local_bytes = Gauge(
            "tokenyard_cache_local_bytes",
            "Bytes held by this gateway's in-process cache tier.",
            registry=r,
        )
        self.collapsed = Counter(
            "tokenyard_collapsed_requests",
            "Requests that joined an identical job in flight instead of creating one.",
            ["model"],
            registry=r,
        )
