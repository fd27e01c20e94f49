"""HTTP routes of the gateway, one module per API surface."""

from __future__ import annotations

from tokenyard.gateway.routes import (
    admin,
    batches,
    dashboard,
    files,
    health,
    jobs,
    messages,
    openai,
    responses,
    vllm,
)

ROUTERS = (
    openai.router,
    jobs.router,
    health.router,
    dashboard.router,
    admin.router,
    files.router,
    batches.router,
    responses.router,
    messages.router,
    vllm.router,
)
