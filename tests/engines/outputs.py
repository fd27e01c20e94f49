"""Reading an engine's outputs in tests: per-sequence tokens, text and finish."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenyard.engines import Engine, StepOutput
from tokenyard.engines.base import LocalEngine


class Result:
    def __init__(self) -> None:
        self.outputs: list[StepOutput] = []
        self.token_ids: list[int] = []
        self.text = ""
        self.finish: StepOutput | None = None


async def collect(engine: Engine, n: int, timeout: float = 60.0) -> dict[str, Result]:
    """Read outputs until n sequences finished."""
    results: dict[str, Result] = {}
    finished = 0
    async with asyncio.timeout(timeout):
        while finished < n:
            for out in await engine.outputs():
                r = results.setdefault(out.seq_id, Result())
                assert r.finish is None, "output after finish"
                r.outputs.append(out)
                r.token_ids += out.token_ids
                r.text += out.text
                assert out.completion_tokens >= len(r.token_ids)
                if out.finish_reason is not None:
                    r.finish = out
                    finished += 1
    return results


def record_deliveries(engine: LocalEngine[Any]) -> list[list[StepOutput]]:
    """Each step's (or pass's) outputs as the engine delivers them, in order, still delivered:
    which sequences one step ran together."""
    delivered: list[list[StepOutput]] = []
    deliver = engine._deliver

    def recorded(outputs: list[StepOutput]) -> None:
        delivered.append(outputs)
        deliver(outputs)

    engine._deliver = recorded  # type: ignore[method-assign]
    return delivered
