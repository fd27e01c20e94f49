"""Every Redis key name, in one place.

All keys of one model share a `{hash tag}` so a model's scripts run on one Redis Cluster slot.
Job ids start with that tag (tokenyard/broker/ids.py), so any key of a job is derived from its
id alone.
"""

from __future__ import annotations

from tokenyard.broker.ids import model_tag, tag_of_job
from tokenyard.messages import Priority

GROUP = "workers"


class _OfLane:
    """A key hanging off a lane's name: `<lane><suffix>`, in the lane's slot."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def __call__(self, lane: str) -> str:
        return lane + self.suffix


class Keys:
    """Key builder for one prefix."""

    def __init__(self, prefix: str = "ty") -> None:
        self.prefix = prefix

    def _model(self, tag: str) -> str:
        return f"{self.prefix}:{{{tag}}}"

    def lane(self, model: str, priority: Priority, pool: int = 0) -> str:
        # pool 0 keeps the name lanes had before size pools
        tail = f":p{pool}" if pool else ""
        return f"{self._model(model_tag(model))}:lane:{priority.name.lower()}{tail}"

    # -- keys hanging off a lane's name (in its slot), which the Lua scripts build as well
    fair = _OfLane(":fair")  # hash of a lane's fair-share state (see lua/lib/fair.lua)
    fair_active = _OfLane(":active")  # sorted set of its tenants with staged jobs, by start tag
    # prefix of a lane's per-tenant staging sets; scripts append the tenant name
    tenant_queue_prefix = _OfLane(":tq:")
    # RabbitMQ lanes (broker/amqp/): the lane lives in RabbitMQ, its bookkeeping here
    waiting = _OfLane(":waiting")  # sorted set of its queued jobs by when they started waiting
    leases = _OfLane(":leases")  # sorted set of its running jobs by when their lease runs out
    # sorted set of its jobs admitted to be published after their records (a key names them,
    # or a worker holds them) whose publish is not confirmed yet, by when they were admitted
    unpublished = _OfLane(":unpub")
    # prefix affinity (broker/policy.py): every key hangs off the lane or the model tag
    affinity_held = _OfLane(":affq")  # sorted set of jobs held for a preferred worker, by when
    # prefix of a lane's per-worker held sets; scripts append the consumer name
    affinity_worker_prefix = _OfLane(":affw:")
    # stream holding the leases of a lane's jobs taken as affinity work (claim adds an entry
    # and reads it at once, so it never holds undelivered entries)
    affinity_stream = _OfLane(":aff")

    @classmethod
    def affinity_worker(cls, lane: str, consumer: str) -> str:
        return cls.affinity_worker_prefix(lane) + consumer

    def prefix_owner_prefix(self, model: str) -> str:
        """Prefix of `prefix key -> worker that last claimed it` keys (with a TTL)."""
        return f"{self._model(model_tag(model))}:pfx:"

    def wake_prefix(self, model: str) -> str:
        """Prefix of the workers' wake-up streams: enqueue adds to one when it holds a job for
        that worker, whose blocking wait reads it; scripts append the consumer name."""
        return f"{self._model(model_tag(model))}:wake:"

    def wake(self, model: str, consumer: str) -> str:
        return self.wake_prefix(model) + consumer

    def lanes(self, model: str, pools: int = 1) -> list[str]:
        """Lane streams of a model, highest priority first, each priority's pools in order."""
        return [self.lane(model, p, pool) for p in Priority for pool in range(pools)]

    def job_prefix(self, model: str) -> str:
        """Prefix of the job records of a model; Lua scripts append job ids to it."""
        return f"{self._model(model_tag(model))}:job:"

    def events_prefix(self, model: str) -> str:
        return f"{self._model(model_tag(model))}:ev:"

    def job(self, job_id: str) -> str:
        return f"{self._model(tag_of_job(job_id))}:job:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self._model(tag_of_job(job_id))}:ev:{job_id}"

    def cancels_of_job(self, job_id: str) -> str:
        return f"{self._model(tag_of_job(job_id))}:cancels"

    def delayed_of_job(self, job_id: str) -> str:
        return f"{self._model(tag_of_job(job_id))}:delayed"

    def idempotency(self, model: str, tenant: str, key: str) -> str:
        return f"{self._model(model_tag(model))}:idem:{tenant}:{key}"

    def inflight(self, model: str, collapse_key: str) -> str:
        """The job an identical deterministic request in flight runs as (collapsing)."""
        return f"{self._model(model_tag(model))}:inflight:{collapse_key}"

    def cache_prefix(self, model: str) -> str:
        """Prefix of a model's response cache entries; the put script appends digests."""
        return f"{self._model(model_tag(model))}:cache:"

    def cache(self, model: str, digest: str) -> str:
        return self.cache_prefix(model) + digest

    def stored_response(self, response_id: str) -> str:
        """A stored response's record (/v1/responses), with its retention as TTL."""
        return f"{self.prefix}:resp:{response_id}"

    def pending_responses(self) -> str:
        """Sorted set of the stored responses whose job's result is not yet in them, scored by
        when each is next due for a look (unix ms); a new name, as the set it replaced (a plain
        set under `resp-pending`) would be the wrong type."""
        return f"{self.prefix}:resp-due"

    def response_part(self, response_id: str) -> str:
        """A stored response's part of its conversation, with its retention as TTL."""
        return f"{self.prefix}:resp-part:{response_id}"

    def cache_index(self, model: str) -> str:
        """Sorted set of a model's cache digests, scored by when each entry expires."""
        return f"{self._model(model_tag(model))}:cacheidx"

    def cache_sizes(self, model: str) -> str:
        """Hash digest -> bytes of each cache entry; the total lives in `counters`."""
        return f"{self._model(model_tag(model))}:cachesz"

    def delayed(self, model: str) -> str:
        return f"{self._model(model_tag(model))}:delayed"

    def cancels(self, model: str) -> str:
        return f"{self._model(model_tag(model))}:cancels"

    def dead_letters(self, model: str) -> str:
        return f"{self._model(model_tag(model))}:dlq"

    def counters(self, model: str) -> str:
        return f"{self._model(model_tag(model))}:counters"

    def workers(self, model: str) -> str:
        """Sorted set of a model's workers, scored by when their heartbeat lapses."""
        return f"{self._model(model_tag(model))}:workers"

    def live(self, model: str) -> str:
        """Sorted set of a model's workers, scored by when their liveness lapses (`beat`);
        only a reap that took a lapsed one's jobs over removes it."""
        return f"{self._model(model_tag(model))}:live"

    def worker(self, model: str, consumer: str) -> str:
        return f"{self._model(model_tag(model))}:worker:{consumer}"

    def drain(self, model: str, consumer: str) -> str:
        """Set while an operator's request that this worker drain waits for its heartbeat."""
        return f"{self._model(model_tag(model))}:drain:{consumer}"

    def series(self) -> str:
        """The dashboard's recorded points, every gateway's, in one stream trimmed by time
        (MINID), under its own hash tag."""
        return f"{self.prefix}:{{series}}:stream"

    def audit(self) -> str:
        """The audit stream (receipts and terminal states): its own hash tag, written in the
        same pipelined round trip as the state change it records (tokenyard/broker/audit.py)."""
        return f"{self.prefix}:{{audit}}:stream"

    def models(self) -> str:
        """Set of models that ever had a job; lets `status` list lanes without SCAN."""
        return f"{self.prefix}:models"

    def _tenant(self, tenant: str) -> str:
        # its own tag: a tenant's quota is shared by all models; the name may hold any character
        return f"{self.prefix}:{{t{model_tag(tenant)}}}"

    def quota(self, tenant: str) -> str:
        """Hash of a tenant's limiter state: rpm_tat, tpm_tat, active."""
        return f"{self._tenant(tenant)}:quota"

    def quota_held(self, tenant: str) -> str:
        """Hash of a tenant's jobs holding a reservation: job id -> tokens|per token|at."""
        return f"{self._tenant(tenant)}:held"

    def quota_tenants(self) -> str:
        """Set of tenants that ever reserved, for the settle sweep."""
        return f"{self.prefix}:quota-tenants"

    def tenants(self) -> str:
        """Hash of tenant name -> TenantConfig; one small key, read through gateway caches."""
        return f"{self.prefix}:{{directory}}:tenants"

    def adapters(self) -> str:
        """Hash of LoRA adapter name -> AdapterRecord."""
        return f"{self.prefix}:{{directory}}:adapters"

    def api_keys(self) -> str:
        """Hash of key digest -> ApiKeyRecord."""
        return f"{self.prefix}:{{directory}}:apikeys"

    # -- offline batches (redis/batches.py): a batch's keys share its own {tag} -------------
    def batch(self, batch_id: str, part: str) -> str:
        """A batch's keys: `rec` (hash: record, cancel flag), `jobs`, `ok`, `failed`, `lease`."""
        return f"{self.prefix}:{{{batch_id}}}:{part}"

    def tenant_batches(self, tenant: str) -> str:
        """Sorted set of a tenant's batch ids by creation time (the list endpoint)."""
        return f"{self._tenant(tenant)}:batches"

    def active_batches(self) -> str:
        """Set of batches not yet terminal: what runners look for work in."""
        return f"{self.prefix}:batches:active"
