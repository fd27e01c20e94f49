"""Every stream, subject, consumer and KV key of the NATS backend, built (and parsed) here only.

A prefix (`BrokerSettings.prefix`) starts each name, so brokers sharing one server stay apart.
Names from outside (tenants, workers, idempotency and prefix keys) become hex digests: subjects
and KV keys allow only a few characters.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable

from tokenyard.broker.ids import model_tag, tag_of_job
from tokenyard.messages import Priority

_SAFE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


@functools.lru_cache(maxsize=4096)
def token(name: str) -> str:
    """A subject- and key-safe stand-in for any name: the name itself when it is safe ('n'
    before it), else a digest ('h'), so two names never share a token."""
    if _SAFE.fullmatch(name):
        return f"n{name}"
    return "h" + hashlib.blake2s(name.encode(), digest_size=8).hexdigest()


def _job_token(job_id: str) -> str:
    """A job id as a subject token: itself (the gateway's ids are safe), else a digest."""
    if _SAFE_ID.fullmatch(job_id):
        return job_id
    return "h" + hashlib.blake2s(job_id.encode(), digest_size=12).hexdigest()


class _Key:
    """A family of KV keys, `<first>.<token of a name>`; `all` matches each of them."""

    def __init__(self, first: str) -> None:
        self.first = first
        self.all = f"{first}.*"

    def __call__(self, name: str) -> str:
        return f"{self.first}.{token(name)}"


class _ModelKey:
    """A KV key per model, `<first>.<model tag>`."""

    def __init__(self, first: str) -> None:
        self.first = first

    def __call__(self, model: str) -> str:
        return f"{self.first}.{model_tag(model)}"


class _Stream:
    """A stream, `<prefix>_<name>`, over the subjects below `<prefix>.<first>`; calling it
    names the subject of one job or model (`tail` turns that name into a subject token)."""

    def __init__(
        self, prefix: str, name: str, first: str, tail: Callable[[str], str] = str
    ) -> None:
        self.stream = f"{prefix}_{name}"
        self.subject = f"{prefix}.{first}"  # a stream of one subject publishes to this one
        self.subjects = f"{self.subject}.>"
        self._tail = tail

    def __call__(self, name: str) -> str:
        return f"{self.subject}.{self._tail(name)}"


class Names:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.events = _Stream(prefix, "events", "ev")  # per job; a job id is subject-safe
        self.dead = _Stream(prefix, "dead", "dead", model_tag)  # dead letters, per model
        # the dashboard's recorded points, every gateway's (nats/series.py)
        self.series = _Stream(prefix, "series", "series")
        self.audit = _Stream(prefix, "audit", "audit")

    # -- lanes: one work-queue stream per (model, priority, size pool) --------------------
    def lane_stream(self, model: str, priority: Priority, pool: int) -> str:
        return f"{self.prefix}_lane_{model_tag(model)}_{int(priority)}_{pool}"

    def _lane(self, model: str, priority: Priority, pool: int) -> str:
        """The lane's subjects start with this; `stream_of_subject` reads it back."""
        return f"{self.prefix}.lane.{model_tag(model)}.{int(priority)}.{pool}"

    def lane_subjects(self, model: str, priority: Priority, pool: int) -> str:
        return f"{self._lane(model, priority, pool)}.>"

    def tenant_subject(self, model: str, priority: Priority, pool: int, tenant: str) -> str:
        """A tenant's share of a lane: fair share picks among these subjects (each job's
        message goes on one below it, `job_subject`)."""
        return f"{self._lane(model, priority, pool)}.t.{token(tenant)}"

    def held_subject(self, model: str, priority: Priority, pool: int, worker: str) -> str:
        """Jobs held for one worker (prefix affinity)."""
        return f"{self._lane(model, priority, pool)}.a.{token(worker)}"

    @staticmethod
    def job_subject(lane_subject: str, job_id: str) -> str:
        """The subject of one job's message on a tenant's or a held subject: a queued job has
        no record, its message is read by id (`waiting_job`), a direct get by subject."""
        return f"{lane_subject}.{_job_token(job_id)}"

    @staticmethod
    def lane_subject_of(subject: str) -> str:
        """The tenant's or held subject a job's message is on (other subjects as they are):
        `<prefix>.lane.<tag>.<priority>.<pool>.<t|a>.<token>`, the job's token after it."""
        if subject.count(".") > 6:
            return subject[: subject.rfind(".")]
        return subject

    @staticmethod
    def subject_kind(subject: str) -> tuple[str, str]:
        """('t', tenant token) or ('a', worker token) of a lane subject (or a job's below it)."""
        parts = subject.split(".")
        return parts[5], parts[6]

    def stream_of_subject(self, subject: str) -> str:
        """The lane stream a lane subject (or a job's below it) belongs to."""
        _, _, tag, priority, pool = subject.split(".")[:5]
        return f"{self.prefix}_lane_{tag}_{priority}_{pool}"

    def waiting_places(self, job_id: str, pool_count: int) -> list[tuple[str, str]]:
        """(lane stream, subject pattern) of each lane a job's message could wait in: every
        priority and pool of its model (its id names the model), any tenant or holder."""
        tag = tag_of_job(job_id)
        return [
            (
                f"{self.prefix}_lane_{tag}_{int(p)}_{pool}",
                f"{self.prefix}.lane.{tag}.{int(p)}.{pool}.*.*.{_job_token(job_id)}",
            )
            for p in Priority
            for pool in range(pool_count)
        ]

    @staticmethod
    def consumer(subject: str) -> str:
        """The durable pull consumer that serves one lane subject (the jobs' subjects below
        it: its filter is `<subject>.*`)."""
        kind, tok = Names.subject_kind(subject)
        return f"{kind}{tok}"

    # -- wake-ups (the streams: `events`, `dead`, `series`, `audit`, set in __init__) -------
    def wake(self, model: str) -> str:
        """Core subject (no stream): enqueues ping it so blocked claims look again."""
        return f"{self.prefix}.wake.{model_tag(model)}"

    # -- KV buckets and keys ---------------------------------------------------------------
    @property
    def jobs_bucket(self) -> str:
        """Job records (key: the job id), idempotency and collapse keys, prefix owners."""
        return f"{self.prefix}_jobs"

    @staticmethod
    def job(job_id: str) -> str:
        tag_of_job(job_id)  # refuses a malformed id before it reaches the server
        return f"j.{job_id}"

    @staticmethod
    def idempotency(model: str, tenant: str, key: str) -> str:
        return f"i.{model_tag(model)}.{token(tenant)}.{token(key)}"

    @staticmethod
    def collapse(model: str, key: str) -> str:
        return f"c.{model_tag(model)}.{token(key)}"

    @staticmethod
    def prefix_owner(model: str, prefix_key: str) -> str:
        return f"p.{model_tag(model)}.{token(prefix_key)}"

    @staticmethod
    def counter(model: str, name: str) -> str:
        return f"n.{model_tag(model)}.{name}"

    live = _ModelKey("l")  # a model's workers by when their liveness lapses (beat, reap)
    delayed = _ModelKey("d")  # jobs waiting out a retry backoff
    cancels = _ModelKey("x")  # running jobs a client asked to cancel

    @property
    def models_key(self) -> str:
        return "models"

    @property
    def tables_bucket(self) -> str:
        """The tables: directory, quotas, response cache, registry, batches, model list."""
        return f"{self.prefix}_tables"

    # -- keys of the tables bucket: each table under its own first token --------------------
    tenant = _Key("d.t")
    api_key = _Key("d.k")  # by the key's digest
    adapter = _Key("d.a")
    quota = _Key("q")  # a tenant's quota state and the jobs it holds reservations for
    ALL_TENANTS, ALL_API_KEYS, ALL_ADAPTERS, ALL_QUOTAS = (
        tenant.all,
        api_key.all,
        adapter.all,
        quota.all,
    )

    @staticmethod
    def cache_slot(digest: str) -> str:
        """A cache entry's name within its model (the index keeps these, short)."""
        return token(digest)

    @staticmethod
    def cache_entry(model: str, slot: str) -> str:
        return f"r.{model_tag(model)}.{slot}"

    # a stored response's record (/v1/responses), with its retention as the entry's TTL
    stored_response = _Key("resp")
    # marks a stored response whose job's result is not yet in it: its id, when it is due for
    # a look and when its record lapses
    pending_response = _Key("resp.p")
    PENDING_RESPONSES = pending_response.all
    # a stored response's part of its conversation, with its retention as the TTL
    response_part = _Key("resp.c")
    cache_index = _ModelKey("ri")  # a model's cache entries by digest: expiry, size
    workers = _ModelKey("w")  # a model's live workers, each with when its heartbeat lapses

    @staticmethod
    def batch(batch_id: str, part: str = "") -> str:
        """A batch's record; `part`: x (cancel asked), l (runner lease), o (outcomes)."""
        return f"b.{token(batch_id)}.{part}" if part else f"b.{token(batch_id)}"

    @staticmethod
    def batch_jobs(batch_id: str, first_line: int | None = None) -> str:
        """One `set_jobs` call's job ids, by its first line; None: the pattern of them all."""
        return f"b.{token(batch_id)}.j.{'*' if first_line is None else first_line}"

    tenant_batches = _Key("bt")

    ACTIVE_BATCHES = "ba"

    @staticmethod
    def kv_stream(bucket: str) -> str:
        """The stream behind a KV bucket (nats-py's and the server's convention)."""
        return f"KV_{bucket}"

    @staticmethod
    def kv_subject(bucket: str, key: str) -> str:
        return f"$KV.{bucket}.{key}"
