"""LoRA adapters as models: a request naming one runs its base model with it.

The adapters live in the broker's directory (`Directory.adapters`: put there by workers given
`--lora NAME=PATH` and by the admin route), so every gateway resolves and lists the same ones;
each gateway reads them at most every `ttl_s`, and again at once when a name is not found (an
adapter just added is usable on the next request)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection

from tokenyard.broker.tables import Directory
from tokenyard.messages import AdapterRecord, JobSpec

# a name not found forces a fresh read, but at most this often (a flood of unknown models
# must not become a flood of directory reads)
_MISS_REREAD_S = 0.2


class AdapterBook:
    """The directory's adapters whose base model this gateway serves, by name."""

    def __init__(
        self,
        directory: Directory,
        served: Collection[str],
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.served = frozenset(served)
        self.ttl_s = ttl_s
        self.clock = clock
        self._known: dict[str, AdapterRecord] = {}
        self._read_at: float | None = None
        self._reading: asyncio.Future[dict[str, AdapterRecord]] | None = None

    async def all(self, *, fresh_within: float | None = None) -> dict[str, AdapterRecord]:
        """Every adapter of a served base, by name; read anew when older than `fresh_within`
        (default: the TTL)."""
        limit = self.ttl_s if fresh_within is None else fresh_within
        if self._read_at is not None and self.clock() - self._read_at < limit:
            return self._known
        if self._reading is None:  # one read however many requests need it
            self._reading = asyncio.ensure_future(self._read())
            self._reading.add_done_callback(lambda _: setattr(self, "_reading", None))
        return await asyncio.shield(self._reading)

    async def find(self, name: str) -> AdapterRecord | None:
        found = (await self.all()).get(name)
        if found is None:
            found = (await self.all(fresh_within=_MISS_REREAD_S)).get(name)
        return found

    async def _read(self) -> dict[str, AdapterRecord]:
        records = await self.directory.adapters()
        self._known = {a.name: a for a in records if a.base in self.served}
        self._read_at = self.clock()
        return self._known


def answered_model(spec: JobSpec) -> str:
    """The model an answer names: the adapter a request asked for (as vLLM answers), else the
    model's name."""
    return spec.adapter or spec.model
