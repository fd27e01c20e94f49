"""Gateway settings: where it listens, which models it serves, and the limits it enforces."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from tokenyard.config import Count, NonNegative, Port, Seconds, SecondsOrZero, from_env


class GatewaySettings(msgspec.Struct, frozen=True, kw_only=True):
    """Each field can be set by TOKENYARD_GATEWAY_<FIELD>; lists are comma-separated there."""

    host: str = "127.0.0.1"
    port: Port = 8000
    # what the workers load (a directory, a hub id `org/name`, `tiny`): each model's tokenizer
    # is loaded from it, and it is served under its own name unless named below
    models: tuple[str, ...] = ("tiny",)
    # the names of the one model above (vLLM's --served-model-name): the first is its name on
    # the lanes and in answers, the others are aliases of it; all are listed by /v1/models
    served_model_name: tuple[str, ...] = ()
    revision: str | None = None  # the hub revision of the one model above; None: main
    tokenizer: Literal["hf", "sim"] = "hf"  # which tokenizer family the workers' engines use
    max_body_bytes: Count = 1 << 20
    max_tokens_cap: Count = 4096  # a request asking for more is refused, not clamped
    max_n: Count = 16  # choices one completions call may ask for (`n`): a job each
    # prompts one /v1/completions call may batch (`prompt` as a list): a job each (times n)
    max_prompts: Count = 64
    # a chat request may bring its own `chat_template` (vLLM's --trust-request-chat-template):
    # rendered in the gateway (transformers' sandboxed jinja), so off unless the clients are
    # trusted with the gateway's time; off, such a request is 400
    trust_request_chat_template: bool = False
    default_max_tokens: Count = 256  # chat requests without max_tokens (completions default 16)
    # how a chat answer's tool calls are read (vLLM's --tool-call-parser names): hermes,
    # llama3_json, mistral, or auto (the one each model's chat template shows)
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    # how a chat answer's reasoning is split from its content (vLLM's --reasoning-parser
    # names): deepseek_r1 or qwen3; "" (the default): none, the thinking is content
    reasoning_parser: Literal["", "deepseek_r1", "qwen3"] = ""
    request_timeout_s: Seconds = 600.0  # sync and streaming calls: queue wait + generation
    stream_resume_grace_s: float = 0.0  # how long a dropped stream's job waits for a reconnect
    # longest single wait on a job's events, and so the SSE keep-alive period; the broker caps
    # blocking reads well below its client's read timeout
    event_block_s: Seconds = 2.0
    # follows of a model's jobs share blocking reads; each holds a broker connection, and at most
    # this many are in flight per model, so enqueue and cancel still find a free connection
    max_blocking_reads: Count = 8
    limits_ttl_s: float = 1.0  # how long the limits workers publish are cached
    # POST /v1/completions, /v1/chat/completions and /v1/jobs answered without FastAPI's
    # routing and dependency injection (gateway/fast.py); false: through FastAPI, same answers
    fast_routes: bool = True
    retry_after_s: NonNegative = 1  # Retry-After on 429
    # overload shedding of interactive calls (sync and streamed completions and chat): one
    # without its own deadline is refused (429 + Retry-After) when its estimated queue wait
    # exceeds this many seconds, so a flood gets fast refusals instead of answers minutes late;
    # 0 = off. Jobs and batch lines are read later: they queue up to the lane bound, held only
    # to their own deadline (as is every request that carries one)
    queue_slo_s: SecondsOrZero = 30.0
    queue_wait_ttl_s: float = 0.25  # the lanes and workers behind the estimate: read this often
    # bootstrap keys, JSON {key: {"tenant": ..., "priority": ..., "admin": false}}; auth is on
    # when this file or the broker (`tokenyard keys create`) holds any key
    api_keys_file: str = ""
    # /openapi.json, /docs, /redoc and the /dashboard page (a shell: its data needs an admin
    # key) answer without an API key, so a browser can open them; false: they need a key too,
    # like every route but /healthz and /readyz
    docs_public: bool = True
    # the dashboard's memory: each gateway records a point this often into the broker (kept an
    # hour, whether or not anyone watches); 0: this gateway records none
    dashboard_interval_s: SecondsOrZero = 5.0
    auth_cache_s: float = 1.0  # key lookups are cached this long: a revoked key dies within it
    require_workers: bool = True  # /readyz needs a live worker for every served model
    # response cache and in-flight collapsing of deterministic (greedy or seeded) requests;
    # a request opts out with `"cache": false` or `Cache-Control: no-cache` / `no-store`
    cache: bool = True
    collapse: bool = True  # identical requests in flight join one job
    cache_shared: bool = False  # False: each tenant sees only its own cached answers
    cache_ttl_s: float = 3600.0
    cache_local_bytes: int = 64 << 20  # this gateway's in-process tier
    cache_shared_bytes: int = 256 << 20  # the Redis tier, per model
    # JSON routing rules (tokenyard/gateway/routing.py): {"aliases": {"gpt-4o-mini": "tiny"},
    # "fast_path": {"model": "small", "below_tokens": 256, "max_depth": 64}}; empty: none
    routing_file: str = ""
    # prefix affinity: a job's prefix key covers at most this many leading prompt tokens (a
    # chat request's system prompt), in whole 16-token blocks; 0: no keys, no affinity
    affinity_prefix_tokens: int = 1024
    # offline batches (/v1/files, /v1/batches); OpenAI's limits by default
    files_dir: str = ".tokenyard/files"  # the file store (uploads and batch outputs)
    batch_max_requests: Count = 50_000
    batch_max_file_bytes: Count = 200 * 1024 * 1024
    batch_max_in_flight: Count = 512  # jobs of one batch queued or running at once
    batch_poll_s: float = 0.05  # how often a runner looks at its batches' jobs
    batch_lease_s: float = 10.0  # a runner that stops renewing loses its batches after this
    batch_runner: bool = True  # this gateway drives batches (any gateway may)
    # what `completion_window: "24h"` lasts; shorter only for tests and drills of expiry
    batch_window_s: Seconds = 24 * 3600.0
    # stored responses (/v1/responses) whose job ended with no gateway watching (the one that
    # created it died) get their result copied in by any gateway's sweep, this often; 0: off
    responses_sweep_s: float = 30.0


class ServedModels(msgspec.Struct, frozen=True, kw_only=True):
    """What a gateway serves, from its settings: each model's name on the lanes, where its
    tokenizer loads from, and the other names a request may give it."""

    models: tuple[str, ...]  # the lanes' names: what answers carry and workers register under
    sources: dict[str, str]  # a model's name -> what its tokenizer loads (`models` setting)
    aliases: dict[str, str]  # another served name -> the model's name
    revision: str | None = None  # the hub revision of the sources

    @property
    def names(self) -> tuple[str, ...]:
        """Every name /v1/models lists: each model's, then the aliases its served names make."""
        return (*self.models, *self.aliases)


def served_models(settings: GatewaySettings) -> ServedModels:
    """The models `settings` serve under their names (engines/models.py `served_names`, the
    rule workers follow too); served names and a revision belong to one model, as in vLLM."""
    from tokenyard.engines.models import served_names
    from tokenyard.errors import FatalError

    if (settings.served_model_name or settings.revision) and len(settings.models) != 1:
        raise FatalError(
            "--served-model-name and --revision name one model; this gateway serves "
            f"{len(settings.models)}: {', '.join(settings.models)}"
        )
    if len(settings.models) != 1:
        return ServedModels(
            models=settings.models, sources={m: m for m in settings.models}, aliases={}
        )
    source = settings.models[0]
    first, *others = served_names(source, settings.served_model_name)
    return ServedModels(
        models=(first,),
        sources={first: source},
        aliases=dict.fromkeys(others, first),
        revision=settings.revision,
    )


def gateway_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> GatewaySettings:
    """Settings from defaults, environment and overrides; a comma list names several models."""
    raw_models = overrides.pop("models", None)
    if isinstance(raw_models, str):
        raw_models = tuple(m.strip() for m in raw_models.split(",") if m.strip())
    return from_env(GatewaySettings, "gateway", environ, models=raw_models, **overrides)
