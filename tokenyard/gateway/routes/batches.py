"""OpenAI's Batches API: create, retrieve, list and cancel; the runner does the work."""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from tokenyard.broker.tables import BatchState
from tokenyard.errors import InvalidRequest, NotFound
from tokenyard.gateway.auth import Tenant, TenantDep
from tokenyard.gateway.batches.service import batches_of
from tokenyard.gateway.batches.types import ENDPOINTS, batch_body, new_batch_id
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.jsonbody import check_json
from tokenyard.gateway.openapi import answers, json_body
from tokenyard.messages import BatchRecord, BatchStatus

router = APIRouter()
_WINDOWS = ("24h",)


class CreateBatch(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; outputs are kept as files


def _view(state: BatchState) -> dict[str, Any]:
    return batch_body(state.record, state.completed, state.failed, state.cancel_requested)


async def _own_batch(request: Request, batch_id: str, tenant: Tenant) -> BatchState:
    state = await batches_of(request).store.get(batch_id)
    if state is None or state.record.tenant != tenant.name:
        raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id")
    return state


@router.post("/v1/batches", responses=answers(404), openapi_extra=json_body("CreateBatchRequest"))
async def create_batch(request: Request, tenant: TenantDep) -> JSONResponse:
    service = batches_of(request)
    raw = await request.body()
    check_json(raw)
    try:
        body = msgspec.json.decode(raw, type=CreateBatch)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequest(f"Invalid request body: {exc}", code="invalid_request") from exc
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"'{body.endpoint}' is not a supported endpoint; supported: {', '.join(ENDPOINTS)}",
            param="endpoint",
        )
    if body.completion_window not in _WINDOWS:
        raise InvalidRequest(
            "'completion_window' must be '24h'", param="completion_window", code="invalid_value"
        )
    if body.metadata is not None and (
        len(body.metadata) > 16
        or any(len(k) > 64 or len(v) > 512 for k, v in body.metadata.items())
    ):
        raise InvalidRequest(
            "'metadata' takes at most 16 pairs, keys up to 64 and values up to 512 characters",
            param="metadata",
        )
    file = service.files.get(body.input_file_id)
    if file is None or file.tenant != tenant.name:
        raise NotFound(f"No such File object: {body.input_file_id}", param="input_file_id")
    if file.purpose != "batch":
        raise InvalidRequest(
            f"File {body.input_file_id} has purpose '{file.purpose}', not 'batch'",
            param="input_file_id",
        )
    now = int(time.time())
    record = BatchRecord(
        id=new_batch_id(),
        tenant=tenant.name,
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        created_at=now,
        expires_at=now + max(1, int(service.settings.batch_window_s)),
        metadata=body.metadata,
    )
    await service.store.create(record)
    service.runner.wake()
    return JSONResponse(batch_body(record, 0, 0, False))


@router.get("/v1/batches/{batch_id}", responses=answers(404))
async def retrieve_batch(request: Request, batch_id: str, tenant: TenantDep) -> JSONResponse:
    return JSONResponse(_view(await _own_batch(request, batch_id, tenant)))


@router.post("/v1/batches/{batch_id}/cancel", responses=answers(404, 409))
async def cancel_batch(request: Request, batch_id: str, tenant: TenantDep) -> JSONResponse:
    service = batches_of(request)
    state = await _own_batch(request, batch_id, tenant)
    status = state.record.status
    if status.terminal or status is BatchStatus.FINALIZING:
        raise ApiError(
            409,
            f"Cannot cancel a batch with status '{status.value}'.",
            code="batch_not_cancellable",
        )
    await service.store.request_cancel(batch_id)
    service.runner.wake()
    state.cancel_requested = True
    return JSONResponse(_view(state))


@router.get("/v1/batches")
async def list_batches(
    request: Request,
    tenant: TenantDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JSONResponse:
    store = batches_of(request).store
    ids = await store.list_ids(tenant.name)
    if after is not None:
        ids = ids[ids.index(after) + 1 :] if after in ids else []
    page: list[dict[str, Any]] = []
    for batch_id in ids[:limit]:
        state = await store.get(batch_id)
        if state is not None:
            page.append(_view(state))
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ids) > limit,
        }
    )
