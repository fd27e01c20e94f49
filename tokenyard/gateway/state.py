"""What a running gateway holds, kept on `app.state.gateway` (no module globals)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import Request

from tokenyard.broker.base import Broker
from tokenyard.engines.base import EngineTokenizer
from tokenyard.gateway.auth import KeyRing
from tokenyard.gateway.dispatch import Abandonment, EventReader
from tokenyard.gateway.settings import GatewaySettings
from tokenyard.metrics import GatewayMetrics


@dataclass
class GatewayState:
    settings: GatewaySettings
    broker: Broker
    tokenizers: Mapping[str, EngineTokenizer]
    keyring: KeyRing
    metrics: GatewayMetrics
    abandonment: Abandonment
    reader: EventReader
    started_at: float  # unix seconds; the `created` of /v1/models


def gateway(request: Request) -> GatewayState:
    """The state of the app serving `request`."""
    state: GatewayState = request.app.state.gateway
    return state
