"""When `serve` is ready: its gateway answers and every served model has a live worker."""

from __future__ import annotations

import asyncio
import contextlib

import httpx


async def wait_ready(base_url: str, *, workers: bool, interval_s: float = 0.1) -> dict[str, int]:
    """Poll the gateway at `base_url` until its /readyz answers 200 (its /healthz where no
    worker is needed yet: autoscaling from zero); the live workers of each model it names."""
    path = "/readyz" if workers else "/healthz"
    async with httpx.AsyncClient(base_url=base_url, timeout=5.0, trust_env=False) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                reply = await client.get(path)
                if reply.status_code == 200:
                    live = reply.json().get("workers") or {}
                    return {str(model): int(n) for model, n in live.items()}
            await asyncio.sleep(interval_s)
