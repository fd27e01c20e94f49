"""Uploaded files behind a small interface: a directory by default, S3-compatible later."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import msgspec


class FileObject(msgspec.Struct, kw_only=True):
    """OpenAI's file object, plus the owning tenant (never shown to clients)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    tenant: str

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


def new_file_id(seed: str | None = None) -> str:
    """A fresh id, or the one id `seed` always names (a batch's output, rewritten on retry)."""
    if seed is None:
        return f"file-{uuid.uuid4().hex}"
    return f"file-{hashlib.blake2s(seed.encode(), digest_size=16).hexdigest()}"


class FileStore(Protocol):
    """Durable storage of uploaded and produced files; tenant checks are the caller's."""

    def put(
        self, tenant: str, purpose: str, filename: str, data: bytes, file_id: str | None = None
    ) -> FileObject:
        """Store a file; a given `file_id` (an output named by its batch) is replaced."""
        ...

    def get(self, file_id: str) -> FileObject | None: ...

    def content(self, file_id: str) -> bytes | None: ...

    def list(self, tenant: str, purpose: str | None = None) -> list[FileObject]:
        """The tenant's files, newest first."""
        ...

    def delete(self, file_id: str) -> bool: ...


_meta = msgspec.json.Encoder()
_meta_decoder = msgspec.json.Decoder(FileObject)


def _valid_id(file_id: str) -> bool:
    # ids name paths: only our own shape gets near the filesystem
    rest = file_id.removeprefix("file-")
    return rest != file_id and len(rest) == 32 and all(c in "0123456789abcdef" for c in rest)


class DirFileStore:
    """Files as `<id>.data` with a `<id>.json` sidecar in one directory; writes are atomic."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _write(self, path: Path, data: bytes) -> None:
        tmp = path.with_suffix(path.suffix + f".{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)

    def put(
        self, tenant: str, purpose: str, filename: str, data: bytes, file_id: str | None = None
    ) -> FileObject:
        obj = FileObject(
            id=file_id or new_file_id(),
            bytes=len(data),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
            tenant=tenant,
        )
        self._write(self.root / f"{obj.id}.data", data)
        # the sidecar last: a file is listed only once its content is in place
        self._write(self.root / f"{obj.id}.json", _meta.encode(obj))
        return obj

    def get(self, file_id: str) -> FileObject | None:
        if not _valid_id(file_id):
            return None
        try:
            return _meta_decoder.decode((self.root / f"{file_id}.json").read_bytes())
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def content(self, file_id: str) -> bytes | None:
        if self.get(file_id) is None:
            return None
        try:
            return (self.root / f"{file_id}.data").read_bytes()
        except FileNotFoundError:
            return None

    def list(self, tenant: str, purpose: str | None = None) -> list[FileObject]:
        found = []
        for meta in self.root.glob("file-*.json"):
            obj = self.get(meta.stem)
            if obj is not None and obj.tenant == tenant and purpose in (None, obj.purpose):
                found.append(obj)
        found.sort(key=lambda f: (f.created_at, f.id), reverse=True)
        return found

    def delete(self, file_id: str) -> bool:
        if self.get(file_id) is None:
            return False
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        (self.root / f"{file_id}.data").unlink(missing_ok=True)
        return True
