"""OpenAI's Files API (`purpose=batch` uploads and batch outputs), scoped to the tenant."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenyard.errors import InvalidRequest, NotFound
from tokenyard.gateway.auth import Tenant, TenantDep
from tokenyard.gateway.batches.files import FileObject
from tokenyard.gateway.batches.service import batches_of
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.openapi import answers

router = APIRouter()
_PURPOSES = ("batch",)


def _own_file(request: Request, file_id: str, tenant: Tenant) -> FileObject:
    obj = batches_of(request).files.get(file_id)
    if obj is None or obj.tenant != tenant.name:
        raise NotFound(f"No such File object: {file_id}", param="id", code="file_not_found")
    return obj


@router.post("/v1/files", responses=answers(413))
async def upload_file(
    request: Request,
    tenant: TenantDep,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form(json_schema_extra={"enum": list(_PURPOSES)})],
) -> JSONResponse:
    service = batches_of(request)
    if purpose not in _PURPOSES:
        raise InvalidRequest(
            f"'{purpose}' is not a supported purpose; supported: {', '.join(_PURPOSES)}",
            param="purpose",
        )
    limit = service.settings.batch_max_file_bytes
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, f"File exceeds the {limit} bytes limit", param="file")
    name = file.filename or "upload.jsonl"
    obj = await anyio.to_thread.run_sync(service.files.put, tenant.name, purpose, name, data)
    return JSONResponse(obj.body())


@router.get("/v1/files")
async def list_files(
    request: Request,
    tenant: TenantDep,
    purpose: str | None = None,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> JSONResponse:
    files = await anyio.to_thread.run_sync(batches_of(request).files.list, tenant.name, purpose)
    if order == "asc":
        files.reverse()
    if after is not None:
        ids = [f.id for f in files]
        files = files[ids.index(after) + 1 :] if after in ids else []
    page = files[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": [f.body() for f in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": len(files) > limit,
        }
    )


@router.get("/v1/files/{file_id}", responses=answers(404))
async def retrieve_file(request: Request, file_id: str, tenant: TenantDep) -> JSONResponse:
    return JSONResponse(_own_file(request, file_id, tenant).body())


@router.get(
    "/v1/files/{file_id}/content",
    responses={
        **answers(404),
        200: {"description": "The file's bytes", "content": {"application/octet-stream": {}}},
    },
)
async def file_content(request: Request, file_id: str, tenant: TenantDep) -> Response:
    _own_file(request, file_id, tenant)
    data = await anyio.to_thread.run_sync(batches_of(request).files.content, file_id)
    if data is None:
        raise NotFound(f"No such File object: {file_id}", param="id", code="file_not_found")
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", responses=answers(404))
async def delete_file(request: Request, file_id: str, tenant: TenantDep) -> JSONResponse:
    _own_file(request, file_id, tenant)
    await anyio.to_thread.run_sync(batches_of(request).files.delete, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
