"""A queued job's lane message is its record: an enqueue no key names writes the message alone
(one round trip), and the first claim writes the record. Until then a reader finds the job by
its id on its own subject of the lane (`Names.job_subject`): one direct get per lane of its
model, whichever tenant's it is. The record is always written before the message goes (a
claim's, a cancel's, an expiry's), so a reader that finds neither looks at the record again.
"""

from __future__ import annotations

import asyncio
import json

import nats.js.errors

from tokenyard.broker.nats.connection import NatsConnection
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.records import StoredJob
from tokenyard.messages import JobSpec, JobStatus, decode

ENQUEUED_AT = "Ty-At"  # header of a lane message: when its job was enqueued
_NONE = ("404", "503")  # no such message; no such lane (no stream answers its direct gets)


async def waiting_job(
    conn: NatsConnection, names: Names, pool_count: int, job_id: str
) -> StoredJob | None:
    """The queued job `job_id` as its lane message says (status queued, never taken; its lane,
    subject and sequence), None when no lane holds a message of it."""
    try:
        places = names.waiting_places(job_id, pool_count)
    except ValueError:
        return None  # not a job id: no enqueue of it can ever land
    found = await asyncio.gather(*(_last(conn, stream, pattern) for stream, pattern in places))
    for (stream, _), hit in zip(places, found, strict=True):
        if hit is None:
            continue
        seq, data, headers = hit
        return StoredJob(
            spec=decode(data, JobSpec),
            status=JobStatus.QUEUED,
            enqueued_at=float(headers.get(ENQUEUED_AT, "0")),
            lane=stream,
            subject=headers.get("Nats-Subject", ""),
            seq=seq,
        )
    return None


async def _last(
    conn: NatsConnection, stream: str, pattern: str
) -> tuple[int, bytes, dict[str, str]] | None:
    body = json.dumps({"last_by_subj": pattern}).encode()
    msgs, end = await conn.replies_raw(f"$JS.API.DIRECT.GET.{stream}", body, 1)
    if not msgs:
        if end is not None and (end.headers or {}).get("Status") not in _NONE:
            raise nats.js.errors.APIError.from_msg(end)
        return None
    headers = msgs[0].headers or {}
    return int(headers["Nats-Sequence"]), msgs[0].data, headers
