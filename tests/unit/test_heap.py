"""A serving process freezes its startup heap once it is up (tokenyard.heap); library users'
processes (tests, notebooks) are left alone."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.heap import YOUNG_THRESHOLD

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio, gc, sys
    from tokenyard.broker import connect
    from tokenyard.config import BrokerSettings, WorkerSettings
    from tokenyard.engines.sim import SimEngine
    from tokenyard.gateway.app import create_app
    from tokenyard.gateway.settings import gateway_settings
    from tokenyard.worker.worker import Worker

    URL, PREFIX = sys.argv[1:]

    async def frozen_after_worker_start(freeze: bool) -> int:
        broker = connect(BrokerSettings(url=URL, prefix=PREFIX))
        worker = Worker(broker, SimEngine(), WorkerSettings(model="sim", engine="sim"),
                        freeze_heap=freeze)
        running = asyncio.create_task(worker.run())
        await asyncio.sleep(0.5)  # a sim engine on a local Valkey is up in milliseconds
        count = gc.get_freeze_count()
        young = gc.get_threshold()[0]
        worker.drain()
        await running
        gc.unfreeze()
        gc.set_threshold(700, 10, 10)
        return count, young

    async def frozen_after_gateway_start(freeze: bool) -> int:
        app = create_app(gateway_settings(models="sim", tokenizer="sim"),
                         connect(BrokerSettings(url=URL, prefix=PREFIX)), freeze_heap=freeze)
        async with app.router.lifespan_context(app):
            count = gc.get_freeze_count()
            young = gc.get_threshold()[0]
        gc.unfreeze()
        gc.set_threshold(700, 10, 10)
        return count, young

    runs = [frozen_after_worker_start, frozen_after_gateway_start]
    print(*(n for run in runs for freeze in (False, True) for n in asyncio.run(run(freeze))))
    """
)


def test_worker_and_gateway_freeze_their_heap_only_when_they_own_the_process(
    valkey: EmbeddedServer,
) -> None:
    prefix = f"heap{uuid.uuid4().hex[:6]}"
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, valkey.url, prefix],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    (
        worker_off,
        young_off,
        worker_on,
        young_on,
        gateway_off,
        gw_young_off,
        gateway_on,
        gw_young_on,
    ) = map(int, run.stdout.split())
    assert worker_off == 0 and gateway_off == 0
    # everything the process had built by then: modules, the app, the engine
    assert worker_on > 10_000 and gateway_on > 10_000
    # young collections wait for more new objects only where the process is owned
    assert young_off == gw_young_off == 700
    assert young_on == gw_young_on == YOUNG_THRESHOLD


FAULTS = textwrap.dedent(
    """
    import resource, sys, threading
    from tokenyard import heap

    if sys.argv[1] == "retain":
        assert heap.retain_freed_memory()
    faults = []

    def steps() -> None:  # an engine thread's steps: buffers taken, then freed, again and again
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(50):
            buffers = [bytearray(4 << 20) for _ in range(4)]
            del buffers
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    thread = threading.Thread(target=steps)
    thread.start()
    thread.join()
    print(faults[0])
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_retained_freed_memory_is_reused_without_page_faults() -> None:
    """With glibc's defaults a thread's freed buffers go back to the system and fault in again
    page by page when next taken; kept (`retain_freed_memory`), they are reused as they are.
    In a process of its own: the setting is process-wide."""

    def faults(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", FAULTS, mode],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    default, retained = faults("default"), faults("retain")
    # 200 buffers of 4 MiB: ~200k faults of 4 KiB pages by default, a few thousand kept
    assert default > 50_000
    assert retained < default // 10
