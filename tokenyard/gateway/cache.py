"""Response cache and in-flight collapsing: never compute the same deterministic answer twice.

`cache_key` is the pure key: model, model revision, tenant scope, the prompt's token ids (after
templating) and every sampling parameter. `ResponseCache` is an in-process LRU in front of the
broker's shared tier (`ResponseStore`: Redis with a TTL and a byte bound per model).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from tokenyard.broker.tables import ResponseStore
from tokenyard.messages import (
    JobResult,
    JobStatus,
    PoolingOptions,
    SamplingParams,
    decode,
    encode,
)
from tokenyard.metrics import GatewayMetrics

log = logging.getLogger(__name__)

KEY_VERSION = 4  # bump when what the key covers changes: old entries then simply miss
SHARED_SCOPE = "*"


class _KeyParts(msgspec.Struct, array_like=True, frozen=True):
    """Everything that decides a deterministic answer, in a fixed order for hashing."""

    v: int
    model: str
    revision: str
    scope: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    input_lengths: Sequence[int] | None  # an embeddings job's: where each input ends
    pooling: PoolingOptions | None  # an embeddings or scoring job's options


def deterministic(sampling: SamplingParams) -> bool:
    """Greedy decoding, or sampling with a seed: the same request gives the same answer."""
    return sampling.greedy or sampling.seed is not None


def cache_scope(tenant: str, shared: bool) -> str:
    """Whose answers a request may see: its tenant's own, or everyone's when shared."""
    return SHARED_SCOPE if shared else f"t:{tenant}"


def cache_key(
    model: str,
    revision: str,
    scope: str,
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    input_lengths: Sequence[int] | None = None,
    pooling: PoolingOptions | None = None,
) -> str:
    """The digest naming one deterministic answer; any change of an input changes it."""
    lengths = None if input_lengths is None else list(input_lengths)
    parts = _KeyParts(
        KEY_VERSION, model, revision, scope, list(prompt_token_ids), sampling, lengths, pooling
    )
    return hashlib.blake2b(encode(parts), digest_size=16).hexdigest()


def collapse_key(digest: str, stream: bool) -> str:
    """Identical requests collapse onto one job only if they read it the same way: a sync
    call's job streams no tokens, which a streaming caller would wait for."""
    return f"{digest}:{'s' if stream else 'r'}"


class LocalLRU:
    """Entries live `ttl_s`; the least recently used go first once values pass `max_bytes`."""

    def __init__(
        self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def get(self, key: str) -> bytes | None:
        found = self._entries.get(key)
        if found is None:
            return None
        if found[1] <= self.clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: str, value: bytes) -> None:
        if len(value) > self.max_bytes:
            return
        self._drop(key)
        self._entries[key] = (value, self.clock() + self.ttl_s)
        self.bytes += len(value)
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= len(old[0])

    def __len__(self) -> int:
        return len(self._entries)


class ResponseCache:
    """Two tiers: this process's LRU, then the broker's shared one, both with the same TTL."""

    def __init__(
        self,
        store: ResponseStore,
        metrics: GatewayMetrics,
        *,
        ttl_s: float,
        local_bytes: int,
        shared_bytes: int,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.shared_bytes = shared_bytes
        self.local = LocalLRU(local_bytes, ttl_s)
        self._tasks: set[asyncio.Task[None]] = set()
        self._written: set[str] = set()  # digests this process already sent to the shared tier

    async def get(self, model: str, digest: str) -> JobResult | None:
        """The cached answer, counted as a hit of its tier or a miss; a broker error is a miss."""
        value = self.local.get(digest)
        tier = "local"
        if value is None:
            tier = "shared"
            try:
                value = await self.store.cache_get(model, digest)
            except Exception:
                log.warning("response cache read failed; answering fresh", exc_info=True)
                value = None
            if value is not None:
                self.local.put(digest, value)
                self._gauge()
        if value is None:
            self.metrics.cache_misses.labels(model).inc()
            return None
        self.metrics.cache_hits.labels(model, tier).inc()
        self.metrics.cache_hit_bytes.labels(model).inc(len(value))
        return decode(value, JobResult)

    def put(self, model: str, digest: str, result: JobResult) -> None:
        """Keep a successful answer; the shared tier is written in the background, once."""
        if result.status is not JobStatus.SUCCEEDED:
            return
        stored = msgspec.structs.replace(result, worker=None, queued_s=None, decode_s=None)
        value = encode(stored)
        self.local.put(digest, value)
        self._gauge()
        if digest in self._written:
            return
        self._written.add(digest)
        if len(self._written) > 100_000:  # a guard, not a cache: forgetting costs one write
            self._written.clear()
        task = asyncio.create_task(self._share(model, digest, value))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _share(self, model: str, digest: str, value: bytes) -> None:
        try:
            await self.store.cache_put(model, digest, value, self.ttl_s, self.shared_bytes)
            self.metrics.cache_stored_bytes.labels(model).inc(len(value))
        except Exception:
            self._written.discard(digest)
            log.warning("response cache write failed", exc_info=True)

    def _gauge(self) -> None:
        self.metrics.cache_local_bytes.set(self.local.bytes)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
