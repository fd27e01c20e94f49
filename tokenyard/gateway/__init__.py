"""The HTTP gateway: OpenAI-compatible endpoints and the async jobs API over the broker."""

from __future__ import annotations

from tokenyard.gateway.app import create_app
from tokenyard.gateway.settings import GatewaySettings, gateway_settings

__all__ = ["GatewaySettings", "create_app", "gateway_settings"]
