"""The Redis scripts of RabbitMQ lanes' tables: records, leases and events beside the lanes.

Declared as the Redis backend's are (tokenyard/broker/redis/scripts.py); the bodies live in
lua/ here. `holds` (lua/lib/holds.lua) is every lease holder's fence; `admit` the Redis
backend's own idempotency and collapsing rule.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

# the complete scripts of both lane kinds write the same model keys (lua/lib/ends.lua) and
# take the same item arguments (ValkeyJobTable's completion_args makes them for both)
from tokenyard.broker.redis.scripts import CompleteItemArgs, CompleteKeys, Empty, ScriptSpec

PACKAGE = "tokenyard.broker.amqp"
# a script of this package: its body is lua/<name>.lua here, its libraries this package's
# lua/lib/ or else the Redis backend's
_script = functools.partial(ScriptSpec, package=PACKAGE)


class JobKeys(NamedTuple):
    job: str
    idem: str
    inflight: str
    waiting: str
    unpub: str  # the lane's jobs published after their records, not yet confirmed


class AdmitArgs(NamedTuple):
    now: str
    idem_ttl_ms: int
    job_prefix: str
    max_depth: int
    collapse_grace_s: str


class AdmitItemArgs(NamedTuple):
    job_id: str  # job_id .. use_inflight: an `Admission` (redis/scripts.py)
    spec: bytes
    deadline: str
    use_idem: str
    use_inflight: str
    msg: str
    lane: str
    prefix: str  # the spec's prefix key ('' none)
    pref: str  # the worker it is held for (prefix affinity: affinity.py), '' none
    affw: str  # that worker's held set in its lane ('' none)
    late: str  # "1": the caller publishes it after its record (a key names it, or it is held)


ADMIT = _script("admit", Empty, AdmitArgs, JobKeys, AdmitItemArgs, libraries=("admit",))


class WithdrawArgs(NamedTuple):
    job_prefix: str
    gone_ttl_ms: int  # how long a withdrawn job's tombstone stands (take.lua reads it)


class WithdrawItemArgs(NamedTuple):
    job_id: str
    created: str
    joined: str
    msg: str
    # the admit's `now` where the caller does not know what it did (its answer was lost), ''
    # where it does: then only a record that admit made is taken back, not one it re-pointed
    made_at: str


WITHDRAW = _script("withdraw", Empty, WithdrawArgs, JobKeys, WithdrawItemArgs)


class EndKeys(NamedTuple):
    """A model's keys that a script which may end jobs writes (take.lua, bury.lua)."""

    dlq: str
    counters: str
    cancels: str
    delayed: str


class LaneItemKeys(NamedTuple):
    """A job's keys and its lane's sets: an item of take.lua, requeue.lua and bury.lua."""

    job: str
    events: str
    waiting: str
    leases: str


class TakeKeys(NamedTuple):
    """take.lua's keys: `EndKeys`, and the model's workers by heartbeat lapse (prefix
    ownership is sticky to a live one)."""

    dlq: str
    counters: str
    cancels: str
    delayed: str
    workers: str


class TakeArgs(NamedTuple):
    now: str
    consumer: str
    lease_s: str
    max_deliveries: int
    ttl_ms: int
    expired_event: bytes
    dead_event: bytes
    dead_error: str
    cancelled: bytes
    pfx_prefix: str  # prefix affinity: `prefix key -> owner` keys; the key is appended
    pfx_ttl_ms: int  # how long a take makes its worker the owner of its job's prefix


class TakeItemArgs(NamedTuple):
    job_id: str
    msg: str
    token: str
    priority: str
    affw_prefix: str  # the lane's per-worker held sets; the worker's name is appended


TAKE = _script(
    "take", TakeKeys, TakeArgs, LaneItemKeys, TakeItemArgs, libraries=("ends", "affinity")
)


class EventKeys(NamedTuple):
    job: str
    events: str


class EmitItemArgs(NamedTuple):
    consumer: str
    token: str
    event: bytes


EMIT = _script("emit", Empty, Empty, EventKeys, EmitItemArgs, libraries=("holds", "events"))


class RenewItemKeys(NamedTuple):
    job: str
    leases: str


class DeadlineArg(NamedTuple):
    deadline: str


class HolderItemArgs(NamedTuple):
    consumer: str
    token: str
    job_id: str


RENEW = _script("renew", Empty, DeadlineArg, RenewItemKeys, HolderItemArgs, libraries=("holds",))


class CompleteItemKeys(NamedTuple):
    job: str
    events: str
    leases: str


class CompleteArgs(NamedTuple):
    now: str
    ttl_ms: int


COMPLETE = _script(
    "complete", CompleteKeys, CompleteArgs, CompleteItemKeys, CompleteItemArgs, libraries=("ends",)
)


class RequeueKeys(NamedTuple):
    delayed: str
    cancels: str


class RequeueArgs(NamedTuple):
    now: str
    expired_by: str
    ttl_ms: int
    cancelled: bytes
    max_preemptions: int  # -1: not a preemption (see requeue.lua)


class RequeueItemArgs(NamedTuple):
    consumer: str
    token: str
    job_id: str
    msg: str
    uncharge: str
    error: str
    due_at: str


REQUEUE = _script(
    "requeue",
    RequeueKeys,
    RequeueArgs,
    LaneItemKeys,
    RequeueItemArgs,
    libraries=("holds", "ends"),
)


class BuryItemArgs(NamedTuple):
    job_id: str
    consumer: str
    token: str
    msg: str
    reason: str
    error: str
    finished: bytes
    priority: str
    # Finished(cancelled result) for a retry past the limit: a job a client asked to cancel
    # ends cancelled instead; b'' otherwise
    cancelled: bytes


BURY = _script(
    "bury", EndKeys, CompleteArgs, LaneItemKeys, BuryItemArgs, libraries=("holds", "ends")
)


class LeasesKey(NamedTuple):
    leases: str


class LiveKey(NamedTuple):
    live: str  # the model's workers by when their liveness lapses


class ExpiredArgs(NamedTuple):
    now: str
    max_entries: int
    job_prefix: str
    expired: str  # "1": leases past their deadline too; "0": lapsed workers' only


EXPIRED = _script("expired", LiveKey, ExpiredArgs, LeasesKey, Empty)


class UnpublishedArgs(NamedTuple):
    before: str  # admitted before this (epoch seconds): its producer is gone
    max_entries: int
    job_prefix: str
    msg_prefix: str  # a fresh message id is this and the job's place in the answer


class UnpublishedKey(NamedTuple):
    unpub: str


UNPUBLISHED = _script("unpublished", Empty, UnpublishedArgs, UnpublishedKey, Empty)

SCRIPTS: tuple[ScriptSpec[Any, Any, Any, Any], ...] = (
    ADMIT,
    WITHDRAW,
    TAKE,
    EMIT,
    RENEW,
    COMPLETE,
    REQUEUE,
    BURY,
    EXPIRED,
    UNPUBLISHED,
)
