"""`tokenyard submit`: stream one completion from a gateway to the terminal."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx


async def stream_completion(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    chat: bool,
    api_key: str | None,
    emit: Callable[..., None],
) -> int:
    """Print text as it arrives; return a process exit code."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=None, headers=headers) as client,
        client.stream("POST", path, json=body) as response,
    ):
        if response.status_code != 200:
            payload = json.loads(await response.aread() or b"{}")
            message = payload.get("error", {}).get("message", response.reason_phrase)
            emit(f"[red]error {response.status_code}[/]: {message}")
            return 1
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content") if chat else choice.get("text")
                if text:
                    emit(text, end="", markup=False, highlight=False)
    emit("")
    return 0
