"""What a gateway holds for batches: the file store, the batch store and its runner."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from tokenyard.broker.tables import BatchStore
from tokenyard.gateway.batches.files import DirFileStore, FileStore
from tokenyard.gateway.settings import GatewaySettings
from tokenyard.gateway.state import GatewayState

if TYPE_CHECKING:
    from tokenyard.gateway.batches.runner import BatchRunner


@dataclass
class BatchService:
    settings: GatewaySettings
    files: FileStore
    store: BatchStore
    runner: BatchRunner
    task: asyncio.Task[None] | None = None

    @classmethod
    def start(cls, state: GatewayState, files: FileStore | None = None) -> BatchService:
        """Open the stores; with `batch_runner` on, this gateway also drives batches."""
        from tokenyard.gateway.batches.runner import BatchRunner

        files = files or DirFileStore(state.settings.files_dir)
        store = state.backend.batches
        runner = BatchRunner(state, store, files)
        service = cls(state.settings, files, store, runner)
        if state.settings.batch_runner:
            service.task = asyncio.create_task(runner.run())
        return service

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.runner.close()


def batches_of(request: Request) -> BatchService:
    service: BatchService = request.app.state.batches
    return service
