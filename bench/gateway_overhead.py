"""Gateway overhead: the latency a request gains going through gateway + queue + worker.

The same simulated engine (fixed costs, no per-token or per-sequence terms) is called two
ways, one request at a time (light load):

  direct  the engine API in this process: add(), then outputs() until the sequence finishes.
  queue   HTTP to a gateway *subprocess* (`python -m tokenyard gateway`: uvicorn on a free
          port), a private Valkey over TCP loopback (AOF everysec), and a worker subprocess
          running tokenyard's Worker on a SimEngine built with the same costs.

Queue requests go sync (`stream: false`) and streamed (SSE) through two clients: `sync` and
`stream` through aiohttp (one session, one keep-alive connection; the SSE lines read by hand:
TTFT at the first data event with text, E2E at `data: [DONE]`), the lean client the goals are
judged on; `sync_httpx` and `stream_httpx` through httpx, the openai SDK's transport, whose own
cost per exchange is several times aiohttp's on a small VM (secondary rows, for what SDK users
see). `floor` sends the same sync request through the same kinds of parts with no tokenyard
code (bench/latency_floor.py: a raw ASGI app under uvicorn, XADD + XREAD BLOCK on a per-request
reply key, a worker process on XREADGROUP running the same SimEngine): what this box's process
hops alone cost. Every kind, a Valkey PING and GET /v1/models on each client run in a shuffled
order per round, so drift on a shared host hits them alike. Overhead = each request's E2E minus
the median direct E2E (TTFT likewise for streams); `floor_overhead_ms` likewise for the floor,
and `sync.overhead_beyond_floor_ms` is the sync overhead minus the floor's median. The
`http_floor_ms` rows (GET /v1/models: one HTTP exchange, no queue, per client) give
`overhead_beyond_http_floor_ms`. `goals` says which kind and figure each goal is judged on
(lean sync E2E overhead and stream TTFT overhead, p50 and p99) and whether it is met.

Job records (enqueue, claim and completion times, found by the x-job-id header) split the
overhead into stages. Valkey commands are counted from INFO commandstats deltas, over the
whole measured phase and around each queue (and floor) request (so per kind), and round trips
from the server's socket reads. A burst phase then sends --burst concurrent requests (sync and
stream alternately, --burst-tokens each, httpx) and reports the gateway's CPU per request,
where per-token event reading shows. Prints one JSON document.

--what-if NAMES adds a second run with suspected costs patched out of the gateway and worker
subprocesses (see PATCHES), to price a fix before making it; the baseline is the product as
is. --profile DIR runs py-spy on both subprocesses during the measured phase.

    python -m bench.gateway_overhead [--requests 300] [--warmup 30] [--quick]
        [--burst 64] [--burst-tokens 64] [--burst-rounds 3]
        [--what-if all|NAME,...] [--profile DIR [--profile-native]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench import latency_floor
from bench.common import loadavg, proc_cpu_s
from tokenyard.bench.client import Endpoint, RequestOptions, chunk_text, send_request
from tokenyard.bench.stats import summarize
from tokenyard.bench.workload import LengthDist, RequestSpec, Workload
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines import EngineRequest
from tokenyard.engines.base import StepOutput
from tokenyard.engines.sim import SimEngine
from tokenyard.fleet.launch import Processes, free_port, tokenyard_command, wait_ready
from tokenyard.messages import FinishReason, SamplingParams

SELF_COMMAND = [sys.executable, "-m", "bench.gateway_overhead"]  # its worker and what-if gateway
MODEL = "sim"
GOAL_P50_MS = 2.0
GOAL_P99_MS = 10.0
GOAL_ROUND_TRIPS = 5.0  # Valkey round trips per request, gateway and worker together
MS = 1000.0
# Request kinds (errors counted). sync / stream: the lean client (aiohttp), on which the goals
# are judged; *_httpx: the same requests through httpx, the openai SDK's transport, whose own
# cost per exchange is several times aiohttp's on this VM; floor: the same sync request through
# the same kinds of parts with no tokenyard code (bench/latency_floor.py).
QUEUE_KINDS = ("sync", "stream", "sync_httpx", "stream_httpx")
KINDS = ("direct", *QUEUE_KINDS, "floor")
COUNTED = (*QUEUE_KINDS, "floor")  # Valkey commands counted around each request
HTTP_FLOOR = {"sync": "http", "stream": "http", "sync_httpx": "http_httpx",
              "stream_httpx": "http_httpx"}  # fmt: skip
STAGES = ("to_enqueue", "to_claim", "in_worker", "admit", "engine", "handoff", "publish",
          "to_client")  # fmt: skip
# Commands the broker clients send themselves (one round trip each here, with one job at a
# time, except where a pipeline holds several); the rest of INFO commandstats runs inside Lua
# scripts or is a periodic heartbeat. SCRIPT EXISTS and SMISMEMBER were per-step round trips
# of earlier versions; they stay listed so a regression shows. Commands run inside scripts
# count in commandstats too (claim.lua's XREAD over its lanes is one), so round_trips is the
# server's socket reads (INFO stats total_reads_processed: one per pipeline or command sent)
# where the server reports them, this list's sum otherwise.
CLIENT_COMMANDS = ("evalsha", "script|exists", "xread", "hgetall", "smembers", "smismember")
READS = "reads|processed"  # pseudo command: the server's socket reads, less the counter's own


@dataclass(frozen=True)
class Costs:
    """The simulated engine's fixed costs; both paths build their engine from these."""

    prefill_ms: float
    decode_ms: float

    def engine_options(self) -> dict[str, Any]:
        return {
            "prefill_base": self.prefill_ms / MS,
            "prefill_per_token": 0.0,
            "decode_base": self.decode_ms / MS,
            "decode_per_seq": 0.0,
        }

    def engine(self) -> SimEngine:
        return SimEngine(**self.engine_options())


@dataclass
class Timing:
    """One request: E2E and TTFT in seconds; for queue requests also the job's wall times."""

    kind: str
    e2e_s: float
    ttft_s: float | None
    ok: bool
    error: str | None = None
    job_id: str | None = None
    sent_at: float | None = None  # time.time(), comparable with the job record's stamps
    done_at: float | None = None
    stages: dict[str, float] = field(default_factory=dict)


# -- what-if patches: suspected costs, removed in the benchmark's subprocesses only ---------

PATCHES = {
    "gil_switch_interval": "the worker's engine thread wakes from each step's sleep and needs "
    "the GIL while the event loop thread publishes; Python hands it over only every 5 ms "
    "unless the holder blocks. Patched: sys.setswitchinterval(0.5 ms) in the worker",
}
WORKER_PATCHES = ("gil_switch_interval",)
GATEWAY_PATCHES: tuple[str, ...] = ()


def apply_patches(names: Sequence[str]) -> None:
    """Monkeypatch this process (a benchmark subprocess) for the what-if run."""
    if "gil_switch_interval" in names:
        sys.setswitchinterval(0.0005)


# -- the subprocesses' entry points ----------------------------------------------------------


class StampedSimEngine(SimEngine):
    """A SimEngine that notes wall times per sequence: added, finish produced (engine thread)
    and finish seen by the worker's event loop; a few dict writes per request."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stamps: dict[str, dict[str, float]] = {}

    def add(self, request: EngineRequest) -> None:
        self.stamps[request.seq_id] = {"added": time.time()}
        super().add(request)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        now = time.time()
        for out in outputs:
            if out.finish_reason is not None and out.seq_id in self.stamps:
                self.stamps[out.seq_id]["finish_made"] = now
        super()._deliver(outputs)

    async def outputs(self) -> list[StepOutput]:
        outputs = await super().outputs()
        now = time.time()
        for out in outputs:
            if out.finish_reason is not None and out.seq_id in self.stamps:
                self.stamps[out.seq_id]["finish_seen"] = now
        return outputs


def worker_main(
    url: str, prefix: str, costs: Costs, patches: Sequence[str], stamps: Path | None
) -> None:
    """A worker process on a SimEngine with the benchmark's costs; SIGTERM drains it, then
    the engine's per-sequence stamps are written to `stamps`."""
    from tokenyard.broker import connect
    from tokenyard.worker.run import run_worker
    from tokenyard.worker.worker import Worker

    apply_patches([p for p in patches if p in WORKER_PATCHES])
    engine = StampedSimEngine(**costs.engine_options())

    async def serve() -> None:
        broker = connect(BrokerSettings(url=url, prefix=prefix))
        settings = WorkerSettings(model=MODEL, engine="sim")
        await run_worker(broker, Worker(broker, engine, settings, freeze_heap=True))

    asyncio.run(serve())
    if stamps is not None:
        stamps.write_text(json.dumps(engine.stamps))


def gateway_main(url: str, prefix: str, port: int, patches: Sequence[str]) -> None:
    """What `tokenyard gateway --engine sim` runs, with the what-if patches applied first."""
    import uvicorn

    from tokenyard.gateway.app import create_app
    from tokenyard.gateway.settings import gateway_settings

    apply_patches([p for p in patches if p in GATEWAY_PATCHES])
    settings = gateway_settings(models=MODEL, port=port, tokenizer="sim")
    app = create_app(
        settings, broker_settings=BrokerSettings(url=url, prefix=prefix), freeze_heap=True
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# -- the stack -------------------------------------------------------------------------------


# -- the three kinds of request --------------------------------------------------------------


class Direct:
    """Sequential requests through the engine API in this process."""

    def __init__(self, engine: SimEngine, max_tokens: int) -> None:
        self.engine = engine
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(self, spec: RequestSpec) -> Timing:
        engine = self.engine
        seq_id = f"direct-{spec.index}-{uuid.uuid4().hex[:6]}"
        prompt = engine.tokenizer.encode(spec.prompt)
        started = time.perf_counter()
        engine.add(EngineRequest(seq_id, prompt, self.params))
        first: float | None = None
        tokens = 0
        while True:
            outputs = await engine.outputs()
            now = time.perf_counter()
            for out in outputs:
                if out.seq_id != seq_id:
                    continue
                if out.token_ids and first is None:
                    first = now
                tokens += len(out.token_ids)
                if out.finish_reason is not None:
                    ok = out.finish_reason is FinishReason.LENGTH and tokens == spec.max_tokens
                    return Timing("direct", now - started, _minus(first, started), ok)


def _minus(a: float | None, b: float) -> float | None:
    return None if a is None else a - b


def completion_body(spec: RequestSpec) -> dict[str, Any]:
    """The sync request every client sends (streams add `stream` and usage)."""
    return {
        "model": MODEL,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


class Lean:
    """Sequential requests through aiohttp, one session on one keep-alive connection: the lean
    client the goals are judged on (its own cost per exchange is a fraction of httpx's here)."""

    def __init__(self, base_url: str) -> None:
        self.connections = 0  # opened: 1 for the run when keep-alive holds
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(self._opened)
        self.session = aiohttp.ClientSession(
            base_url=base_url,
            connector=aiohttp.TCPConnector(limit=1),
            timeout=aiohttp.ClientTimeout(total=30.0),
            trace_configs=[trace],
        )

    async def _opened(self, *_: object) -> None:
        self.connections += 1

    async def sync(self, spec: RequestSpec, kind: str = "sync") -> Timing:
        sent = time.time()
        try:
            async with self.session.post("/v1/completions", json=completion_body(spec)) as resp:
                data = await resp.read()
                done = time.time()
                ok, job_id = resp.status == 200, resp.headers.get("x-job-id")
                error = None if ok else str(resp.status)
            if ok and json.loads(data)["usage"]["completion_tokens"] != spec.max_tokens:
                ok, error = False, "short_output"
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            done, ok, error, job_id = time.time(), False, type(exc).__name__, None
        return Timing(kind, done - sent, None, ok, error, job_id, sent, done)

    async def stream(self, spec: RequestSpec) -> Timing:
        """SSE read line by line: TTFT at the first event with text, E2E at `data: [DONE]`."""
        body = {**completion_body(spec), "stream": True, "stream_options": {"include_usage": True}}
        sent = time.time()
        first: float | None = None
        done: float | None = None
        job_id, error, chunks, tokens = None, None, 0, None
        try:
            async with self.session.post("/v1/completions", json=body) as resp:
                job_id = resp.headers.get("x-job-id")
                if resp.status != 200:
                    error = str(resp.status)
                # read to the body's end (past [DONE]) so the connection is kept for the next
                async for line in resp.content:
                    if error is not None or not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = time.time()
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = "stream_error"
                    elif chunk_text(chunk):
                        first = time.time() if first is None else first
                        chunks += 1
                    usage = chunk.get("usage")
                    if isinstance(usage, dict):
                        tokens = usage.get("completion_tokens")
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            error = type(exc).__name__
        if error is None and done is None:
            error = "incomplete_stream"
        if error is None and (chunks if tokens is None else tokens) != spec.max_tokens:
            error = "short_output"
        end = time.time() if done is None else done
        ttft = None if first is None else first - sent
        return Timing("stream", end - sent, ttft, error is None, error, job_id, sent, end)

    async def http(self, spec: RequestSpec) -> Timing:
        """GET /v1/models: one HTTP exchange with the gateway and no queue."""
        started = time.perf_counter()
        async with self.session.get("/v1/models") as resp:
            await resp.read()
            ok = resp.status == 200
        return Timing("http", time.perf_counter() - started, None, ok)

    async def floor(self, spec: RequestSpec) -> Timing:
        """The sync request to the latency floor's server (its base URL)."""
        return await self.sync(spec, "floor")

    async def close(self) -> None:
        await self.session.close()


class Queue:
    """Sequential requests through httpx (the openai SDK's transport): sync JSON, and SSE
    through tokenyard.bench's client; the secondary *_httpx rows."""

    def __init__(self, client: httpx.AsyncClient, job_ids: list[str]) -> None:
        self.client = client
        self.job_ids = job_ids  # filled by the client's response hook, so streams have theirs too
        self.options = RequestOptions(
            endpoint=Endpoint.completions,
            model=MODEL,
            ignore_eos=True,
            temperature=0.0,
        )

    async def sync(self, spec: RequestSpec) -> Timing:
        sent = time.time()
        try:
            response = await self.client.post("completions", json=completion_body(spec))
            done = time.time()
            ok = response.status_code == 200
            error = None if ok else str(response.status_code)
            if ok and response.json()["usage"]["completion_tokens"] != spec.max_tokens:
                ok, error = False, "short_output"
            job_id = response.headers.get("x-job-id")
        except httpx.HTTPError as exc:
            done, ok, error, job_id = time.time(), False, type(exc).__name__, None
        return Timing("sync_httpx", done - sent, None, ok, error, job_id, sent, done)

    async def stream_one(self, spec: RequestSpec) -> Timing:
        """A stream among concurrent ones (its job id unknown)."""
        result = await send_request(self.client, spec, self.options, clock=time.time)
        ok = result.ok and result.output_tokens == spec.max_tokens
        error = result.error or (None if ok else "short_output")
        return Timing(
            "stream_httpx", result.e2e_s, result.ttft_s, ok, error, None, result.send_s,
            result.end_s,
        )  # fmt: skip

    async def stream(self, spec: RequestSpec) -> Timing:
        """One stream at a time, so the response hook's last job id is its."""
        self.job_ids.clear()
        timing = await self.stream_one(spec)
        timing.job_id = self.job_ids[-1] if self.job_ids else None
        return timing


class HttpFloor:
    """GET /v1/models on the httpx client and connection: one HTTP exchange with this gateway
    (server, middlewares, auth, JSON) and no queue, the floor under any queued request."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def one(self, spec: RequestSpec) -> Timing:
        started = time.perf_counter()
        response = await self.client.get("models")
        ok = response.status_code == 200
        return Timing("http_httpx", time.perf_counter() - started, None, ok)


class Ping:
    """A Valkey PING from this process: the cost of one round trip (two wake-ups) right now."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.redis = aioredis.Redis.from_url(url)

    async def one(self, spec: RequestSpec) -> Timing:
        started = time.perf_counter()
        await self.redis.ping()
        return Timing("ping", time.perf_counter() - started, None, True)


class CommandCounter:
    """INFO commandstats as {command: calls} (and the server's socket reads), over one
    connection of its own."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.calls = 0

    def __call__(self) -> dict[str, int]:
        stats: dict[str, Any] = self.client.info("commandstats", "stats")
        self.calls += 1  # each INFO is one socket read, counted by the stats it returns
        counts = {
            key.removeprefix("cmdstat_"): int(row["calls"])
            for key, row in stats.items()
            if key.startswith("cmdstat_")
        }
        if "total_reads_processed" in stats:
            counts[READS] = int(stats["total_reads_processed"]) - self.calls
        return counts

    def close(self) -> None:
        self.client.close()


def add_deltas(total: dict[str, int], before: dict[str, int], after: dict[str, int]) -> None:
    for name, n in after.items():
        if n > before.get(name, 0):
            total[name] = total.get(name, 0) + n - before.get(name, 0)


def per_request(before: dict[str, int], after: dict[str, int], requests: int) -> dict[str, Any]:
    """Valkey commands per queue request during the measured phase (PINGs and INFO excluded)."""
    calls = {
        name: round((n - before.get(name, 0)) / requests, 2)
        for name, n in sorted(after.items(), key=lambda kv: -kv[1] + before.get(kv[0], 0))
        if name not in ("ping", "info") and n > before.get(name, 0)
    }
    reads = calls.pop(READS, None)
    return {
        "round_trips": reads
        if reads is not None
        else round(sum(calls.get(c, 0.0) for c in CLIENT_COMMANDS), 2),
        "client_commands": {c: calls.get(c, 0.0) for c in CLIENT_COMMANDS},
        "commands": round(sum(calls.values()), 2),  # every command, scripts' included
        "all_commands": calls,
    }


async def attach_stages(
    timings: Sequence[Timing], url: str, prefix: str, engine_stamps: dict[str, dict[str, float]]
) -> None:
    """Split each queue request's time by its job record's enqueue / claim / completion stamps
    and the worker engine's own (all wall clock, one host)."""
    from tokenyard.broker import connect

    broker = connect(BrokerSettings(url=url, prefix=prefix))
    try:
        for t in timings:
            if t.job_id is None or t.sent_at is None or t.done_at is None:
                continue
            record = await broker.queue.record(t.job_id)
            if record is None or record.started_at is None or record.finished_at is None:
                continue
            # enq_at is taken by the gateway before its enqueue script runs; start_at by the
            # worker before its claim script; end_at before its complete script
            t.stages = {
                "to_enqueue": record.enqueued_at - t.sent_at,
                "to_claim": record.started_at - record.enqueued_at,
                "in_worker": record.finished_at - record.started_at,
                "to_client": t.done_at - record.finished_at,
            }
            e = engine_stamps.get(t.job_id, {})
            if {"added", "finish_made", "finish_seen"} <= set(e):
                t.stages.update(
                    admit=e["added"] - record.started_at,
                    engine=e["finish_made"] - e["added"],
                    handoff=e["finish_seen"] - e["finish_made"],
                    publish=record.finished_at - e["finish_seen"],
                )
    finally:
        await broker.close()


# -- profiling -------------------------------------------------------------------------------


def start_profilers(
    procs: Processes, out: Path, seconds: float, native: bool
) -> list[subprocess.Popen[bytes]]:
    """py-spy record (if installed) on the gateway and the worker for the measured phase;
    folded stacks in DIR/{gateway,worker}.txt (samples of threads on CPU only)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("--profile: py-spy not found (pip install py-spy); skipping", file=sys.stderr)
        return []
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name in ("gateway", "worker"):
        cmd = [
            py_spy, "record", "--pid", str(procs.procs[name].pid), "--rate", "500",
            "--duration", str(int(seconds) + 1), "--format", "raw",
            # native unwinding must pause the process; Python-only sampling need not
            *(["--native"] if native else ["--nonblocking"]),
            "--output", str(out / f"{name}.txt"),
        ]  # fmt: skip
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return spies


# -- the run ---------------------------------------------------------------------------------


def ms_summary(values: Sequence[float]) -> dict[str, Any]:
    return summarize(values, (50.0, 90.0, 99.0)).as_dict(MS)


async def measure(
    opts: argparse.Namespace,
    url: str,
    port: int,
    floor_port: int,
    procs: Processes,
    server_pid: int | None,
) -> tuple[dict[str, list[Timing]], dict[str, Any]]:
    """Warm-up rounds, then measured rounds; returns every kind's timings and Valkey calls."""
    costs = Costs(opts.prefill_ms, opts.decode_ms)
    workload = Workload(
        LengthDist(opts.prompt_words, opts.prompt_words),
        LengthDist(opts.max_tokens, opts.max_tokens),
    )
    specs = workload.requests(opts.seed)
    rng = random.Random(opts.seed)
    engine = costs.engine()
    await engine.start()
    job_ids: list[str] = []

    async def remember(response: httpx.Response) -> None:
        job_ids.append(response.headers.get("x-job-id", ""))

    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}/v1",
        timeout=30.0,
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        event_hooks={"response": [remember]},
    )
    direct, queue, ping = Direct(engine, opts.max_tokens), Queue(client, job_ids), Ping(url)
    lean = Lean(f"http://127.0.0.1:{port}")
    floor = Lean(f"http://127.0.0.1:{floor_port}")
    runners = {
        "direct": direct.one,
        "sync": lean.sync,
        "stream": lean.stream,
        "sync_httpx": queue.sync,
        "stream_httpx": queue.stream,
        "floor": floor.floor,
        "ping": ping.one,
        "http": lean.http,
        "http_httpx": HttpFloor(client).one,
    }
    timings: dict[str, list[Timing]] = {k: [] for k in runners}
    counts: dict[str, int] = {}
    command_counts = CommandCounter(url)
    by_kind: dict[str, dict[str, int]] = {kind: {} for kind in COUNTED}
    pids = {"gateway": procs.procs["gateway"].pid, "worker": procs.procs["worker"].pid,
            "valkey": server_pid}  # fmt: skip
    cpu: dict[str, float] = {}
    profilers: list[subprocess.Popen[bytes]] = []
    try:
        for phase, rounds in (("warmup", opts.warmup), ("measure", opts.requests)):
            if phase == "measure":
                counts = command_counts()
                cpu = {name: proc_cpu_s(pid) for name, pid in pids.items()}
                if opts.profile is not None:
                    profilers = start_profilers(
                        procs, opts.profile, opts.profile_s, opts.profile_native
                    )
            for _ in range(rounds):
                spec = next(specs)
                order = list(runners)
                rng.shuffle(order)  # no kind always follows another's tail work
                for kind in order:
                    counted = phase == "measure" and kind in by_kind
                    before = command_counts() if counted else {}
                    t = await runners[kind](spec)
                    if counted:
                        # the worker finishes its job before the client hears the end
                        add_deltas(by_kind[kind], before, command_counts())
                    if phase == "measure":
                        timings[kind].append(t)
        # the product's requests only: the floor's commands (counted around each) come off
        after = command_counts()
        for name, n in by_kind["floor"].items():
            after[name] = after.get(name, 0) - n
        queued = len(QUEUE_KINDS) * opts.requests
        commands = per_request(counts, after, queued)
        commands["by_kind"] = {
            kind: per_request({}, calls, opts.requests) for kind, calls in by_kind.items()
        }
        for kind in ("stream", "stream_httpx"):
            stream = commands["by_kind"][kind]
            stream["commands_per_token"] = round(stream["commands"] / opts.max_tokens, 2)
        # whole process CPU over the measured phase, per queue request (the worker's includes
        # its engine thread, a few sleeps; Valkey's includes this process's PINGs and the
        # floor's requests)
        commands["cpu_ms"] = {
            name: round((proc_cpu_s(pid) - cpu[name]) * MS / queued, 3)
            for name, pid in pids.items()
        }
        commands["aiohttp_connections_opened"] = {
            "gateway": lean.connections,
            "floor": floor.connections,
        }
        for spy in profilers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(opts.profile_s + 30)
    finally:
        command_counts.close()
        await client.aclose()
        await lean.close()
        await floor.close()
        await ping.redis.aclose()
        await engine.stop()
    return timings, commands


async def burst(
    opts: argparse.Namespace, url: str, port: int, procs: Processes, server_pid: int | None
) -> dict[str, Any]:
    """Rounds of `--burst` concurrent requests (sync and stream alternately): the gateway's CPU
    per request under concurrency, and Valkey commands per request."""
    concurrency, tokens = opts.burst, opts.burst_tokens
    workload = Workload(
        LengthDist(opts.prompt_words, opts.prompt_words), LengthDist(tokens, tokens)
    )
    specs = workload.requests(opts.seed + 1)
    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}/v1",
        timeout=120.0,
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
    )
    queue = Queue(client, [])
    pids = {"gateway": procs.procs["gateway"].pid, "worker": procs.procs["worker"].pid,
            "valkey": server_pid}  # fmt: skip
    command_counts = CommandCounter(url)
    try:
        await asyncio.gather(*(queue.sync(next(specs)) for _ in range(concurrency)))  # warm
        before, cpu = command_counts(), {n: proc_cpu_s(p) for n, p in pids.items()}
        started = time.perf_counter()
        results: list[Timing] = []
        for _ in range(opts.burst_rounds):
            round_specs = [next(specs) for _ in range(concurrency)]
            results += await asyncio.gather(
                *(
                    (queue.sync if i % 2 == 0 else queue.stream_one)(spec)
                    for i, spec in enumerate(round_specs)
                )
            )
        wall = time.perf_counter() - started
        n = len(results)
        calls = per_request(before, command_counts(), n)
        cpu_ms = {
            name: round((proc_cpu_s(pid) - cpu[name]) * MS / n, 3) for name, pid in pids.items()
        }
    finally:
        command_counts.close()
        await client.aclose()
    return {
        "concurrency": concurrency,
        "max_tokens": tokens,
        "requests": n,
        "errors": sum(1 for t in results if not t.ok),
        "wall_s": round(wall, 3),
        "cpu_ms_per_request": cpu_ms,
        "valkey_per_request": calls,
        "e2e_ms": ms_summary([t.e2e_s for t in results if t.ok]),
    }


def queue_cell(
    kind: str,
    timings: dict[str, list[Timing]],
    ok: dict[str, list[Timing]],
    direct_e2e: float,
    direct_ttft: float,
    rtt: float,
) -> dict[str, Any]:
    """One queue kind's E2E, overhead (whole, paired, beyond its client's HTTP floor), stages."""
    rows = ok[kind]
    overhead = [t.e2e_s - direct_e2e for t in rows]
    # The direct request of the same round: same moment, so less drift, more jitter.
    paired = [
        q.e2e_s - d.e2e_s
        for q, d in zip(timings[kind], timings["direct"], strict=True)
        if q.ok and d.ok
    ]
    http_floor = statistics.median(t.e2e_s for t in ok[HTTP_FLOOR[kind]])
    cell: dict[str, Any] = {
        "client": "aiohttp" if kind in ("sync", "stream") else "httpx (the openai SDK's)",
        "e2e_ms": ms_summary([t.e2e_s for t in rows]),
        "overhead_ms": ms_summary(overhead),
        "paired_overhead_ms": ms_summary(paired),
        # what the queue adds beyond one HTTP exchange with the same client and gateway
        "overhead_beyond_http_floor_ms": ms_summary([v - http_floor for v in overhead]),
    }
    if kind.startswith("stream"):
        ttft = [t.ttft_s for t in rows if t.ttft_s is not None]
        cell["ttft_ms"] = ms_summary(ttft)
        cell["ttft_overhead_ms"] = ms_summary([v - direct_ttft for v in ttft])
    staged = [t for t in rows if t.stages]
    stages: dict[str, Any] = {
        name: ms_summary([t.stages[name] for t in staged if name in t.stages]) for name in STAGES
    }
    # the worker's share beyond the engine's own time (taken as the direct median)
    stages["in_worker_minus_engine"] = ms_summary(
        [t.stages["in_worker"] - direct_e2e for t in staged]
    )
    cell["stages_ms"] = stages
    # host-independent-ish: how many Valkey round trips' worth of time the path adds
    cell["overhead_in_ping_rtts_p50"] = (
        round(statistics.median(overhead) / rtt, 1) if overhead else None
    )
    return cell


def judge(out: dict[str, Any]) -> dict[str, Any]:
    """The issue's latency goals, judged on the lean client's sync E2E and stream TTFT overhead."""
    checks: dict[str, Any] = {}
    for kind, figure in (("sync", "overhead_ms"), ("stream", "ttft_overhead_ms")):
        for q, goal in (("p50", GOAL_P50_MS), ("p99", GOAL_P99_MS)):
            value = out[kind][figure][q]
            checks[f"{kind}.{figure}.{q}"] = {
                "kind": kind,
                "figure": f"{figure}.{q}",
                "value_ms": value,
                "goal_ms": goal,
                "met": value is not None and value <= goal,
            }
    return {
        "judged_on": "the lean client (aiohttp, one keep-alive connection): sync E2E overhead "
        "and stream TTFT overhead; the *_httpx rows (the openai SDK's client) are not judged",
        "checks": checks,
        "met": all(c["met"] for c in checks.values()),
    }


def report(timings: dict[str, list[Timing]]) -> dict[str, Any]:
    ok = {k: [t for t in ts if t.ok] for k, ts in timings.items()}
    errors = {k: sum(1 for t in ts if not t.ok) for k, ts in timings.items() if k in KINDS}
    rtt = statistics.median(t.e2e_s for t in ok["ping"])
    direct_e2e = statistics.median(t.e2e_s for t in ok["direct"])
    direct_ttft = statistics.median(t.ttft_s for t in ok["direct"] if t.ttft_s is not None)
    out: dict[str, Any] = {
        "direct": {
            "e2e_ms": ms_summary([t.e2e_s for t in ok["direct"]]),
            "ttft_ms": ms_summary([t.ttft_s for t in ok["direct"] if t.ttft_s is not None]),
        }
    }
    out["valkey_ping_rtt_ms"] = ms_summary([t.e2e_s for t in ok["ping"]])
    out["http_floor_ms"] = ms_summary([t.e2e_s for t in ok["http"]])
    out["http_floor_httpx_ms"] = ms_summary([t.e2e_s for t in ok["http_httpx"]])
    floor_overhead = [t.e2e_s - direct_e2e for t in ok["floor"]]
    out["floor"] = {
        "e2e_ms": ms_summary([t.e2e_s for t in ok["floor"]]),
        "paired_overhead_ms": ms_summary(
            [
                f.e2e_s - d.e2e_s
                for f, d in zip(timings["floor"], timings["direct"], strict=True)
                if f.ok and d.ok
            ]
        ),
    }
    out["floor_overhead_ms"] = ms_summary(floor_overhead)
    for kind in QUEUE_KINDS:
        out[kind] = queue_cell(kind, timings, ok, direct_e2e, direct_ttft, rtt)
    if floor_overhead:
        # what tokenyard adds beyond the same hops with no tokenyard code
        floor_p50 = statistics.median(floor_overhead)
        out["sync"]["overhead_beyond_floor_ms"] = ms_summary(
            [t.e2e_s - direct_e2e - floor_p50 for t in ok["sync"]]
        )
    else:
        out["sync"]["overhead_beyond_floor_ms"] = ms_summary([])
    out["errors"] = errors
    out["goal_ms"] = {"p50": GOAL_P50_MS, "p99": GOAL_P99_MS}
    out["goals"] = judge(out)
    return out


async def run_stack(
    opts: argparse.Namespace, url: str, server_pid: int | None, tmp: Path, patches: Sequence[str]
) -> dict[str, Any]:
    """One gateway + worker pair and the latency floor's server + worker on the shared Valkey
    (own key prefix), measured, stopped."""
    prefix = f"go{uuid.uuid4().hex[:8]}"
    port = free_port()
    common = ["--broker", url, "--prefix", prefix]
    costs = ["--prefill-ms", str(opts.prefill_ms), "--decode-ms", str(opts.decode_ms)]
    patched = ["--patches", ",".join(patches)] if patches else []
    gateway = (
        [*SELF_COMMAND, "--run-gateway", "--port", str(port), *common, *patched]
        if patches
        # the product's own entry point for the baseline
        else tokenyard_command("gateway", *common, "--model", MODEL, "--engine", "sim",
                               "--port", str(port))
    )  # fmt: skip
    log_dir = tmp / ("what-if" if patches else "baseline")
    procs = Processes(log_dir)
    stamps = log_dir / "engine-stamps.json"
    floor_port, floor_key = free_port(), f"{prefix}:floor"
    try:
        procs.start("worker", [*SELF_COMMAND, "--run-worker", *common, *costs, *patched,
                               "--stamps", str(stamps)])  # fmt: skip
        procs.start("gateway", gateway)
        engine_options = Costs(opts.prefill_ms, opts.decode_ms).engine_options()
        worker = latency_floor.worker_command(url, floor_key, engine_options)
        await latency_floor.start_floor(procs, url, floor_key, floor_port, worker)
        await asyncio.to_thread(wait_ready, f"http://127.0.0.1:{port}/readyz", procs)
        timings, commands = await measure(opts, url, port, floor_port, procs, server_pid)
        bursts = None
        if opts.burst and not patches:  # the what-if run prices latency only
            bursts = await burst(opts, url, port, procs, server_pid)
    finally:
        procs.stop()  # the worker writes its engine stamps as it exits
    engine_stamps = json.loads(stamps.read_text()) if stamps.exists() else {}
    queued = [t for kind in QUEUE_KINDS for t in timings[kind]]
    await attach_stages(queued, url, prefix, engine_stamps)
    trips = {k: commands["by_kind"][k]["round_trips"] for k in ("sync", "stream")}
    return {
        **report(timings),
        # 1 each where keep-alive held for the whole run (warm-up included)
        "aiohttp_connections_opened": commands.pop("aiohttp_connections_opened"),
        "valkey_per_queue_request": commands,
        "round_trip_goal": {
            "goal": GOAL_ROUND_TRIPS,
            **trips,
            "met": all(v <= GOAL_ROUND_TRIPS for v in trips.values()),
        },
        "burst": bursts,
    }


def what_if_summary(result: dict[str, Any], patches: Sequence[str]) -> dict[str, Any]:
    """The what-if run's headline numbers."""
    out: dict[str, Any] = {"patches": {p: PATCHES[p] for p in patches}}
    for kind in ("sync", "stream"):
        cell = result[kind]
        out[kind] = {
            "e2e_ms": cell["e2e_ms"],
            "overhead_ms": cell["overhead_ms"],
            "stages_ms": {
                k: {"p50": v["p50"], "p99": v["p99"]} for k, v in cell["stages_ms"].items()
            },
        }
    out["stream"]["ttft_overhead_ms"] = result["stream"]["ttft_overhead_ms"]
    out["direct_e2e_ms"] = result["direct"]["e2e_ms"]
    out["valkey_ping_rtt_ms"] = result["valkey_ping_rtt_ms"]
    out["http_floor_ms"] = result["http_floor_ms"]
    out["floor_overhead_ms"] = result["floor_overhead_ms"]
    out["valkey_per_queue_request"] = result["valkey_per_queue_request"]
    out["errors"] = result["errors"]
    out["goals"] = result["goals"]
    return out


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    from tokenyard.broker.redis.embedded import EmbeddedServer

    started = time.perf_counter()
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="ty-go-") as tmp, EmbeddedServer() as server:
        results = await run_stack(opts, server.url, server.pid, Path(tmp), ())
        what_if = None
        if opts.what_if:
            what_if = what_if_summary(
                await run_stack(opts, server.url, server.pid, Path(tmp), opts.what_if),
                opts.what_if,
            )
    return {
        "benchmark": "gateway_overhead",
        "config": {
            "requests_per_kind": opts.requests,
            "warmup_rounds": opts.warmup,
            "max_tokens": opts.max_tokens,
            "prompt_words": opts.prompt_words,
            "engine": f"SimEngine prefill {opts.prefill_ms} ms + decode step {opts.decode_ms} ms "
            "(no per-token or per-sequence cost), greedy, ignore_eos",
            "direct": "engine API in this process, one request at a time",
            "queue": "gateway subprocess (python -m tokenyard gateway: uvicorn, real HTTP on "
            "127.0.0.1) + private Valkey over TCP (AOF everysec) + worker subprocess "
            "(tokenyard Worker on a SimEngine with the same costs)",
            "client": "sync, stream, http: aiohttp in this process (one ClientSession, one "
            "keep-alive connection), SSE lines read from the response (TTFT: first data event "
            "with text; E2E: data: [DONE]); the goals are judged on these. sync_httpx, "
            "stream_httpx, http_httpx: httpx.AsyncClient (the openai SDK's transport), one "
            "keep-alive connection, streams via tokenyard.bench.client.send_request",
            "floor": "the sync request through the same kinds of parts and no tokenyard code "
            "(bench/latency_floor.py): a raw ASGI app under uvicorn as the gateway runs it, one "
            "pipeline of XADD + XREAD BLOCK on a per-request reply key, and a worker process "
            "(XREADGROUP BLOCK, the same SimEngine and costs through the engine API, one pipeline "
            "of XADD reply + PEXPIRE + XACK + XDEL), on the same Valkey; floor_overhead_ms = "
            "floor E2E - direct median; sync.overhead_beyond_floor_ms = sync overhead - the "
            "floor's median overhead",
            "order": "rounds of (direct, sync, stream, sync_httpx, stream_httpx, floor, Valkey "
            "PING, GET /v1/models on each client) in a seeded shuffled order",
            "burst": f"{opts.burst_rounds} rounds of {opts.burst} concurrent requests (sync and "
            f"stream alternately) of {opts.burst_tokens} tokens, after the light-load phase",
            "valkey_commands": "INFO commandstats deltas; by_kind: around each queue (and floor) "
            "request (light load: one request in flight, so the worker's commands for it are "
            "included); the whole phase's per request: the product's requests, floor's taken off",
            "overhead": "queue E2E (or TTFT) minus the median direct E2E (or TTFT); paired: "
            "minus the direct request of the same round",
            "stages": "wall-clock stamps on one host. Job record: to_enqueue = gateway enqueue "
            "stamp - client send; to_claim = worker claim stamp - enqueue stamp; in_worker = "
            "completion stamp - claim stamp (in_worker_minus_engine subtracts the direct "
            "median); to_client = client done - completion stamp. in_worker splits by the worker "
            "engine's stamps: admit = engine.add - claim stamp; engine = add -> finishing "
            "output made (engine thread); handoff = that output seen by the worker's loop; "
            "publish = seen -> completion stamp (last append, cancel check)",
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        },
        **results,
        "what_if": what_if,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, help="measured requests per kind (default 300)")
    p.add_argument("--warmup", type=int, help="unmeasured rounds first (default 30)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--prefill-ms", type=float, default=1.0)
    p.add_argument("--decode-ms", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst", type=int, help="concurrent requests in the burst phase (64; 0: none)")
    p.add_argument("--burst-tokens", type=int, help="max_tokens of each burst request (64)")
    p.add_argument("--burst-rounds", type=int, help="bursts measured (3)")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 20 requests, 5 warmup, 1 burst of 16x16"
    )
    p.add_argument(
        "--what-if",
        default="none",
        help="after the baseline, rerun with these costs patched out of the subprocesses: "
        f"none, all, or a comma list of {', '.join(PATCHES)}",
    )
    p.add_argument("--profile", type=Path, help="py-spy the gateway and worker into DIR")
    p.add_argument("--profile-s", type=float, default=20.0, help="seconds py-spy records")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (C frames)")
    # the worker subprocess's own entry point
    p.add_argument("--run-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-gateway", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--patches", default="", help=argparse.SUPPRESS)
    p.add_argument("--stamps", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--broker", help=argparse.SUPPRESS)
    p.add_argument("--prefix", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.requests is None:
        a.requests = 20 if a.quick else 300
    if a.warmup is None:
        a.warmup = 5 if a.quick else 30
    if a.burst is None:
        a.burst = 16 if a.quick else 64
    if a.burst_tokens is None:
        a.burst_tokens = 16 if a.quick else 64
    if a.burst_rounds is None:
        a.burst_rounds = 1 if a.quick else 3
    if a.requests < 1 or a.max_tokens < 1:
        p.error("--requests and --max-tokens must be at least 1")
    names = {"all": ",".join(PATCHES), "none": ""}.get(a.what_if, a.what_if)
    a.what_if = tuple(n for n in names.split(",") if n)
    a.patches = tuple(n for n in a.patches.split(",") if n)
    for name in (*a.what_if, *a.patches):
        if name not in PATCHES:
            p.error(f"unknown patch {name!r}; known: {', '.join(PATCHES)}")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.run_worker:
        costs = Costs(opts.prefill_ms, opts.decode_ms)
        worker_main(opts.broker, opts.prefix, costs, opts.patches, opts.stamps)
        return 0
    if opts.run_gateway:
        gateway_main(opts.broker, opts.prefix, opts.port, opts.patches)
        return 0
    result = asyncio.run(run(opts))
    print(json.dumps(result, indent=2))
    failed = any(result["errors"].values()) or bool(result["burst"] and result["burst"]["errors"])
    failed = failed or (result["what_if"] is not None and any(result["what_if"]["errors"].values()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
