"""Across hosts: the broker, two gateways and two workers each in their own Linux network
namespace ("host"), joined by veth pairs on a bridge. Under load one worker host dies (every
process in it, SIGKILL); every request still gets its whole answer, once, token for token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tokenyard.broker.redis.embedded import find_server_binary
from tokenyard.fleet.launch import wait_ready

pytestmark = pytest.mark.slow


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root for `ip netns`"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"typrobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Hosts:
    """Namespaces on one bridge; host i has address <subnet>.<i + 2>."""

    tag: str
    subnet: str
    names: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"tyb{self.tag}"

    def add(self, role: str) -> tuple[str, str]:
        index = len(self.names)
        ns = f"ty{self.tag}-{role}"
        addr = f"{self.subnet}.{index + 2}"
        host_end, ns_end = f"ty{self.tag}h{index}", f"ty{self.tag}n{index}"
        _ip("netns", "add", ns)
        self.names.append(ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", host_end, "master", self.bridge, "up")
        _ip("link", "set", ns_end, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ns_end)
        _ip("-n", ns, "link", "set", ns_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns, addr

    def run(self, ns: str, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        with log.open("wb") as out:
            self.procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=subprocess.STDOUT, env=env
                )
            )

    def pids(self, ns: str) -> list[int]:
        listed = _ip("netns", "pids", ns, check=False).stdout.split()
        return [int(p) for p in listed]

    def kill_host(self, ns: str) -> int:
        """SIGKILL every process in the namespace: the host is gone."""
        pids = self.pids(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def teardown(self) -> None:
        for ns in self.names:
            self.kill_host(ns)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in self.names:
            _ip("netns", "del", ns, check=False)  # its veth end goes, and so its peer
        _ip("link", "del", self.bridge, check=False)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    why = _why_not()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:4]
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:], 16)}"
    made = Hosts(tag, subnet)
    try:
        _ip("link", "add", made.bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", made.bridge)
        _ip("link", "set", made.bridge, "up")
        yield made
    finally:
        made.teardown()


def test_a_worker_host_dies_under_load_and_nothing_is_lost_or_doubled(
    hosts: Hosts, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    env |= {"TOKENYARD_BROKER_LEASE_S": "2", "TOKENYARD_BROKER_PREFIX": "netns"}
    broker_ns, broker_ip = hosts.add("broker")
    data = Path(tempfile.mkdtemp(dir=tmp_path))
    hosts.run(
        broker_ns,
        [str(find_server_binary()), "--bind", broker_ip, "--port", "6379", "--dir", str(data),
         "--appendonly", "yes", "--save", "", "--protected-mode", "no"],
        tmp_path / "valkey.log", env,
    )  # fmt: skip
    env["TOKENYARD_BROKER_URL"] = f"redis://{broker_ip}:6379/0"
    py = [sys.executable, "-m", "tokenyard"]
    gateways = []
    for i in range(2):
        ns, addr = hosts.add(f"gw{i}")
        hosts.run(
            ns, [*py, "gateway", "--engine", "sim", "--host", addr, "--port", "8000"],
            tmp_path / f"gateway{i}.log", env,
        )  # fmt: skip
        gateways.append(f"http://{addr}:8000")
    workers = []
    for i in range(2):
        ns, _ = hosts.add(f"wk{i}")
        hosts.run(
            ns, [*py, "worker", "--engine", "sim", "--max-seqs", "8", "--lease-s", "2"],
            tmp_path / f"worker{i}.log", env,
        )  # fmt: skip
        workers.append(ns)
    for base in gateways:
        wait_ready(f"{base}/readyz", timeout_s=60)

    async def stream(client: httpx.AsyncClient, base: str, prompt: str) -> str:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 40,
            "stream": True,
            "temperature": 0,
        }
        text = ""
        async with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def fresh(client: httpx.AsyncClient, base: str, prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        reply = await client.post(f"{base}/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["text"])

    prompts = [f"host test {i}" for i in range(64)]

    async def load() -> tuple[list[str], list[str], int]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [
                asyncio.create_task(stream(client, gateways[i % 2], p))
                for i, p in enumerate(prompts)
            ]
            await asyncio.sleep(1.0)
            killed = hosts.kill_host(workers[0])  # mid-run: its jobs are part-streamed
            streamed = await asyncio.gather(*tasks)
            # the same prompts again, each served whole by the surviving worker: the sim's
            # tokens depend only on prompt and position, so a resumed answer must match
            again = await asyncio.gather(
                *(fresh(client, gateways[(i + 1) % 2], p) for i, p in enumerate(prompts))
            )
            return streamed, again, killed

    streamed, again, killed = asyncio.run(load())
    assert killed >= 1
    assert all(len(text) == 40 for text in streamed)  # nothing lost, no token twice
    assert streamed == again
    assert hosts.pids(workers[1]), "the surviving worker host is still up"
