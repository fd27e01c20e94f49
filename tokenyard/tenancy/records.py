"""What the broker stores about tenants and API keys (msgpack on the wire, like jobs)."""

from __future__ import annotations

import hashlib
import secrets

import msgspec

from tokenyard.messages import Priority
from tokenyard.tenancy.limiter import Quota

KEY_PREFIX = "ty-"
KEY_ID_CHARS = 12  # of the digest's hex: enough to name a key in a list, useless to call with


class TenantConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's tier: its default (and highest) priority, and whether it may see the fleet."""

    name: str
    priority: Priority = Priority.NORMAL
    admin: bool = False
    weight: float = 1.0  # share of a lane against other tenants' weights, by token cost
    quota: Quota = msgspec.field(default_factory=Quota)
    v: int = 1


class ApiKeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One API key, stored by the SHA-256 of the key: the key itself is shown once and kept
    nowhere."""

    digest: str
    tenant: str
    label: str = ""
    created_at: float
    revoked_at: float | None = None
    v: int = 1

    @property
    def key_id(self) -> str:
        return self.digest[:KEY_ID_CHARS]

    @property
    def active(self) -> bool:
        return self.revoked_at is None


def key_digest(key: str) -> str:
    """The stored form of a key; comparing digests leaks nothing about a key."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key(tenant: str, now: float, label: str = "") -> tuple[str, ApiKeyRecord]:
    """A fresh random key and the record to store for it."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, ApiKeyRecord(digest=key_digest(key), tenant=tenant, label=label, created_at=now)
