"""Job ids: a model's tag, a dash, a uuid, so everything about a job derives from its id.

Every backend takes them as given (the gateway makes them); the Redis backend puts the tag in
its keys' `{hash tag}`, so a job's keys share its model's Cluster slot.
"""

from __future__ import annotations

import functools
import hashlib
import re
import uuid

_JOB_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{32}")


@functools.lru_cache(maxsize=1024)  # every key of a job goes through it
def model_tag(model: str) -> str:
    return hashlib.blake2s(model.encode(), digest_size=4).hexdigest()


def new_job_id(model: str) -> str:
    return f"{model_tag(model)}-{uuid.uuid4().hex}"


def tag_of_job(job_id: str) -> str:
    tag, sep, _ = job_id.partition("-")
    if not sep or len(tag) != 8:
        raise ValueError(f"malformed job id {job_id!r}")
    return tag


def is_job_id(job_id: str) -> bool:
    """Whether `job_id` has the shape `new_job_id` gives (a model tag, a dash, a uuid)."""
    return _JOB_ID.fullmatch(job_id) is not None
