"""API keys → tenants with a priority tier; with no keys configured, everyone is "default"."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated

import msgspec
from fastapi import Depends, Request

from tokenyard.errors import FatalError
from tokenyard.gateway.errors import ApiError
from tokenyard.messages import Priority


class Tenant(msgspec.Struct, frozen=True):
    """Who is calling; `priority` is both their default lane and the highest they may ask for."""

    name: str
    priority: Priority = Priority.NORMAL

    def lane_priority(self, requested: Priority | None) -> Priority:
        """A request may lower its priority below the tier, never raise it above."""
        if requested is None:
            return self.priority
        return Priority(max(requested, self.priority))


DEFAULT_TENANT = Tenant("default")


class _KeyEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tenant: str
    priority: str = "normal"


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
            keys[key] = Tenant(entry.tenant, priority)
        return cls(keys)

    def tenant_for(self, authorization: str | None) -> Tenant:
        """The tenant of an Authorization header; 401 when keys are configured and it fails."""
        if not self.enabled:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>'",
                code="missing_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        tenant = self._tenants.get(_digest(key.strip()))
        if tenant is None:
            raise ApiError(
                401,
                "Incorrect API key provided",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant


def authenticate(request: Request) -> Tenant:
    """FastAPI dependency: the calling tenant."""
    keyring: KeyRing = request.app.state.gateway.keyring
    return keyring.tenant_for(request.headers.get("authorization"))


TenantDep = Annotated[Tenant, Depends(authenticate)]
