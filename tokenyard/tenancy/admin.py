"""Key and tenant administration over the broker's directory (the CLI's logic, testable)."""

from __future__ import annotations

from typing import Protocol

import msgspec

from tokenyard.tenancy.records import KEY_PREFIX, ApiKeyRecord, key_digest, new_api_key


class KeyStore(Protocol):
    """The part of the broker's directory that key administration uses (tenancy sits below
    the broker, so it names the role instead of importing it)."""

    async def put_api_key(self, record: ApiKeyRecord) -> None: ...

    async def api_key(self, digest: str) -> ApiKeyRecord | None: ...

    async def api_keys(self) -> list[ApiKeyRecord]: ...


async def create_key(
    directory: KeyStore, tenant: str, now: float, label: str = ""
) -> tuple[str, ApiKeyRecord]:
    """Store a new key of `tenant`; the returned plaintext key is not kept anywhere."""
    if not tenant.strip():
        raise ValueError("a key needs a tenant")
    key, record = new_api_key(tenant, now, label)
    await directory.put_api_key(record)
    return key, record


async def revoke_key(directory: KeyStore, which: str, now: float) -> ApiKeyRecord | None:
    """Revoke the key named by its id (a digest prefix, as `keys list` shows) or by the key
    itself; None when no single active key matches."""
    if which.startswith(KEY_PREFIX):
        record = await directory.api_key(key_digest(which))
        matches = [record] if record is not None else []
    else:
        matches = [r for r in await directory.api_keys() if which and r.digest.startswith(which)]
    active = [r for r in matches if r.active]
    if len(active) != 1:
        return None
    revoked = msgspec.structs.replace(active[0], revoked_at=now)
    await directory.put_api_key(revoked)
    return revoked
