"""API keys → tenants with a priority tier; with no keys configured, everyone is "default".

Keys live in the broker's directory (`tokenyard keys create`), shared by every gateway, and
optionally in a bootstrap JSON file. Lookups are cached for `auth_cache_s`, so a revoked key
stops working on every gateway within that time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec
from fastapi import Depends, Request

from tokenyard.broker.tables import Directory
from tokenyard.errors import BrokerUnavailable, FatalError, InvalidRequest
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.instrument import current_access
from tokenyard.gateway.refresh import RefreshAhead
from tokenyard.messages import Priority
from tokenyard.tenancy.limiter import Quota
from tokenyard.tenancy.records import ApiKeyRecord, TenantConfig, key_digest


class Tenant(msgspec.Struct, frozen=True):
    """Who is calling; `priority` is both their default lane and the highest they may ask for."""

    name: str
    priority: Priority = Priority.NORMAL
    admin: bool = False  # may use fleet routes (/metrics, and AdminDep routes)
    quota: Quota = msgspec.field(default_factory=Quota)  # enforced at admission, fleet-wide
    weight: float = 1.0  # fair share of a lane against other tenants
    keyed: bool = True  # False: the caller of a gateway with no keys, who has no tier

    def lane_priority(self, requested: Priority | None) -> Priority:
        """A request may lower its priority below the tier, never raise it above; a caller
        without a key asking above `normal` is refused rather than quietly served at it."""
        if requested is None:
            return self.priority
        if requested < self.priority and not self.keyed:
            name = requested.name.lower()
            raise InvalidRequest(
                f"'priority': {name!r} needs an API key whose tenant's tier allows it "
                f"(tokenyard tenants set NAME --priority {name}; tokenyard keys create --tenant "
                f"NAME); without keys every request runs at "
                f"{self.priority.name.lower()!r} or lower",
                code="priority_not_allowed",
                param="priority",
            )
        return Priority(max(requested, self.priority))


# with auth off there is one caller, who owns the fleet
DEFAULT_TENANT = Tenant("default", admin=True, keyed=False)


class _KeyEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tenant: str
    priority: str = "normal"
    admin: bool = False


def _digest(key: str) -> bytes:
    # Keys are held and compared as digests, so the comparison leaks nothing about a key.
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Maps presented API keys to tenants."""

    def __init__(self, keys: dict[str, Tenant] | None = None) -> None:
        self._tenants = {_digest(k): t for k, t in (keys or {}).items()}

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    @classmethod
    def from_file(cls, path: str) -> KeyRing:
        """Load {"<key>": {"tenant": "acme", "priority": "high"}, ...}; fail fast when invalid."""
        if not path:
            return cls()
        try:
            raw = msgspec.json.decode(Path(path).read_bytes(), type=dict[str, _KeyEntry])
        except (OSError, msgspec.DecodeError) as exc:
            raise FatalError(f"cannot load API keys from {path}: {exc}") from exc
        keys: dict[str, Tenant] = {}
        for key, entry in raw.items():
            try:
                priority = Priority[entry.priority.upper()]
            except KeyError:
                raise FatalError(
                    f"{path}: tenant {entry.tenant!r} has unknown priority {entry.priority!r}"
                ) from None
            keys[key] = Tenant(entry.tenant, priority, entry.admin)
        return cls(keys)

    def lookup(self, key: str) -> Tenant | None:
        return self._tenants.get(_digest(key))

    def tenant_for(self, authorization: str | None) -> Tenant:
        """The tenant of an Authorization header; 401 when keys are configured and it fails."""
        if not self.enabled:
            return DEFAULT_TENANT
        tenant = self.lookup(bearer_key(authorization))
        if tenant is None:
            raise _invalid_key()
        return tenant


def bearer_key(authorization: str | None) -> str:
    """The key of an Authorization header; 401 missing_api_key when there is none."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return key.strip()


def _invalid_key() -> ApiError:
    return ApiError(
        401,
        "Incorrect API key provided",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


_MAX_CACHED = 10_000  # distinct keys remembered; past it the cache starts over


class Authenticator:
    """Bootstrap file keys first, then the broker's directory, each answer cached `ttl_s`
    (refreshed ahead of expiry, see `gateway/refresh.py`: no request waits on a lookup while
    the key is in use).

    Auth is on when the file has keys or the broker ever stored one; a broker that does not
    answer keeps the last known answers (and refuses unknown keys with 503)."""

    def __init__(
        self,
        keyring: KeyRing,
        directory: Directory,
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keyring = keyring
        self.directory = directory
        self.ever_enabled = False  # the broker said keys exist, at least once
        down = (BrokerUnavailable,)
        self._enabled = RefreshAhead(self._has_keys, ttl_s, clock, keep_on=down)
        self._keys: RefreshAhead[str, ApiKeyRecord | None] = RefreshAhead(
            directory.api_key, ttl_s, clock, keep_on=down, max_entries=_MAX_CACHED
        )
        self._configs: RefreshAhead[str, TenantConfig | None] = RefreshAhead(
            directory.tenant, ttl_s, clock, keep_on=down, max_entries=_MAX_CACHED
        )

    async def _has_keys(self, _: None) -> bool:
        on = await self.directory.has_api_keys()
        self.ever_enabled = self.ever_enabled or on
        return on

    async def enabled(self) -> bool:
        if self.keyring.enabled:
            return True
        return await self._enabled.get(None)

    async def tenant_for(self, authorization: str | None) -> Tenant:
        """The calling tenant; 401 when auth is on and the key is missing, unknown or revoked.
        The broker's tenant record, when there is one, decides tier, admin flag and quota;
        a file key's entry gives the defaults."""
        if not await self.enabled():
            return DEFAULT_TENANT
        key = bearer_key(authorization)
        tenant = self.keyring.lookup(key)
        if tenant is None:
            record = await self._keys.get(key_digest(key))
            if record is None or not record.active:
                raise _invalid_key()
            tenant = Tenant(record.tenant)
        config = await self._configs.get(tenant.name)
        if config is None:
            return tenant
        return Tenant(config.name, config.priority, config.admin, config.quota, config.weight)


def authorization(request: Request) -> str | None:
    """The request's credentials as an Authorization header: its own, else Anthropic's
    `x-api-key` header (what Anthropic's clients send) as a bearer key."""
    header = request.headers.get("authorization")
    if header is None:
        key = request.headers.get("x-api-key")
        if key is not None:
            return f"Bearer {key}"
    return header


async def authenticate(request: Request) -> Tenant:
    """FastAPI dependency: the calling tenant."""
    auth: Authenticator = request.app.state.gateway.auth
    tenant = await auth.tenant_for(authorization(request))
    access = current_access()
    if access is not None:
        access.tenant = tenant.name
    return tenant


TenantDep = Annotated[Tenant, Depends(authenticate)]
"""The one way a route learns its caller (scope its data by `Tenant.name`)."""


async def require_admin(tenant: TenantDep) -> Tenant:
    """FastAPI dependency: the calling tenant, which must be an admin (fleet routes)."""
    if not tenant.admin:
        raise ApiError(403, "This route needs an admin API key", code="admin_required")
    return tenant


AdminDep = Annotated[Tenant, Depends(require_admin)]


async def scrape_caller(request: Request) -> Tenant:
    """FastAPI dependency for /metrics: an admin, except while the broker is down and this
    gateway never learned whether keys exist (only the file could say) — a scrape must still
    report `broker_up 0` then. Once auth was seen on, it stays required."""
    auth: Authenticator = request.app.state.gateway.auth
    try:
        tenant = await auth.tenant_for(authorization(request))
    except BrokerUnavailable:
        if auth.keyring.enabled or auth.ever_enabled:
            raise
        return DEFAULT_TENANT
    return await require_admin(tenant)


ScrapeDep = Annotated[Tenant, Depends(scrape_caller)]
"""For fleet-wide routes (status, metrics, dashboards): 401 without a key, 403 for a tenant."""
