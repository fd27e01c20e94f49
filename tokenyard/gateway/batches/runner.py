"""Drives batches on the queue: validate the input, submit each request as a BATCH-lane job
through the one admission path (`gateway/submit.py`, bounded in flight), collect outcomes,
write the outputs.

Any gateway may run a batch; a lease in the broker makes one drive it at a time, and another
takes over when it lapses. Everything a runner needs to resume is in the broker: the record
(with the submit cursor), each line's job id and the outcome sets. Jobs carry an idempotency
key derived from (batch id, custom_id), so a resubmit after a crash finds the same job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from typing import Any

import anyio
import msgspec

from tokenyard.broker.tables import BatchStore
from tokenyard.errors import UserError
from tokenyard.gateway import protocol
from tokenyard.gateway.auth import Tenant
from tokenyard.gateway.batches.files import FileStore, new_file_id
from tokenyard.gateway.batches.validate import REQUEST_OF, BatchLine, parse_lines
from tokenyard.gateway.errors import status_of
from tokenyard.gateway.state import GatewayState
from tokenyard.gateway.submit import RETRY_LATER, Later, submit
from tokenyard.gateway.tools import Reader, job_reader, parse_whole
from tokenyard.messages import (
    BatchRecord,
    BatchStatus,
    JobRecord,
    JobResult,
    JobStatus,
    LineError,
    Priority,
)

log = logging.getLogger(__name__)

_ADMISSION_ERROR = "!"  # a jobs-hash value starting with it is a JSON error, not a job id


class _AdmissionError(msgspec.Struct):
    status: int
    code: str | None
    message: str
    param: str | None


def idempotency_key(batch_id: str, custom_id: str) -> str:
    return f"batch:{batch_id}:{custom_id}"


class BatchRunner:
    """One per gateway: looks for active batches and drives those whose lease it wins."""

    def __init__(self, state: GatewayState, store: BatchStore, files: FileStore) -> None:
        self.state = state
        self.store = store
        self.files = files
        s = state.settings
        self.max_in_flight = max(1, s.batch_max_in_flight)
        self.poll_s = s.batch_poll_s
        self.lease_s = s.batch_lease_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._driving: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A batch was created or cancelled here: look now rather than at the next scan."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                for batch_id in await self.store.active():
                    if batch_id not in self._driving:
                        self._driving[batch_id] = asyncio.create_task(self._drive(batch_id))
            except Exception:
                log.warning("batch scan failed", exc_info=True)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.lease_s / 3)

    async def close(self) -> None:
        for task in list(self._driving.values()):
            task.cancel()
        await asyncio.gather(*self._driving.values(), return_exceptions=True)

    async def _drive(self, batch_id: str) -> None:
        try:
            if not await self.store.acquire(batch_id, self.owner, self.lease_s):
                self._driving.pop(batch_id, None)
                return
        except Exception:
            self._driving.pop(batch_id, None)
            raise
        try:
            await _Drive(self, batch_id).run()
            self._wake.set()  # a batch that ended may free room for another
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("driving batch %s failed; another pass will resume it", batch_id)
        finally:
            self._driving.pop(batch_id, None)
            with contextlib.suppress(Exception):
                await self.store.release(batch_id, self.owner)


class _Drive:
    """One runner's pass over one batch, until it is terminal or the lease is lost."""

    def __init__(self, runner: BatchRunner, batch_id: str) -> None:
        self.r = runner
        self.id = batch_id
        self.store = runner.store
        self.renewed = time.monotonic()

    async def _renew(self) -> bool:
        if time.monotonic() - self.renewed < self.r.lease_s / 3:
            return True
        self.renewed = time.monotonic()
        return await self.store.acquire(self.id, self.r.owner, self.r.lease_s)

    async def run(self) -> None:
        st = await self.store.get(self.id)
        if st is None or st.record.status.terminal:
            return
        rec = st.record
        data = await anyio.to_thread.run_sync(self.r.files.content, rec.input_file_id)
        settings = self.r.state.settings
        if data is None:
            lines: list[BatchLine] = []
            errors = [LineError(code="invalid_file", message="The input file no longer exists")]
        else:
            lines, errors = await anyio.to_thread.run_sync(
                parse_lines, data, rec.endpoint, settings.batch_max_requests
            )
        if data is None and rec.status is not BatchStatus.VALIDATING:
            # the input was deleted mid-run: its lines can no longer be matched to custom_ids
            jobs = await self.store.jobs(self.id)
            await self._cancel_jobs([j for j in jobs.values() if not _refusal(j)])
            rec.status, rec.failed_at, rec.errors = BatchStatus.FAILED, int(time.time()), errors
            await self.store.save(rec)
            return
        if rec.status is BatchStatus.VALIDATING:
            now = int(time.time())
            if errors:
                rec.status, rec.failed_at, rec.errors = BatchStatus.FAILED, now, errors[:1000]
                await self.store.save(rec)
                return
            rec.status, rec.in_progress_at, rec.total = BatchStatus.IN_PROGRESS, now, len(lines)
            rec.model = _model_of(lines[0])
            await self.store.save(rec)
        active = rec.status in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)
        if active and not await self._progress(rec, lines):
            return
        await self._finalize(rec, lines)

    async def _progress(self, rec: BatchRecord, lines: list[BatchLine]) -> bool:
        """Submit and collect until every line is settled, cancelled or expired; False when
        the lease was lost."""
        jobs = await self.store.jobs(self.id)
        ok, failed = await self.store.outcomes(self.id)
        pending = {
            i: j
            for i, j in jobs.items()
            if i not in ok and i not in failed and not j.startswith(_ADMISSION_ERROR)
        }
        stopping = rec.status is BatchStatus.CANCELLING
        while True:
            if not await self._renew():
                return False
            st = await self.store.get(self.id)
            if st is None:
                return False
            if st.cancel_requested and not stopping:
                stopping = True
                rec.status, rec.cancelling_at = BatchStatus.CANCELLING, int(time.time())
                await self.store.save(rec)
                await self._cancel_jobs(list(pending.values()))
            if not stopping and time.time() >= rec.expires_at:
                rec.status, rec.expired_at = BatchStatus.EXPIRED, int(time.time())
                await self._cancel_jobs(list(pending.values()))
                return True
            if not stopping and rec.submitted < len(lines) and len(pending) < self.r.max_in_flight:
                await self._submit(rec, lines, pending, await self._tenant(rec.tenant))
            if pending:
                await self._collect(rec, pending, stopping)
            if not pending and (stopping or rec.submitted >= len(lines)):
                return True
            await asyncio.sleep(self.r.poll_s)

    async def _tenant(self, name: str) -> Tenant:
        """The batch's tenant as the broker's directory has it now (quota, fair-share weight),
        in the batch lane: a request may lower its priority below its tenant's, never raise
        it, and no lane is below the batch lane, so every line runs in it."""
        config = await self.r.state.backend.directory.tenant(name)
        if config is None:
            return Tenant(name, Priority.BATCH)
        return Tenant(name, Priority.BATCH, quota=config.quota, weight=config.weight)

    async def _submit(
        self, rec: BatchRecord, lines: list[BatchLine], pending: dict[int, str], tenant: Tenant
    ) -> None:
        start = rec.submitted
        stop = min(len(lines), start + self.r.max_in_flight - len(pending))
        outcomes = await asyncio.gather(
            *(self._admit_one(rec, lines[i], tenant) for i in range(start, stop)),
            return_exceptions=True,
        )
        placed: dict[int, str] = {}
        advanced = start
        for i, outcome in zip(range(start, stop), outcomes, strict=True):
            if isinstance(outcome, RETRY_LATER):
                # a full lane, the tenant's quota or the queue's wait: this line and the rest
                # wait a tick (a job a later line made meanwhile is found again by its key);
                # a window that closed meanwhile (the line's deadline passed: 429 too) expires
                # them on that tick
                break
            if isinstance(outcome, UserError):
                refusal = _AdmissionError(
                    status_of(outcome), outcome.code, outcome.message, outcome.param
                )
                placed[i] = _ADMISSION_ERROR + msgspec.json.encode(refusal).decode()
            elif isinstance(outcome, BaseException):
                log.warning("batch %s line %d: enqueue failed", self.id, i, exc_info=outcome)
                break
            else:
                placed[i] = outcome
                pending[i] = outcome
            advanced = i + 1
        await self.store.set_jobs(self.id, placed)
        refused = [i for i, v in placed.items() if v.startswith(_ADMISSION_ERROR)]
        if refused:
            await self.store.add_outcomes(self.id, [], refused)
        if advanced != rec.submitted:
            rec.submitted = advanced
            await self.store.save(rec)

    async def _admit_one(self, rec: BatchRecord, line: BatchLine, tenant: Tenant) -> str:
        """Submit one line as any request is (quota, queue wait, lane bound), in the batch's
        window; its job id."""
        body: Any = protocol.parse(
            REQUEST_OF[line.kind],
            line.body,
            checked=True,  # `parse_lines` checked it
        )
        body.deadline = float(rec.expires_at)
        # nobody follows a batch line's tokens: the runner reads only its result
        how = Later(idempotency_key(rec.id, line.custom_id), tokens=False)
        queued = await submit(self.r.state, line.kind, body, tenant, how)
        return queued.job_id

    async def _collect(self, rec: BatchRecord, pending: dict[int, str], stopping: bool) -> None:
        items = list(pending.items())
        records = await self.r.state.backend.queue.records([j for _, j in items])
        ok: list[int] = []
        failed: list[int] = []
        for (i, _), record in zip(items, records, strict=True):
            if record is None:
                failed.append(i)  # its record is gone (past the broker's record TTL)
            elif record.status.terminal:
                if record.status is JobStatus.CANCELLED and stopping:
                    pass  # cancelled with the batch: neither completed nor failed
                elif record.status is JobStatus.SUCCEEDED:
                    ok.append(i)
                else:
                    failed.append(i)
                if record.result is not None:
                    rec.prompt_tokens += record.result.prompt_tokens
                    rec.completion_tokens += record.result.completion_tokens
            else:
                continue
            del pending[i]
        if ok or failed:
            await self.store.add_outcomes(self.id, ok, failed)
            await self.store.save(rec)

    async def _cancel_jobs(self, job_ids: list[str]) -> None:
        queue = self.r.state.backend.queue
        await asyncio.gather(*(queue.cancel(j) for j in job_ids), return_exceptions=True)

    async def _finalize(self, rec: BatchRecord, lines: list[BatchLine]) -> None:
        """Write the output and error files from the job records, then the terminal status."""
        ending = rec.status
        if ending is BatchStatus.IN_PROGRESS:
            rec.status, rec.finalizing_at = BatchStatus.FINALIZING, int(time.time())
            await self.store.save(rec)
        jobs = await self.store.jobs(self.id)
        queue = self.r.state.backend.queue
        items = sorted(jobs.items())
        records: list[JobRecord | None] = []
        for start in range(0, len(items), 1000):
            chunk = [j for _, j in items[start : start + 1000]]
            got = iter(await queue.records([j for j in chunk if not _refusal(j)]))
            records.extend(None if _refusal(j) else next(got) for j in chunk)
        out: list[bytes] = []
        err: list[bytes] = []
        for (i, job), record in zip(items, records, strict=True):
            line = lines[i]
            if job.startswith(_ADMISSION_ERROR):
                refusal = msgspec.json.decode(job[1:], type=_AdmissionError)
                err.append(_error_line(line, job, refusal.status, refusal))
                continue
            if record is None or record.result is None:
                if ending is BatchStatus.EXPIRED:
                    err.append(_expired_line(line))
                continue
            result = record.result
            failure = protocol.result_error(result)
            if failure is None:
                body = _response_body(
                    line, job, record, result, self.r.state, job_reader(record.spec)
                )
                out.append(_line(f"batch_req_{job}", line.custom_id, 200, job, body, None))
            elif result.status is JobStatus.CANCELLED and ending is BatchStatus.CANCELLING:
                continue  # cancelled with the batch: it never ran
            elif result.status in (JobStatus.EXPIRED, JobStatus.CANCELLED) and (
                ending is BatchStatus.EXPIRED
            ):
                err.append(_expired_line(line))
            else:
                err.append(_line(f"batch_req_{job}", line.custom_id, failure[0], job, failure[1]))
        if ending is BatchStatus.EXPIRED:
            err.extend(_expired_line(lines[i]) for i in range(len(lines)) if i not in jobs)
        if out:
            rec.output_file_id = await self._write_file(rec.tenant, "output", out)
        if err:
            rec.error_file_id = await self._write_file(rec.tenant, "error", err)
        now = int(time.time())
        if ending is BatchStatus.CANCELLING:
            rec.status, rec.cancelled_at = BatchStatus.CANCELLED, now
        elif ending is BatchStatus.EXPIRED:
            rec.status = BatchStatus.EXPIRED
        else:
            rec.status, rec.completed_at = BatchStatus.COMPLETED, now
        await self.store.save(rec)

    async def _write_file(self, tenant: str, part: str, lines: list[bytes]) -> str:
        """Store the batch's output or error file; its id comes from the batch id, so a
        finalize redone after a restart rewrites the same file."""
        file_id = new_file_id(f"{self.id}:{part}")
        name, data, files = f"{self.id}_{part}.jsonl", b"".join(lines), self.r.files
        await anyio.to_thread.run_sync(
            lambda: files.put(tenant, "batch_output", name, data, file_id)
        )
        return file_id


def _response_body(
    line: BatchLine,
    job: str,
    record: JobRecord,
    result: JobResult,
    state: GatewayState,
    tools: Reader | None = None,
) -> Any:
    """The body a successful line's request would have been answered with over HTTP; `tools`
    reads a chat answer for tool calls."""
    spec = record.spec
    asked = msgspec.json.decode(line.body)
    if line.kind == "embedding":
        encoding = asked.get("encoding_format") or "float"
        return protocol.embedding_body(spec.model, result, encoding)
    how = protocol.rendering(
        spec,
        state.tokenizers.get(spec.model),
        echo=line.kind == "completion" and asked.get("echo") is True,
        token_ids=asked.get("return_token_ids") is True,
        tokens_as_ids=asked.get("return_tokens_as_token_ids") is True,
    )
    parsed = [None if tools is None else parse_whole(tools, result.text)]
    return protocol.completion_body(
        line.kind, job, spec.model, int(spec.created_at), [result], how, parsed=parsed
    )


def _refusal(job: str) -> bool:
    return job.startswith(_ADMISSION_ERROR)


def _model_of(line: BatchLine) -> str | None:
    model = msgspec.json.decode(line.body).get("model")
    return model if isinstance(model, str) else None


def _line(
    req_id: str,
    custom_id: str,
    status: int,
    request_id: str,
    body: Any,
    error: Any = None,
) -> bytes:
    return (
        msgspec.json.encode(
            {
                "id": req_id,
                "custom_id": custom_id,
                "response": {"status_code": status, "request_id": request_id, "body": body},
                "error": error,
            }
        )
        + b"\n"
    )


def _error_line(line: BatchLine, job: str, status: int, refusal: _AdmissionError) -> bytes:
    body = {
        "error": {
            "message": refusal.message,
            "type": "invalid_request_error" if status == 400 else "not_found_error",
            "param": refusal.param,
            "code": refusal.code,
        }
    }
    req = f"batch_req_{uuid.uuid5(uuid.NAMESPACE_URL, line.custom_id).hex}"
    return _line(req, line.custom_id, status, "", body)


def _expired_line(line: BatchLine) -> bytes:
    req = f"batch_req_{uuid.uuid5(uuid.NAMESPACE_URL, line.custom_id).hex}"
    return (
        msgspec.json.encode(
            {
                "id": req,
                "custom_id": line.custom_id,
                "response": None,
                "error": {
                    "code": "batch_expired",
                    "message": "This request could not be executed before the completion "
                    "window expired.",
                },
            }
        )
        + b"\n"
    )
