"""The gateway's key lookups: bootstrap file first, the broker's directory (a real Valkey)
cached for a TTL."""

from __future__ import annotations

import pytest

from tests.conftest import BackendFactory
from tokenyard.gateway.auth import DEFAULT_TENANT, Authenticator, KeyRing, Tenant
from tokenyard.gateway.errors import ApiError
from tokenyard.messages import Priority
from tokenyard.tenancy.admin import create_key, revoke_key
from tokenyard.tenancy.records import TenantConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def refused(auth: Authenticator, header: str | None) -> str | None:
    with pytest.raises(ApiError) as error:
        await auth.tenant_for(header)
    assert error.value.status == 401
    return error.value.code


async def test_auth_is_off_until_a_key_exists_then_keys_are_cached(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    clock = Clock()
    auth = Authenticator(KeyRing(), broker.directory, ttl_s=1.0, clock=clock)
    assert await auth.tenant_for(None) == DEFAULT_TENANT and DEFAULT_TENANT.admin

    await broker.directory.put_tenant(TenantConfig(name="acme", priority=Priority.HIGH))
    key, record = await create_key(broker.directory, "acme", now=1.0)
    assert await auth.tenant_for(None) == DEFAULT_TENANT  # the "no keys" answer is cached
    clock.now = 1.5
    assert await refused(auth, None) == "missing_api_key"
    assert await refused(auth, "Bearer ty-nope") == "invalid_api_key"
    assert await auth.tenant_for(f"Bearer {key}") == Tenant("acme", Priority.HIGH)

    # a revoked key and a changed tier are seen once the cached answer is older than the TTL
    await revoke_key(broker.directory, record.key_id, now=2.0)
    await broker.directory.put_tenant(TenantConfig(name="acme", priority=Priority.LOW))
    clock.now = 2.4
    assert await auth.tenant_for(f"Bearer {key}") == Tenant("acme", Priority.HIGH)
    clock.now = 2.6
    assert await refused(auth, f"Bearer {key}") == "invalid_api_key"


async def test_file_keys_come_first_and_a_key_without_tenant_config_gets_defaults(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    ring = KeyRing({"sk-root": Tenant("ops", admin=True)})
    auth = Authenticator(ring, broker.directory, ttl_s=1.0, clock=Clock())
    key, _ = await create_key(broker.directory, "bob", now=0.0)
    assert await auth.tenant_for("Bearer sk-root") == Tenant("ops", admin=True)
    assert await auth.tenant_for(f"Bearer {key}") == Tenant("bob", Priority.NORMAL, admin=False)
    assert await refused(auth, "Basic sk-root") == "missing_api_key"
