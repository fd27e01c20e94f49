"""The tables beside the queue core: small stores the gateway, workers and CLIs share.

Directory (keys, tenants), quotas, the audit trail, the response cache, the worker registry,
the batch store, stored responses (/v1/responses) and the dashboard's recorded series. A
backend may keep them on its own server (Redis) or beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import msgspec

from tokenyard.broker.audit import AuditEntry
from tokenyard.messages import AdapterRecord, BatchRecord, JobResult, JobSpec, JobStatus, WorkerInfo
from tokenyard.tenancy.limiter import Decision, Quota, QuotaState
from tokenyard.tenancy.records import ApiKeyRecord, TenantConfig


class ResponseStore(Protocol):
    """The response cache's shared tier: encoded results by digest, per model."""

    async def cache_get(self, model: str, digest: str) -> bytes | None: ...

    async def cache_put(
        self, model: str, digest: str, value: bytes, ttl_s: float, max_bytes: int
    ) -> None:
        """Store with a TTL; the model's entries stay under `max_bytes` (the soonest to expire
        are evicted first)."""
        ...


class StoredResponses(Protocol):
    """Stored responses (/v1/responses) by id: encoded records that lapse after a TTL. A new
    one is `pending` (its job's result not yet in it) until it is `settled`; a pending one is
    indexed by when it is next due for a look (`due`), so a sweep reads only the due ones, the
    earliest first, however many are pending.

    Beside the records, each response's part of its conversation (`put_part`): what it added to
    its predecessor's, read back by walking the parts, so a chain is stored once."""

    async def put(self, response_id: str, value: bytes, ttl_s: float, due_at: float) -> None:
        """Store a new record, then mark it pending, due at `due_at` (unix seconds)."""
        ...

    async def replace(self, response_id: str, value: bytes, ttl_s: float) -> bool:
        """Overwrite only a record that is still there (a deleted one stays deleted)."""
        ...

    async def get(self, response_id: str) -> bytes | None: ...

    async def delete(self, response_id: str) -> bool:
        """Remove the record (settling it); False when there was none."""
        ...

    async def due(self, now: float, limit: int) -> list[str]:
        """Up to `limit` ids of pending records due by `now`, the earliest due first."""
        ...

    async def defer(self, response_ids: Sequence[str], due_at: float) -> None:
        """Still pending: due again at `due_at` (an id settled meanwhile stays settled)."""
        ...

    async def settle(self, response_ids: Sequence[str]) -> None:
        """No longer pending: the result is in the record, or the record is gone."""
        ...

    async def put_part(self, response_id: str, value: bytes, ttl_s: float) -> None:
        """Store (or keep longer) a response's part of its conversation; deleting the record
        leaves it to the responses chained after it, until it lapses."""
        ...

    async def part(self, response_id: str) -> bytes | None: ...

    async def delete_part(self, response_id: str) -> None: ...


class WorkerRegistry(Protocol):
    """Live workers, by heartbeat; an operator may ask one to drain (`tokenyard drain`)."""

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> bool:
        """Register or refresh a worker; it counts as live for `ttl_s` seconds. True once an
        operator asked it to drain (`request_drain`)."""
        ...

    async def request_drain(self, model: str, consumer: str) -> bool:
        """Ask a live worker to drain, read by its next heartbeat; False when none of that
        name is live."""
        ...

    async def deregister(self, model: str, consumer: str) -> None: ...

    async def workers(self, model: str) -> list[WorkerInfo]:
        """Workers of a model whose heartbeat has not lapsed."""
        ...


class Directory(Protocol):
    """Tenants and API keys (by digest), shared by every gateway; written by `tokenyard keys`
    and `tokenyard tenants`."""

    async def put_tenant(self, tenant: TenantConfig) -> None: ...

    async def tenant(self, name: str) -> TenantConfig | None: ...

    async def tenants(self) -> list[TenantConfig]: ...

    async def put_api_key(self, record: ApiKeyRecord) -> None:
        """Store (or replace, e.g. to revoke) the record of the key with `record.digest`."""
        ...

    async def api_key(self, digest: str) -> ApiKeyRecord | None: ...

    async def api_keys(self) -> list[ApiKeyRecord]: ...

    async def put_adapter(self, record: AdapterRecord) -> None:
        """Add or replace a LoRA adapter (by name) served on its base model's workers."""
        ...

    async def adapters(self) -> list[AdapterRecord]: ...

    async def delete_adapter(self, name: str) -> bool: ...

    async def has_api_keys(self) -> bool:
        """Whether any key was ever stored (revoked ones count): then every call needs a key."""
        ...


class Settlement(msgspec.Struct, frozen=True):
    """A job of `tenant` reached a terminal state having used `actual` tokens (0: refunded),
    or (`request`) was never entered: then its request is given back too (requests/minute)."""

    tenant: str
    job_id: str
    actual: int = 0
    request: bool = False


def settlement(spec: JobSpec, result: JobResult | None) -> Settlement:
    """What a terminal job's quota reservation settles to: its real tokens when it succeeded;
    a failed, cancelled, expired or dead job is refunded."""
    actual = 0
    if result is not None and result.status is JobStatus.SUCCEEDED:
        prompt = result.prompt_tokens or len(spec.prompt_token_ids or ())
        actual = prompt + result.completion_tokens
    return Settlement(spec.tenant, spec.id, actual)


class Quotas(Protocol):
    """Per-tenant quotas, exact across gateways: reserved at admission, settled once per job
    at its terminal state (complete, dead, cancel settle themselves; `settle_finished` catches
    the rest: expired at claim, a crash between a terminal write and its settle)."""

    async def reserve(
        self, tenant: str, quota: Quota, items: Sequence[tuple[str, int]]
    ) -> list[Decision]:
        """Decide each (job id, tokens) in order, atomically; admitted ones are held."""
        ...

    async def settle(self, items: Sequence[Settlement]) -> int:
        """Release held reservations; idempotent per job. Returns how many were released."""
        ...

    async def settle_finished(self, grace_s: float = 30.0) -> int:
        """Settle held jobs that are terminal, or have no record `grace_s` after reserving
        (their enqueue never landed). Returns how many were released."""
        ...

    async def usage(self, tenant: str) -> QuotaState | None:
        """The tenant's limiter state as every gateway sees it (None: never reserved), for the
        dashboard's budget left."""
        ...


class AuditQuery(NamedTuple):
    """A read of the audit trail (`Audit.audit_entries`)."""

    since: float
    tenant: str | None
    model: str | None
    cursor: str | None
    most: int  # entries read past the cursor at most (`count`)


class Audit(Protocol):
    """The audit trail (tokenyard/broker/audit.py): every job's receipt and terminal state, bounded
    by `BrokerSettings.audit_max_len`; written by enqueue and the terminal paths themselves."""

    async def audit_entries(
        self,
        since: float,
        tenant: str | None = None,
        model: str | None = None,
        cursor: str | None = None,
        count: int = 1000,
    ) -> tuple[str | None, list[AuditEntry]]:
        """Entries written at or after `since` (unix s) matching the filters, oldest first,
        from at most `count` read past `cursor`; the next cursor, None at the end."""
        return await self.read_audit(AuditQuery(since, tenant, model, cursor, count))

    async def read_audit(self, query: AuditQuery) -> tuple[str | None, list[AuditEntry]]:
        """`audit_entries`, as each trail reads its store."""
        ...


@dataclass
class BatchState:
    record: BatchRecord
    cancel_requested: bool
    completed: int
    failed: int


class BatchStore(Protocol):
    async def create(self, record: BatchRecord) -> None: ...

    async def get(self, batch_id: str) -> BatchState | None: ...

    async def save(self, record: BatchRecord) -> None:
        """Overwrite the record (the runner holding the lease); terminal ones leave `active`."""
        ...

    async def request_cancel(self, batch_id: str) -> None: ...

    async def active(self) -> list[str]: ...

    async def list_ids(self, tenant: str) -> list[str]:
        """The tenant's batch ids, newest first."""
        ...

    async def acquire(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        """Take or renew the runner lease; False while another owner holds it."""
        ...

    async def release(self, batch_id: str, owner: str) -> None: ...

    async def set_jobs(self, batch_id: str, jobs: Mapping[int, str]) -> None: ...

    async def jobs(self, batch_id: str) -> dict[int, str]: ...

    async def add_outcomes(
        self, batch_id: str, ok: Sequence[int], failed: Sequence[int]
    ) -> None: ...

    async def outcomes(self, batch_id: str) -> tuple[set[int], set[int]]: ...


# how long the dashboard's series are kept: an hour, and the window its rates need before it
SERIES_KEEP_S = 3600.0 + 300.0


class Series(Protocol):
    """The dashboard's recorded series: each gateway appends its own points under its own
    `source` (so none is counted twice), and every gateway reads every source's. A point is
    kept at least `keep_s` (the table's; SERIES_KEEP_S unless a test asks for less)."""

    async def append(self, source: str, at: float, value: bytes) -> None:
        """Add one point taken at `at` (unix s) and let those past the retention go."""
        ...

    async def since(self, at: float) -> list[tuple[str, float, bytes]]:
        """(source, taken at, value) of the points taken after `at`, oldest first (by the
        order they were stored; sources' clocks may differ a little)."""
        ...
