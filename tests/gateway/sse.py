"""A small SSE reader for raw httpx streams."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Event:
    id: str | None
    event: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


def events(response: httpx.Response) -> Iterator[Event]:
    """Dispatched SSE events of a streaming response (comments skipped)."""
    event_id: str | None = None
    kind: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if not line:
            if data:
                yield Event(event_id, kind, "\n".join(data))
            event_id, kind, data = None, None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            event_id = value
        elif name == "event":
            kind = value
        elif name == "data":
            data.append(value)
