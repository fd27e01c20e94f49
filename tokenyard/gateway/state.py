"""What a running gateway holds, kept on `app.state.gateway` (no module globals)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fastapi import Request

from tokenyard.broker import Backend
from tokenyard.engines.base import EngineTokenizer
from tokenyard.gateway.adapters import AdapterBook
from tokenyard.gateway.affinity import PrefixKeys
from tokenyard.gateway.auth import Authenticator
from tokenyard.gateway.cache import ResponseCache
from tokenyard.gateway.enqueue import Enqueuer
from tokenyard.gateway.events import EventHub
from tokenyard.gateway.limits import PublishedLimits
from tokenyard.gateway.live import Abandonment
from tokenyard.gateway.recorder import Recorder, Usage
from tokenyard.gateway.routing import LaneDepths, RoutingRules
from tokenyard.gateway.settings import GatewaySettings, ServedModels
from tokenyard.gateway.shedding import QueueWaits
from tokenyard.metrics import GatewayMetrics


@dataclass
class GatewayState:
    settings: GatewaySettings
    backend: Backend  # the queue core and the tables, each typed by its role
    tokenizers: Mapping[str, EngineTokenizer]
    auth: Authenticator  # API key -> tenant (bootstrap file, then the broker's directory)
    metrics: GatewayMetrics
    enqueuer: Enqueuer  # every job goes through it (group commit)
    events: EventHub  # every follow of a job's events reads through it
    limits: PublishedLimits
    abandonment: Abandonment
    cache: ResponseCache  # deterministic answers (see tokenyard/gateway/cache.py)
    routing: RoutingRules
    depths: LaneDepths  # the fast path's congestion check
    waits: QueueWaits  # estimated queue wait: deadline refusal and overload shedding
    started_at: float  # unix seconds; the `created` of /v1/models
    prefixes: PrefixKeys  # each job's prefix key (prefix affinity)
    served: ServedModels  # the models by their names on the lanes, and their other names
    adapters: AdapterBook  # LoRA adapters served as models of their own names
    usage: Usage = field(default_factory=Usage)  # per-tenant counts for the dashboard
    recorder: Recorder | None = None  # records the dashboard's points (gateway/recorder.py)

    async def close(self) -> None:
        if self.recorder is not None:
            await self.recorder.close()
        await self.enqueuer.close()
        await self.abandonment.close()
        await self.cache.close()
        await self.events.close()


def gateway(request: Request) -> GatewayState:
    """The state of the app serving `request`."""
    state: GatewayState = request.app.state.gateway
    return state
