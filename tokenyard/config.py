"""Typed settings; each can be overridden by a TOKENYARD_<SECTION>_<FIELD> environment variable."""

from __future__ import annotations

import difflib
import functools
import os
import re
import tomllib
from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from tokenyard.errors import FatalError

# what a setting's value may be: msgspec checks these when settings are built from flags, env
# and the file (`from_env`), so a bad value fails at start, naming the setting and its source
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Count = Annotated[int, msgspec.Meta(ge=1)]  # at least one
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
SecondsOrZero = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class BrokerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Delivery semantics shared by every broker implementation."""

    # redis://, rediss://, unix://, redis+cluster://, nats://, tls://, amqp:// or amqps:// (broker/
    # __init__.py); empty: none given, so a command that needs a broker says so (`serve` starts
    # its own Valkey instead; `nats` or `valkey`: serve's own server of that kind)
    url: str = ""
    # RabbitMQ lanes (amqp:// above) keep records, events and every table on this Redis/Valkey
    # URL; `serve` starts its own Valkey for them when none is given
    tables_url: str = ""
    prefix: str = "ty"
    lease_s: Seconds = 30.0  # an unrenewed entry older than this is reclaimed
    # a worker not heard from for this long is dead: any worker's reap takes its jobs over
    # (resumed from their streamed tokens) without waiting for their leases, which stay long
    # for slow engine steps. A worker beats 4 times in it, so a pause of up to 3/4 of it
    # passes (broker/policy.py, `beat_period`); a worker that lapsed and comes back has lost
    # those jobs (its writes are refused) and carries on
    liveness_s: Seconds = 2.0
    max_deliveries: Count = 5  # deliveries (crashes + retries) before the dead-letter stream
    # times one job may be preempted (handed back for higher-priority work, resumed from its
    # streamed tokens); past it, it runs to its end: no job is preempted forever
    max_preemptions: NonNegative = 3
    max_queue_depth: Count = 100_000  # per lane; enqueue past it raises QueueFull
    # group commit of single-job enqueues (broker/group_commit.py): at most this many jobs per
    # script call; jobs arriving while a call is in flight wait at most the window
    enqueue_batch: Count = 64
    enqueue_window_s: SecondsOrZero = 0.0005
    record_ttl_s: Seconds = 24 * 3600.0  # terminal records and event streams
    idempotency_ttl_s: Seconds = 24 * 3600.0
    # an identical request arriving this long after a collapsed job succeeded still joins it
    # (answered from its record): it covers the time the answer takes to reach the response
    # cache, and bounds the joins when no gateway cached it (broker/policy.py `joinable`)
    collapse_grace_s: Seconds = 10.0
    # stored responses (/v1/responses with `store`): how long each stays retrievable, and
    # usable as a `previous_response_id`, after it was created (OpenAI keeps them 30 days)
    response_ttl_s: Seconds = 30 * 24 * 3600.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 60.0
    starvation_every: Count = 8  # every Nth claim round serves lower lanes first
    # fair share: jobs wait per tenant and only this many (beyond the slots a claim asks for)
    # sit in a lane's stream (at least 1: an idle lane's blocked workers wake on it); another
    # tenant's job waits behind at most these
    fair_window: Count = 4
    appendfsync: Literal["always", "everysec", "no"] = "everysec"
    max_connections: Count = 512  # per process; blocking reads each hold one while they wait
    # size pools: ascending bounds of estimated tokens (prompt + max_tokens), comma-separated,
    # e.g. "2048,8192": three lanes per model and priority; a worker claims only the pools its
    # context holds (see broker/policy.py). Gateways and workers must agree. Empty: one pool.
    size_pools: str = ""
    # prefix affinity (broker/policy.py): a job whose prompt prefix a worker claimed
    # within affinity_ttl_s is held for that worker at most affinity_wait_s (then any worker
    # takes it), and at most affinity_max_held jobs per lane wait for one worker
    affinity_wait_s: float = 0.1
    affinity_ttl_s: float = 60.0
    affinity_max_held: int = 8
    # audit trail: entries kept (receipts + terminal states; MAXLEN ~ on Redis); 0: off
    audit_max_len: NonNegative = 200_000  # ~100,000 jobs; an entry is ~0.3 kB in Valkey
    # the audit trail's entries also go to this Kafka topic (kafka://host:9092[,host2]/topic;
    # broker/kafka.py), off the request's path: at most `audit_kafka_buffer` entries wait in
    # the process while Kafka is away, the rest are dropped and counted. Empty: off
    audit_kafka: str = ""
    audit_kafka_buffer: int = 100_000
    audit_kafka_linger_ms: int = 20
    # the idempotent producer (no duplicates from the producer's own retries). auto: asked
    # for at each connect; a broker that refuses it (Tansu 0.6's memory engine: InitProducerId
    # v0) gets acks=all without it, said once in a warning. true: required, a broker that
    # refuses it gets nothing (an error line each minute; the entries wait, then are dropped
    # and counted). false: never asked for
    audit_kafka_idempotent: bool | Literal["auto"] = "auto"

    @property
    def pool_bounds(self) -> tuple[int, ...]:
        return parse_pool_bounds(self.size_pools)

    @property
    def pool_count(self) -> int:
        return len(self.pool_bounds) + 1


@functools.lru_cache(maxsize=64)  # read on every enqueue and claim
def parse_pool_bounds(text: str) -> tuple[int, ...]:
    """ "2048,8192" -> (2048, 8192); the bounds must be positive and ascending."""
    try:
        bounds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise FatalError(f"size_pools: {text!r} is not a comma-separated list of ints") from exc
    if any(b <= 0 for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise FatalError(f"size_pools: {text!r} must be positive and strictly ascending")
    return bounds


_S = TypeVar("_S", bound=msgspec.Struct)

CONFIG_ENV = "TOKENYARD_CONFIG"  # path of a TOML file with [broker], [worker], [gateway] tables
# the config file's tables: one per settings section that reads it (a table named otherwise is
# a typo, e.g. [workers], refused rather than silently ignored)
SECTIONS = ("broker", "worker", "gateway", "autoscale")
DEFAULT = "default"


# TOKENYARD_* variables that are not settings of a section, read where they are used (the CLI,
# the local serve's record, the tiny model's cache, what serve tells its workers)
OTHER_VARIABLES = (
    CONFIG_ENV,
    "TOKENYARD_DATA_DIR",
    "TOKENYARD_LOG_LEVEL",
    "TOKENYARD_LOG_FORMAT",
    "TOKENYARD_LOG_NAME",
    "TOKENYARD_FAILURE_FILE",
    "TOKENYARD_DEBUG",
    "TOKENYARD_API_KEY",
    "TOKENYARD_CACHE_DIR",
    # the test suite's (tests/): its servers and commands inherit them
    "TOKENYARD_RABBITMQ_BIN",
    "TOKENYARD_REQUIRE_TOOLS",
    "TOKENYARD_TEST_ARTEFACTS",
    "TOKENYARD_FAULTS_ACCEPTED_DIR",
)


def setting_variables(kinds: Mapping[str, type[msgspec.Struct]]) -> list[str]:
    """The variable of every setting of each section's kind, TOKENYARD_<SECTION>_<FIELD>."""
    return [
        f"TOKENYARD_{section.upper()}_{field.name.upper()}"
        for section, kind in kinds.items()
        for field in msgspec.structs.fields(kind)
    ]


def unknown_variables(
    environ: Mapping[str, str], known: Collection[str]
) -> list[tuple[str, str | None]]:
    """Each TOKENYARD_* variable in `environ` that nothing reads (a misspelt setting would be
    ignored in silence), with the known name nearest to it, if one is near."""
    return [
        (name, next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.8)), None))
        for name in sorted(environ)
        if name.startswith("TOKENYARD_") and name not in known
    ]


def setting_sources(
    kind: type[msgspec.Struct],
    section: str,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> dict[str, tuple[Any, str]]:
    """Each setting given anywhere, with where it came from: flag > env > file (> default).

    Sources read "flag", the variable's name, or "file <path>"; an unknown key in the file, or
    a file that cannot be read, fails fast naming it.
    """
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in msgspec.structs.fields(kind)}
    found: dict[str, tuple[Any, str]] = {}
    path = environ.get(CONFIG_ENV)
    if path:
        table = _config_file(path).get(section, {})
        if not isinstance(table, dict):
            raise FatalError(f"{path}: [{section}] must be a table")
        for key, value in table.items():
            if key not in fields:
                raise FatalError(
                    f"{path}: unknown setting {key!r} in [{section}]; known: {', '.join(fields)}"
                )
            found[key] = (value, f"file {path}")
    prefix = f"TOKENYARD_{section.upper()}_"
    for name, field in fields.items():
        raw = environ.get(prefix + name.upper())
        if raw is not None:
            # a tuple setting (the gateway's models) is a comma-separated list in a variable
            parsed: Any = raw
            if isinstance(field.default, tuple):
                parsed = tuple(item.strip() for item in raw.split(",") if item.strip())
            found[name] = (parsed, prefix + name.upper())
    for name, given in overrides.items():
        if given is not None:
            found[name] = (given, "flag")
    return found


def _config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            found = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise FatalError(f"cannot read the config file {path} ({CONFIG_ENV}): {exc}") from exc
    unknown = [name for name in found if name not in SECTIONS]
    if unknown:
        known = ", ".join(f"[{name}]" for name in SECTIONS)
        raise FatalError(f"{path}: unknown table [{unknown[0]}]; known: {known}")
    return found


def from_env(
    kind: type[_S], section: str, environ: Mapping[str, str] | None = None, **overrides: Any
) -> _S:
    """Build settings from defaults, the TOML file, the environment, then explicit overrides
    (flags); fail fast, naming the setting and where its bad value came from."""
    sources = setting_sources(kind, section, environ, **overrides)
    try:
        return msgspec.convert({k: v for k, (v, _) in sources.items()}, kind, strict=False)
    except msgspec.ValidationError as exc:
        match = re.search(r"at `\$\.(\w+)", str(exc))
        if match and match.group(1) in sources:
            key = match.group(1)
            value, source = sources[key]
            raise FatalError(
                f"invalid {section} setting {key} = {value!r} (from {source}): {exc}"
            ) from exc
        raise FatalError(f"invalid {section} settings: {exc}") from exc


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How a worker claims, batches and drains, and the engine it runs (`engines.build_engine`)."""

    # a local model directory, a Hugging Face hub id (`org/name`: through huggingface_hub's
    # cache, engines/models.py) or `tiny`
    model: str = "tiny"
    # the names it is served under (vLLM's --served-model-name): the first keys its lanes and
    # limits, and is the name the gateways must serve; empty: the model as named
    served_model_name: tuple[str, ...] = ()
    revision: str | None = None  # a hub id's branch, tag or commit; None: main
    # auto (vllm where it is installed and supports the model, else hf: engines/auto.py) | hf |
    # hf-static | hf-embed | sim | vllm | remote
    engine: str = "auto"
    # LoRA adapters served on this model, `NAME=PATH` each (vLLM's --lora-modules): a request
    # naming NAME runs the model with the PEFT adapter at PATH (hf: loaded when first needed;
    # vllm: enable_lora; remote: NAME is passed upstream as the model). Adapters added by
    # `POST /admin/loras` load from the path the job carries
    loras: tuple[str, ...] = ()
    max_loras: Count = 4  # adapters resident at once (least recently used evicted)
    # Capacity: None takes the engine's own, sized from the device (KV cache memory on CUDA).
    max_seqs: Count | None = None  # sequences running at once
    token_budget: Count | None = None  # prompt + max_tokens over running sequences
    claim_ahead: NonNegative | None = (
        None  # jobs claimed beyond free slots; None: max_seqs // 8, >= 1
    )
    # share of the slots batch-lane jobs may hold (Files + Batches API); the rest stays free
    # for interactive work, which joins the running batch at the next step
    batch_share: Fraction = 0.5
    claim_block_s: SecondsOrZero = 0.5
    # Preemption (worker/scheduler.py, `preemption_victims`): with every slot taken and a job
    # waiting in a higher-priority lane, the running sequence of the lowest of these lanes is
    # handed back (it resumes later from its streamed tokens; BrokerSettings.max_preemptions
    # bounds it per job). Comma-separated of normal, low, batch (high never: interactive work
    # is not preempted); empty: off
    preempt_lanes: str = "normal,low,batch"
    # a higher-priority job waiting in the broker (not yet claimed by any worker) this long
    # means every worker's slots are taken: then a full worker preempts for it. Polled this
    # often, only while this worker is full and runs something preemptible
    preempt_after_s: SecondsOrZero = 0.02
    # a job that outranks every running one (a high job among batch work) takes its first engine
    # step alone, the running sequences waiting that one step, so its first token is not held
    # behind a full batch's step: at most once per this many engine steps (worker/scheduler.py,
    # `Plan.alone`), so the batch keeps at least (n - 1) / n of the steps. 0: off
    alone_step_every: NonNegative = 8
    # while a lane above one that runs had a job claimed within prefill_cap_window_s, an engine
    # step prefills at most this many prompt tokens of sequences not taking a step alone, so
    # the next such job waits for a short step, not a long prompt's whole prefill
    # (worker/scheduler.py, `step_prefill_cap`; the sim engine splits its prefills, hf and the
    # engines whose runtime schedules keep their own budget). 0: off. On by default: behind a
    # refill's 1,000-token prompt a high job's TTFT p50 fell 23 -> 17 ms in bench.preemption
    # (the sim's 2.6 ms of prefill a step against 20 ms), for no throughput it could measure
    prefill_cap_tokens: NonNegative = 128
    prefill_cap_window_s: SecondsOrZero = 1.0
    heartbeat_s: Seconds = 2.0
    # a stats line (running, waiting, tokens/s, KV use) this often at INFO, as vLLM's; 0: off.
    # Logged at a heartbeat, so at most heartbeat_s late
    log_stats_s: SecondsOrZero = 10.0
    drain_timeout_s: SecondsOrZero = 30.0
    metrics_port: Port | None = None  # serve this worker's Prometheus metrics on it (0/None: off)
    device: str = "auto"  # auto (cuda when there is one) | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 CUDA, fp32 CPU
    threads: Count | None = None  # torch CPU threads; None keeps torch's default
    engine_process: bool = False  # run the engine in its own process, off the worker's GIL
    max_batch_tokens: Count | None = None  # hf: tokens per forward pass; None: from the device
    kv_cache_memory_fraction: Fraction | None = None  # hf: of free memory; None: 0.8 CUDA, 0.25 CPU
    cuda_graphs: bool = True  # hf on CUDA: capture the forward passes as CUDA graphs
    warmup: bool = True  # hf: one short request, and on CUDA every batch size's graph, at start
    # what identifies the served weights in the response cache's key; None: the engine's own
    # (hf: a fingerprint of the model directory and the dtype; other engines: their name)
    model_revision: str | None = None
    # sim engine: tokens of its LRU prefix cache (a cached prefix costs nothing to prefill); 0: off
    sim_prefix_cache_tokens: int = 0
    # sim engine's cost model, in seconds: a prefill costs base + per_token·tokens, a decode
    # step base + per_seq·batch; None keeps the engine's own (engines/sim.py)
    sim_prefill_base_s: SecondsOrZero | None = None
    sim_prefill_per_token_s: SecondsOrZero | None = None
    sim_decode_base_s: SecondsOrZero | None = None
    sim_decode_per_seq_s: SecondsOrZero | None = None
    # -- vllm engine (engine = "vllm"): passed to vLLM's AsyncEngineArgs; max_seqs and dtype
    # above become max_num_seqs and dtype, None keeps vLLM's own default
    vllm_max_model_len: int | None = None
    vllm_max_num_batched_tokens: int | None = None
    vllm_gpu_memory_utilization: float | None = None
    vllm_quantization: str | None = None
    vllm_speculative_config: str | None = None  # JSON object, as vllm's --speculative-config
    vllm_enable_prefix_caching: bool | None = None
    vllm_tensor_parallel_size: Count = 1
    vllm_enforce_eager: bool = False
    vllm_args: str | None = None  # JSON object of any other AsyncEngineArgs field
    # -- remote engine (engine = "remote"): an OpenAI-compatible server that returns token ids
    remote_url: str = "http://127.0.0.1:8000"
    remote_model: str | None = None  # the upstream's model name; None: the first served name
    remote_concurrency: Count = 64  # streams held open at once: the engine's capacity
    remote_api_key: str | None = None
    remote_retries: NonNegative = (
        5  # on connection errors, 408/429 and 5xx, with exponential backoff
    )
    remote_timeout_s: Seconds = 600.0
