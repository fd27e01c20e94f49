"""The Lua scripts' arguments, declared once per script.

Each script takes fixed KEYS and ARGV, then zero or more items, each with its own keys and
arguments. The tables below name them; `ScriptSpec.call` flattens typed values into KEYS/ARGV in
that order, and `ScriptSpec.prologue` is Lua prepended to the script that binds the same names
(`K.name`, `A.name`, `item(i)` -> keys, args; `N` items), so neither side counts positions.
`K.name` and `A.name` are written so in the Lua files and sent as locals (`K_name`, `A_name`):
`source` rewrites them, as a table built for them would cost the server on every call.
Each script's header comment repeats its table; tests/unit/test_scripts.py checks they agree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources
from typing import Any, Generic, NamedTuple, TypeVar

Arg = str | bytes | int  # what redis-py sends; floats go as repr() so Lua reads them exactly

_K = TypeVar("_K", bound=tuple[Any, ...])
_A = TypeVar("_A", bound=tuple[Any, ...])
_IK = TypeVar("_IK", bound=tuple[Any, ...])
_IA = TypeVar("_IA", bound=tuple[Any, ...])

Call = tuple[str, list[str], list[Arg]]  # script id, KEYS, ARGV


# K.<name> / A.<name> in a script: the prologue binds each to a local K_<name> / A_<name>
_FIXED_NAME = re.compile(r"\b([KA])\.(\w+)")


def _fields(kind: type[tuple[Any, ...]]) -> tuple[str, ...]:
    names: tuple[str, ...] = getattr(kind, "_fields")  # noqa: B009 - NamedTuple classes only
    return names


class ScriptSpec(Generic[_K, _A, _IK, _IA]):
    """KEYS = fixed keys, then each item's keys; ARGV = fixed args, then each item's args."""

    def __init__(
        self,
        name: str,
        keys: type[_K],
        args: type[_A],
        item_keys: type[_IK],
        item_args: type[_IA],
        libraries: tuple[str, ...] = (),
        package: str = "tokenyard.broker.redis",
    ) -> None:
        self.name = name
        self.libraries = libraries  # lua/lib/<name>.lua, prepended to the body
        self.package = package  # whose lua/ holds the body (another backend's Redis scripts)
        # what a call names it by: another package's script may share a file name with ours
        self.id = name if package == "tokenyard.broker.redis" else f"{package}:{name}"
        self.keys = _fields(keys)
        self.args = _fields(args)
        self.item_keys = _fields(item_keys)
        self.item_args = _fields(item_args)
        names = [*self.item_keys, *self.item_args]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: an item's keys and args need distinct names")

    def call(self, keys: _K, args: _A, items: Sequence[tuple[_IK, _IA]] = ()) -> Call:
        flat_keys: list[str] = list(keys)
        flat_args: list[Arg] = list(args)
        for item_keys, item_args in items:
            flat_keys += item_keys
            flat_args += item_args
        return self.id, flat_keys, flat_args

    def header(self) -> tuple[str, str]:
        """The KEYS and ARGV lines of the script's header comment, unwrapped."""

        def line(fixed: tuple[str, ...], per_item: tuple[str, ...]) -> str:
            text = ", ".join(fixed) or "none"
            return f"{text}; per item: {', '.join(per_item)}" if per_item else text

        return (
            f"KEYS: {line(self.keys, self.item_keys)}",
            f"ARGV: {line(self.args, self.item_args)}",
        )

    def prologue(self) -> str:
        """Lua that binds the declared names; the script body uses only these."""
        nk, na, nik, nia = (
            len(self.keys),
            len(self.args),
            len(self.item_keys),
            len(self.item_args),
        )

        def table(names: tuple[str, ...], array: str, base: str) -> str:
            fields = (f"{n} = {array}[{base}{i + 1}]" for i, n in enumerate(names))
            return "{" + ", ".join(fields) + "}"

        def bind(names: tuple[str, ...], array: str, prefix: str) -> list[str]:
            # locals, not a table: a table of the call's names costs the server an allocation,
            # a hashed store per name and its share of Lua's garbage collection on every call
            if not names:
                return []
            local = ", ".join(f"{prefix}_{n}" for n in names)
            value = ", ".join(f"{array}[{i + 1}]" for i in range(len(names)))
            return [f"local {local} = {value}"]

        lines = [
            f"-- names of KEYS and ARGV, from tokenyard/broker/redis/scripts.py ({self.name}):",
            "-- the body's K.<name> and A.<name> read these locals (ScriptSpec.source)",
            *bind(self.keys, "KEYS", "K"),
            *bind(self.args, "ARGV", "A"),
        ]
        if nik:
            lines.append(f"local N = (#KEYS - {nk}) / {nik}")
        elif nia:
            lines.append(f"local N = (#ARGV - {na}) / {nia}")
        else:
            lines.append("local N = 0")
        # one table holds both an item's keys and its args (their names are distinct), returned
        # as both: every table a script builds costs the server an allocation and its share of
        # Lua's garbage collection, per call, and item() runs once per item
        keys_part = table(self.item_keys, "KEYS", "k + ")[1:-1]
        args_part = table(self.item_args, "ARGV", "a + ")[1:-1]
        both = ", ".join(part for part in (keys_part, args_part) if part)
        lines += [
            "local function item(i)",
            f"  local k, a = {nk} + (i - 1) * {nik}, {na} + (i - 1) * {nia}",
            f"  local t = {{{both}}}",
            "  return t, t",
            "end",
        ]
        return "\n".join(lines) + "\n"

    def source(self) -> str:
        """The script as sent to the server: prologue, libraries, then the file, their
        `K.name`/`A.name` read as the prologue's locals. A library is looked up in the
        script's own package, then in this one's."""
        own = resources.files(self.package).joinpath("lua")
        shared = resources.files("tokenyard.broker.redis").joinpath("lua")

        def library(name: str) -> str:
            path = own.joinpath(f"lib/{name}.lua")
            return (path if path.is_file() else shared.joinpath(f"lib/{name}.lua")).read_text()

        libraries = "".join(library(name) for name in self.libraries)
        body = libraries + own.joinpath(f"{self.name}.lua").read_text()
        return self.prologue() + _FIXED_NAME.sub(r"\1_\2", body)


class Empty(NamedTuple):
    """No keys, or no arguments."""


# -- enqueue: admit one model's batch of jobs atomically ------------------------------------
class EnqueueArgs(NamedTuple):
    now: str
    max_depth: int
    idem_ttl_ms: int
    window: int  # staged jobs kept in a lane's stream (fair share, lua/lib/fair.lua)
    job_prefix: str  # a collapsing request looks up the status of the job it would join
    pfx_prefix: str  # prefix affinity: `prefix key -> worker` keys; the key is appended
    wake_prefix: str  # workers' wake streams; the consumer name is appended
    max_held: int  # jobs held for one worker per lane at most
    collapse_grace_s: str  # a job that succeeded this recently is still joined (lib/admit.lua)


class EnqueueItemKeys(NamedTuple):
    # the lane's fair hash, staging and held sets hang off it: enqueue.lua names them
    lane: str
    job: str
    idem: str  # the idempotency key, or the job key again when the job has none
    inflight: str  # the collapse key, or the job key again when the job has none


class Admission(NamedTuple):
    """What every admitting script's item starts with (enqueue.lua, amqp/lua/admit.lua): what
    lua/lib/admit.lua reads, and the record's spec and deadline (ValkeyJobTable.admission)."""

    job_id: str
    spec: bytes
    deadline: str  # '' for none
    use_idem: str  # '1' | '0'
    use_inflight: str  # '1' | '0': join an identical job in flight instead of adding one


class EnqueueItemArgs(NamedTuple):
    job_id: str  # job_id .. use_inflight: an `Admission`
    spec: bytes
    deadline: str
    use_idem: str
    use_inflight: str
    tenant: str
    weight: str
    cost: int  # tokens it may use: its share of the lane is counted in them
    score: str  # order among the tenant's staged jobs: deadline first, then arrival
    prefix: str  # prefix key, '' for none


class EnqueueKeys(NamedTuple):
    workers: str  # live workers by heartbeat lapse: a job is held only for a live one


ENQUEUE = ScriptSpec(
    "enqueue",
    EnqueueKeys,
    EnqueueArgs,
    EnqueueItemKeys,
    EnqueueItemArgs,
    libraries=("admit", "fair"),
)


# -- claim: take jobs from the lanes in claim order -----------------------------------------
class ClaimKeys(NamedTuple):
    delayed: str
    counters: str
    wake: str  # this worker's wake stream (prefix affinity): its newest id is a wait hint
    workers: str  # live workers by heartbeat lapse: who may keep a prefix


class ClaimArgs(NamedTuple):
    group: str
    consumer: str
    slots: int
    now: str
    # '1': the call waited in a pipeline behind a blocking XREAD, so `now` is stale by the wait;
    # the server's TIME stands in for it
    server_now: str
    job_prefix: str
    event_prefix: str
    expired_event: bytes  # Finished(expired result): stored as the result and appended
    ttl_ms: int
    wait_hints: str  # '1': when the lanes are drained, return what a blocking wait needs
    window: int  # staged jobs kept in a lane's stream beyond the slots asked for
    capped_room: int  # jobs the capped lanes may give together; -1: no cap
    pfx_prefix: str  # prefix affinity: `prefix key -> worker` keys; the key is appended
    pfx_ttl_ms: int  # how long a claim makes this worker its jobs' prefixes' owner
    aff_wait: str  # seconds a held job waits for its preferred worker before any may take it
    # the wake stream's id in this worker's last wait hint ('' for none): nothing after it, and
    # the hint stands without reading the stream's newest id again
    wake_after: str


class LaneKey(NamedTuple):
    lane: str


class ClaimLaneArgs(NamedTuple):
    # a lane is its one key (LaneKey): claim.lua names the keys that hang off it (keys.py's
    # fair, fair_active, tenant_queue_prefix, affinity_held/_worker/_stream) itself, sparing the
    # server seven arguments per lane on every claim
    capped: str  # '1': this lane's claims count against capped_room (the batch lane's share)
    # the lane's id in this worker's last wait hint when that claim read the lane to its end
    # ('' for none): a lane with no entry after it has nothing to read (one XREAD for all)
    after: str


CLAIM = ScriptSpec(
    "claim",
    ClaimKeys,
    ClaimArgs,
    LaneKey,
    ClaimLaneArgs,
    libraries=("fair", "ends", "affinity"),
)


# -- complete: fenced terminal results of a batch --------------------------------------------
class CompleteKeys(NamedTuple):
    cancels: str
    counters: str


class CompleteArgs(NamedTuple):
    group: str
    now: str
    ttl_ms: int


class CompleteItemKeys(NamedTuple):
    lane: str
    job: str
    events: str


class CompleteItemArgs(NamedTuple):
    consumer: str
    entry_id: str
    job_id: str
    status: str
    finished: bytes  # the Finished event: appended last, and stored as the record's result
    tail: bytes  # the last token chunk, or b''


COMPLETE = ScriptSpec(
    "complete", CompleteKeys, CompleteArgs, CompleteItemKeys, CompleteItemArgs, libraries=("ends",)
)


# -- fail: retry after backoff, or dead-letter ------------------------------------------------
class FailKeys(NamedTuple):
    lane: str
    job: str
    events: str
    cancels: str
    counters: str
    delayed: str
    dlq: str


class FailArgs(NamedTuple):
    group: str
    consumer: str
    entry_id: str
    job_id: str
    error: str
    now: str
    due_at: str
    max_deliveries: int
    finished: bytes  # Finished(dead result)
    ttl_ms: int
    reason: str
    force_dead: str  # '1' | '0'
    priority: str  # the lane's priority name, for the dead-letter entry
    cancelled: bytes  # Finished(cancelled result): a cancel request ends it instead of a retry


FAIL = ScriptSpec("fail", FailKeys, FailArgs, Empty, Empty, libraries=("ends",))


# -- reap: requeue or dead-letter entries whose lease expired or whose holder lapsed ---------
class ReapKeys(NamedTuple):
    dlq: str
    counters: str
    live: str  # the model's workers by when their liveness lapses
    cancels: str


class ReapArgs(NamedTuple):
    group: str
    reaper: str
    min_idle_ms: int
    max_entries: int
    max_deliveries: int
    now: str
    job_prefix: str
    event_prefix: str
    finished: bytes  # Finished(dead result)
    dead_error: str
    cancelled: bytes  # Finished(cancelled result)
    ttl_ms: int
    expired: str  # "1": entries idle past the lease too; "0": lapsed workers' only


class ReapItemArgs(NamedTuple):
    priority: str


class ReapItemKeys(NamedTuple):
    lane: str  # a lane, or a lane's affinity stream
    home: str  # where a requeued job goes: the lane


REAP = ScriptSpec("reap", ReapKeys, ReapArgs, ReapItemKeys, ReapItemArgs, libraries=("ends",))


# -- cancel ------------------------------------------------------------------------------------
class CancelKeys(NamedTuple):
    job: str
    events: str
    cancels: str
    delayed: str


class CancelArgs(NamedTuple):
    job_id: str
    now: str
    finished: bytes  # Finished(cancelled result)
    ttl_ms: int
    # followers leaving (a live caller went away): the job is cancelled only when none is left;
    # 0 cancels outright
    leaving: int


CANCEL = ScriptSpec("cancel", CancelKeys, CancelArgs, Empty, Empty, libraries=("ends",))


# -- cache_put: the response cache's Redis tier, bounded by TTL and bytes -------------------
class CachePutKeys(NamedTuple):
    entry: str
    by_expiry: str  # the model's digests scored by expiry
    sizes: str
    counters: str


class CachePutArgs(NamedTuple):
    digest: str
    value: bytes
    ttl_ms: int
    now_ms: int
    max_bytes: int
    entry_prefix: str  # evicted entries' keys are this prefix + their digest


CACHE_PUT = ScriptSpec("cache_put", CachePutKeys, CachePutArgs, Empty, Empty)


# -- lease-fenced batches: emit events, renew, release ---------------------------------------
class GroupArg(NamedTuple):
    group: str


class EmitItemKeys(NamedTuple):
    lane: str
    events: str


class EmitItemArgs(NamedTuple):
    consumer: str
    entry_id: str
    event: bytes


EMIT = ScriptSpec("emit", Empty, GroupArg, EmitItemKeys, EmitItemArgs, libraries=("events",))


class HolderArgs(NamedTuple):
    consumer: str
    entry_id: str


RENEW = ScriptSpec("renew", Empty, GroupArg, LaneKey, HolderArgs)


class ReleaseKeys(NamedTuple):
    cancels: str


class ReleaseArgs(NamedTuple):
    group: str
    now: str
    ttl_ms: int
    cancelled: bytes  # Finished(cancelled result): a cancel request ends the job instead
    max_preemptions: int  # -1: a plain release; else a preemption, refused at this bound


class ReleaseItemKeys(NamedTuple):
    lane: str
    job: str
    home: str  # the lane the job goes back to (`lane` may be its affinity stream)
    events: str


class ReleaseItemArgs(NamedTuple):
    consumer: str
    entry_id: str
    job_id: str


RELEASE = ScriptSpec(
    "release", ReleaseKeys, ReleaseArgs, ReleaseItemKeys, ReleaseItemArgs, libraries=("ends",)
)


# -- tenant quotas: one tenant's keys per call (their own hash tag) ---------------------------
class QuotaKeys(NamedTuple):
    quota: str
    held: str


class ReserveArgs(NamedTuple):
    now: str
    rpm: int
    tpm: int
    max_concurrent: int
    budget: int
    budget_period: str


class ReserveItemArgs(NamedTuple):
    job_id: str
    tokens: int


RESERVE = ScriptSpec("reserve", QuotaKeys, ReserveArgs, Empty, ReserveItemArgs)


class SettleItemArgs(NamedTuple):
    job_id: str
    actual: int
    request: int  # 1: refund the request too (the job never entered)


SETTLE = ScriptSpec("settle", QuotaKeys, Empty, Empty, SettleItemArgs)

SCRIPTS: tuple[ScriptSpec[Any, Any, Any, Any], ...] = (
    ENQUEUE,
    CLAIM,
    COMPLETE,
    FAIL,
    REAP,
    CANCEL,
    EMIT,
    RENEW,
    RELEASE,
    CACHE_PUT,
    RESERVE,
    SETTLE,
)
